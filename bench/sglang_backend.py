"""Question: what time to first token does an SGLang engine get from kvcached as its HiCache
storage tier, on a prompt another engine stored, against computing it and against SGLang's own
``file`` storage backend?

One run, side by side, on SGLang 0.5.23's CPU engine (``.venv-sglang``, the test-only CPU shims
of ``tests/sglang/cpu_shims``), a random-weight Llama (``kvcached_client.vllm.random_model``: 8
layers, hidden 512, 8 heads / 4 KV heads, vocab 4096), pages of 64 tokens, prompts of 2048 tokens
(new ones per repetition), TTFT = wall time of ``/generate`` with ``max_new_tokens=1``:

* ``kvcached``: engine A stores the prompts (its HiCache writes them through to kvcached); A
  stops; a fresh engine B serves each prompt (``hit``: SGLang's ``cached_tokens_details.storage``
  says how much came from storage), then a new prompt of the same length (``cold``), then the
  first prompt again (``device``: a repeat served from B's own GPU-tier cache). The backend's own
  time per hit comes from B's ``kvcached_sglang_seconds_total`` (lookups and loads, copies
  included), against the hit's load time (hit - device).
* ``file``: SGLang's ``file`` backend in a new directory. Engine F stores the prompts, its own
  cache is flushed, F serves them again (``hit``: from its files). Then F restarts with a new
  directory (what a new host or a cleaned scratch disk gives): it has nothing, the prompt is
  computed (``after_restart``); kvcached's B had the hit.

Targets: kvcached hit <= 0.3x cold at >= 2k tokens; the backend's time <= 10 % of the load time;
kvcached's hit as fast as or faster than ``file``'s.

Run:   .venv/bin/python bench/sglang_backend.py            (~6 min on a busy 2-core box)
       .venv/bin/python bench/sglang_backend.py --quick    (small model, 512 tokens, 1 rep)
Output: bench/results/sglang_backend.json (``sglang_backend.quick.json`` for --quick)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file: import bench

from bench._common import RESULTS_DIR
from bench.harness.daemon import Daemon
from bench.harness.sglang_server import SGLANG_PY, Server, file_storage, kvcached_storage, metric, storage_tokens, wait_chunks

PAGE = 64


def prompt(n: int, seed: int) -> str:
    return " ".join(f"w{(seed * 7919 + i * 104729) % 4000 + 3}" for i in range(n))


def ttft(server: Server, text: str) -> tuple[float, dict]:
    t = time.perf_counter()
    out = server.post("/generate", {"text": text, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    assert isinstance(out, dict) and "output_ids" in out, out
    return time.perf_counter() - t, out


def run(quick: bool, reps: int, length: int, tmp: str) -> dict:
    from kvcached_client.vllm.random_model import build

    hidden, layers = (256, 2) if quick else (512, 8)
    model = build(os.path.join(tmp, "model"), layers=layers, hidden=hidden, heads=8, kv_heads=4, vocab=4096,
                  intermediate=3 * hidden, max_positions=8192)
    stored = [prompt(length, 100 + r) for r in range(reps)]
    warm = prompt(length, 99)  # B's first hit maps the daemon's pool and opens its session: not timed
    fresh = [prompt(length, 200 + r) for r in range(reps)]
    pages = (length // PAGE) * (reps + 1)
    res: dict = {"kvcached": {"hit": [], "cold": [], "device": [], "storage_tokens": []}, "file": {"hit": [], "after_restart": []}}
    kw = dict(page=PAGE, max_tokens=4 * length + 1024)
    with Daemon.temp({"trust_client_keys": True, "pool_bytes": "2G", "nvme_bytes": 0}) as d:
        extra = {"model": "bench/random-llama@0", "prefetch_threshold": PAGE}
        a = Server(SGLANG_PY, model, kvcached_storage(d.socket, **extra), os.path.join(tmp, "a.log"), **kw)
        try:
            for p in [warm, *stored]:
                ttft(a, p)
            assert wait_chunks(d.socket, pages) >= pages, "engine A's pages did not all reach kvcached"
        finally:
            a.stop()
        b = Server(SGLANG_PY, model, kvcached_storage(d.socket, **extra), os.path.join(tmp, "b.log"), **kw)
        try:
            ttft(b, warm)
            before = {op: metric(b, "kvcached_sglang_seconds_total", f'op="{op}"') for op in ("exists", "get", "get_copy")}
            for p, q in zip(stored, fresh):
                t, out = ttft(b, p)
                res["kvcached"]["hit"].append(t)
                res["kvcached"]["storage_tokens"].append(storage_tokens(out))
                res["kvcached"]["cold"].append(ttft(b, q)[0])
                res["kvcached"]["device"].append(ttft(b, p)[0])
            res["kvcached"]["backend_seconds"] = {op: metric(b, "kvcached_sglang_seconds_total", f'op="{op}"')
                                                  - before[op] for op in ("exists", "get", "get_copy")}
            res["kvcached"]["loaded_pages"] = metric(b, "kvcached_sglang_pages_total", 'op="loaded"')
        finally:
            b.stop()
    files = os.path.join(tmp, "files")
    f = Server(SGLANG_PY, model, file_storage(files), os.path.join(tmp, "f.log"), **kw)
    try:
        for p in [warm, *stored]:
            ttft(f, p)
        time.sleep(2)  # its write-through to files runs in the background
        f.flush()
        ttft(f, warm)
        for p in stored:
            f.flush()
            t, out = ttft(f, p)
            res["file"]["hit"].append(t)
            res["file"].setdefault("storage_tokens", []).append(storage_tokens(out))
    finally:
        f.stop()
    shutil.rmtree(files, ignore_errors=True)
    f2 = Server(SGLANG_PY, model, file_storage(os.path.join(tmp, "files2")), os.path.join(tmp, "f2.log"), **kw)
    try:
        for p in stored:
            res["file"]["after_restart"].append(ttft(f2, p)[0])
    finally:
        f2.stop()
    return res


def summarise(res: dict, reps: int) -> dict:
    k, fl = res["kvcached"], res["file"]
    med = statistics.median
    hit, cold, device = med(k["hit"]), med(k["cold"]), med(k["device"])
    load = max(hit - device, 1e-9)
    secs = k["backend_seconds"]
    backend = (secs["exists"] + secs["get"]) / reps
    copies = secs["get_copy"] / reps
    return {
        "kvcached_hit_s": hit, "cold_s": cold, "device_hit_s": device,
        "hit_over_cold": hit / cold,
        "backend_s_per_hit": backend, "backend_copy_s_per_hit": copies, "load_s_per_hit": load,
        "backend_share_of_load": backend / load, "backend_share_without_copies": (backend - copies) / load,
        "file_hit_s": med(fl["hit"]), "kvcached_hit_over_file_hit": hit / med(fl["hit"]),
        "file_after_restart_s": med(fl["after_restart"]), "kvcached_hit_over_file_after_restart": hit / med(fl["after_restart"]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 2-layer model, 512 tokens, 1 rep")
    ap.add_argument("--reps", type=int, default=0, help="prompts per contender (default 3; 1 with --quick)")
    ap.add_argument("--length", type=int, default=0, help="prompt tokens (default 2048; 512 with --quick)")
    ap.add_argument("--out", default=RESULTS_DIR)
    a = ap.parse_args()
    if not os.path.exists(SGLANG_PY):
        print("SGLang's venv (.venv-sglang) is missing: KVCACHED_SGLANG=cpu ./scripts/setup", file=sys.stderr)
        return 2
    reps = a.reps or (1 if a.quick else 3)
    length = a.length or (512 if a.quick else 2048)
    tmp = tempfile.mkdtemp(prefix="kvc-sglang-bench-")
    try:
        raw = run(a.quick, reps, length, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = {"question": __doc__.split("\n\n")[0], "quick": a.quick, "reps": reps, "prompt_tokens": length,
           "page_tokens": PAGE, "raw": raw, "summary": summarise(raw, reps)}
    s = out["summary"]
    print(f"prompt {length} tokens, {reps} reps (medians):")
    print(f"  kvcached hit {s['kvcached_hit_s']:.3f} s   cold {s['cold_s']:.3f} s   device {s['device_hit_s']:.3f} s"
          f"   hit/cold {s['hit_over_cold']:.3f}x (target <= 0.3x)")
    print(f"  backend {s['backend_s_per_hit'] * 1e3:.1f} ms of a {s['load_s_per_hit'] * 1e3:.1f} ms load: "
          f"{100 * s['backend_share_of_load']:.1f} %; without its page copies "
          f"({s['backend_copy_s_per_hit'] * 1e3:.1f} ms) {100 * s['backend_share_without_copies']:.1f} % (target <= 10 %)")
    print(f"  file hit {s['file_hit_s']:.3f} s: kvcached/file {s['kvcached_hit_over_file_hit']:.2f}x; file after a "
          f"restart with a new directory {s['file_after_restart_s']:.3f} s (computed): kvcached/that "
          f"{s['kvcached_hit_over_file_after_restart']:.3f}x")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "sglang_backend.quick.json" if a.quick else "sglang_backend.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
