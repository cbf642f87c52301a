"""Every authenticated malformed control message gets exactly one ErrorReply (issue 10,
bug 5). A seeded fuzzer signs messages with the cluster secret and breaks them in every
way the decoder checks: bytes that are not msgpack, msgpack that is not a map, versions,
type tags, missing fields, wrong types, out-of-range values, empty bodies, and messages
over the size limit. A bare TCP client sends them (``_raw_control``). Before the fix, the oversized ones (the MAC was checked after the
size, so they counted as unauthenticated) were dropped without a word."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator

import msgpack

from _raw_control import RawControl
from kvbridge.errors import ProtocolError
from kvbridge.transfer.channel import wire
from kvbridge.transfer.channel import ControlServer

SECRET = b"fuzz-secret"
MAX_BYTES = 4096
FIELD_VALUES: list[object] = [None, -1, 2**64 - 1, 2**63, "x", b"\x01\x02\x03", [1, [2]], {"k": 1}, 1.5, True]


SIGNER = wire.codec(SECRET)


def signed(body: bytes, version: int = wire.WIRE_VERSION) -> bytes:
    return SIGNER.with_version(version).seal(body)


def valid_map(rng: random.Random) -> dict:
    tag = rng.choice(sorted(wire.MESSAGE_TYPES))
    sample = {"room": 7, "decode_rank": "d0", "session": "127.0.0.1:1", "page_ids": b"\0" * 8, "pools": ["target"],
              "buffers": [["target", 0, 4096, 8, 64]], "aux_base": 0, "aux_capacity": 1, "aux_row_bytes": 8,
              "aux_slot": 0, "num_tokens": 10, "deadline_ms": 100, "want_digest": False, "fingerprint": "f",
              "num_decode_ranks": 1, "decode_rank_id": "r1", "first_page": 0, "reason": "r", "seq": 1, "cp_rank": 0, "status": "ok", "logical_pages": b"",
              "digests": None, "ref_type": "ping", "aux": False, "nonce": b"\0" * wire.NONCE_BYTES, "offset": 0,
              "staging_slots": 0, "staging_slot_bytes": 0, "staging_base": 0, "staging_only": False, "chunk": 0,
              "slot": 0, "num_bytes": 0, "scatter": b"", "signature": b"\0" * wire.SIGNATURE_BYTES, "binding": b"",
              "decider": "p0", "instance": "d"}
    sample.update(kind_units={}, kind_last=False, kind_digests={})  # the pool kinds' units (transfer/prefill/kinds.py)
    sample.update(aux_inline=False, aux_row=None, aux_ahead=False)  # the aux row in a report (wire 14, 15)
    sample.update(staging_granted=[])  # slots granted with the request (wire 18)
    return {"t": tag, **{f: sample[f] for f in wire.MESSAGE_TYPES[tag].__struct_fields__}}


def broken(rng: random.Random) -> tuple[str, bytes]:
    """(category, frame body) of one authenticated message that must be refused."""
    m = valid_map(rng)
    fields = [k for k in m if k != "t"]
    version = wire.WIRE_VERSION
    kind = rng.choice(["bytes", "not-a-map", "version", "tag", "missing", "type", "range", "empty", "oversized"])
    if kind == "bytes":
        body = bytes([0xC1]) + rng.randbytes(rng.randrange(0, 64))
    elif kind == "not-a-map":
        body = msgpack.packb(rng.choice([[1, 2, 3], "text", 5, None, [b"a", b"b"]]))
    elif kind == "version":
        version = rng.choice([0, 1, wire.WIRE_VERSION - 1, wire.WIRE_VERSION + 1, 65535])
        body = msgpack.packb(m)
    elif kind == "tag":
        m["t"] = rng.choice(["launch", "", 3, None, ["ping"], {"t": 1}])
        body = msgpack.packb(m)
    elif kind == "missing":  # a field without a default (one with a default may be left out)
        cls = wire.MESSAGE_TYPES[m["t"]]
        required = cls.__struct_fields__[: len(cls.__struct_fields__) - len(cls.__struct_defaults__)]
        del m[rng.choice(required)]
        body = msgpack.packb(m)
    elif kind == "type":
        name = rng.choice(fields)
        m[name] = rng.choice([v for v in FIELD_VALUES if type(v) is not type(m[name])])
        body = msgpack.packb(m)
    elif kind == "range":
        ints = [k for k in fields if isinstance(m[k], int) and not isinstance(m[k], bool)]
        name = rng.choice(ints) if ints else "room"
        m[name] = rng.choice([-5, 2**64 - 1]) if name != "room" else 2**63
        body = msgpack.packb(m)
    elif kind == "empty":
        body = b""
    else:
        m["pad"] = b"p" * rng.randrange(MAX_BYTES, 2 * MAX_BYTES - 200)  # unknown fields are ignored: size is the fault
        body = msgpack.packb(m)
    return kind, signed(body, version)


def refused(body: bytes) -> bool:
    """The fuzzer also makes a few valid messages (a None where None is allowed): skip those."""
    try:
        wire.decode(body, SECRET, max_bytes=MAX_BYTES)
    except ProtocolError:
        return True
    return False


class Serving:
    """A server loop thread, as a prefill rank runs one."""

    def __init__(self, server: ControlServer) -> None:
        self.server, self.errors, self._stop = server, 0, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self._stop.is_set():
            for _, msg in self.server.recv_ready(50):
                self.errors += isinstance(msg, ProtocolError)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)


def collect(sock: RawControl, count: int, decode: Callable[[bytes], object], timeout: float = 20.0) -> list[object]:
    got: list[object] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        body = sock.recv(0.1)
        if body is not None:
            got.append(decode(body))
    return got


@contextlib.contextmanager
def served() -> Iterator[tuple[ControlServer, Serving, RawControl]]:
    """A secret-holding server with its loop thread, and a bare client connected to it."""
    server = ControlServer(secret=SECRET, max_bytes=MAX_BYTES)
    loop = Serving(server)
    try:
        with RawControl(server.endpoint, secret=SECRET) as sock:
            yield server, loop, sock
    finally:
        loop.stop()
        server.close()


def test_every_authenticated_malformed_message_gets_one_error_reply() -> None:
    rng = random.Random(10_5)
    cases = [case for case in (broken(rng) for _ in range(700)) if refused(case[1])][:600]
    with served() as (server, loop, sock):
        for _, body in cases:
            sock.send(body)
        replies = collect(sock, len(cases), lambda data: wire.decode(data, SECRET, max_bytes=MAX_BYTES))
        kinds = {kind for kind, _ in cases}
        assert kinds >= {"bytes", "not-a-map", "version", "tag", "missing", "type", "range", "empty", "oversized"}
        assert len(replies) == len(cases), (len(replies), server.stats)
        assert all(isinstance(r, wire.ErrorReply) and r.reason for r in replies)
        assert sum("over the 4096-byte limit" in r.reason for r in replies) == sum(k == "oversized" for k, _ in cases)
        assert collect(sock, 1, bytes, timeout=0.2) == []  # exactly one reply each
    assert server.stats.unauthenticated == 0 and server.stats.error_replies == len(cases) == loop.errors


def test_a_message_not_signed_with_the_secret_is_still_dropped_whatever_its_size() -> None:
    with served() as (server, _, sock):
        body = msgpack.packb({"t": "ping", "pad": b"p" * (MAX_BYTES + 10)})
        sock.send(signed(body)[:3] + b"\0" * 32 + body)  # a forged MAC on an oversized message
        sock.send(wire.encode(wire.Ping(decode_rank="d", seq=1), b"another-secret"))
        assert collect(sock, 1, bytes, timeout=0.5) == []
        deadline = time.monotonic() + 5
        while server.stats.unauthenticated < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.stats.unauthenticated == 2 and server.stats.error_replies == 0
