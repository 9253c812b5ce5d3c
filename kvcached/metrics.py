"""Prometheus metrics: a collector over store snapshots, plus RPC latency.

The engine never calls Prometheus: :class:`StoreCollector` reads ``Store.stats()`` (and the
per-layout token counters) at scrape time, so a scrape costs one snapshot and the hot path
pays nothing. RPC latency is the only thing observed per call, by a gRPC interceptor
(:class:`LatencyInterceptor`).

The three metrics the seed names keep their names: ``cache_hit_rate_by_model``,
``cache_memory_utilization`` and ``semantic_similarity_distribution`` (a histogram the
semantic layer will fill; it is exported, empty, so dashboards can be built now). Everything
else is prefixed ``kvcached_``.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import grpc
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvcached.store import Store

RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
SIMILARITY_BUCKETS = tuple(round(0.80 + 0.01 * i, 2) for i in range(21))


class StoreCollector:
    def __init__(self, store: Store) -> None:
        self.store = store

    def describe(self) -> list[Metric]:
        return []  # collected lazily; describe() must not take a snapshot at registration

    def collect(self) -> Iterator[Metric]:
        s = self.store.stats()
        c = s.counters
        layouts = self.store.layouts()
        per_layout = self.store.tokens_by_layout()

        hit = GaugeMetricFamily("cache_hit_rate_by_model", "Share of looked-up prompt tokens found cached, per model",
                                labels=["model", "layout_id"])
        for lid, (looked, hits) in per_layout.items():
            model = layouts[lid].model if lid in layouts else "?"
            hit.add_metric([model, lid], hits / looked if looked else 0.0)
        yield hit

        util = GaugeMetricFamily("cache_memory_utilization", "Used share of each tier's capacity", labels=["tier"])
        util.add_metric(["pool"], s.pool.used_bytes / s.pool.capacity_bytes if s.pool.capacity_bytes else 0.0)
        if s.nvme is not None:
            util.add_metric(["nvme"], s.nvme.used_bytes / s.nvme.capacity_bytes if s.nvme.capacity_bytes else 0.0)
        yield util

        used = GaugeMetricFamily("kvcached_tier_used_bytes", "Bytes used per tier", labels=["tier"])
        cap = GaugeMetricFamily("kvcached_tier_capacity_bytes", "Capacity per tier", labels=["tier"])
        chunks = GaugeMetricFamily("kvcached_tier_chunks", "Chunks held per tier", labels=["tier"])
        used.add_metric(["pool"], s.pool.used_bytes)
        cap.add_metric(["pool"], s.pool.capacity_bytes)
        chunks.add_metric(["pool"], s.pool.chunks)
        if s.nvme is not None:
            used.add_metric(["nvme"], s.nvme.used_bytes)
            cap.add_metric(["nvme"], s.nvme.capacity_bytes)
            chunks.add_metric(["nvme"], s.nvme.chunks)
        yield used
        yield cap
        yield chunks

        blocks = GaugeMetricFamily("kvcached_pool_blocks", "Pool blocks by state", labels=["state"])
        for state in ("free", "leased", "cached", "reserved"):
            blocks.add_metric([state], getattr(s.pool, f"blocks_{state}"))
        yield blocks

        if s.nvme is not None:
            yield GaugeMetricFamily("kvcached_lmdb_file_bytes", "Size of the NVMe tier's LMDB data file",
                                    value=s.nvme.file_bytes)
            yield GaugeMetricFamily("kvcached_lmdb_readers", "LMDB reader slots in use", value=s.nvme.readers)

        yield GaugeMetricFamily("kvcached_indexed_chunks", "Chunks in the prefix index", value=s.indexed_chunks)
        yield GaugeMetricFamily("kvcached_leases_active", "Live leases", value=s.leases_active)
        yield GaugeMetricFamily("kvcached_reservations_active", "Live reservations", value=s.reservations_active)
        yield GaugeMetricFamily("kvcached_layouts", "Registered layouts", value=s.layouts)

        for name, doc, value in (
            ("kvcached_lookups", "Lookups and acquires", c.lookups),
            ("kvcached_lookup_tokens", "Prompt tokens looked up", c.lookup_tokens),
            ("kvcached_hit_tokens", "Prompt tokens found cached", c.hit_tokens),
            ("kvcached_acquires", "Acquires", c.acquires),
            ("kvcached_leases_released", "Leases released by their holder", c.leases_released),
            ("kvcached_leases_expired", "Leases that ran out their TTL", c.leases_expired),
            ("kvcached_leases_force_released", "Leases released because their session ended", c.leases_session_released),
            ("kvcached_commits", "Committed reservations", c.commits),
            ("kvcached_committed_chunks", "Chunks stored", c.committed_chunks),
            ("kvcached_reservations_expired", "Reservations that ran out their TTL", c.reservations_expired),
            ("kvcached_in_flight_conflicts", "Reserves that found a chunk being written by another writer",
             c.in_flight_conflicts),
            ("kvcached_promotions", "Chunks copied NVMe -> pool", c.promotions),
            ("kvcached_prefetched", "Promotions ahead of need", c.prefetched),
            ("kvcached_demotions", "Chunks copied pool -> NVMe", c.demotions),
            ("kvcached_ttl_expirations", "Chunks dropped after cache_ttl", c.ttl_expirations),
            ("kvcached_corrupt_dropped", "Corrupt NVMe chunks dropped", c.corrupt_dropped),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        ev = CounterMetricFamily("kvcached_evictions", "Evictions per tier", labels=["tier"])
        ev.add_metric(["pool"], c.pool_evictions)
        ev.add_metric(["nvme"], c.nvme_evictions)
        yield ev


class LatencyInterceptor(grpc.aio.ServerInterceptor):
    """Observes every unary RPC's handler time, labelled by method."""

    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        observe = self.histogram.labels(details.method.rsplit("/", 1)[-1]).observe
        inner = handler.unary_unary

        async def timed(request: Any, context: Any) -> Any:
            t = time.perf_counter()
            try:
                return await inner(request, context)
            finally:
                observe(time.perf_counter() - t)

        return grpc.unary_unary_rpc_method_handler(
            timed, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )


class Metrics:
    """One registry per daemon: the store collector, RPC latency and the similarity histogram."""

    def __init__(self, store: Store) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(StoreCollector(store))
        self.rpc_latency = Histogram("kvcached_rpc_latency_seconds", "Time in the RPC handler", ["method"],
                                     buckets=RPC_BUCKETS, registry=self.registry)
        self.similarity = Histogram("semantic_similarity_distribution",
                                    "Similarity of semantic-cache candidates (filled by the semantic layer)",
                                    buckets=SIMILARITY_BUCKETS, registry=self.registry)
        self.interceptor = LatencyInterceptor(self.rpc_latency)
        self._server: Any = None

    def serve(self, addr: str) -> int:
        """Expose /metrics on ``HOST:PORT`` (port 0 picks one); returns the bound port."""
        from prometheus_client import start_http_server

        host, _, port = addr.rpartition(":")
        server, _thread = start_http_server(int(port), addr=host.strip("[]") or "127.0.0.1", registry=self.registry)
        self._server = server
        return server.server_address[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
