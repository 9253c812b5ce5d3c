"""Runs of pool blocks laid back to back: a lease's whole prefix read with one copy per run, and
a reservation's chunks written the same way, instead of a view and a copy per chunk."""

from __future__ import annotations

import torch

from kvcached_client import Client
from kvcached_client._core import NVME_CHUNK, pool_runs
from kvcached_client.pool import PoolMap
from tests.service.test_daemon import FAT, PROMPT, demote_prompt

CB = 4096


def test_pool_runs_splits_at_gaps_nvme_chunks_and_slab_starts():
    assert pool_runs([], CB) == []
    assert pool_runs([0, CB, 2 * CB, 3 * CB], CB) == [(0, 4)]
    assert pool_runs([0, CB, 5 * CB, 6 * CB], CB) == [(0, 2), (2, 2)]  # a gap
    assert pool_runs([3 * CB, 2 * CB, CB], CB) == [(0, 1), (1, 1), (2, 1)]  # backwards is not a run
    assert pool_runs([0, CB, NVME_CHUNK, 3 * CB, 4 * CB], CB) == [(0, 2), (2, 1), (3, 2)]
    assert pool_runs([NVME_CHUNK, NVME_CHUNK], CB) == [(0, 1), (1, 1)]
    # Contiguous offsets across the start of slab 1 (at 2 * CB) belong to two mappings.
    assert pool_runs([0, CB, 2 * CB, 3 * CB], CB, [0, 2 * CB]) == [(0, 2), (2, 2)]
    # Blocks back to back but positions not consecutive (chunk 2 is not reserved): two runs.
    assert pool_runs([0, CB, 2 * CB], CB, positions=[0, 1, 3]) == [(0, 2), (2, 1)]
    # A chunk size that is not a multiple of 64: blocks are 64-byte aligned, never back to back.
    odd = CB + 8
    assert pool_runs([0, odd + 56, 2 * (odd + 56)], odd) == [(0, 1), (1, 1), (2, 1)]


def count_run_views(monkeypatch) -> list[int]:
    sizes: list[int] = []
    real = PoolMap.run_view

    def counted(self, layout, offset, n):
        sizes.append(n)
        return real(self, layout, offset, n)

    monkeypatch.setattr(PoolMap, "run_view", counted)
    return sizes


def test_a_prompt_stored_in_one_piece_is_written_and_read_with_one_copy(make_daemon, monkeypatch):
    d = make_daemon(pool_bytes="4M", writeback=False)
    a = torch.randn(2, 4, 4, 48, 64)
    with Client(d.socket) as c:
        sizes = count_run_views(monkeypatch)
        assert c.put(FAT, PROMPT, a).stored_chunks == 3
        assert sizes == [3]  # the three chunks' blocks were free in one piece: one view, one copy
        sizes.clear()
        with c.acquire(FAT, PROMPT) as lease:
            assert lease.matched_tokens == 48
            kv = lease.kv()
            assert sizes == [3]
            assert torch.equal(kv, a)
            (first, run), = lease.runs()  # one view of the three blocks
            assert first == 0 and torch.equal(run.permute(1, 2, 3, 0, 4, 5).flatten(3, 4), a)
            views = lease.chunk_views(1)  # chunks 1 and 2, cut from the run's view
            assert [v.data_ptr() for v in views] == [lease.chunk(i).data_ptr() for i in (1, 2)]
            assert torch.equal(torch.cat(views, dim=3), a[:, :, :, 16:48])
            out = torch.zeros(2, 4, 4, 32, 64)  # a part of the prefix, from chunk 1
            assert torch.equal(lease.copy_into(out, first=1), a[:, :, :, 16:48])
            assert [lease.chunk(i).data_ptr() for i in range(3)] == [
                lease.chunk(0).data_ptr() + i * FAT.chunk_bytes for i in range(3)]  # back to back indeed


def test_a_prefix_split_between_the_pool_and_nvme_reads_exactly(make_daemon, monkeypatch):
    """Chunk 0 in the pool, chunks 1 and 2 NVMe-only (read from the file): three runs of one."""
    d = make_daemon(pool_bytes="2M", writeback=False)
    a = torch.randn(2, 4, 4, 48, 64)
    with Client(d.socket, nvme_read="direct") as c:
        demote_prompt(c, a)
        sizes = count_run_views(monkeypatch)
        with c.acquire(FAT, PROMPT) as lease:
            assert [loc.offset == NVME_CHUNK for loc in lease.locations] == [False, True, True]
            assert torch.equal(lease.kv(), a)
            assert sizes == []  # a run of one is a chunk view, not a run view
            assert torch.equal(torch.cat(lease.chunk_views(), dim=3), a)  # NVMe chunks read, as chunk(i)
            runs = lease.runs()
            assert [i for i, _ in runs] == [0, 1, 2]
            assert torch.equal(torch.cat([r for _, r in runs]).permute(1, 2, 3, 0, 4, 5).flatten(3, 4), a)
