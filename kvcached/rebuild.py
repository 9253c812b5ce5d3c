"""Rebuild the prefix index from the NVMe tier at start.

Chunks are inserted in position order, each under its recorded parent, so
the rebuilt index has the same shape it had before the restart. A chunk
whose parent is not there (its parent was evicted or dropped as corrupt just
before a crash), whose layout is unknown, or whose position-0 parent is not
this namespace's seed (the hash key changed) can never be reached again: it
is deleted from NVMe, so that the index and the LMDB contents stay equal.
"""

from __future__ import annotations

import logging

from kvcached.index import PrefixIndex
from kvcached.contract.keys import ChunkHash, KVLayout, LayoutId
from kvcached.contract.locations import NVME
from kvcached.progress import Progress
from kvcached.receipts import RebuildReport
from kvcached.tiers.nvme import NvmeTier

log = logging.getLogger(__name__)


def rebuild_index(
    index: PrefixIndex,
    nvme: NvmeTier,
    layouts: dict[LayoutId, tuple[KVLayout, ChunkHash]],
    now: float,
) -> RebuildReport:
    progress = Progress(nvme.entry_count(), f"rebuilding index from {nvme.path}")
    metas = []
    for meta in nvme.scan():
        metas.append(meta)
        progress.update()
    metas.sort(key=lambda m: m.position)
    orphans = unknown = 0
    for meta in metas:
        entry = layouts.get(meta.layout_id)
        if entry is None:
            unknown += 1
            nvme.delete(meta.chunk_hash)
            continue
        _layout, root = entry
        if meta.position == 0:
            parent = None
            ok = meta.parent_hash == root
        else:
            parent = index.get(meta.parent_hash)
            ok = parent is not None and parent.depth == meta.position - 1 and parent.layout_id == meta.layout_id
        if not ok or meta.chunk_hash in index:
            orphans += 1
            nvme.delete(meta.chunk_hash)
            continue
        index.insert(meta.chunk_hash, parent, meta.layout_id, NVME, now)
    report = RebuildReport(len(index), orphans, nvme.dropped_corrupt, unknown, 0.0)
    seconds = progress.finish(
        f"{report.chunks} chunks indexed, {orphans} orphans, {report.corrupt_dropped} corrupt, "
        f"{unknown} of unknown layouts dropped"
    )
    return RebuildReport(report.chunks, orphans, report.corrupt_dropped, unknown, seconds)
