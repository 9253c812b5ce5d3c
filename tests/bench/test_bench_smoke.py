"""The benchmarks still run (quick mode) and write their JSON. Speed is not asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRACES = os.path.join(ROOT, "..", "shared", "traces", "mooncake-fast25")
EXCERPT = os.path.join(ROOT, "tests", "data", "mooncake-fast25-excerpt")


@pytest.mark.parametrize("name", ["acquire_latency", "index_memory", "trace_replay", "ttft", "rpc_latency", "chunk_read"])
def test_benchmark_runs_quick(name, tmp_path):
    env = dict(os.environ)
    if name == "trace_replay" and not os.path.isdir(TRACES):
        env["KVCACHED_TRACES"] = EXCERPT  # the committed first requests of both traces
    # rpc_latency: also the transport-floor and handler-timing daemons, whose preludes patch the
    # servicer by name
    extra = ["--what-if", "floor,handlers", "--channels", "shared"] if name == "rpc_latency" else []
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", f"{name}.py"), "--quick", "--out", str(tmp_path), *extra],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    files = [f for f in os.listdir(tmp_path) if f.endswith(".json")]
    assert len(files) == 1, files
    data = json.load(open(tmp_path / files[0]))
    assert data["machine"]["nproc"] >= 1
    if name == "rpc_latency":
        for level in data["attribution"].values():  # the floor daemon answered every acquire as a full hit
            assert level["floor_throughput_ratio"] > 0 and level["one_chunk_throughput_ratio"] > 0
        times = data["what_if"]["handlers"]["handler_times"]  # written by the daemon at exit
        for rpc in ("Ping", "Acquire 8192 tokens", "Release 1 leases"):
            assert times[rpc]["calls"] > 0 and times[rpc]["cpu_us_per_call"] > 0, times
