"""KV events: what this daemon holds, chunk by chunk and tier by tier, as vLLM reports its own.

The messages themselves (their types, encoder and decoder) are the shared contract,
:mod:`kvcached.contract.events`; this module makes them from the index.

Routers that place requests where their prefix is cached (llm-d's KV-cache indexer, Dynamo's
KV router, kvcached-router) learn from vLLM's KV event stream. This module produces the same
events from the daemon's index, so those consumers work unchanged; the wire (ZMQ PUB frames,
a replay socket) is :mod:`kvcached.service.kv_events`.

The message types mirror ``vllm/distributed/kv_events.py`` field for field (msgspec structs,
same class names as tags, same options), so vLLM's own decoder reads what this one encodes:

* ``BlockStored``: ``block_hashes`` (the daemon's chunk ids, 16 bytes each), the parent of the
  first one (None for a prompt's first chunk), ``token_ids`` of those chunks, ``block_size``
  (the layout's chunk tokens), ``lora_name``, and ``medium``: ``GPU`` or ``CPU`` for the pool
  (a CUDA pool or host shared memory), ``DISK`` for NVMe.
* ``BlockRemoved``: ``block_hashes`` and the ``medium`` they left.
* ``AllBlocksCleared``: forget everything of this daemon; it is followed by a snapshot of what
  the daemon holds (at start, after the index was rebuilt from NVMe, and after a resync).

Events follow the index tier by tier (:class:`kvcached.index.trie.TierObserver`): a chunk
committed to the pool is ``BlockStored(CPU)`` with its token ids; written back to NVMe,
``BlockStored(DISK)``; its pool copy evicted, ``BlockRemoved(CPU)``; gone from NVMe,
``BlockRemoved(DISK)``. A chunk is on this host while any medium holds it. Token ids travel
once, when a chunk is first committed: a move between tiers, a promotion and a snapshot carry
the hashes only (``token_ids`` empty; the index does not keep tokens). Chunks in the remote
tier are not reported (Redis expires them without telling anyone).

The stream carries prompt token ids: it is as sensitive as the prompts themselves.

Concurrency: the index calls the observer under the store lock; :class:`KvEventLog` only
appends there (no I/O) and the publisher thread takes what accumulated. The log is bounded:
if the publisher falls more than ``max_pending`` events behind, the pending events are dropped
and the next batch starts with ``AllBlocksCleared`` and a snapshot (a resync), so consumers
never keep a state with a hole in it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from kvcached.contract.keys import KVLayout, LayoutId
from kvcached.contract.events import (LOCAL, MEDIUM_STORAGE, AllBlocksCleared, BlockRemoved, BlockStored,
                                      KVCacheEvent)
from kvcached.contract.locations import NVME, POOL

class KvEventLog:
    """The index's observer: turns tier changes into events, bounded, for the publisher."""

    def __init__(self, layout_of: Callable[[LayoutId], KVLayout], pool_medium: str, *,
                 snapshot: Callable[[], list[KVCacheEvent]] | None = None, max_pending: int = 100_000) -> None:
        self._layout_of = layout_of
        self.pool_medium = pool_medium
        self._snapshot = snapshot  # the store's: AllBlocksCleared + what it holds, under the store lock
        self._max = max_pending
        self._lock = threading.Lock()
        self._pending: list[KVCacheEvent] = []
        self._resync = False
        self.wakeup = threading.Event()  # set on every append: the publisher need not poll
        self.resyncs = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._pending)

    # -- the index's observer (called under the store lock) ---------------------------------------

    def stored(self, nodes: Sequence[Any], tier: int, tokens: object = None) -> None:
        layout = self._layout_of(nodes[0].layout_id)
        parent = nodes[0].parent.hash if nodes[0].parent is not None else None
        hashes = [n.hash for n in nodes]
        if tier & POOL:
            ids = np.frombuffer(tokens, dtype="<u4").tolist() if isinstance(tokens, bytes) else []
            self._append(BlockStored(hashes, parent, ids, layout.chunk_tokens, None, self.pool_medium,
                                     layout.lora_name or None, locality=LOCAL))
        if tier & NVME:
            self._append(BlockStored(list(hashes), parent, [], layout.chunk_tokens, None, MEDIUM_STORAGE,
                                     layout.lora_name or None, locality=LOCAL))

    def removed(self, nodes: Sequence[Any], tier: int) -> None:
        hashes = [n.hash for n in nodes]
        if tier & POOL:
            self._append(BlockRemoved(hashes, self.pool_medium, locality=LOCAL))
        if tier & NVME:
            self._append(BlockRemoved(list(hashes), MEDIUM_STORAGE, locality=LOCAL))

    def cleared(self) -> None:
        """Everything this daemon held is gone (an explicit evict of all)."""
        self._append(AllBlocksCleared())

    def request_resync(self) -> None:
        """Start the next batch with AllBlocksCleared and a snapshot (at start, after a rebuild)."""
        with self._lock:
            self._pending.clear()
            self._resync = True
        self.wakeup.set()

    # -- the publisher's side ----------------------------------------------------------------------

    def take(self) -> list[KVCacheEvent]:
        """What accumulated since the last call, in order; after a resync request, the snapshot."""
        with self._lock:
            if not self._resync or self._snapshot is None:
                out, self._pending = self._pending, []
                self.wakeup.clear()
                return out
        return self._snapshot()  # it calls restarted() under the store lock

    def restarted(self) -> None:
        """Called by the snapshot, under the store lock, once it has read the index: the stream
        goes on from there (changes made before are in the snapshot, later ones append)."""
        with self._lock:
            self._resync = False
            self._pending.clear()
            self.wakeup.clear()
            self.resyncs += 1

    def _append(self, event: KVCacheEvent) -> None:
        with self._lock:
            if self._resync:  # a snapshot will say it all
                return
            if len(self._pending) >= self._max:
                self.dropped += len(self._pending) + 1
                self._pending.clear()
                self._resync = True
            else:
                self._pending.append(event)
        self.wakeup.set()


def snapshot_events(nodes: Iterable[Any], layout_of: Callable[[LayoutId], KVLayout],
                    pool_medium: str) -> list[KVCacheEvent]:
    """AllBlocksCleared, then one BlockStored per chunk and medium, parents before children."""
    out: list[KVCacheEvent] = [AllBlocksCleared()]
    for node in sorted(nodes, key=lambda n: n.depth):
        layout = layout_of(node.layout_id)
        parent = node.parent.hash if node.parent is not None else None
        for bit, medium in ((POOL, pool_medium), (NVME, MEDIUM_STORAGE)):
            if node.tiers & bit:
                out.append(BlockStored([node.hash], parent, [], layout.chunk_tokens, None, medium,
                                       layout.lora_name or None, locality=LOCAL))
    return out
