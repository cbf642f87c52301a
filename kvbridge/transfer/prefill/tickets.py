"""Room ownership decided once per room across a prefill instance's ranks: the decider's ticket.

Each prefill rank used to let the first claim it saw win a room (``PrefillRoom.claim``). Two
decode instances racing for one room id could then each win a different CP (or TP) rank, and
neither was served. Now one rank decides, and the others follow its decision:

- **The decider** of a room is the prefill rank (cp 0, tp 0, pp 0) of the room's DP group, one
  for the group whatever the TP layout. It keeps the first-claim rule: the first decode instance
  whose claim it accepts holds the room. To every rank of that instance that asks it, it hands a
  ``RoomTicket``: (decider, room, instance, winning decode rank, the claim's binding), signed
  with its proof key (``ownership.ticket_message``), whose public half is in its registration at
  the daemon. The ticket leaves before the decider plans its own write (the machine posts that
  room at the loop turn's Tick): the other ranks' wait for it runs beside that plan.
- **Every other rank** (cp, tp or pp > 0) *holds* a claim on a room it has no decision for:
  nothing planned, nothing written, no reply. The decode rank that holds a ticket hands it on,
  unchanged, to the other ranks it asked, and the instance's decode TP rank 0 to every rank of
  the TP columns its siblings draw from (decode/machine.py ``_hand_on``). A rank accepts a ticket
  only
  - on a connection proven for a registration of the instance the ticket names (admission.py), and
  - for a room it holds a claim of that instance for (a ticket nobody waits for costs no check:
    one for a room undecided here is *kept*, one per (room, instance), unchecked, until a claim
    of its instance comes, since rank 0's ticket may overtake a sibling's request; it is dropped
    after ``target_timeout`` and counts with the held claims against ``max_held``);
  - signed by the key of the registration the ticket names as decider, which it reads from the
    daemon once and accepts only at (its own instance, its DP group, cp 0, tp 0, pp 0).
  The room is then held by the ticket's instance: its held claims go on as any claim does, every
  other instance's are refused by name ("claimed by decode instance ... (decided by ...)").

    decode A ──TransferRequest──▶ decider (cp0/tp0/pp0)  first claim: A; RoomTicket(A, signed) ──▶ A
    decode A ──TransferRequest──▶ cp1 (or tp1): held (undecided)
    decode A ──RoomTicket(A)────▶ cp1: signature by the decider's key? ─▶ room held by A; A's claims go on
    decode B ──TransferRequest──▶ decider: refused at once; cp1: held, then refused once decided for A

An Abort from an instance on a room not decided here withdraws that instance's held claims and is
acknowledged; it does not end the room (it may be the loser's). A held claim that no decision
reaches within ``target_timeout`` is refused, naming the decider. A machine built without a proof
key (sans-I/O tests of other rules) decides per rank, as before; every ``PrefillEndpoint`` has one.

Plain state and plain data: no socket, clock or engine. The room machine (``machine.py``) feeds
it, sends what it returns, and reads the decider's registration off the loop (``ReadDecider`` ->
``DeciderRead``). docs/concepts.md "Room ownership" states the rule, docs/security.md the argument.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from kvbridge.transfer.channel import wire
from kvbridge.transfer.ownership import ProofKey, verify_ticket
from kvbridge.transfer.prefill.config import PrefillConfig

__all__ = ["MAX_HELD", "DeciderRead", "Held", "ReadDecider", "RegisteredAs", "Tickets"]

MAX_HELD = 10_000  # claims held for a decision, on all rooms together (a flood of undecided claims is bounded)


@dataclass(frozen=True, slots=True)
class RegisteredAs:
    """The rank's registration at the daemon: the ``decider`` its tickets name."""

    rank_id: str


@dataclass(frozen=True, slots=True)
class ReadDecider:
    """Read registration ``rank_id`` from the daemon, off the loop; answer ``DeciderRead``."""

    rank_id: str


@dataclass(frozen=True, slots=True)
class DeciderRead:
    """The daemon's answer to a ``ReadDecider``: who the registration is (``instance``, ``role``,
    ``coords`` = (dp, cp, tp, pp)) and its ``proof_key``, or ``problem``."""

    rank_id: str
    instance: str
    role: str
    coords: tuple[int, int, int, int]
    proof_key: str | None
    problem: str | None
    now: float


@dataclass(frozen=True, slots=True)
class Held:
    """A claim waiting for the room's decision: request ``req`` on connection ``ident`` of ``instance``."""

    ident: bytes
    req: wire.TransferRequest
    instance: str
    since: float


@dataclass
class Tickets:
    """One prefill rank's part in deciding rooms: granting tickets (the decider), holding claims
    until one comes and checking it (every other rank)."""

    cfg: PrefillConfig
    key: ProofKey | None = None
    max_held: int = MAX_HELD
    rank_id: str | None = None  # our registration (``RegisteredAs``): the decider our tickets name
    held: dict[int, list[Held]] = field(default_factory=dict)  # room -> claims waiting for its decision
    num_held: int = 0
    keys: dict[str, str] = field(default_factory=dict)  # decider registration -> its proof key (checked)
    reading: dict[str, list[tuple[bytes, wire.RoomTicket]]] = field(default_factory=dict)  # tickets per decider read
    granted: dict[int, wire.RoomTicket] = field(default_factory=dict)  # room -> our ticket for it (decider)
    # tickets that came before any claim of their instance (handed on by a sibling decode rank):
    # room -> instance -> (connection, ticket, when); unchecked, counted with the held claims
    early: dict[int, dict[str, tuple[bytes, wire.RoomTicket, float]]] = field(default_factory=dict)
    num_early: int = 0

    @property
    def in_force(self) -> bool:
        """Rooms are decided once: a proof key to sign with, and ranks besides this one to follow."""
        c = self.cfg
        return self.key is not None and (c.cp_size > 1 or c.tp_size > 1 or c.pp_size > 1)

    @property
    def decides(self) -> bool:
        """This rank is its DP group's decider (cp 0, tp 0, pp 0)."""
        return self.cfg.cp_rank == 0 and self.cfg.tp_rank == 0 and self.cfg.pp_rank == 0

    @property
    def decider_label(self) -> str:
        c = self.cfg
        return f"{c.instance}/dp{c.dp_rank}/cp0/tp0/pp0"

    def waits(self, holder: tuple[str, str] | None, tombstoned: bool) -> bool:
        """A claim on a room with this holder (None: nobody yet) waits for the decider's ticket."""
        return self.in_force and not self.decides and holder is None and not tombstoned

    # -- the decider ---------------------------------------------------------------------------

    def grant(self, room: int, rank_id: str, holder: tuple[str, str], binding: bytes | None) -> wire.RoomTicket | None:
        """The ticket for ``room``'s holder, handed to its rank ``rank_id`` (None: no ticket is
        needed here, or we cannot sign yet). Signed once per room; each rank of the holder gets
        the same decision on its own registration."""
        if not (self.in_force and self.decides) or self.rank_id is None:
            return None
        t = self.granted.get(room)
        if t is None or t.instance != holder[0]:
            sig = self.key.sign_ticket(self.rank_id, room, holder[0], holder[1], binding or b"")  # type: ignore[union-attr]
            t = self.granted[room] = wire.RoomTicket(room=room, decode_rank_id=rank_id, decider=self.rank_id,
                                                     instance=holder[0], decode_rank=holder[1],
                                                     binding=binding or b"", signature=sig)
        if t.decode_rank_id != rank_id:
            t = wire.RoomTicket(room=room, decode_rank_id=rank_id, decider=t.decider, instance=t.instance,
                                decode_rank=t.decode_rank, binding=t.binding, signature=t.signature)
        return t

    # -- every other rank ----------------------------------------------------------------------

    def hold(self, ident: bytes, req: wire.TransferRequest, instance: str, now: float) -> bool:
        """Keep a claim until its room is decided (False: too many held; refuse it)."""
        if self.num_held + self.num_early >= self.max_held:
            return False
        self.held.setdefault(req.room, []).append(Held(ident, req, instance, now))
        self.num_held += 1
        return True

    def holds(self, room: int, instance: str) -> bool:
        return any(h.instance == instance for h in self.held.get(room, ()))

    def take(self, room: int) -> list[Held]:
        """The claims held for ``room`` (forgotten here)."""
        out = self.held.pop(room, [])
        self.num_held -= len(out)
        return out

    def withdraw(self, room: int, instance: str | None) -> list[Held]:
        """``instance``'s claims on ``room`` no longer wait (an abort, or a ticket refused): them."""
        held = self.held.get(room, [])
        gone = [h for h in held if h.instance == instance]
        keep = [h for h in held if h.instance != instance]
        self.num_held -= len(gone)
        if keep:
            self.held[room] = keep
        else:
            self.held.pop(room, None)
        return gone

    def overdue(self, now: float, timeout: float) -> list[int]:
        """Rooms whose oldest held claim waited longer than ``timeout``."""
        return [room for room, hs in self.held.items() if now - hs[0].since > timeout]

    def restart(self, now: float) -> None:
        """This rank's loop did not run until ``now`` (a starved process): a decision it waits for may
        sit unread in its socket, so every held claim and early ticket counts its timeout from ``now``."""
        for room, hs in self.held.items():
            self.held[room] = [h if h.since >= now else replace(h, since=now) for h in hs]
        for per in self.early.values():
            for inst, (ident, t, since) in per.items():
                per[inst] = (ident, t, max(since, now))

    def park(self, ident: bytes, t: wire.RoomTicket, now: float) -> bool:
        """A ticket for a room undecided here that no claim of its instance waits for yet: kept,
        unchecked, until one does (a sibling decode rank's ticket may overtake that rank's
        request). One per (room, instance), the latest; False: too many wait (ignored)."""
        per = self.early.setdefault(t.room, {})
        if t.instance not in per:
            if self.num_held + self.num_early >= self.max_held:
                if not per:
                    del self.early[t.room]
                return False
            self.num_early += 1
        per[t.instance] = (ident, t, now)
        return True

    def unpark(self, room: int, instance: str | None) -> tuple[bytes, wire.RoomTicket] | None:
        """The ticket that waited for ``instance``'s claim on ``room`` (forgotten here), or None;
        ``instance`` None: drop every ticket of the room."""
        per = self.early.get(room)
        if not per:
            return None
        if instance is None:
            self.num_early -= len(per)
            del self.early[room]
            return None
        hit = per.pop(instance, None)
        if hit is None:
            return None
        self.num_early -= 1
        if not per:
            del self.early[room]
        return hit[0], hit[1]

    def expire(self, now: float, timeout: float) -> None:
        """Tickets that no claim of their instance followed within ``timeout`` are dropped."""
        for room in list(self.early):
            per = self.early[room]
            for inst in [i for i, (_, _, since) in per.items() if now - since > timeout]:
                del per[inst]
                self.num_early -= 1
            if not per:
                del self.early[room]

    def check(self, ident: bytes, t: wire.RoomTicket) -> str | ReadDecider | bool | None:
        """A ticket presented on a proven connection of the instance it names: True (it decides
        the room), None (nobody here waits for it: ignored), a ``ReadDecider`` (it waits for the
        decider's key), or why it is refused."""
        if not self.holds(t.room, t.instance):
            return None
        key = self.keys.get(t.decider)
        if key is None:
            first = t.decider not in self.reading
            self.reading.setdefault(t.decider, []).append((ident, t))
            return ReadDecider(t.decider) if first else False
        if not verify_ticket(key, t.decider, t.room, t.instance, t.decode_rank, t.binding, t.signature):
            return (f"its RoomTicket for room {t.room} is not signed by the key of the room's decider "
                    f"{self.decider_label} (registration {t.decider})")
        return True

    def decider_read(self, e: DeciderRead) -> tuple[list[tuple[bytes, wire.RoomTicket]], str | None]:
        """The decider's registration read: the tickets that waited for it, and why they are all
        refused (None: its key is known now; check them again)."""
        waiting = self.reading.pop(e.rank_id, [])
        c = self.cfg
        want = (c.dp_rank, 0, 0, 0)
        if e.problem is not None:
            return waiting, f"the registration {e.rank_id} its RoomTicket names could not be read: {e.problem}"
        if e.instance != c.instance or e.role != "prefill" or tuple(e.coords) != want:
            dp, cp, tp, pp = e.coords
            return waiting, (f"its RoomTicket names registration {e.rank_id} as the room's decider, which is "
                             f"{e.role} rank {e.instance}/dp{dp}/cp{cp}/tp{tp}/pp{pp}, not {self.decider_label}")
        if not e.proof_key:
            return waiting, f"the room's decider {self.decider_label} (registration {e.rank_id}) registered no proof key"
        self.keys[e.rank_id] = e.proof_key
        return waiting, None

    def forget(self, room: int) -> None:
        self.granted.pop(room, None)
        self.unpark(room, None)

    def describe(self) -> dict[str, Any]:
        return {"held_claims": self.num_held, "rooms_waiting": len(self.held), "early_tickets": self.num_early,
                "deciders_known": len(self.keys)}
