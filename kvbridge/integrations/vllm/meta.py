"""What the scheduler side tells the worker side each step (``build_connector_meta``):
plain dataclasses, pickled by vLLM to every worker of the engine.

    SendChunk   prefill: pages of a request computed by this step's forward pass
                (``block_ids`` hold logical pages ``[first_page, first_page + len)``)
    Receive     decode: a request's room, its prefill instance and the pages to fill
                (logical ``[first_page, ...)``; the pages below are decode's own prefix hit)
    aborts      either side: requests whose room must end (vLLM aborted them)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


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


@dataclass(frozen=True)
class Receive:
    req_id: str
    room: int
    prefill_instance: str
    block_ids: tuple[int, ...]
    first_page: int
    error: str = ""  # the scheduler side refused the request's params: fail its load, naming this
    binding: bytes = b""  # the prompt's digest, presented with the claim (a room bound to another refuses it)


@dataclass
class KVBridgeMetadata(KVConnectorMetadata):
    sends: list[SendChunk] = field(default_factory=list)
    receives: list[Receive] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
