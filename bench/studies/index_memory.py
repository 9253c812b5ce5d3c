"""Question: how many bytes of Python heap does the prefix index cost per cached chunk at 1M
chunks (target <= 300 B), and how fast is a 64-chunk longest-prefix match: the flat map
(``kvcached.index.PrefixIndex``: dict chunk-hash -> Node with parent links) versus pygtrie
(``pygtrie.Trie`` keyed by the tuple of chunk hashes on the path), in the same run?

Shape (deterministic, ``--seed``): prompts of 64 chunks. The first prompt is all new; each later
prompt, with probability 0.75, shares a prefix of uniform random length 1..63 chunks with a
uniformly chosen earlier prompt, else starts a fresh root (a new system prompt). New chunks
get random 16-byte hashes (what the SHA-256/128 chain yields). Prompts are added until the
index holds exactly N distinct chunks (N = 1,000,000; ``--quick``: 50,000). Chunks are
inserted with ``PrefixIndex.insert(h, parent, layout_id, TierId.POOL, now, pool_offset)``, each
with its own 16 MiB-block byte offset (an int object per chunk, as in the daemon).

Equal records: both contenders hold the same per-chunk record (a ``kvcached.index.Node``, the
13-slot object the engine uses) and the same incremental eviction queues under the store's
default eviction policy, ``frequency``, whose 8 MiB count-min sketch of evicted chunks' hits is
counted too (pygtrie's contender subclasses ``PrefixIndex`` and only swaps the container), so
the difference measured is the
container: one dict entry per chunk vs one pygtrie ``_Node`` (+ its children mapping) per chunk.

Memory: ``tracemalloc`` current bytes after ``gc.collect()`` once the index is built (and the
peak during the build), divided by chunk count. The 16-byte hash ``bytes`` objects and the
driver's prompt lists are created before ``tracemalloc.start()``, so they are excluded; the
keys' own cost (identical for both contenders: the engine must keep each hash once) is
measured separately and shown as "+ keys". tracemalloc counts requested bytes, not allocator
rounding, so RSS is a little higher.

Match: per-call latency of the longest-prefix match of 64-chunk prompts (full hits, and
half hits that diverge after 32 chunks; every query hash is a fresh ``bytes`` object, as the
hash chain yields, so no cached ``hash()``), returning the matched nodes in order, as
``PrefixIndex.match`` does. pygtrie is matched two ways: ``Trie.longest_prefix`` + a walk up the
parent links, and ``[s.value for s in Trie.prefixes(key)]``; the faster one is its figure.

Run:   .venv/bin/python bench/studies/index_memory.py          (~1-2 min on a 2-core box)
       .venv/bin/python bench/studies/index_memory.py --quick  (a few seconds; writes *.quick.json)
Output: bench/results/index_memory.json
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # run as a file: import bench

import numpy as np
import pygtrie
from bench._common import bench_parser, finish, format_table, ratio, summarize_ns, time_calls

from kvcached.index import Node, PrefixIndex, make_policy
from kvcached.contract.locations import TierId

TARGET_BYTES_PER_CHUNK = 300
PROMPT_CHUNKS = 64
BLOCK_BYTES = 16 << 20  # one 128-token Llama-3-8B bf16 chunk per pool block
LAYOUT_ID = "0123456789abcdef0123456789abcdef"
POOL = TierId.POOL


class PygtrieIndex(PrefixIndex):
    """``PrefixIndex`` with the flat dict swapped for a ``pygtrie.Trie`` keyed by hash paths.

    Same ``Node`` records, same eviction queues and bookkeeping (inherited ``_refresh``); only
    the container and therefore ``insert``/``match`` differ. Insert needs the whole path
    (pygtrie has no O(1) child-of-node access by hash).
    """

    def __init__(self) -> None:
        super().__init__(make_policy("frequency"))
        self._nodes = None  # type: ignore[assignment]
        self.trie: pygtrie.Trie = pygtrie.Trie()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def insert_path(self, path: tuple, parent: Node | None, layout_id: str, tiers: TierId, now: float,
                    pool_offset: int) -> Node:
        node = Node(path[-1], parent, layout_id, tiers, now)
        node.pool_offset = pool_offset
        self.trie[path] = node
        self._count += 1
        if parent is not None:
            parent.children += 1
            if tiers & POOL:
                parent.pool_children += 1
            self._refresh(parent)
        self._refresh(node)
        return node

    def match_longest(self, key: tuple) -> list[Node]:
        step = self.trie.longest_prefix(key)
        if not step:
            return []
        node = step.value
        out = []
        while node is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def match_prefixes(self, key: tuple) -> list[Node]:
        return [s.value for s in self.trie.prefixes(key)]


# -- workload -----------------------------------------------------------------------------


def make_prompts(n_chunks: int, seed: int) -> tuple[list[list[bytes]], list[int], dict]:
    """Prompts (lists of chunk hashes) whose union is exactly ``n_chunks`` distinct chunks.

    Returns (prompts, shared, shape): ``shared[i]`` is how many leading chunks prompt ``i``
    shares with an earlier prompt (those are already indexed when it is inserted).
    """
    rng = np.random.default_rng(seed)
    blob = rng.bytes(16 * n_chunks)
    hashes = [blob[i * 16 : (i + 1) * 16] for i in range(n_chunks)]
    del blob
    prompts: list[list[bytes]] = []
    shared: list[int] = []
    used = 0
    while used < n_chunks:
        if prompts and rng.random() < 0.75:
            j = int(rng.integers(0, len(prompts)))
            s = min(int(rng.integers(1, PROMPT_CHUNKS)), len(prompts[j]))
            head = prompts[j][:s]
        else:
            s, head = 0, []
        new = min(PROMPT_CHUNKS - s, n_chunks - used)
        prompts.append(head + hashes[used : used + new])
        shared.append(s)
        used += new
    roots = sum(1 for s in shared if s == 0)
    shape = {
        "chunks": n_chunks,
        "prompts": len(prompts),
        "prompt_chunks": PROMPT_CHUNKS,
        "share_probability": 0.75,
        "shared_prefix_len": "uniform 1..63 chunks of a uniformly chosen earlier prompt",
        "fresh_roots": roots,
        "mean_shared_chunks": float(np.mean(shared)),
        "full_length_prompts": sum(1 for p in prompts if len(p) == PROMPT_CHUNKS),
    }
    return prompts, shared, shape


def build_flat(prompts: list[list[bytes]], shared: list[int]) -> PrefixIndex:
    # the store's default policy: its sketch of evicted chunks' hits (8 MiB) is part of the cost
    index = PrefixIndex(make_policy("frequency"))
    insert, get = index.insert, index.get
    now = 0.0
    for path, s in zip(prompts, shared):
        parent = get(path[s - 1]) if s else None
        now += 1.0
        for h in path[s:]:
            parent = insert(h, parent, LAYOUT_ID, POOL, now, len(index) * BLOCK_BYTES)
    return index


def build_trie(prompts: list[list[bytes]], shared: list[int]) -> PygtrieIndex:
    index = PygtrieIndex()
    insert = index.insert_path
    now = 0.0
    for path, s in zip(prompts, shared):
        tpath = tuple(path)
        parent = index.trie[tpath[:s]] if s else None
        now += 1.0
        for k in range(s, len(tpath)):
            parent = insert(tpath[: k + 1], parent, LAYOUT_ID, POOL, now, len(index) * BLOCK_BYTES)
    return index


BUILDERS = {"flat": build_flat, "pygtrie": build_trie}


def measure_memory(name: str, prompts, shared) -> tuple[dict, object]:
    gc.collect()
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    t0 = time.perf_counter()
    index = BUILDERS[name](prompts, shared)
    build_s = time.perf_counter() - t0
    gc.collect()
    current, peak = tracemalloc.get_traced_memory()
    snap = tracemalloc.take_snapshot()
    tracemalloc.stop()
    by_file: dict[str, int] = {}
    for st in snap.statistics("filename"):
        fn = st.traceback[0].filename
        key = ("kvcached/" + fn.split("/kvcached/")[-1]) if "/kvcached/" in fn else os.path.basename(fn)
        by_file[key] = by_file.get(key, 0) + st.size
    del snap
    n = len(index)
    return {
        "chunks": n,
        "current_bytes": current - base,
        "peak_bytes": peak - base,
        "bytes_per_chunk": (current - base) / n,
        "peak_bytes_per_chunk": (peak - base) / n,
        "by_file_bytes_per_chunk": {k: v / n for k, v in sorted(by_file.items(), key=lambda kv: -kv[1]) if v > n},
        "build_seconds_under_tracemalloc": build_s,
    }, index


def key_bytes_per_chunk(n: int) -> float:
    """What one 16-byte hash object costs (tracemalloc), identical for every contender."""
    gc.collect()
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    blob = os.urandom(16 * n)
    keys = [blob[i * 16 : (i + 1) * 16] for i in range(n)]
    cur, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    overhead = sys.getsizeof(keys) + len(blob) + 33
    del keys, blob
    return (cur - base - overhead) / n


def match_workload(prompts: list[list[bytes]], count: int, seed: int) -> tuple[list[list[bytes]], list[list[bytes]]]:
    rng = np.random.default_rng(seed + 1)
    full = [p for p in prompts if len(p) == PROMPT_CHUNKS]
    pick = [full[int(i)] for i in rng.integers(0, len(full), count)]
    half = [p[:32] + [rng.bytes(16) for _ in range(32)] for p in pick[: max(1, count // 4)]]
    return pick, half


def time_matches(name: str, index, queries: list[list[bytes]], reps: int, expect: int) -> dict:
    out: dict[str, list[int]] = {}
    if name == "flat":
        fns = {"match": index.match}
        def conv(q):  # the flat map takes the query as it is
            return q
    else:
        fns = {"longest_prefix+parents": index.match_longest, "prefixes": index.match_prefixes}
        conv = tuple  # key conversion is part of the pygtrie call
    for q in queries[:3]:
        for f in fns.values():
            assert len(f(conv(q))) == expect, (name, len(f(conv(q))), expect)
    for label, f in fns.items():
        xs: list[int] = []
        for _ in range(reps):
            # Fresh bytes objects per call, as the hash chain yields them: their hash() is not
            # cached yet and equality is a memcmp, not an identity check.
            fresh = [[bytes(bytearray(h)) for h in q] for q in queries]
            for q in fresh:
                time_calls(lambda f=f, q=q: f(conv(q)), 1, xs)
            del fresh
        out[label] = xs
    return {k: summarize_ns(v) for k, v in out.items()}


def run(args: argparse.Namespace) -> dict:
    t_all = time.perf_counter()
    print(f"generating {args.chunks:,} chunks ...", flush=True)
    prompts, shared, shape = make_prompts(args.chunks, args.seed)
    if args.trie_chunks < args.chunks:
        tp, ts, tshape = make_prompts(args.trie_chunks, args.seed)
    else:
        tp, ts, tshape = prompts, shared, shape
    keys_per_chunk = key_bytes_per_chunk(min(args.chunks, 200_000))
    queries, halves = match_workload(prompts, args.queries, args.seed)
    tqueries, thalves = (queries, halves) if tp is prompts else match_workload(tp, args.queries, args.seed)

    results: dict[str, dict] = {}
    for name in ("flat", "pygtrie"):
        p, s = (prompts, shared) if name == "flat" else (tp, ts)
        q, hq = (queries, halves) if name == "flat" else (tqueries, thalves)
        print(f"{name}: building {sum(len(x) for x in p) - sum(s):,} chunks under tracemalloc ...", flush=True)
        mem, index = measure_memory(name, p, s)
        print(f"{name}: {mem['bytes_per_chunk']:.1f} B/chunk; timing matches ...", flush=True)
        gc.collect()
        full_t = time_matches(name, index, q, args.reps, PROMPT_CHUNKS)
        half_t = time_matches(name, index, hq, args.reps, 32)
        if len(index) <= 100_000 and name == "flat":
            index.check_invariants()
        queues = {"leaves": len(index.leaves), "pool_lru": len(index.pool_lru), "heap_entries_leaves": len(index.leaves._heap)}
        del index
        gc.collect()
        # Insert rate without tracemalloc (it slows allocation), on a fresh build.
        gc.disable()
        t0 = time.perf_counter()
        index = BUILDERS[name](p, s)
        build_s = time.perf_counter() - t0
        gc.enable()
        del index
        gc.collect()
        best_full = min(full_t, key=lambda k: full_t[k]["p50_us"])
        best_half = min(half_t, key=lambda k: half_t[k]["p50_us"])
        results[name] = {
            **mem,
            "bytes_per_chunk_with_keys": mem["bytes_per_chunk"] + keys_per_chunk,
            "build_seconds": build_s,
            "insert_us_per_chunk": build_s / mem["chunks"] * 1e6,
            "match_full_hit_64": full_t,
            "match_half_hit_32_of_64": half_t,
            "match_full_p50_us": full_t[best_full]["p50_us"],
            "match_full_p99_us": full_t[best_full]["p99_us"],
            "match_full_method": best_full,
            "match_half_p50_us": half_t[best_half]["p50_us"],
            "match_half_method": best_half,
            "queues": queues,
        }

    f, t = results["flat"], results["pygtrie"]
    ratios = {
        "memory_pygtrie_over_flat": ratio(t["bytes_per_chunk"], f["bytes_per_chunk"]),
        "memory_with_keys_pygtrie_over_flat": ratio(t["bytes_per_chunk_with_keys"], f["bytes_per_chunk_with_keys"]),
        "match_full_p50_pygtrie_over_flat": ratio(t["match_full_p50_us"], f["match_full_p50_us"]),
        "match_half_p50_pygtrie_over_flat": ratio(t["match_half_p50_us"], f["match_half_p50_us"]),
        "insert_pygtrie_over_flat": ratio(t["insert_us_per_chunk"], f["insert_us_per_chunk"]),
    }
    return {
        "question": " ".join(__doc__.strip().split("\n\n")[0].split()),
        "shape_flat": shape,
        "shape_pygtrie": tshape,
        "pygtrie_measured_at_fewer_chunks": tp is not prompts,
        "key_bytes_per_chunk": keys_per_chunk,
        "queries": args.queries,
        "reps": args.reps,
        "contenders": results,
        "ratios": ratios,
        "target_bytes_per_chunk": TARGET_BYTES_PER_CHUNK,
        "target_met_flat_index_only": f["bytes_per_chunk"] <= TARGET_BYTES_PER_CHUNK,
        "target_met_flat_with_keys": f["bytes_per_chunk_with_keys"] <= TARGET_BYTES_PER_CHUNK,
        "wall_seconds": time.perf_counter() - t_all,
    }


def print_report(res: dict) -> None:
    c = res["contenders"]
    print()
    rows = []
    for name in ("flat", "pygtrie"):
        r = c[name]
        rows.append([
            name, f"{r['chunks']:,}", r["bytes_per_chunk"], r["bytes_per_chunk_with_keys"], r["peak_bytes_per_chunk"],
            r["insert_us_per_chunk"], r["match_full_p50_us"], r["match_full_p99_us"], r["match_half_p50_us"],
        ])
    rows.append([
        "pygtrie/flat", "", res["ratios"]["memory_pygtrie_over_flat"], res["ratios"]["memory_with_keys_pygtrie_over_flat"],
        ratio(c["pygtrie"]["peak_bytes_per_chunk"], c["flat"]["peak_bytes_per_chunk"]),
        res["ratios"]["insert_pygtrie_over_flat"], res["ratios"]["match_full_p50_pygtrie_over_flat"],
        ratio(c["pygtrie"]["match_full_p99_us"], c["flat"]["match_full_p99_us"]),
        res["ratios"]["match_half_p50_pygtrie_over_flat"],
    ])
    print(format_table(
        ["index", "chunks", "B/chunk", "B/chunk+keys", "peak B/chunk", "insert us/chunk",
         "match64 p50 us", "match64 p99 us", "half p50 us"],
        rows,
    ))
    print(f"\n(keys: one 16-byte bytes object = {res['key_bytes_per_chunk']:.1f} B/chunk, the same for both)")
    for name in ("flat", "pygtrie"):
        parts = ", ".join(f"{k} {v:.1f}" for k, v in c[name]["by_file_bytes_per_chunk"].items())
        print(f"{name} B/chunk by allocating file: {parts}")
        m = c[name]["match_full_hit_64"]
        if len(m) > 1:
            print(f"{name} match variants p50: " + ", ".join(f"{k} {v['p50_us']:.2f} us" for k, v in m.items()))
    if res["pygtrie_measured_at_fewer_chunks"]:
        print(f"NOTE: pygtrie measured at {c['pygtrie']['chunks']:,} chunks, flat at {c['flat']['chunks']:,}")
    f = c["flat"]
    print(
        f"\ntarget <= {TARGET_BYTES_PER_CHUNK} B/chunk (flat, {f['chunks']:,} chunks): index only "
        f"{f['bytes_per_chunk']:.0f} B -> {'MET' if res['target_met_flat_index_only'] else 'NOT MET'}; "
        f"with keys {f['bytes_per_chunk_with_keys']:.0f} B -> {'MET' if res['target_met_flat_with_keys'] else 'NOT MET'}"
    )
    print(f"wall {res['wall_seconds']:.0f} s")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, "50k chunks, fewer match samples (a few seconds)")
    p.add_argument("--chunks", type=int, default=None, help="chunks in the flat index (default 1,000,000)")
    p.add_argument("--trie-chunks", type=int, default=None,
                   help="chunks in the pygtrie index (default: same as --chunks)")
    p.add_argument("--queries", type=int, default=None, help="distinct 64-chunk prompts matched (default 1000)")
    p.add_argument("--reps", type=int, default=None, help="passes over the queries (default 2)")
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args(argv)
    args.chunks = args.chunks or (50_000 if args.quick else 1_000_000)
    args.trie_chunks = min(args.trie_chunks or args.chunks, args.chunks)
    args.queries = args.queries or (200 if args.quick else 1000)
    args.reps = args.reps or (1 if args.quick else 2)
    res = run(args)
    finish("index_memory", res, args, print_report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
