"""``kvbridge chaos --hostile``: attacks against a local cluster, and whether each was defended.

The cluster is the chaos cluster (``cluster.py``): a daemon with a write token, a CP 2
prefill instance and a decode rank with ``--poison-pages``, every message signed with a
cluster secret, all on 127.0.0.1. Each attack runs against those real processes:

    aliasing         a token + secret holder registers a decode rank with a live victim's
                     session id and pool bases (read from GET /v1/ranks/{id}) and asks
                     prefill for a room into the victim's free pages; defended: 0 bytes land
                     there (the victim's poison sweep counts them)
    preauth_flood    many connections hold partial frames before any Hello; defended: the
                     prefill rank's RSS grows by at most ``rss_bound_mib`` and a real room
                     moves during the flood
    slow_connection  one byte a second before the Hello (and, in the full run, inside a frame
                     after a valid Hello); defended: closed within the deadline (+ slack)
    slot_exhaustion  idle connections beyond the connection cap, held open (re-opened when
                     closed); defended: a restarted decode rank connects and moves a room
    room_collision   a second decode instance asks for (then aborts) a room the legitimate
                     one claimed; defended: the legitimate room succeeds once and the second
                     instance is refused, in every trial
    read_exposure    an anonymous client reads GET /v1/ranks/{id} and /v1/instances;
                     defended: no session id or buffer address comes back (the daemon
                     has a write token, so reads need a token too)
    hello_replay     one valid Hello captured off a real connection, replayed on more
                     connections than there are slots (re-opened when closed) while the
                     decode rank is restarted; defended: no replay holds a slot past the
                     Hello deadline and the restarted rank's room succeeds
    postauth_partial connections that pass the challenge with a valid Hello (the attacker
                     holds the secret) announce the largest frame and push its body; defended:
                     the prefill rank's RSS grows at most 3 x (connections x frame_allowance +
                     frame_budget) + ``postauth_slack_mib`` (docs/security.md) and a real room
                     moves meanwhile
    mac_flood        authenticated connections send frames that fail their MAC as fast as
                     the socket takes them, re-opening when closed; defended: every one is
                     closed by the server and a real room moves meanwhile
    spellings, mooncake_reader   identity attacks (``hostile_identity.py``): every other spelling
                     of the victim's session registered as an alias; an attacker that reads
                     any Mooncake-registered memory acting for the victim's registration
    bound_rooms, room_signatures   attacks on room ids (``hostile_rooms.py``): another request's
                     room, a room claimed before it opens, a reused room, a longer prompt; forged,
                     expired and moved router signatures
    nixl_metadata, metadata_flood, lease_squat   claims and the daemon's caps (``hostile_claims.py``)
    starvation, address_flood, proving_bytes, restart_race   fair budgets and a daemon restart
                     (``hostile_budgets.py``): one identity's paced flood of the largest frames, an
                     address flood against a TP 2 host's proven connections, bytes held while a
                     connection proves itself, squats raced against a restarted daemon
    split_collision  two decode instances race for one room id (``hostile_split.py``); defended:
                     one is served every page and the other refused by name, 0 bytes to it

``HostileSpec.engine`` picks the cluster's transfer engine (``--engine``); an attack that cannot
apply to it (``NOT_APPLICABLE_ON``) is reported ``not_applicable`` with the reason, never as defended.

Each attack's record: ``attack``, ``outcome`` ("defended", "vulnerable", "error" when the
harness could not run it, or "not_applicable" on this engine), ``target``,
``bytes_written_where_not_allowed``, ``rss_before_mib``, ``rss_after_mib`` (the attacked process), ``seconds``, ``details`` and ``error``. The report's
``ok`` is True only when every attack that applies was defended.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvbridge.chaos import hostile_budgets, hostile_claims, hostile_identity, hostile_rooms, hostile_split
from kvbridge.chaos.cluster import ChaosCluster, Member, proc_resources
from kvbridge.chaos.hostile_sockets import (Holder, Replayer, RoomWatch, authenticated, closed, connect, dribble, hello_for,
                                            port_of, try_send)
from kvbridge.chaos.traffic import Traffic
from kvbridge.errors import ConfigError
from kvbridge.transfer.channel import Limits, PeerSet
from kvbridge.transfer.channel import wire
from kvbridge.transfer.channel.envelope import HELLO_MAX_BYTES
from kvbridge.transfer.channel.frames import HEADER, frame
from kvbridge.worker import ops

__all__ = ["ATTACKS", "ATTACK_METHODS", "NOT_APPLICABLE_ON", "QUICK_ATTACKS", "HostileSpec", "run_hostile",
           "format_hostile"]

ATTACKS = ("aliasing", "preauth_flood", "slow_connection", "slot_exhaustion", "room_collision", "read_exposure",
           "hello_replay", "postauth_partial", "mac_flood", "spellings", "mooncake_reader", "bound_rooms",
           "room_signatures", "nixl_metadata", "metadata_flood", "lease_squat", "starvation", "address_flood",
           "proving_bytes", "restart_race")
ATTACKS += ("split_collision",)  # (full runs only: tests/transfer/test_room_race_mooncake.py races real processes in CI)
# every attack is defended now; quick runs them all with fewer trials
QUICK_ATTACKS = ("aliasing", "preauth_flood", "slow_connection", "slot_exhaustion", "room_collision", "read_exposure",
                 "hello_replay", "postauth_partial", "mac_flood", "spellings", "mooncake_reader", "bound_rooms",
                 "room_signatures", "nixl_metadata", "metadata_flood", "lease_squat", "starvation", "address_flood",
                 "proving_bytes", "restart_race")
DEFENDED, VULNERABLE, ERROR, NOT_APPLICABLE = "defended", "vulnerable", "error", "not_applicable"
# attacks that cannot apply to a cluster on an engine, and why (reported as such, never as defended)
NOT_APPLICABLE_ON: dict[str, dict[str, str]] = {
    "nixl": {
        "spellings": "a NIXL session is nixl:<agent>, not host:port: there are no other spellings of an address to "
                     "try, and its claim is the UCX worker address in the metadata (nixl_metadata attacks that)",
        "mooncake_reader": "the attacker reads through Mooncake's unauthenticated listener; a NIXL cluster runs no "
                           "Mooncake listener (a NIXL-reading attacker is not written)",
    },
}
SLOW_SLACK_S = 2.0  # a deadline is checked every SCAN_S; a loaded 2-core host adds scheduling delay
ATTACK_ROOMS = itertools.count(900_000)  # rooms the attacks open (Traffic's own rooms count from 1,000)


@dataclass(frozen=True)
class HostileSpec:
    attacks: tuple[str, ...] = ATTACKS
    cp: int = 2
    layers: int = 4
    tokens: int = 512  # a room: 8 pages (the measurement)
    pages: int = 256
    room_timeout: float = 30.0
    flood_connections: int = 400
    flood_addresses: int = 32  # loopback source addresses (127.0.0.2 ...)
    flood_huge_every: int = 4  # every n-th flood connection announces an 8 MiB frame and pushes its body
    flood_push_mib: int = 4
    flood_hold_s: float = 3.0  # the flood goes on at least this long (a real room moves meanwhile)
    rss_bound_mib: float = 64.0
    slow_wait_s: float = 20.0  # how long a slow connection is watched before it counts as never closed
    slow_authenticated: bool = True  # also a slow frame after a valid Hello (frame_timeout: 10 s)
    exhaust_connections: int = 4200  # over the 4,096 authenticated-connection cap
    exhaust_addresses: int = 64
    collision_trials: int = 5
    replay_connections: int = 4200  # replays of one captured Hello held open (over the 4,096 slots)
    postauth_connections: int = 400  # authenticated connections pushing partial frames
    postauth_addresses: int = 16  # (25 each: under the 64-per-address cap)
    postauth_slack_mib: float = 16.0  # bookkeeping of the connections, the loop's own allocations
    mac_flood_connections: int = 32
    metadata_registrations: int = 512  # of the largest engine_metadata (the daemon's cap stops them at 256)
    # the daemon's --max-metadata-chars, in Mi characters (its default, 64); quick: 8, the same cap
    # reached after 32 registrations instead of 256 (the flood took 109 s of a loaded CI's 2 cores)
    max_metadata_mi: int = 64
    starve_connections: int = 40  # starvation: one identity's connections pushing the largest frames
    starve_source: str = "127.0.0.2"  # (its one address)
    probe_source: str = "127.0.0.3"  # the second identity, whose frame needs the shared budget
    probe_bytes: int = 1 << 20
    address_flood_extra: int = 100  # address_flood: connections beyond every slot, one address each
    proving_connections: int = 16  # proving_bytes: connections naming a registration they cannot prove
    proving_messages: int = 12  # requests each sends while its proof waits (192 MiB: 6 times the held cap)
    proving_page_bytes: int = 1 << 20  # each request's page list
    race_s: float = 3.0  # restart_race: how long the squats go on after the restarted daemon answers
    engine: str = "mooncake"  # the cluster's transfer engine
    workdir: str | None = None

    @classmethod
    def quick(cls, **kw: Any) -> HostileSpec:
        return cls(**({"attacks": QUICK_ATTACKS, "flood_connections": 200, "slow_wait_s": 8.0,
                       "slow_authenticated": False, "collision_trials": 2, "room_timeout": 20.0,
                       "replay_connections": 1200, "postauth_connections": 200, "mac_flood_connections": 16,
                       "race_s": 1.5, "proving_messages": 8, "max_metadata_mi": 8,
                       "metadata_registrations": 64} | kw))


@dataclass
class Outcome:
    attack: str
    outcome: str = ERROR
    target: str = ""
    bytes_written_where_not_allowed: int = 0
    rss_before_mib: float | None = None
    rss_after_mib: float | None = None
    seconds: float = 0.0
    details: dict[str, Any] | None = None
    error: str | None = None


class Hostile:
    """The attacks, each a method over one running chaos cluster."""

    def __init__(self, cluster: ChaosCluster, spec: HostileSpec) -> None:
        self.c = cluster
        self.spec = spec
        self.traffic = Traffic(cluster, spec.tokens, 0, 1)
        self.auth = {"Authorization": f"Bearer {cluster.token}"}

    # -- what the attacker can see ---------------------------------------------------

    def get(self, path: str, *, token: bool = True) -> httpx.Response:
        return httpx.get(f"{self.c.url}{path}", headers=self.auth if token else {}, timeout=5.0, trust_env=False)

    def ranks_of(self, instance: str) -> list[dict[str, Any]]:
        r = self.get(f"/v1/instances/{instance}")
        r.raise_for_status()
        return r.json()["ranks"]

    def endpoint(self, cp_rank: int) -> str:
        return next(v["control_endpoint"] for v in self.ranks_of(self.c.prefill_instance) if v["cp_rank"] == cp_rank)

    def room_ok(self) -> tuple[bool, float, str]:
        """One real room through every rank: (ok, seconds, first failure)."""
        t0 = time.monotonic()
        room = self.traffic.batch(1, self.spec.room_timeout)[0]
        why = "; ".join(f"{m}: {r}" for m, _, r in room.failures)[:300] or ("" if room.done else "no answer in time")
        return room.ok, round(time.monotonic() - t0, 2), why

    def room_within(self, seconds: float) -> tuple[bool, float, str]:
        """A real room, tried until one succeeds or ``seconds`` pass (a re-registering rank needs a
        moment): ``room_ok``'s answer for the last room tried."""
        deadline = time.monotonic() + seconds
        while True:
            ok, took, why = self.room_ok()
            if ok or time.monotonic() > deadline:
                return ok, took, why
            time.sleep(0.5)

    def next_room(self) -> int:
        return next(ATTACK_ROOMS)

    def submit(self, m: Member, op: ops.Op) -> int:
        return _submit(m, op)

    def wait_reply(self, m: Member, request_id: int, timeout: float) -> Any:
        return _wait_reply(m, request_id, timeout)

    def reason(self, reply: Any) -> str:
        return _reason(reply)

    def spawn_decode(self, name: str) -> Member:
        """Another decode instance with every flag of the cluster's own (an attacker's), started."""
        legit = self.c.decode[0]
        m = Member(name, "decode", _with_flags(legit.argv, {"--instance": name,
                                                            "--lease-file": str(self.c.workdir / f"{name}.lease")}))
        m.proc = self.c.group.spawn(name, m.argv, ready_file=True)
        m.ready = self.c.group.wait_ready(m.proc, 60.0)
        m.client = ops.OpsClient(m.ready["ops"], secret=self.c.secret.encode())
        return m

    def rss(self, m: Member) -> float | None:
        res = proc_resources(m.pid) if m.alive else None  # type: ignore[arg-type]
        return None if res is None else res["rss_mib"]

    # -- 1. aliasing ------------------------------------------------------------------

    def aliasing(self, out: Outcome) -> None:
        victim_m = self.c.decode[0]
        out.target = victim_m.name
        out.rss_before_mib = self.rss(victim_m)
        victim_id = self.ranks_of(self.c.decode_instance)[0]["rank_id"]
        victim = self.get(f"/v1/ranks/{victim_id}").json()  # the attacker holds the write token, which reads
        contract = next(f["contract"] for f in self.get("/v1/diagnostics/fingerprints").json()
                        if f["instance"] == self.c.decode_instance)
        # the strongest alias: the victim's session, pools, aux rows and scratch region
        body = {"rank": {"instance": "hostile-alias", "role": "decode"}, "control_endpoint": "tcp://127.0.0.1:9",
                "session_id": victim["session_id"], "pools": victim["pools"], "aux": victim["aux"],
                "aux_regions": victim["aux_regions"], "contract": contract, "lease_ttl_s": 60.0,
                "scratch": victim.get("scratch")}
        if victim.get("engine_metadata"):  # (NIXL: what the engine reaches, copied whole)
            body["engine_metadata"] = victim["engine_metadata"]
        reg = httpx.post(f"{self.c.url}/v1/ranks", json=body, headers=self.auth, timeout=5.0, trust_env=False)
        details: dict[str, Any] = {"registration_status": reg.status_code, "victim_session": victim["session_id"]}
        out.details = details
        if reg.status_code != 201:
            details["refusal"] = reg.text[:300]
            out.rss_after_mib = self.rss(victim_m)
            out.outcome = DEFENDED
            return
        attacker = reg.json()
        before = int(self.c.stats(victim_m).get("late_writes", 0))
        num_pages = -(-self.spec.tokens // 64)
        capacity = min(p["capacity_pages"] for p in victim["pools"])
        victim_pages = np.arange(capacity - num_pages, capacity, dtype=np.int32)  # free: no room is open now
        room = next(ATTACK_ROOMS)
        pending = [(m, _submit(m, ops.Prefill(room, self.spec.tokens, 0))) for m in self.c.prefill]
        label = "hostile-alias/dp0/tp0"
        # its connections name its own registration (as a decode rank's do), so that the request
        # passes the binding and meets the ownership proof
        peers = PeerSet(secret=self.c.secret.encode(), name=attacker["rank_id"])
        watch = RoomWatch(room, pending)  # what each prefill rank told the attacker
        try:
            pools = sorted({p["pool"] for p in victim["pools"]})
            req = wire.TransferRequest(
                room=room, decode_rank=label, decode_rank_id=attacker["rank_id"],
                page_ids=wire.pack_pages(victim_pages), first_page=0, pools=pools, aux_slot=0, num_tokens=self.spec.tokens, deadline_ms=10_000,
                want_digest=False, fingerprint=victim["fingerprint"], num_decode_ranks=1)
            for cp_rank in range(len(self.c.prefill)):
                peers.send(self.endpoint(cp_rank), req)
            deadline = time.monotonic() + self.spec.room_timeout
            while watch.open() and time.monotonic() < deadline:
                for where, msg in peers.recv_ready(20):
                    if isinstance(msg, wire.Challenge):  # it cannot read the victim's scratch: its best guess
                        peers.send(where, wire.ChallengeEcho(nonce=bytes(wire.NONCE_BYTES)))
                    watch.note(where, msg)
                watch.take_replies()
        finally:
            peers.close()
            httpx.delete(f"{self.c.url}/v1/ranks/{attacker['rank_id']}", timeout=5.0, trust_env=False,
                         headers={**self.auth, "X-KVBridge-Lease": attacker.get("lease_secret", "")})
        reports, refusals, replies = watch.reports, watch.refusals, watch.replies
        prefill_bytes = {name: r.num_bytes if isinstance(r, ops.RoomResult) and r.ok else 0
                         for name, r in replies.items()}
        overwritten = int(self.c.stats(victim_m).get("late_writes", 0)) - before
        page_bytes = sum(p["bytes_per_page"] for p in victim["pools"])  # one page of every pool and layer
        out.bytes_written_where_not_allowed = overwritten * page_bytes
        out.rss_after_mib = self.rss(victim_m)
        details.update(victim_pages_overwritten=overwritten, prefill_reports=reports,
                       prefill_bytes_posted=prefill_bytes, prefill_refusals=sorted(refusals.values()))
        out.outcome = DEFENDED if overwritten == 0 else VULNERABLE

    # -- 2. pre-authentication flood ----------------------------------------------------

    def preauth_flood(self, out: Outcome) -> None:
        s, m = self.spec, self.c.prefill[0]
        out.target = m.name
        port = port_of(self.endpoint(0))
        stalled = HEADER.pack(HELLO_MAX_BYTES) + b"\0" * (HELLO_MAX_BYTES - 1)
        push = s.flood_push_mib << 20
        chunk = b"\0" * (256 << 10)
        socks: list[tuple[socket.socket, bool]] = []  # (socket, pushes a huge frame)
        pushed: dict[socket.socket, int] = {}
        peak = before = self.rss(m) or 0.0
        out.rss_before_mib = before
        try:
            for i in range(s.flood_connections):
                sock = connect(port, i, s.flood_addresses)
                if sock is None:
                    continue
                huge = i % s.flood_huge_every == 0
                try_send(sock, HEADER.pack(8 << 20) if huge else stalled)
                socks.append((sock, huge))
                pushed[sock] = 0
            result: list[tuple[bool, float, str]] = []
            room = threading.Thread(target=lambda: result.append(self.room_ok()), daemon=True)
            room.start()
            hold_until = time.monotonic() + s.flood_hold_s
            while room.is_alive() or time.monotonic() < hold_until:  # keep pushing the announced bodies
                for sock, huge in socks:
                    if huge and pushed[sock] < push:
                        pushed[sock] += try_send(sock, chunk)
                peak = max(peak, self.rss(m) or 0.0)
                time.sleep(0.05)
            n_closed = sum(1 for sock, _ in socks if closed(sock))
        finally:
            for sock, _ in socks:
                sock.close()
        time.sleep(0.5)
        out.rss_after_mib = self.rss(m)
        ok, seconds, why = result[0] if result else (False, 0.0, "room thread failed")
        growth = round(peak - before, 1)
        out.details = {"connections": len(socks), "addresses": s.flood_addresses, "held_s": s.flood_hold_s,
                       "bytes_pushed_mib": round(sum(pushed.values()) / (1 << 20), 1), "rss_peak_mib": peak,
                       "rss_growth_mib": growth, "rss_bound_mib": s.rss_bound_mib,
                       "closed_by_server": n_closed, "room_during_flood_ok": ok, "room_seconds": seconds,
                       "room_failure": why}
        out.outcome = DEFENDED if ok and growth <= s.rss_bound_mib else VULNERABLE

    # -- 3. slow connection ---------------------------------------------------------------

    def slow_connection(self, out: Outcome) -> None:
        s, m = self.spec, self.c.prefill[0]
        out.target = m.name
        out.rss_before_mib = self.rss(m)
        port, limits = port_of(self.endpoint(0)), Limits()
        details: dict[str, Any] = {}
        hello_s = dribble(port, b"", HEADER.pack(HELLO_MAX_BYTES), s.slow_wait_s)
        details["before_hello"] = {"deadline_s": limits.hello_timeout, "closed_after_s": hello_s}
        ok = hello_s is not None and hello_s <= limits.hello_timeout + SLOW_SLACK_S
        if s.slow_authenticated:  # a 1 KiB frame, one byte a second: its deadline grows with its size
            due = limits.frame_deadline(1024)
            frame_s = dribble(port, b"", HEADER.pack(1024), max(s.slow_wait_s, due + 2 * SLOW_SLACK_S),
                               hello_secret=self.c.secret.encode())
            details["after_hello"] = {"deadline_s": round(due, 3), "closed_after_s": frame_s}
            ok = ok and frame_s is not None and frame_s <= due + SLOW_SLACK_S
        out.rss_after_mib = self.rss(m)
        out.details = details
        out.outcome = DEFENDED if ok else VULNERABLE

    # -- 4. slot exhaustion ----------------------------------------------------------------

    def slot_exhaustion(self, out: Outcome) -> None:
        s, m, decode = self.spec, self.c.prefill[0], self.c.decode[0]
        out.target = m.name
        out.rss_before_mib = self.rss(m)
        holder = Holder(port_of(self.endpoint(0)), s.exhaust_connections, s.exhaust_addresses)
        holder.start()
        try:
            holder.wait_filled(15.0)
            self.c.signal(decode, signal.SIGTERM)
            self.c.wait_exit(decode, 20.0)
            self.c.restart(decode)
            ok, seconds, why = self.room_ok()
        finally:
            holder.stop()
        out.rss_after_mib = self.rss(m)
        out.details = {"attacker_open_peak": holder.peak_open, "connects": holder.connects,
                       "closed_by_server": holder.closed_by_server, "connect_failures": holder.failures,
                       "restarted_decode_room_ok": ok, "room_seconds": seconds, "room_failure": why}
        out.outcome = DEFENDED if ok else VULNERABLE

    # -- 5. room collision -----------------------------------------------------------------

    def room_collision(self, out: Outcome) -> None:
        s, legit = self.spec, self.c.decode[0]
        out.target = self.c.prefill_instance
        out.rss_before_mib = self.rss(self.c.prefill[0])
        second = Member("hostile-d2", "decode", _with_flags(legit.argv, {
            "--instance": "hostile-d2", "--lease-file": str(self.c.workdir / "hostile-d2.lease")}))
        second.proc = self.c.group.spawn("hostile-d2", second.argv, ready_file=True)
        second.ready = self.c.group.wait_ready(second.proc, 60.0)
        second.client = ops.OpsClient(second.ready["ops"], secret=self.c.secret.encode())
        label = "hostile-d2/dp0/tp0"  # the decode rank label the second instance uses (DecodeConfig.rank_label)
        second_rank_id = self.ranks_of("hostile-d2")[0]["rank_id"]
        # the aborts name the second instance's registration on a connection of their own, which
        # cannot prove it holds that rank's memory; the second instance's own requests prove it
        peers = PeerSet(secret=self.c.secret.encode(), name=second_rank_id)
        aborts_refused: list[str] = []
        trials, served_twice = [], 0
        try:
            for _ in range(s.collision_trials):
                # both instances' requests reach prefill before its sender opens (as when the router
                # hands decode the room first), so the two claims meet on one open room; every other
                # trial the second instance then aborts the room
                room, abort = next(ATTACK_ROOMS), len(trials) % 2 == 1
                legit_id = _submit(legit, ops.Decode(room, s.tokens, self.c.prefill_instance))
                time.sleep(0.3)  # the legitimate instance claims the room first
                second_id = _submit(second, ops.Decode(room, s.tokens, self.c.prefill_instance))
                time.sleep(0.3)
                if abort:
                    for cp_rank in range(len(self.c.prefill)):
                        peers.send(self.endpoint(cp_rank), wire.Abort(room=room, decode_rank=label, reason="hostile",
                                                                      decode_rank_id=second_rank_id))
                    time.sleep(0.1)
                pending = [(p, _submit(p, ops.Prefill(room, s.tokens, 0))) for p in self.c.prefill]
                legit_r = _wait_reply(legit, legit_id, s.room_timeout)
                second_r = _wait_reply(second, second_id, s.room_timeout)
                for p, request_id in pending:
                    _wait_reply(p, request_id, s.room_timeout)
                aborts_refused += [m.reason[:300] for _, m in peers.recv_ready(0) if isinstance(m, wire.ErrorReply)]
                legit_ok = isinstance(legit_r, ops.RoomResult) and legit_r.ok
                second_ok = isinstance(second_r, ops.RoomResult) and second_r.ok
                verdict = ("legit_failed" if not legit_ok else "served_twice" if second_ok else "defended")
                if second_ok:
                    served_twice += 1
                    out.bytes_written_where_not_allowed += second_r.num_bytes  # type: ignore[union-attr]
                trials.append({"room": room, "abort_sent": abort, "verdict": verdict, "legit": _reason(legit_r),
                               "second": _reason(second_r)})
            # an abort's connection cannot prove its registration: refused at the proof's deadline
            until = time.monotonic() + (5.0 if any(t["abort_sent"] for t in trials) and not aborts_refused else 0.0)
            while not aborts_refused and time.monotonic() < until:
                aborts_refused += [m.reason[:300] for _, m in peers.recv_ready(50) if isinstance(m, wire.ErrorReply)]
        finally:
            peers.close()
            second.client.close()
        out.rss_after_mib = self.rss(self.c.prefill[0])
        out.details = {"trials": trials, "served_twice": served_twice,
                       "legit_failed": sum(t["verdict"] == "legit_failed" for t in trials),
                       "aborts_refused": aborts_refused[:4]}
        out.outcome = DEFENDED if all(t["verdict"] == "defended" for t in trials) else VULNERABLE

    # -- 6. read exposure ------------------------------------------------------------------

    def read_exposure(self, out: Outcome) -> None:
        out.target = "bootstrap"
        out.rss_before_mib = self.rss(self.c.daemon)
        victim_id = self.ranks_of(self.c.decode_instance)[0]["rank_id"]
        exposed: dict[str, Any] = {}
        for path in (f"/v1/ranks/{victim_id}", "/v1/instances"):
            r = self.get(path, token=False)
            text = r.text if r.status_code == 200 else ""
            exposed[path] = {"status": r.status_code, "session_ids": '"session_id"' in text,
                             "buffer_addresses": '"base"' in text}
        out.rss_after_mib = self.rss(self.c.daemon)
        out.details = {"anonymous": exposed}
        leaked = any(v["session_ids"] or v["buffer_addresses"] for v in exposed.values())
        out.outcome = VULNERABLE if leaked else DEFENDED


    # -- 7. Hello replay ------------------------------------------------------------------

    def hello_replay(self, out: Outcome) -> None:
        s, m, decode = self.spec, self.c.prefill[0], self.c.decode[0]
        out.target = m.name
        out.rss_before_mib = peak = self.rss(m)
        port, limits = port_of(self.endpoint(0)), Limits()
        with socket.create_connection(("127.0.0.1", port), timeout=5.0) as real:  # the capture: a real
            captured = hello_for(real, self.c.secret.encode(), "decode-rank-captured")  # Hello off the wire
        replayer = Replayer(port, s.replay_connections, s.exhaust_addresses, captured,
                             limits.hello_timeout + SLOW_SLACK_S)
        replayer.start()
        try:
            replayer.wait_filled(15.0)
            self.c.signal(decode, signal.SIGTERM)
            self.c.wait_exit(decode, 20.0)
            self.c.restart(decode)
            ok, seconds, why = self.room_ok()
            peak = max(peak or 0.0, self.rss(m) or 0.0)
        finally:
            replayer.stop()
        out.rss_after_mib = self.rss(m)
        out.details = {"replays_open_peak": replayer.peak_open, "connects": replayer.connects,
                       "closed_by_server": replayer.closed_by_server, "connect_failures": replayer.failures,
                       "slots_held": replayer.held_peak, "held_means": f"open past the {limits.hello_timeout:g}s "
                       f"hello deadline + {SLOW_SLACK_S:g}s", "rss_peak_mib": peak,
                       "restarted_decode_room_ok": ok, "room_seconds": seconds, "room_failure": why}
        out.outcome = DEFENDED if ok and replayer.held_peak == 0 else VULNERABLE

    # -- 8. partial frames after a valid Hello -----------------------------------------------

    def postauth_partial(self, out: Outcome) -> None:
        s, m, limits = self.spec, self.c.prefill[0], Limits()
        out.target = m.name
        port, secret = port_of(self.endpoint(0)), self.c.secret.encode()
        socks: list[socket.socket] = []
        pushed: dict[socket.socket, int] = {}
        peak = before = self.rss(m) or 0.0
        out.rss_before_mib = before
        chunk = b"\0" * (256 << 10)
        announce = HEADER.pack(wire.auth_limit(wire.MAX_MESSAGE_BYTES))  # the largest frame it takes
        try:
            for i in range(s.postauth_connections):
                sock = authenticated(port, i, s.postauth_addresses, secret, f"hostile-partial-{i}")
                if sock is not None and try_send(sock, announce):
                    socks.append(sock)
                    pushed[sock] = 0
            result: list[tuple[bool, float, str]] = []
            room = threading.Thread(target=lambda: result.append(self.room_ok()), daemon=True)
            room.start()
            hold_until = time.monotonic() + s.flood_hold_s
            while room.is_alive() or time.monotonic() < hold_until:
                for sock in socks:
                    pushed[sock] += try_send(sock, chunk)
                peak = max(peak, self.rss(m) or 0.0)
                time.sleep(0.02)
            n_closed = sum(1 for sock in socks if closed(sock))
        finally:
            for sock in socks:
                sock.close()
        time.sleep(0.5)
        out.rss_after_mib = self.rss(m)
        ok, seconds, why = result[0] if result else (False, 0.0, "room thread failed")
        growth = round(peak - before, 1)
        # the readers' bound, and as much again twice while a loop turn holds the frames it took
        # out and their decoded messages (docs/security.md)
        readers = (len(socks) * limits.frame_allowance + limits.frame_budget) / (1 << 20)
        bound = round(3 * readers + s.postauth_slack_mib, 1)
        out.details = {"connections": len(socks), "addresses": s.postauth_addresses,
                       "announced_bytes": wire.auth_limit(wire.MAX_MESSAGE_BYTES),
                       "bytes_pushed_mib": round(sum(pushed.values()) / (1 << 20), 1), "rss_peak_mib": peak,
                       "rss_growth_mib": growth, "rss_bound_mib": bound, "closed_by_server": n_closed,
                       "room_during_flood_ok": ok, "room_seconds": seconds, "room_failure": why}
        out.outcome = DEFENDED if ok and growth <= bound else VULNERABLE

    # -- 9. frames failing their MAC after a valid Hello ------------------------------------------

    def mac_flood(self, out: Outcome) -> None:
        s, m, limits = self.spec, self.c.prefill[0], Limits()
        out.target = m.name
        port, secret = port_of(self.endpoint(0)), self.c.secret.encode()
        out.rss_before_mib = peak = self.rss(m) or 0.0
        bad = frame(wire.codec(b"not-the-cluster-secret").encode(wire.Ping(decode_rank="hostile", seq=0)))
        burst = bad * 2000
        cpu0 = _cpu_seconds(m.pid)  # type: ignore[arg-type]
        live: list[socket.socket] = []
        opened = n_closed = frames = 0
        result: list[tuple[bool, float, str]] = []
        room = threading.Thread(target=lambda: result.append(self.room_ok()), daemon=True)
        t0 = time.monotonic()
        try:
            room.start()
            while room.is_alive() or time.monotonic() < t0 + s.flood_hold_s:
                while len(live) < s.mac_flood_connections:
                    sock = authenticated(port, opened, s.flood_addresses, secret, f"hostile-mac-{opened}")
                    opened += 1
                    if sock is None:
                        break
                    live.append(sock)
                for sock in list(live):
                    sent = try_send(sock, burst)
                    frames += sent // len(bad)
                    if closed(sock):
                        n_closed += 1
                        live.remove(sock)
                        sock.close()
                peak = max(peak, self.rss(m) or 0.0)
                time.sleep(0.01)
            until = time.monotonic() + 2 * SLOW_SLACK_S  # the last ones' frames are still being read
            while live and time.monotonic() < until:
                for sock in list(live):
                    if closed(sock):
                        n_closed += 1
                        live.remove(sock)
                        sock.close()
                time.sleep(0.05)
        finally:
            for sock in live:
                sock.close()
        seconds_flooded = time.monotonic() - t0
        cpu = (_cpu_seconds(m.pid) or 0.0) - (cpu0 or 0.0)  # type: ignore[arg-type]
        out.rss_after_mib = self.rss(m)
        ok, seconds, why = result[0] if result else (False, 0.0, "room thread failed")
        out.details = {"connections_opened": opened, "closed_by_server": n_closed, "left_open": len(live),
                       "max_bad_macs": limits.max_bad_macs, "bad_frames_pushed": frames,
                       "target_cpu_s": round(cpu, 2), "flood_s": round(seconds_flooded, 1), "rss_peak_mib": peak,
                       "room_during_flood_ok": ok, "room_seconds": seconds, "room_failure": why}
        out.outcome = DEFENDED if ok and not live else VULNERABLE


# One table from attack name to its method (the order of ATTACKS is the order they run in).
ATTACK_METHODS: dict[str, Callable[[Hostile, Outcome], None]] = {
    "aliasing": Hostile.aliasing, "preauth_flood": Hostile.preauth_flood, "slow_connection": Hostile.slow_connection,
    "slot_exhaustion": Hostile.slot_exhaustion, "room_collision": Hostile.room_collision,
    "read_exposure": Hostile.read_exposure,
    "hello_replay": Hostile.hello_replay, "postauth_partial": Hostile.postauth_partial,
    "mac_flood": Hostile.mac_flood,
    "spellings": hostile_identity.spelling_aliases, "mooncake_reader": hostile_identity.mooncake_reader,
    "bound_rooms": hostile_rooms.bound_rooms, "room_signatures": hostile_rooms.room_signatures,
    "nixl_metadata": hostile_claims.nixl_metadata, "metadata_flood": hostile_claims.metadata_flood,
    "lease_squat": hostile_claims.lease_squat,
    "starvation": hostile_budgets.starvation, "address_flood": hostile_budgets.address_flood,
    "proving_bytes": hostile_budgets.proving_bytes, "restart_race": hostile_budgets.restart_race,
    "split_collision": hostile_split.split_collision,
}


# ---- the run ----------------------------------------------------------------------------------
def run_hostile(spec: HostileSpec, progress: Callable[[Outcome], None] | None = None) -> dict[str, Any]:
    unknown = [a for a in spec.attacks if a not in ATTACKS]
    if unknown:
        raise ConfigError(f"unknown attack(s) {unknown}; attacks are {list(ATTACKS)}", field="attacks")
    t0 = time.monotonic()
    tmp = None if spec.workdir else tempfile.TemporaryDirectory(prefix="kvbridge-hostile-")
    workdir = Path(spec.workdir or tmp.name)  # type: ignore[union-attr]
    cluster = ChaosCluster(workdir, cp=spec.cp, layers=spec.layers, pages=spec.pages, lease_ttl=2.0,
                           peer_timeout=3.0, transfer_timeout=10.0, failed_writes=0, engine=spec.engine,
                           claims_file=True, daemon_args=("--max-metadata-chars", str(spec.max_metadata_mi << 20)))
    results: list[Outcome] = []
    problems: list[str] = []
    try:
        cluster.start()
        hostile = Hostile(cluster, spec)
        warm_ok, _, why = hostile.room_ok()
        if not warm_ok:
            problems.append(f"a room failed before any attack: {why}")
        for name in (a for a in ATTACKS if a in spec.attacks):
            out = Outcome(name)
            a0 = time.monotonic()
            why_not = NOT_APPLICABLE_ON.get(spec.engine, {}).get(name)
            if why_not is not None:
                out.outcome, out.target, out.details = NOT_APPLICABLE, "-", {"engine": spec.engine, "reason": why_not}
                results.append(out)
                if progress is not None:
                    progress(out)
                continue
            try:
                ATTACK_METHODS[name](hostile, out)
            except Exception as exc:  # the harness failed: recorded as this attack's error, and the run goes on
                out.outcome, out.error = ERROR, f"{type(exc).__name__}: {exc}"[:500]
            out.seconds = round(time.monotonic() - a0, 1)
            results.append(out)
            if progress is not None:
                progress(out)
    finally:
        exit_codes = cluster.close()
        if tmp is not None:
            tmp.cleanup()
    problems += [f"{o.attack}: {o.outcome}" for o in results if o.outcome not in (DEFENDED, NOT_APPLICABLE)]
    return {
        "ok": not problems,
        "engine": spec.engine,
        "attacks": [asdict(o) for o in results],
        "defended": [o.attack for o in results if o.outcome == DEFENDED],
        "not_applicable": [o.attack for o in results if o.outcome == NOT_APPLICABLE],
        "vulnerable": [o.attack for o in results if o.outcome == VULNERABLE],
        "errors": [o.attack for o in results if o.outcome == ERROR],
        "problems": problems,
        "exit_codes": exit_codes,
        "seconds": round(time.monotonic() - t0, 1),
        "spec": asdict(spec),
    }


def format_hostile(report: dict[str, Any]) -> str:
    rows = [("attack", "outcome", "target", "bytes written", "RSS before", "RSS after", "s")]
    for a in report["attacks"]:
        rows.append((a["attack"], a["outcome"] if a["outcome"] in (DEFENDED, NOT_APPLICABLE) else a["outcome"].upper(),
                     a["target"],
                     f"{a['bytes_written_where_not_allowed']:,}", str(a["rss_before_mib"]), str(a["rss_after_mib"]),
                     str(a["seconds"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    skipped = report.get("not_applicable", [])
    lines += ["", f"{len(report['defended'])}/{len(report['attacks']) - len(skipped)} attacks defended"
              + (f" ({len(skipped)} not applicable on {report.get('engine')})" if skipped else "")
              + f", {report['seconds']}s"]
    lines += [f"  n/a {a['attack']}: {a['details']['reason']}" for a in report["attacks"]
              if a["outcome"] == NOT_APPLICABLE]
    lines += [f"  - {p}" for p in report["problems"]]
    lines += [f"  {a['attack']}: {a['error']}" for a in report["attacks"] if a["error"]]
    return "\n".join(lines)


def _cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of a live process (Linux /proc), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- small helpers ----------------------------------------------------------------------------
def _submit(m: Member, op: ops.Op) -> int:
    if m.client is None:
        raise ConfigError(f"{m.name} has no ops client: it was never started", field="member")
    return m.client.submit(op)


def _wait_reply(m: Member, request_id: int, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and m.client is not None:
        m.client.poll(0.05)
        reply = m.client.take(request_id)
        if reply is not None:
            return reply
    return None


def _reason(reply: Any) -> str:
    if isinstance(reply, ops.RoomResult):
        return "ok" if reply.ok else f"failed: {reply.reason[:200]}"
    return "no answer" if reply is None else type(reply).__name__


def _with_flags(argv: list[str], flags: dict[str, str]) -> list[str]:
    out = list(argv)
    for flag, value in flags.items():
        out[out.index(flag) + 1] = value
    return out
