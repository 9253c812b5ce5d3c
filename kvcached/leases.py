"""Leases and reservations: who holds what, until when.

This module only does bookkeeping: ids, owning sessions, deadlines. It does
not pin anything itself; the store pins index nodes when it creates an entry
and unpins them exactly once when the entry leaves the table (release,
commit, abort, expiry or session end). Because removal is the single place
that hands an entry back, a second release of the same id finds nothing and
is a no-op: release is idempotent by construction, and a lost or repeated
release can never drop someone else's pin.

Ids are random (64 bits, hex), so one client cannot guess another's lease.
Expiry uses a heap of deadlines with lazy deletion: a renewed entry leaves a
stale heap item behind that is skipped when it surfaces.

Not thread-safe; the store serialises calls.
"""

from __future__ import annotations

import heapq
import itertools
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Generic, Iterator, NewType, TypeVar

LeaseId = NewType("LeaseId", str)
ReservationId = NewType("ReservationId", str)
SessionId = NewType("SessionId", str)

P = TypeVar("P")

#: How many closed ids a table remembers, to tell "already closed" from "never existed".
CLOSED_MEMORY = 65536
_RANDOM_BATCH = 4096


@dataclass
class Entry(Generic[P]):
    """One lease or reservation. ``payload`` is the store's (pinned nodes, slots...)."""

    id: str
    session: SessionId
    payload: P
    expires_at: float
    created_at: float = field(default=0.0)


class TimedTable(Generic[P]):
    """Entries with owners and deadlines; the shared core of leases and reservations."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._entries: dict[str, Entry[P]] = {}
        self._by_session: dict[SessionId, set[str]] = {}
        self._deadlines: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self._closed: OrderedDict[str, str] = OrderedDict()  # id -> why it closed
        self._ended: OrderedDict[SessionId, None] = OrderedDict()  # sessions that ended, newest last
        self._rand = b""
        self._rand_pos = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry[P]]:
        return iter(list(self._entries.values()))

    def _new_id(self) -> str:
        """``prefix-`` + 64 random bits from the OS CSPRNG, drawn 4 KiB at a time: one
        getrandom() per 512 ids instead of one per id (an acquire's hot path)."""
        pos = self._rand_pos
        if pos >= len(self._rand):
            self._rand, pos = secrets.token_bytes(_RANDOM_BATCH), 0
        self._rand_pos = pos + 8
        return f"{self._prefix}-{self._rand[pos:pos + 8].hex()}"

    def add(self, session: SessionId, payload: P, ttl: float, now: float) -> Entry[P]:
        entry_id = self._new_id()
        entry = Entry(entry_id, session, payload, now + ttl, now)
        self._entries[entry_id] = entry
        ids = self._by_session.get(session)
        if ids is None:
            ids = self._by_session[session] = set()
        ids.add(entry_id)
        heapq.heappush(self._deadlines, (entry.expires_at, next(self._seq), entry_id))
        return entry

    def get(self, entry_id: str) -> Entry[P] | None:
        return self._entries.get(entry_id)

    def closed_reason(self, entry_id: str) -> str | None:
        """Why a recently closed id closed ("released", "expired", ...), or None if unknown."""
        return self._closed.get(entry_id)

    def remove(self, entry_id: str, why: str) -> Entry[P] | None:
        """Take an entry out of the table; None if it is not there (already removed)."""
        entry = self._entries.pop(entry_id, None)
        if entry is None:
            return None
        ids = self._by_session.get(entry.session)
        if ids is not None:
            ids.discard(entry_id)
            if not ids:
                del self._by_session[entry.session]
        self._closed[entry_id] = why
        if len(self._closed) > CLOSED_MEMORY:
            self._closed.popitem(last=False)
        if len(self._deadlines) > 2 * len(self._entries) + 1024:
            self._compact()
        return entry

    def _compact(self) -> None:
        """Drop deadline entries of removed or renewed entries (bounded memory without expire())."""
        self._deadlines = [
            d for d in self._deadlines if (e := self._entries.get(d[2])) is not None and e.expires_at == d[0]
        ]
        heapq.heapify(self._deadlines)

    def renew(self, entry_id: str, ttl: float, now: float) -> Entry[P] | None:
        entry = self._entries.get(entry_id)
        if entry is None:
            return None
        entry.expires_at = now + ttl
        heapq.heappush(self._deadlines, (entry.expires_at, next(self._seq), entry_id))
        if len(self._deadlines) > 2 * len(self._entries) + 1024:
            self._compact()
        return entry

    def of_session(self, session: SessionId) -> list[Entry[P]]:
        return [self._entries[i] for i in self._by_session.get(session, ())]

    def count(self, session: SessionId) -> int:
        """How many live entries ``session`` holds."""
        ids = self._by_session.get(session)
        return len(ids) if ids is not None else 0

    def sessions(self) -> int:
        return len(self._by_session)

    def end_session(self, session: SessionId, *, closed: bool = False) -> list[Entry[P]]:
        """Remove and return every entry of ``session``; with ``closed``, also remember that
        the session is gone for good (its id will never be used again).

        A call already past the daemon's "is this session open" check when the session ended
        (its client died with an RPC in flight) must not then pin something in the dead
        session's name: nobody would ever release it but a TTL. The caller asks
        :meth:`ended` under the same lock, before it pins. The memory is bounded
        (``CLOSED_MEMORY`` sessions); the daemon's ids are random, so an old id never comes back.
        """
        entries = self.of_session(session)
        for entry in entries:
            self.remove(entry.id, "session ended")
        if closed:
            self._ended[session] = None
            if len(self._ended) > CLOSED_MEMORY:
                self._ended.popitem(last=False)
        return entries

    def ended(self, session: SessionId) -> bool:
        """Whether ``session`` ended here (recently: see :meth:`end_session`)."""
        return session in self._ended

    def pop_expired(self, now: float) -> list[Entry[P]]:
        """Remove and return every entry whose deadline is at or before ``now``."""
        out: list[Entry[P]] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, _, entry_id = heapq.heappop(heap)
            entry = self._entries.get(entry_id)
            if entry is not None and entry.expires_at == deadline:
                self.remove(entry_id, "expired")
                out.append(entry)
        return out

    def next_deadline(self) -> float | None:
        heap = self._deadlines
        while heap:
            deadline, _, entry_id = heap[0]
            entry = self._entries.get(entry_id)
            if entry is not None and entry.expires_at == deadline:
                return deadline
            heapq.heappop(heap)
        return None
