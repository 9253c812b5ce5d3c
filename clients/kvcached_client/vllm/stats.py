"""The connector's counters on ``vllm serve``'s own ``/metrics``, through vLLM's connector-stats hook.

The connector runs in the engine-core process (scheduler side) and in the GPU workers; the
OpenAI server's ``/metrics`` is served by the API-server process. vLLM carries connector stats
between them (0.32):

1. each worker's ``get_kv_connector_stats()`` (after every step) -> ``KVOutputAggregator``
   ``aggregate``s the workers' objects into the first one;
2. the scheduler, in ``update_from_output``, ``aggregate``s the scheduler-side connector's
   ``get_kv_connector_stats()`` into it and sends ``to_dict()`` in ``SchedulerStats``
   (msgpack: plain numbers and lists only);
3. the API server: ``KVConnectorProm`` calls the connector class's ``build_prom_metrics`` once
   and :meth:`KvcachedPromMetrics.observe` with each step's dict; ``KVConnectorLogging``
   rebuilds :class:`KvcachedConnectorStats` with ``build_kv_connector_stats(data)``, sums them
   over the log interval and logs :meth:`KvcachedConnectorStats.reduce`.

Each side keeps cumulative counters; :class:`StatsDelta` turns them into the increase since the
last step, which is what travels. Prometheus names (per engine: labels ``model_name``,
``engine``):

=============================================  ===================================================
``kvcached_vllm_requests_total``               requests the scheduler side looked up
``kvcached_vllm_hit_requests_total``           requests with a kvcached hit (some tokens loaded)
``kvcached_vllm_miss_requests_total``          requests without one
``kvcached_vllm_load_tokens_total``            prompt tokens loaded from kvcached
``kvcached_vllm_stored_chunks_total``          chunks committed to kvcached
``kvcached_vllm_lookup_failures_total``        lookups (AcquireReserve) that failed open
``kvcached_vllm_store_failures_total``         commits that failed open (scheduler side)
``kvcached_vllm_renew_failures_total``         lease renewals that failed
``kvcached_vllm_lookup_not_yet_total``         "not yet" answers (lookup still in flight)
``kvcached_vllm_lease_renewals_total``         leases renewed
``kvcached_vllm_answer_stores_total``          finished requests whose answer's chunks it set out to store
``kvcached_vllm_answer_chunks_total``          answer chunks reserved for storing
``kvcached_vllm_saves_lost_window_total``      sliding-window requests whose chunks were given up
``kvcached_vllm_loaded_blocks_total``          vLLM blocks the workers filled from kvcached
``kvcached_vllm_failed_blocks_total``          blocks reported to vLLM as load errors (recomputed)
``kvcached_vllm_expired_leases_total``         loads skipped because the lease was running out
``kvcached_vllm_store_failures_worker_total``  chunk writes that failed open (worker side)
``kvcached_vllm_fail_open_events_total``       fail-open events, both sides
``kvcached_vllm_scheduler_seconds``            histogram: scheduler-thread seconds per request
=============================================  ===================================================

Keys in the data that this module does not know are carried and summed but not exported, so
either side may add counters before this table does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from prometheus_client import REGISTRY, Counter, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

if TYPE_CHECKING:
    from vllm.config import VllmConfig

SCHEDULER_KEYS = ("requests", "hit_requests", "miss_requests", "load_tokens", "stored_chunks", "lookup_failures",
                  "store_failures", "renew_failures", "lookup_not_yet", "lease_renewals", "answer_stores",
                  "answer_chunks", "saves_lost_window")
WORKER_KEYS = ("loaded_blocks", "failed_blocks", "expired_leases", "store_failures_worker")
COUNTER_KEYS = SCHEDULER_KEYS + WORKER_KEYS + ("fail_open_events",)

DOCS = {
    "requests": "Requests the kvcached connector looked up",
    "hit_requests": "Requests with a kvcached hit (some prompt tokens loaded from kvcached)",
    "miss_requests": "Requests without a kvcached hit",
    "load_tokens": "Prompt tokens loaded from kvcached",
    "stored_chunks": "Chunks committed to kvcached",
    "lookup_failures": "kvcached lookups that failed; the request was served without the cache",
    "store_failures": "kvcached commits that failed (scheduler side); the request was served without storing",
    "renew_failures": "kvcached lease renewals that failed",
    "lookup_not_yet": "Scheduler steps that found a kvcached lookup still in flight",
    "lease_renewals": "kvcached leases renewed",
    "answer_stores": "Finished requests whose answer (generated whole chunks) the connector set out to store",
    "answer_chunks": "Answer chunks reserved in kvcached for storing (committed ones also count in stored_chunks)",
    "saves_lost_window": "Sliding-window requests whose chunks were given up (blocks vLLM may have freed)",
    "loaded_blocks": "vLLM KV blocks the workers filled from kvcached",
    "failed_blocks": "vLLM KV blocks whose kvcached load failed (recomputed)",
    "expired_leases": "kvcached loads skipped because the lease was running out",
    "store_failures_worker": "kvcached chunk writes that failed (worker side)",
    "fail_open_events": "kvcached operations that failed open, scheduler and worker sides",
}

SECONDS_KEY = "scheduler_seconds"  # per-request scheduler-thread seconds: a list, concatenated
MAX_SECONDS = 10_000  # at most this many kept in one stats object (the most recent)
SECONDS_BUCKETS = [20e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 20e-3, 50e-3]


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class KvcachedConnectorStats(KVConnectorStats):
    """``data``: counter name -> increase over the interval (summed by :meth:`aggregate`), and
    optionally ``scheduler_seconds``: a list of per-request scheduler-thread seconds (concatenated,
    at most :data:`MAX_SECONDS`, the most recent)."""

    data: dict[str, Any] = field(default_factory=dict)  # vLLM's own field, restated for its type without vLLM

    def __post_init__(self) -> None:
        clean: dict[str, Any] = {}
        for k, v in (self.data or {}).items():
            if k == SECONDS_KEY:
                secs = [float(s) for s in v or () if _number(s)]
                if secs:
                    clean[k] = secs[-MAX_SECONDS:]
            elif _number(v):
                clean[k] = v
        self.data = clean

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvcachedConnectorStats:
        """Adds ``other`` into this object (as vLLM's own stats classes do) and returns it."""
        for k, v in (other.data or {}).items():
            if k == SECONDS_KEY:
                secs = self.data.get(SECONDS_KEY, []) + [float(s) for s in v or () if _number(s)]
                if secs:
                    self.data[SECONDS_KEY] = secs[-MAX_SECONDS:]
            elif _number(v):
                self.data[k] = self.data.get(k, 0) + v
        return self

    def count(self, key: str) -> int | float:
        return self.data.get(key, 0)

    def reduce(self) -> dict[str, int | float]:
        """The interval's summary for vLLM's "KV Transfer metrics:" log line."""
        requests, hits = self.count("requests"), self.count("hit_requests")
        secs = sorted(self.data.get(SECONDS_KEY, ()))
        return {
            "Requests": requests,
            "Hit rate (%)": round(100.0 * hits / requests, 1) if requests else 0.0,
            "Loaded tokens": self.count("load_tokens"),
            "Loaded blocks": self.count("loaded_blocks"),
            "Failed blocks": self.count("failed_blocks"),
            "Stored chunks": self.count("stored_chunks"),
            "Fail-open events": self.count("fail_open_events"),
            "Scheduler p50 (ms)": round(_percentile(secs, 50) * 1e3, 3),
            "Scheduler p99 (ms)": round(_percentile(secs, 99) * 1e3, 3),
        }

    def is_empty(self) -> bool:
        return not self.data.get(SECONDS_KEY) and not any(
            v for k, v in self.data.items() if k != SECONDS_KEY)

    def to_dict(self) -> dict[str, Any]:
        """Plain numbers and a list of floats: what msgpack carries to the API server."""
        return {k: (list(v) if k == SECONDS_KEY else v) for k, v in self.data.items()}


def _percentile(sorted_values: list[float], p: float) -> float:
    """Nearest-rank percentile of an ascending list; 0 for an empty one."""
    if not sorted_values:
        return 0.0
    rank = max(1, -(-len(sorted_values) * p // 100))  # ceil(n * p / 100), at least 1
    return sorted_values[int(rank) - 1]


class StatsDelta:
    """The increase of cumulative counters since the last :meth:`take`.

    ``counters`` returns the current cumulative counters; ``drain_seconds`` (optional) returns
    the per-request seconds recorded since it was last called. A counter that goes down (a
    correction) is not reported until it is back above the highest value already reported, so
    what is sent never decreases a Prometheus counter. Thread-safe.
    """

    def __init__(self, counters: Callable[[], Mapping[str, float]],
                 drain_seconds: Callable[[], Iterable[float]] | None = None) -> None:
        self._counters = counters
        self._drain = drain_seconds
        self._reported: dict[str, float] = {}
        self._lock = threading.Lock()

    def take(self) -> KvcachedConnectorStats | None:
        with self._lock:
            delta: dict[str, Any] = {}
            for k, v in dict(self._counters()).items():
                if not _number(v):
                    continue
                before = self._reported.get(k, 0)
                if v > before:
                    delta[k] = v - before
                    self._reported[k] = v
            if self._drain is not None:
                secs = list(self._drain() or ())
                if secs:
                    delta[SECONDS_KEY] = secs
        stats = KvcachedConnectorStats(data=delta)
        return None if stats.is_empty() else stats


def _fresh(name: str) -> None:
    """Unregister an earlier collector of ours named ``name`` from the default registry: vLLM
    re-creates its stat loggers (tests, engine restarts) and only unregisters ``vllm:*`` names."""
    for collector in list(REGISTRY._collector_to_names):  # noqa: SLF001 - as vLLM's unregister_vllm_metrics
        if getattr(collector, "_name", None) == name:
            REGISTRY.unregister(collector)


class KvcachedPromMetrics(KVConnectorPromMetrics):
    """Per-engine Counters ``kvcached_vllm_<key>_total`` and the ``kvcached_vllm_scheduler_seconds``
    histogram, in the API-server process; :meth:`observe` adds one step's stats."""

    def __init__(self, vllm_config: "VllmConfig", metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        registers = issubclass(self._counter_cls, Counter)  # Ray's wrappers do not use the registry
        self.counters: dict[str, dict[int, Any]] = {}
        for key in COUNTER_KEYS:
            name = f"kvcached_vllm_{key}"
            if registers:
                _fresh(name)
            metric = self._counter_cls(name=name, documentation=DOCS[key], labelnames=labelnames)
            self.counters[key] = create_metric_per_engine(metric, per_engine_labelvalues)
        name = "kvcached_vllm_scheduler_seconds"
        if issubclass(self._histogram_cls, Histogram):
            _fresh(name)
        # vLLM types each class of metric_types as "Gauge | Counter | Histogram"; the one it maps
        # Histogram to is Histogram or Ray's wrapper of it (the same constructor and observe()).
        hist_cls = cast("type[Histogram]", self._histogram_cls)
        hist = hist_cls(name=name, documentation="Scheduler-thread seconds the kvcached connector "
                        "spent on each request", labelnames=labelnames, buckets=SECONDS_BUCKETS)
        self.scheduler_seconds = cast("dict[int, Histogram]", create_metric_per_engine(hist, per_engine_labelvalues))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, v in (transfer_stats_data or {}).items():
            if key == SECONDS_KEY:
                child = self.scheduler_seconds.get(engine_idx)
                if child is not None:
                    for s in v or ():
                        if _number(s):
                            child.observe(s)
            elif key in self.counters and _number(v) and v > 0:
                child = self.counters[key].get(engine_idx)
                if child is not None:
                    child.inc(v)


def build_kv_connector_stats(data: dict[str, Any] | None = None) -> KvcachedConnectorStats:
    """For ``KvcachedConnector.build_kv_connector_stats``: the API server rebuilds the stats from
    the dict that :meth:`KvcachedConnectorStats.to_dict` sent."""
    return KvcachedConnectorStats(data=dict(data or {}))


def build_prom_metrics(vllm_config: "VllmConfig", metric_types: dict[type, type], labelnames: list[str],
                       per_engine_labelvalues: dict[int, list[object]]) -> KvcachedPromMetrics:
    """For ``KvcachedConnector.build_prom_metrics`` (called once, in the API-server process)."""
    return KvcachedPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


__all__ = ["COUNTER_KEYS", "SECONDS_BUCKETS", "KvcachedConnectorStats", "KvcachedPromMetrics", "StatsDelta",
           "build_kv_connector_stats", "build_prom_metrics"]
