"""The read path: what an acquire does after it has matched and pinned the prefix.

Promotion of NVMe-only chunks into the pool (on failure the lease is truncated before the
chunk that could not be promoted; a corrupt chunk is dropped with its subtree), prefetch
along the most recently used branch, and the lease receipt. Runs under the store lock, like
:mod:`kvcached.writes`; the store decides before calling in whether disk I/O is allowed.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from kvcached.config import StoreConfig
from kvcached.contract.errors import CorruptChunk, TierFull
from kvcached.index import Node, PrefixIndex
from kvcached.contract.keys import ChunkHash, KVLayout, LayoutId
from kvcached.leases import Entry, LeaseId
from kvcached.contract.locations import POOL
from kvcached.movement import Mover
from kvcached.receipts import LeaseReceipt
from kvcached.stats import Counters
from kvcached.tiers.packed import PackedPool

log = logging.getLogger(__name__)


class ReadPath:
    def __init__(
        self,
        index: PrefixIndex,
        pool: PackedPool,
        mover: Mover,
        counters: Counters,
        config: Callable[[], StoreConfig],
        unpin: Callable[[Sequence[Node], float], None],
    ) -> None:
        self.index = index
        self.pool = pool
        self.mover = mover
        self.counters = counters
        self._config = config  # the store's current config (TTLs may be reloaded)
        self._unpin = unpin

    def needs_promotion(self, nodes: list[Node], all_in_pool: bool) -> bool:
        """Would an acquire of ``nodes`` copy anything from NVMe (itself or by prefetch)?"""
        if not all_in_pool:
            return True
        if nodes and self._config().prefetch_distance:
            return any(not n.tiers & POOL for n in self.index.branch(nodes[-1], self._config().prefetch_distance))
        return False

    def ensure_in_pool(self, nodes: list[Node], now: float, slab: int = 0) -> list[Node]:
        """Promote NVMe-only pinned nodes into ``slab``; on failure unpin the rest and truncate."""
        for i, node in enumerate(nodes):
            if node.tiers & POOL:
                continue
            try:
                self.mover.promote(node, slab)
            except (TierFull, CorruptChunk) as e:
                self._unpin(nodes[i:], now)
                if isinstance(e, CorruptChunk):
                    self.mover.drop_corrupt(node)
                else:
                    log.warning("acquire truncated at chunk %d: %s", i, e)
                return nodes[:i]
        return nodes

    def prefetch(self, last: Node, now: float, slab: int = 0) -> None:
        """Promote NVMe-only chunks of the branch below ``last`` ahead of need.

        Follows the most recently used children for up to
        ``prefetch_distance`` chunks. The targets are pinned while this runs
        (making room must not drop one of them) and released as "just used",
        so the next prefetch does not evict what this one brought in. Stops
        at the first chunk that cannot be promoted.
        """
        targets = self.index.branch(last, self._config().prefetch_distance)
        if not any(not n.tiers & POOL for n in targets):
            return
        self.index.pin(targets, now, touch=False)  # not a use: no hit counted (the release re-dates them)
        try:
            for node in targets:
                if node.tiers & POOL:
                    continue
                try:
                    self.mover.promote(node, slab)
                except (TierFull, CorruptChunk) as e:
                    if isinstance(e, CorruptChunk):
                        self._unpin(targets, now)
                        targets = []
                        self.mover.drop_corrupt(node)
                    break
                self.counters.prefetched += 1
        finally:
            if targets:
                self._unpin(targets, now)

    def receipt(self, entry: Entry[tuple[Node, ...]], layout_id: LayoutId, layout: KVLayout,
                hashes: Sequence[ChunkHash], offsets: Sequence[int]) -> LeaseReceipt:
        """The receipt of a lease on ``entry.payload``, whose nodes' hashes and pool offsets
        (-1 for a chunk left on NVMe) the caller already collected while matching them."""
        nodes = entry.payload
        return LeaseReceipt(
            LeaseId(entry.id),
            entry.session,
            layout_id,
            len(nodes) * layout.chunk_tokens,
            tuple(hashes),
            tuple(offsets),
            layout.chunk_bytes,
            entry.expires_at,
            self.pool.generation,
        )
