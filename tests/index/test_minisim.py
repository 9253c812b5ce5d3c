"""The adaptive policy's miniature simulations pick the weight the workload rewards: LRU where
once-hot chunks would squat, a large weight where a scan streams past a hot set."""

from __future__ import annotations

import hashlib
import itertools

from kvcached.index.eviction import AdaptivePolicy, EvictionQueue, FrequencyPolicy
from kvcached.index.minisim import SEEN_PER_CHUNK, MiniSims
from kvcached.contract.keys import ChunkHash


def h(i: int) -> ChunkHash:
    return ChunkHash(hashlib.sha256(i.to_bytes(8, "little")).digest()[:16])


def feed(sims: MiniSims, prompts, tau: float = 1.0, step: float = 0.01, t0: float = 0.0) -> float:
    now = t0
    for p in prompts:
        now += step
        sims.observe([h(i) for i in p], now, tau)
    return now


def test_once_hot_chunks_make_it_choose_lru():
    sims = MiniSims(scale_chunks=400, weight=1.0)  # rate 1/16: mini caches of 25 chunks
    hot = [[i] for i in range(400)] * 20  # 400 chunks used 20 times each, then never again
    now = feed(sims, hot)
    fresh = itertools.count(10_000)
    stream = []
    for _ in range(6000):  # every new chunk comes back 50 requests later: recency is everything
        stream.append([next(fresh)])
    stream = [p for k, p in enumerate(stream) for p in ([p, stream[k - 50]] if k >= 50 else [p])]
    feed(sims, stream, t0=now)
    assert sims.weight == 0.0, sims.describe()
    assert sims.switches >= 1


def test_a_scan_past_a_hot_set_makes_it_choose_a_large_weight():
    sims = MiniSims(scale_chunks=400, weight=0.0)
    fresh = itertools.count(10_000)
    prompts = []
    for k in range(30_000):  # a hot set of 300 (fits), each used every 600 requests, behind one-hit chunks
        prompts.append([(k // 2) % 300] if k % 2 else [next(fresh)])
    feed(sims, prompts)
    assert sims.weight >= 2.0, sims.describe()


def test_the_remembered_counts_stay_bounded():
    sims = MiniSims(scale_chunks=400, weight=1.0)
    feed(sims, ([i] for i in range(200_000)))  # all distinct
    assert len(sims._seen) <= SEEN_PER_CHUNK * sims.capacity + sims.epoch_uses  # pruned once an epoch


def test_the_sample_is_a_fixed_share_of_the_hash_space():
    sims = MiniSims(scale_chunks=1 << 20, weight=1.0)  # a big pool: mini caches of MINI_CHUNKS
    share = len(sims.sample([h(i) for i in range(200_000)])) / 200_000
    assert abs(share - sims.rate) < 0.3 * sims.rate
    assert sims.capacity == round((1 << 20) * sims.rate)


class N:
    def __init__(self, last_use: float, hits: int) -> None:
        self.hash = ChunkHash(b"x" * 16)
        self.last_use, self.hits, self.qflags = last_use, hits, 0


def test_a_weight_change_reranks_the_queue():
    """After the policy switches weight, members queued under the old weight rank by the new one."""
    policy = FrequencyPolicy(weight=4.0, scale_chunks=100)
    policy.fix_turnover(10.0)
    q = EvictionQueue(2, policy.key)
    once_hot, recent = N(0.0, 50), N(100.0, 1)  # weight 4: 0 + 40 x 49 ranks far above 100
    q.add(once_hot)
    q.add(recent)
    assert q.peek() is recent
    policy.set_weight(0.0)  # what the adaptive policy's switch to LRU does
    assert q.peek() is recent  # the heap still holds the old ranks ...
    q.rekey()
    assert q.peek() is once_hot  # ... until it re-ranks: now by last use


def test_the_adaptive_policy_starts_as_lru_and_ignores_a_configured_weight():
    policy = AdaptivePolicy(weight=4.0, scale_chunks=100)
    policy.fix_turnover(10.0)
    assert policy.weight == 0.0 and policy.boost == 0.0
    policy.set_weight(2.0)  # a reload: the measured choice stands
    assert policy.boost == 0.0
