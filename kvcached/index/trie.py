"""The prefix index: which chunks are cached, where, and which may be evicted.

Representation: a flat map ``chunk hash -> Node`` with parent links, which is
a prefix trie in disguise. Chunk hashes are chained (``h_i`` covers chunk i
*and* its whole prefix, see :mod:`kvcached.contract.keys`), so "the child of node P
for chunk tokens T" is simply ``map[H(P.hash || T)]``; longest-prefix match
walks the prompt's hashes in order and stops at the first miss, O(chunks).

Why not pygtrie (the design card's first choice): ``bench/studies/index_memory.py``
builds the same 1M-chunk index both ways in one run, with the same node
records and eviction queues. pygtrie wraps every node in its own ``_Node``
with a children mapping and is walked by the tuple of hashes on the path:
measured here it costs 1.33x the memory per chunk (227 vs 171 bytes), a
1.2x slower 64-chunk match and a 1.9x slower insert, for identical
behaviour. The flat map also gives O(1) access to any node by hash, which
the NVMe rebuild, eviction and corruption handling need.

Eviction bookkeeping (all incremental, see :mod:`kvcached.index.eviction`):

* ``leaves``: refcount 0 and no children at all, least recently used first.
  Only these may leave the index entirely (TTL expiry, last-tier eviction), so
  every indexed chunk always has its whole prefix indexed.
* ``pool_lru``: in the pool tier, refcount 0, and no child in the pool, in the
  eviction policy's order (the name is historical: with the default policy it
  is frequency-boosted recency, see :mod:`kvcached.index.eviction`). A pool
  copy is evicted leaf-first within the pool; the chunk may stay indexed on NVMe.
* ``nvme_leaves``: the members of ``leaves`` that have an NVMe copy, in the
  policy's order; what the NVMe tier evicts when it needs room.

Each node counts its ``hits``: the acquires that matched it (a pin that
touches) plus the commit that stored it. The policy ranks by them; a chunk
leaving the index hands its count to the policy's sketch, and a chunk
inserted again starts from the remembered count.

Observers: an optional ``observer`` (:class:`TierObserver`, e.g. the KV event stream of
:mod:`kvcached.events`) hears of every copy that appears or goes, tier by tier, in the
order the index changes; ``tokens`` is whatever the caller of :meth:`insert_chain` passed
(the index never reads it).

Not thread-safe; the store serialises all calls.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Protocol, Sequence

from kvcached.contract.errors import InternalInvariantError, RefcountUnderflow
from kvcached.index.eviction import EvictionPolicy, EvictionQueue, LruPolicy
from kvcached.contract.keys import ChunkHash, LayoutId
from kvcached.contract.locations import NVME, POOL, TierId

_IN_LEAVES = 1
_IN_POOL_LRU = 2
_IN_NVME_LEAVES = 4
_DETACHED = 8
_QUEUED = _IN_LEAVES | _IN_POOL_LRU | _IN_NVME_LEAVES
#: The most NVMe-queue members re-ranked in one go when the policy changes its weight.
RERANK_LIMIT = 1 << 15


class TierObserver(Protocol):
    """Told of each copy of a chunk that appears in or leaves a tier (``tier``: one or more bits)."""

    def stored(self, nodes: Sequence["Node"], tier: int, tokens: object = None) -> None: ...

    def removed(self, nodes: Sequence["Node"], tier: int) -> None: ...


class Node:
    """One cached chunk. Fields are mutated only by :class:`PrefixIndex`."""

    __slots__ = (
        "hash",
        "parent",
        "layout_id",
        "depth",
        "children",
        "pool_children",
        "refcount",
        "last_use",
        "tiers",
        "qflags",
        "hits",
        "hot_child",
        "pool_offset",
    )

    def __init__(
        self, h: ChunkHash, parent: "Node | None", layout_id: LayoutId, tiers: int, now: float
    ) -> None:
        self.hash = h
        self.parent = parent
        self.layout_id = layout_id
        self.depth: int = 0 if parent is None else parent.depth + 1
        self.children = 0
        self.pool_children = 0
        self.refcount = 0
        self.last_use = now
        self.tiers = int(tiers)
        self.qflags = 0
        self.hits = 1  # uses: the acquires that matched it, plus the commit that stored it
        self.hot_child: Node | None = None  # the child most recently inserted or used: the branch to prefetch
        self.pool_offset = -1  # byte offset of the pool copy, -1 without one (what a lease receipt names)

    def __repr__(self) -> str:
        return (
            f"Node({self.hash.hex()[:8]} depth={self.depth} tiers={TierId(self.tiers)!r} "
            f"ref={self.refcount} children={self.children})"
        )


class PrefixIndex:
    def __init__(self, policy: EvictionPolicy | None = None) -> None:
        self._nodes: dict[ChunkHash, Node] = {}
        self.policy: EvictionPolicy = policy if policy is not None else LruPolicy()
        self.leaves: EvictionQueue[Node] = EvictionQueue(_IN_LEAVES)  # by last use: TTL expiry walks it oldest first
        key = None if self.policy.by_last_use else self.policy.key  # None: last use, inline
        self.pool_lru: EvictionQueue[Node] = EvictionQueue(_IN_POOL_LRU, key)
        self.nvme_leaves: EvictionQueue[Node] = EvictionQueue(_IN_NVME_LEAVES, key)
        self.pinned_in_pool = 0  # nodes with refcount > 0 and a pool copy: the pool's leased chunks
        self.newest_use = 0.0  # the latest last_use given to any node (the recency span's young end)
        self.observer: TierObserver | None = None

    # -- queries ------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, h: ChunkHash) -> bool:
        return h in self._nodes

    def get(self, h: ChunkHash) -> Node | None:
        return self._nodes.get(h)

    def nodes(self) -> Iterator[Node]:
        return iter(list(self._nodes.values()))

    def match(self, hashes: Sequence[ChunkHash]) -> list[Node]:
        """Nodes of the longest cached prefix of ``hashes``. Read-only."""
        return self.match_located(hashes)[0]

    def match_located(self, hashes: Sequence[ChunkHash]) -> tuple[list[Node], list[int]]:
        """:meth:`match`, plus each matched node's pool offset (-1: no pool copy), collected in
        the same pass (the acquire hot path). Read-only."""
        out: list[Node] = []
        offsets: list[int] = []
        get = self._nodes.get
        for h in hashes:
            node = get(h)
            if node is None:
                break
            out.append(node)
            offsets.append(node.pool_offset)
        return out, offsets

    # -- structure ----------------------------------------------------------

    def insert(
        self, h: ChunkHash, parent: Node | None, layout_id: LayoutId, tiers: int, now: float,
        pool_offset: int = -1,
    ) -> Node:
        """Add a chunk whose parent is already indexed (or a first chunk). A chunk with a pool
        copy comes with that copy's byte offset."""
        if bool(tiers & POOL) != (pool_offset >= 0):
            raise InternalInvariantError(f"chunk {h.hex()}: a pool offset goes with the pool tier, and only with it")
        if h in self._nodes:
            raise InternalInvariantError(f"chunk {h.hex()} is already indexed")
        if parent is not None and self._nodes.get(parent.hash) is not parent:
            raise InternalInvariantError(f"parent {parent.hash.hex()} of {h.hex()} is not indexed")
        if not tiers:
            raise InternalInvariantError("a chunk must live in at least one tier")
        node = Node(h, parent, layout_id, tiers, now)
        node.pool_offset = pool_offset
        node.hits = self.policy.initial_hits((h,))[0]
        self.policy.used(1, now)
        self._nodes[h] = node
        self.newest_use = max(self.newest_use, now)
        if parent is not None:
            parent.hot_child = node
            parent.children += 1
            if tiers & POOL:
                parent.pool_children += 1
            self._refresh(parent)
        self._refresh(node)
        if self.observer is not None:
            self.observer.stored((node,), int(tiers))
        return node

    def insert_chain(
        self, hashes: list[ChunkHash], parent: Node | None, layout_id: LayoutId, tiers: int, now: float,
        pool_offsets: Sequence[int] = (), tokens: object = None,
    ) -> list[Node]:
        """Insert consecutive chunks under ``parent`` in one go.

        Same result as repeated :meth:`insert`, but only the new leaf (and
        the parent) are queued: inner nodes of the chain are never evictable
        and would only leave stale heap entries behind.
        """
        if not hashes:
            return []
        if tiers & POOL and (len(pool_offsets) != len(hashes) or min(pool_offsets) < 0):
            raise InternalInvariantError("chunks inserted into the pool tier need one pool offset each")
        for h in hashes:
            if h in self._nodes:
                raise InternalInvariantError(f"chunk {h.hex()} is already indexed")
        if parent is not None and self._nodes.get(parent.hash) is not parent:
            raise InternalInvariantError(f"parent {parent.hash.hex()} is not indexed")
        if not tiers:
            raise InternalInvariantError("a chunk must live in at least one tier")
        pool = 1 if tiers & POOL else 0
        self.newest_use = max(self.newest_use, now)
        out: list[Node] = []
        prev = parent
        hits = self.policy.initial_hits(hashes)
        self.policy.used(len(hashes), now)
        for i, h in enumerate(hashes):
            node = Node(h, prev, layout_id, tiers, now)
            node.hits = hits[i]
            if pool:
                node.pool_offset = pool_offsets[i]
            self._nodes[h] = node
            if prev is not None:
                prev.hot_child = node
                prev.children += 1
                prev.pool_children += pool
            out.append(node)
            prev = node
        if parent is not None:
            self._refresh(parent)
        self._refresh(out[-1])
        if self.observer is not None:
            self.observer.stored(out, int(tiers), tokens)
        return out

    def remove(self, node: Node) -> None:
        """Drop a chunk from the index. Only a leaf with no pins may go."""
        if node.children or node.refcount:
            raise InternalInvariantError(
                f"cannot remove {node!r}: it has children or pins (leaf-first eviction violated)"
            )
        if self._nodes.get(node.hash) is not node:
            raise InternalInvariantError(f"{node!r} is not indexed")
        if self.observer is not None and node.tiers:
            self.observer.removed((node,), node.tiers)
        del self._nodes[node.hash]
        self._dequeue(node)
        self.policy.forget(node)
        parent = node.parent
        if parent is not None:
            if parent.hot_child is node:
                parent.hot_child = None
            parent.children -= 1
            if node.tiers & POOL:
                parent.pool_children -= 1
            self._refresh(parent)
        node.tiers = 0
        node.pool_offset = -1

    def add_tier(self, node: Node, tier: int, pool_offset: int = -1) -> None:
        """Record a new copy of ``node``; a pool copy comes with its byte offset."""
        if node.tiers & tier:
            return
        if bool(tier & POOL) != (pool_offset >= 0):
            raise InternalInvariantError(f"{node!r}: a pool offset goes with the pool tier, and only with it")
        if tier & POOL:
            node.pool_offset = pool_offset
        node.tiers |= int(tier)
        if tier & POOL and node.refcount:
            self.pinned_in_pool += 1
        if tier & POOL and node.parent is not None:
            node.parent.pool_children += 1
            self._refresh(node.parent)
        self._refresh(node)
        if self.observer is not None:
            self.observer.stored((node,), int(tier))

    def drop_tier(self, node: Node, tier: int) -> int:
        """Forget that ``node`` lives in ``tier``; returns the tiers left.

        The caller removes the node when none are left (it must be a leaf).
        """
        if not node.tiers & tier:
            return node.tiers
        if node.refcount and tier & POOL:
            raise InternalInvariantError(f"evicting the pool copy of pinned {node!r}")
        node.tiers &= ~int(tier)
        if tier & POOL:
            node.pool_offset = -1
        if tier & POOL and node.parent is not None:
            node.parent.pool_children -= 1
            self._refresh(node.parent)
        self._refresh(node)
        if self.observer is not None:
            self.observer.removed((node,), int(tier))
        return node.tiers

    # -- pins and recency -----------------------------------------------------

    def pin(self, nodes: Iterable[Node], now: float, *, touch: bool = True) -> None:
        """Pin ``nodes`` (never evicted or dropped while pinned). A pin that touches is a use
        (an acquire): each node's recency and ``hits``. ``touch=False`` changes neither: the
        write-back thread pins chunks while it writes them, which is no use."""
        n = 0
        for node in nodes:
            n += 1
            node.refcount += 1
            if touch:
                node.last_use = now
                node.hits += 1
                if now > self.newest_use:
                    self.newest_use = now
            if node.refcount == 1 and node.tiers & POOL:
                self.pinned_in_pool += 1
            if node.qflags & _QUEUED:
                self._dequeue(node)
        if touch and n:
            self.policy.used(n, now)

    def unpin(self, nodes: Iterable[Node], now: float, *, touch: bool = True) -> list[Node]:
        """Release one pin on each node; a release refreshes recency (not ``hits``: the pin
        that it ends was the use).

        Raises :class:`RefcountUnderflow` instead of clamping: an unpin
        without a matching pin is a bookkeeping bug that would otherwise let
        a chunk in use be evicted. Returns the detached nodes (see
        :meth:`detach_subtree`) that nobody pins any more, whose bytes the
        caller must now free.
        """
        nodes = list(nodes)
        for node in nodes:
            if node.refcount <= 0:
                raise RefcountUnderflow(f"unpin of {node!r} whose refcount is already {node.refcount}")
        freed: list[Node] = []
        for node in nodes:
            node.refcount -= 1
            if touch and node.last_use < now:
                node.last_use = now
            if node.refcount == 0:
                if node.tiers & POOL:
                    self.pinned_in_pool -= 1
                if node.qflags & _DETACHED:
                    freed.append(node)
                elif not node.pool_children:  # with a child in the pool it joins no queue
                    self._refresh(node)
        return freed

    def requested(self, hashes: Sequence[ChunkHash], now: float) -> None:
        """A request asked for these chunks (its whole prompt): the policy learns from it, and
        if its keys changed scale the policy-ordered queues re-rank their members.

        Re-ranking is O(members) under the store lock (1-2 us each; switches are rare, a few per
        change of workload): the pool's queue always (it holds at most the pool's chunks), the
        NVMe tier's only up to :data:`RERANK_LIMIT` members; past that its members keep the rank
        they were queued with until they are used again or evicted (its order then mixes the
        two weights for a while)."""
        if self.policy.requested(hashes, now):
            self.pool_lru.rekey()
            if len(self.nvme_leaves) <= RERANK_LIMIT:
                self.nvme_leaves.rekey()

    def note_path(self, nodes: Sequence[Node]) -> None:
        """Record that ``nodes`` (a matched prefix) were just used in this order."""
        for parent, child in zip(nodes, nodes[1:]):
            parent.hot_child = child

    def branch(self, node: Node | None, limit: int) -> list[Node]:
        """Up to ``limit`` nodes below ``node`` along the most recently used children."""
        out: list[Node] = []
        nxt = node.hot_child if node is not None else None
        while nxt is not None and len(out) < limit:
            out.append(nxt)
            nxt = nxt.hot_child
        return out

    def touch(self, nodes: Iterable[Node], now: float) -> None:
        if now > self.newest_use:
            self.newest_use = now
        for node in nodes:
            if node.last_use < now:
                node.last_use = now
                self.leaves.touched(node)
                self.pool_lru.touched(node)
                self.nvme_leaves.touched(node)

    # -- internals ---------------------------------------------------------------

    def detach_subtree(self, top: Node) -> list[Node]:
        """Remove ``top`` and every descendant, pinned or not; O(index size).

        Only for a chunk whose bytes turned out corrupt: its descendants can
        no longer be reached. Returns the removed nodes, deepest first, with
        their ``tiers`` intact so the caller can free their bytes. Pins held
        on them stay countable (a later unpin still balances) but the nodes
        are never queued or matched again.
        """
        out = self.subtree(top)
        if self.observer is not None:
            for node in out:
                if node.tiers:
                    self.observer.removed((node,), node.tiers)
        for node in out:
            del self._nodes[node.hash]
            self._dequeue(node)
            node.qflags |= _DETACHED
        parent = top.parent
        if parent is not None:
            if parent.hot_child is top:
                parent.hot_child = None
            parent.children -= 1
            if top.tiers & POOL:
                parent.pool_children -= 1
            self._refresh(parent)
        return out

    def subtree(self, top: Node) -> list[Node]:
        """``top`` and every descendant, deepest first; O(index size)."""
        inside: set[int] = {id(top)}
        out = [top]
        for node in sorted(self._nodes.values(), key=lambda n: n.depth):
            if node.depth > top.depth and node.parent is not None and id(node.parent) in inside:
                inside.add(id(node))
                out.append(node)
        out.reverse()
        return out

    @staticmethod
    def is_detached(node: Node) -> bool:
        return bool(node.qflags & _DETACHED)

    def _dequeue(self, node: Node) -> None:
        self.leaves.discard(node)
        self.pool_lru.discard(node)
        self.nvme_leaves.discard(node)

    def _refresh(self, node: Node) -> None:
        if node.qflags & _DETACHED:
            return
        if node.refcount == 0 and node.children == 0:
            self.leaves.add(node)
            if node.tiers & NVME:
                self.nvme_leaves.add(node)
            else:
                self.nvme_leaves.discard(node)
        else:
            self.leaves.discard(node)
            self.nvme_leaves.discard(node)
        if node.refcount == 0 and node.pool_children == 0 and node.tiers & POOL:
            self.pool_lru.add(node)
        else:
            self.pool_lru.discard(node)

    def check_invariants(self) -> None:
        """Full O(n) consistency check, for tests and ``kvcachectl doctor``."""
        children: dict[ChunkHash, int] = {}
        pool_children: dict[ChunkHash, int] = {}
        for h, node in self._nodes.items():
            if node.hash != h:
                raise InternalInvariantError(f"{node!r} filed under {h.hex()}")
            if node.refcount < 0:
                raise InternalInvariantError(f"{node!r} has a negative refcount")
            if not node.tiers:
                raise InternalInvariantError(f"{node!r} lives in no tier")
            if bool(node.tiers & POOL) != (node.pool_offset >= 0):
                raise InternalInvariantError(f"{node!r} has pool offset {node.pool_offset}")
            p = node.parent
            if p is not None:
                if self._nodes.get(p.hash) is not p:
                    raise InternalInvariantError(f"{node!r} has an unindexed parent")
                children[p.hash] = children.get(p.hash, 0) + 1
                if node.tiers & POOL:
                    pool_children[p.hash] = pool_children.get(p.hash, 0) + 1
        pinned = sum(1 for n in self._nodes.values() if n.refcount and n.tiers & POOL)
        if pinned > self.pinned_in_pool:  # (detached nodes still pinned count too, outside _nodes)
            raise InternalInvariantError(f"pinned_in_pool is {self.pinned_in_pool}, the index has {pinned}")
        for h, node in self._nodes.items():
            if node.children != children.get(h, 0) or node.pool_children != pool_children.get(h, 0):
                raise InternalInvariantError(f"{node!r} has stale child counts")
            leaf = node.refcount == 0 and node.children == 0
            if leaf != (node in self.leaves):
                raise InternalInvariantError(f"{node!r} leaf-queue membership is wrong")
            pool_ev = node.refcount == 0 and node.pool_children == 0 and bool(node.tiers & POOL)
            if pool_ev != (node in self.pool_lru):
                raise InternalInvariantError(f"{node!r} pool-queue membership is wrong")
            if (leaf and bool(node.tiers & NVME)) != (node in self.nvme_leaves):
                raise InternalInvariantError(f"{node!r} NVMe-queue membership is wrong")
