"""One GQA world (NHD, prefill TP 1 -> decode TP 2, chunked prefill of 32 tokens a step,
scattered block ids on both sides) through a request's whole life: a long prompt, a
decode prefix hit, aborts before / during / after the transfer, a prompt decode never
asks for, and prefill's death mid-room. Blocks are freed exactly once on both sides
(the free count returns to its start, never above), and nothing lands after a free."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from test_vllm_transfer import BS, _check, _prefill, _run_pair, _world


def _settled(inst, free):
    inst.run_until(lambda: inst.free_blocks() == free, timeout=30.0)
    assert inst.free_blocks() == free


def _still(dec, seconds=1.5):
    """Nothing is written into decode's memory for ``seconds`` (no late write)."""
    before = [w.call("digest") for w in dec.workers]
    time.sleep(seconds)
    assert [w.call("digest") for w in dec.workers] == before


@pytest.mark.timeout(900)
def test_request_lifecycle(tmp_path, daemon):
    pre, dec = _world(tmp_path, daemon, p_tp=1, d_tp=2, max_batched=32, extra_p={"target_timeout": 3.0, "lease_ttl": 2.0},
                      extra_d={"lease_quarantine": 1.0})
    rng = np.random.default_rng(7)
    try:
        pre.shuffle_free_blocks(1)
        dec.shuffle_free_blocks(2)
        free_p, free_d = pre.free_blocks(), dec.free_blocks()

        # a long prompt: 4 chunks on prefill, the partial block held until its last chunk
        prompt = [int(t) for t in rng.integers(3, 500, 100)]
        rid = _run_pair(pre, dec, prompt, 11)
        blocks = dec._last_blocks[rid]
        assert sorted(blocks) != blocks or np.any(np.diff(blocks) != 1)  # scattered, not consecutive
        _check(dec, rid, prompt, 11)
        _settled(pre, free_p)
        _settled(dec, free_d)

        # decode prefix hit: decode computed the first 40 tokens itself (2 whole blocks cached)
        for w in dec.workers:
            w.call("reset")
        shared = [int(t) for t in rng.integers(3, 500, 40)]
        dec.add("local", shared, None, max_tokens=1)
        dec.run_until(lambda: "local" in dec.outputs and dec.outputs["local"].finish_reason is not None)
        prompt = shared + [int(t) for t in rng.integers(3, 500, 30)]
        rid = _run_pair(pre, dec, prompt, 12)
        _check(dec, rid, prompt, 12, first_page=40 // BS)  # blocks 0, 1 untouched: only missing blocks moved
        _settled(pre, free_p)

        # abort on decode before it was scheduled: prefill's room waits, then fails and frees
        params = _prefill(pre, "early", [int(t) for t in rng.integers(3, 500, 50)], 13)
        dec.add("early", [0] * 50, params, max_tokens=3)
        dec.abort("early")
        _settled(pre, free_p)  # target_timeout: the prompt decode never asked for frees its blocks

        # abort on decode after its room opened (during or just after the transfer)
        prompt = [int(t) for t in rng.integers(3, 500, 60)]
        params = _prefill(pre, "mid", prompt, 14)
        dec.add("mid", prompt, params, max_tokens=3)
        dec.step()
        dec.abort("mid")
        dec.run_until(lambda: "mid" not in dec.scheduler.requests)
        _settled(dec, free_d)
        _settled(pre, free_p)
        _still(dec)

        # abort on prefill mid-prompt (after its first chunk went to the workers)
        pre.add("cut", [int(t) for t in rng.integers(3, 500, 100)], {"do_remote_decode": True})
        pre.step({"cut": 15})
        pre.abort("cut")
        _settled(pre, free_p)
        assert pre.outputs.get("cut") is None or pre.outputs["cut"].kv_transfer_params is None

        # prefill dies after its prompt, before decode asks: decode's load fails by name, blocks freed once
        prompt = [int(t) for t in rng.integers(3, 500, 45)]
        params = _prefill(pre, "orphan", prompt, 16)
        for w in pre.workers:
            os.kill(w.proc.pid, signal.SIGKILL)
            w.proc.join(10.0)
        pre.workers = []
        dec.add("orphan", prompt, params, max_tokens=3)
        seen = {}

        def finished():
            if "orphan" in dec.scheduler.requests:
                seen["blocks"] = dec.block_ids("orphan")
            out = dec.outputs.get("orphan")
            return out is not None and out.finish_reason is not None

        dec.run_until(finished, timeout=60.0)
        assert str(dec.outputs["orphan"].finish_reason) in ("error", "FinishReason.ERROR")
        assert set(seen["blocks"]) & dec.invalid_seen  # reported through get_block_ids_with_load_errors
        _settled(dec, free_d)
        _still(dec)
    finally:
        pre.stop()
        dec.stop()
