"""A claim outlives its lease for its owner: a rank's claim whose lease lapsed (its process
stopped past its lease, a network partition, the daemon restarted) stays held for a grace
period (``claim_grace_s``, 30 s by default), and only the key that held it may take it back.

    rank R (instance I, proof key K) registers session S      claim (S, ranges) live
    R's lease lapses at t                                     claim lapsed until t + grace
    another registration naming S (any spelling, any key)     409 claim_held: "lapsed claim of R"
    a registration with proof key K and K's claim signature   takes S back (the lapsed claim goes)
    t + grace passes                                          S is free
    R deregisters (DELETE, its lease secret)                  S is free at once: the owner let go

The key: a decode rank's ownership-proof key (``transfer/ownership.py``), whose public half is in
its registration. Naming K is not holding it (K is public: ``GET /v1/ranks/{id}``), so a
registration that would take a lapsed claim back must carry ``proof_signature``: K's Ed25519
signature over

    "kvbridge claim v1" | instance | dp.cp.tp.pp | K        (each part length-prefixed)

which only K's holder can make. The signature is never returned by any read. A rank with no
proof key (a prefill rank: nothing is written into its memory) leaves a claim that only a rank of
the same instance may take back.

Where lapsed claims live: in memory (``MemoryStore``; with ``claims_file`` also on disk, read back
by a restarted daemon before it answers a registration), or in etcd (``lapse/<session>/<rank>``
on a lease of TTL + grace that heartbeats keep alive with the rank's own, so it outlives the
rank's lease by the grace with no daemon running). A restarted etcd-backed daemon reads them
with the rest of its cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from kvbridge.bootstrap.claims import Claim, find_conflict

__all__ = ["CLAIM_DOMAIN", "DEFAULT_CLAIM_GRACE_S", "Lapsed", "claim_message", "check_lapsed", "signature_ok"]

CLAIM_DOMAIN = b"kvbridge claim v1"
DEFAULT_CLAIM_GRACE_S = 30.0


def claim_message(instance: str, coords: tuple[int, int, int, int], proof_key: str) -> bytes:
    """What a rank's proof key signs to take its own lapsed claim back."""
    parts = (instance.encode(), ".".join(str(c) for c in coords).encode(), proof_key.encode())
    return CLAIM_DOMAIN + b"".join(len(p).to_bytes(2, "big") + p for p in parts)


def signature_ok(proof_key: str | None, signature: str | None, instance: str, coords: tuple[int, int, int, int]) -> bool:
    """``signature`` (hex) is ``proof_key``'s over this registration's claim message; never raises."""
    if not proof_key or not signature:
        return False
    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(proof_key))
        key.verify(bytes.fromhex(signature), claim_message(instance, coords, proof_key))
        return True
    except (InvalidSignature, ValueError, TypeError):
        return False


@dataclass(frozen=True)
class Lapsed:
    """A claim whose rank's lease lapsed, held for its owner until ``until`` (wall clock)."""

    claim: Claim
    proof_key: str | None
    until: float

    def may_retake(self, instance: str, proof_key: str | None, proven: bool) -> bool:
        """Whether a registration (of ``instance``, with ``proof_key``, its signature checked:
        ``proven``) may take this claim back: the key that held it, or, for a claim held with no
        key, a rank of the same instance."""
        if self.proof_key is not None:
            return proven and proof_key == self.proof_key
        return instance == self.claim.instance

    def to_json(self) -> str:
        return json.dumps({"claim": json.loads(self.claim.to_json()), "proof_key": self.proof_key,
                           "until": self.until})

    @classmethod
    def from_json(cls, data: bytes | str) -> Lapsed:
        d = json.loads(data)
        return cls(Claim.from_json(json.dumps(d["claim"])), d.get("proof_key"), float(d["until"]))


def check_lapsed(lapsed: list[Lapsed], new: Claim, *, proof_key: str | None, proven: bool,
                 now: float) -> tuple[tuple[Claim, str] | None, list[str]]:
    """Against the lapsed claims of ``new``'s session: the first one it conflicts with and may not
    take back (with why), and the rank ids of those it takes back (its owner's own)."""
    current = [x for x in lapsed if x.until > now and x.claim.session == new.session]
    blocking = [x for x in current if not x.may_retake(new.instance, proof_key, proven)]
    conflict = find_conflict([x.claim for x in blocking], new)
    if conflict is not None:
        holder, why = conflict
        left = next(x.until for x in blocking if x.claim.rank_id == holder.rank_id) - now
        return (holder, f"{why} (a lapsed claim, held for its owner's key for {left:.0f} s more)"), []
    retaken = [x.claim.rank_id for x in current if x not in blocking]
    return None, retaken
