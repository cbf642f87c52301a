"""Aux rows in memory, on either side: where each region of a row lives, and the
slices that copy one row from a prefill rank to a decode rank.

An endpoint keeps its aux rows in one of two forms (``AuxSchema`` says what a row holds):

    packed      one uint8 tensor [rows, row_bytes]     | room | first_token | ... | hidden | pad |   row i
    by region   {region name: tensor [rows, *shape]}   room[i]   first_token[i]   ...   hidden[i]

and either may be given as raw addresses (``RawBuffer``: whole rows of the packed row or of
the region; host memory is read back through a numpy view of the same bytes).

Either way region ``r`` of row ``i`` starts at ``base_r + i * stride_r`` (a ``RegionAddr``),
and that is what is registered with the transfer engine and the bootstrap daemon. A row
moves as one slice per region, merged where both sides are contiguous; between two
packed stores that is one slice for the whole row.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.bootstrap.topology import AuxDescriptor, AuxRegionDescriptor
from kvbridge.errors import ConfigError, KVBridgeError, PageRangeError
from kvbridge.layout import AuxSchema, RawBuffer
from kvbridge.transfer.engine import TransferEngine, tensor_region


@dataclass(frozen=True)
class RegionAddr:
    """Region ``name`` of row ``i`` is at ``base + i * stride``; ``capacity_rows`` rows."""

    name: str
    base: int
    capacity_rows: int
    stride: int

    def at(self, slot: int) -> int:
        return self.base + slot * self.stride

    @classmethod
    def of(cls, d: AuxRegionDescriptor) -> RegionAddr:
        return cls(d.name, d.base, d.capacity_rows, d.row_bytes)


def is_packed(schema: AuxSchema, regions: Mapping[str, RegionAddr]) -> bool:
    """True when the regions are one packed row: same stride (the row), offsets as the schema's."""
    rows = {(a.base - schema.offsets[name], a.stride) for name, a in regions.items()}
    return len(rows) == 1 and next(iter(rows))[1] == schema.row_bytes


def packed_base(schema: AuxSchema, regions: Mapping[str, RegionAddr]) -> int | None:
    """Where row 0 starts when ``regions`` are one packed store (``is_packed``), else None."""
    if not is_packed(schema, regions):
        return None
    room = schema.regions[0].name
    return regions[room].base - schema.offsets[room]


def aux_slices(schema: AuxSchema, src: Mapping[str, RegionAddr], src_slot: int, dst: Mapping[str, RegionAddr],
               dst_slot: int, *, src_base: int | None = None,
               dst_base: int | None = None) -> tuple[list[int], list[int], list[int]]:
    """``(src, dst, length)`` of one row, as lists (a slice per item): one slice between two
    packed stores, else one per region, merged where consecutive regions are contiguous on
    both sides. ``src_base`` / ``dst_base``: the stores' ``packed_base`` when their owner keeps
    it (then no region is looked at)."""
    if src_base is None:
        src_base = packed_base(schema, src)
    if dst_base is None:
        dst_base = packed_base(schema, dst)
    if src_base is not None and dst_base is not None:
        rb = schema.row_bytes
        return [src_base + src_slot * rb], [dst_base + dst_slot * rb], [rb]
    out: list[list[int]] = []
    for r in schema.regions:
        if not r.nbytes:
            continue
        s, d = src[r.name].at(src_slot), dst[r.name].at(dst_slot)
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += r.nbytes
        else:
            out.append([s, d, r.nbytes])
    return [o[0] for o in out], [o[1] for o in out], [o[2] for o in out]


def _dtype_name(buf: Any) -> str:
    return str(buf.dtype).removeprefix("torch.")


def _contiguous(buf: Any) -> bool:
    return buf.is_contiguous() if hasattr(buf, "is_contiguous") else bool(buf.flags["C_CONTIGUOUS"])


def _host_uint8(buf: Any) -> np.ndarray | None:
    """A 2-D uint8 numpy view of ``buf``'s bytes when it is a contiguous uint8 array or CPU
    tensor (no copy); None for device memory and anything else."""
    if isinstance(buf, np.ndarray):
        arr = buf
    elif type(buf).__module__.startswith("torch") and getattr(buf, "device", None) is not None \
            and buf.device.type == "cpu" and not buf.requires_grad:
        arr = buf.numpy()
    else:
        return None
    if arr.dtype != np.uint8 or arr.ndim != 2 or not arr.flags.c_contiguous:
        return None
    return arr


def _row_bytes(buf: Any, slot: int) -> np.ndarray:
    """The bytes of row ``slot`` of a tensor or array (copied to the host)."""
    part = buf[slot : slot + 1]
    if hasattr(part, "numpy"):  # torch: any dtype (bf16 has no numpy twin), any device
        import torch

        part = part.contiguous().view(torch.uint8).cpu().numpy()
    return np.ascontiguousarray(part).view(np.uint8).reshape(-1).copy()


def _on_cuda(buf: Any) -> bool:
    return type(buf).__module__.startswith("torch") and getattr(getattr(buf, "device", None), "type", "") == "cuda"


RING_ROWS = 64  # pinned host rows of aux row writes not waited for (a 65th write in flight waits for the oldest)


class _DeviceRows:
    """Rows of a packed CUDA tensor, read through one pinned host row on a stream of their own:
    a copy and a synchronisation per read, two CUDA runtime calls (a decode rank reads every
    room's aux row on its commit: no torch dispatch, no staging allocation there).

    Written either the same way (``write``: the copy waited for) or without waiting
    (``write_async``): from the next of ``RING_ROWS`` pinned rows, which keeps the row's bytes
    until its copy ran, with that ring row's event recorded behind the copy for the caller to
    poll (``RowWrite``). A ring row is refilled only once its last copy ran (waited for when
    the ring is full). Both ways go on the same stream: a later write of a row lands after an
    earlier one, whichever way each was made."""

    def __init__(self, storage: Any, row_bytes: int) -> None:
        import torch

        from kvbridge.transfer.engine._cuda import cuda

        self._cuda = cuda()
        self._device = storage.device.index if storage.device.index is not None else torch.cuda.current_device()
        self._base = storage.data_ptr()
        self._row_bytes = row_bytes
        self._pinned = torch.empty(row_bytes, dtype=torch.uint8, pin_memory=True)
        self._host = self._pinned.numpy()
        self._ring: np.ndarray | None = None  # [RING_ROWS, row_bytes] pinned, made on the first write_async
        self._ring_events: list[int] = []  # per ring row: the event recorded after its last copy
        self._ring_used: list[bool] = []
        self._next = 0
        with torch.cuda.device(self._device):
            self._stream = torch.cuda.Stream(self._device)
        self._lock = threading.Lock()  # one pinned row: one read at a time

    def read(self, slot: int) -> np.ndarray:
        with self._lock, self._cuda.on_device(self._device):
            self._cuda.memcpy_async(self._host.ctypes.data, self._base + slot * self._row_bytes, self._row_bytes,
                                    self._stream.cuda_stream)
            self._cuda.stream_synchronize(self._stream.cuda_stream)
            return self._host.copy()

    def write(self, slot: int, row: np.ndarray) -> None:
        """Row ``slot`` set to ``row`` (packed bytes): through the pinned row, the copy waited for
        (the engine reads the row once the room is Success)."""
        with self._lock, self._cuda.on_device(self._device):
            self._host[:] = row
            self._cuda.memcpy_async(self._base + slot * self._row_bytes, self._host.ctypes.data, self._row_bytes,
                                    self._stream.cuda_stream)
            self._cuda.stream_synchronize(self._stream.cuda_stream)

    def write_async(self, slot: int, row: np.ndarray) -> RowWrite:
        """Row ``slot`` set to ``row``: the copy queued from the next ring row, not waited for."""
        with self._lock, self._cuda.on_device(self._device):
            if self._ring is None:
                import torch

                self._ring_tensor = torch.empty((RING_ROWS, self._row_bytes), dtype=torch.uint8, pin_memory=True)
                self._ring = self._ring_tensor.numpy()
                self._ring_events = [self._cuda.event_create() for _ in range(RING_ROWS)]
                self._ring_used = [False] * RING_ROWS
            i, self._next = self._next, (self._next + 1) % RING_ROWS
            event = self._ring_events[i]
            if self._ring_used[i] and not self._cuda.event_query(event):
                self._cuda.event_synchronize(event)  # (the ring is full: its oldest copy has not run yet)
            self._ring[i] = row
            stream = self._stream.cuda_stream
            self._cuda.memcpy_async(self._base + slot * self._row_bytes, self._ring[i].ctypes.data,
                                    self._row_bytes, stream)
            self._cuda.event_record(event, stream)
            self._ring_used[i] = True
            return RowWrite(self._cuda, event)


class RowWrite:
    """A row's write queued on the GPU (``_DeviceRows.write_async``): ``done()`` polls the event
    recorded behind its copy (no wait); True once the copy ran, and from then on. (The event is
    its ring row's: recorded again by a later write from that row, it passes later, so a write
    asked that late reads done no sooner than its copy ran.)"""

    __slots__ = ("_cuda", "_event", "_done")

    def __init__(self, cuda: Any, event: int) -> None:
        self._cuda, self._event, self._done = cuda, event, False

    def done(self) -> bool:
        if not self._done:
            self._done = self._cuda.event_query(self._event)
        return self._done


class AuxBuffers:
    """An endpoint's aux rows: a packed uint8 ``[rows, row_bytes]`` tensor, or a mapping
    ``{region: tensor[rows, *shape]}``; checked against the schema when built."""

    def __init__(self, schema: AuxSchema, storage: Any, *, rank: str, field: str = "aux_buffer") -> None:
        self.schema = schema
        self._rank, self._field = rank, field
        self._registered: list[int] = []
        if isinstance(storage, Mapping):
            self.packed = False
            names = self._check_mapping(storage)
            self.tensors = {r.name: self._readable(storage[r.name], r.nbytes, f"{field}[{r.name!r}]")
                            for r in schema.regions if r.name in names}
            self.regions = {}
            for r in schema.regions:
                ptr, nbytes = tensor_region(self.tensors[r.name])
                self.regions[r.name] = RegionAddr(r.name, ptr, nbytes // r.nbytes if r.nbytes else 0, r.nbytes)
        else:
            self.packed = True
            self._check_packed(storage)
            storage = self._readable(storage, schema.row_bytes, field)
            self.tensors = {"": storage}
            ptr, nbytes = tensor_region(storage)
            rows = nbytes // schema.row_bytes
            self.regions = {r.name: RegionAddr(r.name, ptr + schema.offsets[r.name], rows, schema.row_bytes)
                            for r in schema.regions}
        self.storage = storage
        self.row_base = packed_base(schema, self.regions)  # (None: rows are not one packed store)
        self.capacity_rows = min(a.capacity_rows for a in self.regions.values())
        # packed rows in host memory: read through a numpy view of the same bytes (no torch call
        # on the commit's path; the view follows every write into the storage); in device memory,
        # through one pinned row (made on the first read)
        self._host_rows = _host_uint8(storage) if self.packed else None
        self._device_rows: _DeviceRows | None = None

    @staticmethod
    def _readable(buf: Any, item_bytes: int, where: str) -> Any:
        """A host ``RawBuffer`` as a ``[rows, item_bytes]`` uint8 view of the same bytes (readable
        like a tensor); anything else as it is."""
        if isinstance(buf, RawBuffer) and buf.on_host and item_bytes:
            return buf.host_view().reshape(-1, item_bytes)
        return buf

    @property
    def readable(self) -> bool:
        """False when a region is device memory given as a ``RawBuffer`` (kvbridge cannot read it back)."""
        return not any(isinstance(t, RawBuffer) for t in self.tensors.values())

    def _fail(self, message: str, field: str | None = None) -> ConfigError:
        return ConfigError(message, rank=self._rank, field=field or self._field)

    def _check_packed(self, buf: Any) -> None:
        if isinstance(buf, RawBuffer):
            self._raw_rows(buf, self.schema.row_bytes, self._field, "packed aux rows")
            return
        shape = tuple(getattr(buf, "shape", ()))
        if _dtype_name(buf) != "uint8" or len(shape) != 2 or shape[0] < 1 or shape[1] != self.schema.row_bytes \
                or not _contiguous(buf):
            raise self._fail(
                f"aux rows must be a contiguous uint8 tensor [rows, {self.schema.row_bytes}] (the schema's packed "
                f"row), or a mapping {{region: tensor[rows, ...]}} of {list(self.schema.names)}; got "
                f"{_dtype_name(buf) if hasattr(buf, 'dtype') else type(buf).__name__} {list(shape)}: rows of another "
                "size would be written into the wrong bytes")

    def _check_mapping(self, storage: Mapping[str, Any]) -> list[str]:
        names = list(self.schema.names)
        if set(storage) != set(names):
            raise self._fail(f"aux regions {sorted(storage)} given, the schema has {names}")
        for r in self.schema.regions:
            buf, where = storage[r.name], f"{self._field}[{r.name!r}]"
            if isinstance(buf, RawBuffer):
                self._raw_rows(buf, r.nbytes, where, f"aux region {r.name!r} ({r.dtype} x {r.count} per row)")
                continue
            shape = tuple(getattr(buf, "shape", ()))
            dtype = _dtype_name(buf)
            if dtype == "uint16" and r.dtype == "bfloat16" and not hasattr(buf, "data_ptr"):
                dtype = "bfloat16"  # numpy has no bf16: its bits as uint16
            per_row = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
            if dtype != r.dtype or not shape or shape[0] < 1 or per_row != r.count or not _contiguous(buf):
                raise self._fail(f"aux region {r.name!r}: expected a contiguous {r.dtype} tensor [rows, "
                                 f"{', '.join(map(str, r.shape)) or '(scalar)'}], got {dtype} {list(shape)}", where)
        return names

    def _raw_rows(self, buf: RawBuffer, item_bytes: int, where: str, what: str) -> None:
        """A RawBuffer of aux rows: an address has no dtype or shape, so whole rows is what is checked."""
        if not item_bytes or buf.nbytes < item_bytes or buf.nbytes % item_bytes:
            raise self._fail(f"{what}: RawBuffer of {buf.nbytes} bytes is not a whole number of {item_bytes}-byte "
                             "rows: rows of another size would be written into the wrong bytes", where)

    # -- what is exposed -------------------------------------------------------

    def descriptors(self) -> list[AuxRegionDescriptor]:
        return [AuxRegionDescriptor(name=a.name, base=a.base, capacity_rows=a.capacity_rows, row_bytes=a.stride)
                for a in self.regions.values()]

    def packed_descriptor(self) -> AuxDescriptor | None:
        """The packed buffer as one descriptor (None for a store by region)."""
        if not self.packed:
            return None
        base, _ = tensor_region(self.storage)
        return AuxDescriptor(base=base, capacity_rows=self.capacity_rows, row_bytes=self.schema.row_bytes)

    def register(self, engine: TransferEngine) -> None:
        for buf in self.tensors.values():
            ptr, nbytes = tensor_region(buf)
            engine.register(ptr, nbytes)
            self._registered.append(ptr)

    def unregister(self, engine: TransferEngine) -> None:
        while self._registered:
            engine.unregister(self._registered.pop())

    # -- reading rows ------------------------------------------------------------

    def check_slot(self, slot: int, *, room: int | None = None, field: str = "aux_slot") -> None:
        if not isinstance(slot, (int, np.integer)) or isinstance(slot, bool) or not 0 <= slot < self.capacity_rows:
            raise PageRangeError(f"aux slot {slot!r} outside [0, {self.capacity_rows}) (registered aux rows)",
                                 room=room, rank=self._rank, field=field)

    def read_row(self, slot: int) -> np.ndarray:
        """Row ``slot`` as the schema's packed bytes (uint8, ``row_bytes``)."""
        if self._host_rows is not None:
            return self._host_rows[slot].copy()
        if self.packed:
            if self._device_rows is None and _on_cuda(self.storage):
                self._device_rows = _DeviceRows(self.storage, self.schema.row_bytes)
            if self._device_rows is not None:
                return self._device_rows.read(slot)
            return _row_bytes(self.storage, slot)
        row = np.zeros(self.schema.row_bytes, dtype=np.uint8)
        for r in self.schema.regions:
            off = self.schema.offsets[r.name]
            row[off : off + r.nbytes] = _row_bytes(self.tensors[r.name], slot)
        return row

    @property
    def writable(self) -> bool:
        """kvbridge can write a row into these rows itself (``write_row``): one packed store, in host
        memory (a numpy view of its bytes) or a CUDA tensor. A decode rank with such rows takes the
        aux row in the report that carries it (``TransferRequest.aux_inline``)."""
        return self._host_rows is not None or self.on_device

    @property
    def on_device(self) -> bool:
        """Writable rows in device memory: a row written here is a host -> device copy, which waits
        behind the other copies on the GPU. A decode rank with such rows takes the aux row ahead of
        the room's last pages (``TransferRequest.aux_ahead``) and writes it while they land."""
        return self._host_rows is None and self.packed and _on_cuda(self.storage)

    def write_row(self, slot: int, row: np.ndarray) -> None:
        """Row ``slot`` set to ``row`` (the schema's packed bytes, uint8 ``row_bytes``): done when
        this returns. Only where ``writable``."""
        rows = self._rows_to_write(slot, row)
        if rows is None:
            self._host_rows[slot] = row
        else:
            rows.write(slot, row)

    def write_row_async(self, slot: int, row: np.ndarray) -> RowWrite | None:
        """``write_row`` without waiting for the copy where the rows are in device memory: a
        ``RowWrite`` to poll (the row is there once ``done()``); host rows are written here and
        then (None)."""
        rows = self._rows_to_write(slot, row)
        if rows is None:
            self._host_rows[slot] = row
            return None
        return rows.write_async(slot, row)

    def _rows_to_write(self, slot: int, row: np.ndarray) -> _DeviceRows | None:
        """``slot`` checked against the registered rows and ``row`` as one packed row, and where it
        goes: None for host rows (a numpy view of their bytes), else the device rows (made on the
        first write). Rows kvbridge cannot write are refused by name. (A slot past the rows would
        be a stray write into device memory, or a negative one a write into another row.)"""
        self.check_slot(slot)
        if row.dtype != np.uint8 or row.shape != (self.schema.row_bytes,):
            raise KVBridgeError(f"an aux row is {self.schema.row_bytes} packed bytes, got {row.dtype} {list(row.shape)}",
                                rank=self._rank, field="aux_row")
        if self._host_rows is not None:
            return None
        if not self.writable:
            raise KVBridgeError("these aux rows are not writable by kvbridge (rows by region, or a RawBuffer)",
                                rank=self._rank, field="aux_row")
        if self._device_rows is None:
            self._device_rows = _DeviceRows(self.storage, self.schema.row_bytes)
        return self._device_rows

    def read_room(self, slot: int) -> int:
        """The room id that row ``slot`` echoes (its ``room`` region's first element)."""
        data = _row_bytes(self.tensors[""] if self.packed else self.tensors["room"], slot)
        start = self.schema.offsets["room"] if self.packed else 0
        return int(data[start : start + 8].view("<u8")[0])


class AuxStaging(AuxBuffers):
    """Packed rows kvbridge owns on a prefill rank, one slot per room, from which the rows
    the engine hands to ``send(aux=...)`` are written. Host memory by default;
    ``device="cuda:N"`` for transports that only move device memory (Mooncake's NVLink).

    On a device the row goes into its slot's pinned host row at ``stage`` and is copied to the
    device on its first use only (``RowCopy``): a write that reads it waits on the room's
    ``ready_event``, which queues the copy (on a side stream, after the producer's events) when
    that write first asks. A room whose every decode rank takes the row in its report
    (``aux_inline``, the default) never copies it: no device copy, event or stream wait on the
    thread that calls ``send()``."""

    def __init__(self, schema: AuxSchema, num_slots: int, *, rank: str, device: str = "cpu") -> None:
        self._pinned: Any = None
        if device == "cpu":
            rows: Any = np.zeros((num_slots, schema.row_bytes), dtype=np.uint8)
        else:
            import torch

            from kvbridge.transfer.engine._cuda import cuda

            rows = torch.zeros((num_slots, schema.row_bytes), dtype=torch.uint8, device=device)
            self._pinned = torch.zeros((num_slots, schema.row_bytes), dtype=torch.uint8).pin_memory()
            self._pinned_rows = self._pinned.numpy()
            self._stream = torch.cuda.Stream(rows.device)
            self._stream_handle = int(self._stream.cuda_stream)
            self._cuda = cuda()
            self._device = rows.device.index if rows.device.index is not None else torch.cuda.current_device()
            self._slot_events: list[int | None] = [None] * num_slots  # a CUDA event per slot, made on first copy
            self._copy_lock = threading.Lock()  # a row's copy is queued once, from whichever thread asks first
        super().__init__(schema, rows, rank=rank, field="aux_slots")
        self._free = list(range(num_slots - 1, -1, -1))
        self._by_room: dict[int, int] = {}
        self._events: dict[int, RowCopy] = {}  # slot -> the device copy of the row staged there last

    def stage(self, room: int, row: np.ndarray, *, after: Any = None) -> int:
        """Put a packed row into the room's slot once (later calls return the slot); returns the
        slot. ``after``: events the row's device copy waits on (queued on first use), as a
        write's would."""
        slot = self._by_room.get(room)
        if slot is not None:
            return slot
        if not self._free:
            raise KVBridgeError(f"all {self.capacity_rows} aux staging slots are in use", room=room,
                                rank=self._rank, field="aux_slots")
        slot = self._by_room[room] = self._free.pop()
        data = np.ascontiguousarray(row).view(np.uint8).reshape(-1)
        if self._pinned is None:
            self.storage[slot] = data
            return slot
        previous = self._events.pop(slot, None)
        if previous is not None:  # the slot's last copy read this pinned row: it must be done (it is, by now)
            previous.retire()
        self._pinned_rows[slot] = data
        self._events[slot] = RowCopy(self, slot, after)
        return slot

    def _copy(self, slot: int, after: Any) -> int:
        """(``_copy_lock`` held) Queue the pinned row's copy into device slot ``slot`` on the side
        stream, after the producer's events; returns the event recorded after it."""
        import torch

        from kvbridge.transfer.engine.base import ready_events

        with self._cuda.on_device(self._device):
            event = self._slot_events[slot]
            if event is None:
                event = self._slot_events[slot] = self._cuda.event_create()
            for ev in ready_events(after):  # the producer's events: on the GPU (a CUDA event) or here
                self._stream.wait_event(ev) if isinstance(ev, torch.cuda.Event) else ev.synchronize()
            row_bytes = self.schema.row_bytes
            self._cuda.memcpy_async(self.storage.data_ptr() + slot * row_bytes,
                                    self._pinned.data_ptr() + slot * row_bytes, row_bytes, self._stream_handle)
            self._cuda.event_record(event, self._stream_handle)
        return event

    def ready_event(self, room: int) -> Any:
        """The event a write of the room's staged row waits on (None: host rows, ready at once)."""
        slot = self._by_room.get(room)
        return None if slot is None else self._events.get(slot)

    def release(self, room: int) -> None:
        slot = self._by_room.pop(room, None)
        if slot is not None:
            self._free.append(slot)


class RowCopy:
    """A staged row's device copy (``AuxStaging`` on a GPU), queued by the first write that waits
    on it; an event to such writes: ``query``, ``synchronize`` (the host waits) and ``wait_on``
    (a stream waits, the host does not: ``CudaCopier.wait_for``). Never asked, never copied."""

    __slots__ = ("_staging", "_slot", "_after", "_event")

    def __init__(self, staging: AuxStaging, slot: int, after: Any) -> None:
        self._staging, self._slot, self._after = staging, slot, after
        self._event: int | None = None

    @property
    def queued(self) -> bool:
        return self._event is not None

    def _queue(self) -> int:
        if self._event is None:
            with self._staging._copy_lock:
                if self._event is None:
                    self._event = self._staging._copy(self._slot, self._after)
                    self._after = None
        return self._event

    def query(self) -> bool:
        return self._staging._cuda.event_query(self._queue())

    def synchronize(self) -> None:
        self._staging._cuda.event_synchronize(self._queue())

    def wait_on(self, stream: int) -> None:
        self._staging._cuda.stream_wait_event(stream, self._queue())

    def retire(self) -> None:
        """The slot is staged again: a copy queued from it has passed before its pinned row changes."""
        if self._event is not None:
            self._staging._cuda.event_synchronize(self._event)
        self._after = None
