"""A rank's registered staging memory and the stager that copies between it and the pages.

Both sides of a staged transfer own one fixed buffer: decode its staging area (where remote
writes land), prefill its gather buffer (where pages are gathered before the wire). It lives
where the pages live: host memory (``HostStager``: vectorised numpy copies) for host pages,
device memory on the pages' GPU (``CudaStager``: the slice kernel) for CUDA tensors. Pages
given as ``RawBuffer`` addresses stage on the device they name (an engine's GPU pools: the
buffer goes on that GPU); pages on several devices, or another accelerator's, go direct. On GPU pages with
``staging="auto"`` a buffer is made unless the engine copies scattered slices itself (the IPC
engine: one kernel launch, nothing to save); its sizes default per device (settings.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvbridge.bootstrap.schemas import StagingDescriptor
from kvbridge.errors import ConfigError
from kvbridge.transfer.engine import TransferEngine, tensor_region
from kvbridge.transfer.staging.stagers import CudaStager, HostStager
from kvbridge.transfer.staging.area import StagingArea
from kvbridge.transfer.staging.settings import staging_sizes

log = logging.getLogger(__name__)

__all__ = ["StagingBuffer"]


class StagingBuffer:
    """``nbytes`` of registered memory cut into slots of ``slot_bytes`` (``area``), with its stager."""

    def __init__(self, nbytes: int, slot_bytes: int, *, rank: str, device: Any = None,
                 device_pages: Any = (), reserved: int = 0) -> None:
        num_slots = nbytes // slot_bytes
        if reserved and reserved >= num_slots:
            raise ConfigError(f"staging_granted_slots {reserved} would keep every one of the staging area's "
                              f"{num_slots} slots ({nbytes} B in slots of {slot_bytes} B) for grants sent with "
                              "requests: at least one must be left for chunks that ask", rank=rank,
                              field="staging_granted_slots")
        self.area = StagingArea(num_slots, slot_bytes, rank=rank, reserved=reserved)
        size = num_slots * slot_bytes
        if device is None:
            self.memory: Any = np.zeros(size, dtype=np.uint8)
            self.base = int(self.memory.ctypes.data)
            self.stager: Any = HostStager()
        else:
            import torch

            self.memory = torch.zeros(size, dtype=torch.uint8, device=device)
            self.base = int(self.memory.data_ptr())
            # the kernel copies between the pages and the slots; anything else (aux rows) by copy
            ranges = [(self.base, size), *(tensor_region(t) for t in device_pages)]
            self.stager = CudaStager(self.memory.device.index or 0, device_ranges=ranges)
        self.nbytes = size
        self._registered = False

    @classmethod
    def for_buffers(cls, tensors: Mapping[Any, Any], mode: str, nbytes: int, slot_bytes: int, *,
                    rank: str, role: str, engine: Any = None, reserved: int = 0) -> StagingBuffer | None:
        """A ``role`` rank's buffer beside ``tensors`` (the endpoint's page buffers) for staging
        ``mode``, or None when staging is off ("never"), the pages lie on several devices or on an
        accelerator other than a CUDA GPU, or they are GPU pages under "auto" and ``engine`` copies
        scattered slices itself (``direct_only``). ``nbytes``/``slot_bytes`` 0: the device's default.
        ``reserved``: the area's last slots kept for grants sent with requests (``StagingArea``)."""
        if mode == "never":
            return None
        devices = {_device_of(t) for t in tensors.values()}
        device = next(iter(devices)) if len(devices) == 1 else None
        if device is None or not (device == "cpu" or device.startswith("cuda")):
            # an operator who asked for "always" must hear that it has no effect here
            (log.warning if mode == "always" else log.info)(
                "%s: pages on %s: no staging buffer (staging %r), every write direct", rank,
                "several devices" if device is None else device, mode)
            return None
        on_gpu = device != "cpu"
        if on_gpu and mode == "auto" and getattr(engine, "direct_only", False):
            return None
        nbytes, slot_bytes = staging_sizes(role, on_gpu, nbytes, slot_bytes, rank)
        if not on_gpu:
            return cls(nbytes, slot_bytes, rank=rank, reserved=reserved)
        try:  # beside the pages, on their GPU (tensors, or device addresses an engine gave)
            return cls(nbytes, slot_bytes, rank=rank, device=device, device_pages=tensors.values(), reserved=reserved)
        except RuntimeError as exc:  # torch's out-of-memory error: the pools took the GPU
            if mode == "always":
                raise ConfigError(f"staging 'always' needs {nbytes} bytes of {device} memory for the staging buffer "
                                  f"and cannot have them ({exc}); leave room for it or set smaller staging sizes",
                                  rank=rank, field="staging_bytes") from None
            log.warning("%s: no room on %s for a %d-byte staging buffer (%s): every write direct; leave room for "
                        "it or set smaller staging sizes", rank, device, nbytes, exc)
            return None

    @property
    def on_gpu(self) -> bool:
        return not isinstance(self.memory, np.ndarray)

    @property
    def descriptor(self) -> StagingDescriptor:
        """The area as the rank registers it with the daemon (what prefill checks requests against)."""
        return StagingDescriptor(base=self.base, nbytes=self.nbytes, slot_bytes=self.area.slot_bytes)

    def slot_addr(self, slot: int) -> int:
        return self.base + self.area.offset(slot)

    def register(self, engine: TransferEngine) -> None:
        engine.register(self.base, self.nbytes)
        self._registered = True

    def unregister(self, engine: TransferEngine) -> None:
        if self._registered:
            self._registered = False
            engine.unregister(self.base)


def _device_of(buf: Any) -> str:
    """Where a page buffer lives: ``"cpu"``, ``"cuda:N"`` (a torch tensor's device, a
    ``RawBuffer``'s ``device``), or another accelerator's name."""
    device = getattr(buf, "device", None)
    if device is None:
        return "cpu"
    text = str(device)
    return f"{text}:0" if text == "cuda" else text  # (a tensor's device always has its index)
