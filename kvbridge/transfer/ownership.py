"""The key half of the ownership proof: a rank's proof key, and what it signs.

A decode endpoint makes an Ed25519 key pair when it is built. The public half goes into its
registration at the daemon (``proof_key``, 32 bytes as hex), where the claim check binds it to
the session and ranges the registration names; the private half stays in this process's heap,
never in memory registered with a transfer engine, so whoever reads or writes every registered
byte of every rank (Mooncake has no authentication) learns nothing of it.

A prefill rank proving a connection sends ``KeyChallenge(nonce)``; the rank answers
``KeyProof(signature)`` over

    "kvbridge ownership proof v1" | registration id | prefill control endpoint | nonce
    (each part after the first prefixed with its length, 2 bytes big-endian: no two
    challenges sign the same bytes)

with the endpoint as the decode rank dialled it (canonical: ``bootstrap.endpoints``), so a
proof made for one prefill rank is no proof to another, and a nonce is never signed twice.
Prefill checks it with the public key the daemon holds for that registration: only the
process that registered it can answer for it (docs/security.md, "Ownership proof").
"""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from kvbridge.bootstrap.endpoints import canonical_endpoint
from kvbridge.bootstrap.lapses import claim_message
from kvbridge.errors import EndpointError

__all__ = ["DOMAIN", "KEY_BYTES", "MEMORY_DOMAIN", "PROOF_FAILED", "SIGNATURE_BYTES", "TICKET_DOMAIN", "ProofKey", "memory_message",
           "proof_message", "proof_peer", "ticket_message", "verify_memory", "verify_proof", "verify_ticket"]

DOMAIN = b"kvbridge ownership proof v1"
MEMORY_DOMAIN = b"kvbridge memory proof v1"  # what a rank writes into its own scratch region (proof by read)
TICKET_DOMAIN = b"kvbridge room ticket v1"  # a room's decider: who holds the room (prefill/tickets.py)
KEY_BYTES = 32
SIGNATURE_BYTES = 64
# what a prefill rank's refusal says of a connection that did not prove its registration's memory (prefill/admission.py);
# decode asks again a few times before it fails a room on it (decode/machine.py: a proof may fail for a moment)
PROOF_FAILED = "could not prove it holds the memory it registered"


def proof_peer(endpoint: str) -> str:
    """A prefill control endpoint as both sides put it into the signed message: canonical
    where it parses (a literal address), else as given."""
    try:
        return canonical_endpoint(endpoint, local=None, resolve=None)
    except EndpointError:
        return endpoint


def proof_message(rank_id: str, prefill_endpoint: str, nonce: bytes) -> bytes:
    parts = (rank_id.encode(), proof_peer(prefill_endpoint).encode(), bytes(nonce))
    return DOMAIN + b"".join(len(p).to_bytes(2, "big") + p for p in parts)


def memory_message(rank_id: str, prefill_endpoint: str, nonce: bytes, offset: int) -> bytes:
    """What a rank signs and writes into its own scratch region at ``offset`` for a memory
    challenge: the prefill rank reads it back through its transfer engine (docs/security.md)."""
    parts = (rank_id.encode(), proof_peer(prefill_endpoint).encode(), bytes(nonce), str(offset).encode())
    return MEMORY_DOMAIN + b"".join(len(p).to_bytes(2, "big") + p for p in parts)


def ticket_message(decider: str, room: int, instance: str, decode_rank: str, binding: bytes) -> bytes:
    """What a room's decider signs: the room is held by decode ``instance`` (its rank
    ``decode_rank``'s claim won, presenting ``binding``), as decided by registration ``decider``."""
    parts = (decider.encode(), str(room).encode(), instance.encode(), decode_rank.encode(), bytes(binding))
    return TICKET_DOMAIN + b"".join(len(p).to_bytes(2, "big") + p for p in parts)


class ProofKey:
    """One rank's proof key: ``public_hex`` for its registration, ``sign`` for KeyProofs."""

    def __init__(self) -> None:
        self._private = Ed25519PrivateKey.generate()
        self.public_hex = self._private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()

    def sign(self, rank_id: str, prefill_endpoint: str, nonce: bytes) -> bytes:
        return self._private.sign(proof_message(rank_id, prefill_endpoint, nonce))

    def sign_memory(self, rank_id: str, prefill_endpoint: str, nonce: bytes, offset: int) -> bytes:
        return self._private.sign(memory_message(rank_id, prefill_endpoint, nonce, offset))

    def sign_ticket(self, decider: str, room: int, instance: str, decode_rank: str, binding: bytes) -> bytes:
        """A room's decider's ticket (``ticket_message``): the room's other prefill ranks check it
        with the public half in the decider's registration."""
        return self._private.sign(ticket_message(decider, room, instance, decode_rank, binding))

    def sign_claim(self, instance: str, coords: tuple[int, int, int, int]) -> bytes:
        """The registration's claim signature (bootstrap/lapses.py): lets this key's holder take
        back its own lapsed claim, which nobody else can."""
        return self._private.sign(claim_message(instance, coords, self.public_hex))


def verify_proof(public_hex: str, rank_id: str, prefill_endpoint: str, nonce: bytes, signature: bytes) -> bool:
    """True when ``signature`` is the registration's key's over this challenge; never raises."""
    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_hex))
        key.verify(signature, proof_message(rank_id, prefill_endpoint, nonce))
        return True
    except (InvalidSignature, ValueError, TypeError):
        return False


def verify_memory(public_hex: str, rank_id: str, prefill_endpoint: str, nonce: bytes, offset: int,
                  written: bytes) -> bool:
    """True when ``written`` (read out of the registration's scratch) is its key's signature over
    this memory challenge; never raises."""
    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_hex))
        key.verify(bytes(written), memory_message(rank_id, prefill_endpoint, nonce, offset))
        return True
    except (InvalidSignature, ValueError, TypeError):
        return False


def verify_ticket(public_hex: str, decider: str, room: int, instance: str, decode_rank: str, binding: bytes,
                  signature: bytes) -> bool:
    """True when ``signature`` is the decider's key's over this room ticket; never raises."""
    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_hex))
        key.verify(bytes(signature), ticket_message(decider, room, instance, decode_rank, binding))
        return True
    except (InvalidSignature, ValueError, TypeError):
        return False
