"""kvbridge as SGLang's PD transfer backend (SGLang 0.5.23).

    kvbridge sglang -- --model-path ... --disaggregation-mode prefill \\
        --disaggregation-transfer-backend kvbridge ...

``install()`` registers the backend ``kvbridge`` in this process (the patches
and the checks of SGLang's interface are in ``patches.py``, the one place that
patches SGLang); SGLang's plugin loader calls ``plugin()`` in each process it
starts. Then:

    version.py           the installed SGLang's version, the supported ones
    kvargs.py            SGLang's KVArgs -> kvbridge pools, RawBuffers, aux regions
    state_kinds.py       KVArgs' state components and V4's compressed KV -> kvbridge pool kinds (refused by
                         the kind the rooms do not carry: kvbridge.ROOM_POOL_KINDS)
    cp_modes.py          SGLang's CP modes -> owner-lane rules
    settings.py          what the backend reads from SGLang and KVBRIDGE_* (once), and refuses
    contract.py          the runtime contract of a rank, from its pools
    logs.py              kvbridge's records through SGLang's log handlers (level, process)
    metrics.py           refusals and failures by reason (prometheus counters on SGLang's /metrics)
    backend.py           the classes SGLang instantiates: manager.py, sender.py, receiver.py,
                         bootstrap_server.py (they import SGLang)
    launch.py            runs SGLang's server (``kvbridge sglang``)

Imports point one way: ``patches -> backend -> manager -> version, settings, ...``;
nothing below ``patches`` imports it. The names below are resolved on first use
(this package imports no submodule when it is imported), and nothing here imports
SGLang until a function needs it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BACKEND": "patches",
    "SGLangMismatch": "patches",
    "install": "patches",
    "installed": "patches",
    "interface_differences": "patches",
    "plugin": "patches",
    "SUPPORTED_VERSIONS": "version",
    "sglang_version": "version",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
