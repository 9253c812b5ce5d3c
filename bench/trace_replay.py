"""Question: on the Mooncake FAST'25 traces (conversation, synthetic), what block hit rate does
the real engine reach with a pool of C blocks (C = 1k, 10k, 30k, 50k, 100k, infinite), next to
a plain LRU block cache of the same capacity, and is the engine >= the plain LRU everywhere?

Workload: ../shared/traces/mooncake-fast25/{conversation,synthetic}_trace.jsonl (see the
README there): one request per line, ``hash_ids`` are prefix block ids of 512-token blocks,
``input_length`` tokens. Block ``h`` is given the deterministic, collision-free tokens
``h*512 .. h*512+511`` (uint32); a request's prompt is the concatenation of its blocks' tokens
cut to ``input_length``, so only its ``input_length // 512`` FULL blocks are ever hashed or
cached by the engine.

Contenders, replayed side by side in one run:

* ``engine``  ``kvcached.store.Store``: host pool of exactly C blocks (``nvme_bytes=0``, so the
  pool is the only tier), ``chunk_tokens=512``, 2 bytes/token (1 KiB chunks), cache_ttl huge,
  a deterministic clock (trace timestamp in seconds, forced strictly increasing by 1 us per
  call). Per request: ``acquire(all input tokens)`` -> hit blocks = ``matched_tokens // 512``,
  ``release``, then ``reserve`` + ``commit`` of the rest (no bytes written). Eviction is the
  engine's own: least recently used unpinned leaves first.
  "Infinite" = a pool with more blocks than distinct full-block ids.
* ``lru``     a plain LRU block cache (``collections.OrderedDict`` of hash ids) of C blocks: hit =
  the longest prefix of the request's full blocks that are all cached; then every full block
  of the request is touched/inserted at the MRU end, in order, evicting the LRU block beyond C.

Hit rate (both) = hit blocks / full blocks, summed over the trace. For comparison with the
paper's maxima (~0.40 conversation, ~0.66 synthetic) the LRU is also replayed at infinite
capacity over ALL ``hash_ids`` (partial last blocks included): prefix hits, and "id seen
before" hits.

Target: engine hit rate >= lru hit rate at every capacity.

Run:   .venv/bin/python bench/trace_replay.py          (~35-60 s on a 2-core box)
       .venv/bin/python bench/trace_replay.py --quick  (a few seconds; first requests only,
                                                        writes *.quick.json / *.quick.png)
Output: bench/results/trace_replay.json, bench/results/trace_replay.png
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections import OrderedDict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
from _common import RESULTS_DIR, format_table, write_json

from kvcached.config import StoreConfig
from kvcached.errors import TierFull
from kvcached.keys import KVLayout
from kvcached.store import Store

# ../shared/traces beside the repository (as on the dev machines and in CI); override with
# KVCACHED_TRACES=/path/to/mooncake-fast25.
TRACE_DIR = os.environ.get(
    "KVCACHED_TRACES",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "traces", "mooncake-fast25"),
)
TRACES = ("conversation", "synthetic")
BLOCK = 512
CAPACITIES = (1_000, 10_000, 30_000, 50_000, 100_000, None)  # None = infinite
QUICK_CAPACITIES = (1_000, 10_000, None)
PAPER_MAX = {"conversation": 0.40, "synthetic": 0.66}
_AR = np.arange(BLOCK, dtype=np.uint32)


class Request:
    __slots__ = ("full", "ids", "input_length", "ts")

    def __init__(self, d: dict) -> None:
        self.ts = d["timestamp"] / 1000.0
        self.input_length = int(d["input_length"])
        self.ids = list(d["hash_ids"])
        self.full = self.input_length // BLOCK  # blocks fully inside input_length
        assert len(self.ids) == -(-self.input_length // BLOCK), d


def load_trace(name: str, limit: int | None) -> list[Request]:
    out = []
    with open(os.path.join(TRACE_DIR, f"{name}_trace.jsonl")) as f:
        for line in f:
            if line.strip():
                out.append(Request(json.loads(line)))
                if limit and len(out) >= limit:
                    break
    return out


def trace_stats(reqs: list[Request]) -> dict:
    full_ids, all_ids = set(), set()
    parent: dict[int, int] = {}
    inconsistent = 0
    for r in reqs:
        all_ids.update(r.ids)
        full_ids.update(r.ids[: r.full])
        prev = -1
        for h in r.ids:
            if parent.setdefault(h, prev) != prev:
                inconsistent += 1
            prev = h
    return {
        "requests": len(reqs),
        "full_blocks": sum(r.full for r in reqs),
        "all_blocks": sum(len(r.ids) for r in reqs),
        "distinct_full_block_ids": len(full_ids),
        "distinct_ids": len(all_ids),
        "max_id": max(all_ids),
        "ids_with_inconsistent_parent": inconsistent,  # 0: ids really are prefix hashes
        "duration_s": reqs[-1].ts - reqs[0].ts,
    }


def tokens_of(r: Request) -> np.ndarray:
    ids = np.asarray(r.ids, dtype=np.uint32)
    return (ids[:, None] * np.uint32(BLOCK) + _AR[None, :]).ravel()[: r.input_length]


# -- contenders -------------------------------------------------------------------------------


def replay_lru(reqs: list[Request], capacity: int | None, all_blocks: bool = False) -> dict:
    cache: OrderedDict[int, None] = OrderedDict()
    cap = capacity if capacity is not None else 1 << 62
    hits = total = 0
    per_req = []
    for r in reqs:
        blocks = r.ids if all_blocks else r.ids[: r.full]
        hit = 0
        for b in blocks:
            if b in cache:
                hit += 1
            else:
                break
        hits += hit
        total += len(blocks)
        per_req.append(hit)
        for b in blocks:
            if b in cache:
                cache.move_to_end(b)
            else:
                cache[b] = None
                if len(cache) > cap:
                    cache.popitem(last=False)
    return {"hit_blocks": hits, "blocks": total, "hit_rate": hits / total if total else 0.0, "per_request": per_req}


def replay_seen_before(reqs: list[Request]) -> float:
    seen: set[int] = set()
    hits = total = 0
    for r in reqs:
        for b in r.ids:
            hits += b in seen
            total += 1
        seen.update(r.ids)
    return hits / total


class TraceClock:
    """Trace time in seconds, forced strictly increasing (1 us per call): deterministic."""

    def __init__(self) -> None:
        self.trace_time = 0.0
        self.last = -1.0

    def __call__(self) -> float:
        t = max(self.trace_time, self.last + 1e-6)
        self.last = t
        return t


def replay_engine(reqs: list[Request], capacity: int | None, distinct_full: int, check: bool) -> dict:
    layout = KVLayout("bench/mooncake-replay@1", num_layers=1, num_kv_heads=1, head_dim=1, dtype="uint8",
                      chunk_tokens=BLOCK)  # 2 bytes/token -> 1 KiB chunks
    pool_chunks = capacity if capacity is not None else distinct_full + 1024
    state_dir = tempfile.mkdtemp(prefix="kvc-bench-replay-")
    clock = TraceClock()
    cfg = StoreConfig(
        state_dir=state_dir,
        pool_bytes=layout.chunk_bytes * pool_chunks,  # a packed pool: exactly pool_chunks chunks
        pool_prefault=False,
        nvme_bytes=0,
        writeback=False,  # no background thread: the replay stays deterministic (and there is no NVMe tier)
        cache_ttl=1e12,
        lease_ttl=1e9,
        reservation_ttl=1e9,
    )
    store = Store(cfg, clock=clock)
    hits = total = 0
    per_req = []
    tier_full = truncated = 0
    t0 = time.perf_counter()
    try:
        lid = store.register_layout(layout)
        assert store.pool.capacity_bytes == layout.chunk_bytes * pool_chunks
        for r in reqs:
            clock.trace_time = r.ts
            toks = tokens_of(r)
            lease = store.acquire(lid, toks)
            hit = lease.matched_tokens // BLOCK
            store.release(lease.lease_id)
            hits += hit
            total += r.full
            per_req.append(hit)
            try:
                res = store.reserve(lid, toks)
            except TierFull:
                tier_full += 1
                continue
            if (res.cached_tokens + res.in_flight_tokens) // BLOCK + len(res.slots) < r.full:
                truncated += 1
            store.commit(res.reservation_id)
        wall = time.perf_counter() - t0
        if check:
            store.index.check_invariants()
        st = store.stats()
        c = st.counters
        out = {
            "hit_blocks": hits,
            "blocks": total,
            "hit_rate": hits / total if total else 0.0,
            "per_request": per_req,
            "pool_chunks": pool_chunks,
            "index_chunks_at_end": st.indexed_chunks,
            "pool_committed_at_end": store.pool.committed_chunks,
            "pool_evictions": c.pool_evictions,
            "committed_chunks": c.committed_chunks,
            "reserve_tier_full": tier_full,
            "reservations_truncated": truncated,
            "seconds": wall,
            "us_per_request": wall / len(reqs) * 1e6,
        }
    finally:
        store.close()
        shutil.rmtree(state_dir, ignore_errors=True)
    return out


# -- driver -----------------------------------------------------------------------------------


def compare(engine: list[int], lru: list[int]) -> dict:
    e, s = np.asarray(engine), np.asarray(lru)
    worse = np.nonzero(e < s)[0]
    return {
        "requests_engine_more": int((e > s).sum()),
        "requests_engine_fewer": len(worse),
        "blocks_engine_fewer": int((s - e)[worse].sum()) if len(worse) else 0,
        "first_requests_engine_fewer": [int(i) for i in worse[:10]],
    }


def run(args: argparse.Namespace) -> dict:
    caps = QUICK_CAPACITIES if args.quick else CAPACITIES
    out: dict = {"question": " ".join(__doc__.strip().split("\n\n")[0].split()), "traces": {}}
    t_all = time.perf_counter()
    for name in TRACES:
        limit = (args.quick_requests if args.quick else None) or args.limit
        reqs = load_trace(name, limit)
        stats = trace_stats(reqs)
        print(f"{name}: {stats['requests']:,} requests, {stats['full_blocks']:,} full blocks, "
              f"{stats['distinct_full_block_ids']:,} distinct full-block ids", flush=True)
        inf_all = replay_lru(reqs, None, all_blocks=True)
        rows = []
        for cap in caps:
            lru = replay_lru(reqs, cap)
            eng = replay_engine(reqs, cap, stats["distinct_full_block_ids"], check=args.check)
            cmp_ = compare(eng.pop("per_request"), lru.pop("per_request"))
            label = "inf" if cap is None else str(cap)
            rows.append({
                "capacity": cap,
                "label": label,
                "engine": eng,
                "lru": lru,
                "engine_minus_lru": eng["hit_rate"] - lru["hit_rate"],
                "engine_ge_lru": eng["hit_rate"] >= lru["hit_rate"],
                "per_request": cmp_,
            })
            print(f"  C={label:>7}: engine {eng['hit_rate']:.4f}  lru {lru['hit_rate']:.4f}  "
                  f"({eng['us_per_request']:.0f} us/request)", flush=True)
        inf_all.pop("per_request")
        out["traces"][name] = {
            "stats": stats,
            "capacities": rows,
            "lru_infinite_all_hash_ids_prefix": inf_all,
            "lru_infinite_all_hash_ids_seen_before": replay_seen_before(reqs),
            "paper_max_hit_rate": PAPER_MAX[name],
            "target_met": all(r["engine_ge_lru"] for r in rows),
        }
    out["capacities"] = [c for c in caps]
    out["target_met"] = all(t["target_met"] for t in out["traces"].values())
    out["wall_seconds"] = time.perf_counter() - t_all
    return out


def print_report(res: dict) -> None:
    for name, t in res["traces"].items():
        s = t["stats"]
        print(f"\n{name}: {s['requests']:,} requests, {s['full_blocks']:,} full blocks "
              f"({s['distinct_full_block_ids']:,} distinct)")
        rows = []
        for r in t["capacities"]:
            e, l_ = r["engine"], r["lru"]
            rows.append([
                r["label"], e["hit_rate"], l_["hit_rate"], r["engine_minus_lru"],
                (e["hit_rate"] / l_["hit_rate"]) if l_["hit_rate"] else float("nan"),
                r["per_request"]["requests_engine_more"], r["per_request"]["requests_engine_fewer"],
                e["pool_evictions"], e["us_per_request"],
            ])
        print(format_table(
            ["capacity", "engine hit", "lru hit", "engine-lru", "engine/lru", "req e>l", "req e<l",
             "evictions", "us/req"],
            rows,
        ))
        print(f"  lru, infinite, all hash_ids: prefix hits {t['lru_infinite_all_hash_ids_prefix']['hit_rate']:.4f}, "
              f"id-seen-before {t['lru_infinite_all_hash_ids_seen_before']:.4f} "
              f"(paper max ~{t['paper_max_hit_rate']:.2f})")
        print(f"  target engine >= lru at every capacity: {'MET' if t['target_met'] else 'NOT MET'}")
    print(f"\nwall {res['wall_seconds']:.0f} s")


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = {"conversation": "tab:blue", "synthetic": "tab:orange"}
    finite = [c for c in res["capacities"] if c is not None]
    inf_x = max(finite) * 3 if finite else 1
    for name, t in res["traces"].items():
        xs = [(r["capacity"] if r["capacity"] is not None else inf_x) for r in t["capacities"]]
        ax.plot(xs, [r["engine"]["hit_rate"] for r in t["capacities"]], "-o", color=colors[name],
                label=f"{name}: engine (kvcached)")
        ax.plot(xs, [r["lru"]["hit_rate"] for r in t["capacities"]], "--s", color=colors[name], alpha=0.7,
                mfc="none", label=f"{name}: plain LRU")
        ax.axhline(t["paper_max_hit_rate"], color=colors[name], lw=0.8, ls=":",
                   label=f"{name}: paper max ~{t['paper_max_hit_rate']:.2f}")
    ax.set_xscale("log")
    ticks = finite + [inf_x]
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{c // 1000}k" for c in finite] + ["inf"])
    ax.minorticks_off()
    ax.set_xlabel("cache capacity (512-token blocks)")
    ax.set_ylabel("block hit rate (full blocks)")
    ax.set_title("Mooncake FAST'25 trace replay: kvcached engine vs plain LRU")
    ax.set_ylim(0, 0.75)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7.5, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="first requests only, capacities 1k/10k/inf (a few seconds)")
    p.add_argument("--quick-requests", type=int, default=800, help="requests per trace with --quick (default 800)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests of each trace")
    p.add_argument("--check", action="store_true", help="run the index's O(n) invariant check after each replay")
    p.add_argument("--out", default=None, help=f"results directory (default {RESULTS_DIR})")
    args = p.parse_args(argv)
    res = run(args)
    res["quick"] = args.quick
    print_report(res)
    stem = "trace_replay.quick" if args.quick else "trace_replay"
    path = write_json(stem, res, args.out)
    png = os.path.join(os.path.dirname(path), stem + ".png")
    plot(res, png)
    print(f"\nwrote {path}\nwrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
