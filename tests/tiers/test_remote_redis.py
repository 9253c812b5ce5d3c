"""The remote tier's data path (kvcached.tiers.remote_redis) against real Redis servers the tests
start: round trips, values it must refuse, fail-open with its breaker, ACL isolation, and two
"hosts" sharing a 6-node cluster."""

from __future__ import annotations

import os
import threading
import time

import pytest

from kvcached.contract.keys import ChunkHash, LayoutId
from kvcached.contract.record import ChunkMeta
from kvcached.contract.remote_format import encode, mac_key, remote_key
from kvcached.tiers.remote_redis import IO_THREADS, Breaker, RemoteConfig, RemoteRedisTier
from bench.harness.redis_servers import RedisCluster, cli
from tests.requirements import require_redis

try:
    import redis
except ImportError:  # pragma: no cover - the bench extra has it
    redis = None

LAYOUT = LayoutId("0f" * 16)
KEY = mac_key(b"shared by the hosts of domain d")
CHUNK = 4096


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def chunks(n: int, salt: int = 0) -> list[tuple[ChunkMeta, bytes]]:
    out = []
    parent = ChunkHash(bytes(16))
    for i in range(n):
        h = ChunkHash(os.urandom(16))
        out.append((ChunkMeta(h, parent, LAYOUT, i, 128), os.urandom(CHUNK)))
        parent = h
    return out


def hashes(cs) -> list[ChunkHash]:
    return [m.chunk_hash for m, _ in cs]


@pytest.fixture
def server(redis_server):
    return redis_server


def tier(srv, domain: str = "d", **kw) -> RemoteRedisTier:
    clock = kw.pop("clock", None)
    cfg = RemoteConfig(nodes=(f"127.0.0.1:{srv.port}",), domain=domain, **kw)
    return RemoteRedisTier(cfg, KEY, **({"clock": clock} if clock else {}))


def test_publish_then_probe_and_fetch(server):
    a, b = tier(server), tier(server)  # two hosts of one domain
    cs = chunks(5)
    assert a.publish(cs) and a.stats.published == 5
    assert b.probe(LAYOUT, hashes(cs) + [ChunkHash(os.urandom(16))]) == 5
    got = b.fetch(LAYOUT, hashes(cs), CHUNK)
    assert [bytes(g) for g in got] == [p for _, p in cs]
    assert (b.stats.hits, b.stats.misses, b.stats.bytes_fetched) == (5, 0, 5 * CHUNK)
    r = redis.Redis(port=server.port)
    assert 0 < r.ttl(remote_key("d", LAYOUT, cs[0][0].chunk_hash)) <= 3600  # every key expires
    assert b.probe(LAYOUT, [ChunkHash(os.urandom(16))] + hashes(cs)) == 0  # leading chunks only
    a.close(), b.close()


@pytest.mark.parametrize("reason, plant", [
    ("mac", lambda m, p: encode(m, p, mac_key(b"a writer without the domain key"))),
    ("truncated", lambda m, p: b"KVCN"),
    ("mac", lambda m, p: encode(m, p, KEY)[:-100]),
    ("header", None),  # a genuine value of another chunk, stored under this chunk's key
])
def test_planted_truncated_or_misfiled_values_are_never_served(server, reason, plant):
    t = tier(server)
    cs = chunks(4)
    assert t.publish(cs)
    r = redis.Redis(port=server.port)
    m, p = cs[2]
    bad = encode(cs[1][0], cs[1][1], KEY) if plant is None else plant(m, p)
    r.set(remote_key("d", LAYOUT, m.chunk_hash), bad)
    got = t.fetch(LAYOUT, hashes(cs), CHUNK)
    assert [bytes(g) for g in got] == [cs[0][1], cs[1][1]]  # served up to the refused one, never it
    assert t.stats.refused == {reason: 1} and t.stats.misses == 2
    t.close()


def test_fail_open_and_the_breaker(server):
    clock = Clock()
    t = tier(server, clock=clock, timeout=0.3, breaker_failures=3, breaker_cooldown=5.0)
    cs = chunks(3)
    assert t.publish(cs)
    server.kill()
    t0 = time.monotonic()
    assert t.probe(LAYOUT, hashes(cs)) == 0  # a miss, not an error
    assert t.fetch(LAYOUT, hashes(cs), CHUNK) == []
    assert t.publish(chunks(1)) is False
    assert time.monotonic() - t0 < 3 * 0.3  # one attempt each, bounded by the timeout (no retry backoff)
    assert t.stats.errors == 3 and t.breaker.state == "open" and t.stats.breaker_opened == 1
    assert t.probe(LAYOUT, hashes(cs)) == 0 and t.stats.skipped_open == 1 and t.stats.errors == 3  # no call made
    server.start()  # back (empty: nothing was persisted)
    assert t.probe(LAYOUT, hashes(cs)) == 0 and t.stats.skipped_open == 2  # still cooling down
    clock.t += 5.0
    assert t.breaker.state == "half_open"
    assert t.publish(cs)  # the trial call succeeds: closed again
    assert t.breaker.state == "closed" and t.probe(LAYOUT, hashes(cs)) == 3
    t.close()


def test_breaker_half_open_failure_reopens():
    clock = Clock()
    b = Breaker(2, 10.0, clock)
    assert b.allow() and not b.failure() and b.failure()  # the second failure in a row opens it
    assert b.state == "open" and not b.allow()
    clock.t = 10.0
    assert b.allow() and not b.allow()  # one trial at a time
    assert b.failure() and b.state == "open"  # the trial failed: open for another cooldown
    clock.t = 20.0
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.allow()


class StuckClient:
    """A client whose every call hangs until ``release`` is set: I/O threads stuck in calls the
    tier abandoned at its deadline (a frozen cluster's client can hang far longer than the
    deadline; a real server cannot be made to hold a socket for exactly as long as a test needs)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def pipeline(self, transaction: bool = False) -> "StuckClient":
        return self

    def exists(self, name: str) -> None:
        pass

    def execute(self) -> list:
        self.release.wait(30)
        raise ConnectionError("abandoned")

    def close(self) -> None:
        pass


def test_a_trial_that_finds_every_io_thread_stuck_does_not_hold_the_breaker_half_open(server):
    clock = Clock()
    t = tier(server, clock=clock, timeout=0.1, breaker_failures=IO_THREADS, breaker_cooldown=5.0)
    stuck = t._client = StuckClient()
    for _ in range(IO_THREADS):  # each call misses its deadline and leaves its thread stuck
        assert t.probe(LAYOUT, hashes(chunks(1))) == 0
    assert t.stats.deadline_missed == IO_THREADS and t.breaker.state == "open"
    clock.t += 5.0
    assert t.probe(LAYOUT, hashes(chunks(1))) == 0  # the half-open trial: no thread free
    assert t.stats.skipped_busy == 1
    stuck.release.set()  # the abandoned calls end; their threads come back
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and t._io_free._value < IO_THREADS:
        time.sleep(0.01)
    cs = chunks(2)
    assert t.publish(cs)  # the next call is the trial (on a fresh client): it succeeds
    assert t.breaker.state == "closed" and t.probe(LAYOUT, hashes(cs)) == 2
    t.close()


def test_acl_keeps_each_domain_to_its_prefix(server):
    for user, domain in (("dom-a", "a"), ("dom-b", "b")):
        cli(server.port, "ACL", "SETUSER", user, "on", f">pw-{user}", "resetkeys", f"~kvc:{domain}:*", "+@all")
    a = tier(server, domain="a", username="dom-a", password="pw-dom-a")
    cs = chunks(2)
    assert a.publish(cs) and a.fetch(LAYOUT, hashes(cs), CHUNK)
    # domain b's user cannot read or write domain a's keys: Redis says NOPERM
    rb = redis.Redis(port=server.port, username="dom-b", password="pw-dom-b")
    with pytest.raises(redis.exceptions.NoPermissionError):
        rb.get(remote_key("a", LAYOUT, cs[0][0].chunk_hash))
    with pytest.raises(redis.exceptions.NoPermissionError):
        rb.set(remote_key("a", LAYOUT, cs[0][0].chunk_hash), b"x")
    # a tier of domain a run with b's credentials gets nothing, and fails open
    wrong = RemoteRedisTier(RemoteConfig(nodes=(f"127.0.0.1:{server.port}",), domain="a", username="dom-b",
                                         password="pw-dom-b"), KEY)
    assert wrong.fetch(LAYOUT, hashes(cs), CHUNK) == [] and wrong.stats.errors == 1
    a.close(), wrong.close()


def test_two_hosts_share_chunks_through_a_cluster(tmp_path):
    require_redis()
    cluster = RedisCluster(str(tmp_path / "cluster")).start()
    try:
        nodes = tuple(f"{h}:{p}" for h, p in cluster.startup_nodes)
        host_a = RemoteRedisTier(RemoteConfig(nodes=nodes[:2], domain="d", cluster=True), KEY)
        host_b = RemoteRedisTier(RemoteConfig(nodes=nodes[3:], domain="d", cluster=True), KEY)
        cs = chunks(32)
        assert host_a.publish(cs)
        assert host_b.probe(LAYOUT, hashes(cs)) == 32
        assert [bytes(g) for g in host_b.fetch(LAYOUT, hashes(cs), CHUNK)] == [p for _, p in cs]
        other = RemoteRedisTier(RemoteConfig(nodes=nodes, domain="d", cluster=True), mac_key(b"another domain key"))
        assert other.fetch(LAYOUT, hashes(cs), CHUNK) == [] and other.stats.refused == {"mac": 1}
        for t in (host_a, host_b, other):
            t.close()
    finally:
        cluster.stop()


def test_a_full_redis_refuses_writes_and_reads_still_work(server):
    t = tier(server, timeout=0.5)
    kept = chunks(2)
    assert t.publish(kept)
    cli(server.port, "CONFIG", "SET", "maxmemory-policy", "noeviction")
    cli(server.port, "CONFIG", "SET", "maxmemory", "1")  # full: every write is refused with OOM
    assert t.publish(chunks(2)) is False and t.stats.errors == 1  # counted, not raised
    assert len(t.fetch(LAYOUT, hashes(kept), CHUNK)) == 2  # what it holds is still served
    t.close()


class SilentOrGarbled:
    """A TCP server on loopback that accepts connections and then says nothing (a hung Redis), or
    answers every request with bytes that are not RESP (something else on the port)."""

    def __init__(self, reply: bytes | None) -> None:
        import socket
        import threading

        self.reply = reply
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns: list = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import threading

        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            if self.reply is not None:
                threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn) -> None:
        try:
            while conn.recv(65536):
                conn.sendall(self.reply)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.mark.parametrize("reply", [None, b"HTTP/1.1 400 Bad Request\r\n\r\n", b"\x00\xff garbage \x13\r\n"],
                         ids=["hung", "http", "garbage"])
def test_a_hung_or_garbled_server_is_a_bounded_miss(reply):
    srv = SilentOrGarbled(reply)
    try:
        cfg = RemoteConfig(nodes=(f"127.0.0.1:{srv.port}",), domain="d", timeout=0.3, breaker_failures=2)
        t = RemoteRedisTier(cfg, KEY)
        cs = chunks(2)
        t0 = time.monotonic()
        assert t.fetch(LAYOUT, hashes(cs), CHUNK) == []
        assert t.probe(LAYOUT, hashes(cs)) == 0
        assert t.publish(cs) is False  # the breaker is open by now: not even tried
        assert time.monotonic() - t0 < 2 * 0.3 + 0.5  # each call at most one timeout
        assert t.stats.errors == 2 and t.breaker.state == "open" and t.stats.skipped_open == 1
        t.close()
    finally:
        srv.close()
