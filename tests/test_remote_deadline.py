"""A hung Redis stays a fast miss: with the remote frozen (SIGSTOP on the real redis-server
processes, a whole cluster included) or answering nothing (a TCP listener that accepts and never
replies), every acquire returns within ``remote_timeout`` x its round trips + 50 ms, none fails,
the breaker opens on the timeouts, and hits resume once the remote answers again.

Before the hard deadline a frozen cluster held acquires for 2.0-3.5 s with a 0.25 s timeout
(redis-py re-read the slot map from every startup node, each waiting the full timeout)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator

import pytest

from bench.harness import remote_hosts
from bench.harness.layouts import TINY, payload, prompt
from bench.harness.redis_servers import RedisCluster, RedisServer
from bench.harness.remote_hosts import MARGIN, TIMEOUT, host, wait_hit
from kvcached.store import Store
from tests.requirements import require_redis


def acquire_latencies(store: Store, lid, n: int, start: int) -> list[float]:
    """``n`` acquires of prompts no tier holds (each goes to the remote), their wall times."""
    out = []
    for i in range(n):
        t0 = time.monotonic()
        lease = store.acquire(lid, prompt(2, start=start + 1000 * i))
        out.append(time.monotonic() - t0)
        assert lease.matched_tokens == 0
        store.release(lease.lease_id)
    return out


def assert_bounded(lat: list[float], rounds: int = 1) -> None:
    bound = TIMEOUT * rounds + MARGIN
    p99 = sorted(lat)[max(0, int(0.99 * len(lat)) - 1)]
    assert max(lat) <= bound and p99 <= bound, (
        f"max {max(lat):.3f} s, p99 {p99:.3f} s, median {statistics.median(lat):.3f} s over {len(lat)} acquires; "
        f"bound {bound:.3f} s")


def test_a_frozen_redis_is_a_fast_miss_and_hits_resume(tmp_path, redis_server: RedisServer):
    node = [f"127.0.0.1:{redis_server.port}"]
    a = host(tmp_path, "a", node)
    b = host(tmp_path, "b", node, key_from=a.config.state_dir)
    try:
        lid = a.register_layout(TINY)
        b.register_layout(TINY)
        toks = prompt(3, start=7)
        a.put(lid, toks, [payload(i) for i in range(3)])
        a.publisher.drain()
        redis_server.freeze()
        try:
            lat = acquire_latencies(b, lid, 30, start=50_000)
        finally:
            redis_server.thaw()
        assert_bounded(lat)
        r = b.stats().remote
        assert r.deadline_missed >= 1 and r.breaker_opened >= 1, r
        wait_hit(b, lid, toks, 3)
    finally:
        a.close(), b.close()


@pytest.fixture
def silent_listener() -> Iterator[int]:
    """A TCP port that accepts connections and never answers (a full queue, a black hole)."""
    with remote_hosts.silent_listener() as port:
        yield port


def test_a_remote_that_accepts_and_never_answers_is_a_fast_miss(tmp_path, silent_listener):
    b = host(tmp_path, "b", [f"127.0.0.1:{silent_listener}"])
    try:
        lid = b.register_layout(TINY)
        lat = acquire_latencies(b, lid, 30, start=90_000)
        assert_bounded(lat)
        r = b.stats().remote
        assert r.deadline_missed + r.errors >= 1 and r.breaker_opened >= 1, r
    finally:
        b.close()


@pytest.mark.slow
def test_a_whole_frozen_cluster_is_a_fast_miss_and_hits_resume(tmp_path):
    require_redis()
    cluster = RedisCluster(str(tmp_path / "cluster")).start()
    try:
        nodes = [f"127.0.0.1:{n.port}" for n in cluster.nodes]
        a = host(tmp_path, "a", nodes, cluster=True)
        b = host(tmp_path, "b", nodes, cluster=True, key_from=a.config.state_dir)
        try:
            lid = a.register_layout(TINY)
            b.register_layout(TINY)
            toks = prompt(4, start=11)
            a.put(lid, toks, [payload(i) for i in range(4)])
            a.publisher.drain()
            wait_hit(b, lid, toks, 4)  # b's client knows the cluster's slot map now
            for n in cluster.nodes:
                n.freeze()
            try:
                lat = acquire_latencies(b, lid, 30, start=70_000)
            finally:
                for n in cluster.nodes:
                    n.thaw()
            assert_bounded(lat)
            r = b.stats().remote
            assert r.deadline_missed >= 1 and r.breaker_opened >= 1, r
            toks2 = prompt(2, start=13)
            a.put(lid, toks2, [payload(i) for i in range(2)])
            wait_hit(b, lid, toks2, 2, timeout=30)  # published after the thaw, fetched by b
        finally:
            a.close(), b.close()
    finally:
        cluster.stop()
