"""Pipeline stages (``--pp-size > 1``) of hybrid and DeepSeek-V4 models through SGLang 0.5.23's
REAL pool classes on the CPU: each stage's pool built as SGLang builds a stage's (its own layers:
``HybridLinearKVPool`` + ``MambaPool`` over the stage's full-attention and linear layers,
``DeepSeekV4TokenToKVPool`` with ``start_layer`` / ``end_layer``), its ``KVArgs`` filled by SGLang's
own ``setup_state_kv_args``, ``build_kv_layer_ids`` and ``_transfer_start_layer`` as
``PrefillBootstrapQueue._init_kv_manager`` does. A stage's KVArgs list its own layers of each
pool only; the model's layer pattern (``kvargs.model_layers``: the model config's, here SGLang's
real ``Qwen3NextConfig`` on a namespace standing for its ``ModelConfig``; V4's
``mla_compression_ratios``) gives every stage the model's pools, which must equal what a decode
at PP 1 registers. Sans I/O: the rooms' stage books are tested in tests/transfer; one end-to-end
case is in test_sglang_hybrid_rooms.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

import kvbridge as kvb  # noqa: E402
from kvbridge import ConfigError  # noqa: E402
from kvbridge.integrations.sglang.kvargs import (ModelLayers, model_layers, model_specs, pool_specs,  # noqa: E402
                                                 read_kv_args, stage_layers)
from kvbridge.integrations.sglang.state_kinds import geometry_of  # noqa: E402

ALL_KINDS = frozenset({"paged", "window", "compressed", "state"})
Q, K_, V_, HEADS = 32, 32, 64, 4


@pytest.fixture(scope="module")
def sgl():
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.server_args import ServerArgs

    with use_context(create_context(ServerArgs(model_path="dummy", device="cpu"), role="scheduler")):
        yield


@pytest.fixture(autouse=True)
def carried(monkeypatch):
    monkeypatch.setattr(kvb, "ROOM_POOL_KINDS", ALL_KINDS, raising=False)


def qwen3_next(layers: int = 4):
    """SGLang's Qwen3-Next config: a full-attention layer every second layer (1, 3, ..), the
    others linear attention (GDN: Mamba state)."""
    from sglang.srt.configs.qwen3_next import Qwen3NextConfig

    return Qwen3NextConfig(num_hidden_layers=layers, full_attention_interval=2)


def model_config(hf):
    """What kvbridge reads of SGLang's ``ModelConfig`` (the scheduler's ``model_config``)."""
    return SimpleNamespace(num_hidden_layers=hf.num_hidden_layers, hf_text_config=hf, full_attention_layer_ids=None,
                           swa_attention_layer_ids=None)


def queue_of(pool, hf=None, window=0):
    """The queue SGLang's ``_init_kv_manager`` runs on, as far as kvbridge reads it."""
    sched = SimpleNamespace(sliding_window_size=window or None)
    if hf is not None:
        sched.model_config = model_config(hf)
    return SimpleNamespace(token_to_kv_pool=pool, scheduler=sched)


def mamba_stage(hf, start: int, end: int):
    """A Qwen3-Next stage's pool as SGLang builds it: the stage's full-attention layers and linear
    layers, ``start_layer`` the stage's first layer."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool

    lin = [i for i in hf.linear_layer_ids if start <= i < end]
    full = [i for i in hf.full_attention_layer_ids if start <= i < end]
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=V_, n_groups=2, num_heads=HEADS, head_dim=16,
                                    state_size=16, conv_kernel=4, conv_shard_groups=[Q, K_, V_])
    mp = MambaPool(size=4, spec_state_size=0, cache_params=Mamba2CacheParams(shape=shape, layers=lin),
                   mamba_layer_ids=lin, device="cpu")
    return HybridLinearKVPool(size=64, dtype=torch.bfloat16, page_size=16, head_num=1, head_dim=8,
                              full_attention_layer_ids=full, device="cpu", mamba_pool=mp, start_layer=start)


def stage_args(pool, hf=None, num_hidden_layers=4):
    """``KVArgs`` as ``PrefillBootstrapQueue._init_kv_manager`` fills them for a stage."""
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.prefill import _transfer_start_layer
    from sglang.srt.disaggregation.utils import (MetadataBuffers, build_kv_layer_ids, get_kv_transfer_buf_infos,
                                                 setup_state_kv_args)

    a = KVArgs()
    a.prefill_start_layer = _transfer_start_layer(pool=pool, hf_text_config=hf)
    a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = get_kv_transfer_buf_infos(pool)
    a.prefill_end_layer = getattr(pool, "end_layer", None)
    a.num_draft_entries = 0
    a.kv_layer_ids = build_kv_layer_ids(token_to_kv_pool=pool, draft_token_to_kv_pool=None, num_draft_entries=0,
                                        num_hidden_layers=num_hidden_layers)
    a.page_size, a.kv_cache_dtype_str = pool.page_size, "auto"
    meta = MetadataBuffers(4, hidden_size=16, hidden_states_dtype=torch.bfloat16, max_sampling_mask_tokens=0)
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = meta.get_buf_infos()
    setup_state_kv_args(a, pool, None, num_hidden_layers)
    a._keep = meta
    return a


def ids(specs):
    return {n: s.layer_ids for n, s in specs.items()}


def test_mamba_hybrid_stages_build_decodes_pools_from_the_model_config(sgl):
    """Qwen3-Next over two stages [0, 2) | [2, 4): each stage's KVArgs hold one full-attention and
    one linear layer (SGLang's prefill_start_layer counts full-attention layers: 0 and 1; no end
    layer). With the model config each stage's range, and the model's pools (k/v on layers 1 and
    3, the Mamba state on 0 and 2: not every layer, the bug ``range(num_target_layers)`` had) are
    those of a decode at PP 1; the last stage alone and the first with the last's contract agree,
    and each stage registers exactly ``stage_specs`` of them."""
    hf = qwen3_next()
    decode_pool = mamba_stage(hf, 0, 4)
    decode = pool_specs(read_kv_args(stage_args(decode_pool, hf), is_mla=False))
    assert ids(decode) == {"k": (1, 3), "v": (1, 3), "mamba_0": (0, 2), "mamba_1": (0, 2)}
    stages, own = [], []
    for start, end in ((0, 2), (2, 4)):
        pool = mamba_stage(hf, start, end)
        args = stage_args(pool, hf)
        assert args.prefill_start_layer == start // 2 and args.prefill_end_layer is None  # SGLang's, as it sets them
        pattern = model_layers(args, queue_of(pool, hf))
        assert pattern == ModelLayers(4, full=(1, 3), mamba=(0, 2))
        cache = read_kv_args(args, is_mla=False, geometry=geometry_of(queue_of(pool, hf)))
        stages.append(stage_layers(cache, args, pattern))
        own.append(pool_specs(cache))
    assert stages == [(0, 2), (2, 4)]
    assert ids(own[0]) == {"k": (1,), "v": (1,), "mamba_0": (0,), "mamba_1": (0,)}
    pattern = ModelLayers(4, full=(1, 3), mamba=(0, 2))
    last = model_specs(own[1], stages[1], 4, pattern=pattern)
    assert last == decode
    assert model_specs(own[0], stages[0], 4, last, pattern) == decode
    for stage, mine in zip(stages, own):
        assert kvb.stage_specs(decode, stage, 4) == mine
    # the contract every stage registers is decode's (target layers: the model's 4, not the 2 full ones)
    from kvbridge.integrations.sglang.contract import rank_contract

    # the Settings fields rank_contract reads
    settings = SimpleNamespace(contract_path="", model_name="qwen3-next-tiny", revision="r", spec_algorithm="none")
    cache = read_kv_args(stage_args(mamba_stage(hf, 2, 4), hf), is_mla=False)
    _, _, c_last = rank_contract(cache, settings, lane_rule="replicated", kv_layout=None, sglang_version="0.5.23",
                                 stage=(2, 4), pattern=pattern)
    _, _, c_dec = rank_contract(read_kv_args(stage_args(decode_pool, hf), is_mla=False), settings,
                                lane_rule="replicated", kv_layout=None, sglang_version="0.5.23", pattern=pattern)
    assert c_last.model.target_layers == 4 and kvb.fingerprint(c_last) == kvb.fingerprint(c_dec)


def _v4_stage(start, end):
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    return DeepSeekV4TokenToKVPool(
        max_num_reqs=4, swa_size=512, c4_size=128, c128_size=4, c4_state_pool_size=64, c128_state_pool_size=8,
        page_size=256, swa_page_size=256, dtype=torch.uint8, c4_state_dtype=torch.float32,
        c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128,
        layer_num=end - start, device="cpu", enable_memory_saver=False, compression_ratios=[128, 128, 4, 128],
        sliding_window=128, start_layer=start, end_layer=end)


def test_v4_stages_build_decodes_pools_from_the_compression_ratios(sgl):
    """DeepSeek-V4 (ratios 128, 128, 4, 128) over [0, 2) | [2, 4): stage 0 holds SWA, C128 KV and
    C128 state of layers 0-1 and no C4 pool at all; stage 1 the C4 KV, indexer and compressor rings
    of layer 2 and the C128 pools of layer 3. ``mla_compression_ratios`` (the whole model's) gives
    every stage the model's pools: decode's at PP 1, byte geometry included."""
    decode = pool_specs(read_kv_args(stage_args(_v4_stage(0, 4)), is_mla=True,
                                     geometry=geometry_of(queue_of(_v4_stage(0, 4), window=128))))
    want = {"c4": (2,), "c4_index": (2,), "c128": (0, 1, 3), "swa": (0, 1, 2, 3), "c4_state": (2,),
            "c4_index_state": (2,), "c128_state": (0, 1, 3)}
    assert ids(decode) == want
    stages, own = [], []
    for start, end in ((0, 2), (2, 4)):
        pool = _v4_stage(start, end)
        args = stage_args(pool)
        pattern = model_layers(args)
        assert pattern == ModelLayers(4, ratios=(128, 128, 4, 128))
        cache = read_kv_args(args, is_mla=True, geometry=geometry_of(queue_of(pool, window=128)))
        stages.append(stage_layers(cache, args, pattern))
        own.append(pool_specs(cache))
    assert stages == [(0, 2), (2, 4)]
    assert ids(own[0]) == {"c128": (0, 1), "swa": (0, 1), "c128_state": (0, 1)}
    assert ids(own[1]) == {"c4": (2,), "c4_index": (2,), "c128": (3,), "swa": (2, 3), "c4_state": (2,),
                           "c4_index_state": (2,), "c128_state": (3,)}
    last = model_specs(own[1], stages[1], 4, pattern=pattern)
    assert last == decode
    assert model_specs(own[0], stages[0], 4, last, pattern) == decode
    for stage, mine in zip(stages, own):
        assert kvb.stage_specs(decode, stage, 4) == mine


def test_a_v4_first_stage_of_all_but_the_last_layer_is_not_taken_for_the_model(sgl):
    """SGLang's ``end_layer`` is inclusive for a whole model's pool (``layer_num - 1``) and exclusive
    for a stage's, so a first stage [0, 3) of a 4-layer V4 reads like the whole model; the buffers
    its KVArgs hold (C4 KV, indexer and rings of layer 2, C128 of layers 0 and 1: none of layer 3)
    tell it apart, and it builds the stage's pools and decode's, as [0, 2) | [2, 4) do."""
    decode = pool_specs(read_kv_args(stage_args(_v4_stage(0, 4)), is_mla=True,
                                     geometry=geometry_of(queue_of(_v4_stage(0, 4), window=128))))
    stages, own = [], []
    for start, end in ((0, 3), (3, 4)):
        pool = _v4_stage(start, end)
        args = stage_args(pool)
        cache = read_kv_args(args, is_mla=True, geometry=geometry_of(queue_of(pool, window=128)))
        stages.append(stage_layers(cache, args, model_layers(args)))
        own.append(pool_specs(cache))
    assert stages == [(0, 3), (3, 4)]
    assert ids(own[0]) == {"c4": (2,), "c4_index": (2,), "c128": (0, 1), "swa": (0, 1, 2), "c4_state": (2,),
                           "c4_index_state": (2,), "c128_state": (0, 1)}
    assert ids(own[1]) == {"c128": (3,), "swa": (3,), "c128_state": (3,)}
    for stage, mine in zip(stages, own):
        assert kvb.stage_specs(decode, stage, 4) == mine


GPT_OSS = ModelLayers(4, full=(1, 3), swa=(0, 2))  # gpt-oss class: sliding window on even layers


def _swa_stage(start, end):
    """An ``SWAKVPool`` as SGLang builds a stage's (``_resolve_local_hybrid_swa_layer_ids``: the
    stage's own SWA and full-attention layers; its ``start_layer`` is 0 on every stage)."""
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    return SWAKVPool(size=64, size_swa=64, page_size=16, dtype=torch.bfloat16, head_num=2, head_dim=8,
                     swa_attention_layer_ids=[i for i in GPT_OSS.swa if start <= i < end],
                     full_attention_layer_ids=[i for i in GPT_OSS.full if start <= i < end], device="cpu")


def test_swa_hybrid_stages_number_full_attention_by_the_pools_layers_mapping(sgl):
    """gpt-oss class over [0, 2) | [2, 4): SGLang's stage ``SWAKVPool`` lists its full-attention
    entries without ids from layer 0 on every stage; ``swa_full_layers`` numbers them by the pool's
    ``layers_mapping`` (at PP 1 too, so decode's pools are the model's), and every stage builds
    decode's pools: k/v on layers 1 and 3, the window pools on 0 and 2."""
    from kvbridge.integrations.sglang.kvargs import swa_full_layers

    hf = SimpleNamespace(num_hidden_layers=4, full_attention_layer_ids=[1, 3], swa_attention_layer_ids=[0, 2],
                         hf_text_config=SimpleNamespace())

    def cache_of(pool):
        queue = SimpleNamespace(token_to_kv_pool=pool, scheduler=SimpleNamespace(sliding_window_size=40,
                                                                                  model_config=hf))
        args = stage_args(pool)
        pattern = model_layers(args, queue)
        assert pattern == GPT_OSS
        return swa_full_layers(read_kv_args(args, is_mla=False, geometry=geometry_of(queue)), queue, pattern), args

    decode = pool_specs(cache_of(_swa_stage(0, 4))[0])
    assert {n: (s.kind, s.layer_ids) for n, s in decode.items()} == {
        "k": ("paged", (1, 3)), "v": ("paged", (1, 3)), "swa_k": ("window", (0, 2)), "swa_v": ("window", (0, 2))}
    stages, own = [], []
    for start, end in ((0, 2), (2, 4)):
        cache, args = cache_of(_swa_stage(start, end))
        assert args.prefill_start_layer == 0  # SWAKVPool.start_layer, on every stage
        stages.append(stage_layers(cache, args, GPT_OSS))
        own.append(pool_specs(cache))
    assert stages == [(0, 2), (2, 4)]
    last = model_specs(own[1], stages[1], 4, pattern=GPT_OSS)
    assert last == decode and model_specs(own[0], stages[0], 4, last, GPT_OSS) == decode
    for stage, mine in zip(stages, own):
        assert kvb.stage_specs(decode, stage, 4) == mine


def test_stage_refusals_name_their_field(sgl):
    """What is still refused, each by name: a kind pool on a stage without the model's layer
    pattern (``model_config``), a stage whose pool lists layers the pattern does not give it
    (``pools.<pool>.layer_ids``: also an ``SWAKVPool`` stage whose full-attention entries were not
    numbered by its ``layers_mapping``), a pool kvbridge has no layer rule for
    (``pools.<pool>``), and a dense stage whose pool holds only some of its layers (the old
    ``range(num_target_layers)`` would have given it every layer: ``pools.index.layer_ids``)."""
    hf = qwen3_next()
    pool = mamba_stage(hf, 2, 4)
    own = pool_specs(read_kv_args(stage_args(pool, hf), is_mla=False))
    with pytest.raises(ConfigError, match=r"state pools \['mamba_0 \(state\)', 'mamba_1 \(state\)'\].*the model's "
                                          r"layers of each come from SGLang's model config") as err:
        model_specs(own, (2, 4), 4)
    assert err.value.field == "model_config"
    wrong = ModelLayers(4, full=(1, 2), mamba=(0, 3))  # a config that is not the model SGLang built
    with pytest.raises(ConfigError, match=r"pool 'k' of pipeline stage layers \[2, 4\): SGLang registers its layers "
                                          r"\[3\], the model's layer pattern \(the model config\) has \[2\]") as err:
        model_specs(own, (2, 4), 4, pattern=wrong)
    assert err.value.field == "pools.k.layer_ids"
    swa_pool = _swa_stage(2, 4)  # its full-attention entries numbered 0.. by read_kv_args: not the model's
    swa_own = pool_specs(read_kv_args(stage_args(swa_pool), is_mla=False,
                                      geometry=geometry_of(queue_of(swa_pool, window=40))))
    with pytest.raises(ConfigError, match=r"pool 'k' of pipeline stage layers \[2, 4\): SGLang registers its layers "
                                          r"\[0\], the model's layer pattern \(the model config\) has \[3\]") as err:
        model_specs(swa_own, (2, 4), 4, pattern=GPT_OSS)
    assert err.value.field == "pools.k.layer_ids"
    with pytest.raises(ConfigError, match=r"pool 'qsa_pending': kvbridge's SGLang backend has no rule") as err:
        ModelLayers(4, full=(1, 3), mamba=(0, 2)).layers_of("qsa_pending")
    assert err.value.field == "pools.qsa_pending"
    index = kvb.PoolSpec(name="index", dtype="fp8_e4m3", abi="uint8", bytes_per_token=132, page_size=16,
                         layer_ids=(3,))  # layer 4 reuses a top-k: no index K there
    target = kvb.PoolSpec(name="target", dtype="bfloat16", abi="bfloat16", bytes_per_token=1152, page_size=16,
                          layer_ids=(3, 4))
    with pytest.raises(ConfigError, match=r"pool 'index' of pipeline stage layers \[3, 5\) holds layers 3..3 "
                                          r"only") as err:
        model_specs({"target": target, "index": index}, (3, 5), 5)
    assert err.value.field == "pools.index.layer_ids"


def test_the_model_config_gives_the_pattern_only_where_it_is_not_dense():
    """``model_layers``: none without a model config or for a dense model (its KV pool holds every
    layer of a stage); a Mamba hybrid's from ``linear_layer_ids`` / ``mamba_layer_ids``; an SWA
    hybrid's from ModelConfig's ``swa_attention_layer_ids``; ids outside the model refused."""
    args = SimpleNamespace(mla_compression_ratios=None)
    assert model_layers(args, None) is None
    dense = SimpleNamespace(scheduler=SimpleNamespace(model_config=SimpleNamespace(
        num_hidden_layers=4, hf_text_config=SimpleNamespace(), full_attention_layer_ids=None,
        swa_attention_layer_ids=None)))
    assert model_layers(args, dense) is None
    assert model_layers(args, SimpleNamespace(scheduler=SimpleNamespace(model_config=model_config(qwen3_next(6))))) \
        == ModelLayers(6, full=(1, 3, 5), mamba=(0, 2, 4))
    nemotron = SimpleNamespace(num_hidden_layers=3, full_attention_layer_ids=None, swa_attention_layer_ids=None,
                               hf_text_config=SimpleNamespace(full_attention_layer_ids=[1], mamba_layer_ids=[0]))
    assert model_layers(args, SimpleNamespace(scheduler=SimpleNamespace(model_config=nemotron))) == \
        ModelLayers(3, full=(1,), mamba=(0,))  # layer 2: an MLP layer without cache
    gpt_oss = SimpleNamespace(num_hidden_layers=4, full_attention_layer_ids=[1, 3], swa_attention_layer_ids=[0, 2],
                              hf_text_config=SimpleNamespace())
    assert model_layers(args, SimpleNamespace(scheduler=SimpleNamespace(model_config=gpt_oss))) == \
        ModelLayers(4, full=(1, 3), swa=(0, 2))
    with pytest.raises(ConfigError, match=r"mamba layer ids \[0, 4\] are not distinct ids of its 4 layers") as err:
        ModelLayers(4, full=(1,), mamba=(0, 4))
    assert err.value.field == "model_config.mamba_layer_ids"
    # a stage's range spans the layers without cache before its first own layer: stages tile the model
    cache = SimpleNamespace(pools={"k": SimpleNamespace(layer_ids=(4,)), "mamba_0": SimpleNamespace(layer_ids=(6,))})
    pattern = ModelLayers(8, full=(1, 4), mamba=(0, 6))  # layers 2, 3, 5, 7: MLP only
    assert stage_layers(cache, None, pattern) == (2, 8)
    cache.pools = {"k": SimpleNamespace(layer_ids=(1,)), "mamba_0": SimpleNamespace(layer_ids=(0,))}
    assert stage_layers(cache, None, pattern) == (0, 2)
