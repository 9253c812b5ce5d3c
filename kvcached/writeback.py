"""Write-back off the request path: batched demotion of pool chunks to NVMe.

A pool chunk without an NVMe copy is *dirty*: evicting it means writing it to
disk first (one fsync'd LMDB transaction, ~2 ms here). If that happens inside a
reservation, under the store lock, every put waits for the disk. Instead a
background thread keeps the pool's free space at or above ``writeback_low`` of
the pool: when it falls below, it takes the unpinned chunks next in eviction
order (:mod:`kvcached.index.eviction`), writes the dirty ones to NVMe in **one transaction and one sync per
batch** (up to ``writeback_batch_bytes``), and evicts pool copies until
``writeback_high`` is free. Chunks it wrote but did not need to evict stay in
the pool *clean*: evicting them later costs no I/O.

Phases of a batch (:class:`Batch`), so that the disk I/O runs outside the lock:

1. ``prepare`` (store lock held): pick victims in eviction order; evict clean ones at
   once; *pin* the dirty ones without touching their recency (so nothing
   evicts, drops or reuses their bytes while they are written), take the NVMe
   room the batch needs (leaf victims to delete in the same transaction) and
   collect each chunk's metadata and pool location.
2. ``write`` (no lock): read the pinned chunks' bytes from the pool and run one
   LMDB write transaction (:meth:`kvcached.tiers.nvme.NvmeTier.write_batch`).
3. ``finish`` (lock held): account the transaction, mark the chunks as on NVMe,
   unpin them, evict the pool copies still needed to reach the goal.

``flush`` and write-through commits run the same three phases with the lock
held throughout (they are allowed to wait for the disk). A crash between the
phases loses nothing that was durable: a chunk counts as on NVMe only after
its transaction committed, and a record written for a chunk that was dropped
meanwhile is an orphan the next index rebuild discards.

Backpressure: a reservation that needs more room than is free waits (the store
lock released, bounded by ``writeback_wait``) while the writer makes progress,
counted in ``writeback_waits`` / ``writeback_wait_seconds``; if the writer
cannot keep up it falls back to demoting synchronously (``sync_demotions``).
Records of an older format (``NvmeTier.legacy``) count as dirty, so they are
rewritten in the current format when their chunk is demoted again.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvcached.config import StoreConfig
from kvcached.index import Node, PrefixIndex
from kvcached.contract.keys import ChunkHash, KVLayout, LayoutId
from kvcached.contract.locations import NVME, POOL
from kvcached.movement import OTHER_SLAB_SCAN, Mover
from kvcached.stats import Counters
from kvcached.contract.record import ChunkMeta
from kvcached.tiers.base import Slot
from kvcached.tiers.nvme import BatchResult, NvmeTier
from kvcached.tiers.packed import PackedPool
from kvcached.contract.record import HEADER_SIZE

log = logging.getLogger(__name__)


@dataclass
class Batch:
    """One write-back transaction in the making (see the module docstring)."""

    nodes: list[Node] = field(default_factory=list)  # pinned while the batch runs, in eviction order
    dirty: list[Node] = field(default_factory=list)  # those without a current NVMe record: written
    metas: list[ChunkMeta] = field(default_factory=list)  # of each dirty node
    where: list[tuple[int, int]] = field(default_factory=list)  # (pool offset, nbytes) of each dirty node
    last_use: list[float] = field(default_factory=list)  # before the pin: unchanged means "not used since"
    deletes: list[ChunkHash] = field(default_factory=list)  # NVMe victims, deleted in the same transaction
    slot: Slot | None = None  # the NVMe space taken for the batch
    result: BatchResult | None = None

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.where)


class WriteBack:
    """The write-back thread of one store. Methods marked "lock held" are called under the
    store's lock (``cond``'s lock); the thread takes it itself around each phase."""

    def __init__(
        self,
        cond: threading.Condition,
        config: Callable[[], StoreConfig],
        index: PrefixIndex,
        pool: PackedPool,
        nvme: NvmeTier,
        mover: Mover,
        counters: Counters,
        layout_of: Callable[[LayoutId], tuple[KVLayout, ChunkHash]],
        clock: Callable[[], float],
    ) -> None:
        self.cond = cond
        self._config = config
        self.index = index
        self.pool = pool
        self.nvme = nvme
        self.mover = mover
        self.counters = counters
        self._layout_of = layout_of
        self._clock = clock
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.busy = False  # a batch's disk I/O is running outside the lock
        self._need = 0  # the largest free run a waiting reservation needs
        self._need_slab = 0  # ... in this pool slab
        self._leftover: list[ChunkHash] = []  # NVMe victims of a failed batch, deleted by the next
        self.stalled = False  # the last attempt could free nothing (all pinned, or NVMe full)

    # -- thread ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvcached-writeback", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread after its current batch (lock NOT held: it joins the thread)."""
        with self.cond:
            self._stopping = True
            self.cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def _goal(self, slab: int) -> int:
        """Free bytes of ``slab`` to reach once a batch starts (lock held)."""
        need = self._need if slab == self._need_slab else 0
        return max(int(self._config().writeback_high * self.pool.slab_capacity(slab)), need)

    def _wanted_slab(self) -> int | None:
        """The pool slab below its low watermark (or that a waiting reservation needs room in),
        None if none: each slab (one per GPU) keeps its own free space."""
        pool = self.pool
        if self._need > 0 and not pool.can_admit(self._need, self._need_slab):
            return self._need_slab
        low = self._config().writeback_low
        for k in range(pool.slabs):
            if pool.slab_free_bytes(k) < int(low * pool.slab_capacity(k)):
                return k
        return None

    def _wanted(self) -> bool:
        return self._wanted_slab() is not None

    def _run(self) -> None:
        backoff = 0.0
        with self.cond:
            while not self._stopping:
                if backoff or not self._wanted():
                    self.cond.wait(timeout=backoff or 0.5)
                    backoff = 0.0
                    continue
                try:
                    progressed = self._one_batch()
                except Exception as e:  # never let the thread die: puts fall back to synchronous demotion
                    log.error("write-back batch failed: %s", e, exc_info=e,
                              extra={"event": "writeback_error", "tier": "nvme"})
                    progressed = False
                self.stalled = not progressed
                self.cond.notify_all()
                if not progressed:
                    backoff = 0.2  # nothing to do until something is unpinned or committed

    def _one_batch(self) -> bool:
        """Lock held on entry and exit; released around the disk I/O. True if it freed or cleaned anything."""
        slab = self._wanted_slab()
        if slab is None:
            return True
        free_before = self.pool.slab_free_bytes(slab)
        batch = self.prepare(self._goal(slab), self._config().writeback_batch_bytes, evict_clean=True, slab=slab)
        if batch is None:
            return self.pool.slab_free_bytes(slab) > free_before
        self.busy = True
        self.cond.release()
        try:
            self.write(batch)
        finally:
            self.cond.acquire()
            self.busy = False
        written = self.finish(batch, evict_to=self._goal(slab), slab=slab)
        return written > 0 or self.pool.slab_free_bytes(slab) > free_before

    # -- waiting (lock held) ------------------------------------------------------------------

    def kick(self) -> None:
        """Wake the thread if the pool is below its low watermark (lock held; cheap)."""
        if self._thread is not None and self._wanted():
            self.cond.notify_all()

    def wait_room(self, nbytes: int, timeout: float, slab: int = 0) -> bool:
        """Wait (releasing the lock) until a run of ``nbytes`` fits in ``slab``, the writer can
        do nothing more, or ``timeout`` passes. True if it fits now. Lock held."""
        if self._thread is None or self.pool.can_admit(nbytes, slab):
            return self.pool.can_admit(nbytes, slab)
        t0 = time.monotonic()
        deadline = t0 + timeout
        if self._need_slab != slab:
            self._need = 0
        self._need = max(self._need, nbytes)
        self._need_slab = slab
        self.stalled = False
        self.cond.notify_all()
        try:
            while not self.pool.can_admit(nbytes, slab) and not self._stopping:
                left = deadline - time.monotonic()
                if left <= 0 or (self.stalled and not self.busy):
                    break
                self.cond.wait(timeout=left)
        finally:
            self._need = 0
            waited = time.monotonic() - t0
            self.counters.writeback_waits += 1
            self.counters.writeback_wait_seconds += waited
        ok = self.pool.can_admit(nbytes, slab)
        if not ok and time.monotonic() >= deadline:
            self.counters.writeback_wait_timeouts += 1
            log.warning("a reservation waited %.2f s for write-back to free %d bytes; demoting synchronously "
                        "(the disk is slower than the puts)", waited, nbytes,
                        extra={"event": "writeback_backpressure", "tier": "nvme"})
        return ok

    def quiesce(self) -> None:
        """Wait until no batch is writing outside the lock (lock held)."""
        while self.busy:
            self.cond.wait()

    # -- synchronous users (lock held throughout) ------------------------------------------------

    def step(self, goal: int | None = None) -> int:
        """One batch now, on the caller's thread, the lock held throughout (what the thread does,
        deterministically: the stateful tests interleave it with every other operation). Frees
        up to ``goal`` bytes (default: the high watermark). Returns chunks written."""
        self.quiesce()
        goal = self._goal(0) if goal is None and self.pool.slabs == 1 else goal
        if goal is None:  # several slabs: the whole pool's high watermark
            goal = int(self._config().writeback_high * self.pool.capacity_bytes)
        batch = self.prepare(goal, self._config().writeback_batch_bytes, evict_clean=True)
        if batch is None:
            return 0
        self.write(batch)
        return self.finish(batch, evict_to=goal)

    def write_nodes(self, nodes: Sequence[Node], *, demotion: bool = True) -> int:
        """Give ``nodes`` (in the pool, without a current NVMe record) NVMe copies in batches,
        one transaction each, without evicting anything: flush and write-through. Returns how
        many were written."""
        self.quiesce()
        limit = self._config().writeback_batch_bytes
        written = 0
        todo = [n for n in nodes if n.tiers & POOL and self._dirty(n)]
        while todo:
            size = 0
            k = 0
            while k < len(todo) and (k == 0 or size + self.pool.locate(todo[k].hash)[1] <= limit):
                size += self.pool.locate(todo[k].hash)[1]
                k += 1
            part, todo = todo[:k], todo[k:]
            batch = self._pin(part)
            if not self._nvme_room(batch):
                self._release(batch)
                break
            self.write(batch)
            got = self.finish(batch, evict_to=0, demotion=demotion)
            written += got
            if got < len(part):
                break
        return written

    # -- the three phases ----------------------------------------------------------------------------

    def _free(self, slab: int | None) -> int:
        return self.pool.free_bytes if slab is None else self.pool.slab_free_bytes(slab)

    def prepare(self, goal: int, limit: int, *, evict_clean: bool, slab: int | None = None) -> Batch | None:
        """Phase 1 (lock held): victims in eviction order until ``goal`` bytes would be free (in
        ``slab``, or in the whole pool when None; chunks of other slabs are passed over), evicting
        clean ones right away and pinning up to ``limit`` bytes of dirty ones. None if nothing dirty.

        A chunk leaves the pool leaf-first, so a parent becomes a victim only once its last
        pool child is one. The dirty children stay in the pool until the batch is written, so
        their parents never join the queue meanwhile; this walk therefore queues them itself
        (``later``), merged with the queue by the eviction policy's key, which keeps the order
        exactly the policy's: a prompt's chunks go from its end, lowest-ranked prompts first."""
        lru = self.index.pool_lru
        pool = self.pool
        picked: list[Node] = []
        picked_bytes = 0
        waiting: dict[int, int] = {}  # id(parent) -> its pool children picked so far
        later: list[tuple[float, int, Node]] = []  # parents all of whose pool children are picked
        skipped: list[Node] = []
        elsewhere: list[Node] = []  # in another slab: put back as they were
        only = slab is not None and pool.slabs > 1
        seq = 0
        while self._free(slab) + picked_bytes < goal and picked_bytes < limit:
            head = lru.peek()
            if later and (head is None or later[0][0] <= lru.key(head)):
                node = heapq.heappop(later)[2]
            else:
                popped = lru.pop()
                if popped is None:
                    break
                node = popped
            if only and pool.slab_of(node.pool_offset) != slab:
                if node.refcount == 0 and not node.pool_children:
                    elsewhere.append(node)
                if len(elsewhere) >= OTHER_SLAB_SCAN:
                    break  # this slab's chunks are far down the order; reservations evict by window
                continue
            if not self._dirty(node) and not node.pool_children:
                if evict_clean:  # a clean leaf: no I/O, evict it now (its parent may join the queue)
                    pool.delete(node.hash)
                    self.index.drop_tier(node, POOL)
                    self.counters.pool_evictions += 1
                else:
                    skipped.append(node)
                continue
            picked.append(node)
            picked_bytes += pool.locate(node.hash)[1]
            parent = node.parent
            if parent is not None and parent.refcount == 0 and parent.tiers & POOL:
                n = waiting[id(parent)] = waiting.get(id(parent), 0) + 1
                if n == parent.pool_children:
                    seq += 1
                    heapq.heappush(later, (lru.key(parent), seq, parent))
        for node in skipped:
            lru.add(node)
        for node in elsewhere:
            lru.add(node)
        if not any(self._dirty(n) for n in picked):
            for node in picked:  # clean parents of clean leaves only: nothing to write
                if node.refcount == 0 and not node.pool_children:
                    lru.add(node)
            return None
        batch = self._pin(picked)
        if not self._nvme_room(batch):
            self._release(batch)
            return None
        return batch

    def write(self, batch: Batch) -> None:
        """Phase 2 (no lock needed): one LMDB transaction for the whole batch."""
        read = self.pool._read
        views = [read(off, n) for off, n in batch.where]
        batch.result = self.nvme.write_batch(list(zip(batch.metas, views)), batch.deletes)

    def finish(self, batch: Batch, *, evict_to: int, demotion: bool = True, slab: int | None = None) -> int:
        """Phase 3 (lock held): account, mark on NVMe, unpin; evict pool copies of the batch
        (least recently used first) while fewer than ``evict_to`` bytes are free (in ``slab``,
        or the whole pool when None). Returns the chunks written."""
        result = batch.result
        assert result is not None and batch.slot is not None
        self.nvme.settle(result, [batch.slot])
        if result.error is not None:
            self._leftover.extend(batch.deletes)
            log.warning("write-back of %d chunks failed: %s", len(batch.dirty), result.error,
                        extra={"event": "tier_full", "tier": "nvme", "error_kind": "resource_exhausted"})
            self._release(batch)
            return 0
        written = 0
        for node in batch.dirty:
            if self.index.is_detached(node):
                self.nvme.delete(node.hash)  # dropped as corrupt meanwhile: its record is an orphan
                continue
            if not node.tiers & NVME:
                self.index.add_tier(node, NVME)
            else:
                self.counters.legacy_rewritten += 1
            written += 1
        self.counters.writeback_batches += 1
        self.counters.writeback_chunks += written
        self.counters.writeback_bytes += batch.nbytes
        if demotion:
            self.counters.demotions += written
        self._release(batch)
        lru = self.index.pool_lru
        for node, before in zip(batch.nodes, batch.last_use):
            if self._free(slab) >= evict_to:
                break
            if node in lru and node.last_use == before and node.tiers & NVME:
                lru.discard(node)
                self.pool.delete(node.hash)
                self.index.drop_tier(node, POOL)
                self.counters.pool_evictions += 1
        return written

    # -- internals ------------------------------------------------------------------------------

    def _dirty(self, node: Node) -> bool:
        return not node.tiers & NVME or node.hash in self.nvme.legacy

    def _pin(self, nodes: Sequence[Node]) -> Batch:
        batch = Batch(nodes=list(nodes))
        for node in nodes:
            batch.last_use.append(node.last_use)
            if self._dirty(node):
                batch.dirty.append(node)
                batch.metas.append(self.mover.meta_of(node))
                batch.where.append(self.pool.locate(node.hash))
        self.index.pin(nodes, self._clock(), touch=False)
        return batch

    def _release(self, batch: Batch) -> None:
        for node in self.index.unpin(batch.nodes, self._clock(), touch=False):
            self.mover.free_detached(node)

    def _nvme_room(self, batch: Batch) -> bool:
        """Take NVMe room for the batch: leaf victims (oldest first) to delete in its transaction.
        False if the tier cannot make that much room."""
        nvme = self.nvme
        need = sum(n + HEADER_SIZE for _, n in batch.where)
        if not nvme.admitting or self._leftover:
            # A full map or disk stopped admission (or a batch failed): delete first, one chunk per
            # transaction, as the synchronous path does (a delete can grow a full map; a batch that
            # deletes and writes in one transaction cannot free a map it has no room to touch).
            for h in self._leftover:
                nvme.delete(h)
            self._leftover = []
            if not nvme.admitting:
                self.mover.shrink_nvme()
        pending = 0  # bytes the victims free once the transaction commits
        mine = {id(n) for n in batch.nodes}  # pinned, so never leaves: a guard only
        while nvme.used_bytes - pending + need > nvme.capacity_bytes:
            victim = self.index.nvme_leaves.pop()
            if victim is None:
                # Not enough room even with every leaf gone: the victims chosen so far are out of
                # the index already, so delete their records now (rare: a tier full of pinned chunks).
                for h in batch.deletes:
                    nvme.delete(h)
                batch.deletes = []
                return False
            if id(victim) in mine:  # pragma: no cover - batch nodes are pinned, so never leaves
                continue
            layout, _ = self._layout_of(victim.layout_id)
            pending += layout.chunk_bytes + HEADER_SIZE
            if victim.tiers == NVME:
                self.mover.leaving(victim)  # its last copy: to the remote tier, if there is one
            batch.deletes.append(victim.hash)
            self.counters.nvme_evictions += 1
            if not self.index.drop_tier(victim, NVME):
                self.index.remove(victim)
        batch.slot = nvme.reserve_unchecked(need)
        return True
