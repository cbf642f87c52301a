"""What an endpoint exposes: its pool buffers and aux rows, validated against
the pool specs, registered with the transfer engine and with the bootstrap
daemon. Buffers are keyed by (pool name, layer id), never by position."""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Mapping
from typing import Any


from kvbridge.bootstrap.client import BootstrapClient, LeaseKeeper
from kvbridge.bootstrap.contract import RuntimeContract
from kvbridge.bootstrap.schemas import RankIdentity, RegisterRequest, ScratchDescriptor, StagingDescriptor
from kvbridge.bootstrap.topology import LayerRange, PoolDescriptor
from kvbridge.errors import BufferSpecError, ConfigError, KVBridgeError
from kvbridge.layout import BufferDesc, PoolSpec, RawBuffer, describe_buffer
from kvbridge.layout.kinds import check_kind_topology, kind_specs
from kvbridge.transfer.aux_rows import AuxBuffers
from kvbridge.transfer.engine import TransferEngine, tensor_region

log = logging.getLogger(__name__)

# the pool kinds the room endpoints carry (kvbridge.layout.pools.KINDS lists every kind planned);
# an integration checks its pools against this before it opens an endpoint
ROOM_POOL_KINDS: frozenset[str] = frozenset({"paged", "window", "compressed", "state"})


def check_kind_config(specs: Mapping[str, PoolSpec], *, rank: str, pp_size: int = 1, cp_size: int = 1,
                      lane_rule: str = "interleaved") -> None:
    """Refuse at construction, by name, what the rooms do not carry for the window, compressed and
    state pools (docs/concepts.md, "Pool kinds in the rooms"). Both sides call it: prefill with its
    CP lanes. Staged and direct writes, layer ranges, pipeline stages and digests (per unit,
    ``transfer/digest.py``) all carry every kind (``pp_size`` is accepted for the callers' symmetry)."""
    kinds = kind_specs(specs)
    if not kinds:
        return
    try:
        check_kind_topology(list(kinds.values()), cp_size, lane_rule)
    except KVBridgeError as exc:
        raise ConfigError(exc.reason, rank=rank, field=exc.field or "cp_size") from None
    # (a paged window's page is a token page: the contract gives every token-paged pool one page
    # size, so its owner lane is the token page's)


class EndpointBuffers:
    """One buffer per (pool, layer id) of every spec (a tensor, an array or a ``RawBuffer``);
    checked on construction."""

    def __init__(self, specs: Mapping[str, PoolSpec], buffers: Mapping[tuple[str, int], Any], rank: str) -> None:
        unmoved = sorted(f"{name} ({spec.kind})" for name, spec in specs.items() if spec.kind not in ROOM_POOL_KINDS)
        if unmoved:  # the rooms move token pages of one mapping; the kinds are planned in kvbridge.layout.kinds
            raise BufferSpecError(f"pools {', '.join(unmoved)} are not paged: the room endpoints move paged pools "
                                  "only (window, compressed and state pools are planned by kvbridge.layout.kinds "
                                  "but not yet carried by the rooms; docs/models.md)", rank=rank, field="kind")
        expected = {(p, layer) for p, spec in specs.items() for layer in spec.layer_ids}
        missing = sorted(expected - set(buffers))
        extra = sorted(set(buffers) - expected)
        if missing or extra:
            raise BufferSpecError(f"buffers missing {missing[:4]} / unexpected {extra[:4]} (keyed by (pool, layer id))",
                                  rank=rank, field="buffers")
        try:
            self.descs = [describe_buffer(specs[p], layer, buffers[(p, layer)]) for p, layer in sorted(expected)]
        except BufferSpecError as exc:
            raise BufferSpecError(exc.reason, rank=rank, field=f"buffers.{exc.field}") from None
        # host memory given as an address is read (digests) through a [pages, bytes_per_page] view of it;
        # padded pages whose last one ends with its payload (pools.validate_buffer) stay an address
        self.tensors = {key: buf.host_view().reshape(-1, specs[key[0]].bytes_per_page)
                        if isinstance(buf, RawBuffer) and buf.on_host and not buf.nbytes % specs[key[0]].bytes_per_page
                        else buf for key, buf in buffers.items()}
        # the room's pages lie inside this: the paged pools' (a paged window may be on pages of its
        # own, an SWA pool smaller than the full KV's; on the room's pages it is checked where its
        # units are planned, transfer/prefill/kinds.py, as compressed, state and ring pools are);
        # without paged pools (DeepSeek-V4) the room's page ids index the paged windows and the
        # compressed pools, each unit checked against its own pool where planned, and an SWA pool
        # may be far smaller than the compressed KV's: the largest of them bounds the pages
        token = [d for d in self.descs if specs[d.pool].kind == "paged"]
        if token:
            self.min_capacity = min(d.capacity_pages for d in token)
        else:
            paged = [d for d in self.descs if specs[d.pool].kind == "compressed" or
                     (specs[d.pool].kind == "window" and not specs[d.pool].ring_stride)]
            self.min_capacity = max(d.capacity_pages for d in (paged or self.descs))
        self._registered: list[int] = []

    @property
    def readable(self) -> bool:
        """False when a buffer is kept as a ``RawBuffer`` (no digests from it): device memory given
        as an address, or host pages padded to a stride whose last one ends with its payload."""
        return not self.unreadable()

    def unreadable(self) -> str:
        """Why no digest can be read from these buffers ("" when every one can), naming the first."""
        for (pool, layer), t in sorted(self.tensors.items()):
            if isinstance(t, RawBuffer):
                what = ("host pages padded to a stride, given as an address whose last page ends with its payload"
                        if t.on_host else f"{t.device} memory given as an address (RawBuffer)")
                return f"pool {pool!r} layer {layer}: {what}, which kvbridge cannot read"
        return ""

    def register(self, engine: TransferEngine) -> None:
        for key in sorted(self.tensors):
            ptr, nbytes = tensor_region(self.tensors[key])
            engine.register(ptr, nbytes)
            self._registered.append(ptr)

    def unregister(self, engine: TransferEngine) -> None:
        while self._registered:
            engine.unregister(self._registered.pop())


def unregister_quietly(engine: TransferEngine, *regions: Any) -> None:
    """Withdraw an endpoint's memory at close; an engine that is already closed has none left."""
    for region in regions:
        if region is None:
            continue
        try:
            region.unregister(engine)
        except KVBridgeError as exc:
            log.warning("unregistering at close: %s", exc)


def pool_descriptors(descs: list[BufferDesc]) -> list[PoolDescriptor]:
    return [PoolDescriptor(pool=d.pool, layer_id=d.layer_id, base=d.base, capacity_pages=d.capacity_pages,
                           bytes_per_page=d.bytes_per_page) for d in descs]


def _layers(config: Any) -> LayerRange | None:
    layers = getattr(config, "pp_layers", None)
    return None if layers is None else LayerRange(start=int(layers[0]), end=int(layers[1]))


def register_rank(
    client: BootstrapClient,
    config: Any,
    role: str,
    endpoint: str,
    session: str,
    descs: list[BufferDesc],
    aux: AuxBuffers,
    contract: RuntimeContract,
    lease_ttl: float,
    scratch: ScratchDescriptor | None = None,
    staging: StagingDescriptor | None = None,
    proof_key: str | None = None,
    engine_metadata: bytes = b"",
    proof_signature: Callable[[str, tuple[int, int, int, int]], bytes] | None = None,
) -> LeaseKeeper:
    """Register this rank with the daemon and keep its lease alive. ``scratch``: the rank's
    scratch region (``transfer/scratch.py``), where its ownership is proven; ``staging``: a decode
    rank's staging area (``transfer/staging/buffer.py``), the only place staged chunks may land;
    ``proof_key``: a decode rank's ownership-proof public key (``transfer/ownership.py``);
    ``engine_metadata``: the engine's ``metadata`` (NIXL's agent; read after every register), what
    a writer loads before writing here; ``proof_signature(instance, coords)``: the proof key's
    signature of its claim (``ProofKey.sign_claim``), what lets this rank take its own lapsed claim
    back (bootstrap/lapses.py)."""
    identity = RankIdentity(
        instance=config.instance, role=role,
        dp_size=config.dp_size, cp_size=getattr(config, "cp_size", 1), tp_size=config.tp_size,
        pp_size=getattr(config, "pp_size", 1), dp_rank=config.dp_rank, cp_rank=getattr(config, "cp_rank", 0),
        tp_rank=config.tp_rank, pp_rank=getattr(config, "pp_rank", 0), pp_layers=_layers(config),
    )
    request = RegisterRequest(rank=identity, control_endpoint=endpoint, session_id=session,
                              pools=pool_descriptors(descs), aux=aux.packed_descriptor(),
                              aux_regions=aux.descriptors(), contract=contract, lease_ttl_s=lease_ttl,
                              scratch=scratch, staging=staging, proof_key=proof_key,
                              proof_signature=(proof_signature(identity.instance, identity.coords).hex()
                                               if proof_signature is not None else None),
                              engine_metadata=base64.b64encode(engine_metadata).decode())
    registration = client.register(request)
    return LeaseKeeper(client, registration).start()
