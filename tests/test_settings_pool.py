"""Pool sizes the settings derive: aligned packed pools, and default pools shared fairly by domains."""

from __future__ import annotations

import pytest
import torch

import kvcached.settings as settings_mod
from kvcached.config import BLOCK_ALIGN, GiB, KiB, MiB
from kvcached.contract.keys import KVLayout
from kvcached.settings import DaemonSettings, load_settings
from kvcached.tiers.pool_shm import HostPool

BF16 = KVLayout("test/align@1", num_layers=1, num_kv_heads=1, head_dim=1, dtype="bfloat16", chunk_tokens=1)


def settings(**kw) -> DaemonSettings:
    return DaemonSettings(socket="/nonexistent/kv.sock", state_dir="/nonexistent/state", device="cpu", **kw)


@pytest.mark.parametrize("pool", [1000017, 33 * KiB + 5, 5 * MiB + 7])
def test_an_odd_pool_size_is_rounded_down_and_every_chunk_offset_is_aligned(pool):
    cfg = settings(pool_bytes=pool).store_config()
    p = HostPool("kvcached.test-align", cfg.pool_bytes, prefault=False)
    try:
        assert p.capacity_bytes == pool // BLOCK_ALIGN * BLOCK_ALIGN
        # What a client does with a chunk (PoolMap.view): view the slab's bytes at the chunk's offset
        # as the layout's dtype. torch refuses an offset the element size does not divide, on the CPU
        # as on the GPU; every offset the packed pool hands out is a multiple of BLOCK_ALIGN.
        slab = torch.empty(p.capacity_bytes, dtype=torch.uint8)
        offsets = [p.reserve(BF16.chunk_bytes).offset for _ in range(16)]
        assert all(off % BLOCK_ALIGN == 0 for off in offsets)
        for off in offsets:
            slab[off : off + BF16.chunk_bytes].view(torch.bfloat16).view(BF16.chunk_shape)
    finally:
        p.close()


def test_the_old_block_size_setting_still_loads_and_is_ignored(tmp_path):
    cfg = tmp_path / "k.toml"
    cfg.write_text('pool_bytes = "64M"\npool_block_bytes = "4M"\n')
    s = load_settings(str(cfg))
    assert s.pool_block_bytes == 4 * MiB  # kept only so the daemon can say it is ignored
    assert not hasattr(s.store_config(), "pool_block_bytes")


def domains_toml(tmp_path, *, device: str = "cpu", **tables: str) -> str:
    """A config of the default domain and one [domains.NAME] per keyword (its extra lines)."""
    path = tmp_path / "k.toml"
    lines = [f'socket = "{tmp_path}/main.sock"', f'device = "{device}"']
    for name, extra in tables.items():
        lines += [f"[domains.{name}]", f'socket = "{tmp_path}/{name}.sock"', extra]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


class ShrinkingFree:
    """Free memory that shrinks each time it is read, as it would once each domain's pool took its
    share: a default computed per domain, at its pool's creation, would see less each time."""

    def __init__(self, free: int) -> None:
        self.free, self.reads = free, 0

    def __call__(self) -> int:
        self.reads += 1
        free, self.free = self.free, self.free // 2
        return free


def test_host_default_pool_is_computed_once_and_split_among_the_domains_that_use_it(tmp_path, monkeypatch):
    free = ShrinkingFree(2 * GiB)
    monkeypatch.setattr(settings_mod, "free_shm_bytes", free)
    s = load_settings(domains_toml(tmp_path, b="", c="", d='pool_bytes = "8M"'))
    configs = s.store_configs()
    assert [c.domain for c in configs] == ["default", "b", "c", "d"]
    share = (2 * GiB // 4) // 3  # a quarter of free /dev/shm, for the three domains without pool_bytes
    assert [c.pool_bytes for c in configs] == [share, share, share, 8 * MiB]
    assert free.reads == 1


def test_host_default_of_a_single_domain_is_unchanged(tmp_path, monkeypatch):
    monkeypatch.setattr(settings_mod, "free_shm_bytes", lambda: 64 * GiB)
    (cfg,) = load_settings(domains_toml(tmp_path)).store_configs()
    assert cfg.pool_bytes == 1 * GiB


def test_gpu_default_pool_is_half_of_free_memory_split_among_the_domains(tmp_path, monkeypatch):
    # This machine has no GPU: torch's view of one is faked (device queries only; nothing is allocated).
    reads = []

    def mem_get_info(device):
        reads.append(device)
        return (80 * GiB >> (len(reads) - 1), 141 * GiB)  # shrinking, as if each pool took its share

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    configs = load_settings(domains_toml(tmp_path, device="cuda", b="")).store_configs()
    assert [c.pool_bytes for c in configs] == [20 * GiB, 20 * GiB] and len(reads) == 1
    assert all(c.device == "cuda" for c in configs)
