"""``scripts/staged_cycle.py --split``: put first on a bench child's PYTHONPATH, with KVBRIDGE_SPLIT_DIR
set; in a decode rank (``python -m kvbridge.bench.procs decode ...``) it wraps the timers of
``scripts/decode_split.py`` around decode's landing turn, in a prefill rank (``... procs prefill ...``)
those of ``scripts/prefill_split.py`` around prefill's grant, completion and deferred gather turns.
Any other process: nothing."""

import os
import sys

_ROLE = sys.argv[1] if len(sys.argv) > 1 else ""
if os.environ.get("KVBRIDGE_SPLIT_DIR") and _ROLE in ("decode", "prefill"):
    import importlib.util

    _name = f"{_ROLE}_split"
    _path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), f"{_name}.py")
    _spec = importlib.util.spec_from_file_location(_name, _path)
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules[_name] = _mod
    _spec.loader.exec_module(_mod)
    _mod.install()
