"""The same-host engine (``create_engine("ipc")``): CUDA IPC into peer processes on this host.

    engine.py    IpcEngine: writes, many slices per kernel launch (``engine/slicecopy.py``)
    tables.py    its region tables: what we export, what each peer exported, withdrawal
    channel.py   its side channel (abstract Unix socket, kvbridge's channel): Get / Regions /
                 Revoke / Revoked

``from kvbridge.transfer.engine.ipc import IpcEngine`` is the public name; the modules are the
engine's own.
"""

from __future__ import annotations

from kvbridge.transfer.engine.ipc.engine import IpcEngine

__all__ = ["IpcEngine"]
