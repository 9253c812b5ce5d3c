"""Shared helpers for the benchmarks in ``bench/``: machine info, timing, tables, JSON.

Not a benchmark itself. The scripts run as plain ``python bench/<name>.py`` from the repository
root: each puts the repository root on ``sys.path`` (one line) and imports ``bench._common``,
which makes ``kvcached`` and ``kvcached_client`` importable from the source tree.
"""

from __future__ import annotations

import argparse
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
#: The Mooncake FAST'25 traces: ../shared/traces beside the repository (as on the dev machines and
#: in CI); override with KVCACHED_TRACES=/path/to/mooncake-fast25.
TRACE_DIR = os.environ.get("KVCACHED_TRACES", os.path.join(REPO_ROOT, "..", "shared", "traces", "mooncake-fast25"))

for _p in (REPO_ROOT, os.path.join(REPO_ROOT, "clients")):  # kvcached and kvcached_client, not installed
    if _p not in sys.path:
        sys.path.insert(0, _p)


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


#: What a figure depends on: the daemon, the client library, the benchmarks and the API.
_SOURCE_PATHS = ("kvcached", "clients", "bench", "protos", "pyproject.toml", ":(exclude)bench/results")


def _git_state() -> dict:
    """Commit of the code the numbers belong to, and which of its files had uncommitted edits
    (a result written by uncommitted code says so; ``uncommitted_files`` empty means the run
    is reproducible from ``git_commit``)."""
    import subprocess

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", REPO_ROOT, *a], capture_output=True, text=True, timeout=10, check=False).stdout

    try:
        dirty = [line[3:] for line in git("status", "--porcelain", "--", *_SOURCE_PATHS).splitlines() if line]
        return {
            "git_commit": git("rev-parse", "HEAD").strip() or None,
            "uncommitted_files": dirty,
            "kvcached_uncommitted_changes": any(f.startswith("kvcached/") for f in dirty),
        }
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None}


def _exe() -> str:
    """The interpreter as the command line would name it, never as a path of this machine: relative
    to the working directory or to the repository (a run from a worktree uses the main checkout's
    .venv), else its file name."""
    exe = sys.executable or "python"
    for base in (os.getcwd(), REPO_ROOT):
        rel = os.path.relpath(exe, base)
        if not rel.startswith(".."):
            return rel
    return os.path.basename(exe)


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


def write_results(name: str, payload: dict, out_dir: str | None = None, *, quick: bool = False,
                  plot: Callable[[dict, str], object] | None = None) -> str:
    """The end of a bench: ``bench/results/<name>.json`` (``<name>.quick.json`` for ``--quick``) by
    :func:`write_json`, and with ``plot``, ``plot(payload, png)`` drawing the ``.png`` beside it.
    Prints what it wrote; returns the JSON's path."""
    stem = f"{name}.quick" if quick else name
    path = write_json(stem, payload, out_dir)
    wrote = [path]
    if plot is not None:
        wrote.append(os.path.join(os.path.dirname(path), stem + ".png"))
        plot(payload, wrote[-1])
    print("\n" + "\n".join(f"wrote {p}" for p in wrote))
    return path


def bench_parser(doc: str, quick: str) -> argparse.ArgumentParser:
    """The start of a bench's ``main``: a parser described by the first line of the module's
    docstring (``doc``, shown whole under ``--help``), with the two flags every bench takes:
    ``--quick`` (``quick``: what it runs then) and ``--out`` (the results directory)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--out", default=None, help=f"results directory (default {RESULTS_DIR})")
    return p


def finish(name: str, res: dict, args: argparse.Namespace, report: Callable[[dict], object], *,
           plot: Callable[[dict, str], object] | None = None) -> str:
    """The end of a bench's ``main``: ``res["quick"]``, ``report(res)`` (the printed tables), then
    :func:`write_results` into ``args.out``; returns the JSON's path."""
    res["quick"] = args.quick
    report(res)
    return write_results(name, res, args.out, quick=args.quick, plot=plot)


# -- figures ----------------------------------------------------------------------------------


def subplots(*args: object, **kwargs: object) -> tuple:
    """``matplotlib.pyplot.subplots`` on the Agg backend (no display): what every bench's plot starts with."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save_figure(fig: object, path: str, *, title: str | None = None, dpi: int = 110) -> str:
    """Title (``suptitle``), lay out, write ``path`` and close ``fig`` (from :func:`subplots`)."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title, fontsize=10)  # type: ignore[attr-defined]
    fig.tight_layout()  # type: ignore[attr-defined]
    fig.savefig(path, dpi=dpi)  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[arg-type]
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


# -- processes --------------------------------------------------------------------------------


def install_sigterm_exit() -> None:
    """Turn SIGTERM into SystemExit so ``finally`` blocks (stopping daemons) still run."""
    import signal

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
