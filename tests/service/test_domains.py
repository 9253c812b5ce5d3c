"""Trust domains: each has its own socket, pool and NVMe environment; the domain is the socket a
request arrived on. Paired tests: same domain hits, other domain misses, on every tier."""

from __future__ import annotations

import os
import stat

import torch

from kvcached.settings import SettingsError, load_settings
from kvcached_client import Client
from tests.service.conftest import LAYOUT

CT = LAYOUT.chunk_tokens


def two_domains(make_daemon, tmp_path, **b):
    d = make_daemon(**{"domains": {"tenant_b": {"socket": str(tmp_path / "b.sock"), "pool_bytes": "2M",
                                                "socket_mode": "0600", **b}}})
    return d, str(tmp_path / "b.sock")


def test_isolation_on_the_pool_and_on_nvme(make_daemon, tmp_path):
    d, b_sock = two_domains(make_daemon, tmp_path)
    assert stat.S_IMODE(os.stat(b_sock).st_mode) == 0o600  # each domain its own socket permissions
    kv = torch.randn(2, 2, 2, 3 * CT, 8)
    toks = list(range(3 * CT))
    with Client(d.socket) as a, Client(b_sock) as b:
        assert a.put(LAYOUT, toks, kv).stored_chunks == 3
        assert a.lookup(LAYOUT, toks) == 3 * CT  # same domain: hit (pool)
        assert b.lookup(LAYOUT, toks) == 0  # other domain: miss (pool)
        with b.acquire(LAYOUT, toks) as lease:
            assert lease.matched_tokens == 0
        assert a._pool.generation != b._pool.generation or b._pool.generation is None
        assert a.stats()["pool"]["chunks"] == 3 and b.stats()["pool"]["chunks"] == 0
    assert d.stop() == 0  # flushes each domain's pool to its own NVMe environment
    d.start()
    with Client(d.socket) as a, Client(b_sock) as b:
        with a.acquire(LAYOUT, toks) as lease:  # same domain: hit (NVMe, after the restart)
            assert torch.equal(lease.kv(), kv)
        assert b.lookup(LAYOUT, toks) == 0  # other domain: miss (NVMe)
        assert b.stats()["nvme"]["chunks"] == 0
    assert os.path.isdir(os.path.join(d.state_dir, "nvme", "tenant_b"))


def test_each_domain_has_its_own_capacity_and_ttl(make_daemon, tmp_path):
    d, b_sock = two_domains(make_daemon, tmp_path, cache_ttl=0.5)
    with Client(d.socket) as a, Client(b_sock) as b:
        sa, sb = a.stats(), b.stats()
        assert sb["pool"]["capacity_bytes"] == 2 << 20 and sa["pool"]["capacity_bytes"] == 4 << 20
        toks = list(range(CT))
        a.put(LAYOUT, toks, torch.zeros(2, 2, 2, CT, 8))
        b.put(LAYOUT, toks, torch.zeros(2, 2, 2, CT, 8))
        import time

        deadline = time.monotonic() + 10
        while b.lookup(LAYOUT, toks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert b.lookup(LAYOUT, toks) == 0  # tenant_b's chunks expire after its 0.5 s cache_ttl
        assert a.lookup(LAYOUT, toks) == CT  # the default domain keeps 3600 s


def test_domain_tables_are_checked(tmp_path):
    cfg = tmp_path / "k.toml"
    cfg.write_text('socket = "/tmp/a.sock"\n[domains.b]\npool_bytes = "1M"\n')
    import pytest

    with pytest.raises(SettingsError, match="needs its own socket"):
        load_settings(str(cfg))
    cfg.write_text('socket = "/tmp/a.sock"\n[domains.b]\nsocket = "/tmp/b.sock"\ntcp_listen = "0.0.0.0:1"\n')
    with pytest.raises(SettingsError, match="cannot set tcp_listen"):
        load_settings(str(cfg))
    cfg.write_text('socket = "/tmp/a.sock"\n[domains.b]\nsocket = "/tmp/a.sock"\n')
    with pytest.raises(SettingsError, match="own socket"):
        load_settings(str(cfg))
