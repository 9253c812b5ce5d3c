"""Remote-tier values in a real Redis server started by the test (bench/harness/redis_servers.py): a
standalone redis-server on a free port, never the shared one on 6379, and a 6-node Redis Cluster. The remote tier itself
(issue 17) builds on this fixture."""

from __future__ import annotations

import os

from kvcached.contract.keys import ChunkHash, LayoutId
from kvcached.contract.record import ChunkMeta
from kvcached.contract.remote_format import decode, encode, mac_key, remote_key
from bench.harness.redis_servers import RedisCluster, RedisServer, free_ports
from tests.requirements import require_redis

try:
    import redis
except ImportError:  # pragma: no cover - the bench extra has it
    redis = None

LAYOUT = LayoutId("0f" * 16)
KEY = mac_key(b"the domain key")


def chunk(i: int) -> tuple[ChunkHash, bytes, bytes]:
    h = ChunkHash(i.to_bytes(4, "little") + bytes(12))
    payload = os.urandom(8192)
    return h, payload, encode(ChunkMeta(h, ChunkHash(bytes(16)), LAYOUT, i, 128), payload, KEY)


def test_standalone_server_round_trip(tmp_path):
    require_redis()
    srv = RedisServer(free_ports(1)[0], str(tmp_path / "redis")).start()
    try:
        assert srv.port != 6379
        r = redis.Redis(host="127.0.0.1", port=srv.port)
        h, payload, v = chunk(1)
        r.set(remote_key("d", LAYOUT, h), v, ex=60)
        assert bytes(decode(r.get(remote_key("d", LAYOUT, h)), h, LAYOUT, KEY)) == payload
        assert 0 < r.ttl(remote_key("d", LAYOUT, h)) <= 60
        r.close()
    finally:
        srv.stop()


def test_cluster_spreads_a_domain_and_serves_it_after_a_primary_dies(tmp_path):
    """No hash tag in the keys: a domain's chunks reach every primary. SIGKILL one: once its
    replica is promoted, the chunks it held are served again and verify (replication is
    asynchronous, but these were written before the kill and synced by WAIT)."""
    require_redis()
    cluster = RedisCluster(str(tmp_path / "cluster")).start()
    try:
        nodes = [redis.cluster.ClusterNode(h, p) for h, p in cluster.startup_nodes]
        rc = redis.RedisCluster(startup_nodes=nodes, socket_timeout=2.0)
        chunks = [chunk(i) for i in range(60)]
        pipe = rc.pipeline()
        for h, _, v in chunks:
            pipe.set(remote_key("d", LAYOUT, h), v, ex=600)
        assert all(pipe.execute())
        owners = {rc.get_node_from_key(remote_key("d", LAYOUT, h)).port for h, _, _ in chunks}
        assert len(owners) == 3
        for p in owners:  # every write reached the replica before the kill
            assert redis.Redis(host="127.0.0.1", port=p).execute_command("WAIT", 1, 5000) == 1
        rc.close()
        victim = next(n for n in cluster.nodes if n.port == min(owners))
        victim.kill()
        cluster.wait_ready(90)  # three primaries again: the replica took over
        assert victim not in cluster.primaries() and len(cluster.primaries()) == 3
        live = [redis.cluster.ClusterNode("127.0.0.1", n.port) for n in cluster.live()]
        rc = redis.RedisCluster(startup_nodes=live, socket_timeout=2.0)
        for h, payload, _ in chunks:
            assert bytes(decode(rc.get(remote_key("d", LAYOUT, h)), h, LAYOUT, KEY)) == payload
        rc.close()
    finally:
        cluster.stop()
