"""SGLang's HTTP app, for its tokenizer worker processes (``--tokenizer-worker-num > 1``).

With more than one tokenizer worker, SGLang's HTTP server (uvicorn or Granian) starts
worker processes that import the app named by ``SGLANG_HTTP_SERVER_APP_PATH``
(default ``sglang.srt.entrypoints.http_server:app``). Those processes never run SGLang's
plugin loader, yet each builds a ``TokenizerWorker``, which calls
``TransferBackend(--disaggregation-transfer-backend)``: without kvbridge's member that
raises. ``install()`` (``patches.py``) therefore points ``SGLANG_HTTP_SERVER_APP_PATH``
at this module's ``app``: a worker that imports it registers the backend, then gets
SGLang's own app. The registration runs when the server asks for ``app``, not when this
module is imported.
"""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from kvbridge.integrations.sglang.patches import SGLANG_APP_PATH, install

    install()
    module, attr = SGLANG_APP_PATH.split(":")
    return getattr(importlib.import_module(module), attr)
