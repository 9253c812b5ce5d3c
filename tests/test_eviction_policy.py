"""The eviction policy inside the store: a one-hit flood does not evict a hot shared prefix, the
doorkeeper refuses and says why, and stats and metrics report the policy."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import CollectorRegistry

from kvcached.config import StoreConfig
from kvcached.metrics import StoreCollector
from kvcached.settings import DaemonSettings, SettingsError, load_settings
from tests.conftest import TINY, payload, prompt

CT = TINY.chunk_tokens
HOT = prompt(4, start=10_000)  # a shared system prompt: 4 chunks


def serve(store, lid, clock, tokens: list[int]) -> int:
    """One request as an engine makes it: acquire the prompt's cached prefix, release it, store
    the rest. Returns the chunks it found cached."""
    lease = store.acquire(lid, tokens)
    store.release(lease.lease_id)
    n = len(tokens) // CT
    store.put(lid, tokens, [payload(i) for i in range(n)])
    clock.advance(1.0)
    return lease.matched_tokens // CT


def flood(make_store, clock, policy: str, state_dir: str) -> tuple[int, int]:
    """20 requests that share HOT (each with its own 2-chunk question), then a scan of 40 unique
    4-chunk prompts, each used once, through a pool of 16 chunks. Returns (chunks of HOT still
    cached after the scan, the pool's evictions)."""
    store = make_store(pool_blocks=16, nvme_chunks=None, eviction_policy=policy, state_dir=state_dir)
    lid = store.register_layout(TINY)
    for q in range(20):
        serve(store, lid, clock, HOT + prompt(2, start=20_000 + 100 * q))
    for k in range(40):
        serve(store, lid, clock, prompt(4, start=50_000 + 100 * k))
    kept = store.lookup(lid, HOT) // CT
    store.index.check_invariants()
    return kept, store.stats().counters.pool_evictions


def test_a_one_hit_flood_does_not_evict_the_hot_shared_prefix(make_store, clock, tmp_path):
    kept, evictions = flood(make_store, clock, "frequency", str(tmp_path / "frequency"))
    assert evictions >= 160 - 16  # the scan went through the whole pool several times over
    assert kept == 4
    # the control: plain recency loses it after four prompts of the scan
    kept_lru, _ = flood(make_store, clock, "lru", str(tmp_path / "lru"))
    assert kept_lru == 0


def test_the_doorkeeper_refuses_one_hit_chunks_and_says_why(make_store, clock):
    store = make_store(pool_blocks=4, nvme_chunks=None, eviction_policy="frequency", eviction_admission="frequency")
    lid = store.register_layout(TINY)
    store.index.policy.fix_turnover(100.0)  # one more hit: 100 s
    hot = prompt(4)
    store.put(lid, hot, [payload(i) for i in range(4)])
    for _ in range(3):
        clock.advance(1.0)
        store.release(store.acquire(lid, hot).lease_id)  # hot: 4 hits, ranked 300 s ahead
    clock.advance(1.0)
    r = store.reserve(lid, prompt(2, start=900))  # a newcomer would have to evict hot chunks
    assert r.slots == () and r.not_reserved_tokens == 2 * CT
    assert "admission policy" in r.not_reserved_reason
    c = store.stats().counters
    assert (c.refused_value_chunks, c.not_reserved_chunks, c.pool_evictions) == (2, 0, 0)
    if r.reservation_id:
        store.abort(r.reservation_id)
    assert store.lookup(lid, hot) == 4 * CT


def test_stats_and_metrics_report_the_policy(make_store, clock):
    store = make_store(pool_blocks=8, nvme_chunks=None)
    lid = store.register_layout(TINY)
    e = store.stats().eviction
    assert (e.policy, e.admission, e.weight, e.memory_chunks) == ("adaptive", "always", 0.0, 1 << 22)  # starts as LRU
    assert store.stats().to_dict()["eviction"]["policy"] == "adaptive"
    for k in range(6):
        serve(store, lid, clock, prompt(3, start=1000 * k))
    reg = CollectorRegistry()
    reg.register(StoreCollector(store))
    v = reg.get_sample_value
    d = {"domain": "default"}
    assert v("kvcached_eviction_policy", {**d, "policy": "adaptive", "admission": "always"}) == 1
    assert v("kvcached_eviction_weight", d) == 0.0 and v("kvcached_eviction_weight_switches_total", d) == 0
    assert v("kvcached_admission_chunks_total", {**d, "decision": "admitted", "reason": ""}) == 18
    assert v("kvcached_admission_chunks_total", {**d, "decision": "refused", "reason": "value"}) == 0
    assert v("kvcached_evictions_total", {**d, "tier": "pool"}) == 10
    lru = make_store(pool_blocks=8, nvme_chunks=None, eviction_policy="lru", state_dir=str(store.config.state_dir) + "2")
    assert lru.stats().eviction.policy == "lru"


def test_reload_changes_the_weight(make_store, clock):
    store = make_store(pool_blocks=8, nvme_chunks=None, eviction_policy="frequency")
    store.index.policy.fix_turnover(10.0)
    assert store.index.policy.boost == 10.0
    store.reconfigure(eviction_weight=0.5)
    assert store.index.policy.boost == 5.0 and store.stats().eviction.weight == 0.5


def test_reload_leaves_the_adaptive_policys_measured_weight(make_store, clock):
    store = make_store(pool_blocks=8, nvme_chunks=None, eviction_weight=2.0)
    store.index.policy.fix_turnover(10.0)
    assert store.index.policy.boost == 0.0  # it starts as LRU, whatever eviction_weight says
    store.reconfigure(eviction_weight=0.5)
    assert store.index.policy.boost == 0.0 and store.stats().eviction.weight == 0.0


@pytest.mark.parametrize("bad", [
    {"eviction_policy": "clock"},
    {"eviction_admission": "tinylfu"},
    {"eviction_policy": "lru", "eviction_admission": "frequency"},
    {"eviction_weight": -1.0},
    {"eviction_memory_chunks": 1000},
])
def test_bad_policy_settings_are_refused(tmp_path, bad):
    with pytest.raises(ValueError):
        StoreConfig(state_dir=str(tmp_path), pool_bytes=1 << 20, **bad)
    with pytest.raises((SettingsError, ValueError)):
        load_settings(None, {"state_dir": str(tmp_path), **bad}).store_config(1 << 20)


def test_policy_settings_reach_the_store_config(tmp_path):
    s = load_settings(None, {"state_dir": str(tmp_path), "eviction_policy": "lru", "eviction_weight": 2.5})
    cfg = s.store_config(1 << 20)
    assert (cfg.eviction_policy, cfg.eviction_weight, cfg.eviction_admission) == ("lru", 2.5, "always")
    assert next(f for f in dataclasses.fields(DaemonSettings) if f.name == "eviction_policy").default == "adaptive"


def hot_and_scan(make_store, clock, policy: str, state_dir: str) -> tuple[int, object]:
    """40 hot prompts (a shared 2-chunk prefix + 2 chunks each) in rotation, three one-off
    4-chunk prompts after each, 40 rounds, through a pool of 512 chunks: under recency the scan
    pushes each hot prompt out before it comes back. A lease taken at the start is held
    throughout. Returns the hot prompts' chunks found cached, and the store.

    Sized so that the adaptive policy's evidence does not depend on the hash key: its mini
    caches sample a sixteenth of the chunks, and at half this size (256 chunks, 20 prompts, 25
    rounds) 5 of 40 random keys left them too few hot chunks to switch. At this size, 30 random
    keys all switched, finding 1.78x or more of LRU's chunks."""
    store = make_store(pool_blocks=512, nvme_chunks=None, eviction_policy=policy, state_dir=state_dir)
    lid = store.register_layout(TINY)
    held_tokens = prompt(2, start=900_000)
    store.put(lid, held_tokens, [payload(i, 7) for i in range(2)])
    held = store.acquire(lid, held_tokens)
    hot = [prompt(2, start=10_000) + prompt(2, start=20_000 + 100 * q) for q in range(40)]
    found, scan = 0, 0
    for rnd in range(40):
        for q in range(40):
            found += serve(store, lid, clock, hot[q])
            for _ in range(3):
                serve(store, lid, clock, prompt(4, start=100_000 + 100 * scan))
                scan += 1
    assert bytes(store.read_chunk(held, 1)) == payload(1, 7)  # pinned through every switch
    store.release(held.lease_id)
    store.index.check_invariants()
    return found, store


def test_the_adaptive_policy_learns_to_protect_a_hot_set_from_a_scan(make_store, clock, tmp_path):
    found, store = hot_and_scan(make_store, clock, "adaptive", str(tmp_path / "adaptive"))
    e = store.stats().eviction
    assert e.policy == "adaptive" and e.weight > 0 and e.weight_switches >= 1  # it started at 0 (LRU)
    found_lru, _ = hot_and_scan(make_store, clock, "lru", str(tmp_path / "lru"))
    assert found > 1.3 * found_lru, (found, found_lru)
