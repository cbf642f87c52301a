"""The worker loops with fake endpoints: chunked sends, the aux row's owner, and hard rule 6
(a failed room's pages stay held until the receiver says no write can reach them)."""

from __future__ import annotations

import numpy as np

from kvbridge.errors import PeerLost
from kvbridge.layout import OwnerLanes
from kvbridge.transfer.poll import KVPoll
from kvbridge.worker import ops
from kvbridge.worker.config import load_config
from kvbridge.worker.decode import DecodeWorker
from kvbridge.worker.prefill import PrefillWorker
from kvbridge.worker.resources import allocate_buffers


class FakeOps:
    def __init__(self, inbox=()):
        self.inbox = list(inbox)
        self.replies: list[tuple[int, ops.Reply]] = []

    def receive(self, timeout):
        out, self.inbox = self.inbox, []
        return out

    def reply(self, peer, request_id, msg):
        self.replies.append((request_id, msg))


class FakeSender:
    def __init__(self):
        self.state = KVPoll.Bootstrapping
        self.sends = []
        self.ready = []
        self.failure_reason = None

    def init(self, num_tokens, *, binding=b""):
        self.num_tokens, self.binding = num_tokens, binding

    def send(self, logical, local, *, num_tokens_ready=None, is_last=False, aux=None):
        self.sends.append((logical.tolist(), local.tolist(), is_last, aux))
        self.ready.append(num_tokens_ready)

    def poll(self):
        return self.state

    def abort(self, reason):
        self.state, self.failure_reason = KVPoll.Failed, reason


class FakeReceiver:
    def __init__(self):
        self.state = KVPoll.Bootstrapping
        self.failure_reason = None
        self.pages_releasable = False
        self.aux = None
        self.stats = {}
        self.inits = []
        self.lanes = OwnerLanes(1)  # what the bootstrap topology would give

    def init(self, page_ids, aux_slot, num_tokens, *, binding=b""):
        self.inits.append((page_ids.tolist(), aux_slot, num_tokens))

    def poll(self):
        return self.state

    def abort(self, reason):
        self.state, self.failure_reason = KVPoll.Failed, reason


class FakeEndpoint:
    def __init__(self, make):
        self.make, self.made = make, {}

    def sender(self, room):
        return self.made.setdefault(room, self.make())

    def receiver(self, room, prefill_instance, dp_rank=None):
        return self.made.setdefault(room, self.make())

    def connections(self):  # (a prefill worker's Stats carries its control connections)
        return {"peers": 0, "proven": 0, "displaced": 0, "refused": 0}


def worker(cls, role, make, **settings):
    cfg = load_config(role, {"layers": 1, "page_size": 4, "pages": 16, "aux_rows": 2, **settings}, {})
    w = cls(cfg)
    w.buffers = allocate_buffers(w.specs, cfg.pages)
    w.endpoint = FakeEndpoint(make)
    w.ops_server = FakeOps()
    return w


def test_prefill_sends_completed_pages_per_chunk_and_the_aux_row_last():
    w = worker(PrefillWorker, "prefill", FakeSender, cp_rank=1, cp_size=2)
    w.ops_server.inbox = [(b"c", 1, ops.Prefill(7, 23, chunk_tokens=10))]  # 6 pages, last one partial
    w.step(0)
    sender = w.endpoint.made[7]
    w.step(0)
    assert sender.sends == []  # the decode side has not asked yet
    sender.state = KVPoll.WaitingForInput
    for _ in range(4):
        w.step(0)
    # cp rank 1 owns logical pages 1, 3, 5 (local 0, 1, 2); chunks end at tokens 10, 20, 23
    assert [s[:3] for s in sender.sends] == [([1], [0], False), ([3], [1], False), ([5], [2], True)]
    assert sender.ready == [10, 20, 23]  # kvbridge holds a page a chunk ends inside (page 4 ends at token 20)
    assert sender.sends[-1][3] is not None and sender.sends[-1][3].num_cached_tokens == 23  # owns token 22
    assert w.pages.num_free == 16 - 3
    sender.state = KVPoll.Success
    w.step(0)
    assert w.pages.num_free == 16
    (rid, result), = w.ops_server.replies
    assert rid == 1 and result.ok and result.num_bytes == 11 * (656 + 132 + 656)  # tokens 4-7, 12-15, 20-22


def test_prefill_rank_without_the_last_token_sends_no_aux_row():
    w = worker(PrefillWorker, "prefill", FakeSender, cp_rank=0, cp_size=2)
    w.ops_server.inbox = [(b"c", 1, ops.Prefill(7, 23))]
    w.step(0)
    w.endpoint.made[7].state = KVPoll.WaitingForInput
    w.step(0)
    assert [s[:4] for s in w.endpoint.made[7].sends] == [([0, 2, 4], [0, 1, 2], True, None)]


def test_decode_holds_pages_of_a_failed_room_until_releasable():
    w = worker(DecodeWorker, "decode", FakeReceiver)
    w.aux_buffer = np.zeros((2, w.aux_schema.row_bytes), dtype=np.uint8)
    w.ops_server.inbox = [(b"c", 1, ops.Decode(9, 40, "p"))]  # 10 pages of 16
    w.step(0)
    receiver = w.endpoint.made[9]
    receiver.state = KVPoll.WaitingForInput
    w.step(0)
    assert receiver.inits == [(list(range(10)), 0, 40)]
    receiver.state, receiver.failure_reason = KVPoll.Failed, "cp1 lost"
    w.step(0)
    (_, result), = w.ops_server.replies
    assert not result.ok and result.reason == "cp1 lost"
    assert w.pages.num_free == 6 and w.pages.num_held == 10  # a write may still land: not reusable
    w.ops_server.inbox = [(b"c", 2, ops.Decode(10, 40, "p"))]
    w.step(0)
    assert isinstance(w.ops_server.replies[-1][1], ops.RoomResult) and "6 free" in w.ops_server.replies[-1][1].reason
    receiver.pages_releasable = True
    w.step(0)
    assert w.pages.num_free == 16 and w.held == {}


def test_decode_refuses_ops_while_draining_and_for_the_wrong_role():
    w = worker(DecodeWorker, "decode", FakeReceiver)
    w.ops_server.inbox = [(b"c", 1, ops.Prefill(1, 10)), (b"c", 2, ops.Stats())]
    w.step(0)
    w.draining = True
    w.ops_server.inbox = [(b"c", 3, ops.Decode(2, 10, "p"))]
    w.step(0)
    replies = dict(w.ops_server.replies)
    assert isinstance(replies[1], ops.OpError) and "does not run Prefill" in replies[1].reason
    assert isinstance(replies[2], ops.StatsReply) and replies[2].stats["capacity_pages"] == 16
    assert isinstance(replies[3], ops.OpError) and "shutting down" in replies[3].reason


class GoneOps(FakeOps):
    """The ops server of a worker whose client went away: every answer to it is PeerLost."""

    def reply(self, peer, request_id, msg):
        if peer == b"gone":
            raise PeerLost("ops channel to peer 676f6e65: peer not connected")
        super().reply(peer, request_id, msg)


def test_a_worker_outlives_the_ops_client_that_asked_for_a_room():
    """Issue 32: an idle ops client closed before its 135 s room ended made the worker exit 2
    (the room's answer raised PeerLost out of the loop). The answer is dropped and counted; the
    next client's room runs."""
    w = worker(PrefillWorker, "prefill", FakeSender)
    w.ops_server = GoneOps([(b"gone", 1, ops.Prefill(7, 8)), (b"gone", 2, ops.Prefill(7, 8))])
    w.step(0)  # the second op (room 7 again) is refused: its answer is lost too
    sender = w.endpoint.made[7]
    sender.state = KVPoll.WaitingForInput
    w.step(0)
    sender.state = KVPoll.Success
    w.step(0)  # the room ends; its client is gone
    assert 7 not in w.tasks and w.counters["rooms_ok"] == 1 and w.counters["replies_lost"] == 2
    w.ops_server.inbox = [(b"c", 3, ops.Stats())]
    w.step(0)
    (rid, reply), = w.ops_server.replies
    assert rid == 3 and isinstance(reply, ops.StatsReply)


def test_a_real_ops_server_answering_a_closed_client_raises_peer_lost_which_the_worker_absorbs():
    server = ops.OpsServer("127.0.0.1")
    try:
        client = ops.OpsClient(server.endpoint)
        client.submit(ops.Stats())
        got = []
        for _ in range(200):  # one thread: each side turns its own loop
            client.poll(0.01)
            got += server.receive(0.01)
            if got:
                break
        (peer, rid, _), = got
        client.close()
        w = worker(PrefillWorker, "prefill", FakeSender)
        w.ops_server = server
        for _ in range(100):  # the server notices the close on its loop
            try:
                server.reply(peer, rid, ops.Ack())
            except PeerLost:
                break
            server.receive(0.02)
        else:
            raise AssertionError("a closed client's peer never became PeerLost")
        w.reply(peer, rid, ops.Ack())  # absorbed, counted
        assert w.counters["replies_lost"] == 1
    finally:
        server.close()
