"""kvbridge as SGLang's PD transfer backend (SGLang 0.5.23).

    kvbridge sglang -- --model-path ... --disaggregation-mode prefill \\
        --disaggregation-transfer-backend kvbridge ...

``install()`` registers the backend ``kvbridge`` in this process (the patches
and the checks of SGLang's interface are in ``patches.py``, the one place that
patches SGLang); SGLang's plugin loader calls ``plugin()`` in each process it
starts. Then:

    kvargs.py            SGLang's KVArgs -> kvbridge pools, RawBuffers, aux regions
    cp_modes.py          SGLang's CP modes -> owner-lane rules
    settings.py          what the backend reads from SGLang and KVBRIDGE_* (once), and refuses
    contract.py          the runtime contract of a rank, from its pools
    backend.py           the classes SGLang instantiates: manager.py, sender.py, receiver.py,
                         bootstrap_server.py (they import SGLang)
    launch.py            runs SGLang's server (``kvbridge sglang``)

Nothing here imports SGLang until a function needs it.
"""

from kvbridge.integrations.sglang.patches import (
    BACKEND,
    SUPPORTED_VERSIONS,
    SGLangMismatch,
    install,
    installed,
    interface_differences,
    plugin,
    sglang_version,
)

__all__ = [
    "BACKEND",
    "SUPPORTED_VERSIONS",
    "SGLangMismatch",
    "install",
    "installed",
    "interface_differences",
    "plugin",
    "sglang_version",
]
