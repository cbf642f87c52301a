"""Attacks on room ids (issue 31) for ``kvbridge chaos --hostile``: rooms are bound to their
request (``kvbridge.room_binding``), and a router's room ids are signed (``kvbridge.sign_room``).

    bound_rooms       a second decode instance (the attacker, every flag of the legitimate one)
                      against the chaos cluster's prefill instance, one trial per case:
        foreign       the attacker claims the legitimate request's room with its own prompt's
                      digest (same length); then the owner claims it
        preclaimed    the attacker claims a room id before the owner's prefill opens it
        reused        the attacker claims a room the owner already received
        longer        the attacker claims with a prompt one token longer (same last page)
                      defended: the attacker's room never succeeds (0 bytes to it) and, for
                      foreign, the owner's does afterwards
    room_signatures   a router's signed room ids checked as a server checks them: a forged
                      signature (another key), an expired one, one moved to another room or
                      expiry, one bound to another prompt; defended: every one refused by
                      name and the genuine one accepted (no engine: pure checks)
"""

from __future__ import annotations

import time
from typing import Any

from kvbridge.errors import RoomBindingError
from kvbridge.transfer.binding import room_binding, sign_room, verify_room
from kvbridge.worker import ops

__all__ = ["bound_rooms", "room_signatures"]

# ``h`` below is ``hostile.Hostile`` and ``out`` its ``Outcome``; named by duck type, so that this
# module and hostile.py do not import each other (as hostile_identity.py)
Hostile = Outcome = Any
DEFENDED, VULNERABLE = "defended", "vulnerable"


def _prompt(n: int, salt: int) -> list[int]:
    return [(i * 37 + salt * 101) % 50_000 for i in range(n)]


def bound_rooms(h: Hostile, out: Outcome) -> None:
    s, legit = h.spec, h.c.decode[0]
    n, timeout = s.tokens, min(s.room_timeout, 15.0)
    out.target = h.c.prefill_instance
    out.rss_before_mib = h.rss(h.c.prefill[0])
    attacker = h.spawn_decode("hostile-d3")
    trials = []

    def prefill(room: int, binding: bytes) -> list[tuple[Any, int]]:
        return [(p, h.submit(p, ops.Prefill(room, n, 0, binding=binding))) for p in h.c.prefill]

    def settle(pending: list[tuple[Any, int]]) -> None:
        for p, request_id in pending:
            h.wait_reply(p, request_id, timeout)

    def decode(m: Any, room: int, tokens: int, binding: bytes) -> Any:
        return h.wait_reply(m, h.submit(m, ops.Decode(room, tokens, h.c.prefill_instance, binding=binding)), timeout)

    try:
        for case, salt in (("foreign", 1), ("preclaimed", 2), ("reused", 3), ("longer", 4)):
            room, own = h.next_room(), room_binding(_prompt(n, salt))
            other = room_binding(_prompt(n + 1, salt), n + 1) if case == "longer" else room_binding(_prompt(n, salt + 50))
            owner_r = None
            if case == "preclaimed":  # the attacker's claim reaches prefill before the room opens
                attack_id = h.submit(attacker, ops.Decode(room, n, h.c.prefill_instance, binding=other))
                time.sleep(0.5)
                pending = prefill(room, own)
                attack_r = h.wait_reply(attacker, attack_id, timeout)
                settle(pending)
            elif case == "reused":
                pending = prefill(room, own)
                owner_r = decode(legit, room, n, own)
                settle(pending)
                attack_r = decode(attacker, room, n, own)
            else:  # foreign, longer: the attacker first, the owner after
                pending = prefill(room, own)
                attack_r = decode(attacker, room, n + 1 if case == "longer" else n, other)
                if case == "foreign":
                    owner_r = decode(legit, room, n, own)
                settle(pending)
            attacked = isinstance(attack_r, ops.RoomResult) and attack_r.ok
            owner_ok = isinstance(owner_r, ops.RoomResult) and owner_r.ok
            if attacked:
                out.bytes_written_where_not_allowed += attack_r.num_bytes  # type: ignore[union-attr]
            verdict = "served_attacker" if attacked else "owner_failed" if case in ("foreign", "reused") and not \
                owner_ok else "defended"
            trials.append({"case": case, "room": room, "verdict": verdict, "attacker": h.reason(attack_r),
                           "owner": h.reason(owner_r) if owner_r is not None else ""})
    finally:
        attacker.client.close()
    out.rss_after_mib = h.rss(h.c.prefill[0])
    out.details = {"trials": trials}
    out.outcome = DEFENDED if all(t["verdict"] == "defended" for t in trials) else VULNERABLE


def room_signatures(h: Hostile, out: Outcome) -> None:
    out.target = "verify_room"
    out.rss_before_mib = out.rss_after_mib = h.rss(h.c.prefill[0])  # pure checks: no process is touched
    key, room, now = h.c.secret.encode(), h.next_room(), time.time()
    expires, bound = int(now) + 60, room_binding(_prompt(16, 1))
    genuine = sign_room(key, room, expires, bound)
    attempts = {
        "forged": (room, expires, sign_room(b"attacker's key", room, expires, bound), bound),
        "expired": (room, int(now) - 1, sign_room(key, room, int(now) - 1, bound), bound),
        "other_room": (room + 1, expires, genuine, bound),
        "moved_expiry": (room, expires + 3600, genuine, bound),
        "other_prompt": (room, expires, genuine, room_binding(_prompt(16, 2))),
    }
    refused: dict[str, str] = {}
    for name, (r, e, sig, b) in attempts.items():
        try:
            verify_room(key, r, e, sig, now=now, binding=b)
        except RoomBindingError as exc:
            refused[name] = exc.field or ""
    verify_room(key, room, expires, genuine, now=now, binding=bound)  # raises if the genuine one is refused
    out.details = {"refused": refused, "accepted": ["genuine"]}
    out.outcome = DEFENDED if set(refused) == set(attempts) else VULNERABLE
