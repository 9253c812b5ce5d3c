"""Resource exhaustion against a real daemon: a pool full of leased chunks, a full LMDB map, a
full disk, and the per-session / per-domain caps. In every case the daemon refuses or degrades
with a clear error, evicts nothing that is leased, loses nothing it acknowledged, and serves on."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import grpc
import numpy as np
import pytest
import torch

from kvcached.contract.keys import ChunkHasher, Namespace
from kvcached.v1 import kvcached_pb2 as pb
from kvcached_client import Client, PutReceipt
from kvcached_client.nvme import NvmeReader
from kvcached_client.errors import ResourceExhaustedError
from bench.harness.daemon import Daemon
from tests.reliability.conftest import LAYOUT
from tests.requirements import require

CT = LAYOUT.chunk_tokens


def prompt(i: int, chunks: int) -> list[int]:
    return list(range(i * 100_000, i * 100_000 + chunks * CT))


def kv(i: int, chunks: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(2, LAYOUT.num_layers, LAYOUT.num_kv_heads, chunks * CT, LAYOUT.head_dim, generator=g)


def test_pool_full_of_leased_chunks_stores_nothing_says_why_and_evicts_nothing_leased(make_daemon):
    """A full cache is never an error: a put into a pool full of leased chunks stores nothing,
    says how much and why, and changes nothing."""
    d = make_daemon(pool_bytes="256K", nvme_bytes="64M", writeback=False)
    with Client(d.socket) as c:
        chunks = c.stats()["pool"]["capacity_bytes"] // LAYOUT.chunk_bytes
        assert chunks == 64
        n = chunks // 16
        for i in range(n):
            assert c.put(LAYOUT, prompt(i, 16), kv(i, 16)).stored_chunks == 16
        leases = [c.acquire(LAYOUT, prompt(i, 16)) for i in range(n)]
        assert all(lease.matched_tokens == 16 * CT for lease in leases)
        before = c.stats()
        assert before["pool"]["free_bytes"] == 0 and before["pool"]["leased_chunks"] == chunks

        for attempt in range(3):  # repeated puts that find no room change nothing either
            r = c.put(LAYOUT, prompt(100 + attempt, 4), kv(100 + attempt, 4))
            assert (r.stored_chunks, r.cached_tokens, r.not_stored_tokens) == (0, 0, 4 * CT)
            assert "no room for 4 more chunks" in r.not_stored_reason and "leased" in r.not_stored_reason
        after = c.stats()
        assert after["pool"] == before["pool"]
        assert after["reservations_active"] == 0 and after["indexed_chunks"] == before["indexed_chunks"]
        for i, lease in enumerate(leases):  # every leased chunk is still there, byte for byte
            assert torch.equal(lease.kv(), kv(i, 16))

        for lease in leases:
            lease.release()
        c.sync()
        assert c.put(LAYOUT, prompt(100, 4), kv(100, 4)).stored_chunks == 4  # room again: unleased chunks move to NVMe
        for i in range(n):
            with c.acquire(LAYOUT, prompt(i, 16)) as lease:
                assert lease.matched_tokens == 16 * CT
                assert torch.equal(lease.kv(), kv(i, 16))
    assert d.proc.poll() is None


def _on_disk(d: Daemon, i: int, chunks: int) -> None:
    """Chunks ``0 .. chunks-1`` of prompt ``i`` are in the daemon's LMDB file right now, with the
    right bytes: read through the client library's own read-only handle, checksums verified."""
    with open(os.path.join(d.state_dir, "hash.key"), "rb") as f:
        hasher = ChunkHasher(f.read())
    keys = hasher.chain(hasher.root(Namespace("default", LAYOUT)), np.asarray(prompt(i, 4), "<u4").tobytes(), CT)
    reader = NvmeReader()
    reader.open(os.path.join(d.state_dir, "nvme", "default"))
    try:
        for pos in range(chunks):
            assert torch.equal(reader.read(LAYOUT, keys[pos]), kv(i, 4)[:, :, :, pos * CT:(pos + 1) * CT]), (i, pos)
    finally:
        reader.close()


def _fill_through_nvme(d: Daemon, c: Client, count: int) -> list[PutReceipt]:
    """Write-through puts of ``count`` 4-chunk prompts. Every put succeeds (the pool takes it);
    what each acknowledges as durable is in the LMDB file when the put returns."""
    receipts = []
    for i in range(count):
        r = c.put(LAYOUT, prompt(i, 4), kv(i, 4))
        assert r.stored_chunks == 4 and r.cached_tokens == 4 * CT and r.write_through
        _on_disk(d, i, r.durable_tokens // CT)
        receipts.append(r)
    return receipts


def _crash_keeps_what_was_acknowledged(d: Daemon, c: Client, start: int) -> None:
    """Put fresh prompts until one is acknowledged durable (the full tier evicts to make room),
    SIGKILL the daemon right then, and read that prompt back after the restart."""
    for i in range(start, start + 20):
        r = c.put(LAYOUT, prompt(i, 4), kv(i, 4))
        if r.durable:
            break
    else:
        pytest.fail("20 write-through puts in a row were not durable: the full tier never made room")
    d.stop(signal.SIGKILL)
    d.start()
    with Client(d.socket) as c2, c2.acquire(LAYOUT, prompt(i, 4)) as lease:
        assert lease.matched_tokens >= r.durable_tokens == 4 * CT
        assert torch.equal(lease.kv(), kv(i, 4))


def _readable(c: Client, i: int) -> bool:
    with c.acquire(LAYOUT, prompt(i, 4)) as lease:
        if lease.matched_tokens == 0:
            return False
        got = lease.kv()
        assert torch.equal(got, kv(i, 4)[:, :, :, : got.shape[3]])  # a hit is always the right bytes
        return True


def test_full_lmdb_map_acknowledges_only_what_it_wrote_and_serves_on(make_daemon):
    # A 256 KiB map grows to its 1 MiB limit, which holds about a hundred 4 KiB chunks (each
    # spills into LMDB overflow pages); 320 chunks go through write-through.
    d = make_daemon(pool_bytes="256K", nvme_bytes="64M", nvme_map_bytes="256K",
                    write_through=True)
    with Client(d.socket) as c:
        receipts = _fill_through_nvme(d, c, 80)
        assert any(r.durable for r in receipts) and not all(r.durable for r in receipts)  # the map did fill
        s = c.stats()
        short = sum((r.cached_tokens - r.durable_tokens) // CT for r in receipts)
        assert 0 < s["counters"]["write_through_failures"] <= short  # every failed write was acknowledged short
        assert 0 < s["nvme"]["chunks"] < 320
        assert s["nvme"]["map_grows"] >= 1 and s["nvme"]["file_bytes"] <= s["nvme"]["map_bytes"] <= 1536 * 1024
        assert _readable(c, 79)  # the newest prompt is in the pool at least
        c.ping()
        assert "was full; grew it to" in d.log()  # told the operator, in the journal
        assert "LMDB map of 1048576 bytes is full" in d.log()
        _crash_keeps_what_was_acknowledged(d, c, 80)
    assert d.proc.poll() is None


@pytest.fixture
def tiny_disk(tmp_path):
    """The state directory on a 1 MiB tmpfs: a real ENOSPC from the kernel."""
    require(os.geteuid() == 0, "mounting a 1 MiB tmpfs needs root (CI runs as root)")
    d = Daemon(str(tmp_path), pool_bytes="256K", nvme_bytes="64M", write_through=True)
    os.makedirs(d.state_dir)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", d.state_dir], check=True)
    try:
        yield d
    finally:
        if d.proc is not None:
            d.stop(signal.SIGKILL)
        subprocess.run(["umount", d.state_dir], check=False)


def test_full_disk_acknowledges_only_what_it_wrote_and_serves_on(tiny_disk):
    d = tiny_disk.start()
    with Client(d.socket) as c:
        receipts = _fill_through_nvme(d, c, 80)  # 320 chunks x 4 KiB: more than the 1 MiB disk holds
        assert any(r.durable for r in receipts)
        s = c.stats()
        assert s["counters"]["write_through_failures"] > 0 or s["counters"]["nvme_evictions"] > 0
        assert s["nvme"]["chunks"] > 0
        assert "disk full" in d.log()
        assert _readable(c, 79)
        _crash_keeps_what_was_acknowledged(d, c, 80)
    with Client(d.socket) as c:
        assert c.put(LAYOUT, prompt(200, 4), kv(200, 4)).stored_chunks == 4  # serves on after the restart
    assert d.proc.poll() is None
    assert d.stop() == 0  # a clean stop (drain, flush) on a full disk


def test_lease_and_reservation_caps_per_session(make_daemon):
    d = make_daemon(max_leases_per_session=5, max_reservations_per_session=2)
    with Client(d.socket) as a, Client(d.socket) as b:
        a.put(LAYOUT, prompt(0, 2), kv(0, 2))
        held = [a.acquire(LAYOUT, prompt(0, 2)) for _ in range(5)]
        with pytest.raises(ResourceExhaustedError) as e:
            a.acquire(LAYOUT, prompt(0, 2))
        assert "max_leases_per_session" in e.value.details
        assert a.stats()["leases_active"] == 5  # the refusal pinned nothing
        with b.acquire(LAYOUT, prompt(0, 2)) as lease:  # another client is not affected
            assert lease.matched_tokens == 2 * CT
        held.pop().release()
        a.sync()  # releases travel on the session stream: at the cap, wait for it before acquiring
        a.acquire(LAYOUT, prompt(0, 2)).release()  # under the cap again

        lid, sid = a.register(LAYOUT), a.session_id()
        for i in range(2):
            a._stub.Reserve(pb.ReserveRequest(layout_id=lid, tokens=np.asarray(prompt(10 + i, 1), "<u4").tobytes(),
                                              session_id=sid))
        with pytest.raises(grpc.RpcError) as e:
            a._stub.Reserve(pb.ReserveRequest(layout_id=lid, tokens=np.asarray(prompt(12, 1), "<u4").tobytes(),
                                              session_id=sid))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_reservations_per_session" in e.value.details()
        assert a.stats()["reservations_active"] == 2
        assert b.put(LAYOUT, prompt(12, 1), kv(12, 1)).stored_chunks == 1  # b has its own budget
    deadline = time.monotonic() + 10  # a's session ended: its leases and reservations went with it
    with Client(d.socket) as c:
        while (c.stats()["leases_active"], c.stats()["reservations_active"]) != (0, 0):
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_session_cap_and_its_reload(make_daemon):
    d = make_daemon(max_sessions=2)
    clients = [Client(d.socket), Client(d.socket)]
    for c in clients:
        c.session_id()
    extra = Client(d.socket)
    with pytest.raises(ResourceExhaustedError) as e:
        extra.session_id()
    assert "max_sessions" in e.value.details
    extra.ping()  # refused a session, not the connection

    d.settings["max_sessions"] = 3  # SIGHUP applies it without a restart
    d.write_config()
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while True:
        try:
            extra.session_id()
            break
        except ResourceExhaustedError:
            assert time.monotonic() < deadline, d.log()
            time.sleep(0.1)
    assert extra.stats()["sessions_open"] == 3
    clients[0].close()  # closing one frees its slot for a fourth
    deadline = time.monotonic() + 10
    fourth = Client(d.socket)
    while True:
        try:
            fourth.session_id()
            break
        except ResourceExhaustedError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    for c in (clients[1], extra, fourth):
        c.close()
