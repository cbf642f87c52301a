"""What an endpoint exposes: its pool buffers and aux rows, validated against
the pool specs, registered with the transfer engine and with the bootstrap
daemon. Buffers are keyed by (pool name, layer id), never by position."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvbridge.bootstrap.client import BootstrapClient, LeaseKeeper
from kvbridge.bootstrap.contract import RuntimeContract
from kvbridge.bootstrap.schemas import RankIdentity, RegisterRequest
from kvbridge.bootstrap.topology import AuxDescriptor, PoolDescriptor
from kvbridge.errors import BufferSpecError, KVBridgeError
from kvbridge.layout import AuxSchema, BufferDesc, PoolSpec, describe_buffer
from kvbridge.transfer.engine import TransferEngine, tensor_region

log = logging.getLogger(__name__)


class EndpointBuffers:
    """One buffer per (pool, layer id) of every spec; checked on construction."""

    def __init__(self, specs: Mapping[str, PoolSpec], buffers: Mapping[tuple[str, int], Any], rank: str) -> None:
        expected = {(p, layer) for p, spec in specs.items() for layer in spec.layer_ids}
        missing = sorted(expected - set(buffers))
        extra = sorted(set(buffers) - expected)
        if missing or extra:
            raise BufferSpecError(f"buffers missing {missing[:4]} / unexpected {extra[:4]} (keyed by (pool, layer id))",
                                  rank=rank, field="buffers")
        self.tensors = dict(buffers)
        self.descs = [describe_buffer(specs[p], layer, buffers[(p, layer)]) for p, layer in sorted(expected)]
        self.min_capacity = min(d.capacity_pages for d in self.descs)
        self._registered: list[int] = []

    def register(self, engine: TransferEngine) -> None:
        for key in sorted(self.tensors):
            ptr, nbytes = tensor_region(self.tensors[key])
            engine.register(ptr, nbytes)
            self._registered.append(ptr)

    def register_extra(self, engine: TransferEngine, ptr: int, nbytes: int) -> None:
        """Another region this endpoint exposes (decode's aux rows), withdrawn with the rest."""
        engine.register(ptr, nbytes)
        self._registered.append(ptr)

    def unregister(self, engine: TransferEngine) -> None:
        while self._registered:
            engine.unregister(self._registered.pop())


class AuxStaging:
    """Registered rows from which a prefill rank writes aux rows, one slot per room.

    Host memory by default. ``device="cuda:N"`` puts them in GPU memory, for
    transports that only move device memory (Mooncake's intra-node NVLink
    transport refuses to register host memory)."""

    def __init__(self, schema: AuxSchema, num_slots: int, device: str = "cpu") -> None:
        self.schema = schema
        self.device = device
        if device == "cpu":
            self.rows: Any = np.zeros((num_slots, schema.row_bytes), dtype=np.uint8)
        else:
            import torch

            self.rows = torch.zeros((num_slots, schema.row_bytes), dtype=torch.uint8, device=device)
        self._base, self._nbytes = tensor_region(self.rows)
        self._registered = False
        self._free = list(range(num_slots - 1, -1, -1))
        self._by_room: dict[int, int] = {}

    @property
    def desc(self) -> AuxDescriptor:
        return AuxDescriptor(base=self._base, capacity_rows=self.rows.shape[0], row_bytes=self.schema.row_bytes)

    def register(self, engine: TransferEngine) -> None:
        engine.register(self._base, self._nbytes)
        self._registered = True

    def unregister(self, engine: TransferEngine) -> None:
        if self._registered:
            self._registered = False
            engine.unregister(self._base)

    def stage(self, room: int, row: np.ndarray) -> int:
        """Copy a packed row into the room's slot; returns its address."""
        slot = self._by_room.get(room)
        if slot is None:
            if not self._free:
                raise KVBridgeError(f"all {self.rows.shape[0]} aux staging slots are in use", room=room, field="aux_slots")
            slot = self._by_room[room] = self._free.pop()
        data = np.ascontiguousarray(row).view(np.uint8).reshape(-1)
        if isinstance(self.rows, np.ndarray):
            self.rows[slot] = data
        else:  # a blocking host-to-device copy: the row is in place before any write reads it
            import torch

            self.rows[slot].copy_(torch.from_numpy(data.copy()))
        return self._base + slot * self.schema.row_bytes

    def release(self, room: int) -> None:
        slot = self._by_room.pop(room, None)
        if slot is not None:
            self._free.append(slot)


def unregister_quietly(engine: TransferEngine, *regions: EndpointBuffers | AuxStaging) -> None:
    """Withdraw an endpoint's memory at close; an engine that is already closed has none left."""
    for region in regions:
        try:
            region.unregister(engine)
        except KVBridgeError as exc:
            log.warning("unregistering at close: %s", exc)


def pool_descriptors(descs: list[BufferDesc]) -> list[PoolDescriptor]:
    return [PoolDescriptor(pool=d.pool, layer_id=d.layer_id, base=d.base, capacity_pages=d.capacity_pages,
                           bytes_per_page=d.bytes_per_page) for d in descs]


def register_rank(
    client: BootstrapClient,
    config: Any,
    role: str,
    endpoint: str,
    session: str,
    descs: list[BufferDesc],
    aux: AuxDescriptor | None,
    contract: RuntimeContract,
    lease_ttl: float,
) -> LeaseKeeper:
    """Register this rank with the daemon and keep its lease alive."""
    identity = RankIdentity(
        instance=config.instance, role=role,
        dp_size=config.dp_size, cp_size=getattr(config, "cp_size", 1), tp_size=config.tp_size,
        pp_size=getattr(config, "pp_size", 1), dp_rank=config.dp_rank, cp_rank=getattr(config, "cp_rank", 0),
        tp_rank=config.tp_rank, pp_rank=getattr(config, "pp_rank", 0),
    )
    request = RegisterRequest(rank=identity, control_endpoint=endpoint, session_id=session,
                              pools=pool_descriptors(descs), aux=aux, contract=contract, lease_ttl_s=lease_ttl)
    registration = client.register(request)
    return LeaseKeeper(client, registration).start()
