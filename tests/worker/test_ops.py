"""Ops channel: typed messages, version/type tags, HMAC, errors that never kill the loop."""

from __future__ import annotations

import msgpack
import pytest
import zmq

from kvbridge.errors import ProtocolError
from kvbridge.worker import ops


def test_round_trip_every_message():
    msgs = [ops.Prefill(1, 100, 32), ops.Decode(2, 50, "prefill-a", 0), ops.Stats(), ops.Shutdown(),
            ops.RoomResult(3, False, "boom", "p/dp0", 10, 10, 2, {"transfer": 0.5}), ops.StatsReply({"a": 1}),
            ops.Ack(), ops.OpError("nope")]
    for i, msg in enumerate(msgs):
        assert ops.decode(ops.encode(msg, i)) == (i, msg)
        assert ops.decode(ops.encode(msg, i, b"k"), b"k") == (i, msg)


@pytest.mark.parametrize(
    "body, field",
    [
        (b"\xc1", "body"),
        (msgpack.packb([1, 2]), "body"),
        (msgpack.packb({"v": 99, "t": "stats", "id": 1}), "v"),
        (msgpack.packb({"v": 1, "t": "launch", "id": 1}), "t"),
        (msgpack.packb({"v": 1, "t": ["prefill"], "id": 1}), "t"),  # unhashable: was a TypeError out of the loop
        (msgpack.packb({"v": 1, "t": {"a": 1}, "id": 1}), "t"),
        (msgpack.packb({"v": 1, "t": "stats", "id": "x"}), "id"),
        (msgpack.packb({"v": 1, "t": "prefill", "id": 1, "room": 1}), "prefill"),
        (msgpack.packb({"v": 1, "t": "prefill", "id": 1, "room": 1, "num_tokens": 2, "bogus": 3}), "prefill"),
        (msgpack.packb({"v": 1, "t": "prefill", "id": 1, "room": "1", "num_tokens": 2}), "prefill.room"),
    ],
)
def test_malformed_messages_are_named(body, field):
    with pytest.raises(ProtocolError) as info:
        ops.decode([body])
    assert info.value.field == field


def test_hmac_is_required_when_a_secret_is_set():
    frames = ops.encode(ops.Stats(), 1, b"right")
    with pytest.raises(ProtocolError, match="authenticated"):
        ops.decode(frames, b"wrong")
    with pytest.raises(ProtocolError, match="authenticated"):
        ops.decode(frames[:1], b"right")


def test_server_answers_garbage_and_keeps_serving():
    ctx = zmq.Context()
    server = ops.OpsServer("127.0.0.1", 0, secret=b"s", ctx=ctx)
    client = ops.OpsClient(server.endpoint, secret=b"s", ctx=ctx)
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.endpoint)
    try:
        raw.send_multipart([b"garbage"])
        assert server.receive(2.0) == []
        assert raw.poll(2000)
        _, reply = ops.decode(raw.recv_multipart(), b"s")
        assert isinstance(reply, ops.OpError) and "authenticated" in reply.reason
        a, b = client.submit(ops.Stats()), client.submit(ops.Prefill(5, 10))
        got = []
        for _ in range(20):
            got += server.receive(0.2)
            if len(got) == 2:
                break
        assert [op for _, _, op in got] == [ops.Stats(), ops.Prefill(5, 10)]
        for peer, rid, op in reversed(got):  # replies out of order are matched by id
            server.reply(peer, rid, ops.Ack() if rid == a else ops.RoomResult(5, True))
        assert client.wait(a, 2.0) == ops.Ack()
        assert client.wait(b, 2.0) == ops.RoomResult(5, True)
    finally:
        raw.close()
        client.close()
        server.close()
        ctx.term()
