"""Prometheus metrics: a collector over store snapshots, plus RPC latency.

The engine never calls Prometheus: :class:`StoreCollector` reads ``Store.stats()`` (and the
per-layout token counters) at scrape time, so a scrape costs one snapshot and the hot path
pays nothing. RPC latency is the only thing observed per call, by a gRPC interceptor
(:class:`LatencyInterceptor`).

The three metrics the seed names keep their names: ``cache_hit_rate_by_model``,
``cache_memory_utilization`` and ``semantic_similarity_distribution``. The semantic response
cache lives in kvcached-router (``kvcached_router.semantic``), whose ``/metrics`` fills a
histogram of that name (the top-1 similarity of every semantic lookup); the daemon answers no
semantic lookups, so its own stays empty, exported so that one dashboard reads either. Everything
else is prefixed ``kvcached_``.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import grpc
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvcached.contract.buckets import SIMILARITY_BUCKETS
from kvcached.store import Store

RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class StoreCollector:
    """One collector for every trust domain's store; every sample carries a ``domain`` label."""

    def __init__(self, stores: "Store | dict[str, Store]") -> None:
        self.stores = stores if isinstance(stores, dict) else {stores.config.domain: stores}

    def describe(self) -> list[Metric]:
        return []  # collected lazily; describe() must not take a snapshot at registration

    def collect(self) -> Iterator[Metric]:
        fams: dict[str, Metric] = {}

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Metric:
            if name not in fams:
                fams[name] = GaugeMetricFamily(name, doc, labels=["domain", *labels])
            return fams[name]

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Metric:
            if name not in fams:
                fams[name] = CounterMetricFamily(name, doc, labels=["domain", *labels])
            return fams[name]

        for domain, store in self.stores.items():
            self._collect_one(domain, store, gauge, counter)
        yield from fams.values()

    @staticmethod
    def _collect_one(dom: str, store: Store, gauge: Any, counter: Any) -> None:
        s = store.stats()
        c = s.counters
        layouts = store.layouts()
        hit = gauge("cache_hit_rate_by_model", "Share of looked-up prompt tokens found cached, per model",
                    ("model", "layout_id"))
        for lid, (looked, hits) in store.tokens_by_layout().items():
            model = layouts[lid].model if lid in layouts else "?"
            hit.add_metric([dom, model, lid], hits / looked if looked else 0.0)
        util = gauge("cache_memory_utilization", "Used share of each tier's capacity", ("tier",))
        util.add_metric([dom, "pool"], s.pool.used_bytes / s.pool.capacity_bytes if s.pool.capacity_bytes else 0.0)
        used = gauge("kvcached_tier_used_bytes", "Bytes used per tier", ("tier",))
        cap = gauge("kvcached_tier_capacity_bytes", "Capacity per tier", ("tier",))
        chunks = gauge("kvcached_tier_chunks", "Chunks held per tier", ("tier",))
        used.add_metric([dom, "pool"], s.pool.used_bytes)
        cap.add_metric([dom, "pool"], s.pool.capacity_bytes)
        chunks.add_metric([dom, "pool"], s.pool.chunks)
        if s.nvme is not None:
            util.add_metric([dom, "nvme"], s.nvme.used_bytes / s.nvme.capacity_bytes if s.nvme.capacity_bytes else 0.0)
            used.add_metric([dom, "nvme"], s.nvme.used_bytes)
            cap.add_metric([dom, "nvme"], s.nvme.capacity_bytes)
            chunks.add_metric([dom, "nvme"], s.nvme.chunks)
            gauge("kvcached_lmdb_file_bytes", "Size of the NVMe tier's LMDB data file").add_metric([dom], s.nvme.file_bytes)
            gauge("kvcached_lmdb_readers", "LMDB reader slots in use").add_metric([dom], s.nvme.readers)
            gauge("kvcached_lmdb_map_bytes", "The NVMe tier's LMDB map size (grows when full)").add_metric(
                [dom], s.nvme.map_bytes)
            counter("kvcached_lmdb_map_grows", "Times the NVMe tier's full LMDB map was grown").add_metric(
                [dom], s.nvme.map_grows)
        pool_bytes = gauge("kvcached_pool_bytes", "Pool bytes by state: KV payload, reserved, free", ("state",))
        for state in ("payload", "reserved", "free"):
            pool_bytes.add_metric([dom, state], getattr(s.pool, f"{state}_bytes"))
        gauge("kvcached_pool_largest_free_bytes", "The longest free run of the pool (fragmentation)").add_metric(
            [dom], s.pool.largest_free_bytes)
        slab_used = gauge("kvcached_pool_slab_used_bytes", "Bytes used in each pool slab (one per GPU)",
                          ("slab", "placement"))
        slab_cap = gauge("kvcached_pool_slab_capacity_bytes", "Capacity of each pool slab (one per GPU)",
                         ("slab", "placement"))
        for k, slab in enumerate(s.pool.slabs):
            slab_used.add_metric([dom, str(k), slab.placement], slab.used_bytes)
            slab_cap.add_metric([dom, str(k), slab.placement], slab.capacity_bytes)
        pool_chunks = gauge("kvcached_pool_chunks", "Pool chunks by state", ("state",))
        for state in ("leased", "cached", "reserved"):
            pool_chunks.add_metric([dom, state], getattr(s.pool, f"{state}_chunks"))
        gauge("kvcached_indexed_chunks", "Chunks in the prefix index").add_metric([dom], s.indexed_chunks)
        gauge("kvcached_leases_active", "Live leases").add_metric([dom], s.leases_active)
        gauge("kvcached_reservations_active", "Live reservations").add_metric([dom], s.reservations_active)
        gauge("kvcached_layouts", "Registered layouts").add_metric([dom], s.layouts)
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
            ("kvcached_sync_demotions", "Demotions on a request's path (the background writer fell behind)",
             c.sync_demotions),
            ("kvcached_pool_window_evictions", "Room made by evicting a contiguous window (fragmented pool)",
             c.pool_window_evictions),
            ("kvcached_writeback_batches", "Background write-back transactions (one sync each)", c.writeback_batches),
            ("kvcached_writeback_chunks", "Chunks written by background write-back", c.writeback_chunks),
            ("kvcached_writeback_bytes", "Bytes written by background write-back", c.writeback_bytes),
            ("kvcached_writeback_waits", "Reservations that waited for write-back to make room", c.writeback_waits),
            ("kvcached_writeback_wait_seconds", "Time reservations waited for write-back", c.writeback_wait_seconds),
            ("kvcached_writeback_wait_timeouts", "Waits for write-back that ran out (the put demoted itself)",
             c.writeback_wait_timeouts),
            ("kvcached_not_reserved_chunks", "Chunks a put could not get room for (stored what fit)",
             c.not_reserved_chunks),
        ):
            counter(name, doc).add_metric([dom], value)
        ev = counter("kvcached_evictions", "Evictions per tier", ("tier",))
        ev.add_metric([dom, "pool"], c.pool_evictions)
        ev.add_metric([dom, "nvme"], c.nvme_evictions)
        adm = counter("kvcached_admission_chunks", "Chunks a reservation asked pool room for, by the decision: "
                      "admitted; refused by the admission policy (value) or for want of room (no_room)",
                      ("decision", "reason"))
        adm.add_metric([dom, "admitted", ""], c.admitted_chunks)
        adm.add_metric([dom, "refused", "value"], c.refused_value_chunks)
        adm.add_metric([dom, "refused", "no_room"], c.not_reserved_chunks)
        if s.remote is not None:
            rt = s.remote
            for name, doc, value in (
                ("kvcached_remote_hits", "Chunks fetched from the remote tier and verified", rt.hits),
                ("kvcached_remote_misses", "Chunks looked for in the remote tier and not usable there", rt.misses),
                ("kvcached_remote_fetched_bytes", "Payload bytes fetched from the remote tier", rt.bytes_fetched),
                ("kvcached_remote_published_bytes", "Value bytes published to the remote tier", rt.bytes_published),
                ("kvcached_remote_published_chunks", "Chunks published to the remote tier", rt.published),
                ("kvcached_remote_errors", "Remote tier calls that failed (each a miss)", rt.errors),
                ("kvcached_remote_skipped", "Remote tier calls not made: the breaker was open", rt.skipped_open),
                ("kvcached_remote_deadline_missed", "Remote tier calls abandoned at their deadline (each a miss, "
                 "counted in errors too)", rt.deadline_missed),
                ("kvcached_remote_skipped_busy", "Remote tier calls not made: every I/O thread was still in an "
                 "abandoned call", rt.skipped_busy),
                ("kvcached_remote_breaker_opened", "Times the remote tier's breaker opened", rt.breaker_opened),
                ("kvcached_remote_queue_dropped", "Chunks dropped from a full publish queue", rt.queue_dropped),
                ("kvcached_remote_demoted_chunks", "Chunks sent to the remote tier as they left the last local tier",
                 rt.demoted),
                ("kvcached_remote_refreshed_chunks", "Chunks leaving the last local tier that the remote tier "
                 "already held (TTL renewed only)", rt.refreshed),
            ):
                counter(name, doc).add_metric([dom], value)
            refused = counter("kvcached_remote_refused", "Remote values not served, by reason", ("reason",))
            for reason in ("mac", "truncated", "header", "length", "checksum"):
                refused.add_metric([dom, reason], rt.refused.get(reason, 0))
            br = gauge("kvcached_remote_breaker_state", "The remote tier's breaker (1 = in this state)", ("state",))
            for state in ("closed", "open", "half_open"):
                br.add_metric([dom, state], 1 if rt.breaker_state == state else 0)
            gauge("kvcached_remote_queue_depth", "Chunks waiting to be published or demoted").add_metric(
                [dom], rt.queue_depth)
            gauge("kvcached_remote_queue_bytes", "Payload bytes copied for demotion, waiting to be sent").add_metric(
                [dom], rt.queue_bytes)
        if s.eviction is not None:
            e = s.eviction
            gauge("kvcached_eviction_policy", "The eviction policy in use (1)", ("policy", "admission")).add_metric(
                [dom, e.policy, e.admission], 1)
            gauge("kvcached_eviction_weight",
                  "Pool turnovers one more hit is worth (frequency; adaptive: the weight it chose)").add_metric(
                [dom], e.weight)
            counter("kvcached_eviction_weight_switches",
                    "Times the adaptive policy changed its weight (its simulations found another better)").add_metric(
                [dom], e.weight_switches)
            gauge("kvcached_eviction_turnover_seconds",
                  "Measured time to use a pool's worth of chunks (the frequency policy's time scale)").add_metric(
                [dom], e.turnover_seconds)
        if s.hash_memo is not None:
            hm = counter("kvcached_chunk_hashes", "Chunk hashes by source: the hash memo or SHA-256", ("source",))
            hm.add_metric([dom, "memo"], s.hash_memo.memo_chunks)
            hm.add_metric([dom, "sha256"], s.hash_memo.hashed_chunks)
            gauge("kvcached_hash_memo_bytes", "Memory held by the hash memo").add_metric([dom], s.hash_memo.bytes)


class LatencyInterceptor(grpc.aio.ServerInterceptor):
    """Observes every unary RPC's handler time, labelled by method. The calls a Session stream
    carries reach no interceptor: the servicer reports them through :meth:`observe`."""

    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram

    def observe(self, method: str, seconds: float) -> None:
        self.histogram.labels(method).observe(seconds)

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


class KvEventsCollector:
    """The KV event publishers (kvcached.service.kv_events), one per domain that has one."""

    def __init__(self) -> None:
        self.publishers: dict[str, Any] = {}

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        if not self.publishers:
            return
        sent = CounterMetricFamily("kvcached_kv_events_sent", "KV events published", labels=["domain"])
        batches = CounterMetricFamily("kvcached_kv_events_batches", "KV event batches published (the next "
                                      "sequence number)", labels=["domain"])
        replays = CounterMetricFamily("kvcached_kv_events_replays", "Replay requests served", labels=["domain"])
        resyncs = CounterMetricFamily("kvcached_kv_events_resyncs", "Snapshots sent (at start, or after the "
                                      "publisher fell behind)", labels=["domain"])
        pending = GaugeMetricFamily("kvcached_kv_events_pending", "KV events waiting to be published",
                                    labels=["domain"])
        for dom, pub in self.publishers.items():
            sent.add_metric([dom], pub.events_sent)
            batches.add_metric([dom], pub.next_seq)
            replays.add_metric([dom], pub.replays)
            resyncs.add_metric([dom], pub.source.resyncs)
            pending.add_metric([dom], len(pub.source))
        yield from (sent, batches, replays, resyncs, pending)


class Metrics:
    """One registry per daemon: the store collector, RPC latency and the similarity histogram."""

    def __init__(self, stores: "Store | dict[str, Store]") -> None:
        self.registry = CollectorRegistry()
        self.registry.register(StoreCollector(stores))
        self.rpc_latency = Histogram("kvcached_rpc_latency_seconds", "Time in the RPC handler", ["method"],
                                     buckets=RPC_BUCKETS, registry=self.registry)
        self.similarity = Histogram("semantic_similarity_distribution",
                                    "Top-1 similarity of semantic-cache lookups (filled by kvcached-router; empty in the daemon)",
                                    buckets=SIMILARITY_BUCKETS, registry=self.registry)
        self.interceptor = LatencyInterceptor(self.rpc_latency)
        self._events = KvEventsCollector()
        self.registry.register(self._events)
        self._server: Any = None

    def add_event_publisher(self, domain: str, publisher: Any) -> None:
        self._events.publishers[domain] = publisher

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
