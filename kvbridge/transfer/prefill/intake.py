"""Prefill's request intake: a decode rank's TransferRequest (or Abort) checked against the room it
names, answered in plain data: a :class:`Refusal`, or the Target and its staging offer.

The room machine (``machine.py``) runs the checks in this order and carries the answers out:

    TransferRequest -- shutting down? FAILED -- binding presented? NOW -- first claim? ERROR
        -- contract fingerprint? REFUSED -- registration known? (else Resolve, and it waits)
    deliver -- the room (or an UNATTACHED one; a tombstone: FAILED) -- binding, claim again
        -- room ended, failing or draining? FAILED -- request_target (targets.py) and
        registered_offer (staged.py)? REFUSED -- asked twice? FAILED -- the Target is added
    Abort -- held by the asker's instance? (else ERROR) -- the room fails, AbortAck when quiet
    Release -- the room open here? binding presented? held by (or free for) the asker's instance?
        (else NOW) -- the room ends now (Success, nothing written), or fails when it has targets

How a refusal is answered (``Refusal.how``): ``NOW``: an ErrorReply at once, the room untouched;
``ERROR``: an ErrorReply once nothing of the room is in flight; ``FAILED``: a failed PagesDone
once quiet; ``REFUSED``: as FAILED, and the room fails here when the asker holds it; ``HOLD``: no
answer yet, the claim waits for the room's decision (``tickets.py``: a rank that is not the
room's decider serves only the decode instance the decider's RoomTicket names). Nothing here
sends, waits or keeps state: the rooms and registrations are the room machine's, passed in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.errors import KVBridgeError
from kvbridge.layout import AuxSchema, BufferDesc, PoolSpec
from kvbridge.transfer.binding import claim_refusal
from kvbridge.transfer.channel import wire
from kvbridge.transfer.prefill.config import PrefillConfig
from kvbridge.transfer.prefill.room import PrefillRoom
from kvbridge.transfer.prefill.staged import Offer, registered_offer
from kvbridge.transfer.prefill.targets import DecodePeer, Target, request_target
from kvbridge.transfer.rooms import Stage

NOW, ERROR, FAILED, REFUSED = "now", "error", "failed", "refused"  # how a refusal is answered
HOLD = "hold"  # not a refusal: the room is not decided on this rank yet; the claim waits (tickets.py)


@dataclass(frozen=True)
class Refusal:
    """Why a request or abort is not taken, and how it is answered (``NOW``, ``ERROR``,
    ``FAILED``, ``REFUSED``: see the module's docstring)."""
    how: str
    reason: str


class Intake:
    """The rules a decode rank's request passes to become a Target of this rank (and an abort to
    end a room): the contract, the room's binding and first claim, the room's state, the
    registration it names (``request_target``)."""

    def __init__(self, config: PrefillConfig, specs: Mapping[str, PoolSpec], src_bufs: Sequence[BufferDesc],
                 aux_schema: AuxSchema, fingerprint: str, digests_readable: bool) -> None:
        self.cfg = config
        self.rank = config.rank_label
        self.specs = specs
        self.src_bufs = src_bufs
        self.aux_schema = aux_schema
        self.fingerprint = fingerprint
        self.digests_readable = digests_readable
        self.kinds: Any = None  # the kind pools' book (prefill/kinds.py: KindWrites), set by the room machine

    def bound(self, r: PrefillRoom | None, req: wire.TransferRequest) -> Refusal | None:
        """The claim presents the room's binding (``transfer/binding.py``), or is refused now,
        before it claims the room: an ErrorReply naming both digests, the room untouched."""
        refusal = None if r is None else claim_refusal(r.binding, r.claimed_binding, req.binding, room=req.room,
                                                       rank=self.rank, decode_rank=req.decode_rank)
        return None if refusal is None else Refusal(NOW, refusal)

    def claim(self, r: PrefillRoom | None, instance: str | None, req: wire.TransferRequest) -> Refusal | None:
        """First claim wins the room id (``PrefillRoom.claim``); another instance is refused with an
        ErrorReply naming the holder, and the holder's room goes on untouched."""
        if r is None or instance is None or r.claim(instance, req.decode_rank):
            return None  # (no room yet: claimed where it is created; or the registration is being read again)
        return Refusal(ERROR, f"room {req.room} is claimed by decode instance {r.holder[0]} (rank {r.holder[1]}) on "
                              f"prefill rank {self.rank}: decode instance {instance} may not claim it (first claim "
                              "wins); nothing done")

    def contract(self, req: wire.TransferRequest) -> Refusal | None:
        if req.fingerprint == self.fingerprint:
            return None
        return Refusal(REFUSED, f"contract fingerprint {req.fingerprint} differs from prefill rank {self.rank}'s "
                                f"{self.fingerprint}; nothing transferred (hard rule 7)")

    def closed(self, req: wire.TransferRequest, tombstone: str) -> Refusal:
        return Refusal(FAILED, f"room {req.room} was already closed on prefill rank {self.rank} ({tombstone}) when "
                               f"decode rank {req.decode_rank} asked")

    def target(self, ident: bytes, req: wire.TransferRequest, r: PrefillRoom, peer: DecodePeer,
               now: float) -> Refusal | tuple[Target, Offer | None]:
        """A bound and claimed request for room ``r``, whose registration ``peer`` is known: its
        Target and staging offer (the room's length set from the request), or why not."""
        if r.state.final:
            reason = f": {r.state.reason}" if r.state.reason else ""
            return Refusal(FAILED, f"room {req.room} already ended on {self.rank} ({r.state.state.name}{reason})")
        failing = next((t.failure or t.abort_reason for t in r.targets.values() if not t.active), None)
        if r.life.stage == Stage.DRAINING or failing is not None:  # no new target for a room on its way out
            return Refusal(FAILED, f"room {req.room} is failing on {self.rank} ({failing or 'its sender was closed'})")
        try:
            target = request_target(req, ident, r, peer, self.specs, self.src_bufs, self.aux_schema,
                                    fingerprint=self.fingerprint, digests_readable=self.digests_readable,
                                    tp=(self.cfg.tp_size, self.cfg.tp_rank), now=now, aux_stage=self.cfg.last_stage,
                                    rank=self.rank)
            offer = registered_offer(req, peer)  # its staging area: the one it registered, or refused
        except KVBridgeError as exc:  # nothing was posted for this target: safe to refuse
            return Refusal(REFUSED, str(exc))
        if req.decode_rank in r.targets:
            return Refusal(FAILED, f"decode rank {req.decode_rank} asked twice for this room")
        if self.kinds:  # the window, compressed and state pools it asks (prefill/kinds.py)
            try:
                self.kinds.accept(req, peer.buffers, target.dst_pages, r.num_tokens or 0)
            except KVBridgeError as exc:
                return Refusal(REFUSED, str(exc))
            target.kind_wait = self.kinds.wants(req.room, req.decode_rank)
        return target, offer

    def abort(self, r: PrefillRoom | None, instance: str | None, msg: wire.Abort) -> Refusal | None:
        """An abort ends only a room its asker's instance holds (or nobody claimed)."""
        if r is None or r.held_by(instance):
            return None
        return Refusal(ERROR, f"room {msg.room} is claimed by decode instance {r.holder[0]} (rank {r.holder[1]}) on "
                              f"prefill rank {self.rank}: an abort from decode instance {instance} is refused; the "
                              "room goes on")

    def release(self, r: PrefillRoom | None, instance: str | None, msg: wire.Release) -> Refusal | None:
        """A release ends only a room this rank holds open, presenting the room's binding as a claim
        would, from the instance that holds it (or may claim it): anything else is refused now, by
        name, and the room goes on."""
        if r is None:
            return Refusal(NOW, f"room {msg.room} is not open on prefill rank {self.rank}: decode rank "
                                f"{msg.decode_rank}'s release is refused")
        why = claim_refusal(r.binding, r.claimed_binding, msg.binding, room=msg.room, rank=self.rank,
                            decode_rank=msg.decode_rank)
        if why is not None:
            return Refusal(NOW, f"release: {why}; the room goes on")
        if instance is None or not r.held_by(instance):
            holder = "nobody" if r.holder is None else f"decode instance {r.holder[0]} (rank {r.holder[1]})"
            return Refusal(NOW, f"room {msg.room} is claimed by {holder} on prefill rank {self.rank}: a release from "
                                f"decode instance {instance} is refused; the room goes on")
        return None
