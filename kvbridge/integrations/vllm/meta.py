"""What the scheduler side tells the worker side each step (``build_connector_meta``):
plain dataclasses, pickled by vLLM to every worker of the engine.

    SendChunk   prefill: pages of a request computed by this step's forward pass
                (``block_ids`` hold logical pages ``[first_page, first_page + len)``)
    Receive     decode: a request's room, its prefill instance and the pages to fill
                (logical ``[first_page, ...)``; the pages below are decode's own prefix hit);
                hybrid groups: each window group's blocks of the window's pages (``hybrid.py``)
    ReleaseRoom decode: a request that needs nothing of its room (a local prefix hit, a prompt
                decode computes itself, a request that finished before it loaded): the
                room's prefill ranks are told at once and free its blocks
    aborts      either side: requests whose room must end (vLLM aborted them)

And what the worker side tells the scheduler side (``build_connector_worker_meta``, aggregated
over the engine's workers by vLLM):

    KVBridgeWorkerMeta  prefill: requests whose room could not be opened or sent this step, by
                        reason: the scheduler answers them with fallback params (decode computes
                        the prompt itself), never with a room
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True)
class SendChunk:
    req_id: str
    room: int
    block_ids: tuple[int, ...]
    first_page: int
    tokens_ready: int  # tokens [0, t) exist once this step's forward pass is done
    num_tokens: int  # the prompt's tokens: what decode receives
    is_last: bool
    binding: bytes = b""  # the prompt's digest (kvbridge.room_binding): the room is opened bound to it
    windows: tuple[tuple[str, tuple[int, ...]], ...] = ()  # last chunk, hybrid: window pool -> its blocks of
    # the window's pages (hybrid.py); the pools are opened waiting for them (KVSender kind_units None); every
    # chunk, Mamba: each state pool -> the request's slot (given at the room's init, sent with the last chunk)


@dataclass(frozen=True)
class Receive:
    req_id: str
    room: int
    prefill_instance: str
    block_ids: tuple[int, ...]
    first_page: int
    error: str = ""  # the scheduler side refused the request's params: fail its load, naming this
    binding: bytes = b""  # the prompt's digest, presented with the claim (a room bound to another refuses it)
    num_tokens: int = 0  # hybrid: the prompt's tokens (the window's extent; 0: prefill says the count)
    windows: tuple[tuple[str, tuple[int, ...]], ...] = ()  # hybrid: window pool -> decode's blocks of its pages,
    # state pool -> decode's slot


@dataclass(frozen=True)
class ReleaseRoom:
    req_id: str
    room: int
    prefill_instance: str
    binding: bytes  # the prompt's digest: a bound room refuses a release with another
    reason: str


@dataclass
class KVBridgeMetadata(KVConnectorMetadata):
    sends: list[SendChunk] = field(default_factory=list)
    receives: list[Receive] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    releases: list[ReleaseRoom] = field(default_factory=list)


@dataclass
class KVBridgeWorkerMeta(KVConnectorWorkerMetadata):
    refused: dict[str, str] = field(default_factory=dict)  # request id -> why its room did not open or send

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVBridgeWorkerMeta:
        if isinstance(other, KVBridgeWorkerMeta):
            for req_id, reason in other.refused.items():
                self.refused.setdefault(req_id, reason)
        return self
