"""The router's Prometheus metrics (``/metrics``): routes and their reasons, predicted and realised
cache hits, per-host load and health, the event stream's lag, failovers, fail-open requests, the
audit of routes, time to first byte. One registry per router, so several run in one process
(the tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.routes = Counter("kvcached_router_routes", "Requests routed, by policy, host and reason",
                              ["policy", "host", "reason"], registry=r)
        self.predicted = Counter("kvcached_router_predicted_hit_tokens", "Cached prompt tokens the index "
                                 "predicted at the chosen host", ["host"], registry=r)
        self.realised = Counter("kvcached_router_realised_hit_tokens", "Cached prompt tokens the engine "
                                "reported (usage.prompt_tokens_details.cached_tokens)", ["host"], registry=r)
        self.prompt_tokens = Counter("kvcached_router_prompt_tokens", "Prompt tokens routed", ["host"], registry=r)
        self.in_flight = Gauge("kvcached_router_in_flight", "Requests in flight per host", ["host"], registry=r)
        self.queued = Gauge("kvcached_router_queued_prefill_tokens", "Prefill tokens sent to a host whose "
                            "answers have not started", ["host"], registry=r)
        self.healthy = Gauge("kvcached_router_host_healthy", "1 while the host passes its health check",
                             ["host"], registry=r)
        self.lag = Gauge("kvcached_router_event_lag_seconds", "Age of the newest KV event batch when applied",
                         ["host"], registry=r)
        self.indexed = Gauge("kvcached_router_indexed_chunks", "Chunks the index says a host holds", ["host"],
                             registry=r)
        self.failovers = Counter("kvcached_router_failovers", "Requests re-sent because a host could not be "
                                 "reached", ["host"], registry=r)
        self.fail_open = Counter("kvcached_router_fail_open", "Requests routed without the cache because the "
                                 "router could not read them", ["reason"], registry=r)
        self.audited = Counter("kvcached_router_audited_routes", "Routes checked against every daemon's Lookup",
                               registry=r)
        self.wrong = Counter("kvcached_router_wrong_routes", "Audited routes where another healthy host within "
                             "the load bound held at least one more cached chunk", registry=r)
        self.unaudited = Counter("kvcached_router_unaudited_routes", "Routes the audit could not judge: the "
                                 "chosen host's daemon did not answer its Lookup (e.g. it was restarting)",
                                 registry=r)
        self.ttft = Histogram("kvcached_router_ttft_seconds", "Time to the first response byte", ["host"],
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r)
