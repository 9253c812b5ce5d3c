"""The router's index and policies, on their own: prefixes from events, provisional entries,
and where each policy sends requests (cache, load bound, dead hosts)."""

from __future__ import annotations

import pytest

from kvcached.contract.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcached_router.index import HostIndex
from kvcached_router.policy import HostState, Router


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def H(i: int) -> bytes:
    return i.to_bytes(16, "big")


def stored(hashes, medium="CPU", parent=None):
    return BlockStored([H(i) for i in hashes], parent, [], 16, None, medium, None)


def test_the_index_follows_events_across_media():
    ix = HostIndex()
    ix.apply([stored([1, 2, 3])])
    assert ix.prefix([H(1), H(2), H(3), H(4)]) == 3
    ix.apply([stored([3], "STORAGE"), BlockRemoved([H(3)], "CPU")])  # written back, then evicted from the pool
    assert ix.prefix([H(1), H(2), H(3)]) == 3 and len(ix) == 3  # still on this host, on its NVMe
    ix.apply([BlockRemoved([H(3)], "STORAGE")])
    assert ix.prefix([H(1), H(2), H(3)]) == 2
    ix.apply([BlockRemoved([H(9)], "CPU"), BlockRemoved([H(1)], "GPU")])  # unknown: nothing changes
    assert ix.prefix([H(1), H(2)]) == 2
    ix.apply([AllBlocksCleared()])
    assert ix.prefix([H(1)]) == 0 and len(ix) == 0 and ix.cleared == 1


def test_provisional_chunks_count_until_confirmed_or_expired():
    clock = Clock()
    ix = HostIndex(provisional_ttl=5.0, clock=clock)
    ix.apply([stored([1])])
    ix.expect([H(2), H(3)])  # a request routed here will store them
    assert ix.prefix([H(1), H(2), H(3)]) == 3 and ix.confirmed_prefix([H(1), H(2), H(3)]) == 1
    ix.apply([stored([2])])  # the daemon confirms one
    clock.t += 6
    assert ix.prefix([H(1), H(2), H(3)]) == 2  # the other expired: the request stored less


def hosts(*names):
    return [HostState(n, HostIndex()) for n in names]


def test_kvcached_routes_to_the_longest_prefix_within_the_load_bound():
    a, b, c = hs = hosts("a", "b", "c")
    b.index.apply([stored([1, 2])])
    c.index.apply([stored([1])])
    r = Router(hs, "kvcached", load_factor=1.25)
    d = r.choose([H(1), H(2), H(3)])
    assert (d.host.name, d.reason, d.cached_chunks, d.best_chunks) == ("b", "cache", 2, 2)
    b.in_flight, a.in_flight, c.in_flight = 4, 1, 1  # b is over the bound: the next best that is not
    d = r.choose([H(1), H(2), H(3)])
    assert (d.host.name, d.reason, d.cached_chunks) == ("c", "load", 1)
    d = r.choose([H(7)])  # nobody holds it: the emptiest queue
    assert d.reason == "balance" and d.host.name in ("a", "c")


def test_at_low_load_one_request_in_flight_does_not_lose_a_long_prefix():
    """The measured case (bench/routing/run.py --quick, before load_slack): a host serving one
    request, the others idle; the bound alone (1.25 x a mean of 0.67) called it over the bound."""
    a, b, c = hs = hosts("a", "b", "c")
    a.index.apply([stored(range(1, 47))])
    b.index.apply([stored([1, 2])])
    a.in_flight = 1
    d = Router(hs, "kvcached").choose([H(i) for i in range(1, 60)])
    assert (d.host.name, d.reason, d.cached_chunks) == ("a", "cache", 46)
    assert d.loads == {"a": 1, "b": 0, "c": 0} and d.bound >= 1
    d = Router(hs, "kvcached", load_slack=1).choose([H(i) for i in range(1, 60)])
    assert d.host.name == "b" and d.reason == "load"  # what happened without the slack


def test_a_tie_goes_to_the_host_whose_daemon_confirmed_the_prefix():
    """Also measured: the system prompt held by a and b, and only expected on c (a request in
    flight there); c's shorter queue must not win over a prefix it does not hold yet."""
    a, b, c = hs = hosts("a", "b", "c")
    a.index.apply([stored([1, 2])])
    b.index.apply([stored([1, 2])])
    c.index.expect([H(1), H(2)])
    a.queued_tokens, b.queued_tokens = 500, 900
    d = Router(hs, "kvcached").choose([H(1), H(2), H(3)])
    assert d.host.name == "a" and d.cached_chunks == 2


def test_under_skewed_load_the_cache_aware_policy_spreads():
    """Every request shares one prefix cached on host a: it takes them until the bound, then the
    others share the rest, and no host carries more than its bounded share."""
    hs = hosts("a", "b", "c", "d")
    hs[0].index.apply([stored([1, 2, 3])])
    r = Router(hs, "kvcached", load_factor=1.25)
    for _ in range(40):  # 40 concurrent requests, none finishing
        d = r.choose([H(1), H(2), H(3)])
        d.host.in_flight += 1
        d.host.index.expect([H(1), H(2), H(3)])  # it will hold them too once this request is done
    loads = sorted(h.in_flight for h in hs)
    assert loads[-1] <= 1.25 * 40 / 4 + 1 and loads[-1] / max(loads[0], 1) <= 1.5
    lp = hosts("a", "b", "c", "d")
    lp[0].index.apply([stored([1, 2, 3])])
    r2 = Router(lp, "longest_prefix")
    for _ in range(40):
        d = r2.choose([H(1), H(2), H(3)])
        d.host.in_flight += 1
    assert lp[0].in_flight == 40  # the oracle of cache alone herds everything onto one host


def test_dead_hosts_are_skipped_and_none_left_is_none():
    a, b = hs = hosts("a", "b")
    a.index.apply([stored([1])])
    a.healthy = False
    for policy in ("kvcached", "round_robin", "least_loaded", "prefix_hash", "longest_prefix"):
        d = Router(hs, policy).choose([H(1)])
        assert d.host is b, policy
    assert Router(hs).choose([H(1)], exclude=frozenset({"b"})) is None


def test_the_other_policies():
    hs = hosts("a", "b", "c")
    rr = Router(hs, "round_robin")
    assert [rr.choose([]).host.name for _ in range(4)] == ["a", "b", "c", "a"]
    hs[0].in_flight, hs[1].in_flight, hs[2].in_flight = 3, 1, 2
    assert Router(hs, "least_loaded").choose([]).host.name == "b"
    ph = Router(hs, "prefix_hash", prefix_hash_chunks=2)
    first = ph.choose([H(1), H(2), H(3)]).host.name
    assert all(ph.choose([H(1), H(2), H(k)]).host.name == first for k in range(10, 30))  # sticky on 2 chunks
    spread = {ph.choose([H(k), H(k + 1)]).host.name for k in range(0, 400, 2)}
    assert spread == {"a", "b", "c"}
    with pytest.raises(ValueError, match="policy must be one of"):
        Router(hs, "random")


def test_ties_at_empty_queues_rotate_instead_of_piling_onto_the_first_host():
    """At low load every queue is empty; new conversations sharing only the system prompt must
    not all land on the first host in the list (measured: 2.6x the least busy host's requests)."""
    hs = hosts("a", "b", "c")
    for h in hs:
        h.index.apply([stored([1, 2])])  # the system prompt, everywhere
    r = Router(hs, "kvcached")
    picks = [r.choose([H(1), H(2), H(100 + k)]).host.name for k in range(30)]
    assert {n: picks.count(n) for n in "abc"} == {"a": 10, "b": 10, "c": 10}


def test_a_host_whose_prefix_is_on_nvme_counts_less_than_one_holding_it_in_its_pool():
    """storage_weight: b holds 3 chunks in its pool, a holds 4 of which 3 only on NVMe (an older
    daemon's "DISK", SGLang's L3 "DISK" and L4 "EXTERNAL" count the same): weighted 1 + 3 x 0.5
    = 2.5 < 3, so b; with weight 1, a."""
    for medium in ("STORAGE", "DISK", "EXTERNAL"):
        a, b = hs = hosts("a", "b")
        a.index.apply([stored([1]), stored([2, 3, 4], medium)])
        b.index.apply([stored([1, 2, 3])])
        want = [H(1), H(2), H(3), H(4)]
        assert a.index.prefix_value(want, {medium: 0.5}) == (4, 2.5) and b.index.prefix_value(want, {}) == (3, 3.0)
        d = Router(hs, "kvcached", storage_weight=0.5).choose(want)
        assert d.host is b and d.reason == "cache" and d.cached_chunks == 3 and d.best_chunks == 4
        assert Router(hs, "kvcached", storage_weight=1.0).choose(want).host is a
        assert Router(hs, "longest_prefix", storage_weight=0.5).choose(want).host is b
    ix = HostIndex()
    ix.apply([stored([1], "STORAGE"), stored([1], "CPU")])  # on both: the pool's weight
    assert ix.prefix_value([H(1)], {"STORAGE": 0.5}) == (1, 1.0)
    a, b = hs = hosts("a", "b")  # SGLang's L2 host memory is memory: it counts in full
    a.index.apply([stored([1, 2, 3, 4], "CPU_PINNED")])
    b.index.apply([stored([1, 2, 3])])
    assert Router(hs, "kvcached", storage_weight=0.5).choose([H(1), H(2), H(3), H(4)]).host is a
