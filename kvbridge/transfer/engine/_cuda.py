"""The few CUDA runtime and driver calls the IPC engine needs, through ctypes (no build step).

    pointer_kind(ptr)            -> ("device", ordinal) | ("host", -1)
    allocation(ptr, device)      -> (base, size) of the cudaMalloc allocation holding ptr
    ipc_handle(base, device)     -> 64 bytes a process on this host opens with open_ipc
    Mappings.acquire/release     opened handles, counted per process

Loaded only where torch sees a CUDA device, after torch initialised CUDA, so the
libraries torch loaded are the ones found (``libcudart.so.13`` is already in the
process; ``dlopen`` by soname returns it). CUDA IPC rules that shape the engine:

- a handle names a whole ``cudaMalloc`` allocation; torch's caching allocator packs
  tensors into shared allocations, so a region is (handle of its allocation, offset);
- a process may open a given handle once: opened mappings are counted per process
  (two engines in one process writing to one peer share them);
- a process cannot open its own handles: writers in the exporting process use the
  pointers as they are;
- memory from ``cuMemCreate`` (torch's ``expandable_segments``) has no legacy IPC
  handle: registering it with the IPC engine fails with the CUDA error.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

from kvbridge.errors import EngineError

_RUNTIMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (unified addressing)
_EVENT_DISABLE_TIMING = 2  # cudaEventDisableTiming
_NOT_READY = 600  # cudaErrorNotReady: an event query's "not yet"
_IPC_LAZY_PEER = 1  # cudaIpcMemLazyEnablePeerAccess
_DEVICE, _MANAGED = 2, 3  # cudaMemoryType


class _PointerAttributes(ctypes.Structure):
    # newer runtimes append reserved words to this struct: room for them, or the call writes past it
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int), ("device_ptr", ctypes.c_void_p),
                ("host_ptr", ctypes.c_void_p), ("reserved", ctypes.c_long * 32)]


class _IpcHandle(ctypes.Structure):
    # bytes, not c_char: a c_char array field reads and writes only up to its first NUL byte
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


class Cuda:
    """Thin wrappers that turn CUDA error codes into EngineError."""

    def __init__(self) -> None:
        import torch

        torch.cuda.init()  # loads the runtime torch was built with
        self.rt = _load(_RUNTIMES)
        self.drv = _load(("libcuda.so.1", "libcuda.so"))
        self.rt.cudaGetErrorString.restype = ctypes.c_char_p
        self.rt.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcHandle, ctypes.c_uint]
        self.rt.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                            ctypes.c_void_p]

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            self.rt.cudaGetLastError()  # reset it: torch would report it at its next kernel launch
            raise EngineError(f"{what} failed: CUDA error {rc} ({self.rt.cudaGetErrorString(rc).decode()})")

    def set_device(self, device: int) -> None:
        self._check(self.rt.cudaSetDevice(ctypes.c_int(device)), f"cudaSetDevice({device})")

    @contextmanager
    def on_device(self, device: int) -> Iterator[None]:
        """``device`` current on this thread (its primary context too), the caller's restored after."""
        before = ctypes.c_int()
        self._check(self.rt.cudaGetDevice(ctypes.byref(before)), "cudaGetDevice")
        self.set_device(device)
        try:
            yield
        finally:
            self.set_device(before.value)

    def pointer_kind(self, ptr: int) -> tuple[str, int]:
        attrs = _PointerAttributes()
        rc = self.rt.cudaPointerGetAttributes(ctypes.byref(attrs), ctypes.c_void_p(ptr))
        if rc != 0:
            self.rt.cudaGetLastError()  # clear the sticky-free error of an unknown pointer
            return "host", -1
        if attrs.type == _MANAGED:
            raise EngineError(f"{ptr:#x} is CUDA managed memory; the IPC engine moves device or host memory only")
        return ("device", attrs.device) if attrs.type == _DEVICE else ("host", -1)

    def allocation(self, ptr: int, device: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        with self.on_device(device):  # the driver call needs the device's primary context current here
            rc = self.drv.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
        if rc != 0:
            raise EngineError(f"cuMemGetAddressRange({ptr:#x}) failed: CUDA driver error {rc}")
        return int(base.value), int(size.value)

    def ipc_handle(self, base: int, device: int) -> bytes:
        handle = _IpcHandle()
        with self.on_device(device):
            self._check(self.rt.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(base)),
                        f"cudaIpcGetMemHandle({base:#x})")
        return bytes(handle.reserved)

    def open_ipc(self, handle: bytes, device: int) -> int:
        """Map a peer's allocation into ``device``'s address space (peer access enabled as needed)."""
        ptr = ctypes.c_void_p()
        if len(handle) != ctypes.sizeof(_IpcHandle):
            raise EngineError(f"a CUDA IPC handle is {ctypes.sizeof(_IpcHandle)} bytes, got {len(handle)}")
        h = _IpcHandle.from_buffer_copy(handle)
        with self.on_device(device):
            self._check(self.rt.cudaIpcOpenMemHandle(ctypes.byref(ptr), h, _IPC_LAZY_PEER), "cudaIpcOpenMemHandle")
        return int(ptr.value)

    def close_ipc(self, ptr: int) -> None:
        self._check(self.rt.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), f"cudaIpcCloseMemHandle({ptr:#x})")

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check(self.rt.cudaMemcpyAsync(dst, src, nbytes, _MEMCPY_DEFAULT, stream),
                    f"cudaMemcpyAsync({dst:#x} <- {src:#x}, {nbytes})")

    def stream_synchronize(self, stream: int) -> None:
        self._check(self.rt.cudaStreamSynchronize(ctypes.c_void_p(stream)), "cudaStreamSynchronize")

    def event_create(self) -> int:
        """An event without timing (for ordering only), kept for its owner's lifetime (a copier's
        piece tables: four per process)."""
        event = ctypes.c_void_p()
        self._check(self.rt.cudaEventCreateWithFlags(ctypes.byref(event), _EVENT_DISABLE_TIMING),
                    "cudaEventCreateWithFlags")
        return int(event.value)

    def event_record(self, event: int, stream: int) -> None:
        self._check(self.rt.cudaEventRecord(ctypes.c_void_p(event), ctypes.c_void_p(stream)), "cudaEventRecord")

    def event_synchronize(self, event: int) -> None:
        self._check(self.rt.cudaEventSynchronize(ctypes.c_void_p(event)), "cudaEventSynchronize")

    def event_query(self, event: int) -> bool:
        """Whether the work before the event's last record completed."""
        rc = self.rt.cudaEventQuery(ctypes.c_void_p(event))
        if rc == _NOT_READY:
            return False
        self._check(rc, "cudaEventQuery")
        return True

    def stream_wait_event(self, stream: int, event: int) -> None:
        """Work queued on ``stream`` from now waits for the event (on the GPU; the host goes on)."""
        self._check(self.rt.cudaStreamWaitEvent(ctypes.c_void_p(stream), ctypes.c_void_p(event), ctypes.c_uint(0)),
                    "cudaStreamWaitEvent")



class Mappings:
    """Peer allocations opened in this process, counted: opened once, closed by the last release."""

    def __init__(self, cuda: Cuda) -> None:
        self._cuda = cuda
        self._lock = threading.Lock()
        self._open: dict[bytes, list[int]] = {}  # handle -> [local base, users]

    def acquire(self, handle: bytes, device: int) -> int:
        with self._lock:
            entry = self._open.get(handle)
            if entry is None:
                entry = self._open[handle] = [self._cuda.open_ipc(handle, device), 0]
            entry[1] += 1
            return entry[0]

    def release(self, handle: bytes) -> None:
        with self._lock:
            entry = self._open.get(handle)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] <= 0:
                del self._open[handle]
                self._cuda.close_ipc(entry[0])


def cuda_available() -> bool:
    """True when torch sees a CUDA device (the IPC engine then moves device memory too)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@cache
def cuda() -> Cuda:
    """The process's CUDA wrappers (one per process: the libraries are process-wide)."""
    return Cuda()


@cache
def mappings() -> Mappings:
    """The process's opened peer allocations (CUDA lets a process open a handle only once)."""
    return Mappings(cuda())


def _load(names: tuple[str, ...]) -> ctypes.CDLL:
    errors = []
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(str(exc))
    found = _mapped_library(names[0].split(".so")[0])
    if found:
        return ctypes.CDLL(found)
    raise EngineError(f"cannot load {names[0]}: {'; '.join(errors)}")


def _mapped_library(stem: str) -> str:
    """Path of a library already mapped into this process whose file name starts with ``stem``."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if path.rsplit("/", 1)[-1].startswith(stem + ".so"):
                    return path
    except OSError:
        pass
    return ""
