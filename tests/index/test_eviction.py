"""Eviction policies on small hand-built sequences: what is evicted, in which order, what a
doorkeeper admits, and what the sketch remembers (kvcached.index.eviction, .sketch)."""

from __future__ import annotations

import hashlib

import pytest

from kvcached.index import FrequencyPolicy, LruPolicy, PrefixIndex, make_policy
from kvcached.index.sketch import MAX_COUNT, FrequencySketch
from kvcached.contract.keys import ChunkHash, LayoutId
from kvcached.contract.locations import TierId
from tests.index.test_trie import h, order

L = LayoutId("layout")
P, N = TierId.POOL, TierId.NVME


def real(i: int) -> ChunkHash:
    return ChunkHash(hashlib.sha256(b"chunk %d" % i).digest())


def frequency(tau: float = 10.0, **kw) -> FrequencyPolicy:
    """A frequency policy whose time scale is pinned: one more hit = ``tau`` seconds."""
    policy = FrequencyPolicy(**kw)
    policy.fix_turnover(tau)
    return policy


def insert(ix: PrefixIndex, name: str, t: float, parent=None, tiers=P):
    off = (len(ix) + 1) * 4096 if tiers & P else -1
    return ix.insert(h(name), parent, L, tiers, t, off)


def use(ix: PrefixIndex, nodes, t: float) -> None:
    """An acquire and its release at ``t``."""
    ix.pin(nodes, t)
    ix.unpin(nodes, t)


# -- the two policies, same sequence -----------------------------------------------------------


def sequence(ix: PrefixIndex) -> dict:
    """a, b, c, d inserted at t=0..3; a used once more at t=4, b twice at t=5 and t=6 (c, d never)."""
    n = {name: insert(ix, name, t) for t, name in enumerate("abcd")}
    use(ix, [n["a"]], 4)
    use(ix, [n["b"]], 5)
    use(ix, [n["b"]], 6)
    return n


def test_lru_evicts_by_last_use_only():
    ix = PrefixIndex(LruPolicy())
    sequence(ix)
    assert order(ix.pool_lru) == ["c", "d", "a", "b"]


def test_frequency_keeps_a_hit_chunk_one_turnover_per_hit_longer():
    ix = PrefixIndex(frequency(tau=10.0))
    n = sequence(ix)
    assert (n["a"].hits, n["b"].hits, n["c"].hits) == (2, 3, 1)
    # keys: c 2, d 3, a 4 + 10, b 6 + 20; a chunk used at t=15 (e) ranks between a and b
    e = insert(ix, "e", 15)
    assert [ix.pool_lru.key(x) for x in (n["c"], n["d"], n["a"], e, n["b"])] == [2, 3, 14, 15, 26]
    assert order(ix.pool_lru) == ["c", "d", "a", "e", "b"]


def test_frequency_with_weight_zero_is_lru():
    ix = PrefixIndex(frequency(tau=10.0, weight=0.0))
    sequence(ix)
    assert order(ix.pool_lru) == ["c", "d", "a", "b"]


def test_frequency_is_lru_until_it_knows_the_time_scale():
    policy = FrequencyPolicy(scale_chunks=100)  # nothing measured yet: tau 0
    ix = PrefixIndex(policy)
    sequence(ix)
    assert policy.boost == 0.0
    assert order(ix.pool_lru) == ["c", "d", "a", "b"]


def test_the_time_scale_is_a_pool_turnover_at_the_measured_use_rate():
    policy = FrequencyPolicy(scale_chunks=1000, weight=2.0, epoch_uses=100)
    policy.used(1, 0.0)  # starts the first measurement
    for k in range(1, 11):
        policy.used(10, k * 0.1)  # 100 uses in 1 s
    assert policy.turnover_seconds == pytest.approx(10.0)  # 1000 chunks at 100 uses/s
    assert policy.boost == pytest.approx(20.0)
    policy.set_scale(500)
    assert policy.turnover_seconds == pytest.approx(5.0) and policy.boost == pytest.approx(10.0)
    policy.set_weight(1.0)
    assert policy.boost == pytest.approx(5.0)


def test_leaf_first_whatever_the_ranks():
    """A much-used parent with a one-hit child: the child goes first (the parent is not even a
    candidate while it has a child in the pool), then the parent, by its boosted rank."""
    ix = PrefixIndex(frequency(tau=10.0))
    p = insert(ix, "p", 0)
    for t in (1, 2, 3):
        use(ix, [p], t)  # p: hits 4, key 3 + 30
    q = insert(ix, "q", 4, parent=p)  # q: hits 1, key 4
    insert(ix, "r", 5)  # r: key 5
    assert p not in ix.pool_lru and ix.pool_lru.key(p) == 33
    assert ix.pool_lru.pop() is q
    ix.drop_tier(q, P)
    ix.remove(q)
    assert p in ix.pool_lru  # a leaf again: queued by its own rank, after r
    ix.check_invariants()
    assert order(ix.pool_lru) == ["r", "p"]


def test_a_pinned_chunk_is_never_a_candidate():
    ix = PrefixIndex(frequency(tau=10.0))
    a, _ = insert(ix, "a", 0), insert(ix, "b", 1)
    ix.pin([a], 2)
    assert order(ix.pool_lru) == ["b"]
    ix.unpin([a], 3)
    assert order(ix.pool_lru) == ["a"]


def test_nvme_leaves_follow_the_policy_and_ttl_leaves_follow_last_use():
    ix = PrefixIndex(frequency(tau=10.0))
    a = insert(ix, "a", 0, tiers=P | N)
    b = insert(ix, "b", 1, tiers=P | N)
    use(ix, [a], 2)  # a: last use 2, hits 2 -> key 12
    assert order(ix.nvme_leaves) == ["b", "a"]
    assert ix.leaves.pop() is b and ix.leaves.pop() is a  # TTL expiry walks by last use: b (1), a (2)
    del b


def test_an_evicted_chunk_resumes_its_count():
    """The sketch remembers the hits of a chunk that left the index; inserted again, it starts
    from them (plus this use) and outranks a newcomer."""
    ix = PrefixIndex(frequency(tau=10.0))
    a = insert(ix, "a", 0)
    use(ix, [a], 1)
    use(ix, [a], 2)
    assert a.hits == 3
    ix.drop_tier(a, P)
    ix.remove(a)
    b = insert(ix, "b", 50)  # a newcomer
    a2 = insert(ix, "a", 51)
    assert (a2.hits, b.hits) == (4, 1)
    assert order(ix.pool_lru) == ["b", "a"]  # keys 50 vs 51 + 30


def test_lru_policy_has_no_memory():
    ix = PrefixIndex(LruPolicy())
    a = insert(ix, "a", 0)
    use(ix, [a], 1)
    ix.drop_tier(a, P)
    ix.remove(a)
    assert insert(ix, "a", 2).hits == 1


def test_pins_that_are_not_uses_count_no_hit():
    ix = PrefixIndex(frequency(tau=10.0))
    a = insert(ix, "a", 0)
    ix.pin([a], 5, touch=False)  # the write-back thread, a prefetch, a reservation's parent
    ix.unpin([a], 6)
    assert a.hits == 1 and a.last_use == 6


# -- admission --------------------------------------------------------------------------------


def test_doorkeeper_refuses_a_newcomer_that_ranks_below_its_victim():
    policy = frequency(tau=10.0, admission="frequency")
    ix = PrefixIndex(policy)
    hot = insert(ix, "hot", 0)
    for t in (1, 2):
        use(ix, [hot], t)  # key 2 + 20 = 22
    assert not policy.admits(real(1), 10.0, hot)  # a first-timer at t=10 ranks 10 < 22
    assert policy.admits(real(1), 23.0, hot)  # ...but not once the hot chunk's boost ran out
    policy.sketch.record(real(2), 3)  # a returning chunk used 3 times before: 10 + 30 >= 22
    assert policy.admits(real(2), 10.0, hot)


def test_always_admits_by_default():
    for policy in (LruPolicy(), frequency(tau=10.0)):
        ix = PrefixIndex(policy)
        hot = insert(ix, "hot", 0)
        for t in (1, 2, 3):
            use(ix, [hot], t)
        assert policy.admits(real(1), 4.0, hot)


def test_make_policy_checks_its_arguments():
    assert make_policy("lru").name == "lru"
    assert make_policy("frequency", weight=2.0).weight == 2.0
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("clock")
    with pytest.raises(ValueError, match="needs the frequency policy"):
        make_policy("lru", admission="frequency")
    with pytest.raises(ValueError, match="unknown admission"):
        make_policy("frequency", admission="tinylfu")


# -- the sketch -------------------------------------------------------------------------------


def test_sketch_remembers_counts_and_never_underestimates():
    s = FrequencySketch(1 << 12)
    counts = {real(i): 1 + i % 7 for i in range(1000)}
    for k, c in counts.items():
        s.record(k, c)
    assert all(s.estimate(k) >= c for k, c in counts.items())
    exact = sum(s.estimate(k) == c for k, c in counts.items())
    assert exact >= 0.95 * len(counts)  # 1000 keys in 2 x 4096 counters: collisions are rare
    assert s.estimate(real(10_000)) == 0 or s.estimate(real(10_000)) <= 7
    assert s.nbytes == 2 * (1 << 12)
    keys = [real(i) for i in range(0, 2000, 3)]  # half recorded, half not
    assert s.estimate_many(keys) == [s.estimate(k) for k in keys] and any(s.estimate_many(keys))


def test_sketch_update_is_conservative_and_saturates():
    s = FrequencySketch(64)
    s.record(real(1), 5)
    s.record(real(1), 3)  # a lower count never lowers what is remembered
    assert s.estimate(real(1)) == 5
    s.record(real(1), 10_000)
    assert s.estimate(real(1)) == MAX_COUNT


def test_sketch_halves_after_width_records():
    s = FrequencySketch(64)
    s.record(real(0), 8)
    for i in range(1, 63):
        s.record(real(i), 1)
    assert s.estimate(real(0)) >= 8
    s.record(real(63), 1)  # the 64th record ages every counter
    assert 4 <= s.estimate(real(0)) < 8


def test_sketch_width_must_be_a_power_of_two():
    for bad in (0, 63, 100, 1 << 29):
        with pytest.raises(ValueError):
            FrequencySketch(bad)
