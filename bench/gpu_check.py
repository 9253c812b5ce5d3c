"""GPU check: the CUDA pool end to end, on a machine with an NVIDIA GPU.

Question: does the daemon's CUDA pool work across processes bit-exactly, how fast is a
leased chunk read compared with a plain device-to-device copy, how fast does the daemon
promote NVMe chunks into GPU memory, and is every block free again after a client that
held leases is killed?

One run, all on one GPU:

1. ``kvcached serve --device cuda`` in a temp dir (pool in GPU memory, NVMe tier on disk).
2. A writer process puts a prompt's KV (generated on the GPU); a reader process acquires it
   and checks it bit-exactly against the writer's tensor.
3. In this process: copy of every leased chunk into a client-owned GPU tensor (``copy_`` from
   the IPC-mapped slab) vs a plain ``copy_`` between two ordinary GPU tensors of the same size;
   medians over many rounds, ratio (target >= 0.8x).
4. Promotion: more prompts are put until the first one is demoted to NVMe (write-back); an
   acquire then promotes it; bytes promoted / time, median of several rounds.
5. A holder process acquires leases and is killed with SIGKILL; the pool's free-block count
   after eviction must equal the total.

Writes JSON to $OUT/gpu_check.json when $OUT is set (the device tool), else to
bench/results/gpu_check.json. Exits 2 with a message when CUDA is not available.

Run: .venv/bin/python bench/gpu_check.py [--chunk-mib 16] [--rounds 20]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "clients")]

WRITER = r"""
import sys, torch
from kvcached_client import Client, KVLayout
layout = KVLayout.from_dict(__import__("json").loads(sys.argv[2]))
n = int(sys.argv[3])
g = torch.Generator(device="cuda").manual_seed(1234)
kv = torch.randn(2, layout.num_layers, layout.num_kv_heads, n, layout.head_dim, device="cuda", generator=g).to(
    getattr(torch, layout.dtype))
with Client(sys.argv[1]) as c:
    print(c.put(layout, list(range(n)), kv), flush=True)
torch.save(kv.cpu(), sys.argv[4])
"""

READER = r"""
import sys, torch, json
from kvcached_client import Client, KVLayout
layout = KVLayout.from_dict(json.loads(sys.argv[2]))
n = int(sys.argv[3])
with Client(sys.argv[1]) as c:
    with c.acquire(layout, list(range(n))) as lease:
        got = lease.kv().cpu()
want = torch.load(sys.argv[4])
print(json.dumps({"matched": lease.matched_tokens, "bit_exact": bool(torch.equal(got, want[:, :, :, : got.shape[3]]))}))
"""

HOLDER = r"""
import sys, time, json
from kvcached_client import Client, KVLayout
layout = KVLayout.from_dict(json.loads(sys.argv[2]))
c = Client(sys.argv[1])
leases = [c.acquire(layout, list(range(int(sys.argv[3]))), ttl=3600) for _ in range(4)]
print(sum(len(l) for l in leases), flush=True)
time.sleep(3600)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunk-mib", type=int, default=16, choices=(2, 16))
    ap.add_argument("--chunks", type=int, default=16, help="chunks per prompt")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("gpu_check: CUDA is not available on this machine; nothing to check", file=sys.stderr)
        return 2
    from kvcached_client import Client, KVLayout

    layers = 32 if args.chunk_mib == 16 else 4
    layout = KVLayout("bench/gpu-check@1", layers, 8, 128, "bfloat16", chunk_tokens=128)
    n = args.chunks * layout.chunk_tokens
    lay_json = json.dumps(layout.to_dict())
    results: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                     "chunk_bytes": layout.chunk_bytes, "chunks_per_prompt": args.chunks}
    out_dir = os.environ.get("OUT") or os.path.join(ROOT, "bench", "results")
    tmp = tempfile.mkdtemp(prefix="kvcached-gpu-")
    sock = os.path.join(tmp, "kv.sock")
    pool_chunks = 3 * args.chunks  # room for three prompts: the fourth demotes the first
    cfg = os.path.join(tmp, "kvcached.toml")
    with open(cfg, "w") as f:
        f.write(f'device = "cuda"\npool_bytes = {pool_chunks * layout.chunk_bytes}\n'
                f'pool_block_bytes = {layout.chunk_bytes}\nnvme_bytes = "16G"\nmetrics_addr = "127.0.0.1:0"\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "clients")]))
    kvcached = [sys.executable, "-c", "from kvcached.cli import kvcached_main; raise SystemExit(kvcached_main())"]
    daemon = subprocess.Popen(kvcached + ["serve", "--config", cfg, "--socket", sock, "--state-dir",
                                          os.path.join(tmp, "state")], stdout=subprocess.PIPE, text=True, env=env)
    try:
        for line in daemon.stdout:  # type: ignore[union-attr]
            if line.startswith("  layouts:"):
                break
        t = time.perf_counter()
        w = subprocess.run([sys.executable, "-c", WRITER, sock, lay_json, str(n), os.path.join(tmp, "kv.pt")],
                           capture_output=True, text=True, env=env, timeout=600)
        results["writer"] = {"ok": w.returncode == 0, "stored_chunks": w.stdout.strip(), "stderr": w.stderr[-2000:],
                             "seconds": time.perf_counter() - t}
        r = subprocess.run([sys.executable, "-c", READER, sock, lay_json, str(n), os.path.join(tmp, "kv.pt")],
                           capture_output=True, text=True, env=env, timeout=600)
        results["reader"] = json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr[-2000:]}

        with Client(sock) as c:
            # 3. leased chunk -> client tensor vs plain device-to-device copy
            dst = torch.empty(layout.chunk_shape, dtype=torch.bfloat16, device="cuda")
            src = torch.empty_like(dst).normal_()
            lease_t, d2d_t = [], []
            with c.acquire(layout, list(range(n))) as lease:
                for _ in range(args.rounds):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    for i in range(len(lease)):
                        dst.copy_(lease.chunk(i))
                    torch.cuda.synchronize()
                    lease_t.append((time.perf_counter() - t) / len(lease))
                    t = time.perf_counter()
                    for _ in range(len(lease)):
                        dst.copy_(src)
                    torch.cuda.synchronize()
                    d2d_t.append((time.perf_counter() - t) / len(lease))
            lm, dm = statistics.median(lease_t), statistics.median(d2d_t)
            results["leased_copy"] = {"gbps": layout.chunk_bytes / lm / 1e9, "d2d_gbps": layout.chunk_bytes / dm / 1e9,
                                      "ratio_vs_d2d": dm / lm, "target": ">= 0.8"}

            # 4. promotion NVMe -> GPU pool
            promo = []
            for k in range(1, 4):
                kv = torch.zeros(2, layout.num_layers, layout.num_kv_heads, n, layout.head_dim, dtype=torch.bfloat16,
                                 device="cuda")
                c.put(layout, [10_000_000 * k + i for i in range(n)], kv)
            for rnd in range(3):
                before = c.stats()["counters"]["promotions"]
                t = time.perf_counter()
                with c.acquire(layout, list(range(n))) as lease:
                    torch.cuda.synchronize()
                    dt = time.perf_counter() - t
                promoted = c.stats()["counters"]["promotions"] - before
                if promoted:
                    promo.append(promoted * layout.chunk_bytes / dt / 1e9)
                for k in range(1, 4):  # push it back out for the next round
                    c.put(layout, [10_000_000 * (k + 3 * rnd + 3) + i for i in range(n)],
                          torch.zeros(2, layout.num_layers, layout.num_kv_heads, n, layout.head_dim,
                                      dtype=torch.bfloat16, device="cuda"))
            results["promotion"] = {"gbps_median": statistics.median(promo) if promo else None, "rounds": len(promo)}

            # 5. leases of a killed client
            h = subprocess.Popen([sys.executable, "-c", HOLDER, sock, lay_json, str(n)], stdout=subprocess.PIPE,
                                 text=True, env=env)
            held = int(h.stdout.readline())  # type: ignore[union-attr]
            leased_before = c.stats()["pool"]["blocks_leased"]
            h.send_signal(signal.SIGKILL)
            h.wait()
            deadline = time.monotonic() + 10
            while c.stats()["leases_active"] and time.monotonic() < deadline:
                time.sleep(0.05)
            c.evict()
            p = c.stats()["pool"]
            results["killed_client"] = {"chunks_leased_by_it": held, "blocks_leased_before_kill": leased_before,
                                        "blocks_free_after": p["blocks_free"], "blocks_total": p["blocks_total"],
                                        "all_free": p["blocks_free"] == p["blocks_total"]}
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "gpu_check.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results, indent=2))
    print(f"wrote {path}")
    ok = results["reader"].get("bit_exact") and results["killed_client"]["all_free"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
