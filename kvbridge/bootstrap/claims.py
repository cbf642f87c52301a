"""What a rank claims by registering, and when two claims conflict: the rule written once,
used by the registry against its index (both stores) and by the etcd store against what it
reads inside its check-and-claim transaction.

A registration names memory a peer will write into: a transport session (the process) and
address ranges inside it (every pool buffer, the aux buffer and its regions, the scratch
region, a decode rank's staging area). Addresses mean something only inside one process, and the session names the
process, so a claim is ``(session, [start, end) ranges)``:

    session S, held by rank a of instance "decode-1":  [a0, a1) [a2, a3)
    new rank b of instance "decode-1", session S:              [b0, b1)      ok if disjoint
    new rank c of instance "decode-2", session S:      refused: the session is another instance's
    new rank d of "decode-1", session S, [a2, ...):    refused: overlaps a's range

A session belongs to one instance (ranks of one process serve one deployment); ranks of that
instance may share it (one process, several ranks) when their ranges are disjoint. The rank
being replaced (same coordinates, its lease secret shown) holds nothing against its successor.

The overlap test is vectorised: the session's held ranges sorted by start, a running maximum
of their ends, and one ``searchsorted`` for all the new ranges, so a registration costs
O((n + m) log n) for n held and m new ranges, whatever the number of ranks elsewhere.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvbridge.bootstrap.endpoints import canonical_session
from kvbridge.bootstrap.reach import claim_key
from kvbridge.bootstrap.schemas import ScratchDescriptor, StagingDescriptor
from kvbridge.bootstrap.topology import AuxDescriptor, AuxRegionDescriptor, PoolDescriptor
from kvbridge.errors import ClaimHeld, EndpointError

__all__ = ["Claim", "claim_of", "claim_session", "session_key", "find_conflict", "claim_held"]


def session_key(session_id: str) -> str:
    """The session as claims compare it: its canonical form (``endpoints.canonical_session``,
    either mode, no resolution), so two spellings of one process are one claim. The daemon
    stores sessions canonical already; a spelling that does not parse (a record written by an
    older daemon) is compared without case or surrounding blanks."""
    try:
        return canonical_session(session_id, local=None, resolve=None)
    except EndpointError:
        return session_id.strip().lower()


def claim_session(session_id: str, engine_metadata: str = "") -> str:
    """The key a claim is compared by: what the session really reaches (``reach.claim_key``: a
    NIXL session's UCX worker address, not its agent name). A registration whose key is refused
    never gets here (the daemon refuses it first, 400); a record of an older daemon that does not
    parse falls back to ``session_key``."""
    try:
        return claim_key(session_id, engine_metadata)
    except EndpointError:
        return session_key(session_id)


@dataclass(frozen=True)
class Claim:
    rank_id: str
    label: str  # the rank's coordinates, for messages
    instance: str
    session: str  # session_key(session_id)
    ranges: np.ndarray  # (n, 2) uint64 [start, end), sorted by start, merged (disjoint)

    @property
    def digest(self) -> str:
        """A fixed-length, key-safe name of the session (etcd keys)."""
        return hashlib.sha256(self.session.encode()).hexdigest()[:32]

    def to_json(self) -> str:
        return json.dumps({"rank_id": self.rank_id, "label": self.label, "instance": self.instance,
                           "session": self.session, "ranges": self.ranges.tolist()})

    @classmethod
    def from_json(cls, data: bytes | str) -> Claim:
        d = json.loads(data)
        ranges = np.asarray(d["ranges"], dtype=np.uint64).reshape(-1, 2)
        return cls(str(d["rank_id"]), str(d["label"]), str(d["instance"]), str(d["session"]), ranges)


def _merged(ranges: np.ndarray) -> np.ndarray:
    """Sorted, with overlapping or touching ranges of one rank merged (its aux regions lie
    inside its aux buffer: its own overlaps are no conflict)."""
    if len(ranges) == 0:
        return ranges.reshape(0, 2)
    r = ranges[np.argsort(ranges[:, 0], kind="stable")]
    ends = np.maximum.accumulate(r[:, 1])
    # a new run starts where the start lies past every earlier end
    new = np.ones(len(r), dtype=bool)
    new[1:] = r[1:, 0] > ends[:-1]
    idx = np.flatnonzero(new)
    last = np.append(idx[1:] - 1, len(r) - 1)
    return np.stack([r[idx, 0], ends[last]], axis=1)


def claim_of(rank_id: str, label: str, instance: str, session_id: str, pools: Iterable[PoolDescriptor],
             aux: AuxDescriptor | None, aux_regions: Iterable[AuxRegionDescriptor],
             scratch: ScratchDescriptor | None, staging: StagingDescriptor | None = None,
             engine_metadata: str = "") -> Claim:
    """A rank's claim from its registration's descriptors (``engine_metadata``: what a NIXL
    session really reaches is in it)."""
    pools = list(pools)
    regions = list(aux_regions)
    starts = [p.base for p in pools] + [r.base for r in regions]
    sizes = [p.capacity_pages * p.bytes_per_page for p in pools] + [r.capacity_rows * r.row_bytes for r in regions]
    if aux is not None:
        starts.append(aux.base)
        sizes.append(aux.capacity_rows * aux.row_bytes)
    if scratch is not None:
        starts.append(scratch.base)
        sizes.append(scratch.nbytes)
    if staging is not None:
        starts.append(staging.base)
        sizes.append(staging.nbytes)
    # python ints first: a base near 2**64 plus its size must not wrap in uint64
    ends = [min(s + n, 2**64 - 1) for s, n in zip(starts, sizes)]
    ranges = np.array([starts, ends], dtype=np.uint64).T.reshape(-1, 2)
    return Claim(rank_id, label, instance, claim_session(session_id, engine_metadata), _merged(ranges))


def find_conflict(held: Iterable[Claim], new: Claim, *, exclude: Iterable[str | None] = ()) -> tuple[Claim, str] | None:
    """The first held claim (in ``new``'s session) that ``new`` conflicts with, and why; None
    when there is none. ``exclude``: rank ids that hold nothing against ``new`` (itself, the
    rank it replaces)."""
    skip = {x for x in exclude if x}
    others = [c for c in held if c.session == new.session and c.rank_id not in skip]
    if not others:
        return None
    foreign = next((c for c in others if c.instance != new.instance), None)
    if foreign is not None:
        return foreign, f"transport session {new.session!r} is held by instance {foreign.instance!r}"
    if len(new.ranges) == 0:
        return None
    ranges = np.concatenate([c.ranges for c in others])
    owner = np.concatenate([np.full(len(c.ranges), i) for i, c in enumerate(others)])
    if len(ranges) == 0:
        return None
    order = np.argsort(ranges[:, 0], kind="stable")
    starts, ends, owner = ranges[order, 0], ranges[order, 1], owner[order]
    reach = np.maximum.accumulate(ends)  # the furthest end among held ranges starting at or before i
    # held ranges that start before a new range's end: indices [0, k); it overlaps one iff reach[k-1] > start
    k = np.searchsorted(starts, new.ranges[:, 1], side="left")
    hit = (k > 0) & (reach[np.maximum(k, 1) - 1] > new.ranges[:, 0])
    if not hit.any():
        return None
    i = int(np.flatnonzero(hit)[0])
    s, e = int(new.ranges[i, 0]), int(new.ranges[i, 1])
    j = int(np.flatnonzero((starts < e) & (ends > s))[0])
    holder = others[int(owner[j])]
    return holder, (f"address range [{s:#x}, {e:#x}) of session {new.session!r} overlaps "
                    f"[{int(starts[j]):#x}, {int(ends[j]):#x}) held by {holder.label}")


def claim_held(label: str, holder: Claim, why: str) -> ClaimHeld:
    """The 409 answer (``claim_held``): who asked, who holds it, and what."""
    return ClaimHeld(f"{label} refused: {why} (rank {holder.rank_id}, {holder.label}); a rank registers only "
                     f"memory of its own process, and the same rank re-registers with its lease secret",
                     holder=f"{holder.rank_id} ({holder.label})", rank=label, field="session_id")
