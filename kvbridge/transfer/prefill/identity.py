"""Who is on each decode connection, and whether it proved it, as state.

**Binding.** A connection's Hello names the decode registration it acts for (the rank id
the daemon gave it). A TransferRequest, Abort or Ping that names another registration is
refused with an ErrorReply and nothing else happens: a connection acts only for its own
registration (issue 20, finding 5).

**Proof.** Naming a registration is not being it, nor owning its memory: anyone with the
write token and the cluster secret can name another rank's registration in a Hello, or
register another process's session and addresses. Before the first message of a connection
is acted on, prefill proves the connection is the registration and holds its memory:

    first message on connection C (Hello: registration R)
      registration of R known?  no -> Resolve(R) ... resolved
      R's session canonical, R has a proof key and a scratch region?   no -> refused
      Send(C, KeyChallenge(k))                                          (KEYING)
      KeyProof(sig) on C: sig by R's proof key over (R, our endpoint, k)?   no -> refused (no retry)
      WriteNonce(C, R's session, scratch base + offset, nonce)  (the shell: engine write, off the loop)
      nonce_written(C, problem)   failed -> refused
      Send(C, Challenge(offset))
      ChallengeEcho(nonce') on C: compare in constant time -> proven | retried | refused
      (no answer within ``timeout`` -> refused)

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

No socket, thread or clock here: the room state machine (``prefill/machine.py``) feeds it.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvbridge.bootstrap.endpoints import is_canonical_session
from kvbridge.transfer.channel.wire import NONCE_BYTES
from kvbridge.transfer.ownership import verify_proof

PROOF_FAILED = "could not prove it holds the memory it registered"
# Echoes that differ before a connection is refused. Every prefill rank of every instance that
# talks to a decode rank writes its nonce into that rank's one scratch region at an offset of its
# own choosing, so two proofs at once may pick the same offset and the later write replaces the
# earlier nonce (with 16 ranks and 128 offsets, more often than not): the overwritten one sees
# another's bytes. A fresh nonce at a fresh offset settles that; memory that is not the rank's
# own never echoes any nonce, so the retries cost an impostor nothing but time.
PROOF_ATTEMPTS = 4


@dataclass(frozen=True, slots=True)
class WriteNonce:
    """Write ``nonce`` through the transfer engine to ``dst`` at decode session ``session`` (its
    registered scratch region), off the loop; answer with ``PrefillRooms.nonce_written(ident,
    problem, now)`` (problem None: written)."""

    ident: bytes
    rank_id: str
    session: str
    dst: int
    nonce: bytes


class Proof(Enum):
    RESOLVING = "resolving"  # the registration is being read
    KEYING = "keying"  # KeyChallenge sent, waiting for the registration key's signature
    WRITING = "writing"  # the nonce write is out
    CHALLENGED = "challenged"  # Challenge sent, waiting for the echo
    PROVEN = "proven"
    REFUSED = "refused"


@dataclass
class Connection:
    ident: bytes
    rank_id: str  # the registration its Hello named
    instance: str = ""  # that registration's decode instance (read with it)
    state: Proof = Proof.RESOLVING
    nonce: bytes = b""
    key_nonce: bytes = b""  # the KeyChallenge's nonce
    offset: int = 0
    attempts: int = 0  # challenges written so far (PROOF_ATTEMPTS)
    deadline: float = 0.0
    why: str = ""  # the refusal, once refused
    retry_at: float = 0.0  # refused: a message after this starts a fresh proof (a failed write may be transient)
    waiting: list[Any] = field(default_factory=list)  # messages held until proven


class Identities:
    """Connections by id, what each proved, and the messages held until it did.
    ``timeout``: seconds from the first message to the echo; ``nonce_source(n)``: n random bytes."""

    def __init__(self, *, timeout: float = 5.0, max_waiting: int = 10_000, retry_s: float = 1.0,
                 nonce_source: Callable[[int], bytes] = secrets.token_bytes) -> None:
        self.timeout = timeout
        self.retry_s = retry_s
        self.max_waiting = max_waiting
        self.nonce_source = nonce_source
        self.conns: dict[bytes, Connection] = {}
        self.resolving: dict[str, list[bytes]] = {}  # registration -> connections waiting for it

    def get(self, ident: bytes) -> Connection | None:
        return self.conns.get(ident)

    def start(self, ident: bytes, rank_id: str) -> Connection:
        c = self.conns[ident] = Connection(ident, rank_id)
        return c

    def prove(self, ident: bytes, rank_id: str) -> Connection:
        """Mark ``ident`` proven for ``rank_id`` (what a passed challenge does; tests use it)."""
        c = self.conns.get(ident) or self.start(ident, rank_id)
        c.state = Proof.PROVEN
        return c

    def wait_registration(self, c: Connection) -> bool:
        """Hold ``c`` until its registration is read; True when no read is out for it yet."""
        first = c.rank_id not in self.resolving
        self.resolving.setdefault(c.rank_id, []).append(c.ident)
        return first

    def key_challenge(self, c: Connection, now: float) -> bytes:
        """A fresh nonce for connection ``c`` to sign (KeyChallenge)."""
        c.key_nonce = self.nonce_source(NONCE_BYTES)
        c.state = Proof.KEYING
        c.deadline = now + self.timeout
        return c.key_nonce

    @staticmethod
    def key_matches(c: Connection, proof_key: str, endpoint: str, signature: bytes) -> bool:
        """``signature`` is ``proof_key``'s over (c's registration, our ``endpoint``, c's nonce)."""
        return bool(c.key_nonce) and verify_proof(proof_key, c.rank_id, endpoint, c.key_nonce, signature)

    @staticmethod
    def unprovable(session: str, proof_key: str | None, scratch: tuple[int, int] | None) -> str | None:
        """Why a registration cannot be proven at all (None: it can)."""
        if not is_canonical_session(session):
            return (f"its transfer-engine session {session!r} is not in canonical form (bootstrap/endpoints.py), so "
                    "it may be another spelling of a session another rank holds")
        if proof_key is None:
            return "its registration has no proof key, so no connection can show it is that registration"
        if scratch is None:
            return "its registration has no scratch region"
        return None

    def challenge(self, c: Connection, session: str, base: int, nbytes: int, now: float) -> WriteNonce:
        """A fresh nonce at a random aligned offset of the scratch region ``[base, base + nbytes)``."""
        c.nonce = self.nonce_source(NONCE_BYTES)
        c.offset = secrets.randbelow(nbytes // NONCE_BYTES) * NONCE_BYTES
        c.attempts += 1
        c.state = Proof.WRITING
        c.deadline = now + self.timeout
        return WriteNonce(c.ident, c.rank_id, session, base + c.offset, c.nonce)

    @staticmethod
    def echo_matches(c: Connection, nonce: bytes) -> bool:
        return hmac.compare_digest(c.nonce, nonce)

    def overdue(self, now: float) -> list[Connection]:
        return [c for c in self.conns.values()
                if c.state in (Proof.KEYING, Proof.WRITING, Proof.CHALLENGED) and now > c.deadline]

    def prune(self, alive: set[bytes]) -> None:
        """Forget settled connections that are gone (no longer heard from)."""
        for ident in [i for i, c in self.conns.items()
                      if i not in alive and c.state in (Proof.PROVEN, Proof.REFUSED)]:
            del self.conns[ident]
