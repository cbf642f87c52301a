"""The hostile checks on the channel's fair budgets and on a daemon restart (issue 32), over the
running chaos cluster. Each attacker holds the cluster secret (and, where it registers, the
write token):

- ``starvation``: 40 authenticated connections of one identity (one Hello name, one source
  address) push the largest signed frames as fast as the sockets take them at a prefill rank,
  while two real rooms run on the decode rank's connections and a second identity (another
  address) sends one frame larger than a connection's allowance, which must draw on the shared
  frame budget. Defended when both rooms succeed and the second identity's frame is answered
  within its frame deadline (the budget serves addresses in turn; before, in arrival order, 40
  connections starved two rooms until they failed at 40 s).
- ``address_flood``: a TP 2 decode host (two decode ranks of a new instance, one address)
  proves itself on a room; then authenticated connections from thousands of loopback source
  addresses (one each: 127.0.x.y) fill every slot of a prefill rank and keep knocking for
  more. Defended when the attacker holds no slot a registered rank held (it holds at most
  ``max_connections`` minus the proven ranks' connections), none of its held connections is
  closed for a newcomer, and the TP 2 host's rooms succeed during the hold (before: one of its
  two connections was displaced and the rank refused on reconnect; rooms 0 of 2).
- ``proving_bytes``: connections whose Hello names the live decode rank's registration (which
  they cannot prove) send TransferRequests carrying 1 MiB page lists while the proof waits for
  an answer that never comes: the messages are held. Defended when the prefill rank refuses
  what is over the held-bytes caps by name, its RSS peak stays within the held cap plus the
  readers' bound (``docs/security.md``), and a real room succeeds meanwhile (before: capped by
  count, +422 MiB from 16 connections).
- ``restart_race``: the decode worker is stopped (SIGSTOP) and the daemon restarted (SIGTERM,
  started again on its port with its claims file); from the moment the new daemon answers, the
  attacker registers the victim's exact session, pools and scratch (its own key, the victim's
  public key, none) as fast as it can; then the victim resumes. Defended when no squat is
  accepted, the victim registers again and a real room succeeds (0 bytes: nothing the attacker
  registered was accepted, so no room is ever asked into the victim's memory).

Each record's ``details`` say the slots the attacker held, the target's RSS peak and whether a
legitimate rank's rooms still succeeded, as the other attacks' do.
"""

from __future__ import annotations

import collections
import os
import selectors
import signal
import socket
import threading
import time
from typing import Any

import httpx

from kvbridge.chaos.hostile_identity import contract_of, victim_of
from kvbridge.chaos.hostile_sockets import authenticated, closed, port_of, try_send
from kvbridge.errors import ProtocolError
from kvbridge.transfer.channel import Limits, PeerSet, wire
from kvbridge.transfer.channel.frames import HEADER, frame
from kvbridge.transfer.ownership import ProofKey
from kvbridge.transfer.prefill.admission import MAX_WAITING_BYTES, MAX_WAITING_BYTES_PER_CONNECTION
from kvbridge.worker import ops

__all__ = ["AuthFlood", "Starver", "address_flood", "proving_bytes", "restart_race", "starvation", "starve_due",
           "probe_frame"]

# ``h`` below is ``hostile.Hostile`` and ``out`` its ``Outcome`` (duck-typed, as in hostile_identity.py)
Hostile = Outcome = Any
DEFENDED, VULNERABLE = "defended", "vulnerable"
SLACK_MIB = 16.0  # the loop's own allocations and what the allocator keeps (as postauth_partial's)
JUDGED_S = 0.3  # a Hello still open this long after it was sent was taken (a refusal closes at once)
PROBE_SLACK_S = 2.0  # a deadline is checked every SCAN_S; a loaded 2-core host adds scheduling delay
STARVE_PACE = 0.6  # of Limits.frame_rate: a paced frame holds its reservation for most of its deadline
STARVE_WARMUP_S = 0.5  # the flood pushes this long before the rooms and the other identity start


def _rss_watch(h: Hostile, m: Any, stop: threading.Event, peak: list[float]) -> threading.Thread:
    """A thread sampling ``m``'s RSS every 20 ms into ``peak[0]`` until ``stop``."""
    def run() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], h.rss(m) or 0.0)
            stop.wait(0.02)

    t = threading.Thread(target=run, name="hostile-rss", daemon=True)
    t.start()
    return t


def _in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    t.start()
    return t, result


# -- 1. one identity's flood of large frames ------------------------------------------------------

def _largest_ping(secret: bytes, seq: int) -> bytes:
    """A signed probe Ping as large as a control frame may be (prefill answers it with a Heartbeat)."""
    body = wire.encode(wire.Ping(decode_rank="", seq=seq), secret)
    pad = wire.MAX_MESSAGE_BYTES - len(body) - 64
    return frame(wire.encode(wire.Ping(decode_rank="x" * pad, seq=seq), secret))


def probe_frame(port: int, source: str, secret: bytes, size: int, timeout: float) -> float | None:
    """Seconds from sending a signed probe Ping of ``size`` bytes (past a connection's allowance:
    it needs the shared budget) from ``source`` to its Heartbeat, or None."""
    sock = authenticated(port, 0, 1, secret, "hostile-probe", source=source)
    if sock is None:
        return None
    codec = wire.codec(secret)
    data = frame(wire.encode(wire.Ping(decode_rank="y" * size, seq=7), secret))
    buf = bytearray()
    t0 = time.monotonic()
    try:
        sock.settimeout(timeout)
        sock.sendall(data)
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except (socket.timeout, OSError):
                return None
            if not chunk:
                return None
            buf += chunk
            while len(buf) >= HEADER.size and len(buf) - HEADER.size >= HEADER.unpack_from(buf)[0]:
                (n,) = HEADER.unpack_from(buf)
                body, buf = bytes(buf[HEADER.size:HEADER.size + n]), buf[HEADER.size + n:]
                try:
                    msg = codec.decode(body)
                except ProtocolError:
                    continue
                if isinstance(msg, wire.Heartbeat) and msg.seq == 7:
                    return round(time.monotonic() - t0, 3)
        return None
    finally:
        sock.close()


class Starver:
    """``n`` authenticated connections of one identity (one name, one source address) that push
    the largest signed frames, each paced at ``pace`` bytes a second once the server reads it
    (small kernel buffers: what it sends before the server reads waits in the attacker's hand),
    so every share of the frame budget it wins is held for most of its frame's deadline; one
    the server closes is opened again. ``pump()`` sends each connection's quota since the last."""

    def __init__(self, port: int, secret: bytes, n: int, source: str, pace: float) -> None:
        self.port, self.secret, self.source, self.pace = port, secret, source, pace
        self.stream = b"".join(_largest_ping(secret, i) for i in range(4))
        self.frame_bytes = len(self.stream) // 4
        self.socks: dict[socket.socket, int] = {}  # connection -> where it is in ``stream``
        self.pushed = self.reopened = 0
        for _ in range(n):
            self._open()
        self._last = time.monotonic()

    def _open(self) -> bool:
        sock = authenticated(self.port, 0, 1, self.secret, "hostile-starver", source=self.source)
        if sock is None:
            return False
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 << 10)
        self.socks[sock] = 0
        return True

    def pump(self) -> None:
        now = time.monotonic()
        quota = max(1, int(self.pace * (now - self._last)))
        self._last = now
        for sock, at in list(self.socks.items()):
            sent = try_send(sock, self.stream[at:at + quota])
            self.pushed += sent
            self.socks[sock] = (at + sent) % len(self.stream)
            if not sent and closed(sock):  # (closed on a deadline: another of the same identity)
                del self.socks[sock]
                sock.close()
                self.reopened += self._open()

    def run_for(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            self.pump()
            time.sleep(0.02)

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


def starvation(h: Hostile, out: Outcome) -> None:
    s, m, limits = h.spec, h.c.prefill[0], Limits()
    out.target = m.name
    port, secret = port_of(h.endpoint(0)), h.c.secret.encode()
    before = out.rss_before_mib = h.rss(m) or 0.0
    stop, peak = threading.Event(), [before]
    watcher = _rss_watch(h, m, stop, peak)
    flood = Starver(port, secret, s.starve_connections, s.starve_source, STARVE_PACE * limits.frame_rate)
    try:
        flood.run_for(STARVE_WARMUP_S)  # every connection of the flood waits for the budget first
        rooms_t, rooms = _in_thread(lambda: h.traffic.batch(2, s.room_timeout))
        probe_t, probe = _in_thread(lambda: probe_frame(port, s.probe_source, secret, s.probe_bytes, s.room_timeout))
        hold_until = time.monotonic() + s.flood_hold_s
        while rooms_t.is_alive() or probe_t.is_alive() or time.monotonic() < hold_until:
            flood.pump()
            time.sleep(0.02)
        held = len(flood.socks)
    finally:
        flood.close()
        stop.set()
        watcher.join(2.0)
    out.rss_after_mib = h.rss(m)
    rooms_ok = bool(rooms) and all(r.ok for r in rooms[0])
    why = "; ".join(f"{n}: {r}"[:200] for room in (rooms[0] if rooms else []) for n, _, r in room.failures)
    probe_s = probe[0] if probe else None
    due = starve_due(flood.frame_bytes, s.probe_bytes)
    out.details = {"connections": s.starve_connections, "identity": "hostile-starver", "source": s.starve_source,
                   "slots_held": held, "reopened": flood.reopened, "frame_bytes": flood.frame_bytes,
                   "pace_bytes_per_s": int(flood.pace), "bytes_pushed_mib": round(flood.pushed / (1 << 20), 1),
                   "rss_peak_mib": peak[0], "rss_growth_mib": round(peak[0] - before, 1), "rooms_ok": rooms_ok,
                   "rooms": len(rooms[0]) if rooms else 0, "room_failures": why or None,
                   "second_identity_frame_bytes": s.probe_bytes, "second_identity_answered_s": probe_s,
                   "second_identity_due_s": round(due, 2), "legit_room_ok": rooms_ok}
    out.outcome = DEFENDED if rooms_ok and probe_s is not None and probe_s <= due else VULNERABLE


def starve_due(frame_bytes: int, probe_bytes: int, limits: Limits | None = None) -> float:
    """How long another identity's frame may wait under a flood: one turn (the share held when
    it came, at most the flood frame's deadline), then its own frame, plus scheduling slack."""
    limits = limits or Limits()
    return limits.frame_deadline(frame_bytes) + limits.frame_deadline(probe_bytes) + PROBE_SLACK_S


# -- 2. thousands of source addresses against a TP 2 decode host --------------------------------

class AuthFlood:
    """Authenticated connections from ``addresses`` loopback source addresses (one each),
    opened ``window`` at a time (under the server's pending cap) with a selector: each reads its
    challenge and answers with a valid Hello. ``held``: those the server kept; ``refused``: those
    it closed right after the Hello; ``lost``: held ones it closed later (displaced or timed out)."""

    def __init__(self, port: int, secret: bytes, name: str, first_address: int = 2, window: int = 48) -> None:
        self.port, self.secret, self.name, self.window = port, secret, name, window
        self.next_address = first_address
        self.held: list[socket.socket] = []
        self.refused = self.failed = self.lost = 0
        self._codec = wire.codec(secret)

    def _source(self) -> str:
        n = self.next_address
        self.next_address += 1
        return f"127.{(n >> 16) & 255}.{(n >> 8) & 255}.{n & 255}"

    def open(self, n: int, timeout: float) -> None:
        """Open ``n`` more connections (each from a new address), Hello sent; wait for the verdicts."""
        sel = selectors.DefaultSelector()
        pending: dict[socket.socket, bytearray] = {}  # connected, challenge not read yet (the window)
        judged: collections.deque[tuple[float, socket.socket]] = collections.deque()  # Hello sent, by when
        todo, deadline = n, time.monotonic() + timeout
        try:
            while (todo or pending or judged) and time.monotonic() < deadline:
                while todo and len(pending) < self.window:
                    todo -= 1
                    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    try:
                        sock.bind((self._source(), 0))
                        sock.setblocking(False)
                        sock.connect_ex(("127.0.0.1", self.port))
                    except OSError:
                        sock.close()
                        self.failed += 1
                        continue
                    pending[sock] = bytearray()
                    sel.register(sock, selectors.EVENT_READ)
                for key, _ in sel.select(0.01):
                    sock = key.fileobj
                    if sock in pending:
                        verdict = self._challenge(sock, pending[sock])
                        if verdict is not None:
                            del pending[sock]
                        if verdict:
                            judged.append((time.monotonic(), sock))
                        elif verdict is not None:
                            self.failed += 1
                            sel.unregister(sock)
                            sock.close()
                    elif closed(sock):  # a refusal closes it at once
                        sel.unregister(sock)
                        sock.close()
                        self.refused += 1
                now = time.monotonic()
                while judged and (judged[0][1].fileno() < 0 or now - judged[0][0] > JUDGED_S):  # (closed: refused)
                    _, sock = judged.popleft()
                    if sock.fileno() >= 0:  # kept past a moment: held
                        sel.unregister(sock)
                        self.held.append(sock)
        finally:
            for sock in [*pending, *(s for _, s in judged)]:
                if sock.fileno() >= 0:
                    self.failed += 1
                    sock.close()
            sel.close()

    def _challenge(self, sock: socket.socket, buf: bytearray) -> bool | None:
        """Read the challenge; once whole, send the Hello: True (sent), False (failed), None (more to read)."""
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return None
        except OSError:
            data = b""
        buf += data
        if data and (len(buf) < HEADER.size or len(buf) - HEADER.size < HEADER.unpack_from(buf)[0]):
            return None
        try:
            if not data:
                raise OSError("closed before its challenge")
            (size,) = HEADER.unpack_from(buf)
            nonce = self._codec.open_challenge(bytes(buf[HEADER.size:HEADER.size + size])).nonce
            sock.sendall(frame(self._codec.hello(self.name, nonce)))
        except (OSError, ProtocolError):
            return False
        return True

    def sweep(self) -> None:
        """Drop (and count) the held connections the server closed since."""
        for sock in [s for s in self.held if closed(s)]:
            self.held.remove(sock)
            sock.close()
            self.lost += 1

    def close(self) -> None:
        for sock in self.held:
            sock.close()
        self.held.clear()


def _rooms(h: Hostile, decode: list[Any], n: int) -> tuple[bool, str]:
    """``n`` rooms at once through both prefill ranks and the ``decode`` ranks: (all ok, failures)."""
    rooms = [h.next_room() for _ in range(n)]
    pending = [(m, h.submit(m, ops.Prefill(room, h.spec.tokens, 0) if m.role == "prefill"
                              else ops.Decode(room, h.spec.tokens, h.c.prefill_instance)))
               for room in rooms for m in (*h.c.prefill, *decode)]
    results = [(m.name, h.wait_reply(m, request_id, h.spec.room_timeout)) for m, request_id in pending]
    failed = [f"{name}: {h.reason(r)}" for name, r in results if not (isinstance(r, ops.RoomResult) and r.ok)]
    return not failed, "; ".join(failed)[:600]


def _spawn_tp2(h: Hostile, name: str) -> list[Any]:
    """A decode instance of two TP ranks on this host (every flag of the cluster's own), started."""
    from kvbridge.chaos.cluster import Member

    legit = h.c.decode[0]
    members = []
    for r in range(2):
        argv = [*_replaced(legit.argv, {"--instance": name, "--lease-file": str(h.c.workdir / f"{name}-tp{r}.lease")}),
                "--tp-rank", str(r), "--tp-size", "2"]
        m = Member(f"{name}-tp{r}", "decode", argv)
        m.proc = h.c.group.spawn(m.name, argv, ready_file=True)
        members.append(m)
    for m in members:
        m.ready = h.c.group.wait_ready(m.proc, 60.0)
        m.client = ops.OpsClient(m.ready["ops"], secret=h.c.secret.encode())
    return members


def _stop(members: list[Any]) -> None:
    for m in members:
        if m.client is not None:
            m.client.close()
        if m.alive:
            m.proc.popen.send_signal(signal.SIGTERM)
    for m in members:
        try:
            m.proc.popen.wait(15.0)
        except Exception:  # subprocess.TimeoutExpired: the group's stop_all ends it at close
            pass


def _replaced(argv: list[str], flags: dict[str, str]) -> list[str]:
    out = list(argv)
    for flag, value in flags.items():
        out[out.index(flag) + 1] = value
    return out


def address_flood(h: Hostile, out: Outcome) -> None:
    s, m, limits = h.spec, h.c.prefill[0], Limits()
    out.target = m.name
    before = out.rss_before_mib = h.rss(m) or 0.0
    tp2 = _spawn_tp2(h, "hostile-tp2")
    flood = AuthFlood(port_of(h.endpoint(0)), h.c.secret.encode(), "hostile-address")
    stop, peak = threading.Event(), [before]
    watcher = None
    try:
        warm, _ = _rooms(h, tp2, 1)  # both TP ranks connect to both prefill ranks and prove
        conns_before = h.c.stats(m).get("control_connections", {})
        proven = int(conns_before.get("proven", 0))  # the cluster's decode rank and the TP 2 host's
        watcher = _rss_watch(h, m, stop, peak)
        t0 = time.monotonic()
        free = limits.max_connections - int(conns_before.get("peers", 0))
        for _ in range(8):  # (a Hello still unread when newer connections fill the pending pool is evicted)
            flood.open(free - len(flood.held), 60.0)
            flood.sweep()  # (a loaded server judges a Hello late: what it closed since is not held)
            if len(flood.held) >= free:
                break
        fill_s = round(time.monotonic() - t0, 1)
        evicted_while_filling, flood.refused = flood.refused, 0
        flood.open(s.address_flood_extra, 30.0)  # more than every slot: refused, or displacing someone
        flood.sweep()
        held_full = len(flood.held)
        rooms_t, rooms = _in_thread(lambda: _rooms(h, tp2, 2))
        knocks = 0
        hold_until = time.monotonic() + s.flood_hold_s
        while rooms_t.is_alive() or time.monotonic() < hold_until:  # newcomers keep knocking meanwhile
            flood.open(16, 5.0)
            knocks += 16
            flood.sweep()
        rooms_t.join(1.0)
        flood.sweep()
        conns_after = h.c.stats(m).get("control_connections", {})
    finally:
        flood.close()
        stop.set()
        if watcher is not None:
            watcher.join(2.0)
        _stop(tp2)
    out.rss_after_mib = h.rss(m)
    rooms_ok, why = rooms[0] if rooms else (False, "room thread failed")
    # a proven connection lost during the hold is a registered rank displaced (or closed)
    lost_proven = max(0, proven - int(conns_after.get("proven", 0)))
    out.details = {"addresses": flood.next_address - 2, "slots": limits.max_connections,
                   "connections_before": conns_before, "connections_after": conns_after,
                   "proven_connections": proven, "proven_lost": lost_proven, "slots_held": held_full, "fill_s": fill_s,
                   "closed_while_filling": evicted_while_filling, "refused_after_hello": flood.refused, "connect_failures": flood.failed,
                   "knocks_during_hold": knocks, "held_closed_by_server": flood.lost,
                   "displaced_during_attack": int(conns_after.get("displaced", 0))
                   - int(conns_before.get("displaced", 0)), "warm_room_ok": warm,
                   "rooms_during_hold_ok": rooms_ok, "rooms": 2,
                   "room_failures": why or None, "rss_peak_mib": peak[0], "rss_growth_mib": round(peak[0] - before, 1),
                   "legit_room_ok": rooms_ok}
    filled = held_full + int(conns_before.get("peers", 0)) >= limits.max_connections
    out.outcome = DEFENDED if warm and filled and proven >= 3 and not lost_proven and rooms_ok else VULNERABLE


# -- 3. messages held while a connection proves itself -------------------------------------------

def proving_bytes(h: Hostile, out: Outcome) -> None:
    s, m, limits = h.spec, h.c.prefill[0], Limits()
    out.target = m.name
    _, victim, victim_id = victim_of(h)
    before = out.rss_before_mib = h.rss(m) or 0.0
    endpoint = h.endpoint(0)
    pages = b"\0" * s.proving_page_bytes  # a page list of 1 MiB: what a held message weighs
    label = f"{h.c.decode_instance}/dp0/tp0"
    conns = [PeerSet(secret=h.c.secret.encode(), name=victim_id) for _ in range(s.proving_connections)]
    replies: dict[str, int] = {}
    challenges = 0
    stop, peak = threading.Event(), [before]
    watcher = _rss_watch(h, m, stop, peak)
    sent = 0
    try:
        for peers in conns:
            for _ in range(s.proving_messages):
                peers.send(endpoint, wire.TransferRequest(
                    room=h.next_room(), decode_rank=label, decode_rank_id=victim_id, page_ids=pages, first_page=0,
                    pools=sorted({p["pool"] for p in victim["pools"]}), aux_slot=0, num_tokens=s.tokens,
                    deadline_ms=10_000, want_digest=False, fingerprint=victim["fingerprint"], num_decode_ranks=1))
                sent += 1
        room_t, room = _in_thread(h.room_ok)
        hold_until = time.monotonic() + s.flood_hold_s
        while room_t.is_alive() or time.monotonic() < hold_until:
            for peers in conns:  # never answers a challenge: every message it sent waits
                for _, msg in peers.recv_ready(0):
                    if isinstance(msg, wire.KeyChallenge):
                        challenges += 1
                    elif isinstance(msg, wire.ErrorReply):
                        kind = "over the held-bytes caps" if "bytes of messages wait" in msg.reason else msg.reason[:80]
                        replies[kind] = replies.get(kind, 0) + 1
            time.sleep(0.02)
    finally:
        for peers in conns:
            peers.close()
        stop.set()
        watcher.join(2.0)
    out.rss_after_mib = h.rss(m)
    ok, seconds, why = room[0] if room else (False, 0.0, "room thread failed")
    growth = round(peak[0] - before, 1)
    held_cap = MAX_WAITING_BYTES / (1 << 20)
    readers = (s.proving_connections * limits.frame_allowance + limits.frame_budget) / (1 << 20)
    bound = round(held_cap + 3 * readers + SLACK_MIB, 1)
    capped = replies.get("over the held-bytes caps", 0)
    out.details = {"connections": s.proving_connections, "messages_sent": sent,
                   "bytes_sent_mib": round(sent * s.proving_page_bytes / (1 << 20), 1), "key_challenges": challenges,
                   "refused_over_cap": capped, "other_refusals": {k: v for k, v in replies.items()
                                                                  if k != "over the held-bytes caps"},
                   "held_cap_mib": held_cap, "held_cap_per_connection_mib": MAX_WAITING_BYTES_PER_CONNECTION / (1 << 20),
                   "slots_held": s.proving_connections, "rss_peak_mib": peak[0], "rss_growth_mib": growth,
                   "rss_bound_mib": bound, "stated_worst_case_mib": 223.0, "legit_room_ok": ok,
                   "legit_room_seconds": seconds, "legit_room_failure": why}
    out.outcome = DEFENDED if ok and growth <= bound and capped > 0 else VULNERABLE


# -- 4. the daemon restarted while a victim is down ----------------------------------------------

def _register(h: Hostile, body: dict[str, Any]) -> httpx.Response | None:
    try:
        return httpx.post(f"{h.c.url}/v1/ranks", json=body, headers=h.auth, timeout=2.0, trust_env=False)
    except httpx.HTTPError:
        return None  # the daemon is not answering yet


class _Race(threading.Thread):
    """Registers the victim's session under each of ``keys`` in turn, as fast as the daemon
    answers, from before it answers until ``race_s`` after its first answer (or ``stop``)."""

    def __init__(self, h: Hostile, body: dict[str, Any], keys: tuple[tuple[str, str | None], ...]) -> None:
        super().__init__(name="hostile-race", daemon=True)
        self.h, self.body, self.keys = h, body, keys
        self.statuses: dict[str, dict[str, int]] = {name: {} for name, _ in keys}
        self.accepted: list[dict[str, Any]] = []
        self.tries = self.unanswered = 0
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(10.0)

    def run(self) -> None:
        first_answer, until = None, time.monotonic() + 60.0
        while not self._stop_event.is_set() and time.monotonic() < until:
            for i, (name, key) in enumerate(self.keys):
                squat = {**self.body, "rank": {"instance": f"hostile-race-{i}", "role": "decode"}}
                if key is not None:
                    squat["proof_key"] = key
                r = _register(self.h, squat)
                self.tries += 1
                if r is None:
                    self.unanswered += 1
                    continue
                first_answer = first_answer or time.monotonic()
                self.statuses[name][str(r.status_code)] = self.statuses[name].get(str(r.status_code), 0) + 1
                if r.status_code == 201:
                    self.accepted.append(r.json())
            if first_answer is not None and time.monotonic() - first_answer > self.h.spec.race_s:
                return
            if first_answer is None:
                time.sleep(0.01)


def restart_race(h: Hostile, out: Outcome) -> None:
    victim_m, victim, victim_id = victim_of(h)
    out.target = victim_m.name
    out.rss_before_mib = h.rss(victim_m)
    contract = contract_of(h)
    body = {"control_endpoint": "tcp://127.0.0.1:9", "session_id": victim["session_id"], "pools": victim["pools"],
            "aux": victim["aux"], "aux_regions": victim["aux_regions"], "contract": contract, "lease_ttl_s": 60.0,
            "scratch": victim["scratch"]}
    if victim.get("engine_metadata"):
        body["engine_metadata"] = victim["engine_metadata"]
    keys = (("own key", ProofKey().public_hex), ("victim's key", victim["proof_key"]), ("no key", None))
    race = _Race(h, body, keys)
    os.kill(victim_m.pid, signal.SIGSTOP)  # type: ignore[arg-type]
    try:
        h.c.signal(h.c.daemon, signal.SIGTERM)
        code = h.c.wait_exit(h.c.daemon, 20.0)
        race.start()  # (squats from before the new daemon answers)
        t0 = time.monotonic()
        # the daemon is started from this thread: a worker process dies with the thread that started it
        h.c.restart(h.c.daemon)
        restart_s = round(time.monotonic() - t0, 1)
        race.join(60.0)
    finally:
        race.stop()
        os.kill(victim_m.pid, signal.SIGCONT)  # type: ignore[arg-type]
        for reg in race.accepted:
            httpx.delete(f"{h.c.url}/v1/ranks/{reg['rank_id']}", timeout=5.0, trust_env=False,
                         headers={**h.auth, "X-KVBridge-Lease": reg.get("lease_secret", "")})
    t0 = time.monotonic()
    registered = h.c.wait_registered(30.0)  # every rank back (the victim with its own key), then a room
    back_s = round(time.monotonic() - t0, 1)
    ok, seconds, why = h.room_within(30.0)
    back = h.get(f"/v1/instances/{h.c.decode_instance}")
    out.rss_after_mib = h.rss(victim_m)
    accepted = race.accepted
    out.details = {"daemon_exit": code, "daemon_restart_s": restart_s, "ranks_back_s": back_s,
                   "every_rank_registered_again": registered, "claims_file": str(h.c.claims_file),
                   "squat_tries": race.tries,
                   "squats_before_it_answered": race.unanswered, "squat_statuses": race.statuses,
                   "squats_accepted": len(accepted), "slots_held": len(accepted),
                   "victim_registered_again": back.status_code == 200 and back.json().get("num_ranks") == 1,
                   "legit_room_ok": ok, "legit_room_seconds": seconds, "legit_room_failure": why}
    out.outcome = DEFENDED if not accepted and ok else VULNERABLE
