"""The semantic response cache inside ``kvcached-router``: per request, look up, serve or let the
request through and store its answer; shadow a few semantic hits; metrics; ``/router/semantic``.

Per ``/v1/completions`` or ``/v1/chat/completions`` request (:meth:`SemanticFrontEnd.lookup`):

1. the opt-outs: ``Cache-Control`` or ``X-Cache-Control`` with ``no-cache`` (not served from
   the cache; its answer may still be stored) or ``no-store`` (its answer is not stored);
2. the request as the cache sees it (:func:`~kvcached_router.semantic.exchange.cache_request`;
   sampled requests, token-id prompts and batches pass by), the tenant (:func:`tenant_of`);
3. the exact path on the event loop; on a miss the semantic path on the one embedding thread
   (one embedding, ~15 ms, before the request is forwarded). The embedder serves one query at a
   time, so when ``max_queued_lookups`` are already waiting for it a request skips the semantic
   path (reason ``busy``) rather than queue behind them: under load the cache degrades to the
   exact path instead of adding latency without bound;
4. a hit is answered here, as JSON or replayed as a stream, with ``X-Semantic-Cache: exact`` or
   ``semantic; similarity=0.962``; a miss goes to the engine, and its answer, if it is a 200 and
   storable, is stored (the exact entry at once, its embedding on the embedding thread).

Every semantic lookup that reached a matcher observes its top-1 similarity in the
``semantic_similarity_distribution`` histogram and in the drift monitor.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvcached.contract.buckets import SIMILARITY_BUCKETS
from kvcached_client.policy import CachePolicy
from kvcached_router.config import SemanticConfig
from kvcached_router.semantic.cache import MISS, CacheLimits, CacheRequest, Lookup, SemanticCache
from kvcached_router.semantic.drift import DriftConfig, DriftMonitor, reference_counts
from kvcached_router.semantic.exchange import (CachedAnswer, answer_from_json, answer_from_sse, cache_request,
                                               kind_of, render_json, render_sse)
from kvcached_router.semantic.shadow import ShadowConfig, ShadowSampler

log = logging.getLogger("kvcached_router.semantic")

#: The daemon's buckets (0.80 to 1.00 by 0.01) and coarser ones below, where misses fall.
BUCKETS = (0.2, 0.4, 0.5, 0.6, 0.7, 0.75) + SIMILARITY_BUCKETS

#: ``shadow(path, body, headers) -> (status, raw answer)``: the router sends a request to an engine.
ShadowForward = Callable[[str, dict, dict[str, str]], Awaitable[tuple[int, bytes]]]


def request_policy(headers: Mapping[str, str]) -> CachePolicy:
    """``X-Cache-Control`` and ``Cache-Control`` together: a directive in either applies
    (:meth:`CachePolicy.from_headers` parses each)."""
    x = CachePolicy.from_headers(headers)
    std = CachePolicy.from_headers({"X-Cache-Control": v for k, v in headers.items() if k.lower() == "cache-control"})
    return CachePolicy(no_store=x.no_store or std.no_store, no_cache=x.no_cache or std.no_cache)


def tenant_of(headers: Mapping[str, str], tenant_header: str = "") -> str:
    """The tenant: the ``tenant_header`` value (when one is configured: a header the operator's
    gateway sets, since a client that could set it could read another tenant's entries), else a
    hash of the ``Authorization`` header (two API keys never share entries), else ``""``."""
    value = headers.get(tenant_header) if tenant_header else None
    if value:
        return "t:" + value
    auth = headers.get("Authorization")
    if auth:
        return "a:" + hashlib.blake2b(auth.encode(), digest_size=16).hexdigest()
    return ""


@dataclass(frozen=True)
class Pending:
    """A request that went to the engine and whose answer may be stored."""

    request: CacheRequest
    kind: str
    vector: np.ndarray | None
    max_bytes: int


class Capture:
    """Collects an upstream answer's bytes (up to a bound) so it can be stored once complete."""

    def __init__(self, front: "SemanticFrontEnd", pending: Pending) -> None:
        self.front, self.pending = front, pending
        self.parts: list[bytes] = []
        self.size = 0
        self.overflow = False

    def feed(self, piece: bytes) -> None:
        if self.overflow:
            return
        self.size += len(piece)
        if self.size > 4 * self.pending.max_bytes:  # a stream's framing is a few times its text
            self.overflow, self.parts = True, []
        else:
            self.parts.append(piece)

    def finish(self, status: int, content_type: str) -> None:
        self.front.store(self.pending, status, content_type, b"".join(self.parts), self.overflow)


class SemanticMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.similarity = Histogram("semantic_similarity_distribution", "Top-1 similarity of every semantic "
                                    "lookup that reached a matcher", buckets=BUCKETS, registry=r)
        self.lookups = Counter("kvcached_router_semantic_lookups", "Semantic cache lookups by outcome "
                               "(exact, semantic, miss, bypass) and reason", ["outcome", "reason"], registry=r)
        self.stores = Counter("kvcached_router_semantic_stores", "Answers stored, or why not", ["result"], registry=r)
        self.entries = Gauge("kvcached_router_semantic_entries", "Entries in the semantic cache", registry=r)
        self.bytes = Gauge("kvcached_router_semantic_bytes", "Bytes the semantic cache accounts for", registry=r)
        self.drift = Gauge("kvcached_router_semantic_drift_psi", "PSI of the live top-1 similarity distribution "
                           "against the reference (NaN until there are enough lookups)", registry=r)
        self.drift_alert = Gauge("kvcached_router_semantic_drift_alert", "1 while the drift alert fires", registry=r)
        self.shadow = Counter("kvcached_router_semantic_shadow", "Shadowed semantic hits: the engine's answer "
                              "agreed, disagreed, or there was none (error)", ["result"], registry=r)
        self.false_hits = Gauge("kvcached_router_semantic_shadow_false_hit_rate", "Disagreeing share of shadowed "
                                "semantic hits (NaN before the first)", registry=r)


class SemanticFrontEnd:
    """The cache, drift monitor and shadow sampler of one router (see the module docstring)."""

    def __init__(self, config: SemanticConfig, registry: CollectorRegistry, *, embedder: Any = None,
                 matcher_factory: Callable[[], Any] | None = None, shadow: ShadowForward | None = None,
                 reference: list[int] | None = None) -> None:
        self.config = config
        self.metrics = SemanticMetrics(registry)
        self.embedder = embedder
        self.cache = SemanticCache(CacheLimits(config.max_entries, config.max_bytes, config.ttl),
                                   embedder=embedder, matcher_factory=matcher_factory)
        self.drift = DriftMonitor(DriftConfig(config.drift_threshold, config.drift_min_samples, config.drift_window,
                                              config.drift_reference_samples), reference)
        self.shadow = ShadowSampler(ShadowConfig(config.shadow_rate, config.shadow_agree_similarity,
                                                 config.false_hit_bound),
                                    similar=self._similar if embedder is not None else None)
        self._shadow_forward = shadow
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="semantic")
        self._tasks: set[asyncio.Future] = set()
        self._queued = 0  # semantic lookups and embeddings waiting for or on the embedding thread
        m = self.metrics
        m.entries.set_function(lambda: len(self.cache))
        m.bytes.set_function(lambda: self.cache.bytes)
        m.drift.set_function(lambda: _nan_if_none(self.drift.psi))
        m.drift_alert.set_function(lambda: 1.0 if self.drift.alert else 0.0)
        m.false_hits.set_function(lambda: _nan_if_none(self.shadow.false_hit_rate))

    def warm_up(self) -> None:
        """Load the embedder on the embedding thread (its first encode loads the model)."""
        if self.embedder is not None:
            self._background(asyncio.get_running_loop().run_in_executor(self._pool, self.embedder.encode, ["warm up"]))

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the request path -------------------------------------------------------------------------

    async def lookup(self, request: web.Request, body: dict) -> web.Response | Capture | None:
        """A response served from the cache; or a :class:`Capture` for the engine's answer (to be
        stored); or None (not cached: bypassed, or ``no-store``)."""
        policy = request_policy(request.headers)
        req, why = cache_request(request.path, body, tenant_of(request.headers, self.config.tenant_header),
                                 cache_sampled=self.config.cache_sampled,
                                 default_temperature=self.config.default_temperature)
        m = self.metrics
        if req is None:
            m.lookups.labels("bypass", why).inc()
            return None
        found = Lookup(MISS, "no_cache")
        if policy.read:
            found = self.cache.lookup_exact(req)
            if found.reason == "no_exact" and self._queued >= self.config.max_queued_lookups:
                found = Lookup(MISS, "busy")
            elif found.reason == "no_exact":
                self._queued += 1
                try:
                    found = await asyncio.get_running_loop().run_in_executor(self._pool, self.cache.lookup_semantic,
                                                                             req)
                finally:
                    self._queued -= 1
                if found.similarity is not None:
                    m.similarity.observe(found.similarity)
                    self.drift.observe(found.similarity)
        m.lookups.labels(found.outcome if policy.read else "bypass", found.reason).inc()
        if found.hit:
            if found.outcome == "semantic" and self._shadow_forward is not None and self.shadow.should_shadow():
                self._background(asyncio.ensure_future(self._run_shadow(request.path, body, dict(request.headers),
                                                                        found.value)))
            return self._serve(found, body)
        if policy.no_store:
            m.stores.labels("no_store").inc()
            return None
        return Capture(self, Pending(req, kind_of(request.path), found.vector, self.config.max_response_bytes))

    def _serve(self, found: Lookup, body: dict) -> web.Response:
        answer: CachedAnswer = found.value
        tag = "exact" if found.outcome == "exact" else f"semantic; similarity={found.match_similarity:.3f}"
        headers = {"X-Semantic-Cache": tag}
        model = body.get("model", "")
        if body.get("stream"):
            opts = body.get("stream_options") or {}
            sse = render_sse(answer, model, include_usage=bool(opts.get("include_usage")))
            return web.Response(body=sse, headers={**headers, "Cache-Control": "no-cache"},
                                content_type="text/event-stream")
        return web.json_response(render_json(answer, model), headers=headers)

    def store(self, pending: Pending, status: int, content_type: str, raw: bytes, overflow: bool = False) -> None:
        """Store the engine's answer to a missed request (an error status is never stored)."""
        m = self.metrics
        if status != 200:
            m.stores.labels("error_status").inc()
            return
        if overflow:
            m.stores.labels("too_large").inc()
            return
        stream = content_type.startswith("text/event-stream")
        answer = answer_from_sse(pending.kind, raw) if stream else answer_from_json(pending.kind, raw)
        if answer is None:
            m.stores.labels("unstorable").inc()
            return
        if answer.size > pending.max_bytes:
            m.stores.labels("too_large").inc()
            return
        entry_id = self.cache.store_exact(pending.request, answer, answer.size)
        if entry_id is None:
            m.stores.labels("too_large").inc()
            return
        m.stores.labels("stored").inc()
        if not (self.cache.semantic and pending.request.semantic):
            return
        if pending.vector is None and self._queued >= self.config.max_queued_lookups:
            m.stores.labels("not_indexed_busy").inc()  # it would need an embedding: exact path only
            return
        fut = asyncio.get_running_loop().run_in_executor(self._pool, self.cache.index_semantic, entry_id,
                                                         pending.vector)
        if pending.vector is None:
            self._queued += 1
            fut.add_done_callback(self._unqueue)
        self._background(fut)

    def _unqueue(self, _: asyncio.Future) -> None:
        self._queued -= 1

    # -- shadow sample ----------------------------------------------------------------------------

    async def _run_shadow(self, path: str, body: dict, headers: dict[str, str], cached: CachedAnswer) -> None:
        """Ask the engine the same question and compare its answer with the cached one."""
        assert self._shadow_forward is not None
        fresh_body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        try:
            status, raw = await self._shadow_forward(path, fresh_body, headers)
        except Exception as e:  # noqa: BLE001 - a shadow request never fails anything
            log.info("shadow request failed: %s: %s", type(e).__name__, e)
            status, raw = 0, b""
        fresh = answer_from_json(kind_of(path), raw) if status == 200 else None
        if fresh is None:
            self.shadow.record_error()
            self.metrics.shadow.labels("error").inc()
            return
        loop = asyncio.get_running_loop()
        agreed = await loop.run_in_executor(self._pool, self.shadow.record, cached.text, fresh.text)
        self.metrics.shadow.labels("agree" if agreed else "disagree").inc()
        if not agreed:
            log.info("EVENT=semantic_shadow_disagree similarity_to_cached_answer=below %.2f",
                     self.config.shadow_agree_similarity, extra={"event": "semantic_shadow_disagree"})

    def _similar(self, a: str, b: str) -> float:
        v = self.embedder.encode([a, b])
        return float(np.dot(v[0], v[1]))

    def _background(self, fut: asyncio.Future) -> None:
        self._tasks.add(fut)
        fut.add_done_callback(self._done)

    def _done(self, fut: asyncio.Future) -> None:
        self._tasks.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            log.warning("semantic cache background task failed: %r", fut.exception(),
                        extra={"event": "semantic_error"})

    async def drain(self) -> None:
        """Wait for the stores and shadow requests in flight (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # -- state ------------------------------------------------------------------------------------

    def summary(self) -> dict:
        """For ``/router/state``: entries and the shadow-measured false-hit rate."""
        shadow = self.shadow.state()
        return {"entries": len(self.cache), "bytes": self.cache.bytes, "drift_alert": self.drift.alert,
                "shadow_false_hit_rate": shadow["false_hit_rate"],
                "shadow_compared": shadow["agree"] + shadow["disagree"]}

    def state(self) -> dict:
        lookups: dict[str, dict[str, float]] = {}
        for metric in self.metrics.lookups.collect():
            for s in metric.samples:
                if s.name.endswith("_total"):
                    lookups.setdefault(s.labels["outcome"], {})[s.labels["reason"]] = s.value
        return {"enabled": True, "match": self.cache.semantic, "cache": self.cache.state(), "lookups": lookups,
                "drift": self.drift.state(), "shadow": self.shadow.state()}

    async def handle_state(self, request: web.Request) -> web.Response:
        return web.json_response(self.state())


def _nan_if_none(x: float | None) -> float:
    return math.nan if x is None else x


def build(config: SemanticConfig, registry: CollectorRegistry, shadow: ShadowForward | None = None,
          embedder: Any = None) -> SemanticFrontEnd:
    """The router's front end from its ``[semantic]`` settings: the embedder and the matcher with
    the calibrated thresholds (``calibration``, else the shipped one), or the exact path only
    (``match = false``)."""
    reference = None
    factory = None
    if config.match:
        from kvcached_router.semantic.embed import make_embedder

        embedder = embedder if embedder is not None else make_embedder(config.embedder)
        factory, calibration = matcher_factory(config, embedder)
        if calibration is not None and config.drift_reference == "calibration":
            reference = reference_counts(calibration)
    else:
        embedder = None
    return SemanticFrontEnd(config, registry, embedder=embedder, matcher_factory=factory, shadow=shadow,
                            reference=reference)


def matcher_factory(config: SemanticConfig, embedder: Any) -> tuple[Callable[[], Any], Any]:
    """A factory of matchers with the calibration's thresholds, and the calibration (None
    without a calibration file: the matcher's defaults). Each scope has its own matcher, and
    most scopes hold a few entries: their vector rows start at 16 (doubling when full), not at
    the index's default of 1024 (1.5 MB of MiniLM rows per scope)."""
    from kvcached_router.semantic.matcher import SemanticMatcher
    from kvcached_router.semantic.vectors import SearchConfig

    from kvcached_router.semantic.calibrate import Calibration, shipped_calibration

    calibration = None
    if config.calibration:
        calibration = Calibration.load(config.calibration)
    else:
        calibration = shipped_calibration(getattr(embedder, "name", ""))
    search = SearchConfig(initial_capacity=16)
    return (lambda: SemanticMatcher(embedder, calibration, search=search)), calibration

