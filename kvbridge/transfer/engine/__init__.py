"""Transfer engines behind one small interface, chosen by name.

    engine = create_engine("auto")              # CUDA IPC to same-host peers, Mooncake to the rest
    engine = create_engine("mooncake")          # or "nixl", "ipc" (same host only), "local" (tests, faults)
    engine.register(*tensor_region(kv_buffer))
    handle = engine.submit_write(peer_session, src, dst, length)
    ... engine.poll(handle) -> WriteStatus.PENDING / DONE / FAILED(reason)

Which engines exist, and what each is, is the registry's (``registry.py``: one entry per
engine). The adapters are imported only inside :func:`create_engine`, so ``import kvbridge``
works on hosts without Mooncake or NIXL. An adapter extends ``JobEngine`` (``jobs.py``). A NIXL peer must be introduced before the
first write: ``writer.add_peer(target.session_id, target.metadata)`` (the registration at the
bootstrap daemon carries ``metadata``; the endpoints do this themselves).
"""

from __future__ import annotations

from typing import Any

from kvbridge.errors import ConfigError, EngineError
from kvbridge.layout.buffers import RawBuffer
from kvbridge.transfer.engine.base import TransferEngine, WriteState, WriteStatus
from kvbridge.transfer.engine.jobs import JobEngine
from kvbridge.transfer.engine.local import Faults, LocalEngine, LocalFabric
from kvbridge.transfer.engine.registry import ENGINES, EngineEntry, engine_entry, engine_names

__all__ = [
    "ENGINES",
    "ENGINE_KINDS",
    "EngineEntry",
    "Faults",
    "JobEngine",
    "LocalEngine",
    "LocalFabric",
    "TransferEngine",
    "WriteState",
    "WriteStatus",
    "create_engine",
    "engine_entry",
    "engine_names",
    "mooncake_available",
    "nixl_available",
    "tensor_region",
]

ENGINE_KINDS = engine_names()  # every registered engine (registry.py), in the table's order


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
    """A started engine named ``kind``, one of the registry's names (``ENGINE_KINDS``; the list
    below is generated from the registry: name, what kind of engine, transport, default cap). ``protocol``/``device`` go to Mooncake as they are ("rdma", "mlx5_0"); ``fabric`` is for
    "local" only (a fresh one when omitted). ``max_slices_per_call`` (default: the entry's) also caps
    the slices a Mooncake engine keeps in flight per destination session.

    "ipc"'s peers must be "ipc" engines too; "auto" writes to a peer whose IPC side channel answers
    (an "auto" engine on this host) over IPC where it reaches the destination, everything else over
    Mooncake; "nixl"'s peers must be "nixl" engines, introduced with ``add_peer``.

    Engines:
    """
    entry = engine_entry(kind)
    if fabric is not None and "fabric" not in entry.options:
        raise ConfigError(f"a LocalFabric only applies to the 'local' engine, not {kind!r}", field="fabric")
    if not entry.is_available():
        raise EngineError(entry.missing, field="engine")
    given = {"host": host, "protocol": protocol, "device": device, "fabric": fabric}
    options = {name: given[name] for name in entry.options}
    return entry.load()(**options, max_slices_per_call=max_slices_per_call or entry.max_slices_per_call)


create_engine.__doc__ = (create_engine.__doc__ or "") + "".join(
    f"\n    - ``{e.name}`` ({e.kind}, transport ``{e.transport}``, {e.max_slices_per_call:,} slices per call): "
    f"{e.description}" for e in ENGINES.values())


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
