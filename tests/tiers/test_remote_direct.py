"""The remote tier's direct reader (kvcached.tiers.resp under RemoteRedisTier.fetch_into): values
read straight into the caller's buffers, verified there, the same answers as the redis-py reader,
redirections followed, and nothing written into a buffer after a call abandoned at its deadline
has returned (the caller frees those buffers: pool slots)."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from kvcached.contract.keys import ChunkHash
from kvcached.contract.remote_format import encode, mac_key, remote_key
from kvcached.tiers.remote_redis import RemoteConfig, RemoteRedisTier
from kvcached.tiers.resp import RespConnection, RespProtocolError
from bench.harness.redis_servers import RedisCluster, cli
from tests.requirements import require_redis
from tests.tiers.test_remote_redis import CHUNK, KEY, LAYOUT, chunks, hashes

redis = pytest.importorskip("redis", reason="the remote extra (redis-py) is not installed")


def tier(port: int, reader: str = "direct", **kw) -> RemoteRedisTier:
    return RemoteRedisTier(RemoteConfig(nodes=(f"127.0.0.1:{port}",), domain="d", **kw), KEY, reader=reader)


def test_values_land_in_the_callers_buffers_verified(redis_server):
    cs = chunks(6)
    t = tier(redis_server.port)
    assert t.direct and t.publish(cs)
    arena = bytearray(6 * CHUNK)  # one buffer, like a pool: chunk i at i * CHUNK
    asked: list[int] = []

    def dest(i: int) -> memoryview:
        asked.append(i)
        return memoryview(arena)[i * CHUNK: (i + 1) * CHUNK]

    assert t.fetch_into(LAYOUT, hashes(cs) + [ChunkHash(os.urandom(16))], CHUNK, dest) == 6
    assert bytes(arena) == b"".join(p for _, p in cs) and sorted(asked) == list(range(6))
    assert (t.stats.hits, t.stats.misses, t.stats.bytes_fetched) == (6, 1, 6 * CHUNK)
    # a destination refused (no room) ends the prefix there; the pipeline is read to its end
    assert t.fetch_into(LAYOUT, hashes(cs), CHUNK, lambda i: None if i == 3 else dest(i)) == 3
    assert t.fetch_into(LAYOUT, hashes(cs), CHUNK, dest) == 6  # and the connection is still good
    t.close()


@pytest.mark.parametrize("reader", ["direct", "redis-py"])
@pytest.mark.parametrize("reason, plant", [
    ("mac", lambda cs: encode(cs[2][0], cs[2][1], mac_key(b"a writer without the domain key"))),
    ("mac", lambda cs: (lambda v: v[:200] + bytes([v[200] ^ 1]) + v[201:])(encode(cs[2][0], cs[2][1], KEY))),
    ("truncated", lambda cs: b"KVCN"),
    ("mac", lambda cs: encode(cs[2][0], cs[2][1], KEY)[:-100]),
    ("header", lambda cs: encode(cs[1][0], cs[1][1], KEY)),  # another chunk's genuine value
], ids=["foreign-key", "flipped-bit", "truncated", "short", "misfiled"])
def test_both_readers_refuse_the_same_values(redis_server, reader, reason, plant):
    cs = chunks(4)
    t = tier(redis_server.port, reader)
    assert t.publish(cs)
    redis.Redis(port=redis_server.port).set(remote_key("d", LAYOUT, cs[2][0].chunk_hash), plant(cs))
    got = t.fetch(LAYOUT, hashes(cs), CHUNK)
    assert [bytes(g) for g in got] == [cs[0][1], cs[1][1]]  # up to the refused one, never it
    assert t.stats.refused == {reason: 1} and t.stats.misses == 2
    t.close()


def test_an_error_reply_is_a_failed_call_not_a_value(redis_server):
    cs = chunks(2)
    t = tier(redis_server.port)
    assert t.publish(cs)
    r = redis.Redis(port=redis_server.port)
    name = remote_key("d", LAYOUT, cs[1][0].chunk_hash)
    r.delete(name)
    r.rpush(name, b"x")  # GET of a list: -WRONGTYPE
    assert t.fetch(LAYOUT, hashes(cs), CHUNK) == [] and t.stats.errors == 1
    t.close()


def test_time_in_the_callers_dest_is_not_the_remotes(redis_server):
    """A fill's reservation may wait for local room (write-back) inside ``dest``: that wait must
    not count against Redis's deadline (a miss, a breaker failure) when Redis answered in time."""
    cs = chunks(3)
    t = tier(redis_server.port, timeout=0.2)
    assert t.publish(cs)
    arena = bytearray(3 * CHUNK)

    def slow_dest(i: int) -> memoryview:
        time.sleep(0.15)  # three of these: 0.45 s in all, past the 0.2 s deadline
        return memoryview(arena)[i * CHUNK: (i + 1) * CHUNK]

    assert t.fetch_into(LAYOUT, hashes(cs), CHUNK, slow_dest) == 3
    assert t.stats.deadline_missed == 0 and t.stats.errors == 0
    assert bytes(arena) == b"".join(p for _, p in cs)
    t.close()


class TricklingProxy:
    """Forwards one Redis connection, but after ``fast`` bytes of the server's answer sends the rest
    16 KiB at a time, 50 ms apart: a Redis (or a link) that slows down in the middle of a value.
    Every read still returns within the socket timeout; only the call's deadline can end it."""

    def __init__(self, port: int, fast: int) -> None:
        self.port_to, self.fast = port, fast
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            client, _ = self.sock.accept()
        except OSError:
            return
        upstream = socket.create_connection(("127.0.0.1", self.port_to))
        threading.Thread(target=self._pump, args=(client, upstream, None), daemon=True).start()
        self._pump(upstream, client, self.fast)

    def _pump(self, src: socket.socket, dst: socket.socket, fast: int | None) -> None:
        sent = 0
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    return
                while data:
                    n = len(data) if fast is None or sent + len(data) <= fast else max(fast - sent, 16 << 10)
                    if fast is not None and sent >= fast:
                        time.sleep(0.05)
                    dst.sendall(data[:n])
                    sent += n
                    data = data[n:]
        except OSError:
            pass


class TwoNodeMap:
    """The slot map of a two-node "cluster" whose nodes are one Redis, directly and through a
    proxy: chunk 1's key is the proxy's. Only the map is made up; every byte comes from Redis."""

    def __init__(self, direct: int, proxy: int, proxy_key: str) -> None:
        self.direct, self.proxy, self.proxy_key = direct, proxy, proxy_key.encode()

    def get_node_from_key(self, name: bytes):
        from types import SimpleNamespace

        return SimpleNamespace(host="127.0.0.1", port=self.proxy if name == self.proxy_key else self.direct)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("reader", ["the call's thread", "a helper thread"])
def test_a_fetch_abandoned_at_its_deadline_writes_nothing_after_it_returns(redis_server, reader):
    big = 1 << 20
    cs = [(m, os.urandom(big)) for m, _ in chunks(2)]
    assert tier(redis_server.port).publish(cs)
    if reader == "the call's thread":  # one node, behind the proxy: slows down inside the 2nd value
        proxy = TricklingProxy(redis_server.port, fast=big + big // 4)
        t = tier(proxy.port, timeout=0.3)
    else:  # chunk 0 read directly by the call's thread, chunk 1 through the proxy by a helper
        proxy = TricklingProxy(redis_server.port, fast=big // 4)
        cfg = RemoteConfig(nodes=(f"127.0.0.1:{redis_server.port}",), domain="d", cluster=True, timeout=0.3)
        t = RemoteRedisTier(cfg, KEY, client=TwoNodeMap(redis_server.port, proxy.port,
                                                        remote_key("d", LAYOUT, cs[1][0].chunk_hash)))
    arena = bytearray(2 * big)
    t0 = time.monotonic()
    n = t.fetch_into(LAYOUT, hashes(cs), big, lambda i: memoryview(arena)[i * big: (i + 1) * big])
    took = time.monotonic() - t0
    assert n == 0 and t.stats.deadline_missed == 1
    assert took < 0.3 + 0.05
    seen = bytes(arena)
    assert seen[:big] == cs[0][1]  # the first value had arrived, the second was on its way
    time.sleep(0.5)  # the proxy goes on sending: a reader left running would still be writing
    assert bytes(arena) == seen
    t.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    require_redis()
    c = RedisCluster(str(tmp_path_factory.mktemp("cluster"))).start()
    yield c
    c.stop()


def test_one_frozen_primary_is_a_bounded_miss_and_nothing_is_written_after_it(cluster):
    """A real frozen node among live ones. (Here each frozen read also ends at its socket timeout,
    the deadline's length; the trickling proxy above is what needs the deadline's stop.)"""
    nodes = tuple(f"{h}:{p}" for h, p in cluster.startup_nodes)
    t = RemoteRedisTier(RemoteConfig(nodes=nodes, domain="frozen", cluster=True, timeout=0.3), KEY)
    big = 1 << 20
    cs = [(m, os.urandom(big)) for m, _ in chunks(12)]
    assert t.publish(cs)
    arena = bytearray(12 * big)

    def dest(i: int) -> memoryview:
        return memoryview(arena)[i * big: (i + 1) * big]

    assert t.fetch_into(LAYOUT, hashes(cs), big, dest) == 12
    # The primary holding the first chunk: with random hashes, any one fixed primary holds none
    # of the 12 chunks in (2/3)^12 of the runs, and the fetch would then be a plain full hit.
    r = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.startup_nodes[0][1])
    port = r.get_node_from_key(remote_key("frozen", LAYOUT, cs[0][0].chunk_hash)).port
    r.close()
    frozen = next(n for n in cluster.primaries() if n.port == int(port))
    arena[:] = bytes(len(arena))
    frozen.freeze()
    try:
        t0 = time.monotonic()
        assert t.fetch_into(LAYOUT, hashes(cs), big, dest) == 0  # a miss, bounded
        assert time.monotonic() - t0 < 0.3 + 0.05 and t.stats.deadline_missed == 1
        seen = bytes(arena)
    finally:
        frozen.thaw()
    time.sleep(0.5)  # the thawed node answers now: a reader left running would write it
    assert bytes(arena) == seen
    assert t.fetch_into(LAYOUT, hashes(cs), big, dest) == 12  # fresh connections, full hit again
    assert bytes(arena) == b"".join(p for _, p in cs)
    t.close()


def test_a_slot_in_migration_is_read_through_its_redirection(cluster):
    nodes = tuple(f"{h}:{p}" for h, p in cluster.startup_nodes)
    t = RemoteRedisTier(RemoteConfig(nodes=nodes, domain="d", cluster=True), KEY)
    cs = chunks(8)
    assert t.publish(cs)
    assert [bytes(g) for g in t.fetch(LAYOUT, hashes(cs), CHUNK)] == [p for _, p in cs]
    # move chunk 3's slot to another primary by hand: first half-way (ASK), then for good (MOVED)
    r = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.startup_nodes[0][1])
    name = remote_key("d", LAYOUT, cs[3][0].chunk_hash)
    slot = r.keyslot(name)
    src = r.get_node_from_key(name)
    dst = next(n for n in r.get_primaries() if n.port != src.port)
    src_id = cli(src.port, "CLUSTER", "MYID").strip()
    dst_id = cli(dst.port, "CLUSTER", "MYID").strip()
    cli(dst.port, "CLUSTER", "SETSLOT", str(slot), "IMPORTING", src_id)
    cli(src.port, "CLUSTER", "SETSLOT", str(slot), "MIGRATING", dst_id)
    for k in cli(src.port, "CLUSTER", "GETKEYSINSLOT", str(slot), "100").split():
        cli(src.port, "MIGRATE", "127.0.0.1", str(dst.port), k, "0", "5000")
    assert "ASK" in cli(src.port, "GET", name)
    redirected = []
    inner = t._redirected
    t._redirected = lambda *a, **k: redirected.append(a[2]) or inner(*a, **k)
    assert [bytes(g) for g in t.fetch(LAYOUT, hashes(cs), CHUNK)] == [p for _, p in cs]
    assert redirected == [3]
    for n in r.get_primaries():
        cli(n.port, "CLUSTER", "SETSLOT", str(slot), "NODE", dst_id)
    redirected.clear()
    assert [bytes(g) for g in t.fetch(LAYOUT, hashes(cs), CHUNK)] == [p for _, p in cs]
    assert redirected == [3]  # MOVED: through redis-py, which follows it and updates its slot map
    redirected.clear()
    assert [bytes(g) for g in t.fetch(LAYOUT, hashes(cs), CHUNK)] == [p for _, p in cs]
    assert redirected == []  # so the next fetch reads the slot's new owner directly
    assert t.stats.errors == 0 and t.stats.refused == {}
    t.close(), r.close()


def test_the_reader_refuses_what_is_not_resp():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def answer() -> None:
        c, _ = srv.accept()
        c.recv(1024)
        c.sendall(b"$5\r\nabcdeXX")  # a value not followed by CRLF
        time.sleep(0.5)
        c.close()

    threading.Thread(target=answer, daemon=True).start()
    conn = RespConnection("127.0.0.1", srv.getsockname()[1], timeout=2)
    conn.send_many([b"k"])
    buf = bytearray(5)
    with pytest.raises(RespProtocolError, match="CRLF"):
        conn.read_many(1, lambda i, n, c: c.read_into(memoryview(buf)))
    conn.close(), srv.close()
