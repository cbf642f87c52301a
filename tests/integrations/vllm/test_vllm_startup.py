"""What the connector refuses when vLLM builds it, by name, before any request: in one
process, with vLLM's real config objects and its own KV tensor allocation."""

from __future__ import annotations

import pytest

import _vllm_config as C
from kvbridge import ConfigError

URL = {"bootstrap_url": "http://127.0.0.1:9"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return C.model_dir(tmp_path_factory.mktemp("m"), "gqa")


def _scheduler_side(vc):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvbridge.integrations.vllm import KVBridgeConnector

    return KVBridgeConnector(vc, KVConnectorRole.SCHEDULER, C.kv_cache_config(vc, 64))


def test_vllm_factory_loads_the_connector_by_module_path(model):
    """The JSON a user types selects our class through vLLM's own factory."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    vc = C.vllm_config(model, "kv_producer", URL)
    cls = KVConnectorFactory.get_connector_class(vc.kv_transfer_config)
    assert cls.__name__ == "KVBridgeConnector" and cls.__module__ == "kvbridge.integrations.vllm.connector"


@pytest.mark.parametrize("role,extra,field", [
    ("kv_both", URL, "kv_role"),
    ("kv_producer", {}, "kv_connector_extra_config.bootstrap_url"),
    ("kv_producer", {**URL, "bootstarp_url": "x"}, "kv_connector_extra_config.bootstarp_url"),
    ("kv_producer", {**URL, "staging": "sometimes"}, "kv_connector_extra_config.staging"),
    ("kv_consumer", {**URL, "peer_timeout": "soon"}, "kv_connector_extra_config.peer_timeout"),
    ("kv_producer", {**URL, "engine": "nccl"}, "kv_connector_extra_config.engine"),
    ("kv_producer", {**URL, "layerwise": "sometimes"}, "kv_connector_extra_config.layerwise"),
    ("kv_producer", {**URL, "layer_pass_bytes": -1}, "kv_connector_extra_config.layer_pass_bytes"),
])  # fmt: skip
def test_bad_settings_refused_by_name(model, monkeypatch, role, extra, field):
    monkeypatch.delenv("KVBRIDGE_BOOTSTRAP_URL", raising=False)
    vc = C.vllm_config(model, role, extra)
    with pytest.raises(ConfigError) as err:
        _scheduler_side(vc)
    assert err.value.field == field


def test_settings_from_the_environment_are_refused_by_their_variable(model, monkeypatch):
    """kvbridge's one settings convention: a bad value names where it came from (the variable),
    and the engine setting reaches the registry's names."""
    from kvbridge.integrations.vllm.settings import read_settings

    monkeypatch.setenv("KVBRIDGE_ENGINE", "nixl")
    assert read_settings(C.vllm_config(model, "kv_producer", URL)).engine == "nixl"
    monkeypatch.setenv("KVBRIDGE_STAGING", "sometimes")
    with pytest.raises(ConfigError, match="KVBRIDGE_STAGING='sometimes' is not one of auto, always, never") as err:
        read_settings(C.vllm_config(model, "kv_producer", URL))
    assert err.value.field == "KVBRIDGE_STAGING"
    monkeypatch.delenv("KVBRIDGE_STAGING")
    # decode's slots kept for grants sent with a room's request (docs/staging.md); prefill has none
    monkeypatch.setenv("KVBRIDGE_STAGING_GRANTED_SLOTS", "2")
    assert read_settings(C.vllm_config(model, "kv_consumer", URL)).staging_config == {
        "staging": "auto", "staging_granted_slots": 2}
    assert read_settings(C.vllm_config(model, "kv_producer", URL)).staging_config == {"staging": "auto"}
    monkeypatch.setenv("KVBRIDGE_STAGING_GRANTED_SLOTS", "-1")
    with pytest.raises(ConfigError, match="KVBRIDGE_STAGING_GRANTED_SLOTS='-1' must be at least 0") as err:
        read_settings(C.vllm_config(model, "kv_consumer", URL))
    assert err.value.field == "KVBRIDGE_STAGING_GRANTED_SLOTS"


def test_layerwise_reads_auto_by_default_then_true_or_false(model, monkeypatch):
    from kvbridge.integrations.vllm.settings import read_settings

    monkeypatch.delenv("KVBRIDGE_LAYERWISE", raising=False)
    for given, want in [(None, None), ("auto", None), ("AUTO", None), (True, True), ("false", False), ("0", False)]:
        extra = {**URL} if given is None else {**URL, "layerwise": given}
        assert read_settings(C.vllm_config(model, "kv_producer", extra)).layerwise is want, given
    monkeypatch.setenv("KVBRIDGE_LAYERWISE", "false")
    assert read_settings(C.vllm_config(model, "kv_producer", URL)).layerwise is False


@pytest.mark.parametrize("given", ["auto", True])
def test_layerwise_auto_sends_whole_rooms_where_layer_wise_measured_slower(model, monkeypatch, caplog, given):
    """The prefill worker's choice once its engine is known, on a real Mooncake engine over the
    intra-node NVLink transport (rdma with MC_INTRANODE_NVLINK; rdma starts here without a NIC):
    with GPU pools, auto turns layer-wise off and says why, true keeps it with a warning; with
    host pools both keep it, silently."""
    import logging

    from kvbridge import create_engine
    from kvbridge.integrations.vllm.settings import read_settings
    from kvbridge.integrations.vllm.worker import WorkerSide

    monkeypatch.delenv("KVBRIDGE_LAYERWISE", raising=False)
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    monkeypatch.setenv("MC_INTRANODE_NVLINK", "1")
    settings = read_settings(C.vllm_config(model, "kv_producer", {**URL, "layerwise": given}))
    engine = create_engine("mooncake", host="127.0.0.1", protocol="rdma")
    try:
        for device, kept in [("cpu", True), ("cuda:0", given is True)]:
            side = WorkerSide(settings, tp_rank=0, total_kv_heads=2, is_mla=False, num_blocks=64)
            side.engine = engine
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="kvbridge.integrations.vllm.worker"):
                side._check_layerwise(device)
            assert side.layerwise is kept, device
            said = [r for r in caplog.records if "intra-node NVLink" in r.getMessage()]
            if device == "cpu":
                assert not said
            else:
                assert len(said) == 1 and said[0].levelno == (logging.WARNING if given is True else logging.INFO)
                assert ("sends whole rooms" in said[0].getMessage()) is (given == "auto")
    finally:
        engine.close()


def test_pipeline_parallel_refused(model):
    from kvbridge.integrations.vllm.settings import read_settings

    vc = C.vllm_config(model, "kv_producer", URL)
    vc.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(ConfigError, match="pipeline parallelism") as err:
        read_settings(vc)
    assert err.value.field == "parallel_config.pipeline_parallel_size"


def test_hybrid_model_refused(model, monkeypatch):
    """A sliding-window group beside the full-attention one (the hybrid manager's shape), while the
    rooms carry paged pools only: refused naming the group and its kind."""
    import torch

    import kvbridge as kvb
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, SlidingWindowSpec

    from kvbridge.integrations.vllm import KVBridgeConnector

    monkeypatch.setattr(kvb, "ROOM_POOL_KINDS", frozenset({"paged"}), raising=False)
    vc = C.vllm_config(model, "kv_producer", URL)
    kvcc = C.kv_cache_config(vc, 64)
    kvcc.kv_cache_groups.append(KVCacheGroupSpec(["model.layers.9.self_attn.attn"], SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=64)))
    with pytest.raises(ConfigError, match=r"KV cache group 1 \(SlidingWindowSpec, layers \[9\]\) is a kvbridge "
                                          r"'window' pool") as err:
        KVBridgeConnector(vc, KVConnectorRole.SCHEDULER, kvcc)
    assert err.value.field == "kv_cache_config.kv_cache_groups[1]"


@pytest.mark.parametrize("layout,pool,per_token", [("LBNHC", "kv", 2 * 256), ("LBHNC", "kv", 2 * 256)])
def test_vllm_tensors_read_as_one_pool(model, layout, pool, per_token):
    """vLLM's own allocation: one buffer per layer, keyed by the layer index in its name."""
    import torch
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from kvbridge.integrations.vllm.cache import pool_spec, read_kv_caches

    vc = C.vllm_config(model, "kv_producer", URL, layout=layout)
    kvcc = C.kv_cache_config(vc, 64)
    caches = allocate_kv_cache(kvcc, torch.device("cpu"), KVCacheLayout[layout])
    cache = read_kv_caches(caches, kvcc.num_blocks, 16, is_mla=False)
    assert cache.layout == layout and [b.layer_id for b in cache.layers] == [0, 1, 2]
    first = caches["model.layers.1.self_attn.attn"]
    assert cache.layers[1].ptr == first.data_ptr() and cache.layers[1].nbytes == kvcc.num_blocks * cache.block_bytes
    spec = pool_spec(cache, 2, 1, 0)
    assert (spec.name, spec.bytes_per_token, spec.page_size) == (pool, per_token, 16)


def test_cross_layer_layout_refused(model):
    """Block-outermost layouts put every layer's page of a block together: refused by name."""
    import torch
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from kvbridge.integrations.vllm.cache import read_kv_caches

    vc = C.vllm_config(model, "kv_producer", URL, layout="BLNHC")
    kvcc = C.kv_cache_config(vc, 64)
    caches = allocate_kv_cache(kvcc, torch.device("cpu"), KVCacheLayout.BLNHC)
    with pytest.raises(ConfigError) as err:
        read_kv_caches(caches, kvcc.num_blocks, 16, is_mla=False)
    assert err.value.field == "kv_cache_layout"


def test_kvbridge_logs_go_through_vllms_logging_with_time_and_level(model, capfd, monkeypatch):
    """kvbridge's records reach vLLM's log with its format (level, time, file and line), INFO
    included when asked (KVBRIDGE_LOG_LEVEL); a bad level is refused by name."""
    import logging
    import re

    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    configure_logging(LoggingConfig())  # what a vLLM process does at start-up, before it builds connectors
    ours = logging.getLogger("kvbridge")
    saved = (list(ours.handlers), ours.level, ours.propagate)
    try:
        monkeypatch.setenv("KVBRIDGE_LOG_LEVEL", "INFO")
        _scheduler_side(C.vllm_config(model, "kv_producer", URL))
        logging.getLogger("kvbridge.integrations.vllm.worker").info("room 7 probe line")
        out = capfd.readouterr()
        line = next(x for x in (out.out + out.err).splitlines() if "room 7 probe line" in x)
        assert "INFO" in line and re.search(r"\d\d:\d\d:\d\d", line) and "worker" not in line.split("]")[-1], line
        monkeypatch.setenv("KVBRIDGE_LOG_LEVEL", "LOUD")
        with pytest.raises(ConfigError) as err:
            _scheduler_side(C.vllm_config(model, "kv_producer", URL))
        assert err.value.field == "KVBRIDGE_LOG_LEVEL"
    finally:
        ours.handlers[:], ours.propagate = saved[0], saved[2]
        ours.setLevel(saved[1])


def test_refusals_reach_vllms_connector_stats_by_reason(model):
    """What was refused is counted by reason in vLLM's connector stats (taken once: vLLM's scheduler
    asks every step and aggregates the workers' into them)."""
    from kvbridge.integrations.vllm import KVBridgeConnector

    connector = _scheduler_side(C.vllm_config(model, "kv_producer", URL))
    side = connector.scheduler_side
    for reason in ("room_in_use", "room_in_use", "room_refused"):
        side._count(reason, "req-1", "probe")
    stats = connector.get_kv_connector_stats()
    assert stats.reduce() == {"room_in_use": 2, "room_refused": 1} and connector.get_kv_connector_stats() is None
    workers = KVBridgeConnector.build_kv_connector_stats({"load_failed": 1, "room_in_use": 1})
    assert stats.aggregate(workers).reduce() == {"room_in_use": 3, "room_refused": 1, "load_failed": 1}
    assert side.refusals == {"room_in_use": 2, "room_refused": 1}  # the running totals stay


def test_another_checkpoint_under_the_same_name_differs_in_model_weights(model, tmp_path):
    """The contract a worker builds names the checkpoint (weights auto: the model folder's
    kvbridge.weights_digest): a copy of the model's config with weight files of its own, served
    under the same name, differs from the original in ``model.weights`` alone, which decode's
    start-up check refuses by name (``_check_prefill_contract``: any differing field); off, or a
    folder without weight files, leaves it unspecified."""
    import json
    import shutil
    from pathlib import Path

    import torch
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from kvbridge import diff_contracts
    from kvbridge.integrations.vllm.cache import pool_spec, rank_contract, read_kv_caches
    from kvbridge.integrations.vllm.settings import model_weights, read_settings

    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(Path(model) / "config.json", other / "config.json")
    data = torch.arange(64, dtype=torch.float32).numpy().tobytes()
    header = json.dumps({"w": {"dtype": "F32", "shape": [64], "data_offsets": [0, len(data)]}}).encode()
    (other / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + data)

    contracts = {}
    for name, folder, extra in (("original", model, {}), ("other", str(other), {}),
                                ("off", str(other), {"weights": "off"})):
        vc = C.vllm_config(folder, "kv_consumer", {**URL, **extra})
        vc.model_config.served_model_name = "tiny"
        s = read_settings(vc)
        kvcc = C.kv_cache_config(vc, 64)
        cache = read_kv_caches(allocate_kv_cache(kvcc, torch.device("cpu"), KVCacheLayout["LBNHC"]), 64, 16, False)
        contracts[name] = rank_contract(cache, pool_spec(cache, 2, 1, 0), model_name=s.model_name, revision=s.revision,
                                        tp_size=1, vllm_version=s.vllm_version, weights=model_weights(s))
    assert contracts["original"].model.weights == "unspecified"  # the test model has no weight files
    assert contracts["other"].model.weights.startswith("wd1:")
    [d] = diff_contracts(contracts["original"], contracts["other"])
    assert d.path == "model.weights" and "another checkpoint" in d.breaks
    assert diff_contracts(contracts["original"], contracts["off"]) == []
