"""``SemanticCache``: a response cache with an exact path and a guarded semantic path.

A front end describes each request as a :class:`CacheRequest`: the tenant, the model, the
system prompt, a ``context`` (everything else that changes the answer: earlier turns, the
sampling parameters, as canonical text) and the ``query`` (the text a user may rephrase: the
last user message, or a completion's prompt). Then:

1. **Exact path** (a dict lookup, microseconds): the key is
   :func:`kvcached_client.text.text_key` over the normalised parts (the scope's key, then the
   query), so width, punctuation and whitespace differences hit; digits and case do not.
2. **Semantic path**: one matcher per *scope* (kind, tenant, model, system prompt, context): a
   query is only ever compared with entries of its own scope, so nothing crosses tenants,
   models, system prompts, earlier turns or sampling parameters. The matcher (embedding top-k,
   the guards, the calibrated thresholds: :mod:`kvcached_router.semantic.matcher`) says hit or
   why not.

A hit returns the stored value (the response) and nothing else: the cache never touches the
daemon, so a semantic match never reuses KV computed for other tokens.

Entries expire ``ttl_s`` after they were stored and are bounded by count and by bytes (the
value's size, the query text and its embedding); the least recently used go first, and leave
their matcher with them.

Threads: the exact path and :meth:`store_exact` take one short lock and are safe on an event
loop. Embedding and matching (milliseconds) run in :meth:`lookup_semantic` and
:meth:`index_semantic`, serialised by a second lock; a front end on an event loop runs those on
one worker thread. Entries evicted or expired on the exact path are removed from their matcher
the next time the matcher lock is taken, so the exact path never waits for a match in progress;
a semantic match that lands on such an entry in between reports ``evicted`` (a miss).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, NewType, Protocol

import numpy as np

from kvcached_client.policy import CachePolicy
from kvcached_client.text import normalize, text_key

from .features import Features, analyse
from .guards import unguarded

EntryId = NewType("EntryId", int)

#: Lookup outcomes.
EXACT, SEMANTIC, MISS = "exact", "semantic", "miss"


class Matcher(Protocol):
    """What the cache needs of a matcher (``kvcached_router.semantic.matcher.SemanticMatcher``)."""

    def add(self, entry_id: Any, text: str, vector: Any = None, features: Features | None = None) -> Any: ...
    def remove(self, entry_id: Any) -> Any: ...
    def __len__(self) -> int: ...
    def match(self, text: str, vector: Any = None, features: Features | None = None) -> Any: ...


class Embedder(Protocol):
    dim: int

    def encode(self, texts: Any) -> np.ndarray: ...


@dataclass(frozen=True)
class CacheLimits:
    max_entries: int = 10_000
    max_bytes: int = 256 << 20
    ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.max_entries < 1 or self.max_bytes < 1 or self.ttl_s <= 0:
            raise ValueError("max_entries, max_bytes and ttl_s must be positive")


@dataclass(frozen=True)
class CacheRequest:
    """One request as the cache sees it. ``semantic=False`` keeps it to the exact path (a
    request whose rephrasable part is not plain text, or a conversation that does not end with a
    user's message)."""

    tenant: str
    model: str
    system: str
    context: str
    query: str
    kind: str = "chat"
    semantic: bool = True
    #: The matcher this request is compared in (all but the query).
    scope: str = field(init=False, repr=False, compare=False)
    #: ``text_key(scope, query)``. The scope's key is memoised (most requests share their system
    #: prompt and parameters with many others), so this normalises and hashes little more than
    #: the query.
    exact_key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        scope = _scope_key(self.kind, self.tenant, self.model, self.system, self.context)
        object.__setattr__(self, "scope", scope)
        object.__setattr__(self, "exact_key", text_key(scope, self.query))


@lru_cache(maxsize=1024)
def _scope_key(kind: str, tenant: str, model: str, system: str, context: str) -> str:
    return text_key(kind, tenant, model, system, context)


@dataclass(frozen=True)
class Lookup:
    """What a lookup found. ``reason``: ``exact``; the matcher's (``hit``, ``below_threshold``,
    ``guard:<why>``, ``empty``); or the cache's (``no_cache``, ``exact_only``, ``expired``,
    ``evicted``). ``similarity`` is the matcher's top-1 similarity (None when it was not asked),
    ``match_similarity`` the served entry's (on a semantic hit; the top-1 may have been refused).
    ``vector`` is the query's embedding, for :meth:`SemanticCache.index_semantic`."""

    outcome: str
    reason: str
    similarity: float | None = None
    value: Any = None
    entry_id: EntryId | None = None
    vector: np.ndarray | None = None
    match_similarity: float | None = None

    @property
    def hit(self) -> bool:
        return self.outcome != MISS


@dataclass
class _Entry:
    id: EntryId
    key: str
    scope: str
    value: Any
    size: int
    expires: float
    query: str
    semantic: bool
    indexed: bool = False


class SemanticCache:
    """The response cache (see the module docstring). ``embedder`` and ``matcher_factory`` are
    both None for an exact-only cache."""

    def __init__(self, limits: CacheLimits = CacheLimits(), *, embedder: Embedder | None = None,
                 matcher_factory: Callable[[], Matcher] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if (embedder is None) != (matcher_factory is None):
            raise ValueError("the semantic path needs both an embedder and a matcher factory")
        self.limits = limits
        self.embedder = embedder
        self._factory = matcher_factory
        self._clock = clock
        self._lock = threading.Lock()  # the entries
        self._match_lock = threading.Lock()  # the matchers
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # by exact key, least recently used first
        self._by_id: dict[EntryId, _Entry] = {}
        self._expiry: list[tuple[float, EntryId]] = []
        self._scopes: dict[str, Matcher] = {}
        self._unindex: list[tuple[str, EntryId]] = []  # (scope, id) to remove from matchers
        self._ids = itertools.count(1)
        self.bytes = 0
        self.evictions = 0
        self.expirations = 0

    @property
    def semantic(self) -> bool:
        return self.embedder is not None

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def scopes(self) -> int:
        return len(self._scopes)

    # -- lookups ----------------------------------------------------------------------------------

    def lookup(self, req: CacheRequest, policy: CachePolicy | None = None) -> Lookup:
        """The exact path, then the semantic path (blocking: it embeds the query)."""
        if policy is not None and not policy.read:
            return Lookup(MISS, "no_cache")
        found = self.lookup_exact(req)
        if found.hit or found.reason == "exact_only":
            return found
        return self.lookup_semantic(req)

    def lookup_exact(self, req: CacheRequest) -> Lookup:
        """The exact path only (no embedding; safe on an event loop). A miss's reason is
        ``exact_only`` when the semantic path does not apply, else ``no_exact``."""
        now = self._clock()
        with self._lock:
            e = self._entries.get(req.exact_key)
            if e is not None and e.expires <= now:
                self._drop(e)
                self.expirations += 1
            elif e is not None:
                self._entries.move_to_end(e.key)
                return Lookup(EXACT, "exact", 1.0, e.value, e.id)
        return Lookup(MISS, "no_exact" if self._semantic_applies(req) else "exact_only")

    def lookup_semantic(self, req: CacheRequest) -> Lookup:
        """The semantic path only: embed the query, ask its scope's matcher. Blocking. A query in a
        language the guards cannot read (:func:`guards.unguarded`) is not embedded: no candidate
        could be accepted for it."""
        if not self._semantic_applies(req):
            return Lookup(MISS, "exact_only")
        assert self.embedder is not None
        query = normalize(req.query)
        features = analyse(query)
        if unguarded(features) is not None:
            return Lookup(MISS, "guard:language")
        vector = self.embedder.encode([query])[0]
        scope = req.scope
        with self._match_lock:
            self._apply_unindex()
            m = self._scopes.get(scope)
            if m is None or len(m) == 0:
                return Lookup(MISS, "empty", None, vector=vector)
            r = m.match(query, vector, features)
        sim = float(r.top1_similarity) if r.top1_similarity is not None else None
        if r.entry_id is None:
            return Lookup(MISS, r.reason, sim, vector=vector)
        now = self._clock()
        with self._lock:
            e = self._by_id.get(EntryId(int(r.entry_id)))
            if e is None:
                return Lookup(MISS, "evicted", sim, vector=vector)
            if e.expires <= now:
                self._drop(e)
                self.expirations += 1
                return Lookup(MISS, "expired", sim, vector=vector)
            self._entries.move_to_end(e.key)
            judged = getattr(r, "similarity", None) or sim
            assert judged is not None  # an entry was matched: it has a similarity
            return Lookup(SEMANTIC, r.reason, sim, e.value, e.id, vector, float(judged))

    # -- stores -----------------------------------------------------------------------------------

    def store(self, req: CacheRequest, value: Any, size: int, vector: np.ndarray | None = None,
              policy: CachePolicy | None = None) -> EntryId | None:
        """Store ``value`` (``size`` bytes) for ``req`` on both paths (blocking: it may embed).
        None when the policy says ``no-store`` or the entry alone exceeds ``max_bytes``."""
        if policy is not None and policy.no_store:
            return None
        entry_id = self.store_exact(req, value, size)
        if entry_id is not None:
            self.index_semantic(entry_id, vector)
        return entry_id

    def store_exact(self, req: CacheRequest, value: Any, size: int) -> EntryId | None:
        """Store on the exact path only (safe on an event loop); evicts to stay within bounds.
        :meth:`index_semantic` then adds it to its matcher."""
        applies = self._semantic_applies(req)
        query = normalize(req.query)
        total = int(size) + len(query.encode()) + (4 * self.embedder.dim if applies and self.embedder else 0)
        if total > self.limits.max_bytes:
            return None
        now = self._clock()
        with self._lock:
            self._expire(now)
            old = self._entries.get(req.exact_key)
            if old is not None:
                self._drop(old)
            e = _Entry(EntryId(next(self._ids)), req.exact_key, req.scope, value, total, now + self.limits.ttl_s,
                       query, applies)
            self._entries[e.key] = e
            self._by_id[e.id] = e
            heapq.heappush(self._expiry, (e.expires, e.id))
            if len(self._expiry) > 2 * len(self._entries) + 1024:  # replaced and evicted entries' items
                self._expiry = [(x.expires, x.id) for x in self._entries.values()]
                heapq.heapify(self._expiry)
            self.bytes += total
            while len(self._entries) > self.limits.max_entries or self.bytes > self.limits.max_bytes:
                self._drop(next(iter(self._entries.values())))
                self.evictions += 1
            return e.id

    def index_semantic(self, entry_id: EntryId, vector: np.ndarray | None = None) -> bool:
        """Add a stored entry to its scope's matcher (embedding its query unless ``vector``, the
        query's embedding from the lookup, is given). False when the entry is gone or exact-only,
        and for a question in a language the guards cannot read: it could never be accepted, and
        in the index it would only take one of a query's k candidate places."""
        with self._lock:
            e = self._by_id.get(entry_id)
            if e is None or not e.semantic or e.indexed:
                return False
        assert self.embedder is not None and self._factory is not None
        features = analyse(e.query)
        if unguarded(features) is not None:
            return False
        if vector is None:
            vector = self.embedder.encode([e.query])[0]
        with self._match_lock:
            self._apply_unindex()
            with self._lock:
                if self._by_id.get(entry_id) is not e:  # evicted while we embedded
                    return False
                e.indexed = True
            m = self._scopes.get(e.scope)
            if m is None:
                m = self._scopes[e.scope] = self._factory()
            m.add(int(e.id), e.query, vector, features)
        return True

    # -- internals --------------------------------------------------------------------------------

    def _semantic_applies(self, req: CacheRequest) -> bool:
        return self.embedder is not None and req.semantic and bool(req.query.strip())

    def _drop(self, e: _Entry) -> None:
        """Forget an entry (under ``_lock``); its matcher entry is removed later (``_unindex``)."""
        del self._entries[e.key]
        del self._by_id[e.id]
        self.bytes -= e.size
        if e.indexed:
            self._unindex.append((e.scope, e.id))

    def _expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            _, entry_id = heapq.heappop(self._expiry)
            e = self._by_id.get(entry_id)
            if e is not None and e.expires <= now:
                self._drop(e)
                self.expirations += 1

    def _apply_unindex(self) -> None:
        """Remove dropped entries from their matchers (under ``_match_lock``)."""
        with self._lock:
            todo, self._unindex = self._unindex, []
        for scope, entry_id in todo:
            m = self._scopes.get(scope)
            if m is None:
                continue
            m.remove(int(entry_id))
            if len(m) == 0:
                del self._scopes[scope]

    def purge(self) -> None:
        """Drop expired entries and apply pending matcher removals now (blocking)."""
        with self._lock:
            self._expire(self._clock())
        with self._match_lock:
            self._apply_unindex()

    def state(self) -> dict:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.bytes, "scopes": len(self._scopes),
                    "max_entries": self.limits.max_entries, "max_bytes": self.limits.max_bytes,
                    "ttl_s": self.limits.ttl_s, "evictions": self.evictions, "expirations": self.expirations,
                    "semantic": self.semantic}
