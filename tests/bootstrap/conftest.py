"""Fixtures for the bootstrap tests (the daemon fixtures live in tests/conftest.py)."""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from kvbridge.bootstrap import digest
from kvbridge.bootstrap.contract import RuntimeContract, contract_from_preset
from kvbridge.bootstrap.schemas import RankIdentity, RegisterRequest
from kvbridge.bootstrap.topology import AuxDescriptor, LayerRange, PoolDescriptor
from kvbridge.layout import stage_layer_ids


@pytest.fixture(scope="module")
def http(daemon: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=daemon.url, timeout=5.0, trust_env=False) as c:
        yield c


Plain = dict[str, Any]


def _rehash(d: Plain) -> None:
    d["source"]["digest"] = digest.combine(d["source"]["files"])


def _pool(d: Plain, name: str) -> Plain:
    return next(p for p in d["pools"] if p["name"] == name)


def _set(path: str, value: Any) -> Callable[[Plain], None]:
    def apply(d: Plain) -> None:
        node = d
        *head, last = path.split(".")
        for key in head:
            node = next(p for p in node if p["name"] == key) if isinstance(node, list) else node[key]
        node[last] = value

    return apply


def _page_size(d: Plain) -> None:
    for p in d["pools"]:
        p["page_size"] = 32


def _split(d: Plain) -> None:
    _pool(d, "index").update(value_bytes_per_token=120, scale_bytes_per_token=12)


def _aux_dtype(d: Plain) -> None:
    next(f for f in d["aux"]["regions"] if f["name"] == "hidden")["dtype"] = "float16"


def _aux_width(d: Plain) -> None:
    hidden = next(f for f in d["aux"]["regions"] if f["name"] == "hidden")  # 4 more bf16: 8 more bytes per row
    hidden["shape"], hidden["nbytes"] = [hidden["shape"][0] + 4], hidden["nbytes"] + 8
    d["aux"]["row_bytes"] += 8


def _source_file(d: Plain) -> None:
    d["source"]["files"]["kvbridge/layout/pools.py"] = "0" * 64
    _rehash(d)


def _source_extra(d: Plain) -> None:
    d["source"]["files"]["engine/kv_pool.py"] = "1" * 64
    _rehash(d)


@dataclass(frozen=True)
class Mutation:
    """One changed contract field: ``apply(contract)`` returns the changed contract,
    whose diff against the original must list ``path``."""

    name: str
    change: Callable[[Plain], None]
    path: str

    def apply(self, contract: RuntimeContract) -> RuntimeContract:
        d = copy.deepcopy(contract.model_dump(mode="json"))
        self.change(d)
        return RuntimeContract.model_validate(d)


# One mutation per contract field; each must change the fingerprint and show up in the diff.
MUTATIONS = [Mutation(*m) for m in [
    ("wire-version", _set("wire_version", 99), "wire_version"),
    ("model-name", _set("model.name", "other/model"), "model.name"),
    ("model-revision", _set("model.revision", "abc123"), "model.revision"),
    ("model-target-layers", _set("model.target_layers", 3), "model.target_layers"),
    ("model-draft-layers", _set("model.draft_layers", 2), "model.draft_layers"),
    ("pool-dtype", _set("pools.target.dtype", "fp8_e5m2_with_scale"), "pools.target.dtype"),
    ("pool-abi", _set("pools.draft.abi", "int8"), "pools.draft.abi"),
    ("pool-bytes-per-token", _set("pools.target.bytes_per_token", 576), "pools.target.bytes_per_token"),
    ("pool-page-size", _page_size, "pools.index.page_size"),
    ("pool-layout", _set("pools.index.layout", "rows"), "pools.index.layout"),
    ("pool-value-scale-split", _split, "pools.index.value_bytes_per_token"),
    ("pool-kernel-abi", _set("pools.index.kernel_abi", "nsa-index-k-fp8-int8"), "pools.index.kernel_abi"),
    ("pool-layer-ids", _set("pools.target.layer_ids", [0, 2]), "pools.target.layer_ids"),
    ("cp-rule", _set("cp_rule", "contiguous"), "cp_rule"),
    ("kernel-backend", _set("kernel.attention_backend", "flashinfer"), "kernel.attention_backend"),
    ("kernel-abi", _set("kernel.abi", "mla-paged-v2"), "kernel.abi"),
    ("spec-algorithm", _set("speculative.algorithm", "eagle3"), "speculative.algorithm"),
    ("spec-hidden-size", _set("speculative.hidden_size", 4096), "speculative.hidden_size"),
    ("spec-hidden-dtype", _set("speculative.hidden_dtype", "float32"), "speculative.hidden_dtype"),
    ("spec-topk", _set("speculative.topk", 4), "speculative.topk"),
    ("aux-field-dtype", _aux_dtype, "aux.regions.hidden.dtype"),
    ("aux-row-bytes", _aux_width, "aux.row_bytes"),
    ("source-file", _source_file, "source.files.kvbridge/layout/pools.py"),
    ("source-extra-file", _source_extra, "source.files.engine/kv_pool.py"),
    ("transport", _set("transport", "nixl"), "transport"),
]]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test that takes ``mutation`` runs once per contract field."""
    if "mutation" in metafunc.fixturenames:
        metafunc.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])


@pytest.fixture
def all_mutations() -> list[Mutation]:
    return list(MUTATIONS)


@pytest.fixture(scope="session")
def small_contract() -> RuntimeContract:
    """V3.2 fp8 geometry with 2 target layers, 1 NextN layer and 16-token pages."""
    return contract_from_preset("deepseek-v3.2-fp8", num_layers=2, page_size=16, draft_layers=1)


@pytest.fixture
def instance_name() -> Callable[[str], str]:
    return lambda prefix="inst": f"{prefix}-{uuid.uuid4().hex[:8]}"


def descriptors(contract: RuntimeContract, *, base: int = 1 << 40, capacity_pages: int = 32,
                pp_layers: tuple[int, int] | None = None) -> list[PoolDescriptor]:
    """One descriptor per (pool, layer) of the contract; ``pp_layers``: a pipeline stage's layers only."""
    out = []
    for pool in contract.pools:
        ids = pool.layer_ids if pp_layers is None else stage_layer_ids(pool.to_spec(), pp_layers,
                                                                       contract.model.target_layers)
        for layer in ids:
            out.append(PoolDescriptor(pool=pool.name, layer_id=layer, base=base, capacity_pages=capacity_pages,
                                      bytes_per_page=pool.bytes_per_page))
            base += capacity_pages * pool.bytes_per_page
    return out


_SESSION_PORTS: dict[tuple[str, tuple[int, int, int, int]], int] = {}


def session_port(instance: str, coords: tuple[int, int, int, int]) -> int:
    """A loopback port of its own for each rank (instance, coordinates) of the test session: a
    session is ``127.0.0.1:port`` in canonical form (bootstrap/endpoints.py), and one process
    per rank means one session each; the same rank gets the same port when it registers again."""
    key = (instance, coords)
    if key not in _SESSION_PORTS:
        _SESSION_PORTS[key] = 10_000 + len(_SESSION_PORTS) % 55_000
    return _SESSION_PORTS[key]


def make_register(
    contract: RuntimeContract,
    instance: str,
    role: str = "prefill",
    *,
    sizes: tuple[int, int, int, int] = (1, 1, 1, 1),
    coords: tuple[int, int, int, int] = (0, 0, 0, 0),
    lease_ttl_s: float | None = None,
    pp_layers: tuple[int, int] | None = None,
) -> RegisterRequest:
    """A rank's registration; a prefill pipeline stage (pp_size > 1) declares ``pp_layers``
    (default: the target layers split evenly, in stage order) and describes those layers only."""
    dp_size, cp_size, tp_size, pp_size = sizes
    dp, cp, tp, pp = coords
    if pp_layers is None and pp_size > 1 and role == "prefill":
        n = contract.model.target_layers
        pp_layers = (n * pp // pp_size, n * (pp + 1) // pp_size)
    rank = RankIdentity(instance=instance, role=role, dp_size=dp_size, cp_size=cp_size, tp_size=tp_size, pp_size=pp_size,
                        dp_rank=dp, cp_rank=cp, tp_rank=tp, pp_rank=pp,
                        pp_layers=None if pp_layers is None else LayerRange(start=pp_layers[0], end=pp_layers[1]))
    port = 20000 + (dp * 1000 + cp * 100 + tp * 10 + pp)
    return RegisterRequest(
        rank=rank,
        control_endpoint=f"tcp://127.0.0.1:{port}",
        session_id=f"127.0.0.1:{session_port(instance, coords)}",  # one process per rank: its own session
        pools=descriptors(contract, pp_layers=pp_layers),
        aux=AuxDescriptor(base=1 << 44, capacity_rows=64, row_bytes=contract.aux.row_bytes),
        contract=contract,
        lease_ttl_s=lease_ttl_s,
    )


def all_coords(sizes: tuple[int, int, int, int]) -> list[tuple[int, int, int, int]]:
    dp_size, cp_size, tp_size, pp_size = sizes
    return [(d, c, t, p) for d in range(dp_size) for c in range(cp_size) for t in range(tp_size) for p in range(pp_size)]


@pytest.fixture(scope="session")
def kvb() -> Any:
    """Helpers as one object (conftest functions are not importable from tests)."""

    class Helpers:
        register_request = staticmethod(make_register)
        descriptors = staticmethod(descriptors)
        all_coords = staticmethod(all_coords)

        @staticmethod
        def body(req: RegisterRequest) -> dict[str, Any]:
            return req.model_dump(mode="json", exclude_none=True)

        @staticmethod
        def lookup_body(contract: RuntimeContract, prefill: str, room: int, *, decode: str = "decode-x",
                        dp_rank: int | None = None) -> dict[str, Any]:
            body: dict[str, Any] = {
                "prefill_instance": prefill,
                "room": room,
                "contract": contract.model_dump(mode="json"),
                "rank": {"instance": decode, "role": "decode"},
            }
            if dp_rank is not None:
                body["dp_rank"] = dp_rank
            return body

    return Helpers


@pytest.fixture(scope="session")
def etcd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real three-member etcd cluster (Debian's etcd-server) on free loopback ports, shared
    by the session (it starts in a few seconds, once); each test keeps its keys under a
    prefix of its own. Stopped at the end with a deadline, then SIGKILL."""
    from kvbridge.chaos.etcd import EtcdCluster, etcd_binary

    etcd_binary()  # ConfigError naming the package when etcd is missing
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd"), members=3).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def etcd_prefix() -> str:
    return f"/kvbridge-test-{uuid.uuid4().hex[:8]}/"
