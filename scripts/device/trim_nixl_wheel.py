#!/usr/bin/env python
"""A NIXL wheel (nixl-cu12 / nixl-cu13) cut to what kvbridge uses, small enough to carry to a
device host beside Mooncake's wheel (the device call carries 64 MiB in all; nixl-cu13 1.5.1 is
56 MiB). Dropped: the ``nixl_ep_*`` package (expert-parallel kernels for torch) and every
backend plugin but UCX (plugins are loaded by name at run time: NIXL lists the rest as missing).
RECORD is rewritten to match.

    python scripts/device/trim_nixl_wheel.py IN.whl OUT_DIR      -> OUT_DIR/<same name>.whl
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

DROP = re.compile(r"^(nixl_ep_[^/]+/|[^/]+\.libs/nixl/libplugin_(?!UCX\b)[A-Z_]+\.so)")


def trim(src: Path, out_dir: Path) -> Path:
    out = out_dir / src.name
    out_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if DROP.match(info.filename):
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                rows = [r for r in data.decode().splitlines() if r and not DROP.match(r.split(",", 1)[0])]
                data = ("\n".join(rows) + "\n").encode()
            zout.writestr(info, data)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    path = trim(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"{path}: {path.stat().st_size / 2**20:.1f} MiB")
