"""Who is on each decode connection, and whether it proved it: a small state machine.

**Binding.** A connection's Hello names the decode registration it acts for (the rank id
the daemon gave it). A TransferRequest, Abort or Ping that names another registration is
refused with an ErrorReply and nothing else happens: a connection acts only for its own
registration (issue 20, finding 5).

**Proof.** Naming a registration is not being it, nor owning its memory: anyone with the
write token and the cluster secret can name another rank's registration in a Hello, or
register another process's session and addresses. Before the first message of a connection
is acted on, prefill proves the connection is the registration and holds its memory:

    first message on connection C (Hello: registration R)
      registration of R known?  no -> Resolve(R) ... RegistrationRead      (RESOLVING)
      R's session canonical, R has a proof key and a scratch region?   no -> refused
      Send(C, KeyChallenge(k))                                          (KEYING)
      KeyProof(sig) on C: sig by R's proof key over (R, our endpoint, k)?   no -> refused (no retry)
      proof by read (an engine that reads R's session: Mooncake, NIXL, the local fabric):
        Send(C, Challenge(offset, nonce))                               (CHALLENGED)
          R writes sig' = its key's signature over (R, our endpoint, nonce, offset) into its
          own scratch region at offset, and says so: ChallengeEcho
        ReadProof(C, R's session, scratch base + offset, 64)            (READING; the shell: engine read, off the loop)
        ProofRead(C, bytes, problem): a signature by R's key over that? -> PROVEN | CHALLENGED again | refused
      proof by write (an engine that cannot read: CUDA IPC on one host):
        WriteNonce(C, R's session, scratch base + offset, nonce)        (WRITING; the shell: engine write, off the loop)
        NonceWritten(C, problem)   failed -> refused
        Send(C, Challenge(offset))                                      (CHALLENGED)
        ChallengeEcho(nonce') on C: compare in constant time -> PROVEN | WRITING again | refused
      (no answer within ``timeout`` -> refused)

By read, prefill writes nothing anywhere before the connection is proven: it reads what the
registrant wrote into memory it named, and only the process that holds both R's key and write
access to that memory can have put a fresh signature there (docs/security.md, "Ownership proof").

The key step binds C to R: R's proof key is the one its registrant put in the registration,
whose private half never lies in memory a transfer engine can reach, so reading or writing
any rank's registered memory does not forge it, and prefill writes nothing before it holds
(transfer/ownership.py). The daemon's claim check binds R to its session and ranges in
canonical form (bootstrap/endpoints.py): no live registration's memory is another's. The
nonce step then shows R's process reaches the memory it named (a registrant that named memory
it cannot read fails there). docs/security.md, "Ownership proof", gives the whole argument.
Messages that arrive meanwhile wait (bounded); once proven they are delivered in order;
refused, each gets an ErrorReply naming the rank and why, as does every message of the
next ``retry_s`` seconds; a later one starts a fresh proof (a nonce write may fail for a
passing reason, and each try costs prefill one small write).

**The machine.** :class:`Admission` takes the events below through ``feed(event)`` and
returns what follows from them: ``Admitted`` (deliver this message now), ``Refused`` (answer
it with an ErrorReply naming ``why``), and the actions the shell carries out (``Send``,
``WriteNonce``, ``Resolve``). Every state change goes through ``TRANSITIONS`` (a change the
table does not hold raises ``IllegalTransition``); ``TABLE`` says which event moves a
connection from which state. What it knows of a registration comes in with each event as plain
data (the ``DecodePeer`` the room machine holds, or None): it holds no callable and no pointer
back. No socket, thread or clock here: the room state machine (``prefill/machine.py``) feeds it.
"""

from __future__ import annotations

import hmac
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvbridge.bootstrap.endpoints import is_canonical_session
from kvbridge.transfer.actions import Send
from kvbridge.transfer.channel import wire
from kvbridge.transfer.ownership import PROOF_FAILED, SIGNATURE_BYTES, verify_memory, verify_proof
from kvbridge.transfer.poll import IllegalTransition
from kvbridge.transfer.prefill.targets import DecodePeer, Resolve

log = logging.getLogger(__name__)

__all__ = [
    "EVENTS", "MAX_WAITING_BYTES", "MAX_WAITING_BYTES_PER_CONNECTION", "PROOF_ATTEMPTS", "held_bytes", "PROOF_FAILED", "TABLE", "TRANSITIONS", "Admission", "Admitted", "Arrived",
    "Connection", "EchoGiven", "Forget", "KeyProofGiven", "NonceWritten", "Overdue", "Proof", "ProofRead", "ReadProof",
    "Refused", "RegistrationRead", "WriteNonce",
]

# Echoes that differ before a connection is refused. Every prefill rank of every instance that
# talks to a decode rank writes its nonce into that rank's one scratch region at an offset of its
# own choosing, so two proofs at once may pick the same offset and the later write replaces the
# earlier nonce (with 16 ranks and 128 offsets, more often than not): the overwritten one sees
# another's bytes. A fresh nonce at a fresh offset settles that; memory that is not the rank's
# own never echoes any nonce, so the retries cost an impostor nothing but time.
PROOF_ATTEMPTS = 4
# Messages held while their connection proves itself weigh at most this much, on all connections
# together and on one: a flood of large requests on connections that never finish their proof
# costs a bounded amount, and one connection cannot take every byte (docs/security.md)
MAX_WAITING_BYTES = 32 << 20
MAX_WAITING_BYTES_PER_CONNECTION = 4 << 20
HELD_OVERHEAD = 512  # per held message: the decoded struct and its small fields, counted generously


def held_bytes(msg: Any) -> int:
    """What a held message weighs: its byte and text fields (page lists) plus ``HELD_OVERHEAD``."""
    size = HELD_OVERHEAD
    for name in getattr(msg, "__struct_fields__", ()):
        value = getattr(msg, name, None)
        if isinstance(value, (bytes, bytearray, str)):
            size += len(value)
        elif isinstance(value, (list, tuple)):
            size += sum(len(v) if isinstance(v, (bytes, str)) else 16 for v in value)
        elif isinstance(value, dict):  # (a request's kind_units: pool -> packed units)
            size += sum(len(k) + (len(v) if isinstance(v, (bytes, str)) else 16) for k, v in value.items())
    return size


class Proof(Enum):
    RESOLVING = "resolving"  # the registration is being read
    KEYING = "keying"  # KeyChallenge sent, waiting for the registration key's signature
    WRITING = "writing"  # the nonce write is out (proof by write)
    CHALLENGED = "challenged"  # Challenge sent, waiting for the echo
    READING = "reading"  # the memory proof's read is out (proof by read)
    PROVEN = "proven"
    REFUSED = "refused"


# Every state change of a connection (a fresh record starts in RESOLVING, or goes straight on
# from it when the registration is known). PROVEN and REFUSED are final for the record: a
# later message after ``retry_s`` (refused) or naming another registration starts a new one.
TRANSITIONS: dict[Proof, frozenset[Proof]] = {
    Proof.RESOLVING: frozenset({Proof.KEYING, Proof.REFUSED}),
    Proof.KEYING: frozenset({Proof.WRITING, Proof.CHALLENGED, Proof.REFUSED}),
    Proof.WRITING: frozenset({Proof.CHALLENGED, Proof.REFUSED}),
    Proof.CHALLENGED: frozenset({Proof.PROVEN, Proof.WRITING, Proof.READING, Proof.REFUSED}),
    Proof.READING: frozenset({Proof.PROVEN, Proof.CHALLENGED, Proof.REFUSED}),
    Proof.PROVEN: frozenset(),
    Proof.REFUSED: frozenset(),
}


# -- events in (frozen plain data) -------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Arrived:
    """A message that acts for a registration (TransferRequest, Abort, Ping) came on connection
    ``ident``, whose Hello named registration ``said``; ``peer``: that registration as known here
    (None: not yet read)."""

    ident: bytes
    msg: Any
    said: str | None
    peer: DecodePeer | None
    now: float


@dataclass(frozen=True, slots=True)
class KeyProofGiven:
    """A KeyProof on ``ident``; ``peer``: the registration the connection named, as known now;
    ``endpoint``: our control endpoint as decode ranks dial it (what the proof signs)."""

    ident: bytes
    msg: wire.KeyProof
    peer: DecodePeer | None
    endpoint: str
    now: float


@dataclass(frozen=True, slots=True)
class NonceWritten:
    """The shell's answer to a ``WriteNonce``: written (``problem`` None), or not."""

    ident: bytes
    problem: str | None
    now: float


@dataclass(frozen=True, slots=True)
class EchoGiven:
    """A ChallengeEcho on ``ident``; ``peer`` as in ``KeyProofGiven`` (a retry writes there)."""

    ident: bytes
    msg: wire.ChallengeEcho
    peer: DecodePeer | None
    now: float


@dataclass(frozen=True, slots=True)
class ProofRead:
    """The shell's answer to a ``ReadProof``: the bytes read (``problem`` None), or why not;
    ``peer`` and ``endpoint`` as in ``KeyProofGiven`` (what the proof is checked against)."""

    ident: bytes
    data: bytes
    problem: str | None
    peer: DecodePeer | None
    endpoint: str
    now: float


@dataclass(frozen=True, slots=True)
class RegistrationRead:
    """The daemon's answer for registration ``rank_id``: ``peer`` (None with ``problem``)."""

    rank_id: str
    peer: DecodePeer | None
    problem: str | None
    now: float


@dataclass(frozen=True, slots=True)
class Overdue:
    """The clock: proofs past their deadline are refused."""

    now: float


@dataclass(frozen=True, slots=True)
class Forget:
    """Forget settled connections not among ``alive`` (the connections still heard from)."""

    alive: frozenset[bytes]


EVENTS = (Arrived, KeyProofGiven, NonceWritten, EchoGiven, ProofRead, RegistrationRead, Overdue, Forget)

# Which event moves a connection from which state (to the states the event may lead to). An
# event for a connection in a state not listed here is answered as the protocol says: a proof
# or echo nobody waits for is refused by name, a late nonce answer or registration is ignored.
_WAITING = (Proof.KEYING, Proof.WRITING, Proof.CHALLENGED, Proof.READING)
TABLE: dict[tuple[type, Proof], frozenset[Proof]] = {
    (Arrived, Proof.RESOLVING): frozenset({Proof.KEYING, Proof.REFUSED}),  # (a fresh record)
    (RegistrationRead, Proof.RESOLVING): frozenset({Proof.KEYING, Proof.REFUSED}),
    (KeyProofGiven, Proof.KEYING): frozenset({Proof.WRITING, Proof.CHALLENGED, Proof.REFUSED}),
    (NonceWritten, Proof.WRITING): frozenset({Proof.CHALLENGED, Proof.REFUSED}),
    (EchoGiven, Proof.CHALLENGED): frozenset({Proof.PROVEN, Proof.WRITING, Proof.READING, Proof.REFUSED}),
    (ProofRead, Proof.READING): frozenset({Proof.PROVEN, Proof.CHALLENGED, Proof.REFUSED}),
    **{(Overdue, s): frozenset({Proof.REFUSED}) for s in _WAITING},
}


# -- what comes out, besides the shell's actions (Send, WriteNonce, Resolve) --------------------

@dataclass(frozen=True, slots=True)
class Admitted:
    """``msg`` on ``ident`` acts for its proven registration: deliver it now."""

    ident: bytes
    msg: Any


@dataclass(frozen=True, slots=True)
class Refused:
    """Answer ``msg`` on ``ident`` with an ErrorReply saying ``why``; nothing else is done."""

    ident: bytes
    msg: Any
    why: str


@dataclass(frozen=True, slots=True)
class WriteNonce:
    """Write ``nonce`` through the transfer engine to ``dst`` at decode session ``session`` (its
    registered scratch region), off the loop; answer with ``NonceWritten(ident, problem, now)``
    (problem None: written)."""

    ident: bytes
    rank_id: str
    session: str
    dst: int
    nonce: bytes


@dataclass(frozen=True, slots=True)
class ReadProof:
    """Read ``length`` bytes at ``src`` of decode session ``session`` (its registered scratch
    region) through the transfer engine into our own memory, off the loop; answer with
    ``ProofRead(ident, data, problem, ...)``. Nothing is written anywhere."""

    ident: bytes
    rank_id: str
    session: str
    src: int
    length: int


@dataclass
class Connection:
    ident: bytes
    rank_id: str  # the registration its Hello named
    instance: str = ""  # that registration's decode instance (read with it)
    label: str = ""  # that registration's decode rank, once read (names it in a refusal)
    state: Proof = Proof.RESOLVING
    nonce: bytes = b""
    key_nonce: bytes = b""  # the KeyChallenge's nonce
    offset: int = 0
    attempts: int = 0  # challenges written so far (PROOF_ATTEMPTS)
    by_read: bool = False  # proof by read (its engine reads the registration's session)
    deadline: float = 0.0
    why: str = ""  # the refusal, once refused
    retry_at: float = 0.0  # refused: a message after this starts a fresh proof (a failed write may be transient)
    waiting: list[Any] = field(default_factory=list)  # messages held until proven
    waiting_bytes: int = 0  # what they weigh (held_bytes)


class Admission:
    """The connections of one prefill rank, what each proved, and the messages held until it
    did. ``timeout``: seconds from the first message to the echo; ``nonce_source(n)``: n random
    bytes (a test may pass its own)."""

    def __init__(self, rank: str, *, timeout: float = 5.0, max_waiting: int = 10_000, retry_s: float = 1.0,
                 nonce_source: Callable[[int], bytes] = secrets.token_bytes,
                 max_waiting_bytes: int = MAX_WAITING_BYTES,
                 max_waiting_bytes_per_connection: int = MAX_WAITING_BYTES_PER_CONNECTION) -> None:
        self.rank = rank
        self.timeout = timeout
        self.retry_s = retry_s
        self.max_waiting = max_waiting
        self.max_waiting_bytes = max_waiting_bytes  # every connection's held messages together
        self.max_waiting_bytes_per_connection = max_waiting_bytes_per_connection
        self.waiting_bytes = 0
        self.nonce_source = nonce_source
        self.conns: dict[bytes, Connection] = {}
        self.resolving: dict[str, list[bytes]] = {}  # registration -> connections waiting for it
        self._out: list[Any] = []

    # -- the door ---------------------------------------------------------------------------

    def feed(self, event: Any) -> list[Any]:
        """One event in; ``Admitted`` / ``Refused`` and the shell's actions out, in order."""
        handler = _HANDLERS.get(type(event))
        if handler is None:
            raise TypeError(f"the admission machine does not take {type(event).__name__}")
        handler(self, event)
        out, self._out = self._out, []
        return out

    # -- read-only queries ------------------------------------------------------------------

    def rank_of(self, ident: bytes) -> str | None:
        """The registration connection ``ident`` named (None: no proof started on it)."""
        c = self.conns.get(ident)
        return None if c is None else c.rank_id

    def instance_of(self, ident: bytes, rank_id: str) -> str | None:
        """The decode instance of ``rank_id`` as read when ``ident`` proved it (None: not known)."""
        c = self.conns.get(ident)
        return c.instance if c is not None and c.rank_id == rank_id and c.instance else None

    def prove(self, ident: bytes, rank_id: str) -> Connection:
        """Mark ``ident`` proven for ``rank_id`` (what a passed challenge does; tests use it)."""
        c = self.conns.get(ident) or self._start(ident, rank_id)
        c.state = Proof.PROVEN
        return c

    # -- handlers ---------------------------------------------------------------------------

    def _arrived(self, e: Arrived) -> None:
        msg = e.msg
        if isinstance(msg, wire.Ping) and not msg.decode_rank_id:
            self._out.append(Admitted(e.ident, msg))  # a probe that acts for nobody: a Heartbeat, and nothing else
            return
        if msg.decode_rank_id != e.said:
            self._out.append(Refused(e.ident, msg, f"{msg.TAG} names decode registration {msg.decode_rank_id!r}, but "
                                                   f"its connection said it is {e.said!r} in its Hello: a connection "
                                                   "acts only for its own registration; nothing done"))
            return
        c = self.conns.get(e.ident)
        if c is None or c.rank_id != e.said or (c.state is Proof.REFUSED and e.now >= c.retry_at):
            c = self._start(e.ident, e.said)  # (a refused connection may try again after a pause)
            if e.peer is None:
                first = c.rank_id not in self.resolving
                self.resolving.setdefault(c.rank_id, []).append(c.ident)
                if first:
                    self._out.append(Resolve(e.said, getattr(msg, "decode_rank", e.said)))
            else:
                self._challenge(c, e.peer, e.now)
        if c.state is Proof.PROVEN:
            self._out.append(Admitted(e.ident, msg))
        elif c.state is Proof.REFUSED:
            self._out.append(Refused(e.ident, msg, c.why))
        elif len(c.waiting) >= self.max_waiting:
            self._out.append(Refused(e.ident, msg, f"{self.max_waiting} messages already wait for decode registration "
                                                   f"{e.said} to prove it holds its memory"))
        elif (c.waiting_bytes + (size := held_bytes(msg)) > self.max_waiting_bytes_per_connection
              or self.waiting_bytes + size > self.max_waiting_bytes):
            self._out.append(Refused(e.ident, msg, f"{c.waiting_bytes} bytes of messages wait on this connection and "
                                                   f"{self.waiting_bytes} on all (caps {self.max_waiting_bytes_per_connection}"
                                                   f" and {self.max_waiting_bytes}) for decode registrations to prove "
                                                   "they hold their memory; this one is not held"))
        else:
            c.waiting.append(msg)
            c.waiting_bytes += size
            self.waiting_bytes += size

    def _registration_read(self, e: RegistrationRead) -> None:
        for ident in self.resolving.pop(e.rank_id, []):
            c = self.conns.get(ident)
            if c is None or c.state is not Proof.RESOLVING:
                continue
            if e.problem is not None or e.peer is None:
                self._refuse(c, e.problem or f"registration {e.rank_id} could not be read", e.now)
            else:
                self._challenge(c, e.peer, e.now)

    def _key_proof(self, e: KeyProofGiven) -> None:
        c = self.conns.get(e.ident)
        if c is None or c.state is not Proof.KEYING:
            self._out.append(Refused(e.ident, e.msg, "no key challenge is waiting for a proof on this connection"))
            return
        if e.peer is None or e.peer.proof_key is None:
            self._refuse(c, f"registration {c.rank_id} is no longer known here", e.now)
            return
        if not (c.key_nonce and verify_proof(e.peer.proof_key, c.rank_id, e.endpoint, c.key_nonce, e.msg.signature)):
            # no retry: a signature is no nonce another proof could have replaced
            self._refuse(c, "its KeyProof is not a signature by the proof key of the registration its Hello named, "
                            f"over prefill rank {self.rank}'s challenge: the connection is not that registration",
                         e.now)
            return
        c.key_nonce = b""
        self._write_challenge(c, e.peer, e.now)

    def _nonce_written(self, e: NonceWritten) -> None:
        c = self.conns.get(e.ident)
        if c is None or c.state is not Proof.WRITING:
            return  # (refused or re-started meanwhile)
        if e.problem is not None:
            self._refuse(c, f"the nonce write into its scratch region failed: {e.problem}", e.now)
        else:
            _to(c, Proof.CHALLENGED)
            self._out.append(Send((e.ident,), wire.Challenge(offset=c.offset)))

    def _echo(self, e: EchoGiven) -> None:
        c = self.conns.get(e.ident)
        if c is None or c.state is not Proof.CHALLENGED:
            self._out.append(Refused(e.ident, e.msg, "no challenge is waiting for an echo on this connection"))
            return
        if c.by_read:  # it says it wrote its proof: read it back (nothing written by us)
            if e.peer is None or e.peer.scratch is None:
                self._refuse(c, f"registration {c.rank_id} is no longer known here", e.now)
                return
            _to(c, Proof.READING)
            c.deadline = e.now + self.timeout
            self._out.append(ReadProof(c.ident, c.rank_id, e.peer.session, e.peer.scratch[0] + c.offset,
                                       SIGNATURE_BYTES))
            return
        if not hmac.compare_digest(c.nonce, e.msg.nonce):
            if e.peer is not None and c.attempts < PROOF_ATTEMPTS:  # (another rank's nonce may have replaced ours)
                self._write_challenge(c, e.peer, e.now)
                return
            session = e.peer.session if e.peer else "?"
            self._refuse(c, f"it echoed other bytes than the nonce written into the scratch region of session "
                            f"{session}, {c.attempts} times: that memory is not its own", e.now)
            return
        _to(c, Proof.PROVEN)
        c.nonce = b""
        waiting = self._take_waiting(c)
        self._out.extend(Admitted(e.ident, held) for held in waiting)

    def _proof_read(self, e: ProofRead) -> None:
        c = self.conns.get(e.ident)
        if c is None or c.state is not Proof.READING:
            return  # (refused or re-started meanwhile)
        if e.problem is not None:
            self._refuse(c, f"its memory proof could not be read from its scratch region: {e.problem}", e.now)
            return
        if e.peer is None or e.peer.proof_key is None:
            self._refuse(c, f"registration {c.rank_id} is no longer known here", e.now)
            return
        if verify_memory(e.peer.proof_key, c.rank_id, e.endpoint, c.nonce, c.offset, e.data):
            _to(c, Proof.PROVEN)
            c.nonce = b""
            waiting = self._take_waiting(c)
            self._out.extend(Admitted(e.ident, held) for held in waiting)
            return
        if c.attempts < PROOF_ATTEMPTS:  # (another prefill rank's challenge may have taken that offset meanwhile)
            self._write_challenge(c, e.peer, e.now)
            return
        self._refuse(c, f"the memory of session {e.peer.session} it registered held no proof by its key at the "
                        f"offsets asked, {c.attempts} times: that memory is not its own (or it cannot write there)",
                     e.now)

    def _overdue(self, e: Overdue) -> None:
        for c in [c for c in self.conns.values() if c.state in _WAITING and e.now > c.deadline]:
            what = {Proof.KEYING: "key proof", Proof.READING: "read of its memory proof"}.get(c.state,
                                                                                              "echo of the nonce")
            self._refuse(c, f"no {what} within {self.timeout:.1f}s", e.now)

    def _forget(self, e: Forget) -> None:
        for ident in [i for i, c in self.conns.items()
                      if i not in e.alive and c.state in (Proof.PROVEN, Proof.REFUSED)]:
            del self.conns[ident]

    # -- steps ------------------------------------------------------------------------------

    def _take_waiting(self, c: Connection) -> list[Any]:
        waiting, c.waiting = c.waiting, []
        self.waiting_bytes -= c.waiting_bytes
        c.waiting_bytes = 0
        return waiting

    def _start(self, ident: bytes, rank_id: str) -> Connection:
        old = self.conns.get(ident)
        if old is not None and old.waiting:  # (a record is replaced only once settled; never lose count)
            self._take_waiting(old)
        c = self.conns[ident] = Connection(ident, rank_id)
        return c

    def _challenge(self, c: Connection, peer: DecodePeer, now: float) -> None:
        """The proof's first step: the registration's key signs a fresh nonce."""
        c.label = peer.label
        why = _unprovable(peer)
        if why is not None:
            self._refuse(c, f"{why}, so prefill rank {self.rank} cannot check that the connection holds the memory "
                            "it names (a kvbridge DecodeEndpoint registers all it needs)", now)
            return
        c.instance = peer.instance
        c.key_nonce = self.nonce_source(wire.NONCE_BYTES)
        _to(c, Proof.KEYING)
        c.deadline = now + self.timeout
        self._out.append(Send((c.ident,), wire.KeyChallenge(nonce=c.key_nonce)))

    def _write_challenge(self, c: Connection, peer: DecodePeer, now: float) -> None:
        """The proof's second step. By read: a fresh nonce and a random aligned offset of the
        registration's scratch region, where it writes its key's signature over them. By write
        (an engine that cannot read): a fresh nonce written at such an offset, to echo."""
        base, nbytes = peer.scratch  # type: ignore[misc]  # (_unprovable checked it)
        c.by_read = peer.by_read
        if c.by_read:
            if nbytes < SIGNATURE_BYTES:
                self._refuse(c, f"its scratch region ({nbytes} bytes) cannot hold a memory proof", now)
                return
            c.nonce = self.nonce_source(wire.NONCE_BYTES)
            c.offset = secrets.randbelow(nbytes // SIGNATURE_BYTES) * SIGNATURE_BYTES
            c.attempts += 1
            _to(c, Proof.CHALLENGED)
            c.deadline = now + self.timeout
            self._out.append(Send((c.ident,), wire.Challenge(offset=c.offset, nonce=c.nonce)))
            return
        c.nonce = self.nonce_source(wire.NONCE_BYTES)
        c.offset = secrets.randbelow(nbytes // wire.NONCE_BYTES) * wire.NONCE_BYTES
        c.attempts += 1
        _to(c, Proof.WRITING)
        c.deadline = now + self.timeout
        self._out.append(WriteNonce(c.ident, c.rank_id, peer.session, base + c.offset, c.nonce))

    def _refuse(self, c: Connection, why: str, now: float) -> None:
        label = f"decode rank {c.label} (registration {c.rank_id})" if c.label else f"decode registration {c.rank_id}"
        _to(c, Proof.REFUSED)
        c.why = f"{label} {PROOF_FAILED}: {why}"
        c.retry_at = now + self.retry_s
        log.warning("prefill rank %s refuses connection %s: %s", self.rank, c.ident.hex(), c.why)
        waiting = self._take_waiting(c)
        self._out.extend(Refused(c.ident, msg, c.why) for msg in waiting)


_HANDLERS: dict[type, Callable[[Admission, Any], None]] = {
    Arrived: Admission._arrived, KeyProofGiven: Admission._key_proof, NonceWritten: Admission._nonce_written,
    EchoGiven: Admission._echo, ProofRead: Admission._proof_read, RegistrationRead: Admission._registration_read,
    Overdue: Admission._overdue,
    Forget: Admission._forget,
}


def _to(c: Connection, new: Proof) -> None:
    if new not in TRANSITIONS[c.state]:
        raise IllegalTransition(f"connection {c.ident.hex()}: {c.state.name} -> {new.name}")
    c.state = new


def _unprovable(peer: DecodePeer) -> str | None:
    """Why a registration cannot be proven at all (None: it can)."""
    if not is_canonical_session(peer.session):
        return (f"its transfer-engine session {peer.session!r} is not in canonical form (bootstrap/endpoints.py), so "
                "it may be another spelling of a session another rank holds")
    if peer.proof_key is None:
        return "its registration has no proof key, so no connection can show it is that registration"
    if peer.scratch is None:
        return "its registration has no scratch region"
    return None
