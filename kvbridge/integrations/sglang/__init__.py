"""kvbridge as SGLang's PD transfer backend (SGLang 0.5.23).

    kvbridge sglang -- --model-path ... --disaggregation-mode prefill \\
        --disaggregation-transfer-backend kvbridge ...

``install()`` registers the backend ``kvbridge`` in this process (the patches
and the checks of SGLang's interface are in ``patches.py``, the one place that
patches SGLang); SGLang's plugin loader calls ``plugin()`` in each process it
starts. ``kvargs`` translates SGLang's ``KVArgs`` into kvbridge's pools and
aux regions, ``cp_modes`` its CP modes into lane rules; ``backend`` holds the
classes SGLang instantiates; ``launch`` runs SGLang's server.

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
