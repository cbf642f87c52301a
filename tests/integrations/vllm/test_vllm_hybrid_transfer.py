"""A gpt-oss-like hybrid (sliding-window layers beside full-attention layers) end to end under
vLLM's hybrid KV cache manager: vLLM's real KVCacheConfig grouping, its Scheduler with
``KVBridgeHMAConnector`` built by ``KVConnectorFactory``, worker ranks in processes of their own
with vLLM's shared KV tensors, real Mooncake TCP between them (``_vllm_world.py``).

The full-attention group moves every prompt token's blocks, the window group only the blocks of
tokens [n - W, n) (decode recomputes token n - 1, which attends token n - W: hybrid.py); every
byte decode holds is checked, every other byte of every tensor is untouched. A prompt whose
n - W + 1 is a multiple of the block size leaves vLLM's decode no block for token n - W: that
room is released and decode computes the prompt itself, counted (never a stale key).
vLLM's CPU platform turns the hybrid manager off for served models, so no served model runs
here; the scheduler and the workers are vLLM's classes with the manager on."""

from __future__ import annotations

import pytest

from _vllm_world import instance_pair, start_ranks

import kvbridge as kvb

BS, W = 16, 32


def _finished(inst, rid):
    return rid in inst.outputs and inst.outputs[rid].finish_reason is not None


@pytest.mark.timeout(600)
def test_window_group_moves_only_the_blocks_decode_reads(tmp_path, daemon):
    import _vllm_config as C

    model = C.model_dir(tmp_path, "gqa", num_hidden_layers=4)
    pre, dec = instance_pair(model, daemon, peer_timeout=10.0,  # (nothing is killed here)
                             tp=1, layout="LBNHC", block_size=BS, num_blocks=48, window=W)
    try:
        kinds = [type(g.kv_cache_spec).__name__ for g in pre.kvcc.kv_cache_groups]
        assert sorted(kinds) == ["FullAttentionSpec", "SlidingWindowSpec"]  # vLLM's grouping, manager on
        assert type(pre.scheduler.connector).__name__ == "KVBridgeHMAConnector"  # from KVConnectorFactory
        pre.attach(start_ranks(pre.cfgs))
        dec.attach(start_ranks(dec.cfgs))
        free = (pre.free_blocks(), dec.free_blocks())

        # n = 70 (two prefill steps of 64): the window is tokens 38..69, pages 2..4 from row 6;
        # vLLM's decode skips n - W + 1 = 39 tokens, so it holds page 2 (token 38's)
        n, rid = 70, "moved"
        prompt = [(i * 7) % 500 + 3 for i in range(n)]
        pre.add(rid, prompt, {"do_remote_decode": True})
        pre.run_until(lambda: _finished(pre, rid), {rid: 11})
        params = pre.outputs[rid].kv_transfer_params
        assert params["do_remote_prefill"] is True
        dec.add(rid, prompt, params, max_tokens=3)
        seen = {}

        def loaded():
            ids = dec.group_block_ids(rid) if rid in dec.scheduler.requests else ()
            if rid not in seen and ids and min(len(g) for g in ids) * BS >= n:
                seen[rid] = ids  # at allocation: what the connector was handed
            return _finished(dec, rid)

        dec.run_until(loaded)
        (w,) = dec.workers
        got = w.call("check_groups", seen[rid], n, W, 11)
        assert got == {"wrong": 0, "stray": 0, "tensors": 2}  # (the W - 1 rule leaves token 38 stale: wrong > 0)
        assert w.call("check_groups", seen[rid], n, W, 12)["wrong"] > 0
        row = 2 * 64 * 2 * 2  # K and V of 2 heads of 64, bf16
        full = kvb.PoolSpec(name="f", dtype="bfloat16", abi="bfloat16", bytes_per_token=row, page_size=BS,
                            layer_ids=(1, 3))
        window = kvb.window_pool("w", (0, 2), row, window=W, page_size=BS)
        stats = w.call("stats", rid)
        assert stats["bytes"] == kvb.needed_bytes(full, n) + kvb.needed_bytes(window, n) == (70 + 32) * 2 * row

        # n = 79: n - W + 1 = 48 is three blocks, so decode would hold no block for token 47
        n, rid = 79, "local"
        prompt = [(i * 5) % 500 + 3 for i in range(n)]
        pre.add(rid, prompt, {"do_remote_decode": True})
        pre.run_until(lambda: _finished(pre, rid), {rid: 21})
        params = pre.outputs[rid].kv_transfer_params
        assert params["do_remote_prefill"] is True
        before = w.call("digest")
        dec.add(rid, prompt, params, max_tokens=3)
        dec.run_until(lambda: _finished(dec, rid))
        assert w.call("digest") == before  # nothing loaded: decode computed the prompt
        assert dec.scheduler.connector.scheduler_side.refusals["local_compute_window"] == 1
        pre.run_until(lambda: pre.worker_stats.get("rooms_released", 0) >= 1)  # prefill freed the room at once
        dec.run_until(lambda: True)
        assert (pre.free_blocks(), dec.free_blocks()) == free
        assert dec.worker_stats.get("rooms_received") == 1 and not dec.worker_stats.get("load_failed")
    finally:
        pre.stop()
        dec.stop()
