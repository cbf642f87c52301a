"""Ops channel: typed messages, version/type tags, HMAC, errors that never kill the loop."""

from __future__ import annotations

import time

import msgpack
import pytest

from kvbridge.errors import ProtocolError
from kvbridge.transfer.channel.frames import HEADER, frame
from kvbridge.worker import ops


def test_round_trip_every_message():
    msgs = [ops.Prefill(1, 100, 32), ops.Decode(2, 50, "prefill-a", 0), ops.Stats(), ops.Shutdown(),
            ops.RoomResult(3, False, "boom", "p/dp0", 10, 10, 2, {"transfer": 0.5}), ops.StatsReply({"a": 1}),
            ops.Ack(), ops.OpError("nope"), ops.Prefill(4, 3, prompt=[1, 2, 3], batch_id=7, batch_size=2)]
    for i, msg in enumerate(msgs):
        assert ops.decode(ops.encode(msg, i)) == (i, msg)
        assert ops.decode(ops.encode(msg, i, b"k"), b"k") == (i, msg)


PLAIN = ops.codec()


def op(msg: dict, id_: object = 1) -> bytes:
    return PLAIN.seal(msgpack.packb({"t": "ops", "id": id_, "msg": msg}))


@pytest.mark.parametrize(
    "data, field",
    [
        (PLAIN.seal(b"\xc1"), None),
        (PLAIN.seal(msgpack.packb([1, 2])), None),
        (ops.codec().with_version(99).seal(msgpack.packb({"t": "ops", "id": 1, "msg": {"t": "stats"}})), "v"),
        (op({"t": "launch"}), "msg.t"),
        (op({"t": ["prefill"]}), "msg.t"),  # unhashable: was a TypeError out of the loop
        (op({"t": {"a": 1}}), "msg.t"),
        (op({"t": "stats"}, "x"), "id"),
        (op({"t": "prefill", "room": 1}), "num_tokens"),
        (op({"t": "prefill", "room": 1, "num_tokens": 2, "bogus": 3}), "msg"),
        (op({"t": "prefill", "room": "1", "num_tokens": 2}), "msg.room"),
        (op({"t": "prefill", "room": -1, "num_tokens": 2}), "msg.room"),
    ],
)
def test_malformed_messages_are_named(data, field):
    with pytest.raises(ProtocolError) as info:
        ops.decode(data)
    assert info.value.field == field


def test_an_unknown_field_is_refused_by_name():
    with pytest.raises(ProtocolError, match="bogus"):
        ops.decode(op({"t": "prefill", "room": 1, "num_tokens": 2, "bogus": 3}))


def test_hmac_is_required_when_a_secret_is_set():
    data = ops.encode(ops.Stats(), 1, b"right")
    with pytest.raises(ProtocolError, match="bad MAC"):
        ops.decode(data, b"wrong")
    with pytest.raises(ProtocolError, match="missing MAC"):
        ops.decode(ops.encode(ops.Stats(), 1), b"right")


def test_server_answers_garbage_and_keeps_serving():
    import socket

    server = ops.OpsServer("127.0.0.1", 0, secret=b"s")
    client = ops.OpsClient(server.endpoint, secret=b"s")
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    try:
        def next_frame() -> bytes:
            (size,) = HEADER.unpack(raw.recv(HEADER.size, socket.MSG_WAITALL))
            return raw.recv(size, socket.MSG_WAITALL)

        assert server.receive(0.5) == []  # accepts the connection and sends it a challenge
        nonce = ops.codec(b"s").open_challenge(next_frame()).nonce
        raw.sendall(frame(ops.codec(b"s").hello("raw", nonce)) + frame(ops.codec(b"s").seal(b"\xc1garbage")))
        assert server.receive(2.0) == []
        body = next_frame()
        rid, reply = ops.decode(body, b"s")
        assert rid == -1 and isinstance(reply, ops.OpError) and "not msgpack" in reply.reason
        a, b = client.submit(ops.Stats()), client.submit(ops.Prefill(5, 10))
        got = []
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            got += server.receive(0.2)
        assert [op for _, _, op in got] == [ops.Stats(), ops.Prefill(5, 10)]
        for peer, rid, op_ in reversed(got):  # replies out of order are matched by id
            server.reply(peer, rid, ops.Ack() if rid == a else ops.RoomResult(5, True))
        assert client.wait(a, 2.0) == ops.Ack()
        assert client.wait(b, 2.0) == ops.RoomResult(5, True)
        peer = got[0][0]
        server.reply(peer, 99, ops.Ack())
        client.wait(99, 2.0)
        server.send(peer, ops.OpsFrame(id=100, msg=ops.Stats()))  # an op sent to a client is just stored
    finally:
        raw.close()
        client.close()
        server.close()


def test_a_reply_sent_as_an_op_is_refused():
    server = ops.OpsServer("127.0.0.1", 0)
    client = ops.OpsClient(server.endpoint)
    try:
        rid = client._clients.get(server.endpoint).send(ops.OpsFrame(id=3, msg=ops.Ack())) or 3
        reply, deadline = None, time.monotonic() + 10
        while reply is None and time.monotonic() < deadline:  # (the client answers the challenge, then sends)
            assert server.receive(0.05) == []
            client.poll(0.05)
            reply = client.take(rid)
        assert isinstance(reply, ops.OpError) and "reply, not an op" in reply.reason
    finally:
        client.close()
        server.close()
