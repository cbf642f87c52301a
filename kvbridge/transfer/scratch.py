"""A rank's scratch region: a few KiB that hold no KV, registered with its transfer engine
and described in its registration (``ScratchDescriptor``).

    [0, nbytes)                      advertised: this rank writes its memory proofs here and
                                     a prefill rank reads them back (proof by read), or, on an
                                     engine that cannot read, prefill writes an ownership nonce
                                     here (prefill/admission.py); ``kvbridge doctor`` a probe
    [nbytes, nbytes + PRIVATE_SLOTS not advertised: PRIVATE_SLOTS slots of PRIVATE_BYTES, each
     * PRIVATE_BYTES)                the source of the nonces one of this rank's probe threads
                                     writes into others' scratch, and where its proof reads land
                                     (never written from outside)

Each endpoint owns one, so that a library user's rank proves what it registered the same
way a worker's does. Host memory (numpy) by default; ``device`` puts it where the engine
reaches (CUDA IPC reaches device memory only), through torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvbridge.bootstrap.schemas import ScratchDescriptor
from kvbridge.errors import KVBridgeError, LayoutError
from kvbridge.transfer.channel.wire import NONCE_BYTES
from kvbridge.transfer.engine import TransferEngine, tensor_region

SCRATCH_BYTES = 4096
PRIVATE_BYTES = 64  # a nonce (32) or a memory proof (an Ed25519 signature, 64)
# private slots: a prefill rank's proof reads and nonce writes in flight at once, one per probe thread, so a peer
# whose engine does not answer holds one slot for the engine's timeout, not every other connection's proof
PRIVATE_SLOTS = 4

__all__ = ["PRIVATE_BYTES", "PRIVATE_SLOTS", "SCRATCH_BYTES", "Scratch", "device_of"]


class Scratch:
    """``nbytes`` advertised bytes plus ``PRIVATE_SLOTS`` private slots, on ``device`` ("cpu": numpy)."""

    def __init__(self, nbytes: int = SCRATCH_BYTES, device: str = "cpu") -> None:
        self.nbytes = nbytes
        self.device = device
        if device == "cpu":
            self.memory: Any = np.zeros(nbytes + PRIVATE_SLOTS * PRIVATE_BYTES, dtype=np.uint8)
        else:
            import torch

            self.memory = torch.zeros(nbytes + PRIVATE_SLOTS * PRIVATE_BYTES, dtype=torch.uint8, device=device)
        self.base, _ = tensor_region(self.memory)
        self._registered = False

    @property
    def descriptor(self) -> ScratchDescriptor:
        return ScratchDescriptor(base=self.base, nbytes=self.nbytes)

    def source(self, slot: int = 0) -> int:
        """Address of private slot ``slot``: a nonce source, or where a proof read lands (registered,
        not advertised)."""
        if not 0 <= slot < PRIVATE_SLOTS:
            raise LayoutError(f"private slot {slot} of {PRIVATE_SLOTS}", field="slot")
        return self.base + self.nbytes + slot * PRIVATE_BYTES

    def register(self, engine: TransferEngine) -> None:
        engine.register(self.base, self.nbytes + PRIVATE_SLOTS * PRIVATE_BYTES)
        self._registered = True

    def unregister(self, engine: TransferEngine) -> None:
        if self._registered:
            self._registered = False
            engine.unregister(self.base)

    def read(self, offset: int, length: int = NONCE_BYTES) -> bytes:
        """The advertised bytes ``[offset, offset + length)``; LayoutError outside them."""
        if not (isinstance(offset, int) and 0 <= offset and offset + length <= self.nbytes):
            raise LayoutError(f"offset {offset!r} + {length} lies outside the {self.nbytes}-byte scratch region",
                              field="offset")
        view = self.memory[offset:offset + length]
        return bytes(view.tobytes() if self.device == "cpu" else view.cpu().numpy().tobytes())

    def write(self, offset: int, data: bytes) -> None:
        """This rank's own bytes into ``[offset, offset + len(data))`` of the advertised region (a
        memory proof, read back by a prefill rank); LayoutError outside it."""
        if not (isinstance(offset, int) and 0 <= offset and offset + len(data) <= self.nbytes):
            raise LayoutError(f"offset {offset!r} + {len(data)} lies outside the {self.nbytes}-byte scratch region",
                              field="offset")
        src = np.frombuffer(bytes(data), dtype=np.uint8)
        if self.device == "cpu":
            self.memory[offset:offset + len(data)] = src
        else:
            import torch

            self.memory[offset:offset + len(data)].copy_(torch.from_numpy(src.copy()))
            torch.cuda.synchronize(self.memory.device)

    def landing(self, slot: int = 0) -> int:
        """Where a proof read of private slot ``slot`` lands."""
        return self.source(slot)

    def read_landing(self, length: int, slot: int = 0) -> bytes:
        at = self.source(slot) - self.base
        view = self.memory[at:at + min(length, PRIVATE_BYTES)]
        return bytes(view.tobytes() if self.device == "cpu" else view.cpu().numpy().tobytes())

    def set_source(self, nonce: bytes, slot: int = 0) -> None:
        """Put ``nonce`` where nonce writes from private slot ``slot`` read from."""
        if len(nonce) != NONCE_BYTES:
            raise KVBridgeError(f"a nonce is {NONCE_BYTES} bytes, got {len(nonce)}", field="nonce")
        data = np.frombuffer(nonce, dtype=np.uint8)
        at = self.source(slot) - self.base
        if self.device == "cpu":
            self.memory[at:at + NONCE_BYTES] = data
        else:
            import torch

            self.memory[at:at + NONCE_BYTES].copy_(torch.from_numpy(data.copy()))
            torch.cuda.synchronize(self.memory.device)


def device_of(tensors: Any) -> str:
    """Where a scratch region should live next to ``tensors`` (an endpoint's aux memory): the
    device of the first torch tensor that is not on the CPU, else "cpu"."""
    for t in tensors:
        device = getattr(t, "device", None)
        if getattr(device, "type", "cpu") not in ("cpu",):
            return str(device)
    return "cpu"
