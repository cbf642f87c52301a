"""Issue 31 through SGLang's real classes: a room is bound to its request.

SGLang carries the room as ``bootstrap_room``; kvbridge's patch of SGLang's
``PrefillBootstrapQueue.create_sender`` and ``DecodePreallocQueue._create_receiver_and_enqueue``
(called here as SGLang calls them, see ``_sgl_sched``) binds each sender's room to the digest of
its request's prompt token ids and count, and each receiver presents its own with the claim.
One prefill and one decode server of SGLang ranks in this process (``_sgl_inproc.Pair``), over
real Mooncake TCP on loopback. The attacker is a request sent straight to the same decode
server. Each attack asserts the precise refusal, that not one byte reached the refused request's
decode pages, that the owner's request is served (where it can be), and the counter of its reason.
"""

from __future__ import annotations

import time
import types
from http import HTTPStatus

import numpy as np
import pytest

pytest.importorskip("sglang.srt.disaggregation.prefill", reason="needs SGLang: make test-sglang")
pytestmark = pytest.mark.sglang

from kvbridge.transfer.engine import mooncake_available  # noqa: E402

if not mooncake_available():
    pytest.skip("Mooncake not installed", allow_module_level=True)

from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402
from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue, SchedulerDisaggregationPrefillMixin  # noqa: E402
from sglang.srt.disaggregation.utils import TransferBackend  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_ABORT  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

from _sgl_inproc import Pair  # noqa: E402
from _sgl_sched import prompt, sglang_req  # noqa: E402
from kvbridge.integrations.sglang.metrics import REFUSED  # noqa: E402
from kvbridge.worker.synthetic import SENTINEL_BYTE  # noqa: E402

ROOMS = iter(range(2**62 + 31_000, 2**62 + 32_000))
N, CHUNK = 150, 100  # 3 pages of 64: the last one partial


@pytest.fixture
def pair(daemon):
    p = Pair(daemon.url, "rooms")
    yield p
    p.close()


def done(pair: Pair, server: str, room: int) -> list[dict]:
    return [e for e in pair.events() if e["room"] == room and e["event"] == "done" and e["server"] == server]


def run_decode(pair: Pair, room: int, n: int, tokens: np.ndarray, count: int = 1) -> tuple[dict, object]:
    """Send a decode request (the ``count``-th of ``room`` on this server) and run until it ends:
    its done event and its DReq (its pages, still holding what they held when it ended)."""
    pair.decode.add(room, n, 0, pair.addr, tokens=tokens)
    r = pair.decode.reqs[room]
    pair.run(lambda: len(done(pair, pair.decode.name, room)) >= count)
    return done(pair, pair.decode.name, room)[-1], r


def untouched(pair: Pair, r) -> list[str]:
    """The refused request's decode pages hold the sentinel in every pool and layer: 0 bytes written."""
    return [f"{pool} layer {layer}: a page was written" for (pool, layer), buf in pair.decode.w.buffers.items()
            if r.pages.size and not (buf[r.pages] == SENTINEL_BYTE).all()]


def counted(mgr, name: str, reason: str) -> float:
    return mgr.counters.value(name, reason)


def test_foreign_room_is_refused_and_its_owner_served(pair):
    """A request of another prompt (same length) naming the owner's room, sent to decode first."""
    room = next(ROOMS)
    d_mgr = pair.decode.w.mgr
    before = counted(d_mgr, REFUSED, "bound_to_another_request")
    pair.prefill.add(room, N, CHUNK)
    attack, r = run_decode(pair, room, N, prompt(room, N, salt=7))
    assert attack["state"] == "Failed", attack
    assert any(f"room {room} on prefill rank" in x and "is bound to another request" in x and "nothing written or read"
               in x for x in attack["reasons"]), attack
    assert untouched(pair, r) == [] and r.pages.size == 3
    assert counted(d_mgr, REFUSED, "bound_to_another_request") == before + 1
    owner, _ = run_decode(pair, room, N, prompt(room, N), count=2)
    assert owner["state"] == "Success" and owner["errors"] == [], owner
    pair.run(lambda: bool(done(pair, pair.prefill.name, room)))
    assert done(pair, pair.prefill.name, room)[0]["state"] == "Success"


def test_longer_prompt_ending_in_the_same_page_is_refused(pair):
    """The owner's prompt and one token more (the same last page): another digest and count."""
    room = next(ROOMS)
    pair.prefill.add(room, N, CHUNK)
    longer = np.concatenate([prompt(room, N), [5]])
    attack, r = run_decode(pair, room, N + 1, longer)
    assert attack["state"] == "Failed" and any("is bound to another request" in x for x in attack["reasons"]), attack
    assert untouched(pair, r) == []
    owner, _ = run_decode(pair, room, N, prompt(room, N), count=2)
    assert owner["state"] == "Success" and owner["errors"] == [], owner


def test_preclaimed_room_fails_both_and_serves_nobody(pair):
    """The attacker's claim reaches prefill before the owner's request opens the room: the owner's
    open refuses it by name (its request fails: SGLang aborts it), and the attacker gets nothing."""
    room = next(ROOMS)
    p_mgr = pair.prefill.worlds[0].mgr
    before = counted(p_mgr, REFUSED, "bound_to_another_request")
    pair.decode.add(room, N, 0, pair.addr, tokens=prompt(room, N, salt=3))
    r = pair.decode.reqs[room]
    deadline = time.monotonic() + 60
    while room not in p_mgr.endpoint.machine.rooms:  # the claim reached prefill's rank
        assert time.monotonic() < deadline, pair.events()
        pair.decode.step()
        time.sleep(0.01)
    pair.prefill.add(room, N, CHUNK)
    pair.run(lambda: bool(done(pair, pair.prefill.name, room)) and bool(done(pair, pair.decode.name, room)))
    owner, attack = done(pair, pair.prefill.name, room)[0], done(pair, pair.decode.name, room)[0]
    assert owner["state"] == "Failed" and any("was claimed with binding" in x and "the claim is another request's" in x
                                              for x in owner["reasons"]), owner
    assert attack["state"] == "Failed", attack
    assert untouched(pair, r) == []
    assert counted(p_mgr, REFUSED, "bound_to_another_request") == before + 1


def test_reused_room_is_refused_after_its_owner_received_it(pair):
    """The owner's room, claimed again (the same prompt) once the owner received it."""
    room = next(ROOMS)
    pair.prefill.add(room, N, CHUNK)
    owner, _ = run_decode(pair, room, N, prompt(room, N))
    assert owner["state"] == "Success" and owner["errors"] == [], owner
    pair.run(lambda: bool(done(pair, pair.prefill.name, room)))
    attack, r = run_decode(pair, room, N, prompt(room, N), count=2)
    assert attack["state"] == "Failed" and any(f"room {room} was already closed on prefill rank" in x
                                               for x in attack["reasons"]), attack
    assert untouched(pair, r) == []


def test_room_in_use_on_prefill_is_answered_as_failed_by_sglang(pair):
    """A second prefill request with a room id still open: kvbridge's sender refuses to open it
    (RoomInUse) and SGLang's own pop_bootstrapped -> handle_bootstrap_failure answers the request
    as an error (FINISH_ABORT, 500), never with tokens; the first request's room goes on."""
    room = next(ROOMS)
    pair.prefill.add(room, N, CHUNK)
    w = pair.prefill.worlds[0]
    req = sglang_req(room, pair.addr, prompt(room, N, salt=1))
    queue = types.SimpleNamespace(transfer_backend=TransferBackend.KVBRIDGE, kv_manager=w.mgr, bootstrap_port=req.bootstrap_port,
                                  _check_if_req_exceed_kv_capacity=lambda _r: False, _process_req=lambda _r: None)
    assert PrefillBootstrapQueue.create_sender(queue, req, 0)
    assert req.disagg_kv_sender.poll() == KVPoll.Failed
    # what handle_bootstrap_failure reads of the Req besides (no KV held, no metadata row yet)
    req.time_stats = types.SimpleNamespace(trace_ctx=types.SimpleNamespace(abort=lambda **_k: None))
    req.kv = types.SimpleNamespace(holds_kv=False, holds_mamba=False)
    req.metadata_buffer_index, req.return_logprob, req.cache_request_handle = -1, False, None
    failed: list = []
    group = types.SimpleNamespace(size=lambda: 1)  # one rank: SGLang's MIN all-reduce is the rank's poll
    scheduler = sglang_scheduler(failed)
    queue.queue, queue.pp_size, queue.scheduler, queue.scheduler_stage_metrics = [req], 1, scheduler, None
    scheduler.attn_cp_cpu_group = scheduler.attn_tp_cpu_group = group
    with get_parallel().override(tp_rank=0):  # the failure message names the rank
        assert PrefillBootstrapQueue.pop_bootstrapped(queue) == [] and queue.queue == []
    assert failed == [req]
    assert isinstance(req.finished_reason, FINISH_ABORT)
    assert req.finished_reason.status_code == HTTPStatus.INTERNAL_SERVER_ERROR
    assert f"room {room} is open" in req.finished_reason.message, req.finished_reason.message
    assert counted(w.mgr, REFUSED, "room_in_use") >= 1
    owner, _ = run_decode(pair, room, N, prompt(room, N))  # the first request's room is untouched
    assert owner["state"] == "Success" and owner["errors"] == [], owner


def sglang_scheduler(failed: list) -> types.SimpleNamespace:
    """What SGLang's ``handle_bootstrap_failure`` (the real one, bound here) reads of its scheduler."""
    s = types.SimpleNamespace(clear_pending_chunk_send=lambda r: None, tree_cache=types.SimpleNamespace(
        finish=lambda *a: None), req_to_metadata_buffer_idx_allocator=None,
        output_streamer=types.SimpleNamespace(stream_output=lambda reqs, _lp: failed.extend(reqs)),
        metrics_reporter=types.SimpleNamespace(enable_metrics=False))  # fmt: skip
    s.handle_bootstrap_failure = lambda req: SchedulerDisaggregationPrefillMixin.handle_bootstrap_failure(s, req)
    return s


def test_other_weights_are_refused_by_field(daemon):
    """Prefill and decode of the same model name over other checkpoints (KVBRIDGE_WEIGHTS: the
    digest a checkpoint gives): decode is refused naming model.weights, nothing transferred."""
    p = Pair(daemon.url, "weights", env={"KVBRIDGE_WEIGHTS": "w1-aaaa"}, decode_env={"KVBRIDGE_WEIGHTS": "w1-bbbb"})
    try:
        room = next(ROOMS)
        p.prefill.add(room, N, CHUNK)
        p.decode.add(room, N, 0, p.addr)
        p.run(lambda: bool(done(p, p.decode.name, room)))
        attack = done(p, p.decode.name, room)[0]
        assert attack["state"] == "Failed" and any("model.weights" in x for x in attack["reasons"]), attack
        assert counted(p.decode.w.mgr, REFUSED, "contract") == 1
    finally:
        p.close()
