"""G2: SGLang's early send of a cached prefix under overlap scheduling. SGLang 0.5.23's
``Scheduler.maybe_send_cached_prefix_chunk`` records a CUDA event after the previous forward
pass (which may still be writing the prefix pages), stores it as the sender's
``_early_send_wait_event`` and sends the prefix pages at once; kvbridge must not read a byte
of them before that event completed (it hands the event to ``KVSender.send(ready_event=)``).

SGLang's own function runs here (and its ``send_kv_chunk``/``_send_kv_chunk``), on a
scheduler object holding what they read. On the CPU there is no CUDA event, so
``torch.cuda.Event`` is a recording event that the test completes by hand: until then the
prefix rows on prefill are still "being written" (they hold NOT_COMPUTED), and no byte may
reach decode; then the rows land, the event completes, and every byte must arrive intact.
"""

from __future__ import annotations

import threading
import time
import types

import numpy as np
import pytest

pytest.importorskip("sglang.srt.disaggregation.prefill", reason="needs SGLang: make test-sglang")
pytestmark = pytest.mark.sglang

import torch  # noqa: E402

from kvbridge.transfer.engine import mooncake_available  # noqa: E402

if not mooncake_available():
    pytest.skip("Mooncake not installed", allow_module_level=True)

from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin as Mixin  # noqa: E402

from _sgl_inproc import Pair  # noqa: E402
from _sgl_world import PAGE  # noqa: E402
from kvbridge.worker.synthetic import SENTINEL_BYTE  # noqa: E402

N, PREFIX = 200, 2 * PAGE  # prefill's radix cache holds the first two pages


class RecordingEvent:
    """``torch.cuda.Event`` as the scheduler uses it: ``record`` on the forward stream, then
    the transfer side waits (``synchronize``) or asks (``query``)."""

    made: list[RecordingEvent] = []

    def __init__(self, *args, **kwargs) -> None:
        self.done = threading.Event()
        self.log: list[str] = []
        RecordingEvent.made.append(self)

    def record(self, stream=None) -> None:
        self.log.append("record")

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.log.append("wait")
        if not self.done.wait(30):
            raise TimeoutError("the recording event was never completed")
        self.log.append("waited")


def scheduler(req_to_token: torch.Tensor) -> types.SimpleNamespace:
    """What ``maybe_send_cached_prefix_chunk`` -> ``send_kv_chunk`` -> ``_send_kv_chunk`` read
    on the Scheduler (overlap scheduling on, no staging, no checksum)."""
    s = types.SimpleNamespace(
        enable_overlap=True, enable_staging=False, forward_stream=None, kv_checksum_computer=None,
        token_to_kv_pool_allocator=types.SimpleNamespace(page_size=PAGE, translate_kv_indices_for_transfer=lambda x: x),
        req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token), disagg_prefill_pending_chunk_rids=set())  # fmt: skip
    for name in ("maybe_send_cached_prefix_chunk", "send_kv_chunk", "_send_kv_chunk"):
        setattr(s, name, types.MethodType(getattr(Mixin, name), s))
    return s


@pytest.fixture
def pair(daemon):
    # no peer dies here, and the test holds the transfer for 1 s on purpose: a loaded machine must not
    # read that pause as a dead decode rank (CHILD_ENV's 1 s peer timeout is for the tests that kill one)
    p = Pair(daemon.url, "early", env={"KVBRIDGE_PEER_TIMEOUT": "10"})
    yield p
    p.close()


def test_prefix_pages_are_read_only_after_the_early_send_event(pair, monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", RecordingEvent)
    room = 2**62 + 5
    pair.prefill.add(room, N, N, hold_after=0)  # bootstraps, then waits for the test
    pair.decode.add(room, N, 0, pair.addr)
    r, d = pair.prefill.reqs[room], pair.decode.reqs[room]
    pair.run(lambda: not r.pending_bootstrap and d.phase == "transfer")
    req_to_token = torch.as_tensor(np.repeat(r.pages, PAGE) * PAGE + np.tile(np.arange(PAGE), r.pages.size))[None]
    req = types.SimpleNamespace(rid="r0", prefix_len=PREFIX, host_hit_length=0, pending_bootstrap=False,
                                early_send_prefix_end=None, start_send_idx=r.start_send_idx[0], extend_end=PREFIX,
                                origin_input_ids=list(range(N)), kv=types.SimpleNamespace(req_pool_idx=0),
                                disagg_decode_prefix_len=0, disagg_kv_sender=r.senders[0])  # fmt: skip

    scheduler(req_to_token).maybe_send_cached_prefix_chunk(req)  # SGLang's own code path

    (event,) = RecordingEvent.made
    assert event.log[0] == "record" and r.senders[0]._early_send_wait_event is None  # one chunk's event, consumed
    deadline = time.monotonic() + 1.0  # the transfer side waits; nothing of the prefix moves meanwhile
    while time.monotonic() < deadline:
        pair.step()
        time.sleep(0.005)
    assert "wait" in event.log or not event.query()
    for (pool, layer), buf in pair.decode.w.buffers.items():
        assert (buf[d.pages[:2]] == SENTINEL_BYTE).all(), f"{pool}/{layer}: prefix bytes read before the event"
    for w in pair.prefill.worlds:  # the previous forward pass finishes writing the prefix, then the event completes
        w.write_rows(room, r.pages, 0, PREFIX, N, 1)
    event.done.set()

    r.start_send_idx[0], r.extend_end, r.hold_after = req.start_send_idx, PREFIX, None  # the rest of the prompt
    pair.run(lambda: all(pair.done(room)))
    pe, de = pair.done(room)
    assert pe["state"] == "Success", pe["reasons"]
    assert de["state"] == "Success" and de["errors"] == [], de
    assert req.start_send_idx == PREFIX
