"""Two stores ("host A", "host B": separate state dirs and pools, the same domain key) sharing a
real redis-server: what A commits, B acquires with identical bytes, from the remote first and
from its own tiers after; different keys never match; a dead Redis is a miss, never an error."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from kvcached.config import StoreConfig
from kvcached.store import Store
from kvcached.contract.record import HEADER_SIZE
from kvcached.tiers.remote_redis import RemoteConfig
from tests.conftest import TINY, payload, prompt
from bench.harness.redis_servers import RedisServer

CT = TINY.chunk_tokens


@pytest.fixture
def server(redis_server):
    return redis_server


def host(tmp_path, name: str, srv: RedisServer, key_from: str | None = None, *, pool_chunks: int = 16,
         nvme_chunks: int = 64, remote_kw: dict | None = None, **kw) -> Store:
    state = str(tmp_path / name)
    if key_from is not None:  # the same domain key file on every host of the domain
        os.makedirs(state, exist_ok=True)
        shutil.copy(os.path.join(key_from, "hash.key"), os.path.join(state, "hash.key"))
    cfg = StoreConfig(state_dir=state, pool_bytes=TINY.chunk_bytes * pool_chunks,
                      nvme_bytes=(TINY.chunk_bytes + HEADER_SIZE) * nvme_chunks, writeback=False,
                      remote=RemoteConfig(nodes=(f"127.0.0.1:{srv.port}",), domain="ignored", timeout=0.3,
                                          **(remote_kw or {})), **kw)
    return Store(cfg)


def test_a_chunk_stored_on_host_a_is_served_on_host_b(tmp_path, server):
    a = host(tmp_path, "a", server)
    b = host(tmp_path, "b", server, key_from=a.config.state_dir)
    try:
        toks = prompt(4)
        lid = a.register_layout(TINY)
        assert b.register_layout(TINY) == lid
        a.put(lid, toks, [payload(i) for i in range(4)])
        assert a.publisher is not None
        a.publisher.drain()  # the background thread may have sent some already
        assert a.remote.stats.published == 4
        lease = b.acquire(lid, toks)
        assert lease.matched_tokens == 4 * CT
        assert [bytes(b.pool.read(c.chunk_hash)) for c in lease.chunks] == [payload(i) for i in range(4)]
        b.release(lease.lease_id)
        assert b.stats().counters.remote_filled_chunks == 4 and b.remote.stats.hits == 4
        assert b.stats().counters.hit_tokens >= 4 * CT  # B's own hit counters say so
        assert len(b.publisher) == 0  # fetched chunks are not published back
        lease = b.acquire(lid, toks)  # now from B's own tiers: no remote round trip
        assert lease.matched_tokens == 4 * CT and b.remote.stats.hits == 4
        b.release(lease.lease_id)
        b.index.check_invariants()
    finally:
        a.close(), b.close()


def test_hosts_with_different_domain_keys_never_match(tmp_path, server):
    a = host(tmp_path, "a", server)
    b = host(tmp_path, "b", server)  # its own generated key
    try:
        lid = a.register_layout(TINY)
        b.register_layout(TINY)
        a.put(lid, prompt(3), [payload(i) for i in range(3)])
        a.publisher.drain()
        lease = b.acquire(lid, prompt(3))
        assert lease.matched_tokens == 0 and b.stats().counters.remote_filled_chunks == 0
    finally:
        a.close(), b.close()


def test_a_dead_redis_is_a_miss_never_an_error(tmp_path, server):
    a = host(tmp_path, "a", server)
    try:
        lid = a.register_layout(TINY)
        server.kill()
        a.put(lid, prompt(2), [payload(i) for i in range(2)])  # committing still works
        a.publisher.drain()
        assert a.remote.stats.published == 0  # nothing could be published, nothing raised
        lease = a.acquire(lid, prompt(4))  # 2 cached here, the rest looked for remotely: a miss
        assert lease.matched_tokens == 2 * CT
        a.release(lease.lease_id)
        assert a.remote.stats.errors >= 1
    finally:
        a.close()


def test_daemon_settings_make_the_remote_config(tmp_path):
    from kvcached.settings import SettingsError, load_settings

    pw = tmp_path / "redis.pw"
    pw.write_text("s3cret\n")
    pw.chmod(0o600)
    s = load_settings(None, {"state_dir": str(tmp_path), "domain": "tenant-a", "remote_nodes": "10.0.0.1:7000, 10.0.0.2:7001",
                             "remote_cluster": True, "remote_username": "kvc-a", "remote_password_file": str(pw)})
    cfg = s.store_config(1 << 20)
    r = cfg.remote
    assert r.nodes == ("10.0.0.1:7000", "10.0.0.2:7001") and r.cluster and r.domain == "tenant-a"
    assert (r.username, r.password, r.ttl) == ("kvc-a", "s3cret", s.cache_ttl)  # the TTL defaults to cache_ttl
    assert cfg.remote_write == "async"
    assert load_settings(None, {"state_dir": str(tmp_path)}).store_config(1 << 20).remote is None  # off by default
    pw.chmod(0o644)
    with pytest.raises(SettingsError, match="readable by others"):
        s.store_config(1 << 20)
    with pytest.raises(SettingsError, match="host:port"):
        load_settings(None, {"state_dir": str(tmp_path), "remote_nodes": "no-port"}).store_config(1 << 20)
    with pytest.raises((SettingsError, ValueError)):
        load_settings(None, {"state_dir": str(tmp_path), "remote_nodes": "h:1", "remote_write": "sometimes"}
                      ).store_config(1 << 20)


def test_stats_and_metrics_report_the_remote_tier(tmp_path, server):
    from prometheus_client import CollectorRegistry

    from kvcached.metrics import StoreCollector

    a = host(tmp_path, "a", server)
    b = host(tmp_path, "b", server, key_from=a.config.state_dir)
    try:
        lid = a.register_layout(TINY)
        b.register_layout(TINY)
        a.put(lid, prompt(3), [payload(i) for i in range(3)])
        a.publisher.drain()
        b.release(b.acquire(lid, prompt(3)).lease_id)
        rs = b.stats().remote
        assert (rs.hits, rs.breaker_state, rs.queue_depth) == (3, "closed", 0)
        assert b.stats().to_dict()["remote"]["hits"] == 3
        reg = CollectorRegistry()
        reg.register(StoreCollector(b))
        v = reg.get_sample_value
        d = {"domain": "default"}
        assert v("kvcached_remote_hits_total", d) == 3
        assert v("kvcached_remote_fetched_bytes_total", d) == 3 * TINY.chunk_bytes
        assert v("kvcached_remote_breaker_state", {**d, "state": "closed"}) == 1
        assert v("kvcached_remote_refused_total", {**d, "reason": "mac"}) == 0
        assert a.stats().remote.published == 3
    finally:
        a.close(), b.close()


def test_hosts_configured_with_one_shared_key_file_match(tmp_path, server):
    from kvcached.contract.keys import write_new_key

    key = str(tmp_path / "domain.key")
    write_new_key(key)  # `kvcachectl keygen`, then the same file on every host
    a = host(tmp_path, "a", server, hash_key_file=key)
    b = host(tmp_path, "b", server, hash_key_file=key)
    try:
        lid = a.register_layout(TINY)
        b.register_layout(TINY)
        a.put(lid, prompt(3), [payload(i) for i in range(3)])
        a.publisher.drain()
        lease = b.acquire(lid, prompt(3))
        assert lease.matched_tokens == 3 * CT
        b.release(lease.lease_id)
        assert not os.path.exists(os.path.join(a.config.state_dir, "hash.key"))  # no key of its own made
    finally:
        a.close(), b.close()


@pytest.mark.parametrize("nvme_chunks", [0, 6], ids=["pool-only", "with-nvme"])
def test_chunks_pushed_out_of_the_last_local_tier_are_demoted_to_the_remote(tmp_path, server, nvme_chunks):
    """remote_write = "on_evict": nothing is published at commit; a chunk that capacity pushes out
    of this host's last tier (the pool without NVMe, else NVMe) is sent then, and found again,
    here and on another host."""
    a = host(tmp_path, "a", server, pool_chunks=4, nvme_chunks=nvme_chunks, remote_write="on_evict")
    b = host(tmp_path, "b", server, key_from=a.config.state_dir)
    try:
        lid = a.register_layout(TINY)
        b.register_layout(TINY)
        first = prompt(4)
        a.put(lid, first, [payload(i) for i in range(4)])
        a.publisher.drain()
        assert a.remote.stats.published == 0 and a.remote.stats.demoted == 0  # on_evict: nothing yet
        for k in range(1, 4):  # other prompts push the first one out of the pool, then out of NVMe
            a.put(lid, prompt(4, start=1000 * k), [payload(i, salt=k) for i in range(4)])
        assert a.lookup(lid, first) == 0  # gone from every local tier of A
        a.publisher.drain()
        rs = a.stats().remote
        assert rs.demoted >= 4 and rs.queue_depth == 0 and rs.queue_bytes == 0
        lease = b.acquire(lid, first)  # another host finds it
        assert lease.matched_tokens == 4 * CT
        assert [bytes(b.pool.read(c.chunk_hash)) for c in lease.chunks] == [payload(i) for i in range(4)]
        b.release(lease.lease_id)
        lease = a.acquire(lid, first)  # and so does A itself
        assert lease.matched_tokens == 4 * CT and a.stats().counters.remote_filled_chunks == 4
        a.release(lease.lease_id)
        a.index.check_invariants()
    finally:
        a.close(), b.close()


def test_demoting_a_chunk_the_remote_already_holds_only_renews_its_ttl(tmp_path, server):
    import redis

    a = host(tmp_path, "a", server, pool_chunks=4, nvme_chunks=0)  # async: published at commit
    try:
        lid = a.register_layout(TINY)
        a.put(lid, prompt(4), [payload(i) for i in range(4)])
        a.publisher.drain()
        assert a.remote.stats.published == 4
        r = redis.Redis(port=server.port)
        keys = sorted(r.keys("kvc:default:*"))
        assert len(keys) == 4
        for k in keys:
            r.expire(k, 100)  # much less than the tier's TTL (cache_ttl)
        sent = a.remote.stats.bytes_published
        a.put(lid, prompt(4, start=5000), [payload(i, salt=9) for i in range(4)])  # evicts the first 4
        a.publisher.drain()
        rs = a.stats().remote
        assert (rs.refreshed, rs.demoted) == (4, 0)
        assert a.remote.stats.bytes_published == sent + sum(len(v) for v in [r.get(k) for k in sorted(
            r.keys("kvc:default:*")) if k not in keys])  # only the new prompt's values were sent
        assert all(r.ttl(k) > 1000 for k in keys)  # renewed to the full TTL
    finally:
        a.close()


def test_the_publisher_holds_its_queue_while_redis_is_down_and_resumes(tmp_path, server):
    a = host(tmp_path, "a", server, nvme_chunks=256, remote_queue_chunks=8)  # no NVMe evictions: no demotions
    try:
        lid = a.register_layout(TINY)
        server.kill()
        k, deadline = 0, time.monotonic() + 20
        while a.remote.breaker.state == "closed" and time.monotonic() < deadline:  # a few batches fail
            a.put(lid, prompt(4, start=100 * k), [payload(i, salt=k) for i in range(4)])
            k += 1
            time.sleep(0.05)
        assert a.remote.breaker.state == "open"
        dropped = a.stats().remote.queue_dropped
        for j in range(6):  # 24 chunks while the breaker is open: held, the newest 8 kept
            a.put(lid, prompt(4, start=100 * (k + j)), [payload(i, salt=k + j) for i in range(4)])
        rs = a.stats().remote
        assert rs.queue_depth == 8 and rs.queue_dropped - dropped >= 16 and rs.published == 0
        server.start()
        deadline = time.monotonic() + 20
        while a.stats().remote.published < 8 and time.monotonic() < deadline:
            time.sleep(0.1)  # the thread waits out the breaker's cooldown, then resumes
        rs = a.stats().remote
        assert rs.published >= 8 and rs.breaker_state == "closed" and rs.queue_depth == 0
    finally:
        a.close()


def test_doctor_judges_reachability_acl_and_memory_policy(tmp_path, server):
    from kvcachectl.doctor import doctor_checks
    from bench.harness.redis_servers import cli

    def remote_verdicts(store: Store) -> dict[str, str]:
        s = store.stats().to_dict()
        s.update(doctor=store.doctor_facts(), leases_active=0)
        return {c["check"]: (c["verdict"], c["detail"]) for c in doctor_checks(s) if c["check"].startswith("remote")}

    cli(server.port, "ACL", "SETUSER", "kvc-default", "on", ">pw", "resetkeys", "~kvc:default:*", "-@all",
        "+get", "+set", "+exists", "+expire", "+ping")
    cli(server.port, "CONFIG", "SET", "maxmemory-policy", "noeviction")
    open_ = host(tmp_path, "a", server)  # the default user: no isolation
    locked = host(tmp_path, "b", server, remote_kw={"username": "kvc-default", "password": "pw"})
    try:
        v = remote_verdicts(open_)
        assert v["remote tier"][0] == "ok" and v["remote ACL"][0] == "warn" and "default user" in v["remote ACL"][1]
        assert v["remote memory"][0] == "warn" and "noeviction" in v["remote memory"][1]
        v = remote_verdicts(locked)
        assert v["remote ACL"][0] == "ok"  # NOPERM outside kvc:default:*
        assert v["remote memory"][0] == "ok" and "not visible" in v["remote memory"][1]  # no +info granted
        cli(server.port, "CONFIG", "SET", "maxmemory", "64mb")
        cli(server.port, "CONFIG", "SET", "maxmemory-policy", "volatile-lru")
        assert remote_verdicts(open_)["remote memory"][0] == "ok"
        cli(server.port, "ACL", "SETUSER", "kvc-default", "resetkeys", "~other:*")  # misconfigured: not its prefix
        assert remote_verdicts(locked)["remote ACL"][0] == "fail"
        server.kill()
        v = remote_verdicts(open_)
        assert v["remote tier"][0] == "fail" and "not reachable" in v["remote tier"][1] and len(v) == 1
    finally:
        open_.close(), locked.close()


def test_a_long_prompt_is_fetched_in_windows(tmp_path, server, monkeypatch):
    import kvcached.remotefill as fill_mod

    monkeypatch.setattr(fill_mod, "FETCH_WINDOW_BYTES", 3 * TINY.chunk_bytes)  # 3 chunks a window
    a = host(tmp_path, "a", server, pool_chunks=32)
    b = host(tmp_path, "b", server, key_from=a.config.state_dir, pool_chunks=32)
    try:
        lid = a.register_layout(TINY)
        b.register_layout(TINY)
        a.put(lid, prompt(8), [payload(i) for i in range(8)])
        a.publisher.drain()
        calls = []
        fetch = b.remote.fetch_into
        monkeypatch.setattr(b.remote, "fetch_into", lambda *a_, **k: calls.append(len(a_[1])) or fetch(*a_, **k))
        lease = b.acquire(lid, prompt(10))  # 8 there, 2 more asked for
        assert lease.matched_tokens == 8 * CT
        assert [bytes(b.pool.read(c.chunk_hash)) for c in lease.chunks] == [payload(i) for i in range(8)]
        b.release(lease.lease_id)
        assert calls == [3, 3, 3]  # the third window found 2 of its 3 (chunk 8 is not there): no fourth
    finally:
        a.close(), b.close()


def test_a_worker_threads_acquire_is_not_refused_while_the_event_loop_runs_inline(tmp_path, server):
    """The remote fill is decided before the store lock is taken. While another thread (the
    event loop) sits inside run_inline, a worker thread's acquire must still fetch from the
    remote, not raise WouldBlock (which only the inline caller can handle: seen once in CI as
    an 'Unexpected WouldBlock' error answered to a client while Redis came back)."""
    import threading

    a = host(tmp_path, "a", server)
    b = host(tmp_path, "b", server, key_from=a.config.state_dir)
    try:
        lid = a.register_layout(TINY)
        b.register_layout(TINY)
        a.put(lid, prompt(3), [payload(i) for i in range(3)])
        a.publisher.drain()
        inside, leave = threading.Event(), threading.Event()

        def inline_work() -> None:
            inside.set()
            leave.wait(10)

        loop = threading.Thread(target=b.run_inline, args=(inline_work,))
        loop.start()
        try:
            assert inside.wait(10)
            result: dict = {}

            def worker() -> None:
                try:
                    result["lease"] = b.acquire(lid, prompt(3))
                except BaseException as e:  # noqa: BLE001 - reported below
                    result["error"] = e

            w = threading.Thread(target=worker)
            w.start()
            time.sleep(0.3)  # the worker's remote fill runs now, before it waits for the lock
            leave.set()
            w.join(10)
        finally:
            leave.set()
            loop.join(10)
        assert "error" not in result, repr(result.get("error"))
        assert result["lease"].matched_tokens == 3 * CT
        assert b.stats().counters.remote_filled_chunks == 3
    finally:
        a.close(), b.close()


def test_a_chunk_over_the_remote_value_limit_is_refused_there_and_served_here(tmp_path):
    """Redis refuses a value over its proto-max-bulk-len (1 MiB here, the least it allows): a chunk
    of exactly 1 MiB (its record adds a header and MAC) cannot be published. Nothing fails: the
    host serves it from its own tiers, the publish counts an error, and a chunk just under the
    limit (512 KiB) still goes there and is served to another host, verified."""
    from kvcached.contract.keys import KVLayout
    from bench.harness.redis_servers import free_ports
    from tests.requirements import require_redis

    require_redis()
    srv = RedisServer(free_ports(1)[0], str(tmp_path / "redis"), extra=["--proto-max-bulk-len", "1mb"]).start()
    big = KVLayout("test/big@1", num_layers=1, num_kv_heads=8, head_dim=64, dtype="float32", chunk_tokens=256)
    small = KVLayout("test/small@1", num_layers=1, num_kv_heads=8, head_dim=64, dtype="float32", chunk_tokens=128)
    assert big.chunk_bytes == 1 << 20 and small.chunk_bytes == 1 << 19

    def mk(name: str, key_from: str | None = None) -> Store:
        state = str(tmp_path / name)
        if key_from is not None:
            os.makedirs(state, exist_ok=True)
            shutil.copy(os.path.join(key_from, "hash.key"), os.path.join(state, "hash.key"))
        return Store(StoreConfig(state_dir=state, pool_bytes=8 << 20, nvme_bytes=0, writeback=False,
                                 remote=RemoteConfig(nodes=(f"127.0.0.1:{srv.port}",), domain="d", timeout=2.0,
                                                     breaker_failures=100)))

    a = mk("a")
    b = mk("b", key_from=a.config.state_dir)
    try:
        for layout, n in ((big, 2), (small, 2)):
            lid = a.register_layout(layout)
            b.register_layout(layout)
            toks = list(range(n * layout.chunk_tokens))
            data = [bytes([i + 1]) * layout.chunk_bytes for i in range(n)]
            a.put(lid, toks, data)
            a.publisher.drain()
            lease = a.acquire(lid, toks)  # the host that has it serves it whatever the remote did
            assert lease.matched_tokens == len(toks)
            assert [bytes(a.pool.read(c.chunk_hash)) for c in lease.chunks] == data
            a.release(lease.lease_id)
            lease = b.acquire(lid, toks)
            got = [bytes(b.pool.read(c.chunk_hash)) for c in lease.chunks]
            b.release(lease.lease_id)
            if layout is big:
                assert got == [] and a.stats().remote.errors >= 1  # refused by Redis: counted, not served
            else:
                assert got == data  # under the limit: shared and verified
    finally:
        a.close(), b.close()
        srv.stop()
