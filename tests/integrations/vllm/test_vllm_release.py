"""What decode needs nothing of, and what prefill could not open, with vLLM's real scheduler and
real worker-side connectors (one GQA world, p1 -> d1): prefill's ``target_timeout`` is 10
minutes, so every free below within a bounded wait is the release, not the timeout.

- decode with ``prompt_logprobs`` (vLLM computes the prompt locally: nothing to load) releases
  the room: prefill frees its blocks at once, counted on both sides;
- a decode request aborted before it was scheduled releases it too;
- a room the worker cannot open (RoomInUse: the id is held on the worker's endpoint) is learnt by
  the scheduler before its answer leaves the engine: fallback params (``kvbridge_fallback``, no
  room, no ``do_remote_prefill``), in the step that finishes the request (a short prompt) and in
  an earlier step (a chunked one); decode then computes the prompt itself."""

from __future__ import annotations

import numpy as np
import pytest

from test_vllm_transfer import _prefill, _world


def _settled(inst, free, timeout=60.0):
    inst.run_until(lambda: inst.free_blocks() == free, timeout=timeout)
    assert inst.free_blocks() == free


def _logprobs_request(req_id, prompt, params, block_size):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    sp.extra_args = {"kv_transfer_params": dict(params)}
    return Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=sp, pooling_params=None,
                   block_hasher=get_request_block_hasher(block_size, sha256))


@pytest.mark.timeout(900)
def test_releases_and_worker_refusals(tmp_path, daemon):
    pre, dec = _world(tmp_path, daemon, p_tp=1, d_tp=1, max_batched=32, extra_p={"target_timeout": 600.0})
    rng = np.random.default_rng(31)
    sched = pre.scheduler.connector.scheduler_side
    try:
        free_p, free_d = pre.free_blocks(), dec.free_blocks()

        # prompt_logprobs on decode: vLLM reads no prefix, the room is released at once
        prompt = [int(t) for t in rng.integers(3, 500, 50)]
        params = _prefill(pre, "lp", prompt, 21)
        assert pre.free_blocks() < free_p  # held for the room
        dec.scheduler.add_request(_logprobs_request("lp", prompt, params, dec.block_size))
        dec.run_until(lambda: "lp" in dec.outputs and dec.outputs["lp"].finish_reason is not None)
        _settled(pre, free_p)  # within the bound, not after target_timeout (600 s)
        dec.run_until(lambda: dec.worker_stats.get("rooms_released", 0) == 1, timeout=30.0)
        assert pre.worker_stats.get("rooms_released") == 1 and "rooms_sent" not in pre.worker_stats
        assert dec.scheduler.connector.scheduler_side.refusals["local_compute_prompt_logprobs"] == 1
        assert pre.workers[0].call("counters")["rooms_released"] == 1
        _settled(dec, free_d)

        # aborted on decode before it was scheduled: released too
        prompt = [int(t) for t in rng.integers(3, 500, 50)]
        params = _prefill(pre, "early", prompt, 22)
        dec.add("early", prompt, params, max_tokens=3)
        dec.abort("early")
        dec.step()
        _settled(pre, free_p)
        assert pre.workers[0].call("counters")["rooms_released"] == 2

        # a forged release (another prompt of the same length) is refused, counted, and frees nothing
        prompt = [int(t) for t in rng.integers(3, 500, 50)]
        params = _prefill(pre, "owner", prompt, 23)
        dec.scheduler.add_request(_logprobs_request("thief", [t + 1 for t in prompt], params, dec.block_size))
        dec.run_until(lambda: "thief" in dec.outputs and dec.outputs["thief"].finish_reason is not None)
        for _ in range(20):
            dec.step()
            pre.step()
        assert pre.free_blocks() < free_p and pre.workers[0].call("counters")["releases_refused"] == 1
        dec.scheduler.add_request(_logprobs_request("owner", prompt, params, dec.block_size))
        dec.run_until(lambda: "owner" in dec.outputs and dec.outputs["owner"].finish_reason is not None)
        _settled(pre, free_p)

        # the worker cannot open the room (the id is held on its endpoint): the scheduler learns it
        # in the step that finishes the request and answers without a room
        for room, n, rid in ((0x31A, 20, "short"), (0x31B, 100, "chunked")):
            pre.workers[0].call("hold_room", room)
            pre.add(rid, [int(t) for t in rng.integers(3, 500, n)], {"do_remote_decode": True, "kvbridge_room": room})
            pre.run_until(lambda: rid in pre.outputs and pre.outputs[rid].finish_reason is not None, {rid: 24})
            got = pre.outputs[rid].kv_transfer_params
            assert got == {"do_remote_prefill": False, "do_remote_decode": False, "kvbridge_fallback": "room_in_use"}
            _settled(pre, free_p)
        assert sched.refusals["fallback_room_in_use"] == 2
        # decode given the fallback params computes the prompt itself (no room, no load)
        dec.add("local", [int(t) for t in rng.integers(3, 500, 20)], got, max_tokens=2)
        dec.run_until(lambda: "local" in dec.outputs and dec.outputs["local"].finish_reason is not None)
        assert str(dec.outputs["local"].finish_reason) not in ("error", "FinishReason.ERROR")
        _settled(dec, free_d)
    finally:
        pre.stop()
        dec.stop()
