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


def test_a_run_is_carved_from_the_smallest_gap_that_holds_all_of_it():
    a = ExtentAllocator(20 * 64)
    offs = [a.alloc(64) for _ in range(20)]
    for i in (1, 2, 5, 6, 7, 8, 9, 11, 12, 13):  # gaps: 2 grains at 1, 5 at 5, 3 at 11
        a.free(offs[i])
    assert a.alloc_run(60, 3) == [11 * 64, 12 * 64, 13 * 64]  # the 3-grain gap, not the 5
    assert a.alloc_run(64, 4) == [5 * 64, 6 * 64, 7 * 64, 8 * 64]  # leaves one grain at 9
    assert a.alloc_run(64, 3) is None and a.free_bytes == 3 * 64  # 3 grains free, no 3 in a row
    assert a.size_of(6 * 64) == 64  # each run is its own allocation, freed alone
    a.free(6 * 64)
    a.check()
    with pytest.raises(ValueError):
        a.alloc_run(64, 0)


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
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 5000)), max_size=200))
def test_random_churn_keeps_the_tiling(ops):
    a = ExtentAllocator(64 * 1024)
    live: list[int] = []
    for op, n in ops:
        if op == 2:  # a run of 1..4 allocations of n bytes
            count, size = n % 4 + 1, -(-n // 64) * 64
            offs = a.alloc_run(n, count)
            if offs is None:
                assert a.largest_gap < count * size
            else:
                assert [b - o for o, b in zip(offs, offs[1:])] == [size] * (count - 1)  # back to back
                live.extend(offs)
        elif op == 1 or not live:
            off = a.alloc(n)
            if off is None:
                assert not a.fits(n)
            else:
                live.append(off)
        else:
            a.free(live.pop(n % len(live)))
        a.check()
    assert a.used_bytes == sum(a.size_of(o) for o in live)
