"""SGLang's KVArgs -> kvbridge pools, layer ids and aux regions (pure: no SGLang
needed; the test against SGLang's real MetadataBuffers is at the end)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import kvbridge as kvb
from kvbridge import ConfigError, contract_from_preset, preset_pools
from kvbridge.integrations.sglang.cp_modes import check_lane_rule, lane_rule
from kvbridge.integrations.sglang.kvargs import (
    METADATA_FIELDS,
    check_against_contract,
    model_specs,
    pool_specs,
    read_kv_args,
    read_metadata_buffers,
)

PS = 64
MLA_BF16, MLA_FP8, INDEX_K = 1152 * PS, 656 * PS, 132 * PS
PAGES = 10  # SGLang's buffers: (size + page_size) token rows, here 10 pages


def metadata(*, sampling_mask=False, dsa_topk=0, kv_checksum=False, hidden=7168, hidden_size=2, rows=6, top=128):
    """aux lists as MetadataBuffers.get_buf_infos() builds them."""
    widths = {"output_top_logprobs_val": top * 4, "output_top_logprobs_idx": top * 4,
              "output_token_sampling_mask_idx": 64 * 4, "output_token_sampling_logprobs": 64 * 4,
              "output_hidden_states": hidden * hidden_size, "output_dsa_topk_indices": dsa_topk * 4}  # fmt: skip
    present = {"": True, "sampling_mask": sampling_mask, "dsa_topk": dsa_topk > 0, "kv_checksum": kv_checksum}
    items = []
    for name, dtype, width, flag in METADATA_FIELDS:
        if present[flag]:
            items.append(widths.get(name) or width * (8 if dtype in ("int64", "uint64") else 4))
    ptrs = [0x7000_0000 + i * 0x10_0000 for i in range(len(items))]
    return ptrs, [i * rows for i in items], items


def kv_args(*, layers=4, draft=1, item=MLA_BF16, index=True, draft_index=False, mla=True, dtype="auto", **aux):
    entries = (layers + draft) * (1 if mla else 2)
    ptrs = [0x1000_0000 * (i + 1) for i in range(entries)]
    ns = SimpleNamespace(
        page_size=PS, kv_cache_dtype_str=dtype, kv_data_ptrs=ptrs, kv_data_lens=[item * PAGES] * entries,
        kv_item_lens=[item] * entries, kv_layer_ids=[], num_draft_entries=draft * (1 if mla else 2),
        prefill_start_layer=0, state_types=[], state_data_ptrs=[], state_data_lens=[], state_item_lens=[],
    )  # fmt: skip
    if index:
        n = layers + (draft if draft_index else 0)
        ns.state_types = [SimpleNamespace(value="dsa")]
        ns.state_data_ptrs = [[0x9000_0000 + 0x100_0000 * i for i in range(n)]]
        ns.state_data_lens = [[INDEX_K * PAGES] * n]
        ns.state_item_lens = [[INDEX_K] * n]
    ns.aux_data_ptrs, ns.aux_data_lens, ns.aux_item_lens = metadata(**aux)
    return ns


def test_deepseek_v32_pools_layer_ids_and_buffers():
    cache = read_kv_args(kv_args(layers=4, draft=1), is_mla=True)
    assert list(cache.pools) == ["target", "draft", "index"]
    assert cache.pools["target"].layer_ids == (0, 1, 2, 3)
    assert cache.pools["draft"].layer_ids == (4,)  # numbered after the target's
    assert cache.pools["index"].layer_ids == (0, 1, 2, 3)
    target = cache.pools["target"]
    assert [b.ptr for b in target.buffers] == [0x1000_0000 * i for i in range(1, 5)]
    assert target.bytes_per_page == MLA_BF16 and target.capacity_pages == PAGES
    assert cache.pools["draft"].buffers[0].ptr == 0x5000_0000
    assert cache.pools["index"].bytes_per_page == INDEX_K


def test_pool_specs_match_the_deepseek_presets():
    for preset, item, dtype in (("deepseek-v3.2", MLA_BF16, "auto"), ("deepseek-v3.2-fp8", MLA_FP8, "fp8_e4m3"),
                                ("deepseek-v3", MLA_BF16, "bfloat16")):  # fmt: skip
        cache = read_kv_args(kv_args(layers=4, draft=1, item=item, dtype=dtype, index=preset.startswith("deepseek-v3.2")),
                             is_mla=True)  # fmt: skip
        assert pool_specs(cache) == preset_pools(preset, num_layers=4, page_size=PS, draft_layers=1)
        contract = contract_from_preset(preset, num_layers=4, page_size=PS, draft_layers=1)
        assert check_against_contract(cache, contract) == pool_specs(cache)


def test_sglangs_v3_fp8_pool_is_plain_fp8_not_the_656_byte_preset():
    """SGLang stores V3 (no DSA) in fp8 as 576 bytes per token (one scale per tensor); only its DSA
    pool (V3.2) uses FlashMLA's 656-byte fp8-with-scales rows, which kvbridge's fp8 presets describe."""
    cache = read_kv_args(kv_args(layers=4, draft=1, item=576 * PS, dtype="fp8_e4m3", index=False), is_mla=True)
    spec = pool_specs(cache)["target"]
    assert (spec.dtype, spec.abi, spec.bytes_per_token, spec.kernel_abi) == ("fp8_e4m3", "uint8", 576, "mla-fp8_e4m3-576")
    with pytest.raises(ConfigError, match="36864 bytes, the contract.s 41984"):
        check_against_contract(cache, contract_from_preset("deepseek-v3-fp8", num_layers=4, page_size=PS, draft_layers=1))


def test_draft_index_k_is_not_in_the_v32_preset():
    """SGLang appends the NextN draft's index K (a DSATokenToKVPool) to the DSA state;
    kvbridge's deepseek-v3.2 preset has index K for the target layers only."""
    cache = read_kv_args(kv_args(layers=4, draft=1, draft_index=True), is_mla=True)
    assert cache.pools["index"].layer_ids == (0, 1, 2, 3, 4)
    with pytest.raises(ConfigError, match=r"pool 'index': SGLang registers layers 0\.\.4, the contract has 0\.\.3"):
        check_against_contract(cache, contract_from_preset("deepseek-v3.2", num_layers=4, page_size=PS))


def test_contract_mismatches_name_pool_and_field():
    contract = contract_from_preset("deepseek-v3.2", num_layers=4, page_size=PS, draft_layers=1)
    with pytest.raises(ConfigError, match="bytes_per_page") as err:
        check_against_contract(read_kv_args(kv_args(item=MLA_FP8), is_mla=True), contract)
    assert "41984 bytes, the contract's 73728" in str(err.value)
    with pytest.raises(ConfigError, match=r"pools \['draft', 'target'\], the contract has"):
        check_against_contract(read_kv_args(kv_args(index=False), is_mla=True), contract)
    with pytest.raises(ConfigError, match="layer_ids"):
        check_against_contract(read_kv_args(kv_args(layers=3), is_mla=True), contract)
    small = contract_from_preset("deepseek-v3.2", num_layers=4, page_size=32, draft_layers=1)
    with pytest.raises(ConfigError, match="page_size"):
        check_against_contract(read_kv_args(kv_args(), is_mla=True), small)


def test_mha_k_and_v_pools_with_a_draft():
    args = kv_args(layers=3, draft=1, item=8 * 128 * 2 * PS, index=False, mla=False, dtype="bfloat16")
    cache = read_kv_args(args, is_mla=False)
    assert {n: p.layer_ids for n, p in cache.pools.items()} == {
        "k": (0, 1, 2), "v": (0, 1, 2), "draft_k": (3,), "draft_v": (3,)}  # fmt: skip
    assert [b.ptr for b in cache.pools["v"].buffers] == args.kv_data_ptrs[3:6]  # k entries first, then v
    assert cache.pools["draft_v"].buffers[0].ptr == args.kv_data_ptrs[7]
    spec = pool_specs(cache)["k"]
    assert (spec.dtype, spec.abi, spec.bytes_per_token) == ("bfloat16", "bfloat16", 8 * 128 * 2)


def test_layer_ids_from_sglang_and_pipeline_start():
    args = kv_args(layers=2, draft=1, index=False)
    args.kv_layer_ids = [10, 11, 40]  # hybrid pools report ids; the draft's sit in a band above the target
    assert {n: p.layer_ids for n, p in read_kv_args(args, is_mla=True).pools.items()} == {"target": (10, 11), "draft": (40,)}
    args = kv_args(layers=2, draft=1, index=False)
    args.prefill_start_layer = 30
    assert read_kv_args(args, is_mla=True, num_hidden_layers=61).pools["target"].layer_ids == (30, 31)
    assert read_kv_args(args, is_mla=True, num_hidden_layers=61).pools["draft"].layer_ids == (61,)


def test_index_layers_without_index_k_are_skipped():
    """A layer that reuses the previous layer's top-k has a 0-row index buffer."""
    args = kv_args(layers=4, draft=0)
    args.state_item_lens = [[INDEX_K, 0, INDEX_K, 0]]
    args.state_data_lens = [[INDEX_K * PAGES, 0, INDEX_K * PAGES, 0]]
    assert read_kv_args(args, is_mla=True).pools["index"].layer_ids == (0, 2)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(kv_item_lens=[MLA_BF16] * 3 + [MLA_FP8, MLA_BF16]), "different page sizes"),
        (dict(kv_data_lens=[MLA_BF16] * 4), "lengths 5/4/5"),
        (dict(num_draft_entries=5), "num_draft_entries 5 of 5"),
        (dict(page_size=0), "page_size must be a positive integer"),
        (dict(kv_item_lens=[1000] * 5), "1000 bytes per page is not 64 whole token rows"),
        (dict(kv_data_lens=[10] * 5), "holds no page"),
        (dict(state_types=["mamba"]), r"SGLang state 'mamba' maps to kvbridge 'state' pools .*the room endpoints "
                                      r"carry only \['paged'\].*--disaggregation-transfer-backend mooncake"),
        (dict(state_types=["swa"]), r"SGLang state 'swa' maps to kvbridge 'window' pools"),
        (dict(state_types=["qsa_pending"]), r"SGLang state 'qsa_pending' \(QSA sparse-attention models .*has no "
                                            r"kvbridge pool kind"),
        (dict(state_data_ptrs=[[1, 2]]), "DSA state has 2/4/4"),
        (dict(kv_layer_ids=[0, 1]), "2 kv_layer_ids for 5 KV entries"),
    ],
)
def test_kv_args_that_do_not_fit(change, match, monkeypatch):
    monkeypatch.setattr(kvb, "ROOM_POOL_KINDS", frozenset({"paged"}), raising=False)  # the rooms carry paged pools only
    args = kv_args(layers=4, draft=1)
    for k, v in change.items():
        setattr(args, k, v)
    with pytest.raises(ConfigError, match=match):
        read_kv_args(args, is_mla=True)


def test_odd_mha_entry_count():
    args = kv_args(layers=2, draft=0, index=False, mla=False)
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = (v[:3] for v in (args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens))
    with pytest.raises(ConfigError, match="3 target KV entries for an MHA pool"):
        read_kv_args(args, is_mla=False)


@pytest.mark.parametrize("sampling_mask", [False, True])
@pytest.mark.parametrize("dsa_topk", [0, 2048])
@pytest.mark.parametrize("kv_checksum", [False, True])
def test_every_metadata_field_is_a_named_region(sampling_mask, dsa_topk, kv_checksum):
    ptrs, lens, items = metadata(sampling_mask=sampling_mask, dsa_topk=dsa_topk, kv_checksum=kv_checksum, rows=6)
    aux = read_metadata_buffers(ptrs, lens, items, kv_checksum=kv_checksum, hidden_dtype="bfloat16")
    names = [a.name for a in aux]
    assert names[:6] == ["output_ids", "cached_tokens", "output_token_logprobs_val", "output_token_logprobs_idx",
                         "output_top_logprobs_val", "output_top_logprobs_idx"]  # fmt: skip
    assert ("output_token_sampling_mask_idx" in names) == sampling_mask
    assert ("output_dsa_topk_indices" in names) == bool(dsa_topk)
    assert ("kv_checksum" in names) == kv_checksum and "bootstrap_room" not in names
    by_name = {a.name: a for a in aux}
    assert (by_name["room"].dtype, by_name["room"].shape) == ("uint64", (8,))  # the room echo, element 0
    assert (by_name["output_hidden_states"].dtype, by_name["output_hidden_states"].shape) == ("bfloat16", (7168,))
    assert by_name["output_top_logprobs_idx"].shape == (128,)
    assert [a.buffer.ptr for a in aux] == ptrs and {a.buffer.capacity for a in aux} == {6}


def test_metadata_that_does_not_fit():
    ptrs, lens, items = metadata()
    with pytest.raises(ConfigError, match="9 aux buffers do not match"):
        read_metadata_buffers(ptrs[:9], lens[:9], items[:9])
    with pytest.raises(ConfigError, match=r"output_ids: 32 bytes per row, expected 16 x int32"):
        read_metadata_buffers(ptrs, lens, [32] + items[1:])
    bad_rows = list(lens)
    bad_rows[3] = items[3] * 5
    with pytest.raises(ConfigError, match="output_token_logprobs_idx: 5 rows, the regions before it 6"):
        read_metadata_buffers(ptrs, bad_rows, items)
    with pytest.raises(ConfigError, match="hidden dtype 'fp8'"):
        read_metadata_buffers(ptrs, lens, items, hidden_dtype="fp8")
    ptrs, lens, items = metadata(hidden=7167)  # 14334 bytes: bf16, not float32
    with pytest.raises(ConfigError, match="output_hidden_states: 14334 bytes per row, expected a multiple of 4"):
        read_metadata_buffers(ptrs, lens, items, hidden_dtype="float32")


def test_lane_rule_of_each_sglang_cp_mode():
    assert lane_rule(attn_cp_size=2, all_cp_ranks=False) == "replicated"  # CP rank 0 sends (default)
    assert lane_rule(attn_cp_size=2, all_cp_ranks=True) == "balanced"  # SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER
    assert lane_rule(attn_cp_size=2, all_cp_ranks=True, kv_shard_size=2) == "interleaved"  # KV cache sharding
    assert lane_rule(attn_cp_size=1, all_cp_ranks=False) == "replicated"
    check_lane_rule("interleaved", cp_size=1, sglang_rule="replicated")  # one rank: every rule is the same
    check_lane_rule("balanced", cp_size=2, sglang_rule="balanced")
    with pytest.raises(ConfigError, match="'replicated' rule over 2 CP ranks, the contract says 'interleaved'"):
        check_lane_rule("interleaved", cp_size=2, sglang_rule="replicated")
    with pytest.raises(ConfigError, match="must be positive"):
        lane_rule(attn_cp_size=0, all_cp_ranks=False)


def test_sglang_real_metadata_buffers(monkeypatch):
    """The field table against SGLang's own MetadataBuffers (CPU tensors)."""
    pytest.importorskip("sglang.srt.disaggregation.utils", reason="needs SGLang: make test-sglang")
    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers

    for mask in ("0", "1"):
        monkeypatch.setenv("SGLANG_ENABLE_DISAGG_SAMPLING_MASK", mask)
        buffers = MetadataBuffers(4, hidden_size=24, hidden_states_dtype=torch.bfloat16, max_sampling_mask_tokens=40,
                                  max_top_logprobs_num=20, output_dsa_topk_indices_dim=32, kv_checksum_enabled=True)  # fmt: skip
        aux = read_metadata_buffers(*buffers.get_buf_infos(), kv_checksum=True, hidden_dtype="bfloat16")
        assert ("output_token_sampling_mask_idx" in [a.name for a in aux]) == (mask == "1")
        for region in aux:
            tensor = getattr(buffers, "bootstrap_room" if region.name == "room" else region.name)
            assert str(tensor.dtype).removeprefix("torch.") == region.dtype, region.name
            assert tuple(tensor.shape) == (4, *region.shape), region.name
            assert tensor.data_ptr() == region.buffer.ptr and region.buffer.capacity == 4


def test_pipeline_stage_specs_become_the_whole_models():
    """G6: a stage lists its own layers (``prefill_start_layer`` on); the last stage extends its
    pools to the model's target layers (draft ids past them stay), another stage takes the ids
    from the last stage's specs and is refused, naming the pool, where its geometry differs."""
    ids = lambda specs: {k: v.layer_ids for k, v in specs.items()}  # noqa: E731
    stage = kv_args(layers=2, draft=1)
    stage.prefill_start_layer = 3
    last = pool_specs(read_kv_args(stage, is_mla=True, num_hidden_layers=5))
    model = model_specs(last, (3, 5), 5)
    assert ids(model) == {"target": (0, 1, 2, 3, 4), "draft": (5,), "index": (0, 1, 2, 3, 4)}
    first = pool_specs(read_kv_args(kv_args(layers=3, draft=1), is_mla=True))  # its draft ids are not the model's
    assert model_specs(first, (0, 3), 5, model) == model
    no_draft = pool_specs(read_kv_args(kv_args(layers=3, draft=0), is_mla=True))  # SGLANG_ENABLE_PP_SPEC: none listed
    assert model_specs(no_draft, (0, 3), 5, model) == model
    fp8 = pool_specs(read_kv_args(kv_args(layers=3, draft=0, item=MLA_FP8, dtype="fp8_e4m3"), is_mla=True))
    with pytest.raises(ConfigError, match="pool 'target' of pipeline stage layers \\[0, 3\\) differs from the last"):
        model_specs(fp8, (0, 3), 5, model)
    with pytest.raises(ConfigError, match="only the last stage knows them alone"):
        model_specs(first, (0, 3), 5)
