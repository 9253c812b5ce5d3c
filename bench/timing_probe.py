"""Question: can a client of trust domain B tell, by the latency of its own requests, whether a
prompt is cached in domain A (a cross-tenant timing side channel), through Acquire or Lookup,
probing one at a time or several at once? And can the same measurement tell a hit from a miss
inside one domain (the positive control, which it should)?

Setup: one real ``kvcached serve`` with two trust domains (default, and ``tenant_b`` on its own
socket, pool and NVMe environment), one small layout (1 layer, 1 KV head, head_dim 8, float16,
16-token chunks: 512-byte chunks, so thousands of prompts fit a small pool; the RPCs carry ids
and offsets, not KV bytes). 2N prompts of random token ids (8 chunks each), a random half of them
stored in domain A only (``put_bytes``). Nothing is ever stored in B.

Probes: for each probe kind (``acquire``: Acquire then, untimed, Release; ``lookup``: Lookup of
one prompt) and each concurrency C, every prompt is probed once from B (the attacker: N cached
in A vs N cached nowhere) and once from A (the control: N hits vs N misses); these 4N probes run
in one random order, so drift of the busy box hits all four sets alike. C asyncio tasks (one
grpc.aio channel per domain) take the next probe from the shared order; each probe's latency is
its own RPC's round trip (``perf_counter_ns``), raw stubs, prebuilt requests.

Statistic: ROC AUC = Mann-Whitney U / (n1 n2) of the two latency sets (ties count half); 0.5 =
indistinguishable; max(AUC, 1 - AUC) is the attacker's best single-threshold distinguishability.
Under no leak the AUC is normal around 0.5 with sd sqrt((n1 + n2 + 1) / (12 n1 n2)) (reported,
with a z score). The CI test (tests/reliability/test_security.py) asserts <= 0.6 on 300 Acquire
probes per set; this script is its long version. Limit checked here too: attack <= 0.6.

Run:   .venv/bin/python bench/timing_probe.py            (N = 5000 per set; ~2 min on a 2-core box)
       .venv/bin/python bench/timing_probe.py --quick    (N = 300; writes *.quick.json)
Output: bench/results/timing_probe.json
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file: import bench

from bench._common import bench_parser, finish, format_table, install_sigterm_exit
from bench.harness.daemon import Daemon

import grpc
import numpy as np
from kvcached_client import Client, KVLayout

from kvcached.v1 import kvcached_pb2 as pb
from kvcached.v1 import kvcached_pb2_grpc as pb_grpc

LAYOUT = KVLayout("bench/timing-probe@1", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16",
                  chunk_tokens=16)
AUC_LIMIT = 0.6
TIMEOUT = 30.0


def roc_auc(pos: list[int], neg: list[int]) -> float:
    """Mann-Whitney U of ``pos`` over n_pos * n_neg, midranks for ties (no sklearn)."""
    x = np.concatenate([np.asarray(pos, dtype=np.float64), np.asarray(neg, dtype=np.float64)])
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    ranks = np.empty(len(x))
    i = 0
    while i < len(xs):
        j = i
        while j < len(xs) and xs[j] == xs[i]:
            j += 1
        ranks[order[i:j]] = (i + j + 1) / 2
        i = j
    u = ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2
    return float(u / (len(pos) * len(neg)))


def null_sd(n1: int, n2: int) -> float:
    return math.sqrt((n1 + n2 + 1) / (12 * n1 * n2))


def summary(ns: list[int]) -> dict:
    xs = np.sort(np.asarray(ns)) / 1e3
    return {"n": len(xs), "p50_us": float(np.percentile(xs, 50)), "p90_us": float(np.percentile(xs, 90)),
            "p99_us": float(np.percentile(xs, 99)), "mean_us": float(xs.mean())}


async def probe_round(kind: str, conc: int, ends: dict, prompts: list[bytes], cached: set[int],
                      rng: np.random.Generator) -> dict:
    """4N probes (A/B x cached-in-A/not) in one random order, ``conc`` at a time."""
    order = [(who, i) for who in "AB" for i in range(len(prompts))]
    rng.shuffle(order)
    lat: dict[tuple[str, bool], list[int]] = {(w, c): [] for w in "AB" for c in (True, False)}
    wrong: list[tuple[str, int, int]] = []
    it = iter(order)
    full = len(prompts[0]) // 4 // LAYOUT.chunk_tokens * LAYOUT.chunk_tokens
    pc = time.perf_counter_ns

    async def worker() -> None:
        for who, i in it:
            lid, sid, st = ends[who]
            if kind == "acquire":
                req = pb.AcquireRequest(layout_id=lid, tokens=prompts[i], session_id=sid)
                t0 = pc()
                r = await st.Acquire(req, timeout=TIMEOUT)
                dt = pc() - t0
                matched = r.matched_tokens
                await st.Release(pb.ReleaseRequest(lease_ids=[r.lease_id], session_id=sid), timeout=TIMEOUT)
            else:
                req = pb.LookupRequest(layout_id=lid, tokens=[prompts[i]])
                t0 = pc()
                r = await st.Lookup(req, timeout=TIMEOUT)
                dt = pc() - t0
                matched = r.cached_tokens[0]
            expect = full if (who == "A" and i in cached) else 0
            if matched != expect:
                wrong.append((who, i, matched))
            lat[(who, i in cached)].append(dt)

    t0 = time.monotonic()
    await asyncio.gather(*[worker() for _ in range(conc)])
    wall = time.monotonic() - t0
    if wrong:
        raise SystemExit(f"ISOLATION FAILURE or wrong answer ({kind}, c={conc}): {wrong[:5]} (who, prompt, matched)")
    attack = roc_auc(lat[("B", True)], lat[("B", False)])
    control = roc_auc(lat[("A", True)], lat[("A", False)])
    n1, n2 = len(lat[("B", True)]), len(lat[("B", False)])
    sd = null_sd(n1, n2)
    return {
        "kind": kind, "concurrency": conc, "probes": len(order), "wall_s": wall,
        "attack_auc": attack, "attack_distinguishability": max(attack, 1 - attack),
        "attack_z": (attack - 0.5) / sd, "null_sd": sd,
        "control_auc": control, "control_z": (control - 0.5) / sd,
        "attack_within_limit": max(attack, 1 - attack) <= AUC_LIMIT,
        "latency": {f"{w}/{'cached-in-A' if c else 'nowhere'}": summary(v) for (w, c), v in lat.items()},
    }


async def measure(d: Daemon, b_sock: str, a: Client, b: Client, prompts: list[bytes], cached: set[int],
                  args: argparse.Namespace, rng: np.random.Generator) -> list[dict]:
    chans = {"A": grpc.aio.insecure_channel(f"unix:{d.socket}"), "B": grpc.aio.insecure_channel(f"unix:{b_sock}")}
    ends = {"A": (a.register(LAYOUT), a.session_id(), pb_grpc.KVCacheStub(chans["A"])),
            "B": (b.register(LAYOUT), b.session_id(), pb_grpc.KVCacheStub(chans["B"]))}
    try:
        warm = prompts[:50]  # warm-up: channels, code paths (not recorded)
        await probe_round("acquire", 1, ends, warm, {i for i in range(len(warm)) if i in cached}, rng)
        out = []
        for conc in args.concurrency:
            for kind in args.kinds:
                r = await probe_round(kind, conc, ends, prompts, cached, rng)
                print(f"  {kind:8s} c={conc:<3d} attack AUC {r['attack_auc']:.3f} (z {r['attack_z']:+.1f})  "
                      f"control AUC {r['control_auc']:.3f}  [{r['probes']} probes, {r['wall_s']:.1f} s]", flush=True)
                out.append(r)
        return out
    finally:
        for ch in chans.values():
            await ch.close()


def run(args: argparse.Namespace) -> dict:
    n, n_chunks = args.n, args.chunks
    rng = np.random.default_rng(args.seed)
    chunk_bytes = LAYOUT.chunk_bytes
    # A packed pool: each 512-byte chunk takes 512 bytes, so twice the stored prompts' bytes keeps
    # every one of them in the pool (well above write-back's low-water mark: nothing is demoted).
    pool = max(16 << 20, int(n * n_chunks * chunk_bytes * 2))
    settings = {"pool_bytes": pool, "nvme_bytes": "256M", "lease_ttl": 600.0,
                "log_level": "warning", "cache_ttl": 86400.0}
    domain_b = {"pool_bytes": "16M"}
    d = Daemon.temp(settings, prefix="kvc-timing-")
    b_sock = os.path.join(d.root, "b.sock")
    d.settings["domains"] = {"tenant_b": {**domain_b, "socket": b_sock}}
    with d:
        raise_if_missing(b_sock)
        prompts = [p.astype("<u4").tobytes()
                   for p in rng.integers(0, 2**31, size=(2 * n, n_chunks * LAYOUT.chunk_tokens), dtype=np.int64)]
        cached = set(rng.permutation(2 * n)[:n].tolist())
        zero = [bytes(chunk_bytes)] * n_chunks
        with Client(d.socket) as a, Client(b_sock) as b:
            t0 = time.monotonic()
            for i in sorted(cached):
                if a.put_bytes(LAYOUT, prompts[i], zero).stored_chunks != n_chunks:
                    raise SystemExit(f"prompt {i} was not stored whole (pool too small?)")
            got = [t for k in range(0, 2 * n, 2048) for t in a.lookup_many(LAYOUT, prompts[k:k + 2048])]
            if got != [n_chunks * LAYOUT.chunk_tokens if i in cached else 0 for i in range(2 * n)]:
                raise SystemExit("domain A does not hold exactly the chosen prompts")
            print(f"stored {n} prompts x {n_chunks} chunks in domain A in {time.monotonic() - t0:.1f} s", flush=True)
            results = asyncio.run(measure(d, b_sock, a, b, prompts, cached, args, rng))
            stats_b = b.stats()
    return {
        "question": " ".join(__doc__.strip().split("\n\n")[0].split()),
        "setup": {
            "daemon_settings": settings, "domain_tenant_b": {k: v for k, v in domain_b.items()},
            "layout": LAYOUT.to_dict(), "chunk_bytes": chunk_bytes, "chunks_per_prompt": n_chunks,
            "prompts_per_set": n, "concurrency": args.concurrency, "kinds": args.kinds, "seed": args.seed,
            "grpc": grpc.__version__, "auc_limit": AUC_LIMIT,
        },
        "results": results,
        "domain_b_hit_tokens": stats_b["counters"]["hit_tokens"],
        "all_attacks_within_limit": all(r["attack_within_limit"] for r in results),
    }


def raise_if_missing(path: str) -> None:
    if not os.path.exists(path):
        raise SystemExit(f"domain B's socket {path} was not created")


def print_report(res: dict) -> None:
    rows = []
    for r in res["results"]:
        lat = r["latency"]
        rows.append([f"{r['kind']} c={r['concurrency']}", r["attack_auc"], r["attack_z"], r["control_auc"],
                     lat["B/cached-in-A"]["p50_us"], lat["B/nowhere"]["p50_us"],
                     lat["A/cached-in-A"]["p50_us"], lat["A/nowhere"]["p50_us"],
                     "ok" if r["attack_within_limit"] else "LEAK"])
    print(f"\n{res['setup']['prompts_per_set']} prompts per set; AUC limit {AUC_LIMIT} (max(AUC, 1 - AUC))\n")
    print(format_table(["probe", "attack AUC", "z", "control AUC", "B: A-only p50 us", "B: nowhere p50 us",
                        "A: hit p50 us", "A: miss p50 us", "verdict"], rows))
    print(f"\ndomain B hit tokens over the whole run: {res['domain_b_hit_tokens']} (must be 0)")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, "N = 300 per set, concurrency 1 only (a few seconds)")
    p.add_argument("--n", type=int, default=None, help="prompts per set (default 5000; quick 300)")
    p.add_argument("--chunks", type=int, default=8, help="chunks per prompt (default 8)")
    p.add_argument("--concurrency", default=None, help="comma-separated (default 1,4; quick 1)")
    p.add_argument("--kinds", default="acquire,lookup", help="probe kinds (default acquire,lookup)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    args.n = args.n or (300 if args.quick else 5000)
    args.concurrency = [int(x) for x in (args.concurrency or ("1" if args.quick else "1,4")).split(",")]
    args.kinds = args.kinds.split(",")
    if set(args.kinds) - {"acquire", "lookup"}:
        p.error("--kinds: acquire and/or lookup")
    install_sigterm_exit()
    res = run(args)
    finish("timing_probe", res, args, print_report)
    return 0 if res["all_attacks_within_limit"] and res["domain_b_hit_tokens"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
