"""``bench/sim/eviction_candidates.py --quick`` runs and writes a JSON that holds together.

Speed is not asserted. Without ``../shared/traces`` the script replays the committed excerpt of
both traces (tests/data), the same fallback ``test_bench_smoke.py`` uses for trace_replay.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRACES = os.path.join(ROOT, "..", "shared", "traces", "mooncake-fast25")
EXCERPT = os.path.join(ROOT, "tests", "data", "mooncake-fast25-excerpt")
SCRIPT = os.path.join(ROOT, "bench", "sim", "eviction_candidates.py")

ONLINE = {
    "lru", "frequency_beta0.5", "frequency_beta1", "frequency_beta2", "frequency_no_memory", "gdsf",
    "lfu", "lru2", "hyperbolic", "frequency_doorkeeper", "frequency_adaptive",
}
ORACLES = {"oracle_admission_lru"}


def fraction(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and 0.0 <= x <= 1.0


def test_eviction_candidates_quick(tmp_path) -> None:
    env = dict(os.environ)
    if not os.path.isdir(TRACES) and "KVCACHED_TRACES" not in env:
        env["KVCACHED_TRACES"] = EXCERPT  # the committed first requests of both traces
    proc = subprocess.run([sys.executable, SCRIPT, "--quick", "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    path = tmp_path / "eviction_candidates.quick.json"
    assert path.is_file() and (tmp_path / "eviction_candidates.quick.png").is_file()
    d = json.loads(path.read_text())

    assert d["quick"] is True
    assert d["question"].startswith("Question:")
    assert isinstance(d["wall_seconds"], float) and d["wall_seconds"] > 0
    assert set(d["traces"]) == {"conversation", "synthetic"}
    assert set(d["best_online"]) == set(d["traces"])
    for name, t in d["traces"].items():
        caps = [str(c) for c in t["capacities"]]
        assert caps == ["100", "1000"], (name, caps)
        assert set(t["contenders"]) == ONLINE | ORACLES, (name, sorted(t["contenders"]))
        for c in caps:
            opt = t["optimum"][c]
            assert fraction(opt) and opt > 0, (name, c, opt)
            lru = t["contenders"]["lru"][c]["hit_rate"]
            for n, by_cap in t["contenders"].items():
                e = by_cap[c]
                assert fraction(e["hit_rate"]), (name, c, n, e)
                assert math.isclose(e["over_optimum"], e["hit_rate"] / opt), (name, c, n)
                if lru > 0:
                    assert math.isclose(e["over_lru"], e["hit_rate"] / lru), (name, c, n)
                # Belady MIN with bypass maximises flat hits (a block present when accessed),
                # and every contender's hits are flat hits (oracle included: it is still a
                # replacement policy on the same stream). MIN's hits are moreover all prefix
                # hits (an ancestor's next use always comes before its descendant's), so the
                # prefix-counted optimum equals the flat one and bounds every contender.
                # Both are exact ratios of integer counts over the same total: no tolerance.
                assert e["hit_rate"] <= t["optimum_flat"][c], (name, c, n)
                assert e["hit_rate"] <= opt, (name, c, n, e["hit_rate"], opt)
            assert t["optimum_flat"][c] == opt, (name, c)
            assert t["contenders"]["lru"][c]["over_optimum"] > 0, (name, c)  # LRU hits something
            best = d["best_online"][name][c]
            assert best["name"] in ONLINE, best
            assert best["hit_rate"] == max(t["contenders"][n][c]["hit_rate"] for n in ONLINE), (name, c)
