"""DeepSeek-V4 in model mode: a tiny random ``DeepseekV4ForCausalLM`` (HCA and CSA layers,
indexer on) prefills, its cache is written into kvbridge's window, compressed and state
pools, each chunk sends what ``chunk_extent`` gives it (planned by ``plan_kind``, written by
a transfer engine), and decode rebuilds its cache from what arrived: logits and tokens
bit-equal with the colocated run, and the bytes moved equal to what decode needs
(``needed_bytes``). The model has no NextN layer in transformers, so no draft pool here."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.models.deepseek_v4")

import kvbridge as kvb  # noqa: E402
from kvbridge.integrations.transformers.v4 import run_v4_request, tiny_v4_model  # noqa: E402
from kvbridge.transfer.engine import LocalFabric, create_engine, mooncake_available  # noqa: E402

@pytest.fixture(scope="module")
def v4_model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the demo: one thread count on both sides, and quick on a loaded host
    yield tiny_v4_model()
    torch.set_num_threads(threads)


def _engines(kind):
    if kind == "local":
        fabric = LocalFabric()
        return create_engine("local", fabric=fabric), create_engine("local", fabric=fabric)
    return create_engine("mooncake"), create_engine("mooncake")


def _run(model, n, cuts, engine_kind):
    from kvbridge.integrations.transformers.v4 import v4_specs
    from kvbridge.transfer.decode.kinds import KindLedger

    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
    engines = _engines(engine_kind)
    reports: list = []
    try:
        r = run_v4_request(model, ids, list(cuts), engines, steps=3, reports=reports)
    finally:
        for e in engines:
            e.close()
    assert r["bytes_moved"] == r["bytes_needed"]
    assert r["logits_equal"] and r["tokens_equal"]
    # decode's ledger, fed what each chunk reported: complete, each kind counted once
    ledger = KindLedger(n, v4_specs(model.config, page_size=4), n)
    for pool, units, last in reports:
        ledger.record_units(pool, units, last=last, rank="cp0")
    assert ledger.complete, ledger.missing()


@pytest.mark.parametrize("n, cuts", [
    (9, ()),  # shorter than the window, no complete HCA window, two complete CSA windows
    (45, ()),  # longer than the window, not a multiple of 4 or 32
    (131, (40, 96)),  # chunked, chunks not on page or window boundaries; 4 HCA entries and a tail of 3
    (64, (32,)),  # on every boundary: empty tails
])
def test_v4_disaggregated_equals_colocated(v4_model, n, cuts):
    _run(v4_model, n, cuts, "local")


@pytest.mark.mooncake
@pytest.mark.skipif(not mooncake_available(), reason="Mooncake not importable")
def test_v4_over_mooncake(v4_model):
    _run(v4_model, 77, (50,), "mooncake")


def test_the_v4_demo_reports_every_request(v4_model):
    from kvbridge.demo_v4 import format_v4_summary, run_v4_demo

    summary = run_v4_demo([13, 1], chunk_tokens=5, steps=2, engine="local")
    assert summary["requests"] == summary["requests_ok"] == summary["tokens_equal"] == 2
    assert "requests 2: ok 2" in format_v4_summary(summary)


def test_v4_decode_needs_a_fraction_of_v32_bytes():
    """The bytes decode needs per request, from the layout: V4 against V3.2 (bf16, same tokens)."""
    v4 = kvb.deepseek_v4_pools()
    v32 = kvb.preset_pools("deepseek-v3.2")
    ratios = [sum(kvb.needed_bytes(s, n) for s in v4.values()) / sum(kvb.needed_bytes(s, n) for s in v32.values())
              for n in (1024, 8192, 32768, 131072)]
    assert all(0 < r < 0.2 for r in ratios) and np.all(np.diff(ratios) < 0)


@pytest.mark.skipif(not mooncake_available(), reason="Mooncake not installed")
def test_v4_through_the_rooms_tokens_and_logits_equal(v4_model, daemon):
    """The same requests through a prefill and a decode endpoint (rooms, a bootstrap daemon): the
    window's pages on the room's mapping, entries and state on their units, the first token from
    the aux row; logits bit-equal, bytes posted (less the aux row) = what decode needs."""
    from kvbridge.integrations.transformers.v4_rooms import V4Rooms

    rooms = V4Rooms(v4_model, daemon.url, engine="mooncake")
    try:
        for n, cuts in ((9, ()), (131, (40, 96))):
            ids = torch.randint(0, v4_model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
            r = rooms.run(ids, list(cuts), steps=3)
            assert r["bytes_moved"] == r["bytes_needed"], r
            assert r["logits_equal"] and r["tokens_equal"], r
    finally:
        rooms.close()


def test_v4_cp2_through_the_rooms_tokens_and_logits_equal(v4_model, daemon):
    """Prefill CP 2 through the rooms (two prefill endpoints, CP attention simulated), by the rule of
    docs/concepts.md: V4's compressed pools need replicated lanes, so rank 0 sends every window
    page, entry and state slot (and the aux row), rank 1 takes part in the room and sends nothing;
    interleaved lanes are refused at construction, naming cp_size. Prompts shorter and longer than
    the window, not a multiple of 4 or of the HCA ratio, chunked: logits bit-equal, bytes = needed."""
    from kvbridge.integrations.transformers.v4_rooms import V4Rooms

    with pytest.raises(kvb.ConfigError) as refused:
        V4Rooms(v4_model, daemon.url, engine="local", cp_size=2, lane_rule="interleaved", instance="v4-cp2-lanes")
    assert refused.value.field == "cp_size"
    rooms = V4Rooms(v4_model, daemon.url, engine="local", cp_size=2, instance="v4-cp2")
    try:
        for n, cuts in ((9, ()), (45, ()), (131, (40, 97))):
            ids = torch.randint(0, v4_model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
            r = rooms.run(ids, list(cuts), steps=3)
            assert r["bytes_per_rank"] == [r["bytes_needed"], 0], r
            assert r["logits_equal"] and r["tokens_equal"], r
    finally:
        rooms.close()


def test_replicated_lanes_send_every_kind_unit_from_rank_0_only():
    """``lane_units`` under replicated lanes: rank 0 sends each unit (as it sends every page), the
    others none: no unit is posted twice."""
    lanes = kvb.OwnerLanes(2, "replicated")
    for spec in kvb.deepseek_v4_pools(4, 16, sliding_window=16, draft_layers=0).values():
        ext = kvb.needed_extent(spec, 300)
        got = [kvb.lane_units(spec, ext, lanes, r, 300, 16) for r in (0, 1)]
        assert got[0].tolist() == list(range(ext.first, ext.stop)) and not len(got[1]), spec.name
