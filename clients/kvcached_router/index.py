"""Which host holds which chunks: the router's picture, built from the daemons' KV events.

One :class:`HostIndex` per host. It applies that daemon's events (:mod:`kvcached.events`:
BlockStored / BlockRemoved per medium, AllBlocksCleared) and answers "how many leading chunks
of this prompt does the host hold" in O(matched chunks). A chunk is held while any medium
(pool, NVMe) holds it.

Event lag: a daemon reports the chunks a request stores only after that request's prefill,
so the next request of the same conversation, routed a moment later, would find nothing yet.
``expect`` records the chunks a routed request is about to store as *provisional* for
``provisional_ttl`` seconds: they count as held until the daemon confirms them (its
BlockStored clears the provisional mark) or the time runs out (the request failed, or the
host stored less).

Not thread-safe: the router's event loop owns every index.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from kvcached.contract.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


class HostIndex:
    def __init__(self, provisional_ttl: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.provisional_ttl = provisional_ttl
        self._clock = clock
        # Chunk hashes are the daemon's 16-byte ids; the event format also allows vLLM's int ids.
        self._held: dict[bytes | int, int] = {}  # chunk hash -> how many media hold it
        self._media: dict[str, set[bytes | int]] = {}
        self._provisional: dict[bytes | int, float] = {}  # chunk hash -> until when it counts as held
        self._expiry: deque[tuple[float, list[bytes]]] = deque()
        self.cleared = 0  # AllBlocksCleared seen (daemon starts, resyncs)
        self.events = 0
        #: The daemon's stream is down (its subscriber says so): counts as holding nothing, and
        #: what it held is kept for when the stream resumes (a restart then clears it).
        self.stale = False

    def __len__(self) -> int:
        return len(self._held)

    # -- the daemon's events -----------------------------------------------------------------------

    def apply(self, events: Iterable[KVCacheEvent]) -> None:
        for ev in events:
            self.events += 1
            if isinstance(ev, BlockStored):
                medium = self._media.setdefault(ev.medium or "", set())
                for h in ev.block_hashes:
                    if h not in medium:
                        medium.add(h)
                        self._held[h] = self._held.get(h, 0) + 1
                    self._provisional.pop(h, None)
            elif isinstance(ev, BlockRemoved):
                held_there = self._media.get(ev.medium or "")
                if held_there is None:
                    continue
                for h in ev.block_hashes:
                    if h in held_there:
                        held_there.discard(h)
                        left = self._held[h] - 1
                        if left:
                            self._held[h] = left
                        else:
                            del self._held[h]
            elif isinstance(ev, AllBlocksCleared):
                self.clear()

    def clear(self) -> None:
        """Forget everything the daemon said (it restarted, or its stream had a hole), and what
        routed requests were about to store: a restarted daemon will not receive what its
        predecessor was sent (a restart storm measured 25 % wrong routes while these lingered)."""
        self._held.clear()
        self._media.clear()
        self._provisional.clear()
        self._expiry.clear()
        self.cleared += 1

    # -- routing -------------------------------------------------------------------------------------

    def expect(self, hashes: Sequence[bytes]) -> None:
        """A request routed here will store ``hashes``: count them as held for a while."""
        if not hashes or self.stale:  # its daemon is down: the engine cannot store them now
            return
        until = self._clock() + self.provisional_ttl
        # Not renewed by later routes: an expectation the daemon never confirms (its engine
        # could not store: the daemon restarting, full, refusing) must lapse, or every request
        # routed on it renews it and the host keeps getting the prefix it does not hold (a
        # restart storm measured 25 % wrong routes that way).
        fresh = [h for h in hashes if h not in self._held and h not in self._provisional]
        for h in fresh:
            self._provisional[h] = until
        if fresh:
            self._expiry.append((until, fresh))

    def prefix(self, hashes: Sequence[bytes]) -> int:
        """How many leading chunks of ``hashes`` this host holds (or is about to)."""
        return self.prefix_value(hashes)[0]

    def prefix_value(self, hashes: Sequence[bytes], weights: dict[str, float] | None = None) -> tuple[int, float]:
        """(how many leading chunks of ``hashes`` this host holds or is about to, what they are
        worth): each chunk counted by the weight of the best medium it is on (``weights``:
        medium -> weight, 1.0 for a medium not named; None: every chunk 1.0); a chunk a routed
        request is about to store counts 1.0, as it will be in the pool. One walk: the router
        asks for both on every request."""
        if self.stale:
            return 0, 0.0
        self._expire()
        held, prov = self._held, self._provisional
        n, value = 0, 0.0
        for h in hashes:
            if h in held:
                value += 1.0 if not weights else max(weights.get(m, 1.0) for m, on in self._media.items() if h in on)
            elif h in prov:
                value += 1.0
            else:
                break
            n += 1
        return n, value

    def confirmed_prefix(self, hashes: Sequence[bytes]) -> int:
        """Like :meth:`prefix`, counting only what the daemon has confirmed."""
        if self.stale:
            return 0
        n = 0
        for h in hashes:
            if h not in self._held:
                break
            n += 1
        return n

    def _expire(self) -> None:
        now = self._clock()
        q = self._expiry
        while q and q[0][0] <= now:
            until, hashes = q.popleft()
            for h in hashes:
                if self._provisional.get(h) == until:
                    del self._provisional[h]
