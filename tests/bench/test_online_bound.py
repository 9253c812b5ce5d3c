"""``workloads.online_bound``: the most hit rate any online policy can expect on an agent workload.

The bench quotes it as the reason an optimum-relative target is out of reach, so it is checked
against brute force: on small random cases, every cache of ``c`` already-seen blocks is tried
and the best expected prefix hit (the drawn session is uniform among the active ones) must
equal the bound's value for that request, not only stay under it.
"""

from __future__ import annotations

import itertools
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import workloads  # noqa: E402


def prefix_in(ctx: list[int], cache: set[int]) -> int:
    n = 0
    for b in ctx:
        if b not in cache:
            break
        n += 1
    return n


def brute_force(active: list[list[list[int]]], requests: list[dict], c: int) -> float:
    """Per request, the best expected prefix hit over every cache of ``c`` seen blocks."""
    seen: set[int] = set()
    total, expected = 0, 0.0
    for contexts, r in zip(active, requests):
        best = 0.0
        for cache in itertools.combinations(sorted(seen), min(c, len(seen))):
            cs = set(cache)
            best = max(best, sum(prefix_in(ctx, cs) for ctx in contexts) / len(contexts))
        expected += best
        total += len(r["hash_ids"])
        seen.update(r["hash_ids"])
    return expected / total


def small_case(seed: int) -> tuple[list[list[list[int]]], list[dict]]:
    """Three sessions sharing prefixes (a tree of block ids); each request continues one."""
    rng = random.Random(seed)
    nxt = iter(range(100, 10_000))
    ctxs = [[1, 2], [1, 3], [1, 2, 4]]
    active, reqs = [], []
    for _ in range(5):
        active.append([list(c) for c in ctxs])
        k = rng.randrange(len(ctxs))
        reqs.append({"hash_ids": list(ctxs[k])})
        ctxs[k] = ctxs[k] + [next(nxt)]
    return active, reqs


def test_the_bound_is_the_best_expected_hit_of_any_cache():
    for seed in range(6):
        active, reqs = small_case(seed)
        for c in (1, 2, 3):
            got = workloads.online_bound(active, reqs, [c])[c]
            assert abs(got - brute_force(active, reqs, c)) < 1e-12, (seed, c)


def test_a_detector_that_ignores_sharing_is_caught():
    """Positive control: a bound that counts each block once (no weights) is below the brute
    force on a case where a shared prefix is worth more than a private one."""
    active = [[[1, 2], [1, 3]], [[1, 2], [1, 3]]]
    reqs = [{"hash_ids": [1, 2]}, {"hash_ids": [1, 3]}]
    best = brute_force(active, reqs, 1)
    assert best == 1.0 / 4  # block 1, held by both sessions: expected 1 block of 4 sent
    unweighted = 0.5 / 4  # a block's worth as 1/n, as if nothing were shared
    assert unweighted < best


def test_recording_what_a_policy_could_know_changes_no_request():
    for gen in (workloads.agentic, workloads.agents_shared):
        active: list = []
        assert gen(active_out=active) == gen()
        assert len(active) == len(gen())
