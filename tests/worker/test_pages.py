"""Page allocator: contiguous when possible, never hands out owned or held pages (hard rule 6)."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.worker.pages import OutOfPages, PageAllocator


def test_contiguous_first_fit_then_scattered():
    alloc = PageAllocator(10)
    a = alloc.allocate(1, 3)
    b = alloc.allocate(2, 3)
    assert a.tolist() == [0, 1, 2] and b.tolist() == [3, 4, 5]
    alloc.free(1)
    assert alloc.allocate(3, 4).tolist() == [6, 7, 8, 9]  # the hole of 3 is too small
    assert alloc.allocate(4, 2).tolist() == [0, 1]
    alloc.free(3)
    c = alloc.allocate(5, 5)
    assert c.tolist() == [2, 6, 7, 8, 9]  # no run of 5: lowest free pages
    assert alloc.num_free == 0
    with pytest.raises(OutOfPages):
        alloc.allocate(6, 1)


def test_held_pages_are_not_reused_until_released():
    alloc = PageAllocator(4)
    alloc.allocate(1, 4)
    alloc.hold(1)
    assert alloc.num_free == 0 and alloc.num_held == 4 and alloc.held_rooms() == [1]
    with pytest.raises(OutOfPages, match="4 held"):
        alloc.allocate(2, 1)
    alloc.release(1)
    assert alloc.allocate(2, 4).tolist() == [0, 1, 2, 3]


def test_no_page_is_handed_out_twice():
    rng = np.random.default_rng(0)
    alloc, live = PageAllocator(64), {}
    for room in range(500):
        if live and rng.random() < 0.5:
            victim = int(rng.choice(list(live)))
            (alloc.free if rng.random() < 0.7 else alloc.hold)(victim)
            live.pop(victim)
        for r in alloc.held_rooms():
            if rng.random() < 0.3:
                alloc.release(r)
        n = int(rng.integers(0, 12))
        if alloc.can_allocate(n):
            live[room] = alloc.allocate(room, n)
        owned = np.concatenate([*live.values(), np.empty(0, np.int32)])
        assert len(np.unique(owned)) == len(owned)
    with pytest.raises(Exception):
        alloc.free(10_000)
