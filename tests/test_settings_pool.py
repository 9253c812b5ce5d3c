"""Pool sizes the settings derive: aligned block sizes, and default pools shared fairly by domains."""

from __future__ import annotations

import pytest
import torch

import kvcached.settings as settings_mod
from kvcached.config import BLOCK_ALIGN, GiB, KiB, MiB, StoreConfig
from kvcached.keys import KVLayout
from kvcached.settings import DaemonSettings, SettingsError, load_settings
from kvcached.tiers.pool_shm import HostPool

BF16 = KVLayout("test/align@1", num_layers=1, num_kv_heads=1, head_dim=1, dtype="bfloat16", chunk_tokens=1)


def settings(**kw) -> DaemonSettings:
    return DaemonSettings(socket="/nonexistent/kv.sock", state_dir="/nonexistent/state", device="cpu", **kw)


@pytest.mark.parametrize("pool", [1000017, 33 * KiB + 5, 5 * MiB + 7, 100 * MiB + 1, 255 * MiB + 3])
def test_block_sizes_derived_from_a_small_pool_are_aligned(pool):
    cfg = settings(pool_bytes=pool).store_config()
    block = cfg.pool_block_bytes
    assert block % BLOCK_ALIGN == 0 and cfg.pool_blocks >= 16
    if pool // 16 >= 2 * MiB:
        assert block % (2 * MiB) == 0
    elif pool // 16 >= 4 * KiB:
        assert block % (4 * KiB) == 0
    # What a client does with a CUDA pool block (PoolMap.view): view the slab's bytes at the block's
    # offset as the layout's dtype. torch refuses an offset the element size does not divide, on
    # the CPU as on the GPU; a bare pool // 16 block (odd for these pools) failed here.
    slab = torch.empty(cfg.pool_blocks * block, dtype=torch.uint8)
    for b in range(cfg.pool_blocks):
        slab[b * block : b * block + BF16.chunk_bytes].view(torch.bfloat16).view(BF16.chunk_shape)


def test_a_configured_block_size_is_kept_when_the_pool_holds_16_of_them():
    assert settings(pool_bytes=64 * MiB, pool_block_bytes=4 * MiB).store_config().pool_block_bytes == 4 * MiB


@pytest.mark.parametrize("bad", [1000, 100, 16 * MiB + 2])
def test_an_unaligned_block_size_is_refused_with_the_next_aligned_one(tmp_path, bad):
    up = -(-bad // BLOCK_ALIGN) * BLOCK_ALIGN
    cfg = tmp_path / "k.toml"
    cfg.write_text(f"pool_block_bytes = {bad}\n")
    with pytest.raises(SettingsError, match=f"multiple of {BLOCK_ALIGN} bytes.*got {bad}; use {up}"):
        load_settings(str(cfg))
    cfg.write_text(f'socket = "{tmp_path}/a.sock"\n[domains.b]\nsocket = "{tmp_path}/b.sock"\n'
                   f"pool_block_bytes = {bad}\n")
    with pytest.raises(SettingsError, match=f"multiple of {BLOCK_ALIGN}"):
        load_settings(str(cfg))
    with pytest.raises(ValueError, match=f"multiple of {BLOCK_ALIGN}"):
        StoreConfig(state_dir=str(tmp_path), pool_bytes=1 << 20, pool_block_bytes=bad)
    with pytest.raises(ValueError, match=f"multiple of {BLOCK_ALIGN}"):
        HostPool("kvcached.test-align", bad, 4, prefault=False)


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
    assert cfg.pool_bytes == 1 * GiB and cfg.pool_block_bytes == 16 * MiB


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
    assert all(c.device == "cuda" and c.pool_block_bytes == 16 * MiB for c in configs)
