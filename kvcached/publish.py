"""Publishing committed chunks to the remote tier in the background (``remote_write = "async"``).

A commit only appends the new chunks' hashes to a bounded queue (``offer``; O(1), no I/O); a
thread takes batches from it, copies their pool bytes under the store lock (a memcpy each), and
publishes them outside the lock, one pipelined round trip per Redis node. A chunk evicted
before its turn is skipped (it may be published again when it is committed again). When the
queue is full the oldest entries are dropped and counted: under a Redis outage the queue never
grows without bound, and publishing resumes with what is recent when Redis is back.

Fail-open: the remote tier never raises; a failed batch is counted there and dropped here.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcached.keys import ChunkHash
from kvcached.locations import POOL

if TYPE_CHECKING:
    from kvcached.store import Store

log = logging.getLogger("kvcached.remote")


class RemotePublisher:
    def __init__(self, store: "Store", *, max_queue: int = 4096, batch: int = 64) -> None:
        self._store = store
        self._queue: deque[ChunkHash] = deque()
        self._max = max_queue
        self._batch = batch
        self._cond = threading.Condition()
        self._stop = False
        self._stepping = threading.Lock()  # one batch at a time: drain() waits for the thread's
        self._thread: threading.Thread | None = None
        self.dropped = 0  # queue entries dropped because it was full
        self.skipped = 0  # chunks no longer in the pool when their turn came
        self.batches = 0

    def __len__(self) -> int:
        return len(self._queue)

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
        with self._cond:
            for h in hashes:
                if len(self._queue) >= self._max:
                    self._queue.popleft()
                    self.dropped += 1
                self._queue.append(h)
            self._cond.notify()

    def step(self) -> int:
        """Publish one batch now (the thread's body). Returns chunks sent."""
        with self._stepping:
            return self._step()

    def _step(self) -> int:
        with self._cond:
            todo = [self._queue.popleft() for _ in range(min(self._batch, len(self._queue)))]
        if not todo:
            return 0
        store = self._store
        items = []
        with store._lock:
            for h in todo:
                node = store.index.get(h)
                if node is None or not node.tiers & POOL:
                    self.skipped += 1
                    continue
                items.append((store._mover.meta_of(node), bytes(store.pool.read(h))))
        assert store.remote is not None
        if items and store.remote.publish(items):
            self.batches += 1
            return len(items)
        return 0

    def drain(self) -> int:
        """Publish everything queued now, the batch the thread may be sending included (tests,
        flush). Returns the chunks this call sent."""
        sent = 0
        while True:
            with self._stepping:
                if not self._queue:
                    return sent
                sent += self._step()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait(1.0)
                if self._stop:
                    return
            try:
                self.step()
            except Exception:  # noqa: BLE001 - a publisher bug must not kill the daemon
                log.exception("remote publishing failed")
