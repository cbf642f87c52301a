"""The identity attacks of ``kvbridge chaos --hostile`` (issue 26), against the same cluster:

    spellings        a token + secret holder registers a decode rank whose session is another
                     spelling of the live victim's (``kvbridge.chaos.spellings``: every one
                     generated) with the victim's pools, aux and scratch, and its own proof key;
                     any registration the daemon accepts is then driven like ``mooncake_reader``
                     below, its own key signing; defended: 0 bytes land in memory the attacker does
                     not own, and a real room still succeeds
    mooncake_reader  the attacker also reads and writes any Mooncake-registered memory (Mooncake
                     has no authentication; ``Snoop``): it names the *victim's* registration in its
                     Hello, asks both prefill ranks for a room into the victim's free pages, reads
                     every nonce prefill writes out of the victim's scratch region and echoes it, and
                     answers the key challenge with the best signature it can make (its own key);
                     defended: 0 bytes land in the victim (pages and scratch region), and a real
                     room still succeeds

``bytes_written_where_not_allowed``: the victim's pages overwritten (its poison sweep) x bytes
of one page over every pool and layer, plus the bytes of the victim's scratch region that
changed while the attack ran (a nonce prefill wrote for the attacker).
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import numpy as np

from kvbridge.chaos.hostile_sockets import RoomWatch
from kvbridge.chaos.spellings import spellings
from kvbridge.errors import EngineError
from kvbridge.transfer.channel import PeerSet, wire
from kvbridge.transfer.ownership import ProofKey
from kvbridge.worker import ops

__all__ = ["Snoop", "contract_of", "mooncake_reader", "spelling_aliases", "victim_of"]

# ``h`` below is ``hostile.Hostile`` (the cluster, the spec and its helpers) and ``out`` its
# ``Outcome``; named by duck type, so that this module and hostile.py do not import each other
Hostile = Outcome = Any
DEFENDED, VULNERABLE = "defended", "vulnerable"
HOST = "127.0.0.1"
READ_MAX = 1 << 16


class Snoop:
    """What anyone who reaches a Mooncake port can do: read (and write) any registered memory of
    any session, with a Mooncake engine of its own. ``read(session, address, n)``."""

    def __init__(self) -> None:
        from mooncake.engine import TransferEngine  # the attacker's own engine, not kvbridge's adapter

        self._mc = TransferEngine()
        if self._mc.initialize(HOST, "P2PHANDSHAKE", "tcp", "") != 0:
            raise EngineError("the attacker's Mooncake engine did not start")
        self._buf = np.zeros(READ_MAX, dtype=np.uint8)
        self._ptr = int(self._buf.ctypes.data)
        if self._mc.register_memory(self._ptr, READ_MAX) != 0:
            raise EngineError("the attacker's Mooncake engine did not register its buffer")
        self.reads = 0

    def read(self, session: str, address: int, n: int) -> bytes:
        if n > READ_MAX:
            raise EngineError(f"read of {n} bytes over the snoop's {READ_MAX}-byte buffer")
        rc = self._mc.transfer_sync_read(session, self._ptr, address, n)
        if rc < 0:
            raise EngineError(f"Mooncake read of {n} bytes at {address:#x} of {session} returned {rc}")
        self.reads += 1
        return self._buf[:n].tobytes()

    def close(self) -> None:
        self._mc.unregister_memory(self._ptr)


def victim_of(h: Hostile) -> tuple[Any, dict[str, Any], str]:
    victim_m = h.c.decode[0]
    victim_id = h.ranks_of(h.c.decode_instance)[0]["rank_id"]
    return victim_m, h.get(f"/v1/ranks/{victim_id}").json(), victim_id


def contract_of(h: Hostile) -> dict[str, Any]:
    return next(f["contract"] for f in h.get("/v1/diagnostics/fingerprints").json()
                if f["instance"] == h.c.decode_instance)


def act_for(h: Hostile, victim: dict[str, Any], rank_id: str, label: str, key: ProofKey,
            snoop: Snoop) -> dict[str, Any]:
    """Ask both prefill ranks for a room into the victim's free pages on connections whose Hello
    names ``rank_id``; sign every key challenge with ``key``; answer every nonce challenge with
    the real nonce, read out of the victim's scratch region through Mooncake. What prefill said,
    and what it wrote into the victim."""
    scratch = victim["scratch"]
    session = victim["session_id"]
    snapshot = snoop.read(session, scratch["base"], scratch["nbytes"])
    before = int(h.c.stats(h.c.decode[0]).get("late_writes", 0))
    num_pages = -(-h.spec.tokens // 64)
    capacity = min(p["capacity_pages"] for p in victim["pools"])
    pages = np.arange(capacity - num_pages, capacity, dtype=np.int32)  # free: no room is open now
    room = h.next_room()
    pending = [(m, h.submit(m, ops.Prefill(room, h.spec.tokens, 0))) for m in h.c.prefill]
    peers = PeerSet(secret=h.c.secret.encode(), name=rank_id)
    watch = RoomWatch(room, pending)
    echoed = signed = 0
    try:
        req = wire.TransferRequest(
            room=room, decode_rank=label, decode_rank_id=rank_id, page_ids=wire.pack_pages(pages), first_page=0,
            pools=sorted({p["pool"] for p in victim["pools"]}), aux_slot=0, num_tokens=h.spec.tokens,
            deadline_ms=10_000, want_digest=False, fingerprint=victim["fingerprint"], num_decode_ranks=1)
        for cp_rank in range(len(h.c.prefill)):
            peers.send(h.endpoint(cp_rank), req)
        deadline = time.monotonic() + h.spec.room_timeout
        while watch.open() and time.monotonic() < deadline:
            for where, msg in peers.recv_ready(20):
                if isinstance(msg, wire.KeyChallenge):  # its best: a signature by a key it holds
                    peers.send(where, wire.KeyProof(signature=key.sign(rank_id, where, msg.nonce)))
                    signed += 1
                elif isinstance(msg, wire.Challenge) and msg.nonce:  # proof by read: it cannot sign as the victim
                    peers.send(where, wire.ChallengeEcho(nonce=bytes(wire.NONCE_BYTES)))
                    echoed += 1
                elif isinstance(msg, wire.Challenge):  # the nonce, read where prefill wrote it
                    nonce = snoop.read(session, scratch["base"] + msg.offset, wire.NONCE_BYTES)
                    peers.send(where, wire.ChallengeEcho(nonce=nonce))
                    echoed += 1
                else:
                    watch.note(where, msg)
            watch.take_replies()
    finally:
        peers.close()
    refusals, reports, replies = watch.refusals, watch.reports, watch.replies
    after = snoop.read(session, scratch["base"], scratch["nbytes"])
    # the legitimate decode rank asks for the room the attacker tried to take: it is served to it
    # (a refused request claims nothing), and every prefill rank's room ends before shutdown
    legit = h.c.decode[0]
    pending.append((legit, h.submit(legit, ops.Decode(room, h.spec.tokens, h.c.prefill_instance))))
    deadline = time.monotonic() + h.spec.room_timeout
    while len(replies) < len(pending) and time.monotonic() < deadline:
        for m, request_id in pending:
            m.client.poll(0.01)  # type: ignore[union-attr]
            reply = m.client.take(request_id)  # type: ignore[union-attr]
            if reply is not None:
                replies[m.name] = reply
    legit_reply = replies.get(legit.name)
    served_legit = isinstance(legit_reply, ops.RoomResult) and legit_reply.ok
    changed = int(np.count_nonzero(np.frombuffer(snapshot, np.uint8) != np.frombuffer(after, np.uint8)))
    overwritten = int(h.c.stats(h.c.decode[0]).get("late_writes", 0)) - before
    page_bytes = sum(p["bytes_per_page"] for p in victim["pools"])
    return {"pages_overwritten": overwritten, "scratch_bytes_changed": changed,
            "bytes": overwritten * page_bytes + changed, "key_proofs_sent": signed, "nonces_echoed": echoed,
            "prefill_refusals": sorted(refusals.values()), "prefill_reports": reports,
            "room_served_to_the_legitimate_rank": served_legit,
            "legitimate_rank_result": _reason(legit_reply),
            "prefill_results": {n: _reason(r) for n, r in replies.items() if n != legit.name}}


def _reason(reply: Any) -> str:
    if isinstance(reply, ops.RoomResult):
        return "ok" if reply.ok else f"failed: {reply.reason[:200]}"
    return "no answer" if reply is None else type(reply).__name__


def spelling_aliases(h: Hostile, out: Outcome) -> None:
    victim_m, victim, _ = victim_of(h)
    out.target = victim_m.name
    out.rss_before_mib = h.rss(victim_m)
    contract = contract_of(h)
    host, port = victim["session_id"].rsplit(":", 1)
    tried = spellings(host, int(port))
    statuses: dict[str, int] = {}
    accepted: list[str] = []
    attacks: list[dict[str, Any]] = []
    snoop = Snoop()
    try:
        for i, session in enumerate(tried):
            key = ProofKey()
            body = {"rank": {"instance": f"hostile-spelling-{i}", "role": "decode"},
                    "control_endpoint": "tcp://127.0.0.1:9", "session_id": session, "pools": victim["pools"],
                    "aux": victim["aux"], "aux_regions": victim["aux_regions"], "contract": contract,
                    "lease_ttl_s": 60.0, "scratch": victim["scratch"], "proof_key": key.public_hex}
            reg = httpx.post(f"{h.c.url}/v1/ranks", json=body, headers=h.auth, timeout=5.0, trust_env=False)
            statuses[session] = reg.status_code
            if reg.status_code != 201:
                continue
            accepted.append(session)
            alias = reg.json()
            try:
                attacks.append({"session": session, **act_for(h, victim, alias["rank_id"],
                                                              f"hostile-spelling-{i}/dp0/tp0", key, snoop)})
            finally:
                httpx.delete(f"{h.c.url}/v1/ranks/{alias['rank_id']}", timeout=5.0, trust_env=False,
                             headers={**h.auth, "X-KVBridge-Lease": alias.get("lease_secret", "")})
    finally:
        snoop.close()
    written = sum(a["bytes"] for a in attacks)
    ok, seconds, why = h.room_ok()  # the legitimate rank, after every alias
    out.bytes_written_where_not_allowed = written
    out.rss_after_mib = h.rss(victim_m)
    by_status: dict[str, int] = {}
    for s in statuses.values():
        by_status[str(s)] = by_status.get(str(s), 0) + 1
    out.details = {"victim_session": victim["session_id"], "spellings_tried": len(tried), "by_status": by_status,
                   "accepted": accepted, "attacks_on_accepted": attacks, "legit_room_ok": ok,
                   "legit_room_seconds": seconds, "legit_room_failure": why}
    out.outcome = DEFENDED if written == 0 and not accepted and ok else VULNERABLE


def mooncake_reader(h: Hostile, out: Outcome) -> None:
    victim_m, victim, victim_id = victim_of(h)
    out.target = victim_m.name
    out.rss_before_mib = h.rss(victim_m)
    snoop = Snoop()
    try:
        # the victim's own label and registration, in the attacker's Hello: what the victim would send
        label = f"{h.c.decode_instance}/dp0/tp0"
        result = act_for(h, victim, victim_id, label, ProofKey(), snoop)
        reads = snoop.reads
    finally:
        snoop.close()
    ok, seconds, why = h.room_ok()
    out.bytes_written_where_not_allowed = result["bytes"]
    out.rss_after_mib = h.rss(victim_m)
    out.details = {**result, "mooncake_reads": reads, "legit_room_ok": ok, "legit_room_seconds": seconds,
                   "legit_room_failure": why}
    got_in = ok and result["room_served_to_the_legitimate_rank"]
    out.outcome = DEFENDED if result["bytes"] == 0 and got_in else VULNERABLE
