#!/usr/bin/env python
"""A transfer engine's wheel cut to what kvbridge uses, so Mooncake's and NIXL's fit together in
one device call's 64 MiB carry (mooncake-transfer-engine-cuda13 0.3.14 is 47 MiB, nixl-cu13 1.5.1
56 MiB; cut: 9 and 25 MiB).

    NIXL (nixl-cu12 / nixl-cu13)   dropped: the ``nixl_ep_*`` package (expert-parallel kernels for
                                   torch), every backend plugin but UCX (plugins are loaded by
                                   name at run time: NIXL lists the rest as missing), and UCX's
                                   InfiniBand and RDMA-CM transports (one GPU host moves bytes by
                                   cuda_ipc, shared memory or TCP; UCX skips a module it cannot
                                   find). Those load the wheel's own libibverbs and libnl-route
                                   beside the host's (Mooncake's), and that second libnl-route
                                   crashes in rtnl_tc_unregister at process exit (exit code 139)
    Mooncake (mooncake-transfer-   kept: ``mooncake.engine`` (engine.so) and the libraries it links
    engine*)                       (readelf -d: libasio, libetcd_wrapper, nvlink_allocator, glog,
                                   gflags, jsoncpp, yaml-cpp); dropped: the store, the expert-
                                   parallel and process-group extensions, the master, client and
                                   bench executables, and the libraries only they link (zmq, its
                                   crypto and transports, the store's etcd copy)

RECORD is rewritten to match.

    python scripts/device/trim_wheel.py IN.whl OUT_DIR      -> OUT_DIR/<same name>.whl
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

DROP_NIXL = re.compile(r"^(nixl_ep_[^/]+/|[^/]+\.libs/(nixl|plugins)/libplugin_(?!UCX\b)[A-Z_]+\.so"
                       r"|[^/]+\.libs/ucx/libuct_(ib|rdmacm)[^/]*\.so)")
DROP_MOONCAKE = re.compile(
    r"^(mooncake/(_ep|_store)\.cpython[^/]*\.so|mooncake/(mooncake_master|mooncake_client|transfer_engine_bench)$"
    r"|mooncake/lib(mooncake_pg|mooncake_pg_device|mooncake_ep_device)\.so$"
    r"|mooncake/(_pg_jit|mooncake_ep_jit|store|reshard)/"
    r"|mooncake_transfer_engine[^/]*\.libs/lib(etcd_wrapper|zmq|crypto|sodium|pgm|unwind)-)")


def drop_rule(name: str) -> re.Pattern[str]:
    if name.startswith("nixl"):
        return DROP_NIXL
    if name.startswith("mooncake"):
        return DROP_MOONCAKE
    raise SystemExit(f"{name}: not a NIXL or Mooncake wheel")


def trim(src: Path, out_dir: Path) -> Path:
    drop = drop_rule(src.name)
    out = out_dir / src.name
    out_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if drop.match(info.filename):
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                rows = [r for r in data.decode().splitlines() if r and not drop.match(r.split(",", 1)[0])]
                data = ("\n".join(rows) + "\n").encode()
            zout.writestr(info, data)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    path = trim(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"{path}: {path.stat().st_size / 2**20:.1f} MiB")
