"""``scripts/staged_cycle.py --split``: put first on a bench child's PYTHONPATH, with KVBRIDGE_SPLIT_DIR
set; in a decode rank (``python -m kvbridge.bench.procs decode ...``) it wraps the timers of
``scripts/decode_split.py`` around decode's landing turn. Any other process: nothing."""

import os
import sys

if os.environ.get("KVBRIDGE_SPLIT_DIR") and "decode" in sys.argv[1:2]:
    import importlib.util

    _path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "decode_split.py")
    _spec = importlib.util.spec_from_file_location("decode_split", _path)
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules["decode_split"] = _mod
    _spec.loader.exec_module(_mod)
    _mod.install()
