"""Buffers given as raw addresses: what an engine that hands out pointers, not
tensors, registers (SGLang's ``KVArgs`` are flat lists of pointers and lengths).

    RawBuffer(ptr, nbytes, device="cpu")      bytes [ptr, ptr + nbytes) of one allocation

A ``RawBuffer`` is accepted wherever a tensor is: as one layer of a pool (it
must hold whole pages: ``nbytes`` a multiple of the pool's bytes per page) and
as aux rows (packed ``[rows, row_bytes]`` or one region's ``[rows, *shape]``:
``nbytes`` a multiple of the row or region size). kvbridge cannot see a dtype or
a shape in an address, so it checks what it can: a non-null address, whole
pages or rows, a known device. Host memory (``device="cpu"``) can be read back
(``host_view``: the decode rank checks the aux row's room echo there); device
memory is only ever written by the transfer engine.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.errors import BufferSpecError

_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?|npu(:\d+)?)$")


@dataclass(frozen=True)
class RawBuffer:
    """Bytes ``[ptr, ptr + nbytes)`` of memory the engine owns (and keeps alive while an
    endpoint uses it). ``device``: ``"cpu"`` for host memory, ``"cuda:N"`` for a GPU's."""

    ptr: int
    nbytes: int
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("ptr", "nbytes"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise BufferSpecError(f"RawBuffer.{name} must be an integer, got {value!r}", field=name)
        if self.ptr <= 0 or self.nbytes <= 0 or self.ptr + self.nbytes > 2**64:
            raise BufferSpecError(f"RawBuffer at {int(self.ptr):#x} of {int(self.nbytes)} bytes: the address must be "
                                  "non-null and the size positive (a region below 2**64)", field="ptr")
        if not isinstance(self.device, str) or not _DEVICE.match(self.device):
            raise BufferSpecError(f"RawBuffer.device {self.device!r} is not 'cpu', 'cuda[:N]' or 'npu[:N]'",
                                  field="device")
        object.__setattr__(self, "ptr", int(self.ptr))
        object.__setattr__(self, "nbytes", int(self.nbytes))

    @property
    def on_host(self) -> bool:
        return self.device == "cpu"

    def host_view(self) -> np.ndarray:
        """The bytes as a writable 1-D uint8 numpy view (no copy); host memory only."""
        if not self.on_host:
            raise BufferSpecError(f"RawBuffer at {self.ptr:#x} is {self.device} memory: kvbridge can read back host "
                                  "memory only (give a tensor, or host memory, where rows are read)", field="device")
        return np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(self.ptr))

    def whole_items(self, item_bytes: int, what: str, field: str) -> int:
        """How many ``item_bytes`` items (pages, rows) the buffer holds; it must be a whole
        number, at least one (else BufferSpecError naming ``what`` and ``field``)."""
        if item_bytes <= 0 or self.nbytes < item_bytes or self.nbytes % item_bytes:
            raise BufferSpecError(f"{what}: RawBuffer of {self.nbytes} bytes is not a whole number of {item_bytes}-byte "
                                  "items", field=field)
        return self.nbytes // item_bytes


def is_raw(buf: Any) -> bool:
    return isinstance(buf, RawBuffer)
