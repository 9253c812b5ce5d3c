"""Where a lease's chunks land and when its release may run, for a pool on another device.

This machine has no GPU, so a pool "on another device" is simulated by what the client believes
its pool's device is (``PoolMap.device``, and ``PoolMap.device_of`` for a slab): "meta" for placement (tensors on it carry shapes,
no data) and "cuda:0" for release ordering (nothing is allocated there). The bytes still come from
the daemon's host pool. tests/tiers/test_pool_cuda.py checks the same on a real GPU.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvcached_client import AsyncClient, Client
from kvcached_client.pool import PoolMap
from tests.service.conftest import LAYOUT
from tests.service.test_daemon import FAT, PROMPT, demote_prompt


@pytest.fixture
def fat_daemon(make_daemon):
    return make_daemon(pool_bytes="2M", writeback=False)  # exact demotions, as in test_daemon


def pool_device(monkeypatch, device: str) -> None:
    monkeypatch.setattr(PoolMap, "device", property(lambda self: torch.device(device)), raising=False)
    monkeypatch.setattr(PoolMap, "device_of", lambda self, offset: torch.device(device))


def test_nvme_direct_chunks_land_on_the_pools_device(fat_daemon, monkeypatch):
    a = torch.randn(2, 4, 4, 48, 64)
    with Client(fat_daemon.socket, nvme_read="direct") as c:
        demote_prompt(c, a)  # chunk 0 stays in the pool, chunks 1 and 2 are NVMe-only
        pool_device(monkeypatch, "meta")
        with c.acquire(FAT, PROMPT) as lease:
            direct = [i for i, loc in enumerate(lease.locations) if loc.nvme_key]
            assert direct == [1, 2]
            assert lease.chunk(1).device.type == "meta"  # was a host tensor: torch.cat then mixed devices
            kv = lease.kv()
            assert kv.device.type == "meta" and kv.shape == a.shape  # one tensor, on the pool's device
            out = torch.empty(FAT.chunk_shape)  # and a host tensor still gets the bytes, straight from LMDB
            assert torch.equal(lease.copy_chunk(2, out), a[:, :, :, 32:48])


def test_kv_on_a_host_pool_spanning_both_tiers_is_exact(fat_daemon):
    a = torch.randn(2, 4, 4, 48, 64)
    with Client(fat_daemon.socket, nvme_read="direct") as c:
        demote_prompt(c, a)
        with c.acquire(FAT, PROMPT) as lease:
            kv = lease.kv()
            assert kv.device.type == "cpu" and torch.equal(kv, a)
            assert torch.equal(lease.copy_chunk(1, torch.empty(2, 4, 4, 32, 64)[:, :, :, :16]), a[:, :, :, 16:32])


def record_calls(monkeypatch, client_cls) -> list:
    """Record torch.cuda.synchronize and the client's Release RPC, in the order they happen."""
    calls: list = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("synchronize", str(device))))
    # The sync client's lease release goes on the session stream (_release_later); the async one's is the RPC.
    name = "_release_later" if client_cls is Client else "release"
    rpc = getattr(client_cls, name)
    if asyncio.iscoroutinefunction(rpc):
        async def release(self, *a, **kw):
            calls.append(("Release",))
            return await rpc(self, *a, **kw)
    else:
        def release(self, *a, **kw):
            calls.append(("Release",))
            return rpc(self, *a, **kw)
    monkeypatch.setattr(client_cls, name, release)
    return calls


def put_prompt(daemon) -> None:
    with Client(daemon.socket) as c:
        assert c.put(LAYOUT, list(range(32)), torch.randn(2, 2, 2, 32, 8)).stored_chunks == 2


def test_release_synchronises_a_cuda_pools_device_before_the_release_rpc(daemon, monkeypatch):
    put_prompt(daemon)
    with Client(daemon.socket) as c:
        calls = record_calls(monkeypatch, Client)
        pool_device(monkeypatch, "cuda:0")
        with c.acquire(LAYOUT, list(range(32))) as lease:
            lease.chunk(0)  # a view of (what the client takes for) GPU memory; reads of it may be queued
        assert calls == [("synchronize", "cuda:0"), ("Release",)]
        calls.clear()
        with c.acquire(LAYOUT, list(range(32))):
            pass  # handed out no view: nothing to wait for
        assert calls == [("Release",)]


def test_async_release_synchronises_a_cuda_pools_device_before_the_release_rpc(daemon, monkeypatch):
    put_prompt(daemon)

    async def main() -> list:
        async with AsyncClient(daemon.socket) as c:
            calls = record_calls(monkeypatch, AsyncClient)
            pool_device(monkeypatch, "cuda:0")
            async with await c.acquire(LAYOUT, list(range(32))) as lease:
                lease.chunk(1)
            return calls

    assert asyncio.run(main()) == [("synchronize", "cuda:0"), ("Release",)]


def test_release_of_a_host_pool_lease_does_not_synchronise(daemon, monkeypatch):
    put_prompt(daemon)
    with Client(daemon.socket) as c:
        calls = record_calls(monkeypatch, Client)
        with c.acquire(LAYOUT, list(range(32))) as lease:
            lease.chunk(0)
            lease.kv()
        assert calls == [("Release",)]
