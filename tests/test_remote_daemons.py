"""Two real daemons, "host A" and "host B" (their own sockets, state dirs and pools; one hash key
file, as every host of a trust domain has), sharing a real 6-node Redis Cluster (3 primaries + 3
replicas) that the tests start on free loopback ports.

* A cross-host hit: what A puts, B acquires with identical bytes, from the cluster first and
  from its own tiers after; B's counters and metrics say so; both connect as the domain's ACL
  user (the README's recipe, on every node) and `kvcachectl doctor` reports it.
* Failover under load from both hosts: a primary is SIGKILLed while both keep acquiring and
  putting; no client sees an error, no corrupt chunk is served, and cross-host hits come back
  once a replica is promoted.
* The whole cluster down, then back: no client errors, the breaker opens and closes, the publish
  queue stays within its bound, and publishing resumes.
* Resharding under load: slots migrate between primaries (clients meet ASK and MOVED), a fourth
  primary joins, takes slots, gives them back and leaves: no client error, no corrupt chunk,
  hits from the cluster after every step.

The hosts' load, and the resharding steps, live in ``bench/harness/remote_hosts.py`` (shared with
``bench/cross_host.py``, which runs the resharding at full length).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest

from bench.harness.daemon import BIN, Daemon
from bench.harness.redis_servers import RedisCluster, RedisServer, cli, free_ports
from bench.harness.remote_hosts import (CHUNKS, CT, LAYOUT, Load, add_primary, chunk, node_id, read, remote, reshard,
                                        settle, tokens, wait_for)
from kvcached.contract.keys import write_new_key
from kvcached_client import Client
from tests.requirements import require_redis

pytestmark = pytest.mark.slow  # two real daemons and a 6-node Redis Cluster per test: run first (tests/conftest.py)


@pytest.fixture
def cluster(tmp_path) -> Iterator[RedisCluster]:
    require_redis()
    c = RedisCluster(str(tmp_path / "cluster")).start()
    yield c
    c.stop()


@pytest.fixture
def hosts(tmp_path, cluster) -> Iterator[Callable[..., tuple[Daemon, Daemon]]]:
    started: list[Daemon] = []

    def make(acl: bool = False, **settings: object) -> tuple[Daemon, Daemon]:
        key = str(tmp_path / "domain.key")
        write_new_key(key)  # `kvcachectl keygen`, copied to every host
        nodes = ",".join(f"{h}:{p}" for h, p in cluster.startup_nodes)
        if acl:  # the README's recipe: one user per domain, kept to its prefix, set on every node
            for node in cluster.nodes:
                cli(node.port, "ACL", "SETUSER", "kvc-default", "on", ">s3cret", "resetkeys", "~kvc:default:*",
                    "-@all", "+get", "+set", "+exists", "+expire", "+ping", "+cluster|slots", "+command", "+info")
            pw = tmp_path / "redis.password"
            pw.write_text("s3cret\n")
            pw.chmod(0o600)
            settings.update(remote_username="kvc-default", remote_password_file=str(pw))
        settings.setdefault("remote_timeout", 0.3)
        for name in ("a", "b"):
            os.makedirs(tmp_path / name)
            d = Daemon(str(tmp_path / name), hash_key_file=key, remote_nodes=nodes, remote_cluster=True, **settings)
            started.append(d.start())
        return started[0], started[1]

    yield make
    for d in started:
        if d.proc is not None:
            d.stop()


def test_what_host_a_puts_host_b_acquires_from_the_cluster_then_from_its_own_tiers(hosts):
    # A publishes in the background and drops a batch that misses the remote deadline (fail
    # open); its first batch also connects and authenticates to the cluster's nodes, which on a
    # loaded 2-core box can take longer than the 0.3 s the other tests use. This test is about
    # the hit, not the deadline (the failover tests below are): a deadline a busy box meets.
    a, b = hosts(acl=True, remote_timeout=2.0)
    with Client(a.socket) as ca, Client(b.socket) as cb:
        want = [chunk("a", 0, i) for i in range(CHUNKS)]
        assert ca.put_bytes(LAYOUT, tokens("a", 0), want).cached_tokens == CHUNKS * CT
        wait_for(lambda: remote(ca)["published"] >= CHUNKS, 10, "A to publish")
        # B's first fetch also connects to the cluster's nodes, all within the remote deadline:
        # on a loaded box it can still run out, and that acquire fails open (a miss, no hit
        # counted). Ask again until the fill lands.
        deadline = time.monotonic() + 20
        while True:
            with cb.acquire(LAYOUT, tokens("a", 0)) as lease:
                if lease.matched_tokens == CHUNKS * CT:
                    assert read(lease) == want
                    break
                assert lease.matched_tokens == 0, lease.matched_tokens
            assert time.monotonic() < deadline, f"B never filled A's prompt from the cluster: {remote(cb)}"
            time.sleep(0.2)
        s = cb.stats()
        assert s["remote"]["hits"] == CHUNKS and s["counters"]["remote_filled_chunks"] == CHUNKS
        assert s["counters"]["hit_tokens"] >= CHUNKS * CT
        with cb.acquire(LAYOUT, tokens("a", 0)) as lease:  # now B's own tiers serve it
            assert lease.matched_tokens == CHUNKS * CT and read(lease) == want
        assert remote(cb)["hits"] == CHUNKS
        assert remote(cb)["published"] == 0  # what came from the cluster is not sent back
    metrics = urllib.request.urlopen(b.metrics_url, timeout=10).read().decode()
    assert f'kvcached_remote_hits_total{{domain="default"}} {float(CHUNKS)}' in metrics
    r = subprocess.run([os.path.join(BIN, "kvcachectl"), "--socket", b.socket, "doctor", "--json"],
                       capture_output=True, text=True, timeout=60)
    checks = {c["check"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["remote tier"]["verdict"] == "ok" and "Redis Cluster" in checks["remote tier"]["detail"]
    assert checks["remote ACL"]["verdict"] == "ok"  # NOPERM just outside kvc:default:*
    assert checks["remote memory"]["verdict"] == "warn"  # the test cluster's noeviction: said so


def test_the_load_counts_a_corrupt_chunk():
    """The positive control of every "corrupt == 0" below: one flipped bit in one served chunk
    is counted; right bytes, and an empty (missed) answer, are not."""
    load = Load({"a": "unused-a", "b": "unused-b"})
    right = [chunk("a", 3, i) for i in range(CHUNKS)]
    load.check("a", 3, right)
    load.check("a", 3, [])
    assert load.corrupt == 0
    flipped = bytearray(right[2])
    flipped[100] ^= 1
    load.check("a", 3, right[:2] + [bytes(flipped)])
    assert load.corrupt == 1 and len(load.cross_hits) == 2


def test_failover_under_load_from_both_hosts(hosts, cluster):
    a, b = hosts(pool_bytes="2M", nvme_bytes=0)  # a small pool: the other host's prompts come and go
    load = Load({"a": a.socket, "b": b.socket}).start()
    try:
        wait_for(lambda: load.hits_since(0) > 0, 20, "cross-host hits before the failover")
        victim = cluster.primaries()[0]
        victim.kill()
        killed = time.monotonic()
        cluster.wait_ready(90)  # three primaries again: a replica took over the slots
        promoted = time.monotonic()
        with Client(a.socket) as ca, Client(b.socket) as cb:
            # Chunks fetched from the cluster again (not only from what the hosts fetched before).
            before = remote(ca)["hits"] + remote(cb)["hits"]
            wait_for(lambda: remote(ca)["hits"] + remote(cb)["hits"] > before, 30,
                     "cross-host hits from the cluster after the promotion")
            wait_for(lambda: remote(ca)["hits"] > 0 and remote(cb)["hits"] > 0, 30, "cluster hits on both hosts")
    finally:
        load.stop()
    assert load.errors == [], load.errors[:5]
    assert load.corrupt == 0
    assert load.requests > 20 and promoted > killed
    with Client(a.socket) as ca, Client(b.socket) as cb:
        for c in (ca, cb):
            r = remote(c)
            assert r["refused"] == {} or sum(r["refused"].values()) == 0  # nothing garbled was served
            assert r["hits"] > 0


def test_the_whole_cluster_down_then_back(hosts, cluster):
    bound = 16
    a, b = hosts(remote_queue_chunks=bound)
    load = Load({"a": a.socket, "b": b.socket}).start()
    try:
        with Client(a.socket) as ca, Client(b.socket) as cb:
            wait_for(lambda: load.hits_since(0) > 0, 20, "cross-host hits")
            for node in cluster.nodes:
                node.kill()
            down = time.monotonic()
            wait_for(lambda: remote(ca)["breaker_state"] != "closed" and remote(cb)["breaker_state"] != "closed",
                     20, "both breakers to open")
            time.sleep(2)  # the hosts keep serving, putting and queueing while it is down
            requests_down = load.requests
            for c in (ca, cb):
                r = remote(c)
                assert r["breaker_opened"] >= 1 and r["queue_depth"] <= 2 * bound  # publish + demote queues
            published = {n: remote(c)["published"] for n, c in (("a", ca), ("b", cb))}
            for node in cluster.nodes:
                node.start()
            cluster.wait_ready(90)
            back = time.monotonic()
            wait_for(lambda: all(remote(c)["published"] > published[n] for n, c in (("a", ca), ("b", cb))),
                     30, "publishing to resume on both hosts")
            before = remote(ca)["hits"] + remote(cb)["hits"]
            wait_for(lambda: remote(ca)["hits"] + remote(cb)["hits"] > before, 30,
                     "cross-host hits from the cluster after it came back")
            for c in (ca, cb):
                assert remote(c)["breaker_state"] == "closed"
    finally:
        load.stop()
    assert load.errors == [], load.errors[:5]
    assert load.corrupt == 0
    assert load.requests > requests_down > 0 and back > down


def test_resharding_and_a_node_added_and_removed_under_load(hosts, cluster, tmp_path):
    """Slots move between primaries while both hosts fetch and publish, then a new primary joins,
    takes slots, gives them back and leaves: no client error, no corrupt chunk, cross-host hits
    from the cluster continue after each step."""
    a, b = hosts(pool_bytes="2M", nvme_bytes=0)  # a small pool: prompts keep going to the cluster
    load = Load({"a": a.socket, "b": b.socket}).start()
    extra = RedisServer(free_ports(1)[0], str(tmp_path / "extra"),
                        extra=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                               "--cluster-node-timeout", "2000"]).start()
    try:
        with Client(a.socket) as ca, Client(b.socket) as cb:
            def cluster_hits() -> int:
                return remote(ca)["hits"] + remote(cb)["hits"]

            wait_for(lambda: load.hits_since(0) > 0, 20, "cross-host hits before resharding")
            p = [n.port for n in cluster.primaries()]
            reshard(cluster, p[0], p[1], 2000)
            before = cluster_hits()
            wait_for(lambda: cluster_hits() > before, 30, "hits from the cluster after a reshard")
            add_primary(cluster, extra, via=p[0])
            reshard(cluster, p[1], extra.port, 1500)
            before = cluster_hits()
            wait_for(lambda: cluster_hits() > before, 30, "hits from the cluster with a fourth primary")
            reshard(cluster, extra.port, p[2], 1500)  # empty it, then remove it
            settle(p[0])
            cli(cluster.nodes[0].port, "--cluster", "del-node", f"127.0.0.1:{p[0]}", node_id(extra.port))
            cluster.nodes.remove(extra)
            extra.stop()
            before = cluster_hits()
            wait_for(lambda: cluster_hits() > before, 30, "hits from the cluster after the node left")
    finally:
        load.stop()
        if extra in cluster.nodes:
            cluster.nodes.remove(extra)
        extra.stop()
    assert load.errors == [], load.errors[:5]
    assert load.corrupt == 0 and load.requests > 20
    with Client(a.socket) as ca, Client(b.socket) as cb:
        for c in (ca, cb):
            assert sum(remote(c)["refused"].values()) == 0  # nothing garbled was served
