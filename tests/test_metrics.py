"""Prometheus: the collector on a fresh registry, and a real scrape of a running daemon."""

from __future__ import annotations

import urllib.request

import torch
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvcached.metrics import Metrics, StoreCollector
from kvcached_client import Client
from tests.conftest import TINY, payload, prompt
from tests.service.conftest import LAYOUT

CT = TINY.chunk_tokens


def test_collector_reports_store_snapshot(store, lid):
    reg = CollectorRegistry()
    reg.register(StoreCollector(store))
    store.put(lid, prompt(3), [payload(i) for i in range(3)])
    store.lookup(lid, prompt(4))  # 3 of 4 chunks cached
    lease = store.acquire(lid, prompt(2))
    v = reg.get_sample_value
    d = {"domain": "default"}
    assert v("cache_hit_rate_by_model", {**d, "model": TINY.model, "layout_id": lid}) == (5 * CT) / (6 * CT)
    assert v("kvcached_pool_chunks", {**d, "state": "leased"}) == 2
    assert v("kvcached_pool_chunks", {**d, "state": "cached"}) == 1
    assert v("kvcached_tier_chunks", {**d, "tier": "pool"}) == 3
    assert v("cache_memory_utilization", {**d, "tier": "pool"}) == 3 * TINY.chunk_bytes / store.pool.capacity_bytes
    assert v("kvcached_leases_active", d) == 1
    assert v("kvcached_lookup_tokens_total", d) == 6 * CT and v("kvcached_hit_tokens_total", d) == 5 * CT
    # each of the 4 distinct chunks was hashed with SHA-256 once; lookup (3) and acquire (2) reused them
    assert v("kvcached_chunk_hashes_total", {**d, "source": "sha256"}) == 4
    assert v("kvcached_chunk_hashes_total", {**d, "source": "memo"}) >= 5
    assert v("kvcached_hash_memo_bytes", d) > 0
    store.release(lease.lease_id)
    assert v("kvcached_leases_active", d) == 0 and v("kvcached_leases_released_total", d) == 1
    assert v("kvcached_lmdb_file_bytes", d) > 0
    assert v("kvcached_lmdb_map_bytes", d) == store.nvme.map_size and v("kvcached_lmdb_map_grows_total", d) == 0


def test_semantic_histogram_is_exported_empty(store):
    m = Metrics(store)
    assert m.registry.get_sample_value("semantic_similarity_distribution_count") == 0
    m.similarity.observe(0.95)
    assert m.registry.get_sample_value("semantic_similarity_distribution_bucket", {"le": "0.95"}) == 1


def test_scrape_of_a_running_daemon(daemon):
    with Client(daemon.socket) as c:
        c.put(LAYOUT, list(range(64)), torch.zeros(2, 2, 2, 64, 8))
        with c.acquire(LAYOUT, list(range(64))):
            text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    hit = [s for s in fams["cache_hit_rate_by_model"].samples if s.labels["model"] == LAYOUT.model]
    assert len(hit) == 1 and hit[0].value == 1.0
    leased = [s.value for s in fams["kvcached_pool_chunks"].samples if s.labels["state"] == "leased"]
    assert leased == [4.0]
    counts = {s.labels["method"]: s.value for s in fams["kvcached_rpc_latency_seconds"].samples
              if s.name.endswith("_count")}
    assert counts["Acquire"] >= 1 and counts["Reserve"] == 1 and counts["Commit"] == 1
    assert "semantic_similarity_distribution" in fams


def test_dashboard_queries_only_exported_metrics(store, lid):
    import json
    import os
    import re
    import subprocess
    import sys

    exe = os.path.join(os.path.dirname(sys.executable), "kvcachectl")
    dash = json.loads(subprocess.run([exe, "dashboard"], capture_output=True, text=True, check=True, timeout=60).stdout)
    m = Metrics(store)
    store.lookup(lid, prompt(1))
    m.rpc_latency.labels("Acquire").observe(0.001)
    exported = {s.name for fam in m.registry.collect() for s in fam.samples}
    used = {name for p in dash["panels"] for t in p["targets"]
            for name in re.findall(r"\b(?:cache|kvcached|semantic)_[a-z_]+", t["expr"])}
    assert used and used <= exported, used - exported
    assert len(dash["panels"]) >= 8


def test_promtool_accepts_a_real_scrape(make_daemon, tmp_path, redis_server):
    import shutil
    import subprocess

    from tests.requirements import require

    # Every optional family too: the KV event stream's and the remote tier's.
    daemon = make_daemon(kv_events_endpoint=f"ipc://{tmp_path}/ev", remote_nodes=f"127.0.0.1:{redis_server.port}")

    promtool = shutil.which("promtool")
    require(promtool, "promtool missing: scripts/test installs Debian's prometheus package")
    with Client(daemon.socket) as c:
        c.put(LAYOUT, list(range(32)), torch.zeros(2, 2, 2, 32, 8))
        c.lookup(LAYOUT, list(range(32)))
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read()
    assert b"kvcached_kv_events_sent_total" in text and b"kvcached_remote_hits_total" in text
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert r.returncode == 0 and r.stdout == b"" and r.stderr == b"", (r.stdout + r.stderr).decode()
