"""Transfer engines behind one small interface, chosen by name.

    engine = create_engine("auto")              # CUDA IPC to same-host peers, Mooncake to the rest
    engine = create_engine("mooncake")          # or "nixl", "ipc" (same host only), "local" (tests, faults)
    engine.register(*tensor_region(kv_buffer))
    handle = engine.submit_write(peer_session, src, dst, length)
    ... engine.poll(handle) -> WriteStatus.PENDING / DONE / FAILED(reason)

The Mooncake and NIXL adapters are imported only inside :func:`create_engine`, so
``import kvbridge`` works on hosts without them. A NIXL peer must be introduced before the
first write: ``writer.add_peer(target.session_id, target.metadata)`` (the registration at the
bootstrap daemon carries ``metadata``; the endpoints do this themselves).
"""

from __future__ import annotations

from typing import Any

from kvbridge.errors import ConfigError, EngineError
from kvbridge.layout.buffers import RawBuffer
from kvbridge.transfer.engine.base import TransferEngine, WriteState, WriteStatus
from kvbridge.transfer.engine.local import Faults, LocalEngine, LocalFabric

__all__ = [
    "ENGINE_KINDS",
    "Faults",
    "LocalEngine",
    "LocalFabric",
    "TransferEngine",
    "WriteState",
    "WriteStatus",
    "create_engine",
    "mooncake_available",
    "nixl_available",
    "tensor_region",
]

ENGINE_KINDS = ("mooncake", "nixl", "ipc", "auto", "local")


def mooncake_available() -> bool:
    """True when the Mooncake transfer engine package imports on this host."""
    try:
        from mooncake.engine import TransferEngine as _  # noqa: F401
    except (ImportError, OSError):  # not installed, or e.g. the CUDA build without libcudart
        return False
    return True


def nixl_available() -> bool:
    """True when a NIXL wheel (``nixl-cu12`` or ``nixl-cu13``, extra ``kvbridge[nixl]``) imports here."""
    from kvbridge.transfer.engine.nixl import nixl_available as available

    return available()


def create_engine(
    kind: str = "mooncake",
    *,
    host: str = "127.0.0.1",
    protocol: str = "tcp",
    device: str = "",
    max_slices_per_call: int | None = None,
    fabric: LocalFabric | None = None,
) -> TransferEngine:
    """A started engine. ``protocol``/``device`` go to Mooncake as they are ("rdma", "mlx5_0");
    ``fabric`` is for "local" only (a fresh one when omitted). ``max_slices_per_call`` (default
    1,024; "ipc": 1,048,576 slices per kernel launch) also caps the slices a Mooncake engine keeps
    in flight per destination session.

    "ipc" writes into peers on this host through CUDA IPC, many slices per kernel launch
    (``kvbridge.transfer.engine.ipc``); its peers must be "ipc" engines too. "auto" is a
    Mooncake engine (its session id) with an IPC engine beside it: writes to a peer whose
    IPC side channel answers (an "auto" engine on this host) go over IPC where it reaches
    the destination, everything else over Mooncake (``kvbridge.transfer.engine.auto``).

    "nixl" is NVIDIA's NIXL with its UCX backend (``kvbridge.transfer.engine.nixl``; default
    65,536 slices per request); its peers must be "nixl" engines, introduced with ``add_peer``."""
    if fabric is not None and kind != "local":
        raise ConfigError("a LocalFabric only applies to the 'local' engine", field="fabric")
    if kind == "ipc":
        from kvbridge.transfer.engine.ipc import IpcEngine

        return IpcEngine(max_slices_per_call=max_slices_per_call or 1 << 20)
    if kind == "auto":
        from kvbridge.transfer.engine.auto import AutoEngine, ipc_session
        from kvbridge.transfer.engine.ipc import IpcEngine

        mooncake = create_engine("mooncake", host=host, protocol=protocol, device=device,
                                 max_slices_per_call=max_slices_per_call)
        try:
            ipc = IpcEngine(session=ipc_session(mooncake.session_id))
        except BaseException:
            mooncake.close()
            raise
        return AutoEngine(mooncake=mooncake, ipc=ipc)
    if kind == "nixl":
        if not nixl_available():
            raise EngineError(
                "NIXL is not importable: install kvbridge[nixl] (nixl-cu12 1.5.1 with --no-deps; "
                "scripts/setup.sh does), or nixl-cu13 on CUDA 13 hosts",
                field="engine",
            )
        from kvbridge.transfer.engine.nixl import NixlEngine

        return NixlEngine(host=host, max_slices_per_call=max_slices_per_call or 1 << 16)
    max_slices_per_call = max_slices_per_call or 1024
    if kind == "local":
        return LocalEngine(fabric if fabric is not None else LocalFabric(), max_slices_per_call=max_slices_per_call)
    if kind == "mooncake":
        if not mooncake_available():
            raise EngineError(
                "the Mooncake transfer engine is not importable: install mooncake-transfer-engine-non-cuda "
                "(CPU hosts, needs libibverbs1) or mooncake-transfer-engine (CUDA 12)",
                field="engine",
            )
        from kvbridge.transfer.engine.mooncake import MooncakeEngine

        return MooncakeEngine(host=host, protocol=protocol, device=device, max_slices_per_call=max_slices_per_call)
    raise ConfigError(f"unknown transfer engine {kind!r}; choose one of {', '.join(ENGINE_KINDS)}", field="engine")


def tensor_region(buf: Any) -> tuple[int, int]:
    """``(ptr, nbytes)`` of a contiguous torch tensor (CPU or CUDA), numpy array or ``RawBuffer``,
    for ``register``."""
    if isinstance(buf, RawBuffer):
        return buf.ptr, buf.nbytes
    if hasattr(buf, "data_ptr") and hasattr(buf, "element_size"):  # torch.Tensor, without importing torch
        if not buf.is_contiguous():
            raise EngineError(f"cannot register a non-contiguous tensor of shape {tuple(buf.shape)}", field="buffer")
        return int(buf.data_ptr()), int(buf.numel() * buf.element_size())
    if hasattr(buf, "__array_interface__"):
        if not buf.flags.c_contiguous:
            raise EngineError(f"cannot register a non-contiguous array of shape {buf.shape}", field="buffer")
        return int(buf.__array_interface__["data"][0]), int(buf.nbytes)
    raise EngineError(f"cannot take the memory region of a {type(buf).__name__}", field="buffer")
