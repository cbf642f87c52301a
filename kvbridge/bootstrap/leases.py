"""Per-rank credentials: the lease secret.

A rank's registration returns a fresh lease secret. Whatever touches that
registration afterwards must present it in the ``X-KVBridge-Lease`` header, or
carry the admin token:

    action                                   without the secret (and not admin)
    heartbeat        POST /v1/ranks/{id}/heartbeat   403 lease_secret_required / wrong_lease_secret
    deregistration   DELETE /v1/ranks/{id}           403
    replacement      POST /v1/ranks, same coords     409 lease_held (Retry-After: until the lease runs out),
                                                     with no secret or a wrong one

so the shared write token alone no longer lets one instance replace, renew or drop
another's ranks. The daemon keeps only a SHA-256 of each secret.

Restart paths (documented in deploy/README.md):
- the daemon restarts: it knows no rank, so every heartbeat is 404 and the client
  registers again without a secret (a new one is issued);
- a worker restarts with its saved secret (``lease_file``): it replaces its old
  registration at once;
- a worker restarts without it: the client waits (bounded) until the old lease runs
  out, then registers; a rank that is in fact still alive keeps its coordinates;
- an operator uses the admin token (replace or ``DELETE /v1/ranks/{id}``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from kvbridge.errors import LeaseHeld, Unauthorized

__all__ = ["new_secret", "secret_digest", "check_secret", "refuse_replacement"]


def new_secret() -> str:
    return secrets.token_urlsafe(24)


def secret_digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def check_secret(digest: bytes, given: str | None, *, admin: bool, action: str, label: str, rank_id: str) -> None:
    """Raise ``Unauthorized`` (403) unless ``given`` is the rank's secret or the caller is admin."""
    if admin:
        return
    if not given:
        exc = Unauthorized(f"{action} of {label} needs its lease secret (header X-KVBridge-Lease) or the admin token",
                           rank=rank_id, field="lease_secret")
        exc.code = "lease_secret_required"  # type: ignore[attr-defined]
        raise exc
    if not hmac.compare_digest(secret_digest(given), digest):
        exc = Unauthorized(f"{action} of {label}: wrong lease secret", rank=rank_id, field="lease_secret")
        exc.code = "wrong_lease_secret"  # type: ignore[attr-defined]
        raise exc


def refuse_replacement(digest: bytes, given: str | None, *, admin: bool, label: str, rank_id: str, remaining_s: float) -> None:
    """A registration of coordinates a live rank holds: allowed with that rank's secret or as admin."""
    if admin or (given and hmac.compare_digest(secret_digest(given), digest)):
        return
    why = "no lease secret given" if not given else "the lease secret given is not this rank's"
    raise LeaseHeld(
        f"{label} is held by live rank {rank_id} for {remaining_s:.1f}s more ({why}): register with its lease "
        f"secret (a restarted worker's lease_file), wait for the lease to run out, or use the admin token",
        retry_after=remaining_s, rank=label, field="rank",
    )
