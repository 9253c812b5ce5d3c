"""Moving chunk bytes between tiers: make room, demote, promote, drop.

The :class:`Mover` is the only code that touches both the index and the
tiers. It runs under the store lock (see :mod:`kvcached.store`), so while it
works nothing else can pin, release or read the chunks it moves.

Rules it keeps:

* A pinned chunk is never evicted from the pool (pinned nodes are never in
  ``pool_lru``) and never dropped (never in ``leaves``).
* A chunk leaves the index only as a leaf, so every indexed chunk keeps its
  whole prefix indexed.
* A chunk is added to a tier's set in the index only after the tier's commit
  returned, so nothing half-written is ever matched.
* Pool eviction demotes to NVMe (write-back) unless the chunk already has an
  NVMe copy (write-through, or demoted before, or written by the background
  writer of :mod:`kvcached.writeback`, which keeps the chunks next in eviction
  order clean so that evicting them costs no disk I/O). If NVMe cannot take
  it, a leaf is dropped; an inner chunk stays in the pool for now.
* Room in the packed pool is made for a number of bytes: first in eviction
  order (the policy's, :mod:`kvcached.index.eviction`) until that many bytes are free, then, if no free run is long enough (the
  pool is fragmented), by evicting the contiguous window that frees the fewest
  bytes (:meth:`kvcached.tiers.packed.PackedPool.victims_for`).
* A chunk that capacity pushes out of its last local tier (an NVMe victim, or a
  pool victim without an NVMe tier) is first handed to ``demote`` (a copy of
  its verified bytes: the remote tier's queue, :mod:`kvcached.publish`), so the
  trust domain's other hosts, and this one later, can still find it. Expiry and
  explicit evictions are not demotions.
"""

from __future__ import annotations

import logging
from typing import Callable, cast

from kvcached.config import StoreConfig
from kvcached.contract.errors import ChunkNotCached, CorruptChunk, TierFull
from kvcached.index import Node, PrefixIndex
from kvcached.contract.keys import ChunkHash, KVLayout, LayoutId
from kvcached.contract.locations import NVME, POOL
from kvcached.stats import Counters
from kvcached.contract.record import ChunkMeta
from kvcached.tiers.nvme import NvmeTier
from kvcached.tiers.packed import PackedPool

log = logging.getLogger(__name__)


#: How many chunks of other pool slabs an eviction in one slab passes over in eviction order before
#: it stops and takes the cheapest window of its own slab instead (:meth:`Mover.pool_room`), and
#: write-back before it ends a batch: bounds the work per reserve on a multi-GPU pool.
OTHER_SLAB_SCAN = 256


class Mover:
    def __init__(
        self,
        config: StoreConfig,
        index: PrefixIndex,
        pool: PackedPool,
        nvme: NvmeTier | None,
        counters: Counters,
        layout_of: Callable[[LayoutId], tuple[KVLayout, ChunkHash]],
        io_check: Callable[[], None] = lambda: None,
    ) -> None:
        self.config = config
        self.index = index
        self.pool = pool
        self.nvme = nvme
        self.counters = counters
        self._layout_of = layout_of
        self.io_check = io_check  # raises WouldBlock on the store's inline path (no disk I/O there)
        #: Receives (meta, bytes) of a chunk leaving its last local tier for want of room; None: dropped.
        self.demote: Callable[[ChunkMeta, bytes], None] | None = None

    def meta_of(self, node: Node) -> ChunkMeta:
        layout, root = self._layout_of(node.layout_id)
        parent = node.parent.hash if node.parent is not None else root
        return ChunkMeta(node.hash, parent, node.layout_id, node.depth, layout.chunk_tokens)

    def leaving(self, node: Node) -> None:
        """``node`` is about to leave its last local tier for want of room: hand a verified copy
        of its bytes to ``demote``. A chunk whose bytes fail their check is not handed on."""
        if self.demote is None:
            return
        try:
            if node.tiers & POOL:
                data = bytes(self.pool.read(node.hash))
            elif node.tiers & NVME and self.nvme is not None:
                data = cast(bytes, self.nvme.read(node.hash).obj)  # already a checked copy
            else:
                return
        except (ChunkNotCached, CorruptChunk):
            return
        self.demote(self.meta_of(node), data)

    # -- pool ----------------------------------------------------------------------

    def pool_room(self, nbytes: int, slab: int = 0) -> bool:
        """Evict unpinned pool copies until a run of ``nbytes`` fits in ``slab``: in eviction
        order first until that many bytes are free there, then the cheapest contiguous window.
        False if it cannot (everything in the way is pinned, reserved, or cannot leave the pool).
        Chunks of other slabs are passed over (and put back): room on GPU 1 does not help GPU 0;
        after :data:`OTHER_SLAB_SCAN` of them the window takes over, so a slab whose chunks are
        all newer than another slab's does not walk the whole order on every reserve.

        On the inline path a dirty victim (no NVMe copy yet) raises WouldBlock; whatever was
        evicted before stays evicted (clean copies only, so nothing is lost) and the caller
        releases what it holds."""
        pool = self.pool
        if pool.can_admit(nbytes, slab):
            return True
        lru = self.index.pool_lru
        skipped: list[Node] = []
        several = pool.slabs > 1
        passed = 0  # chunks of other slabs passed over
        try:
            while pool.slab_free_bytes(slab) < nbytes:
                victim = lru.pop()
                if victim is None:
                    break
                skipped.append(victim)  # until evicted: an I/O check may raise in between
                if several and pool.slab_of(victim.pool_offset) != slab:
                    passed += 1
                    if passed >= OTHER_SLAB_SCAN:
                        break  # this slab's chunks are far down the order: the window below finds them
                    continue
                if self.evict_pool_copy(victim):
                    skipped.pop()
            if pool.can_admit(nbytes, slab):
                return True
            hashes = self._window(nbytes, slab)
            if hashes is None:
                return False
            self.counters.pool_window_evictions += 1
            for h in hashes:
                victim = self.index.get(h)
                assert victim is not None
                lru.discard(victim)
                skipped.append(victim)
                if self.evict_pool_copy(victim):
                    skipped.pop()
            return pool.can_admit(nbytes, slab)
        finally:
            for node in skipped:
                if node.refcount == 0 and node.tiers & POOL and not node.pool_children:
                    lru.add(node)

    def _window(self, nbytes: int, slab: int = 0) -> list[ChunkHash] | None:
        """The contiguous window of ``slab`` to evict for ``nbytes``: among the oldest quarter of
        the pool's LRU span first (by last use), then among any evictable chunk. The cheapest
        window ignores recency; bench/studies/pool_packing.py measured that limiting it to old chunks
        keeps re-used chunks cached far more often (0.90 vs 0.68 of re-touches hit) at the same
        packing (98 % vs 99 % of the pool holding KV)."""
        lru, get = self.index.pool_lru, self.index.get
        oldest = lru.peek()
        if oldest is None:
            return None
        newest = max(oldest.last_use, self.index.newest_use)
        cutoff = oldest.last_use + 0.25 * (newest - oldest.last_use)
        hashes = self.pool.victims_for(
            nbytes, lambda h: (n := get(h)) is not None and n in lru and n.last_use <= cutoff, slab)
        if hashes is None:
            hashes = self.pool.victims_for(nbytes, lambda h: (n := get(h)) is not None and n in lru, slab)
        return hashes

    def evict_pool_copy(self, node: Node) -> bool:
        """Move or drop the pool copy of an unpinned chunk. False if it must stay."""
        if not node.tiers & NVME and self.nvme is not None and not self.config.write_through:
            self.io_check()
            if self.write_nvme(node, self.pool.read(node.hash)):
                self.counters.demotions += 1
                self.counters.sync_demotions += 1
        if node.tiers & NVME:
            self.pool.delete(node.hash)
            self.index.drop_tier(node, POOL)
            self.counters.pool_evictions += 1
            return True
        if node.children == 0:
            self.counters.dropped_no_room += 1
            self.counters.pool_evictions += 1
            self.leaving(node)
            self.drop(node)
            return True
        return False

    def promote(self, node: Node, slab: int = 0) -> None:
        """Copy an NVMe-only chunk into a pool block of ``slab`` (the reader's device). The
        caller has pinned ``node``.

        Raises :class:`TierFull` when no block can be freed and
        :class:`CorruptChunk` when the NVMe copy fails its checksum (the
        NVMe tier has already deleted it; call :meth:`drop_corrupt`).
        """
        assert self.nvme is not None and node.tiers & NVME
        layout, _ = self._layout_of(node.layout_id)
        if not self.pool_room(layout.chunk_bytes, slab):
            raise TierFull("the pool is full of leased chunks; cannot promote from NVMe")
        slot = self.pool.reserve(layout.chunk_bytes, slab)
        try:
            nvme = self.nvme
            self.pool.write_with(slot, lambda dest: nvme.read_into(node.hash, dest))
        except BaseException:
            self.pool.abort(slot)
            raise
        self.pool.commit(slot, self.meta_of(node))
        self.index.add_tier(node, POOL, slot.offset)
        self.counters.promotions += 1

    # -- NVMe ----------------------------------------------------------------------

    def nvme_room(self, nbytes: int) -> bool:
        """Drop NVMe copies of unpinned leaves, oldest first, until ``nbytes`` fit."""
        assert self.nvme is not None
        while not self.nvme.can_admit(nbytes):
            victim = self.index.nvme_leaves.pop()
            if victim is None:
                return False
            if victim.tiers == NVME:
                self.leaving(victim)
            self.nvme.delete(victim.hash)
            self.counters.nvme_evictions += 1
            if not self.index.drop_tier(victim, NVME):
                self.index.remove(victim)
            if not self.nvme.admitting and self.nvme.used_bytes <= self.nvme.capacity_bytes // 2:
                self.nvme.resume_admission()
        return True

    def write_nvme(self, node: Node, data: memoryview) -> bool:
        """Give ``node`` an NVMe copy of ``data``. False (logged) if NVMe cannot take it."""
        assert self.nvme is not None
        nbytes = data.nbytes
        for attempt in (0, 1):
            if not self.nvme.admitting:
                # A full map/disk stopped admission: free a tenth of the tier, then retry.
                self.shrink_nvme()
            if not self.nvme_room(nbytes):
                return False
            slot = self.nvme.reserve(nbytes)
            try:
                self.nvme.write(slot, data)
                self.nvme.commit(slot, self.meta_of(node))
            except TierFull as e:
                self.nvme.abort(slot)
                log.warning("NVMe tier full while writing %s (attempt %d): %s", node.hash.hex(), attempt + 1, e,
                            extra={"event": "tier_full", "tier": "nvme", "error_kind": "resource_exhausted"})
                continue
            except BaseException:
                self.nvme.abort(slot)
                raise
            self.index.add_tier(node, NVME)
            return True
        return False

    def shrink_nvme(self) -> None:
        """Free a tenth of the NVMe tier (oldest leaves first) and resume admission after a full map/disk."""
        assert self.nvme is not None
        target = self.nvme.used_bytes - max(self.nvme.used_bytes // 10, 1)
        while self.nvme.used_bytes > target:
            victim = self.index.nvme_leaves.pop()
            if victim is None:
                break
            if victim.tiers == NVME:
                self.leaving(victim)
            self.nvme.delete(victim.hash)
            self.counters.nvme_evictions += 1
            if not self.index.drop_tier(victim, NVME):
                self.index.remove(victim)
        self.nvme.resume_admission()

    # -- dropping ------------------------------------------------------------------

    def drop(self, node: Node) -> int:
        """Remove an unpinned leaf from every tier and the index; returns bytes freed."""
        freed = 0
        if node.tiers & POOL:
            freed += self.pool.locate(node.hash)[1]
            self.pool.delete(node.hash)
        if node.tiers & NVME and self.nvme is not None:
            try:
                self.nvme.delete(node.hash)
            except ChunkNotCached:  # pragma: no cover - delete returns False instead
                pass
            layout, _ = self._layout_of(node.layout_id)
            freed += layout.chunk_bytes
        self.index.remove(node)
        return freed

    def drop_corrupt(self, node: Node) -> int:
        """Detach a chunk whose NVMe bytes are corrupt, with its now unreachable subtree."""
        removed = self.index.detach_subtree(node)
        for n in removed:
            if n.tiers & NVME and self.nvme is not None:
                self.nvme.delete(n.hash)
            n.tiers &= ~int(NVME)
            self.free_detached(n)
        self.counters.corrupt_dropped += 1
        log.error("dropped corrupt chunk %s and %d descendants", node.hash.hex(), len(removed) - 1,
                  extra={"event": "corrupt_chunk", "tier": "nvme", "layout_id": node.layout_id})
        return len(removed)

    def free_detached(self, node: Node) -> None:
        """Free the pool block of a detached chunk once nobody pins it any more."""
        if node.refcount == 0 and node.tiers & POOL:
            self.pool.delete(node.hash)
            node.tiers = 0

    def read(self, node: Node) -> memoryview:
        """The chunk's bytes from the fastest tier that has them."""
        if node.tiers & POOL:
            return self.pool.read(node.hash)
        if node.tiers & NVME and self.nvme is not None:
            return self.nvme.read(node.hash)
        raise ChunkNotCached(f"chunk {node.hash.hex()} lives in no tier")


__all__ = ["Mover", "CorruptChunk"]
