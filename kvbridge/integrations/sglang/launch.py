"""Run SGLang's server in this process with kvbridge registered as a backend.

``serve(argv)`` is what ``kvbridge sglang -- <args>`` runs: ``install()``, then
what ``sglang serve <args>`` runs (``sglang.cli.serve.serve``: plugin loading,
LLM/diffusion dispatch, ``--help``, killing the process tree on exit). The
processes SGLang spawns register the backend again through its plugin loader
(``patches.py``); ``SGLANG_PLUGINS``, when set, gets ``kvbridge`` added so that
the loader does not skip it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from kvbridge.integrations.sglang.patches import BACKEND, install

PLUGINS_ENV = "SGLANG_PLUGINS"


def serve(argv: Sequence[str]) -> int:
    install()
    allowed = os.environ.get(PLUGINS_ENV, "")
    if allowed and BACKEND not in {name.strip() for name in allowed.split(",")}:
        os.environ[PLUGINS_ENV] = f"{allowed},{BACKEND}"
    from sglang.cli.serve import serve as sglang_serve

    sglang_serve(None, list(argv))
    return 0
