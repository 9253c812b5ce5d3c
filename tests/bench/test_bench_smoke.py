"""The benchmarks still run (quick mode) and write their JSON. Speed is not asserted here.

Every figure README.md and bench/README.md quote from ``bench/results/*.json`` comes from a key
checked below (present, right type, a plausible value), so a refactor that drops or renames one
fails here instead of leaving the READMEs quoting a number the scripts no longer produce.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # each a whole bench run in quick mode, seconds each: run first (tests/conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRACES = os.path.join(ROOT, "..", "shared", "traces", "mooncake-fast25")
EXCERPT = os.path.join(ROOT, "tests", "data", "mooncake-fast25-excerpt")


def positive(x) -> bool:
    """A real, finite number above 0 (bools are not numbers here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def fraction(x) -> bool:
    return isinstance(x, float) and 0.0 <= x <= 1.0


def check_acquire_latency(d: dict) -> None:
    lat = d["latency"]
    # README: "20.2 µs p50 (bytes), 24.6 µs (numpy)", "a Python list input: 69 µs", and the memo's
    # chain "in 2.5 µs"; bench/README: acquire vs hashing the same tokens alone.
    for tokens in ("np.uint32", "bytes", "list"):
        for op in ("hashes", "acquire"):
            assert positive(lat[f"{tokens}/{op}"]["p50_us"]), (tokens, op)
        assert positive(d["ratios"][tokens]["acquire_over_hashes_p50"]), tokens
        assert isinstance(d["target_acquire_p50"][tokens]["met"], bool), tokens
    # README: "0.05× the 49.7 µs SHA-256 chain it replaces". A breakdown row that calls an engine
    # internal a refactor renamed is listed with the reason, and the run exits 1; none may be.
    assert d["breakdown_skipped"] == [], d["breakdown_skipped"]
    memo_off = d["breakdown_bytes_input"]["hashes with the memo off: normalize_tokens + SHA-256 chain (64 chunks)"]
    assert positive(memo_off["p50_us"])
    assert isinstance(d["target_met_for_bytes_input"], bool)
    # bench/README and docs/benchmarks.md: SGLang's match_prefix on the same prompt and tree, page
    # size 1 and 64, or a stated reason it did not run.
    sg = d["sglang_match_prefix"]
    if "skipped" in sg:
        assert sg["skipped"]
    else:
        assert sorted(sg) == ["page_size 1", "page_size 64"], sorted(sg)
        for v in sg.values():
            assert positive(v["match_prefix"]["p50_us"]) and positive(v["match+lock+unlock"]["p50_us"])
            assert v["tree_tokens"] >= 8192
        assert all(positive(r["acquire+release_list_over_match_prefix"]) for r in d["sglang_ratios"].values())
        assert isinstance(d["target_acquire_release_le_sglang_match_prefix"], bool)


def check_hf_path(d: dict) -> None:
    # docs/benchmarks.md: the cache's part of an HF prefill (hit, miss) over a health check, and per
    # run over per chunk.
    for row in ("health check", "hit", "hit, a copy per chunk", "miss", "miss, a copy per chunk"):
        assert positive(d["latency"][row]["p50_us"]) and d["samples_per_row"][row] > 0, row
        assert positive(d["p50_over_health_check"][row]), row
    assert positive(d["runs_over_per_chunk_p50"]["hit"]) and positive(d["runs_over_per_chunk_p50"]["miss"])
    assert isinstance(d["hit_target_met"], bool) and isinstance(d["miss_target_met"], bool)
    assert d["targets"] == {"hit_over_health_check_max": 1.5, "miss_over_health_check_max": 2.5}


def check_index_memory(d: dict) -> None:
    flat, trie = d["contenders"]["flat"], d["contenders"]["pygtrie"]
    # README: "230 B/chunk ... (279 with the hash keys); pygtrie 1.24× that"; bench/README: the
    # keys' "49 B each", reported apart, and the 64-chunk match latency of both.
    assert positive(flat["bytes_per_chunk"]) and flat["bytes_per_chunk_with_keys"] > flat["bytes_per_chunk"]
    assert positive(d["key_bytes_per_chunk"])
    assert positive(d["ratios"]["memory_pygtrie_over_flat"])
    for c in (flat, trie):
        assert positive(c["bytes_per_chunk"]) and positive(c["match_full_p50_us"])
    assert d["target_bytes_per_chunk"] == 300
    assert isinstance(d["target_met_flat_index_only"], bool) and isinstance(d["target_met_flat_with_keys"], bool)


def check_trace_replay(d: dict) -> None:
    # README: each policy's hit rate over the LRU engine's and the optimum's, per workload and
    # capacity; the Mooncake traces' infinite capacity; the default policy's engine time.
    assert d["policies"][0] == "adaptive" and set(d["policies"]) == {"adaptive", "frequency", "lru"}
    assert set(d["workloads"]) == {"conversation", "synthetic", "scan", "shift", "agentic", "agents_shared", "tenants"}
    for name, w in d["workloads"].items():
        if name in ("conversation", "synthetic"):
            assert w["paper_max_hit_rate"] in (0.4, 0.66)
        by_label = {c["label"]: c for c in w["capacities"]}
        assert len(by_label) >= 2, (name, list(by_label))
        for c in by_label.values():
            for p, e in c["engines"].items():
                assert fraction(e["hit_rate"]), (name, c["label"], p)
                assert e["policy"]["policy"] == p
                # MIN with bypass bounds every online cache
                assert c["optimum"]["hit_rate"] >= e["hit_rate"], (name, c["label"], p)
            assert positive(c["over_engine_lru"]["lru"]) and c["over_engine_lru"]["lru"] == 1.0
        if "inf" in by_label:
            inf = by_label["inf"]
            assert inf["engines"]["adaptive"]["hit_rate"] == inf["optimum"]["hit_rate"] == w["infinite_capacity_hit_rate"]
        t = w["targets"]
        assert isinstance(t["all_met"], bool) and isinstance(t["all_met_vs_engine_lru"], bool)
        assert all(isinstance(v, bool) for v in t["floor_vs_engine_lru"].values())
        assert set(t["floor_vs_plain_lru"]) == set(by_label)
        assert ("signal" in t) == (name in ("conversation", "scan", "agentic"))
    assert positive(d["workloads"]["conversation"]["cost"]["max_default_over_lru"])
    assert isinstance(d["target_met"], bool)


def check_ttft(d: dict) -> None:
    # README: "hit 0.009× cold at 4k, 0.005× at 8k; miss +0.01–0.16 %" (quick runs 256 and 512
    # tokens; the keys are the same).
    assert d["rows"]
    for r in d["rows"]:
        assert positive(r["tokens"]) and positive(r["cold_s"]) and positive(r["hit_s"])
        assert positive(r["hit_over_cold"]), r["tokens"]
        assert isinstance(r["miss_overhead_direct"], float) and isinstance(r["miss_overhead"], float)
        assert r["hit_cached_tokens"] > 0
    t = d["targets"]
    assert t["hit_le_0.1x_cold_at_4k_plus"] in (True, False, None)  # None: no row of 4k tokens or more
    assert isinstance(t["miss_overhead_le_3pct_end_to_end"], bool)
    assert isinstance(t["miss_overhead_le_3pct_direct"], bool)


API_DIRECT = "c' api Client(nvme_read=direct): acquire + copy_chunk(0, dst)"


def check_chunk_read(d: dict) -> None:
    assert d["sizes"]
    threads = d["torch_threads"]["default"]
    for size, s in d["sizes"].items():
        notes = s["notes"]
        assert not [n for n in notes if "nvme_read='direct'" in n], notes  # the client's direct path ran
        assert positive(s["promotions_during_timing"]) and all(s["verified"].values()), s["verified"]
        # bench/README: "the `N threads` row shows it".
        assert positive(s["latency"][f"memcpy hot (torch, {threads} threads)"]["gb_s_at_p50"])
        v = s["verdicts"]
        # README: pool "0.89× (2 MiB) / 0.85× (16 MiB) memcpy".
        assert positive(v["pool_read"]["hot_over_memcpy_hot"]) and positive(v["pool_read"]["cold_over_memcpy_cold"])
        # README: NVMe "data path: 0.54× / 0.58× of a hot memcpy, 0.76× of a cold one"; "with its own
        # acquire RPC per chunk 0.12× / 0.37×"; "direct is 1.6× / 2.0× faster than daemon promotion".
        n = v["nvme"]
        for k in ("direct_over_memcpy_hot", "data_path_only_direct_over_memcpy_cold", "best_over_memcpy_hot",
                  "api_direct_over_api_promote", "direct_over_promotion"):
            assert positive(n[k]), (size, k, n.get(k))
        assert n["faster_method"] in s["latency"] and n["client_default_should_be"] in ("direct", "promote")
        assert all(isinstance(x, bool) for x in v["targets"].values()), v["targets"]
        # README: "≥ 17× a Redis GET", NVMe "10× / 14× Redis", with the RPC "2.4× / 8.9× Redis". Without
        # a Redis at --redis-url those rows are skipped, and the run says so.
        redis = v["ratios_to_redis_get"]
        if redis is None:
            assert [n for n in notes if n.startswith("redis skipped")], notes
        else:
            for row in ("a pool hot", "c nvme direct (LMDB)", API_DIRECT):
                assert positive(redis[row]), (size, row)
            assert isinstance(v["targets"]["pool >= 10x redis GET (pool hot)"], bool)


def check_rpc_latency(d: dict) -> None:
    for c in (1, 16, 64):
        level = f"shared/c{c}"
        # README: "p50 1.22–1.31× / 1.14–1.26× / 1.23–1.29× at c=1 / 16 / 64, throughput 0.73–0.85× ...".
        r = d["ratios"][level]["acquire vs ping"]
        assert positive(r["p50_ratio"]) and positive(r["throughput_ratio"]), level
        assert isinstance(r["p50_target_met"], bool) and isinstance(r["throughput_target_met"], bool)
        assert positive(d["ratios"][level]["acquire+release vs ping x2"]["throughput_ratio"]), level
        # bench/README: CPU per op of each side (`*_cpu_us_per_op`), "daemon switches/op", and the
        # batched Release "~8 µs per lease".
        res = d["results"][level]
        for name in ("ping", "acquire", "acquire 1 chunk"):
            row = res[name]
            assert positive(row["p50_us"]) and positive(row["throughput_ops_s_median"]), (level, name)
            assert positive(row["client_cpu_us_per_op"]) and positive(row["daemon_cpu_us_per_op"]), (level, name)
            assert positive(row["daemon_switches_per_op"]), (level, name)
            assert row["misses"] == 0, (level, name)
        assert positive(res["acquire"]["batched_release_us_per_lease"]), level
        # README: "Transport floor ...: 0.93–0.95× / ..."; bench/README's attribution table: gRPC's
        # µs, kvcached's µs, its budget at the target, the one-chunk acquire. The floor daemon
        # answered every acquire as a full hit.
        a = d["attribution"][level]
        for k in ("floor_throughput_ratio", "floor_p50_ratio", "one_chunk_throughput_ratio", "throughput_ratio"):
            assert positive(a[k]), (level, k, a.get(k))
        for k in ("daemon_cpu_us_acquire_minus_ping", "of_which_transport_us", "of_which_kvcached_us",
                  "one_chunk_acquire_minus_ping_us", "kvcached_budget_us_at_target"):
            assert isinstance(a[k], float) and math.isfinite(a[k]), (level, k, a.get(k))
    # bench/README: in process, acquire + release "23-55 µs" back to back, "32.5 and 37.2 µs" cold.
    b = d["breakdown_in_process"]
    for row in ("store.acquire + store.release (in process)", "store.acquire + store.release, 0.1 ms apart (cold)",
                "store.acquire + store.release, 1 ms apart (cold)"):
        assert positive(b[row]["p50_us"]), row
    # README / bench/README: "the Acquire handler costs 129–149 µs of event-loop CPU per call, Ping's
    # 6–7 µs", "a Release of one lease 65-78 µs; a batched Release 14-16 µs per lease" (written by
    # the handlers daemon at exit).
    times = d["what_if"]["handlers"]["handler_times"]
    for rpc in ("Ping", "Acquire 8192 tokens", "Release 1 leases"):
        assert times[rpc]["calls"] > 0 and positive(times[rpc]["cpu_us_per_call"]), times
    batched = [k for k in times if k.startswith("Release ") and k != "Release 1 leases"]
    assert batched and all(positive(times[k]["cpu_us_per_call"]) for k in batched), times
    assert d["what_if"]["floor"]["daemon_exit_code"] == 0 and d["daemon_exit_code"] == 0
    assert d["targets"] == {"acquire_p50_over_ping_p50_max": 1.3, "acquire_throughput_over_ping_min": 0.8}
    # The per-request rows (sync Client, one per thread): ping, a full hit, a miss, with RPCs counted.
    pr = d["per_request"]
    for c in (1, 16, 64):
        level = pr["results"][f"c{c}"]
        for name in ("ping", "request full hit", "request full hit, a view per chunk", "request miss"):
            row = level[name]
            assert positive(row["p50_ms"]) and positive(row["p99_ms"]), (c, name)
            assert positive(row["throughput_ops_s_median"]), (c, name)
            assert row["wrong_outcomes"] == 0, (c, name)
        r = pr["ratios"][f"c{c}"]
        for k in ("hit_p50_over_ping_p50", "miss_p50_over_ping_p50", "hit_throughput_over_ping",
                  "miss_throughput_over_ping", "hit_p50_over_hit_with_a_view_per_chunk"):
            assert positive(r[k]), (c, k)
        for k in ("hit_p50_target_met", "miss_p50_target_met", "hit_throughput_target_met",
                  "miss_throughput_target_met"):
            assert isinstance(r[k], bool), (c, k)
    rpcs = {name: v["rpcs_per_request"] for name, v in pr["rpcs_per_request"].items()}
    assert rpcs == {"ping": 1, "request full hit": 1, "request full hit, a view per chunk": 1, "request miss": 2}, rpcs
    assert pr["daemon_counters_after"]["pool_evictions"] == 0 and pr["daemon_exit_code"] == 0
    assert pr["targets"] == {"hit_p50_over_ping_p50_max": 1.3, "miss_p50_over_ping_p50_max": 2.3,
                             "hit_throughput_over_ping_min": 0.8, "miss_throughput_over_ping_min": 0.45}


def check_remote_tier(d: dict) -> None:
    # README / bench/README: fetch vs redis-py GET (and LMCache where it ran), the 8k-token fill
    # against the prefill, the GPU break-even, and the Bloom filter's saving per miss.
    for size, m in d["fetch"].items():
        for cn, v in m["verdicts"].items():
            if isinstance(v, dict) and "kvcached_gb_s" in v:
                assert positive(v["kvcached_gb_s"]) and positive(v["kvcached_over_redis_py"]), (size, cn)
            if isinstance(v, dict) and "direct_over_redis_py_reader" in v:  # both readers, per core too
                assert positive(v["direct_over_redis_py_reader"]) and positive(v["gb_per_client_cpu_s"]["kvcached"])
        assert m["tier_errors_during_timing"] == 0
        assert m["verified"]["kvcached fetch, both readers and fetch_into (all chunks, CRC of every payload)"]
    assert d["lmcache"]["status"] in ("ran", "skipped") and (d["lmcache"]["status"] == "ran" or d["lmcache"]["reason"])
    e = d["e2e"]
    assert positive(e["median"]["cold_acquire_s"]) and positive(e["cold_acquire_us_per_token"])
    assert positive(e["cold_acquire_gb_s"])
    assert {r["reader"] for r in e["reps_detail"]} == {"direct", "redis-py"}
    assert all(positive(x) for x in e["direct_over_redis_py_reader"].values())
    assert all(positive(g["fill_over_break_even"]) for g in d["gpu_break_even"]["models"].values())
    mi = d["miss"]
    assert positive(mi["saved_per_miss_us_by_a_perfect_filter"]) and mi["remote_errors"] == 0
    assert d["conclusions"] and isinstance(d["targets"], dict)


def check_negation_probe(d):
    assert d["train_traps"] > 0 and d["test_traps"] > 0 and 0 < d["test_traps_refused_by_guards"] <= 1
    (row,) = d["rows"]  # quick: one regularisation, one cap
    for part in ("validation", "test"):
        r = row[part]
        assert 0 <= r["caught"] <= r["traps_passing_guards"] and 0 <= r["should_hit_refused"] <= r["should_hit_passing_guards"]
    assert row["test_traps_refused_with_probe"] >= d["test_traps_refused_by_guards"]


CHECKS = {
    "acquire_latency": check_acquire_latency,
    "index_memory": check_index_memory,
    "trace_replay": check_trace_replay,
    "ttft": check_ttft,
    "rpc_latency": check_rpc_latency,
    "hf_path": check_hf_path,
    "chunk_read": check_chunk_read,
    "remote_tier": check_remote_tier,
    "negation_probe": check_negation_probe,
}

#: benches outside bench/ itself: the one-off studies
PLACE = {"index_memory": ("studies",), "negation_probe": ("studies",)}


@pytest.mark.parametrize("name", list(CHECKS))
def test_benchmark_runs_quick(name, tmp_path):
    env = dict(os.environ)
    if name == "trace_replay" and not os.path.isdir(TRACES):
        env["KVCACHED_TRACES"] = EXCERPT  # the committed first requests of both traces
    # rpc_latency: also the transport-floor and handler-timing daemons, whose preludes patch the
    # servicer by name
    extra = ["--what-if", "floor,handlers", "--channels", "shared"] if name == "rpc_latency" else []
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", *PLACE.get(name, ()), f"{name}.py"), "--quick", "--out",
         str(tmp_path), *extra],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    files = [f for f in os.listdir(tmp_path) if f.endswith(".json")]
    assert files == [f"{name}.quick.json"], files
    data = json.load(open(tmp_path / files[0]))
    assert data["machine"]["nproc"] >= 1 and data["quick"] is True
    CHECKS[name](data)


def test_pool_packing_quick(tmp_path):
    # bench/studies/pool_packing.py: pool bytes holding KV per geometry (scenario A) and under a mixed
    # churn (scenario B), the shipped extents-64B allocator next to fixed 16 MiB blocks and the
    # other packed designs; JSON and PNG written.
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "studies", "pool_packing.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    files = sorted(os.listdir(tmp_path))
    assert files == ["pool_packing.quick.json", "pool_packing.quick.png"], files
    d = json.load(open(tmp_path / files[0]))
    assert d["machine"]["nproc"] >= 1 and d["quick"] is True
    names = d["contenders"]
    assert {"fixed-16MiB", "pages-64KiB", "pages-256KiB", "pages-2MiB", "size-classes", "extents-64B"} <= set(names)
    assert len(d["scenario_a_fill"]) == 7
    for geo, g in d["scenario_a_fill"].items():
        assert positive(g["chunk_bytes"]), geo
        for c in names:
            assert fraction(g["contenders"][c]["utilisation"]), (geo, c)
        assert g["contenders"]["extents-64B"]["utilisation"] > 0.9, geo
    assert d["scenario_a_fill"]["Llama-3-70B-TP1"]["contenders"]["fixed-16MiB"]["utilisation"] == 0.0
    churn = d["scenario_b_churn"]["contenders"]
    for c in names + d["references"]:
        s = churn[c]
        assert fraction(s["utilisation_median"]) and fraction(s["utilisation_min"]), c
        assert s["utilisation_min"] <= s["utilisation_median"], c
        assert isinstance(s["window_evictions"], int) and positive(s["evicted_per_inserted_byte"]), c
        assert fraction(s["retouch_hit_rate"]) and s["series"], c
    assert churn["extents-64B"]["window_evictions"] > 0 and churn["fixed-16MiB"]["window_evictions"] == 0
    assert positive(d["scenario_b_ratio_to_fixed"]["extents-64B"]["median"])
    assert all(positive(w["ms_per_call"]) for w in d["window_call_cost"])
    t = d["targets"]
    assert t["a_min_utilisation"] == 0.95 and t["b_min_utilisation"] == 0.9
    assert all(isinstance(t[k], bool) for k in ("a_met", "b_median_met", "b_min_met"))


def test_writeback_quick(tmp_path):
    # bench/writeback.py: puts/s into an empty pool vs a full one (write-back on, and off:
    # synchronous demotion), the reader's acquire latency idle vs while the pool fills, the NVMe
    # write bandwidth vs a plain sequential write, and the write-back counters; JSON and PNG written.
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "writeback.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    files = sorted(os.listdir(tmp_path))
    assert files == ["writeback.quick.json", "writeback.quick.png"], files
    d = json.load(open(tmp_path / files[0]))
    assert d["machine"]["nproc"] >= 1 and d["quick"] is True
    assert d["shape"]["chunk_bytes"] == 1 << 20
    for case in ("empty", "full/writeback", "full/sync"):
        assert positive(d["puts_per_s"][case]["median"]), case
    assert d["partial_puts"] == {"empty": 0, "full/writeback": 0, "full/sync": 0}
    for k in ("full_writeback_over_empty", "full_sync_over_empty", "full_writeback_over_full_sync"):
        assert positive(d["puts_ratios"][k]), k
    for phase in ("idle", "busy/writeback", "busy/sync", "busy, memcpy only (GIL control)",
                  "busy, room free (same puts, no write-back)"):
        lat = d["latency"][phase]
        assert positive(lat["acquire_p50_us"]) and lat["acquire_p99_us"] >= lat["acquire_p50_us"], phase
        assert lat["misses"] == 0, phase
    assert positive(d["latency_ratios"]["p99_busy_writeback_over_idle"])
    assert positive(d["latency_ratios"]["p99_busy_sync_over_idle"])
    assert positive(d["latency_ratios"]["p99_busy_writeback_over_room_free"])
    bw = d["bandwidth"]
    for k in ("writeback_mb_s", "sync_mb_s", "plain_write_mb_s", "plain_write_per_chunk_mb_s"):
        assert positive(bw[k]), k
    assert positive(d["bandwidth_ratios"]["writeback_over_plain"])
    wb, sync = d["counters"]["full/writeback"], d["counters"]["full/sync"]
    # With write-back on the writer demotes in batches; off, every demotion is synchronous.
    assert wb["writeback_batches"] >= 1 and wb["writeback_chunks"] >= 1 and wb["writeback_bytes"] > 0
    assert sync["writeback_batches"] == 0 and sync["sync_demotions"] == sync["demotions"] > 0
    for k in ("sync_demotions", "writeback_waits", "writeback_wait_seconds"):
        assert wb[k] >= 0, k
    t = d["targets"]
    assert all(isinstance(t[k], bool) for k in ("full_ge_0.8x_empty", "disk_bound", "nvme_bw_ge_0.7x_plain",
                                                "puts_target_met", "acquire_p99_le_1.2x_idle"))
