"""Sending chunks to the remote tier in the background, never on a request's path.

Two queues, one thread (``kvcached-publish``):

* **Publish** (``remote_write = "async"``): a commit only appends the new chunks' hashes
  (``offer``; O(1), no I/O). The thread takes a batch, and under the store lock *pins* the
  chunks still in the pool without touching their recency (so nothing evicts or reuses their
  bytes meanwhile) and notes their metadata and pool location; it encodes and sends them
  outside the lock, straight from the pool, one pipelined round trip per Redis node; then it
  unpins them. A chunk evicted before its turn is skipped (counted).
* **Demote** (``"async"`` and ``"on_evict"``): a chunk that capacity pushes out of this host's
  last local tier is handed over as a copy of its verified bytes (``offer_demoted``, called by
  :class:`kvcached.movement.Mover` under the store lock: a memcpy, no I/O), since its local
  copy is gone once the eviction finishes. The thread sends these first: one round trip renews
  the TTL of those the remote already has, a second sends only the rest
  (:meth:`kvcached.tiers.remote_redis.RemoteRedisTier.demote`).

Both queues are bounded, by chunks (``max_queue``) and the demote queue also by bytes
(``max_bytes``): when one is full the oldest entries are dropped and counted, so under a Redis
outage nothing grows without bound, and sending resumes with what is recent once Redis is back.

Fail-open: the remote tier never raises; a failed batch is counted there and dropped here.

Collaborators, handed in as the write-back thread's are: the remote tier (sends, outside any
lock), and the store's lock, index, pool, mover and clock (pinning and unpinning a batch, under
that lock). ``offer`` and ``offer_demoted`` are called with the store lock held and take only
this module's own condition; the thread never holds both.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ContextManager

from kvcached.index import Node, PrefixIndex
from kvcached.contract.keys import ChunkHash
from kvcached.contract.locations import POOL
from kvcached.contract.record import ChunkMeta
from kvcached.tiers.packed import PackedPool

if TYPE_CHECKING:
    from kvcached.movement import Mover
    from kvcached.tiers.remote import RemoteTier

log = logging.getLogger("kvcached.remote")


class RemotePublisher:
    def __init__(self, remote: "RemoteTier", lock: ContextManager[object], index: PrefixIndex,
                 pool: PackedPool, mover: "Mover", clock: Callable[[], float], *, max_queue: int = 4096,
                 max_bytes: int = 256 << 20, batch: int = 64, publish: bool = True) -> None:
        self._remote = remote
        self._lock = lock  # the store's: guards index, pool and mover
        self._index, self._pool, self._mover, self._clock = index, pool, mover, clock
        self._queue: deque[ChunkHash] = deque()  # committed chunks to publish, read from the pool
        self._demoted: deque[tuple[ChunkMeta, bytes]] = deque()  # copies of chunks that left this host
        self._demoted_bytes = 0
        self._max = max_queue
        self._max_bytes = max_bytes
        self._batch = batch
        self.publishes = publish  # False ("on_evict"): offer() is a no-op, only demotions are sent
        self._cond = threading.Condition()
        self._stop = False
        self._stepping = threading.Lock()  # one batch at a time: drain() waits for the thread's
        self._thread: threading.Thread | None = None
        self.dropped = 0  # queue entries dropped because a queue was full
        self.skipped = 0  # chunks no longer in the pool when their turn came
        self.batches = 0

    def __len__(self) -> int:
        return len(self._queue) + len(self._demoted)

    @property
    def queued_bytes(self) -> int:
        """Payload bytes held for demotion (the publish queue holds hashes only)."""
        return self._demoted_bytes

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvcached-publish", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def offer(self, hashes: Sequence[ChunkHash]) -> None:
        """Queue committed chunks for publishing (called under the store lock: no I/O)."""
        if not self.publishes:
            return
        with self._cond:
            for h in hashes:
                if len(self._queue) >= self._max:
                    self._queue.popleft()
                    self.dropped += 1
                self._queue.append(h)
            self._cond.notify()

    def offer_demoted(self, meta: ChunkMeta, data: bytes) -> None:
        """Queue a copy of a chunk leaving this host's last local tier (under the store lock)."""
        with self._cond:
            self._demoted.append((meta, data))
            self._demoted_bytes += len(data)
            while len(self._demoted) > self._max or (self._demoted_bytes > self._max_bytes and len(self._demoted) > 1):
                _, old = self._demoted.popleft()
                self._demoted_bytes -= len(old)
                self.dropped += 1
            self._cond.notify()

    def step(self) -> int:
        """Send one batch now (the thread's body). Returns chunks sent."""
        with self._stepping:
            return self._step()

    def _step(self) -> int:
        with self._cond:
            demoted = [self._demoted.popleft() for _ in range(min(self._batch, len(self._demoted)))]
            self._demoted_bytes -= sum(len(d) for _, d in demoted)
            todo = [] if demoted else [self._queue.popleft() for _ in range(min(self._batch, len(self._queue)))]
        remote = self._remote
        if demoted:
            if remote.demote(demoted):
                self.batches += 1
                return len(demoted)
            return 0
        if not todo:
            return 0
        pinned, items = self._pin(todo)
        try:
            sent = remote.publish(items) if items else False
        finally:
            n = len(items)
            items.clear()  # the views die here, even if a failed call's traceback keeps this frame
            self._unpin(pinned)
        if sent:
            self.batches += 1
            return n
        return 0

    def _pin(self, hashes: list[ChunkHash]) -> tuple[list[Node], list[tuple[ChunkMeta, memoryview]]]:
        """Under the store lock: pin the chunks still in the pool (no recency change) and return
        them with (meta, a view of their pool bytes), valid until :meth:`_unpin`."""
        index = self._index
        nodes: list[Node] = []
        items: list[tuple[ChunkMeta, memoryview]] = []
        with self._lock:
            for h in hashes:
                node = index.get(h)
                if node is None or not node.tiers & POOL or index.is_detached(node):
                    self.skipped += 1
                    continue
                nodes.append(node)
                items.append((self._mover.meta_of(node), self._pool.read(h)))
            index.pin(nodes, self._clock(), touch=False)
        return nodes, items

    def _unpin(self, nodes: list[Node]) -> None:
        with self._lock:
            for node in self._index.unpin(nodes, self._clock(), touch=False):
                self._mover.free_detached(node)

    def drain(self) -> int:
        """Send everything queued now, the batch the thread may be sending included (tests,
        flush). Returns the chunks this call sent."""
        sent = 0
        while True:
            with self._stepping:
                if not self._queue and not self._demoted:
                    return sent
                sent += self._step()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._demoted and not self._stop:
                    self._cond.wait(1.0)
                if self._stop:
                    return
                if not self._remote.available():
                    # The breaker is open: keep what is queued (the bounds drop the oldest) and
                    # look again shortly, rather than spin through the queue sending nothing.
                    self._cond.wait(0.25)
                    continue
            try:
                self.step()
            except Exception:  # noqa: BLE001 - a publisher bug must not kill the daemon
                log.exception("remote publishing failed")
