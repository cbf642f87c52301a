"""vLLM's real scheduler and real worker-side connectors over real Mooncake TCP.

Each world is a prefill instance and a decode instance (``_vllm_world.py``): the proxy's
flow is played here (prefill with ``do_remote_decode``, decode with what prefill
returned), and every byte decode holds is compared with what prefill computed.
"""

from __future__ import annotations

import itertools
import uuid

import numpy as np
import pytest

from _vllm_world import Instance, start_ranks

BS = 16


def _world(tmp_path, daemon, *, p_tp, d_tp, layout="LBNHC", kind="gqa", num_blocks=64, max_batched=64,
           extra_p=None, extra_d=None, model_overrides=None):
    import _vllm_config as C

    url, token = daemon
    model = C.model_dir(tmp_path, kind, **(model_overrides or {}))
    tag = uuid.uuid4().hex[:6]
    base = {"bootstrap_url": url, "bootstrap_token": token, "peer_timeout": 2.0}
    pre = Instance("kv_producer", model, {**base, "instance": f"p-{tag}", **(extra_p or {})}, tp=p_tp, layout=layout,
                   block_size=BS, num_blocks=num_blocks, max_batched=max_batched)
    dec = Instance("kv_consumer", model, {**base, "instance": f"d-{tag}", "prefill_instance": f"p-{tag}",
                                          **(extra_d or {})}, tp=d_tp, layout=layout, block_size=BS,
                   num_blocks=num_blocks, max_batched=max_batched)
    pre.attach(start_ranks(pre.cfgs))
    dec.attach(start_ranks(dec.cfgs))
    return pre, dec


def _prefill(pre, req_id, prompt, seed, params=None):
    pre.add(req_id, prompt, {"do_remote_decode": True, **(params or {})})
    pre.run_until(lambda: req_id in pre.outputs and pre.outputs[req_id].finish_reason is not None, {req_id: seed})
    out = pre.outputs[req_id]
    assert out.kv_transfer_params["do_remote_prefill"] is True
    return out.kv_transfer_params


def _decode(dec, req_id, prompt, params):
    dec.add(req_id, prompt, params, max_tokens=3)
    dec.run_until(lambda: req_id in dec.outputs and dec.outputs[req_id].finish_reason is not None)
    return dec.outputs[req_id]


def _check(dec, req_id, prompt, seed, first_page=0):
    whole = dec.workers[0].info["layout"] == "LBHNC"
    for w in dec.workers:
        got = w.call("check", dec._last_blocks[req_id], first_page, len(prompt), seed, whole)
        assert got == {"wrong": 0, "stray": 0}
        assert w.call("check", dec._last_blocks[req_id], first_page, len(prompt), seed + 1, whole)["wrong"] > 0


def _run_pair(pre, dec, prompt, seed, *, first_page=0):
    rid = f"r{seed}"
    params = _prefill(pre, rid, prompt, seed)
    assert params["kvbridge_num_tokens"] == len(prompt)
    dec.add(rid, prompt, params, max_tokens=3)
    blocks = {}

    def loaded():
        if rid in dec.scheduler.requests:
            blocks[rid] = dec.block_ids(rid)
        return rid in dec.outputs and dec.outputs[rid].finish_reason is not None

    dec.run_until(loaded)
    dec._last_blocks = getattr(dec, "_last_blocks", {})
    dec._last_blocks[rid] = blocks[rid]
    return rid


@pytest.mark.timeout(600)
@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (1, 2), (2, 1)])
def test_gqa_nhd_heterogeneous_tp(tmp_path, daemon, p_tp, d_tp):
    """GQA (2 KV heads), NHD: p1 -> d1, p1 -> d2, p2 -> d1; prompts of several lengths
    (partial last block, exactly whole blocks); every byte equal, no stray write, blocks
    freed on both sides."""
    pre, dec = _world(tmp_path, daemon, p_tp=p_tp, d_tp=d_tp)
    try:
        free_p, free_d = pre.free_blocks(), dec.free_blocks()
        rng = np.random.default_rng(p_tp * 10 + d_tp)
        for seed, n in zip(itertools.count(1), (5, 16, 37)):
            prompt = [int(t) for t in rng.integers(3, 500, n)]
            rid = _run_pair(pre, dec, prompt, seed)
            _check(dec, rid, prompt, seed)
            for w in dec.workers:
                w.call("reset")
        pre.run_until(lambda: pre.free_blocks() == free_p)
        assert dec.free_blocks() <= free_d  # decode's prefix cache keeps freed blocks cached, counted free
    finally:
        pre.stop()
        dec.stop()


@pytest.mark.timeout(600)
def test_staged_path(tmp_path, daemon):
    """staging "always" (the path "auto" picks for many small slices): prefill gathers into its
    staging buffer, decode scatters from its staging area; p1 -> d2, every byte equal."""
    pre, dec = _world(tmp_path, daemon, p_tp=1, d_tp=2, extra_p={"staging": "always"}, extra_d={"staging": "always"})
    try:
        prompt = [int(t) for t in np.random.default_rng(5).integers(3, 500, 70)]
        rid = _run_pair(pre, dec, prompt, 41)
        _check(dec, rid, prompt, 41)
        pre.run_until(lambda: bool(pre.workers[0].call("stats", rid)))  # prefill reports its final room
        stats = pre.workers[0].call("stats", rid)
        assert len(stats["paths"]) == 2 and set(stats["paths"].values()) == {"staged"}, stats
        assert stats["bytes_staged"] > 0, stats
    finally:
        pre.stop()
        dec.stop()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layerwise,pass_bytes", [(True, 0), (False, 0), (True, None)],
                         ids=["layerwise", "whole", "short-pass"])
def test_layer_by_layer_sends(tmp_path, daemon, layerwise, pass_bytes):
    """The worker connector's save_kv_layer after each layer of the prompt's last step posts that
    layer (``LayerPosts``' poster thread; groups of one layer with layer_group_bytes 1, so one
    layer-range send per layer), wait_for_save the rest; ``layerwise: false`` sends
    it all in wait_for_save. Chunked prefill (max_batched 32, a 70-token prompt): the earlier
    chunks go whole, the last per layer; p1 -> d2, every byte equal either way. With the default
    ``layer_pass_bytes`` (64 MiB) this step's few KiB are one group, posted at its last layer."""
    extra = {"layerwise": layerwise, "layer_group_bytes": 1}
    if pass_bytes is not None:
        extra["layer_pass_bytes"] = pass_bytes
    pre, dec = _world(tmp_path, daemon, p_tp=1, d_tp=2, max_batched=32, extra_p=extra)
    try:
        prompt = [int(t) for t in np.random.default_rng(7).integers(3, 500, 70)]
        rid = _run_pair(pre, dec, prompt, 51)
        _check(dec, rid, prompt, 51)
        pre.run_until(lambda: bool(pre.workers[0].call("stats", rid)))
        stats = pre.workers[0].call("stats", rid)
        num_layers = int(pre.vc.model_config.get_num_layers(pre.vc.parallel_config))
        want = 0 if not layerwise else (num_layers if pass_bytes == 0 else 1)
        assert num_layers > 1 and stats["layer_sends"] == want, stats
    finally:
        pre.stop()
        dec.stop()


@pytest.mark.timeout(600)
def test_layer_hooks_of_decode_steps_send_nothing(tmp_path, daemon):
    """save_kv_layer fires on every step; on a step whose metadata ends no prompt (a decode step's
    empty metadata, or a chunk that is not the prompt's last) it opens no room and posts nothing."""
    from kvbridge.integrations.vllm.meta import KVBridgeMetadata, SendChunk

    pre, dec = _world(tmp_path, daemon, p_tp=1, d_tp=1)
    try:
        w = pre.workers[0]
        for meta in (KVBridgeMetadata(), KVBridgeMetadata(sends=[SendChunk("mid", 99, (3, 4), 0, 32, 70, False)])):
            got = w.call("hooks_only", meta)
            assert got["before"] == got["after"], got
    finally:
        pre.stop()
        dec.stop()


@pytest.mark.timeout(600)
def test_rooms_are_bound_to_their_prompt_and_signed(tmp_path, daemon):
    """Issue 31 on vLLM's real scheduler and workers, ``room_key`` set on both sides: decode refuses
    before loading anything a longer prompt ending in the same block, another prompt of the same
    length, a forged and an expired signature (each request ends in an error, counted by reason);
    the owner is then served every byte; prefill refuses a router's room that is unsigned or
    already open, returning fallback params (never another request's room)."""
    import time

    from kvbridge import sign_room

    key = "k" * 32
    pre, dec = _world(tmp_path, daemon, p_tp=1, d_tp=1, extra_p={"room_key": key}, extra_d={"room_key": key})
    try:
        prompt = list(range(3, 3 + 2 * BS + 5))
        params = _prefill(pre, "owner", prompt, 11)
        assert len(params["kvbridge_room_sig"]) == 64 and params["kvbridge_room_expires"] > time.time()
        refused = {
            "longer": (prompt + [9], params),
            "foreign": ([t + 1 for t in prompt], params),
            "forged": (prompt, {**params, "kvbridge_room_sig": "0" * 64}),
            "expired": (prompt, {**params, "kvbridge_room_expires": int(time.time()) - 1}),
        }
        for rid, (p, prm) in refused.items():
            out = _decode(dec, rid, p, prm)
            assert str(out.finish_reason) in ("error", "FinishReason.ERROR"), (rid, out)
        assert dec.scheduler.connector.scheduler_side.refusals["decode_params_refused"] == 4

        dec.add("owner", prompt, params, max_tokens=3)
        blocks = {}

        def loaded():
            if "owner" in dec.scheduler.requests:
                blocks["owner"] = dec.block_ids("owner")
            return "owner" in dec.outputs and dec.outputs["owner"].finish_reason is not None

        dec.run_until(loaded)
        assert str(dec.outputs["owner"].finish_reason) not in ("error", "FinishReason.ERROR")
        dec._last_blocks = {"owner": blocks["owner"]}
        _check(dec, "owner", prompt, 11)

        expires = int(time.time()) + 60
        router = {"kvbridge_room": 77, "kvbridge_room_sig": sign_room(key.encode(), 77, expires),
                  "kvbridge_room_expires": expires}  # fmt: skip
        assert _prefill(pre, "r1", prompt, 12, router)["kvbridge_room"] == 77
        for rid, prm in (("r2", router), ("r3", {"kvbridge_room": 78})):  # room 77 still open; 78 unsigned
            pre.add(rid, prompt, {"do_remote_decode": True, **prm})
            pre.run_until(lambda: rid in pre.outputs and pre.outputs[rid].finish_reason is not None)
            reason = "room_in_use" if rid == "r2" else "room_refused"  # no room: decode computes the prompt
            assert pre.outputs[rid].kv_transfer_params == {"do_remote_prefill": False, "do_remote_decode": False,
                                                           "kvbridge_fallback": reason}, pre.outputs[rid]
        assert dict(pre.scheduler.connector.scheduler_side.refusals) == {
            "room_in_use": 1, "room_refused": 1, "fallback_room_in_use": 1, "fallback_room_refused": 1}
    finally:
        pre.stop()
        dec.stop()
