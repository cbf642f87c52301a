"""The engine registry is the one list of engines: every other list, choice and label is derived
from it, an engine must say what it is, and a prefill rank's staging thresholds are its engine's
entry's (no class-name match)."""

from __future__ import annotations

import argparse
import inspect
from types import SimpleNamespace

import numpy as np
import pytest

from kvbridge.errors import ConfigError
from kvbridge.layout import PathThresholds, choose_path
from kvbridge.transfer.engine import ENGINE_KINDS, JobEngine, LocalFabric, TransferEngine, create_engine
from kvbridge.transfer.engine.faulty import FaultyEngine
from kvbridge.transfer.engine.jobs import JobTable
from kvbridge.transfer.engine.registry import (
    ENGINES,
    GPU_PAGE_SIZED,
    KINDS,
    NIXL_PAGE_SIZED,
    PAGE_SIZED,
    TCP_PAGE_SIZED,
    EngineEntry,
    engine_entry,
    engine_names,
    entry_of,
    route_key,
    staging_thresholds,
)
from kvbridge.transfer.prefill.endpoint import PrefillEndpoint


def _sub(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _choices(parser: argparse.ArgumentParser, name: str) -> tuple[str, ...]:
    """The choices of ``--engine`` of ``kvbridge name``."""
    (action,) = [a for a in _sub(parser, name)._actions if "--engine" in a.option_strings]
    return tuple(action.choices) if action.choices is not None else ()


def test_every_list_of_engines_is_the_registry():
    names = tuple(ENGINES)
    assert ENGINE_KINDS == engine_names() == names == ("mooncake", "nixl", "ipc", "auto", "local")
    assert engine_names("network") == ("mooncake", "nixl")
    # create_engine's documented kinds are generated from the table: each entry, once
    doc = inspect.getdoc(create_engine) or ""
    for e in ENGINES.values():
        assert doc.count(f"``{e.name}`` ({e.kind}, transport ``{e.transport}``") == 1, e.name
    # the command line: every --engine choice comes from the registry
    from kvbridge.cli.bench import ENGINES as BENCH_ENGINES
    from kvbridge.cli.main import build_parser
    from kvbridge.worker.config import SETTINGS

    parser = build_parser()
    for worker in ("prefill-worker", "decode-worker"):  # the settings validate; the metavar lists them
        (action,) = [a for a in _sub(parser, worker)._actions if "--engine" in a.option_strings]
        assert action.metavar == "{" + ",".join(names) + "}"
    assert BENCH_ENGINES == engine_names("network", "same-host", "composite")
    assert _choices(parser, "chaos") == engine_names("network")
    assert set(_choices(parser, "demo")) <= set(names)
    (engine,) = [s for s in SETTINGS if s.name == "engine"]
    assert engine.choices == names and all(e.description in engine.help for e in ENGINES.values())


def test_the_integrations_settings_take_the_registry_names():
    import kvbridge

    assert kvbridge.engine_names is engine_names
    # the SGLang and vLLM settings (their packages import without their engines: settings only)
    from kvbridge.integrations.sglang import settings as sglang_settings

    assert sglang_settings.ENGINES == engine_names("network")
    assert "KVBRIDGE_ENGINE" in dict(sglang_settings.ENVIRONMENT)
    vllm_settings = pytest.importorskip("kvbridge.integrations.vllm.settings")
    assert vllm_settings.ENGINES == engine_names("network")
    assert vllm_settings.EXTRA_KEYS["engine"][0] == "KVBRIDGE_ENGINE"


def test_every_entry_names_a_class_that_declares_the_entrys_transport():
    """The contract's ``transport`` is what the engine declares; the entry carries the same label,
    and its direct_only flag is the class's."""
    for e in ENGINES.values():
        assert e.kind in KINDS
        module, _, attr = e.class_path.partition(":")
        cls = __import__(module, fromlist=[attr])
        cls = getattr(cls, attr)  # imports the adapter's module only (Mooncake and NIXL load inside __init__)
        assert issubclass(cls, TransferEngine), e.name
        assert f"{cls.__module__}:{cls.__qualname__}" == e.class_path
        assert cls.transport == e.transport, e.name
        assert cls.direct_only == e.direct_only, e.name
        assert callable(e.load())


@pytest.mark.parametrize("name", ["local", "ipc"])
def test_the_contract_transport_of_a_built_engine_is_its_entrys(name):
    """Built through create_engine, the engine is its entry's, and the contract an endpoint stamps
    (``contract.with_transport(engine.transport)``) carries the entry's label."""
    from kvbridge.worker.resources import build_contract

    engine = create_engine(name)
    try:
        assert entry_of(engine) is engine_entry(name)
        contract = build_contract("deepseek-v3.2-fp8", 2, 4, 1, "interleaved").with_transport(engine.transport)
        assert contract.transport == engine_entry(name).transport
    finally:
        engine.close()


def test_an_engine_that_does_not_say_its_transport_does_not_construct():
    class Anonymous(JobEngine):  # everything but the transport
        max_slices_per_call = 8
        session_id = "anon"

        def __init__(self) -> None:
            self._jobs = JobTable("anonymous")

        def register(self, ptr: int, nbytes: int) -> None: ...

        def unregister(self, ptr: int) -> None: ...

        def submit_write(self, session, src, dst, length, *, after=None) -> int:
            return 0

        def close(self) -> None: ...

    with pytest.raises(TypeError, match="transport"):
        Anonymous()

    class Declared(Anonymous):
        transport = "anon"

    assert Declared().transport == "anon"
    with pytest.raises(ConfigError, match="Declared is not a registered transfer engine"):
        entry_of(Declared())


def test_nixl_has_its_own_measured_thresholds_and_the_endpoint_looks_them_up():
    assert staging_thresholds("nixl") is NIXL_PAGE_SIZED != PAGE_SIZED
    assert staging_thresholds("mooncake") is PAGE_SIZED and staging_thresholds("mooncake-gpu") is GPU_PAGE_SIZED
    assert staging_thresholds("local") is PAGE_SIZED and staging_thresholds("ipc") is None
    assert staging_thresholds("nixl-gpu") is GPU_PAGE_SIZED  # not measured for NIXL: the rule it ran under
    # 3,000 scattered 41,984 B pages: staged on Mooncake TCP, direct on NIXL (measured: UCX moves them
    # faster than gather + write + scatter, docs/engines.md)
    pages = 3000
    assert choose_path(pages, staging_thresholds("mooncake"), mean_slice_bytes=41_984) == "staged"
    assert choose_path(pages, staging_thresholds("nixl"), mean_slice_bytes=41_984) == "direct"

    from kvbridge.transfer.engine.nixl import NixlEngine

    class Nixlish(NixlEngine):  # a NIXL engine by class (registry lookup through the MRO), never started
        def __init__(self) -> None:
            pass

    class MooncakeLookalike:  # a name that the class-name match took for Mooncake
        transport = "mooncake"

    def kind(engine: object, on_gpu: bool = False) -> str:
        shell = SimpleNamespace(engine=engine, gather=SimpleNamespace(on_gpu=on_gpu))
        return PrefillEndpoint._engine_kind(shell, "peer")  # type: ignore[arg-type]

    assert kind(Nixlish()) == "nixl" and kind(Nixlish(), on_gpu=True) == "nixl-gpu"
    with pytest.raises(ConfigError, match="not a registered transfer engine"):
        kind(MooncakeLookalike())
    fabric = LocalFabric()
    local = create_engine("local", fabric=fabric)
    try:
        assert kind(local) == "local" and kind(local, on_gpu=True) == "local-gpu"
        assert staging_thresholds("local-gpu") is PAGE_SIZED  # no GPU thresholds of its own: the host's
        faulty = FaultyEngine(local, 1)  # a wrapper routes as the engine it wraps
        assert kind(faulty) == "local" and faulty.transport == "local"
    finally:
        local.close()


def test_the_path_is_pinned_per_transport_at_the_peer_bench_cells():
    """Thresholds are per engine *and* transport: Mooncake over TCP stages a target of 64 slices
    or more of at most 48 KiB (the SGLang peer bench's 41,984 B pages, staged measured faster from
    32 slices; the vLLM peer bench's MLA rooms of 18,432 B slices, from 513; docs/engines.md) and
    stages the vLLM peer bench's GQA rooms (64 KiB slices) from 1,024 slices (slower staged at 513,
    faster from 1,025), while Mooncake's other transports keep the engine's rules (host pages staged
    from 2,048 page-sized slices, GPU pages from 512). The route names the transport as a Mooncake
    engine reports it (``mooncake/<protocol>``, MC_FORCE_TCP read as TCP), through the endpoint's
    look-up, for plain Mooncake and the auto engine's Mooncake part alike."""
    page = 64 * 656  # the bench's 41,984 B fp8 latent page: one slice per page and layer
    # (tokens, layers, CP): a CP rank's target carries its share of the pages of every layer
    cells = [(n, layers, cp) for n in (1024, 8192, 32768) for layers in (4, 16, 61) for cp in (1, 2)]

    def path(route: str, n: int, layers: int, cp: int) -> str:
        return choose_path(n // 64 // cp * layers, staging_thresholds(route), mean_slice_bytes=page)

    for route in ("mooncake/tcp", "auto/tcp"):
        got = {c: path(route, *c) for c in cells}
        assert got == {c: "staged" if c[0] // 64 // c[2] * c[1] >= 64 else "direct" for c in cells}, route
        # the SGLang peer bench: every goal cell at its 16 layers staged (128 slices a rank and more);
        # --quick's 1K at 4 layers staged at CP 1 (64 slices), direct at CP 2 (32 a rank)
        assert {got[(n, 16, cp)] for n in (1024, 8192, 32768) for cp in (1, 2)} == {"staged"}
        assert (got[(1024, 4, 1)], got[(1024, 4, 2)]) == ("staged", "direct")
    # the vLLM peer bench's rooms (scripts/vllm_peer_bench.py): slices and bytes of a prefill target
    # as its stats report them (one slice per block and layer, plus the 8-byte aux slice)
    vllm = {("mla", 1024): (513, 9_437_192), ("mla", 2048): (1025, 18_874_376), ("mla", 4096): (2049, 37_748_744),
            ("mla", 6144): (3065, 56_623_112), ("mla", 8192): (4097, 75_497_480), ("mla", 32768): (16385, 301_989_896),
            ("gqa", 8192): (1025, 67_108_872), ("gqa", 32768): (4081, 268_435_464)}  # fmt: skip
    for route in ("mooncake/tcp", "auto/tcp"):
        rule = staging_thresholds(route)
        got = {cell: choose_path(n, rule, mean_slice_bytes=nbytes // n) for cell, (n, nbytes) in vllm.items()}
        # every cell staged: MLA from 513 slices, GQA's 64 KiB slices from 1,025 (the wider rule)
        assert got == {cell: "staged" for cell in vllm}, (route, got)
        assert choose_path(513, rule, mean_slice_bytes=67_108_872 // 1025) == "direct"  # GQA at 4K: direct
    assert TCP_PAGE_SIZED == PathThresholds(min_slices=64, max_mean_slice_bytes=48 << 10,
                                            wider=PathThresholds(min_slices=1024, max_mean_slice_bytes=72 << 10))
    # SGLang's page and an 18,432 B slice stage from 64 on; a 64 KiB slice from 1,024 (a mean up to
    # 72 KiB: some blocks merged, as the 32K cell's 4,081 slices); larger never
    for page_bytes in (41_984, 18_432):
        assert choose_path(63, TCP_PAGE_SIZED, mean_slice_bytes=page_bytes) == "direct"
        assert choose_path(64, TCP_PAGE_SIZED, mean_slice_bytes=page_bytes) == "staged"
    assert choose_path(1023, TCP_PAGE_SIZED, mean_slice_bytes=64 << 10) == "direct"
    assert choose_path(1024, TCP_PAGE_SIZED, mean_slice_bytes=64 << 10) == "staged"
    assert choose_path(1 << 20, TCP_PAGE_SIZED, mean_slice_bytes=72 << 10) == "staged"
    assert choose_path(1 << 20, TCP_PAGE_SIZED, mean_slice_bytes=(72 << 10) + 1) == "direct"
    for route in ("mooncake", "mooncake/rdma", "auto/rdma"):  # the engine's host rule: 2,048 slices
        got = {c: path(route, *c) for c in cells}
        assert got[(1024, 16, 1)] == "direct" and got[(8192, 16, 1)] == got[(32768, 61, 2)] == "staged", route
        assert all(p == ("staged" if c[0] // 64 // c[2] * c[1] >= 2048 else "direct") for c, p in got.items())
    # GPU pages: TCP has no GPU rule of its own (not measured), so it takes the engine's GPU rule
    assert staging_thresholds("mooncake/tcp-gpu") is staging_thresholds("mooncake/nvlink_intra-gpu") is GPU_PAGE_SIZED
    assert staging_thresholds("mooncake/rdma") is staging_thresholds("mooncake") is PAGE_SIZED
    assert staging_thresholds("nixl/ucx") is NIXL_PAGE_SIZED  # a transport without a rule: the engine's
    assert staging_thresholds("ipc/cuda") is None  # direct only, whatever carries it

    from kvbridge.transfer.engine.auto import AutoEngine
    from kvbridge.transfer.engine.mooncake import MooncakeEngine

    class Mooncakeish(MooncakeEngine):  # a Mooncake engine by class, never started: its protocol only
        def __init__(self, protocol: str) -> None:
            self.protocol, self.max_slices_per_call = protocol, 1024

    class Autoish(AutoEngine):  # the auto engine with no IPC part: every peer over its Mooncake part
        def __init__(self, mooncake: MooncakeEngine) -> None:
            self._mc, self._ipc = mooncake, None

    def kind(engine: object, on_gpu: bool = False) -> str:
        shell = SimpleNamespace(engine=engine, gather=SimpleNamespace(on_gpu=on_gpu))
        return PrefillEndpoint._engine_kind(shell, "peer")  # type: ignore[arg-type]

    tcp, rdma = Mooncakeish("tcp"), Mooncakeish("rdma")
    assert kind(tcp) == kind(Autoish(tcp)) == kind(FaultyEngine(tcp, 1)) == "mooncake/tcp"
    assert kind(tcp, on_gpu=True) == "mooncake/tcp-gpu" and kind(rdma) == kind(Autoish(rdma)) == "mooncake/rdma"
    n = 1024 // 64 * 61  # 1K tokens, 61 layers, CP 1: 976 slices
    assert choose_path(n, staging_thresholds(kind(tcp)), mean_slice_bytes=page) == "staged"
    assert choose_path(n, staging_thresholds(kind(rdma)), mean_slice_bytes=page) == "direct"
    with pytest.raises(ConfigError, match="want an engine's name, or name/transport"):
        route_key("mooncake/", on_gpu=False)
    with pytest.raises(ConfigError, match="unknown transfer engine 'tcp'"):
        route_key("tcp/mooncake", on_gpu=False)


def test_bad_names_and_entries_are_named_errors():
    with pytest.raises(ConfigError, match="unknown transfer engine 'nccl'; choose one of mooncake, nixl"):
        engine_entry("nccl")
    with pytest.raises(ConfigError, match="unknown transfer engine 'rdma'"):
        staging_thresholds("rdma")
    with pytest.raises(ConfigError, match="unknown engine kind 'fast'"):
        engine_names("fast")
    with pytest.raises(ConfigError, match="unknown transfer engine"):
        route_key("nccl", on_gpu=False)
    with pytest.raises(ConfigError, match="kind 'wire'"):
        EngineEntry("x", "m:C", "wire", "x", "", (), 1)
    with pytest.raises(ConfigError, match="direct only and has staging thresholds"):
        EngineEntry("x", "m:C", "network", "x", "", (), 1, direct_only=True,
                    staging=PathThresholds(min_slices=1, max_mean_slice_bytes=1))
    assert np.all([engine_entry(n).max_slices_per_call > 0 for n in ENGINES])
