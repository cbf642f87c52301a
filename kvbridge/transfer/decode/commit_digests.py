"""The digest check at a decode room's commit, as pure functions of the room: which digests the
shell reads back (``digest_reads``, the ``DigestRead`` / ``KindDigestRead`` records of a
``ReadForCommit``) and why what it read refuses the commit (``digest_mismatch``, over the
``CommitRead`` that answers it). What prefill sent is kept on the room, one entry per report
(``DecodeRoom.digests``, ``DecodeRoom.kind_digests``); the machine (``machine.py``) decides when
to check, and fails the room with the reason.

The reads come in one order and the answer's arrays in the same:

    [ page reads: 1 (one stage) or 1 per report (pipeline stages) | 1 per report of kind units ]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvbridge.layout import PoolSpec
from kvbridge.transfer.decode.events import DigestRead, KindDigestRead

if TYPE_CHECKING:
    from kvbridge.transfer.decode.kind_rooms import DecodeKinds
    from kvbridge.transfer.decode.room import DecodeRoom

__all__ = ["digest_mismatch", "digest_reads"]


def digest_reads(r: DecodeRoom, pools: Sequence[str], kinds: DecodeKinds) -> tuple[DigestRead | KindDigestRead, ...]:
    """The page digests to read back (one read, or one per report under pipeline stages), then
    one per report of kind units (each over the layers its sender holds). ``pools``: the paged
    pools; the room's token count must be known."""
    return _page_reads(r, pools) + _kind_reads(r, kinds)


def _page_reads(r: DecodeRoom, pools: Sequence[str]) -> tuple[DigestRead, ...]:
    if not r.digests:
        return ()
    if not r.placement.layers:  # one stage: every report digests every layer of every pool
        pages = np.concatenate([p for p, _, _, _ in r.digests])
        return (DigestRead(tuple(pools), pages, r.page_ids[pages - r.first_page], r.num_tokens),)
    # pipeline stages: each digested its own layers of the pools it sent; check each against the same
    return tuple(DigestRead(p, pages, r.page_ids[pages - r.first_page], r.num_tokens, r.placement.layers[key])
                 for pages, _, key, p in r.digests)


def _kind_reads(r: DecodeRoom, kinds: DecodeKinds) -> tuple[KindDigestRead, ...]:
    return tuple(KindDigestRead(pool, logical, kinds.digest_units(r.room, pool, logical, r.page_ids),
                                r.num_tokens, r.placement.layers[key][pool] if r.placement.layers else None)
                 for pool, logical, _, key in r.kind_digests)


def _num_page_reads(r: DecodeRoom) -> int:
    """How many of the answer's arrays are page digests (``_page_reads``' count)."""
    if not r.digests:
        return 0
    return len(r.digests) if r.placement.layers else 1


def digest_mismatch(r: DecodeRoom, read: Sequence[np.ndarray], kind_specs: Mapping[str, PoolSpec]) -> str | None:
    """Why room ``r`` may not commit with the digests ``read`` back (in ``digest_reads``' order):
    the first logical page, or the first kind unit, whose bytes differ from what prefill sent.
    ``kind_specs``: the window, compressed and state pools' specs (``DecodeKinds.specs``)."""
    pages = _num_page_reads(r)
    bad = _page_mismatch(r, read[:pages])
    if bad is not None:
        return f"digest mismatch on logical page {bad}: bytes differ from what prefill sent"
    for (pool, logical, theirs, key), ours in zip(r.kind_digests, read[pages:]):
        wrong = np.flatnonzero(ours != theirs)
        if wrong.size:
            spec = kind_specs[pool]
            unit = "state slot" if spec.kind == "state" else "ring row" if spec.ring_stride else \
                f"unit {int(logical[wrong[0]])}"
            stage = f"/pp{key[2]}" if r.placement.layers else ""
            return (f"digest mismatch in pool {pool!r} ({spec.kind}), {unit} (from cp{key[0]}/tp{key[1]}"
                    f"{stage}): bytes differ from what prefill sent")
    return None


def _page_mismatch(r: DecodeRoom, mine: Sequence[np.ndarray]) -> int | None:
    """The first logical page whose digest read back differs from the one its report carried."""
    if not r.digests:
        return None
    if not r.placement.layers:
        found = [np.concatenate([p for p, _, _, _ in r.digests])]
        sent = [np.concatenate([d for _, d, _, _ in r.digests])]
    else:
        found = [p for p, _, _, _ in r.digests]
        sent = [d for _, d, _, _ in r.digests]
    for pages, theirs, ours in zip(found, sent, mine):
        bad = np.flatnonzero(ours != theirs)
        if bad.size:
            return int(pages[bad[0]])
    return None
