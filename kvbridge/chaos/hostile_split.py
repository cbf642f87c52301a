"""A split collision (issue 32) for ``kvbridge chaos --hostile``: two decode instances race for
one room id against the chaos cluster's CP 2 prefill instance.

    split_collision   the legitimate decode instance and a second one (the attacker, every flag
                      of the legitimate one) ask for the same room at the same moment, then the
                      prefill ranks send it; ``collision_trials`` trials. Each trial is:
        served_one    one instance's room succeeded, the other was refused naming the holder
        split         neither succeeded (each won a different CP rank: the old per-rank first claim)
        served_twice  both succeeded (the KV went to two instances)
                      defended: every trial served_one, and 0 bytes to the loser (its received
                      bytes when its room reported success, plus pages its poison sweep found
                      written after release, on both decode instances)

The room's decider (cp 0) decides once and the other CP ranks follow its signed RoomTicket
(``transfer/prefill/tickets.py``); before that, 2 of 5 trials split.
"""

from __future__ import annotations

from typing import Any

from kvbridge.worker import ops

__all__ = ["split_collision"]

# ``h`` is ``hostile.Hostile`` and ``out`` its ``Outcome``, named by duck type (as hostile_rooms.py)
Hostile = Outcome = Any
DEFENDED, VULNERABLE = "defended", "vulnerable"


def split_collision(h: Hostile, out: Outcome) -> None:
    s, legit = h.spec, h.c.decode[0]
    out.target = h.c.prefill_instance
    out.rss_before_mib = h.rss(h.c.prefill[0])
    attacker = h.spawn_decode("hostile-split")
    members = {"legit": legit, "attacker": attacker}
    late_before = {name: int(h.c.stats(m).get("late_writes", 0)) for name, m in members.items()}
    late: dict[str, int] = {}
    trials: list[dict[str, Any]] = []
    try:
        for _ in range(s.collision_trials):
            room = h.next_room()
            # both claims leave at once: each decode instance looks the room up and asks every CP rank
            asked = {name: h.submit(m, ops.Decode(room, s.tokens, h.c.prefill_instance)) for name, m in members.items()}
            pending = [(p, h.submit(p, ops.Prefill(room, s.tokens, 0))) for p in h.c.prefill]
            got = {name: h.wait_reply(members[name], rid, s.room_timeout) for name, rid in asked.items()}
            for p, rid in pending:
                h.wait_reply(p, rid, s.room_timeout)
            ok = [name for name, r in got.items() if isinstance(r, ops.RoomResult) and r.ok]
            verdict = "served_one" if len(ok) == 1 else "split" if not ok else "served_twice"
            loser = next((n for n in members if n not in ok), None) if len(ok) == 1 else None
            to_loser = 0
            if verdict == "served_twice":  # the second instance to claim got KV it does not hold
                to_loser = min(r.num_bytes for r in got.values())  # type: ignore[union-attr]
            trials.append({"room": room, "verdict": verdict, "winner": ok[0] if len(ok) == 1 else None,
                           "loser_refusal": h.reason(got[loser]) if loser else "",
                           "legit": h.reason(got["legit"]), "attacker": h.reason(got["attacker"]),
                           "bytes_to_loser": to_loser})
        late = {name: int(h.c.stats(m).get("late_writes", 0)) - late_before[name] for name, m in members.items()}
    finally:
        attacker.client.close()
    late_pages = sum(late.values())
    page_bytes = 0
    if late_pages:  # one page of every pool and layer, as the decode instances registered them
        rank_id = h.ranks_of(h.c.decode_instance)[0]["rank_id"]
        page_bytes = sum(p["bytes_per_page"] for p in h.get(f"/v1/ranks/{rank_id}").json()["pools"])
    bytes_to_loser = sum(t["bytes_to_loser"] for t in trials) + late_pages * page_bytes
    out.bytes_written_where_not_allowed = bytes_to_loser
    out.rss_after_mib = h.rss(h.c.prefill[0])
    named = all("claimed by decode instance" in t["loser_refusal"] for t in trials if t["verdict"] == "served_one")
    counts = {v: sum(t["verdict"] == v for t in trials) for v in ("served_one", "split", "served_twice")}
    out.details = {"trials": trials, **counts, "late_writes": late, "bytes_to_loser": bytes_to_loser,
                   "loser_refused_by_name": named}
    out.outcome = (DEFENDED if counts["served_one"] == len(trials) and named and not bytes_to_loser and not late_pages
                   else VULNERABLE)
