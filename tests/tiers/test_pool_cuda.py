"""The CUDA pool. The GPU tests need CUDA and skip cleanly without it (CI has none); the
checks around them (refusals, the handle's wire form) run everywhere."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvcached.config import StoreConfig
from kvcached.service.convert import pool_handle_from_proto, pool_handle_to_proto
from kvcached.tiers.blocks import CudaIpc, PoolHandle
from kvcached.tiers.pool_cuda import CudaUnavailable, check_allocator
from kvcached.tiers.registry import make_pool

def gpu(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")(fn))


def test_expandable_segments_are_refused(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:True")
    with pytest.raises(CudaUnavailable, match="expandable_segments"):
        check_allocator()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    check_allocator()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_pool_without_cuda_is_a_clear_error(tmp_path):
    cfg = StoreConfig(state_dir=str(tmp_path), device="cuda:0", pool_bytes=1 << 20, pool_block_bytes=1 << 16)
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


_WRITER = r"""
import sys, torch
from kvcached_client import Client
from tests.service.conftest import LAYOUT
g = torch.Generator(device="cuda").manual_seed(11)
kv = torch.randn(2, 2, 2, 64, 8, device="cuda", generator=g)
with Client(sys.argv[1]) as c:
    assert c.put(LAYOUT, list(range(64)), kv) == 4
    assert c._pool._mapping.slab.device.type == "cuda"
torch.save(kv.cpu(), sys.argv[2])
"""

_READER = r"""
import sys, torch
from kvcached_client import Client
from tests.service.conftest import LAYOUT
with Client(sys.argv[1]) as c:
    with c.acquire(LAYOUT, list(range(64))) as lease:
        assert lease.chunk(0).device.type == "cuda"
        torch.save(lease.kv().cpu(), sys.argv[2])
        print(c._pool.generation)
"""


@gpu
def test_gpu_pool_shared_across_processes_bit_exact_and_new_generation_after_restart(make_daemon, tmp_path):
    d = make_daemon(device="cuda", pool_bytes="64M", pool_block_bytes="1M")
    w = subprocess.run([sys.executable, "-c", _WRITER, d.socket, str(tmp_path / "w.pt")], capture_output=True, text=True,
                       timeout=300)
    assert w.returncode == 0, w.stderr
    r = subprocess.run([sys.executable, "-c", _READER, d.socket, str(tmp_path / "r.pt")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert torch.equal(torch.load(tmp_path / "r.pt"), torch.load(tmp_path / "w.pt"))
    gen1 = r.stdout.strip()
    assert d.stop() == 0
    d.start()
    r2 = subprocess.run([sys.executable, "-c", _READER, d.socket, str(tmp_path / "r2.pt")], capture_output=True,
                        text=True, timeout=300)
    assert r2.returncode == 0, r2.stderr
    assert r2.stdout.strip() != gen1  # a restarted daemon exports a new slab: clients remap
    assert torch.equal(torch.load(tmp_path / "r2.pt"), torch.load(tmp_path / "w.pt"))  # via NVMe and promotion
