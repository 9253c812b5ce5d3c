"""The daemon as a process: clients in other processes, restarts, crashes, TTLs."""

from __future__ import annotations

import dataclasses
import json
import tomllib
import os
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch

from kvcached.contract.keys import KVLayout
from kvcached_client import Client, FailedPreconditionError
from tests.service.conftest import LAYOUT, run_py

CT = LAYOUT.chunk_tokens

_WRITER = r"""
import sys, torch
from kvcached_client import Client
from tests.service.conftest import LAYOUT
sock, n = sys.argv[1], int(sys.argv[2])
g = torch.Generator().manual_seed(7)
kv = torch.randn(2, LAYOUT.num_layers, LAYOUT.num_kv_heads, n, LAYOUT.head_dim, generator=g)
with Client(sock) as c:
    print(c.put(LAYOUT, list(range(n)), kv).stored_chunks)
torch.save(kv, sys.argv[3])
"""

_READER = r"""
import sys, json, torch
from kvcached_client import Client
from tests.service.conftest import LAYOUT
sock, tokens = sys.argv[1], json.loads(sys.argv[2])
with Client(sock) as c:
    with c.acquire(LAYOUT, tokens) as lease:
        torch.save(lease.kv().clone(), sys.argv[3])
        print(lease.matched_tokens)
"""


def _env_ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.strip()


def test_two_client_processes_share_chunks(daemon, tmp_path):
    n = 4 * CT + 5
    assert _env_ok(run_py(_WRITER, daemon.socket, str(n), str(tmp_path / "kv.pt"))) == "4"
    kv = torch.load(tmp_path / "kv.pt")
    out = _env_ok(run_py(_READER, daemon.socket, json.dumps(list(range(n))), str(tmp_path / "got.pt")))
    assert out == str(4 * CT)
    assert torch.equal(torch.load(tmp_path / "got.pt"), kv[:, :, :, : 4 * CT])  # bit-exact
    half = list(range(2 * CT)) + [10_000 + i for i in range(2 * CT)]  # shares only the first half
    out = _env_ok(run_py(_READER, daemon.socket, json.dumps(half), str(tmp_path / "half.pt")))
    assert out == str(2 * CT)
    assert torch.equal(torch.load(tmp_path / "half.pt"), kv[:, :, :, : 2 * CT])


def test_restart_finds_nvme_chunks_and_the_client_remaps(daemon, tmp_path):
    kv = torch.randn(2, 2, 2, 3 * CT, 8)
    toks = list(range(3 * CT))
    with Client(daemon.socket) as c:
        assert c.put(LAYOUT, toks, kv).stored_chunks == 3
        with c.acquire(LAYOUT, toks) as lease:
            first_gen = c._pool.generation
            assert lease.matched_tokens == 3 * CT
        assert daemon.stop() == 0  # SIGTERM writes pool-only chunks to NVMe
        daemon.start()
        with c.acquire(LAYOUT, toks) as lease:  # same client object: reconnects, new session, new pool
            assert lease.matched_tokens == 3 * CT
            assert torch.equal(lease.kv(), kv)
        assert c._pool.generation != first_gen and c.pool_maps == 2
    assert "index rebuilt" in daemon.log()


def test_a_clean_stop_does_not_wait_out_its_grace_for_an_idle_client(daemon):
    """A connected client's Session stream never ends by itself; the stop ends it (UNAVAILABLE)
    instead of letting the drain wait its whole 5 s grace (it took 5.6 s), and the client's
    next call after the restart opens a new session."""
    toks = list(range(2 * CT))
    kv = torch.randn(2, 2, 2, 2 * CT, 8)
    with Client(daemon.socket) as c:
        c.put(LAYOUT, toks, kv)
        c.acquire(LAYOUT, toks).release()  # an open session, idle
        t0 = time.monotonic()
        assert daemon.stop() == 0
        took = time.monotonic() - t0
        assert took < 3.0, f"the stop took {took:.2f} s"
        assert "ended: released" in daemon.log()
        daemon.start()
        with c.acquire(LAYOUT, toks) as lease:
            assert torch.equal(lease.kv(), kv)


def test_pool_is_mapped_once_per_generation(daemon):
    kv = torch.randn(2, 2, 2, 2 * CT, 8)
    with Client(daemon.socket) as c:
        c.put(LAYOUT, list(range(2 * CT)), kv)
        for _ in range(5):
            with c.acquire(LAYOUT, list(range(2 * CT))) as lease:
                lease.chunk(1)
        assert c.pool_maps == 1


_HOLDER = r"""
import sys, time, torch
from kvcached_client import Client
from tests.service.conftest import LAYOUT
from kvcached.v1 import kvcached_pb2 as pb
c = Client(sys.argv[1])
toks = list(range(4 * 16))
c.put(LAYOUT, toks, torch.zeros(2, 2, 2, 64, 8))
leases = [c.acquire(LAYOUT, toks, ttl=3600) for _ in range(3)]
lid = c.register(LAYOUT)
r = c._stub.Reserve(pb.ReserveRequest(layout_id=lid, tokens=bytes(range(256)) * 4, session_id=c.session_id(), ttl_seconds=3600))
print(len(r.slots.offsets), flush=True)
time.sleep(600)
"""


def test_sigkilled_client_leaks_nothing(daemon):
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, daemon.socket], stdout=subprocess.PIPE, text=True)
    reserved = int(p.stdout.readline())
    assert reserved > 0
    with Client(daemon.socket, session=False) as c:
        s = c.stats()
        assert s["leases_active"] == 3 and s["reservations_active"] == 1
        assert s["pool"]["leased_chunks"] == 4 and s["pool"]["reserved_chunks"] == reserved
        p.kill()  # SIGKILL: no goodbye
        p.wait()
        p.stdout.close()
        wait_until(lambda: "released 3 leases, aborted 1 reservations" in daemon.log())  # logged once released
        s = c.stats()
        assert s["leases_active"] == 0 and s["reservations_active"] == 0 and s["sessions_open"] == 0
        assert s["pool"]["reserved_chunks"] == 0 and s["pool"]["leased_chunks"] == 0
        chunks, _ = c.evict()
        assert chunks == 4
        p2 = c.stats()["pool"]
        assert p2["free_bytes"] == p2["capacity_bytes"]  # fully reclaimable


def wait_until(pred, timeout: float = 30.0) -> None:
    """Wait for a state, not for a time: generous, since a busy 2-core box stalls for seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"not within {timeout} s"
        time.sleep(0.02)


def test_lease_ttl_expiry_and_keep_alive(make_daemon):
    """Two leases with the same 2 s TTL, taken back to back; one is kept alive (with a TTL long
    enough that no stall of the box can let it lapse), the other is not. The one not kept alive
    expires by its TTL, the kept one outlives it."""
    d = make_daemon(lease_ttl=2.0)
    with Client(d.socket) as c:
        c.put(LAYOUT, list(range(CT)), torch.zeros(2, 2, 2, CT, 8))
        lost = c.acquire(LAYOUT, list(range(CT)))
        kept = c.acquire(LAYOUT, list(range(CT)))
        # the daemon's lease_ttl, less what each reply took to build (so not ordered between the two)
        assert 0 < lost.ttl_seconds <= 2.0 and 0 < kept.ttl_seconds <= 2.0
        assert 30 < kept.keep_alive(60) <= 60  # taken after lost: without this it would expire no earlier
        wait_until(lambda: c.stats()["counters"]["leases_expired"] == 1)
        assert c.stats()["leases_active"] == 1  # only the one kept alive
        with pytest.raises(FailedPreconditionError, match="expired"):
            lost.keep_alive()
        assert 30 < kept.keep_alive(60) <= 60  # still live, still renewable
        kept.release()
        c.sync()  # the release went on the session stream: wait until the daemon has done it
        s = c.stats()
        assert s["leases_active"] == 0 and s["counters"]["leases_expired"] == 1


def test_sigkill_leaves_no_pool_segment_behind(make_daemon, tmp_path):
    """A SIGKILLed daemon cannot unlink its pool segments; Daemon.stop does it once the process is
    dead (else /dev/shm keeps them until reboot). One segment per trust domain."""
    from bench.harness.daemon import SHM_DIR, pool_segments

    d = make_daemon(domains={"tenant_b": {"socket": str(tmp_path / "b.sock"), "pool_bytes": "1M"}})
    with Client(d.socket) as c:
        assert c.pool_handle().name in d.segments
    assert len(d.segments) == 2, d.log()  # announced by both domains
    pid = d.proc.pid
    assert pool_segments(pid) == d.segments and all(os.path.exists(os.path.join(SHM_DIR, n)) for n in d.segments)
    assert d.stop(signal.SIGKILL) == -signal.SIGKILL
    assert pool_segments(pid) == set()


def test_socket_mode_and_clean_shutdown(daemon):
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o660
    pool = [line for line in daemon.log().splitlines() if "pool: host shared memory" in line][0]
    shm = pool.split("memory ")[1].split(",")[0]
    assert os.path.exists(shm)
    assert daemon.stop() == 0
    assert not os.path.exists(daemon.socket) and not os.path.exists(shm)
    assert "stopped" in daemon.log()


def test_second_daemon_on_same_socket_is_refused(daemon):
    r = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "kvcached"), "serve", "--socket", daemon.socket,
         "--state-dir", daemon.state_dir + "2", "--pool-bytes", "1M", "--nvme-bytes", "0"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 1 and "already served" in r.stderr


def test_sighup_reloads_reloadable_settings(make_daemon):
    d = make_daemon(lease_ttl=30.0, eviction_policy="frequency")  # the policy whose weight is a setting
    d.settings["lease_ttl"] = 5.0
    d.settings["eviction_weight"] = 2.5
    d.settings["pool_bytes"] = "8M"
    d.write_config()
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "reloaded" not in d.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "reloaded: eviction_weight, lease_ttl" in d.log()
    assert "pool_bytes need a restart" in d.log()
    with Client(d.socket) as c:
        c.put(LAYOUT, list(range(CT)), torch.zeros(2, 2, 2, CT, 8))
        with c.acquire(LAYOUT, list(range(CT))) as lease:
            assert 4.0 < lease.keep_alive() <= 5.0
        assert c.stats()["eviction"]["weight"] == 2.5


def test_kvcachectl_against_a_daemon(daemon):
    def ctl(*args, stdin=None):
        exe = os.path.join(os.path.dirname(sys.executable), "kvcachectl")
        return subprocess.run([exe, "--socket", daemon.socket, *args], input=stdin, capture_output=True, text=True,
                              timeout=60)

    with Client(daemon.socket) as c:
        c.put(LAYOUT, list(range(3 * CT)), torch.zeros(2, 2, 2, 3 * CT, 8))
    r = ctl("status")
    assert r.returncode == 0 and "3 indexed in 1 layouts" in r.stdout
    s = json.loads(ctl("stats", "--json").stdout)
    assert s["indexed_chunks"] == 3 and s["pool"]["cached_chunks"] == 3
    assert s["eviction"]["policy"] == "adaptive" and s["eviction"]["admission"] == "always"
    assert s["hash_memo"]["hashed_chunks"] == 3 and s["hash_memo"]["runs"] == 1  # the put hashed its prompt once
    r = ctl("stats")
    assert "hash_memo.memo_chunks" in r.stdout and "pool.cached_chunks" in r.stdout
    r = ctl("lookup", "--json", stdin=" ".join(map(str, range(2 * CT + 3))))
    assert json.loads(r.stdout)["cached_tokens"] == 2 * CT
    lid = next(iter(s["layouts_detail"]))
    with Client(daemon.socket) as c:  # a second layout: lookup answers for each, naming it by its model
        c.register(dataclasses.replace(LAYOUT, model="other-model@rev", extra=(("tp", "1/2"),)))
    r = ctl("lookup", stdin=" ".join(map(str, range(2 * CT + 3))))
    assert r.returncode == 0, r.stderr
    assert f"{lid} ({LAYOUT.model})" in r.stdout and "(other-model@rev, tp 1/2)" in r.stdout, r.stdout
    assert f"{2 * CT} of {2 * CT + 3} tokens cached" in r.stdout and f"0 of {2 * CT + 3} tokens cached" in r.stdout
    r = ctl("lookup", "--json", stdin="1 2 3")
    assert len(json.loads(r.stdout)["layouts"]) == 2
    r = ctl("lookup", "--layout-id", "nope", stdin="1 2 3")
    assert r.returncode != 0 and "unknown layout id nope" in r.stderr
    r = ctl("layout")  # the router's [layout] table: which one, when there are two
    assert r.returncode != 0 and "2 layouts are registered" in r.stderr and "(other-model@rev, tp 1/2)" in r.stderr
    r = ctl("layout", "--layout-id", lid)
    assert r.returncode == 0, r.stderr
    assert KVLayout.from_dict(tomllib.loads(r.stdout)["layout"]) == LAYOUT  # exactly what the router needs
    r = ctl("evict", "--layout-id", lid, "--prefix", "-", "--json", stdin=" ".join(map(str, range(2 * CT))))
    assert json.loads(r.stdout)["chunks"] == 2  # chunks 1 and 2 (prompts starting with the first two chunks)
    assert json.loads(ctl("flush", "--json").stdout) == {"chunks": 1}
    assert json.loads(ctl("evict", "--json").stdout)["chunks"] == 1
    r = ctl("drain", "--json")
    assert json.loads(r.stdout)["leases_active"] == 0
    with Client(daemon.socket) as c:
        with pytest.raises(Exception, match="draining"):
            c.acquire(LAYOUT, list(range(CT)))


# -- NVMe-only chunks reaching a client ------------------------------------------------------
#: 128 KiB chunks in a 2 MiB pool of 16 blocks: the 15 chunks of FILLERS push the last two chunks
#: of PROMPT out of the pool, and write-back demotes them to NVMe (leaf-first: chunk 0 stays, so
#: a lease of PROMPT mixes both tiers).
FAT = KVLayout("test/fat@1", num_layers=4, num_kv_heads=4, head_dim=64, dtype="float32", chunk_tokens=16)
PROMPT = list(range(48))
FILLERS = [[1000 * (k + 1) + i for i in range(48)] for k in range(5)]


@pytest.fixture
def fat_daemon(make_daemon):
    # 16 FAT chunks; write-back off: these tests need to know exactly which chunks were demoted
    return make_daemon(pool_bytes="2M", writeback=False)


@pytest.fixture
def nvme_refused(monkeypatch):
    """As root every file is readable, so a permission failure on the NVMe tier is simulated."""
    import kvcached_client.nvme as nv
    from kvcached_client import PoolMappingError

    def refuse(path):
        raise PoolMappingError(f"cannot open the NVMe tier at {path}: Permission denied")

    monkeypatch.setattr(nv, "_acquire_env", refuse)


def demote_prompt(c: Client, a: torch.Tensor) -> None:
    c.put(FAT, PROMPT, a)
    for toks in FILLERS:
        c.put(FAT, toks, torch.zeros(2, 4, 4, 48, 64))
    assert c.stats()["counters"]["demotions"] == 2


async def demote_prompt_async(c, a: torch.Tensor) -> None:
    await c.put(FAT, PROMPT, a)
    for toks in FILLERS:
        await c.put(FAT, toks, torch.zeros(2, 4, 4, 48, 64))
    assert (await c.stats())["counters"]["demotions"] == 2


@pytest.mark.parametrize("mode", ["promote", "direct"])
def test_nvme_only_chunks_reach_the_client_both_ways(fat_daemon, mode):
    a = torch.randn(2, 4, 4, 48, 64)
    with Client(fat_daemon.socket, nvme_read=mode) as c:
        demote_prompt(c, a)
        with c.acquire(FAT, PROMPT) as lease:
            assert lease.matched_tokens == 48
            assert torch.equal(lease.kv(), a)
            out = torch.empty(FAT.chunk_shape)
            assert torch.equal(lease.copy_chunk(2, out), a[:, :, :, 32:48])  # one copy, into the caller's tensor
        with Client(fat_daemon.socket, nvme_read=mode) as c2:  # a second client in the same process shares the LMDB env
            with c2.acquire(FAT, PROMPT) as lease:
                assert torch.equal(lease.kv(), a)
        s = c.stats()
    assert (s["counters"]["promotions"] == 0) == (mode == "direct")  # direct: read from the LMDB file
    assert s["leases_active"] == 0


@pytest.mark.parametrize("mode", ["promote", "direct"])
def test_async_client_reads_nvme_only_chunks_both_ways(fat_daemon, mode):
    import asyncio

    from kvcached_client import AsyncClient

    a = torch.randn(2, 4, 4, 48, 64)

    async def main() -> dict:
        async with AsyncClient(fat_daemon.socket, nvme_read=mode) as c:
            await demote_prompt_async(c, a)
            async with await c.acquire(FAT, PROMPT) as lease:
                assert lease.matched_tokens == 48
                assert torch.equal(lease.kv(), a)
                out = torch.empty(FAT.chunk_shape)
                assert torch.equal(lease.copy_chunk(2, out), a[:, :, :, 32:48])
            return await c.stats()

    s = asyncio.run(main())
    assert (s["counters"]["promotions"] == 0) == (mode == "direct")
    assert s["leases_active"] == 0


def test_direct_nvme_read_falls_back_to_promotion_when_the_file_cannot_be_opened(fat_daemon, nvme_refused):
    a = torch.randn(2, 4, 4, 48, 64)
    with Client(fat_daemon.socket) as c:
        assert c.nvme_read == "direct"  # the measured default
        demote_prompt(c, a)
        with c.acquire(FAT, PROMPT) as lease:
            assert torch.equal(lease.kv(), a)
        assert c.nvme_read == "promote" and c.stats()["counters"]["promotions"] >= 2
        assert c.stats()["leases_active"] == 0


def test_async_client_falls_back_to_promotion_when_the_nvme_file_cannot_be_opened(fat_daemon, nvme_refused):
    import asyncio

    from kvcached_client import AsyncClient

    a = torch.randn(2, 4, 4, 48, 64)

    async def main() -> None:
        async with AsyncClient(fat_daemon.socket) as c:
            assert c.nvme_read == "direct"  # the measured default, as for Client
            await demote_prompt_async(c, a)
            async with await c.acquire(FAT, PROMPT) as lease:
                assert torch.equal(lease.kv(), a)
            s = await c.stats()
            assert c.nvme_read == "promote" and s["counters"]["promotions"] >= 2
            assert s["leases_active"] == 0

    asyncio.run(main())


def test_async_client_refuses_an_unknown_nvme_read_mode():
    from kvcached_client import AsyncClient

    with pytest.raises(ValueError, match="nvme_read"):
        AsyncClient("/nonexistent.sock", nvme_read="sometimes")
