"""Shared helpers for the benchmarks in ``bench/``: machine info, timing, tables, JSON.

Not a benchmark itself. Every script imports it as ``from _common import ...``
(the scripts put their own directory on ``sys.path``), so they run as plain
``python bench/<name>.py`` from the repository root.
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO_ROOT, "bench", "results")

if REPO_ROOT not in sys.path:  # make ``import kvcached`` work without installing the package
    sys.path.insert(0, REPO_ROOT)


def machine_info() -> dict:
    """What the numbers were measured on, and how they were produced."""
    info = {
        "nproc": os.cpu_count(),
        "sched_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": sys.version.split()[0],
        "python_impl": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "command": " ".join([_exe()] + sys.argv),
        "argv": list(sys.argv),
        "cwd": os.getcwd(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    info.update(_git_state())
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_kib"] = int(f.readline().split()[1])
    except (OSError, ValueError, IndexError):
        pass
    try:
        info["loadavg"] = os.getloadavg()
    except OSError:
        pass
    try:
        import numpy

        info["numpy"] = numpy.__version__
    except ImportError:  # pragma: no cover
        pass
    return info


def _git_state() -> dict:
    """Commit of the engine the numbers belong to, and whether kvcached/ had uncommitted edits."""
    import subprocess

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", REPO_ROOT, *a], capture_output=True, text=True, timeout=10, check=False).stdout.strip()

    try:
        return {
            "git_commit": git("rev-parse", "HEAD") or None,
            "kvcached_uncommitted_changes": bool(git("status", "--porcelain", "--", "kvcached")),
        }
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None}


def _exe() -> str:
    exe = sys.executable or "python"
    rel = os.path.relpath(exe)
    return rel if not rel.startswith("..") else exe


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted sequence (q in 0..100)."""
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(q / 100.0 * (len(sorted_values) - 1))))
    return float(sorted_values[k])


def summarize_ns(samples_ns: Iterable[int]) -> dict:
    """p50/p90/p99/min/mean of per-call samples, in microseconds."""
    xs = sorted(samples_ns)
    n = len(xs)
    return {
        "n": n,
        "p50_us": percentile(xs, 50) / 1e3,
        "p90_us": percentile(xs, 90) / 1e3,
        "p99_us": percentile(xs, 99) / 1e3,
        "min_us": (xs[0] / 1e3) if n else float("nan"),
        "mean_us": (sum(xs) / n / 1e3) if n else float("nan"),
    }


def time_calls(fn: Callable[[], object], iterations: int, out: list[int]) -> None:
    """Append ``iterations`` per-call durations (ns) of ``fn()`` to ``out``, with gc disabled."""
    pc = time.perf_counter_ns
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(iterations):
            t0 = pc()
            fn()
            out.append(pc() - t0)
    finally:
        if was_enabled:
            gc.enable()


def timer_overhead_ns(iterations: int = 20000) -> float:
    """Median cost of one empty timed call (perf_counter_ns pair + a no-op call)."""
    xs: list[int] = []
    time_calls(lambda: None, iterations, xs)
    xs.sort()
    return float(xs[len(xs) // 2])


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Plain fixed-width table; floats get 4 significant-ish digits."""

    def cell(v: object) -> str:
        if isinstance(v, float):
            if math.isnan(v):
                return "-"
            if abs(v) >= 1000:
                return f"{v:,.0f}"
            if abs(v) >= 100:
                return f"{v:.1f}"
            if abs(v) >= 1:
                return f"{v:.2f}"
            return f"{v:.4f}"
        return str(v)

    cells = [[cell(v) for v in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) if cells else len(str(h)) for i, h in enumerate(headers)]
    lines = ["  ".join(str(h).rjust(w) if i else str(h).ljust(w) for i, (h, w) in enumerate(zip(headers, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for r in cells:
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


def write_json(name: str, payload: dict, out_dir: str | None = None) -> str:
    """Write ``payload`` (plus machine info) to ``bench/results/<name>.json``; returns the path."""
    out_dir = out_dir or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    doc = {"benchmark": name, "machine": machine_info(), **payload}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=False, default=_json_default)
        f.write("\n")
    os.replace(tmp, path)
    return path


def _json_default(o: object) -> object:
    try:
        import numpy as np

        if isinstance(o, np.integer):
            return int(o)
        if isinstance(o, np.floating):
            return float(o)
    except ImportError:  # pragma: no cover
        pass
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    return str(o)
