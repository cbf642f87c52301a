"""SGLang's CP modes as kvbridge owner-lane rules (pure; no SGLang import).

A prefill instance with attention CP ranks sends a request's pages in one of
three ways in SGLang 0.5.23 (``CommonKVManager.__init__`` and
``CommonKVSender._prepare_send_indices`` in ``disaggregation/common/conn.py``):
CP rank 0 alone, every rank its contiguous share, or, with KV cache sharding,
every rank the pages it holds. ``lane_rule`` names the kvbridge rule for each;
``check_lane_rule`` refuses a contract that says otherwise.
"""

from __future__ import annotations

from kvbridge import ConfigError, OwnerLanes


def lane_rule(*, attn_cp_size: int, all_cp_ranks: bool, kv_shard_size: int = 1) -> str:
    """kvbridge's owner-lane rule for an SGLang prefill instance's CP mode:

    - default: CP rank 0 sends the whole cache, the others store a replica and
      send nothing (``is_dummy_cp_rank``) -> ``replicated``;
    - all CP ranks transfer (``enable_all_cp_ranks_for_transfer``): each rank sends
      one contiguous run, base + remainder pages -> ``balanced``
      (``sglang.srt.disaggregation.utils._get_cp_rank_page_bounds``);
    - logical-page KV sharding (``--enable-kv-cache-sharding`` over ``N`` ranks:
      the attention CP group, or for MLA the attention TP group) -> ``interleaved``.
      SGLang gives page *id* ``p`` to rank ``p % N`` (``filter_kv_indices_for_shard_rank``);
      kvbridge gives request page *position* ``l`` to rank ``l % N``. They agree
      when the allocator (``PageInterleavePoolAllocator``) starts the request's
      round-robin at rank 0; from another rotation base the owners are shifted, so
      the sender must check ``page_ids % N`` against the positions per request.

    With one CP rank every rule gives the same pages."""
    if attn_cp_size < 1 or kv_shard_size < 1:
        raise ConfigError(f"attn_cp_size {attn_cp_size} and kv_shard_size {kv_shard_size} must be positive",
                          field="attn_cp_size")  # fmt: skip
    if kv_shard_size > 1:
        return "interleaved"
    if attn_cp_size > 1 and all_cp_ranks:
        return "balanced"
    return "replicated"


def check_lane_rule(contract_rule: str, *, cp_size: int, sglang_rule: str) -> None:
    """Refuse a contract whose lane rule is not what SGLang's CP mode does (any
    rule is the same with one CP rank)."""
    if cp_size > 1 and contract_rule != sglang_rule:
        raise ConfigError(
            f"SGLang's CP mode sends pages by the {sglang_rule!r} rule over {cp_size} CP ranks, the contract says "
            f"{contract_rule!r}: decode would wait for pages from ranks that never send them",
            field="cp_rule",
        )
    OwnerLanes(cp_size, sglang_rule)  # a rule kvbridge knows
