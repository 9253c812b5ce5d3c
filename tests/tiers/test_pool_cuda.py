"""The CUDA pool. The GPU tests need CUDA and skip cleanly without it (CI has none); the
checks around them (refusals, the handle's wire form) run everywhere."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvcached.config import StoreConfig
from kvcached.contract.proto import pool_handle_from_proto, pool_handle_to_proto
from kvcached.contract.pool import CudaIpc, PoolHandle
from kvcached.contract.poolmap import CudaUnavailable, cuda_mem_handle, torch_storage_handle
from kvcached.tiers.pool_cuda import check_allocator
from kvcached.tiers.registry import make_pool


def gpu(fn):
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")
    return pytest.mark.gpu(skip(fn))


def two_gpus(fn):
    skip = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs; this machine has fewer")
    return pytest.mark.gpu(skip(fn))


def test_expandable_segments_are_refused(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:True")
    with pytest.raises(CudaUnavailable, match="expandable_segments"):
        check_allocator()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    check_allocator()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_pool_without_cuda_is_a_clear_error(tmp_path):
    cfg = StoreConfig(state_dir=str(tmp_path), device="cuda:0", pool_bytes=1 << 20)
    with pytest.raises(CudaUnavailable, match="CUDA is not available"):
        make_pool(cfg)
    exe = os.path.join(os.path.dirname(sys.executable), "kvcached")
    r = subprocess.run([exe, "serve", "--device", "cuda", "--state-dir", str(tmp_path), "--socket",
                        str(tmp_path / "s.sock"), "--pool-bytes", "1M"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "CUDA is not available" in r.stderr


def test_cuda_handle_round_trips_through_protobuf():
    ipc = CudaIpc(1, "GPU-1234", b"\x01" * 64, 1 << 30, 512, b"/torch_123_456", 8, b"\x02" * 64, True)
    h = PoolHandle("cuda", "cuda:1/abc", 1 << 20, 1024, "abc", ipc)
    assert pool_handle_from_proto(pool_handle_to_proto(h)) == h
    shm = PoolHandle("shm", "kvcached.default.1.abc", 4096, 8, "abc")
    assert pool_handle_from_proto(pool_handle_to_proto(shm)) == shm


@pytest.mark.parametrize("version", [None, 2, 3])
def test_the_wire_carries_the_bare_cuda_handle_and_each_torch_gets_its_own_wrapping(version):
    """Seen on an H200 with torch 2.11: ``_share_cuda_`` gives 66 bytes (torch's version byte, type
    'c', the 64-byte cudaIpcMemHandle_t); torch 2.13 writes version 3, and a torch refuses a newer
    version than its own. The daemon sends the bare 64 bytes; each client wraps them for its torch."""
    mem = bytes(range(64))
    exported = mem if version is None else bytes([version]) + b"c" + mem
    assert cuda_mem_handle(exported) == mem
    for client_version in (None, 2, 3):
        wrapped = torch_storage_handle(mem, client_version)
        assert cuda_mem_handle(wrapped) == mem
        assert wrapped == (mem if client_version is None else bytes([client_version]) + b"c" + mem)


@pytest.mark.parametrize("bad", [bytes([2]) + b"e" + bytes(80), bytes([2]) + b"x" + bytes(64), bytes(65), b""])
def test_an_expandable_or_unknown_torch_handle_is_refused_at_export(bad):
    with pytest.raises(ValueError):
        cuda_mem_handle(bad)
    with pytest.raises(ValueError):
        torch_storage_handle(bad[:63], 2)


def test_a_handle_the_daemon_cannot_export_stops_it_with_a_clear_error():
    from kvcached.tiers.pool_cuda import _exported

    with pytest.raises(CudaUnavailable, match=r"cannot share the GPU pool with clients: .*expandable segment.*torch "):
        _exported(bytes([2]) + b"e" + bytes(80))
    assert _exported(bytes([3]) + b"c" + bytes(range(64))) == bytes(range(64))


_WRITER = r"""
import sys, torch
from kvcached_client import Client
from tests.service.conftest import LAYOUT
g = torch.Generator(device="cuda").manual_seed(11)
kv = torch.randn(2, 2, 2, 64, 8, device="cuda", generator=g)
with Client(sys.argv[1]) as c:
    assert c.put(LAYOUT, list(range(64)), kv).stored_chunks == 4
    assert c._pool.device.type == "cuda"
torch.save(kv.cpu(), sys.argv[2])
"""

# "promote": chunks that are only on NVMe (after the restart) come back through the daemon's GPU pool;
# the default "direct" would read them from the LMDB file into host memory and bypass the pool.
_READER = r"""
import sys, torch
from kvcached_client import Client
from tests.service.conftest import LAYOUT
with Client(sys.argv[1], nvme_read="promote") as c:
    with c.acquire(LAYOUT, list(range(64))) as lease:
        assert lease.matched_tokens == 64
        assert all(not loc.nvme_key for loc in lease.locations)
        assert all(lease.chunk(i).device.type == "cuda" for i in range(len(lease)))
        kv = lease.kv()
        assert kv.device.type == "cuda"
        torch.save(kv.cpu(), sys.argv[2])
    print(c._pool.generation, c.stats()["counters"]["promotions"])
"""


def _run(*args: str) -> str:
    r = subprocess.run([sys.executable, "-c", *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.strip()


@gpu
def test_gpu_pool_shared_across_processes_bit_exact_and_new_generation_after_restart(make_daemon, tmp_path):
    d = make_daemon(device="cuda", pool_bytes="64M")
    _run(_WRITER, d.socket, str(tmp_path / "w.pt"))
    gen1, promoted = _run(_READER, d.socket, str(tmp_path / "r.pt")).split()
    assert torch.equal(torch.load(tmp_path / "r.pt"), torch.load(tmp_path / "w.pt")) and promoted == "0"
    assert d.stop() == 0  # writes the pool-only chunks to NVMe
    d.start()
    gen2, promoted = _run(_READER, d.socket, str(tmp_path / "r2.pt")).split()
    assert gen2 != gen1  # a restarted daemon exports a new slab: clients remap
    assert promoted == "4"  # NVMe -> GPU pool, by the daemon
    assert torch.equal(torch.load(tmp_path / "r2.pt"), torch.load(tmp_path / "w.pt"))


@gpu
def test_gpu_lease_spanning_pool_and_nvme_direct_chunks_gives_one_cuda_tensor(make_daemon):
    from kvcached_client import Client
    from tests.service.test_daemon import FAT, PROMPT, demote_prompt

    d = make_daemon(device="cuda", pool_bytes="2M", writeback=False)  # as fat_daemon: exactly two demotions
    a = torch.randn(2, 4, 4, 48, 64)
    with Client(d.socket, nvme_read="direct") as c:
        demote_prompt(c, a)  # chunk 0 stays in the GPU pool, chunks 1 and 2 are NVMe-only
        with c.acquire(FAT, PROMPT) as lease:
            assert [bool(loc.nvme_key) for loc in lease.locations] == [False, True, True]
            assert all(lease.chunk(i).device.type == "cuda" for i in range(3))
            kv = lease.kv()
            assert kv.device.type == "cuda" and torch.equal(kv.cpu(), a)
            out = torch.empty(FAT.chunk_shape, device="cuda")
            assert torch.equal(lease.copy_chunk(2, out).cpu(), a[:, :, :, 32:48])
        assert c.stats()["counters"]["promotions"] == 0


@gpu
def test_gpu_blocks_of_a_derived_size_view_as_a_two_byte_dtype(make_daemon):
    from kvcached.contract.keys import KVLayout
    from kvcached_client import Client

    # An odd pool size: a chunk at an odd offset is one a bfloat16 view of the CUDA slab refuses
    # ("storage offset must be divisible by the element size"); the packed pool aligns every chunk.
    d = make_daemon(device="cuda", pool_bytes=1000017)
    layout = KVLayout("test/gpu-bf16@1", num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", chunk_tokens=16)
    kv = torch.randn(2, 2, 2, 64, 8).to(torch.bfloat16)
    with Client(d.socket) as c:
        h = c.pool_handle()
        assert h.align_bytes % 64 == 0 and h.size_bytes % h.align_bytes == 0
        assert c.put(layout, list(range(64)), kv).stored_chunks == 4  # blocks 0..3
        with c.acquire(layout, list(range(64))) as lease:
            assert torch.equal(lease.kv().cpu(), kv)


_PLACED = r"""
import sys, torch
from kvcached_client import Client
from tests.service.conftest import LAYOUT
dev, toks = torch.device(sys.argv[2]), list(range(int(sys.argv[3]), int(sys.argv[3]) + 64))
kv = torch.randn(2, 2, 2, 64, 8, device=dev, generator=torch.Generator(device=dev).manual_seed(5))
with Client(sys.argv[1], placement=dev) as c:
    assert c.put(LAYOUT, toks, kv).stored_chunks == 4
    assert c._pool.mapped_slabs == [dev.index]  # its own GPU's slab only: no context on the other
    with c.acquire(LAYOUT, toks) as lease:
        assert all(lease.chunk(i).device == dev for i in range(4))
        assert torch.equal(lease.kv(), kv)
    print([s["used_bytes"] > 0 for s in c.stats()["pool"]["slabs"]])
"""


@two_gpus
def test_gpu_a_slab_per_gpu_and_each_client_stores_on_its_own(make_daemon):
    d = make_daemon(device="cuda", pool_bytes="64M")
    assert _run(_PLACED, d.socket, "cuda:1", "0").endswith("[False, True]")
    assert _run(_PLACED, d.socket, "cuda:0", "1000").endswith("[True, True]")
