"""What the backend reads from SGLang (server arguments, the rank's place in the attention
grid) and the environment, and what it refuses, naming the flag (settings.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.server_args", reason="needs SGLang: make test-sglang")
pytestmark = pytest.mark.sglang

from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from kvbridge import ConfigError  # noqa: E402
from kvbridge.integrations.sglang.settings import read_settings  # noqa: E402

ENV = {"KVBRIDGE_HOST": "127.0.0.1"}


@pytest.fixture
def rank():
    def stamp(cp=(0, 1), tp=(0, 1), dp=(0, 1), **more):
        get_parallel().override_permanently(attn_cp_rank=cp[0], attn_cp_size=cp[1], attn_tp_rank=tp[0],
                                            attn_tp_size=tp[1], attn_dp_rank=dp[0], attn_dp_size=dp[1],
                                            attn_dcp_size=1, attn_dcp_rank=0, **more)  # fmt: skip

    yield stamp
    get_parallel().clear_stamp()


def args(**kw) -> ServerArgs:
    return ServerArgs(model_path="/models/dsv32", served_model_name="dsv32", host="0.0.0.0", port=30000,
                      disaggregation_bootstrap_port=8998, **kw)  # fmt: skip


def test_prefill_ranks_in_each_cp_mode(rank, monkeypatch):
    rank(cp=(1, 2), tp=(1, 2))
    s = read_settings("prefill", args(), True, env=ENV)
    assert (s.cp_rank, s.cp_size, s.lane_rule, s.sends) == (1, 2, "replicated", False)  # TP rank 1 sends nothing
    assert s.instance == "127.0.0.1:8998" and s.daemon_url == "http://127.0.0.1:8998"
    assert (s.model_name, s.spec_algorithm, s.protocol) == ("dsv32", "none", "tcp")
    monkeypatch.setenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", "1")
    assert read_settings("prefill", args(), True, env=ENV).lane_rule == "balanced"
    rank(tp=(1, 2))
    shard = read_settings("prefill", args(enable_kv_cache_sharding=True), True, env=ENV)
    assert (shard.cp_rank, shard.cp_size, shard.lane_rule, shard.sends, shard.kv_shard_size) == (1, 2, "interleaved",
                                                                                                 True, 2)  # fmt: skip


def test_decode_finds_daemons_by_bootstrap_address(rank):
    rank(tp=(1, 2), dp=(3, 4))
    s = read_settings("decode", args(enable_dp_attention=True, dp_size=4, tp_size=8), True, env=ENV)
    assert (s.dp_rank, s.dp_size, s.tp_rank, s.tp_size) == (3, 4, 1, 2)
    assert s.instance == "sglang-decode-127.0.0.1:30000"
    assert s.daemon_for("10.0.0.7:8998") == ("http://10.0.0.7:8998", None)  # that prefill instance's own daemon
    cluster = read_settings("decode", args(), True, env={**ENV, "KVBRIDGE_BOOTSTRAP_URL": "http://boot:8998/"})
    assert cluster.daemon_for("10.0.0.7:8998") == ("http://boot:8998", "10.0.0.7:8998")  # named by its address


@pytest.mark.parametrize("role, kw, env, stamp, flag", [
    ("decode", {}, {}, {"pp_size": 2}, "--pp-size"),
    ("prefill", {"disaggregation_enable_kv_checksum": True}, {}, {"pp_size": 2}, "--disaggregation-enable-kv-checksum"),
    ("prefill", {"enable_hisparse": True}, {}, {}, "--enable-hisparse"),
    ("prefill", {"disaggregation_decode_allocation_policy": "prefill_complete"}, {}, {},
     "--disaggregation-decode-allocation-policy"),
    ("prefill", {"dp_size": 2}, {}, {}, "--dp-size"),
    ("decode", {}, {"SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK": "1"}, {},
     "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK"),
    ("decode", {}, {"SGLANG_MOONCAKE_CUSTOM_MEM_POOL": "INTRA_NODE_NVLINK"}, {}, "SGLANG_MOONCAKE_CUSTOM_MEM_POOL"),
    ("prefill", {"speculative_algorithm": "STANDALONE"}, {}, {}, "speculative_algorithm"),
])  # fmt: skip
def test_what_kvbridge_does_not_support_is_refused_by_name(rank, monkeypatch, role, kw, env, stamp, flag):
    rank(**stamp)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as err:
        read_settings(role, args(**kw), True, env=ENV)
    assert err.value.field.split("=")[0] == flag, str(err.value)


def test_g3_g6_refusals_say_why_and_what_instead(rank):
    """G3 is closed: the KV checksum with a decode prefix cache is served (prefill digests from the
    decode prefix, ``pop_decode_prefix_len``); G6: a pipeline-parallel prefill is served (each stage
    a kvbridge pipeline stage), while PP on decode and the KV checksum over PP prefill stages are
    refused, naming the flag, why, and what to use."""
    rank()
    for cache in ({"disaggregation_decode_enable_radix_cache": True}, {"enable_hierarchical_cache": True}):
        for role in ("decode", "prefill"):
            assert read_settings(role, args(disaggregation_enable_kv_checksum=True, **cache), True, env=ENV).kv_checksum
    rank(pp_size=2, pp_rank=1)
    s = read_settings("prefill", args(), True, env=ENV)
    assert (s.pp_rank, s.pp_size) == (1, 2) and s.label.endswith("/cp0/pp1"), s
    with pytest.raises(ConfigError) as err:
        read_settings("decode", args(), True, env=ENV)
    msg = str(err.value)
    assert msg.startswith("--pp-size > 1 on decode is not supported by kvbridge's SGLang backend: a kvbridge decode")
    assert "instead serve decode with --pp-size 1" in msg and "--disaggregation-transfer-backend mooncake" in msg
    with pytest.raises(ConfigError) as err:
        read_settings("prefill", args(disaggregation_enable_kv_checksum=True), True, env=ENV)
    assert "the row of the last stage only" in str(err.value)
    assert err.value.field == "--disaggregation-enable-kv-checksum"


def test_mha_over_attention_tp_every_tp_rank_is_a_kvbridge_tp_rank(rank):
    """G1: an MHA/GQA cache's heads are sharded over attention TP: every prefill TP rank sends its
    heads (MLA: TP rank 0 alone, the latent is replicated)."""
    rank(tp=(1, 2))
    p = read_settings("prefill", args(), False, env=ENV)
    assert (p.tp_rank, p.tp_size, p.sends) == (1, 2, True)
    assert (read_settings("prefill", args(), True, env=ENV).sends, read_settings("prefill", args(), True,
                                                                                 env=ENV).tp_size) == (False, 1)
    d = read_settings("decode", args(), False, env=ENV)
    assert (d.tp_rank, d.tp_size) == (1, 2)


def test_prefill_tp_wider_than_the_kv_heads_is_refused(rank, monkeypatch):
    from sglang.srt.disaggregation import utils
    from test_sglang_kvargs import kv_args

    from kvbridge.integrations.sglang import install
    from kvbridge.integrations.sglang.kvargs import head_range

    assert [head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # replicated heads
    assert [head_range(4, 2, r) for r in range(2)] == [(0, 2), (2, 4)]
    install()
    rank(tp=(0, 4))
    monkeypatch.setenv("KVBRIDGE_HOST", "127.0.0.1")
    kv = kv_args(layers=2, draft=0, item=64 * 32, index=False, mla=False)
    kv.kv_head_num, kv.total_kv_head_num = 1, 2
    manager = utils.get_kv_class(utils.TransferBackend.KVBRIDGE, utils.KVClassType.MANAGER)
    with pytest.raises(ConfigError, match=r"prefill attention TP 4 over 2 KV heads is not supported .* instead serve "
                                          r"prefill with attention TP <= 2 \(decode may use any TP"):  # fmt: skip
        manager(kv, utils.DisaggregationMode.PREFILL, args(), False)


def test_bad_names_are_refused(rank):
    rank()
    with pytest.raises(ConfigError, match="instance name 'a b'"):
        read_settings("decode", args(), True, env={**ENV, "KVBRIDGE_INSTANCE": "a b"})
    with pytest.raises(ConfigError, match="KVBRIDGE_LEASE_TTL='soon' is not a number"):
        read_settings("decode", args(), True, env={**ENV, "KVBRIDGE_LEASE_TTL": "soon"})


def test_the_contract_from_sglangs_pools_and_from_a_file(rank, tmp_path):
    """Built from what SGLang registers (so prefill and decode agree without a shared file), or
    loaded from KVBRIDGE_CONTRACT and checked against SGLang's pools and metadata regions."""
    import dataclasses

    from test_sglang_kvargs import kv_args

    from kvbridge.integrations.sglang.contract import rank_contract
    from kvbridge.integrations.sglang.kvargs import read_kv_args

    rank()
    s = read_settings("prefill", args(speculative_algorithm="NEXTN"), True, env=ENV)
    cache = read_kv_args(kv_args(layers=4, draft=1), is_mla=True)
    specs, schema, contract = rank_contract(cache, s, lane_rule="replicated", kv_layout=None, sglang_version="0.5.23")
    assert sorted(specs) == ["draft", "index", "target"] and schema.names[-1] == "room"
    assert (contract.model.name, contract.model.target_layers, contract.model.draft_layers) == ("dsv32", 4, 1)
    assert (contract.speculative.algorithm, contract.speculative.hidden_size, contract.cp_rule) == ("nextn", 7168,
                                                                                                  "replicated")
    assert contract.kernel.attention_backend == "sglang-0.5.23" and contract.kernel.abi == "kv_layout=default"
    path = tmp_path / "contract.json"
    path.write_text(contract.model_dump_json())
    from_file = dataclasses.replace(s, contract_path=str(path))
    assert rank_contract(cache, from_file, lane_rule="x", kv_layout=None, sglang_version="?")[2] == contract
    other = read_kv_args(kv_args(layers=4, draft=1, hidden=4096), is_mla=True)  # another hidden width
    with pytest.raises(ConfigError, match="aux regions .* are not SGLang's metadata buffers"):
        rank_contract(other, from_file, lane_rule="replicated", kv_layout=None, sglang_version="0.5.23")
    with pytest.raises(ConfigError, match="layer_ids"):
        rank_contract(read_kv_args(kv_args(layers=3, draft=1), is_mla=True), from_file, lane_rule="replicated",
                      kv_layout=None, sglang_version="0.5.23")


@pytest.mark.parametrize("state, missing", [
    ("MAMBA", "state_layer_ids"),
    ("SWA", "swa_layer_ids"),
    ("SWA_RING", "swa_ring_stride"),
])  # fmt: skip
def test_g5_state_pools_sglang_does_not_describe_are_refused_when_sglang_builds_the_manager(rank, monkeypatch, state,
                                                                                             missing):
    """G5: SGLang's KV manager (got from get_kv_class, built as _init_kv_manager builds it) refuses
    at start-up, by the field it lacks, a hybrid state pool whose geometry it was not given (the
    pools of carried kinds are built from SGLang's own pool classes: test_sglang_hybrid_pools.py)."""
    from sglang.srt.disaggregation import utils
    from sglang.srt.disaggregation.base.conn import StateType
    from test_sglang_kvargs import kv_args

    from kvbridge.integrations.sglang import install

    install()
    rank()
    monkeypatch.setenv("KVBRIDGE_HOST", "127.0.0.1")
    kv = kv_args(layers=4, draft=1, index=False)
    kv.state_types = [getattr(StateType, state)]
    kv.state_data_ptrs, kv.state_data_lens, kv.state_item_lens = [[0x9000_0000]], [[1 << 16]], [[1 << 12]]
    if state != "MAMBA":
        kv.state_layer_ids = [[0]]
    manager = utils.get_kv_class(utils.TransferBackend.KVBRIDGE, utils.KVClassType.MANAGER)
    with pytest.raises(ConfigError) as err:
        manager(kv, utils.DisaggregationMode.PREFILL, args(), True)
    assert err.value.field == missing and state.lower() in str(err.value).lower(), str(err.value)


def test_staging_is_chosen_by_kvbridge_settings_and_sglangs_own_buffer_is_refused(rank, monkeypatch):
    """KVBRIDGE_STAGING* (docs/staging.md) reach both roles' configs; sizes not given keep each
    role's default; a bad value is refused naming the variable. SGLang's own staging buffer
    switches its schedulers to its Mooncake backend's machinery: refused, pointing at kvbridge's."""
    rank()
    s = read_settings("decode", args(), True, env=ENV)
    assert s.staging_config == {"staging": "auto"}
    env = {**ENV, "KVBRIDGE_STAGING": "always", "KVBRIDGE_STAGING_BYTES": str(1 << 20),
           "KVBRIDGE_STAGING_SLOT_BYTES": str(1 << 18)}
    for role in ("prefill", "decode"):
        assert read_settings(role, args(), True, env=env).staging_config == {
            "staging": "always", "staging_bytes": 1 << 20, "staging_slot_bytes": 1 << 18}
    assert read_settings("prefill", args(), True, env={**ENV, "KVBRIDGE_STAGING": "never"}).staging == "never"
    # decode's slots kept for grants sent with a room's request; prefill reads none
    kept = {**ENV, "KVBRIDGE_STAGING_GRANTED_SLOTS": "2"}
    assert read_settings("decode", args(), True, env=kept).staging_config == {"staging": "auto",
                                                                              "staging_granted_slots": 2}
    assert read_settings("prefill", args(), True, env=kept).staging_config == {"staging": "auto"}
    with pytest.raises(ConfigError) as err:
        read_settings("decode", args(), True, env={**ENV, "KVBRIDGE_STAGING_GRANTED_SLOTS": "-1"})
    assert err.value.field == "KVBRIDGE_STAGING_GRANTED_SLOTS", str(err.value)
    for name, value in (("KVBRIDGE_STAGING", "sometimes"), ("KVBRIDGE_STAGING_SLOT_BYTES", "1000"),
                        ("KVBRIDGE_STAGING_BYTES", "lots")):
        with pytest.raises(ConfigError) as err:
            read_settings("decode", args(), True, env={**ENV, name: value})
        assert err.value.field == name, str(err.value)
    monkeypatch.setenv("SGLANG_DISAGG_STAGING_BUFFER", "1")
    with pytest.raises(ConfigError) as err:
        read_settings("prefill", args(), True, env=ENV)
    assert err.value.field == "SGLANG_DISAGG_STAGING_BUFFER" and "KVBRIDGE_STAGING=always" in str(err.value)


def test_the_weights_identity_of_model_path(rank, tmp_path):
    """KVBRIDGE_WEIGHTS: auto digests --model-path (the checkpoint, not the folder's name), off and
    an empty folder give "unspecified", a given digest is used as it is; a bad log level is refused."""
    import json

    import numpy as np

    from kvbridge.integrations.sglang.settings import model_weights

    def checkpoint(root, seed):
        root.mkdir()
        data = np.random.default_rng(seed).standard_normal((64, 64)).astype("<f4").tobytes()
        header = json.dumps({"w": {"dtype": "F32", "shape": [64, 64], "data_offsets": [0, len(data)]}}).encode()
        (root / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + data)
        return str(root)

    rank()
    a, a_copy, other = (checkpoint(tmp_path / n, s) for n, s in (("a", 1), ("a-copy", 1), ("other", 2)))
    (tmp_path / "empty").mkdir()

    def weights(path, value=None):
        env = {**ENV, **({"KVBRIDGE_WEIGHTS": value} if value else {})}
        return model_weights(read_settings("decode", ServerArgs(model_path=path, port=30000), True, env=env))

    assert weights(a).startswith("wd1:") and weights(a) == weights(a_copy) != weights(other)
    assert weights(a, "off") == weights(str(tmp_path / "empty")) == "unspecified"
    assert weights(a, "wd1:given") == "wd1:given"
    with pytest.raises(ConfigError, match="KVBRIDGE_LOG_LEVEL='LOUD'"):
        read_settings("decode", args(), True, env={**ENV, "KVBRIDGE_LOG_LEVEL": "loud"})
