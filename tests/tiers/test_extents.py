"""The packed pool's allocator: exact placement, coalescing, and the eviction window."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcached.contract.errors import InternalInvariantError
from kvcached.tiers.extents import ExtentAllocator


def test_best_fit_lowest_address_and_coalescing():
    a = ExtentAllocator(1000 * 64 + 10)  # rounded down to the grain
    assert a.capacity == 64000
    x, y, z = a.alloc(6400), a.alloc(100), a.alloc(6400)
    assert (x, y, z) == (0, 6400, 6528)  # 100 bytes take 128
    a.free(x)
    a.free(z)
    # gaps: [0, 6400) and [6528, 64000): a 64-byte run goes to the smaller one
    assert a.alloc(64) == 0
    a.free(0)
    a.free(y)  # merges with both neighbours into one run
    assert (a.gaps, a.largest_gap, a.free_bytes) == (1, 64000, 64000)
    a.check()


def test_no_fit_and_double_free():
    a = ExtentAllocator(4 * 64)
    offs = [a.alloc(64) for _ in range(4)]
    assert a.alloc(1) is None and not a.fits(1)
    a.free(offs[1])
    a.free(offs[3])
    assert a.free_bytes == 128 and not a.fits(128)  # free, but not contiguous
    with pytest.raises(InternalInvariantError):
        a.free(offs[1])


def test_window_frees_the_fewest_bytes():
    a = ExtentAllocator(10 * 64)
    offs = [a.alloc(64) for _ in range(10)]
    for i in (1, 4, 8):
        a.free(offs[i])
    pinned = {offs[3], offs[6]}
    # Three grains in a row without a pinned one: [0,1,2] and [7,8,9] each cost two chunks
    # (1 and 8 are free); [4,5] is too short (3 and 6 are pinned).
    got = a.window(3 * 64, lambda off: off not in pinned)
    assert got == [offs[0], offs[2]]  # equal cost: the lowest address
    assert a.window(5 * 64, lambda off: off not in pinned) is None  # every 5-run crosses a pinned one
    assert a.window(64, lambda off: False) == []  # a free grain is enough on its own


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5000)), max_size=200))
def test_random_churn_keeps_the_tiling(ops):
    a = ExtentAllocator(64 * 1024)
    live: list[int] = []
    for is_alloc, n in ops:
        if is_alloc or not live:
            off = a.alloc(n)
            if off is None:
                assert not a.fits(n)
            else:
                live.append(off)
        else:
            a.free(live.pop(n % len(live)))
        a.check()
    assert a.used_bytes == sum(a.size_of(o) for o in live)
