"""Question: which structure should answer "how much of this prompt is cached": kvcached's prefix
index, a plain set of chained chunk hashes, a Bloom filter of them, or MinHash-LSH over token
shingles? For each, on the same lookups in one run: match precision (is the claimed cached prefix
really cached), recall (how much of the truly cached prefix it finds), index bytes per chunk and
lookups/s; and does a Bloom filter measurably pay anywhere in kvcached?

Workload (deterministic, ``--seed``). The Mooncake FAST'25 traces (``../shared/traces``, see its
README) give per request the ids of its 512-token blocks (equal ids: identical prefix up to and
including that block). Block id ``h`` of trace ``s`` becomes 512 fixed pseudo-random token ids
(SplitMix64 of ``(s, h, j)`` modulo a 128,256-token vocabulary, Llama-3's), a request's prompt is
its blocks' tokens cut to ``input_length``, and chunks are the daemon's default 128 tokens (four
per trace block). The cache holds the first 1,500 conversation and 1,000 synthetic requests (no
eviction; 195k distinct chunks; ``--quick``: 200 and 150); the lookups are:

* ``conversation`` / ``synthetic``: the next 1,000 / 500 requests of each trace, as they arrived;
* ``one_token_edit``: a cached prompt with one token changed, at a uniformly drawn position of its
  full chunks;
* ``reordered``: a cached prompt with two of its 512-token sections (trace blocks) swapped;
* ``new_suffix``: a cached prompt followed by 1-4 chunks of new tokens;

400 of each kind (``--quick``: 30), of cached prompts drawn uniformly.

Truth: the longest truly cached prefix in chunks, from an exact reference that compares token
contents (a dict keyed by (parent chunk, the chunk's token bytes): no hashing can make it wrong).

Contenders (each one's lookup goes from the prompt's token ids to a claimed prefix length):

* ``kvcached trie``: ``kvcached.index.PrefixIndex``, the class the daemon uses, with the store's
  default eviction policy, filled with ``insert_chain`` as a commit does; the chunk hashes are
  the daemon's, ``ChunkHasher.chain`` (keyed SHA-256/128, chained) over ``normalize_tokens``, as
  ``Store.hashes`` computes them (without the store's memo of recent runs, for every contender).
* ``chained-hash set``: a ``set`` of the same hashes, walked until one is missing.
* ``Bloom 1 %`` / ``Bloom 0.1 %``: ``rbloom.Bloom`` sized for the cached chunk count at that
  false-positive rate, walked the same way; the measured false-positive rate is reported too.
* ``MinHash-LSH``: datasketch ``MinHashLSH`` (threshold 0.9, 128 permutations, the library's
  defaults) over each chunk's 3-token shingles, walked like a trie: chunk i matches when the LSH
  returns a cached chunk whose parent matched chunk i-1. The build is exact (each distinct chunk
  once, with its true parent); only the lookup is approximate. Shingles are hashed with numpy
  and fed to datasketch's own permutation scheme (``affine32``: the same values
  ``MinHash.update_batch`` computes, checked in the test); datasketch's per-shingle SHA-1 would
  cost more (its speed is in the JSON).

Metrics per contender and lookup kind, with c = claimed and t = true chunks: exact (c == t),
safe (c <= t: nothing claimed that is not cached; "match precision"), chunk precision
sum(min(c, t)) / sum(c), recall sum(min(c, t)) / sum(t), over-claimed chunks sum(max(0, c - t))
(KV that would be served for tokens it was not computed for). Memory: ``tracemalloc`` of the
structure's build (current bytes after ``gc.collect()``), the 16-byte hash objects that a trie
or set keeps added at ``sys.getsizeof`` each (49 B); the Bloom filter's bits live in Rust, out
of tracemalloc's sight, so its figure is ``size_in_bits / 8``. The trie's eviction policy, with
its fixed 8 MiB sketch, is made before tracing starts: the figure is what each chunk adds. Lookups/s: a sample of the
lookups timed per call, contenders interleaved in a new random order each repeat, gc off; the
median over repeats of lookups / wall time, end to end (tokens in) and probe only (hashes or
sketches already made).

Does a Bloom filter pay? Timed here: as a gate in front of the trie (trie.match vs "first hash
in the filter, else 0, then trie.match", and the same gate asking the trie's own dict) on the
lookup sample and on 64-chunk prompts that all miss; in
the router's per-host index (its ``HostIndex`` layout, a dict of counts and a set per medium,
rebuilt here on the same hashes for its bytes per chunk). The remote tier's figures come from
``bench/results/remote_tier.json`` (quoted, not re-measured).

Run:   .venv/bin/python bench/studies/matchers.py          (~3 min on a 2-core box)
       .venv/bin/python bench/studies/matchers.py --quick  (< 30 s; writes *.quick.json / *.quick.png)
Output: bench/results/matchers.json, bench/results/matchers.png
The workload, the reference, the contenders and the scoring live in ``bench/studies/_matchers.py``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import tracemalloc
from typing import Callable, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # run as a file: import bench

import numpy as np
from bench._common import (
    RESULTS_DIR, TRACE_DIR, bench_parser, finish, format_table, ratio, save_figure, subplots, summarize_ns,
)
from bench.studies._matchers import (
    CHUNK_TOKENS, LAYOUT, LSH_THRESHOLD, NUM_PERM, SHINGLE, VOCAB, BloomMatcher, ChainHashes, ChunkSketcher, Lookup,
    MinHashMatcher, SetMatcher, StoredPrompt, TrieMatcher, Workload, build_workload, score, score_by_kind,
)
from datasketch import MinHash
from rbloom import Bloom

from kvcached.contract.keys import ChunkHash

BLOOM_RATES = (0.01, 0.001)
#: What a source document claims (accuracy, memory, queries/s), quoted as given.
SOURCE_CLAIMS = {
    "kvcached trie": {"accuracy": 0.992, "memory_bytes": 1.2e9, "qps": 850},
    "MinHash-LSH": {"accuracy": 0.957, "memory_bytes": 0.8e9, "qps": 1200},
    "Bloom 1 %": {"accuracy": 0.883, "memory_bytes": 0.4e9, "qps": 2000},
}
FULL = {"warm": {"conversation": 1500, "synthetic": 1000}, "lookups": {"conversation": 1000, "synthetic": 500},
        "variants": 400, "sample": 500, "repeats": 5, "fp_probes": 1_000_000}
QUICK = {"warm": {"conversation": 200, "synthetic": 150}, "lookups": {"conversation": 100, "synthetic": 60},
         "variants": 30, "sample": 60, "repeats": 3, "fp_probes": 100_000}


# -- memory ----------------------------------------------------------------------------------------


def traced_bytes(build: Callable[[], None]) -> int:
    """Python heap bytes that ``build()`` leaves allocated (tracemalloc, after gc)."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        build()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()


def router_layout_bytes(prompts: Sequence[StoredPrompt]) -> tuple[int, int]:
    """Bytes of the router's ``HostIndex`` layout for these chunks (a dict hash -> media count and
    one set per medium, one medium here), rebuilt on the same hash objects; and the chunk count."""
    held: dict[bytes, int] = {}
    medium: set[bytes] = set()

    def build() -> None:
        for p in prompts:
            for h in p.hashes[p.known :]:
                medium.add(h)
                held[h] = held.get(h, 0) + 1

    return traced_bytes(build), len(held)


# -- timing ---------------------------------------------------------------------------------------


def timed_pass(fn: Callable[[object], int], inputs: Sequence[object]) -> tuple[float, list[int], list[int]]:
    """Wall seconds of ``fn`` over ``inputs`` (gc off), the per-call ns and the results."""
    pc = time.perf_counter_ns
    per: list[int] = []
    res: list[int] = []
    enabled = gc.isenabled()
    gc.disable()
    try:
        t0 = pc()
        for x in inputs:
            s = pc()
            res.append(fn(x))
            per.append(pc() - s)
        wall = (pc() - t0) / 1e9
    finally:
        if enabled:
            gc.enable()
    return wall, per, res


def fresh_hashes(hash_lists: Sequence[list[ChunkHash]]) -> list[list[ChunkHash]]:
    """New bytes objects with the same values: their hash() is not cached yet, as after hashing."""
    return [[ChunkHash(bytes(bytearray(h))) for h in hs] for hs in hash_lists]


def time_contenders(contenders: dict[str, Callable[[], Callable[[object], int]]],
                    inputs: dict[str, Callable[[], Sequence[object]]], repeats: int,
                    rng: np.random.Generator) -> dict:
    """Per contender: lookups/s (median over repeats), per-call p50/p90, interleaved by repeat."""
    walls: dict[str, list[float]] = {n: [] for n in contenders}
    calls: dict[str, list[int]] = {n: [] for n in contenders}
    names = list(contenders)
    for _ in range(repeats):
        for i in rng.permutation(len(names)):
            n = names[int(i)]
            xs = inputs[n]()
            wall, per, _ = timed_pass(contenders[n](), xs)
            walls[n].append(len(xs) / wall)
            calls[n].extend(per)
    return {n: {"lookups_per_s": statistics.median(walls[n]), "lookups_per_s_by_repeat": walls[n],
                **summarize_ns(calls[n])} for n in names}


def false_positive_rate(bloom: Bloom, probes: int, seed: int) -> float:
    """Share of fresh random 16-byte keys (never added) that the filter reports present."""
    blob = np.random.default_rng(seed).bytes(16 * probes)
    return sum(blob[i : i + 16] in bloom for i in range(0, 16 * probes, 16)) / probes


def sketch_speed(sketcher: ChunkSketcher, tokens: np.ndarray, chunks: int, repeats: int = 3) -> dict:
    """µs per chunk (best of ``repeats``): the vectorised sketch vs datasketch's own ``update_batch``
    (SHA-1 per shingle) of the same chunks."""
    c = sketcher.chunk_tokens
    vec, native = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sketcher.sketch(tokens, 0, chunks)
        vec.append((time.perf_counter() - t0) / chunks)
        t0 = time.perf_counter()
        for i in range(chunks):
            seg = tokens[i * c : (i + 1) * c]
            m = MinHash(num_perm=len(sketcher.a), seed=1, scheme="affine32")
            m.update_batch([seg[j : j + SHINGLE].tobytes() for j in range(c - SHINGLE + 1)])
        native.append((time.perf_counter() - t0) / chunks)
    return {"vectorised_us_per_chunk": min(vec) * 1e6, "datasketch_update_batch_sha1_us_per_chunk": min(native) * 1e6,
            "chunks": chunks}


# -- the run ----------------------------------------------------------------------------------------


def measure_memory(matchers: Sequence, wl: Workload) -> dict[str, dict]:
    """Build every contender from the cached prompts under tracemalloc; bytes per cached chunk."""
    n_chunks = len(wl.reference)
    key_bytes = sys.getsizeof(wl.stored[0].hashes[0])
    out: dict[str, dict] = {}
    for m in matchers:
        t0 = time.perf_counter()
        traced = traced_bytes(lambda m=m: m.build(wl.stored))
        if m.chunks() != n_chunks:
            raise AssertionError(f"{m.name} holds {m.chunks()} chunks, the reference {n_chunks}")
        per = traced / n_chunks
        row = {"tracemalloc_bytes_per_chunk": per, "build_seconds_under_tracemalloc": time.perf_counter() - t0}
        if isinstance(m, BloomMatcher):
            row["bytes_per_chunk"] = m.bytes_per_chunk()
            row["how"] = "size_in_bits / 8 (the bits are allocated in Rust, outside tracemalloc)"
        elif isinstance(m, (TrieMatcher, SetMatcher)):
            row["bytes_per_chunk"] = per + key_bytes
            row["how"] = f"tracemalloc of the build + {key_bytes} B per kept 16-byte hash object (sys.getsizeof)"
        else:
            row["bytes_per_chunk"] = per
            row["how"] = "tracemalloc of the build (datasketch's band tables and keys, the parent array)"
        out[m.name] = row
        print(f"  built {m.name}: {row['bytes_per_chunk']:.1f} B/chunk", flush=True)
    router_bytes, router_chunks = router_layout_bytes(wl.stored)
    out["router HostIndex layout"] = {
        "bytes_per_chunk": router_bytes / router_chunks + key_bytes, "chunks": router_chunks,
        "how": "dict hash -> media count + one set per medium (clients/kvcached_router/index.py HostIndex), "
               f"tracemalloc, + {key_bytes} B per hash object"}
    return out


def measure_speed(matchers: Sequence, sample: Sequence[Lookup], hashes: ChainHashes, repeats: int,
                  rng: np.random.Generator) -> dict:
    """Lookups/s of every contender on the same sample, end to end and probe only; hashing alone."""
    tokens = [x.tokens for x in sample]
    sample_hashes = [hashes(t) for t in tokens]
    by_name = {m.name: m for m in matchers}
    e2e = time_contenders({n: (lambda m=m: lambda t: m.probe(m.prepare(t))) for n, m in by_name.items()},
                          {n: (lambda: tokens) for n in by_name}, repeats, rng)
    prepared = {n: ((lambda m=m: [m.prepare(t) for t in tokens]) if isinstance(m, MinHashMatcher)
                    else (lambda: fresh_hashes(sample_hashes))) for n, m in by_name.items()}
    probe = time_contenders({n: (lambda m=m: m.probe) for n, m in by_name.items()}, prepared, repeats, rng)
    hashing = time_contenders({"chain hashing": lambda: hashes}, {"chain hashing": lambda: tokens}, repeats, rng)
    return {"end_to_end": e2e, "probe_only": probe, "chain_hashing": hashing["chain hashing"],
            "sample_hashes": sample_hashes}


def run(args: argparse.Namespace, sizes: dict | None = None) -> dict:
    """The whole comparison; ``sizes`` (keys as in :data:`FULL`) overrides the mode's sizes."""
    t_all = time.perf_counter()
    phases: dict[str, float] = {}

    def phase(name: str, t0: float) -> float:
        now = time.perf_counter()
        phases[name] = now - t0
        return now

    p = sizes or (QUICK if args.quick else FULL)
    rng = np.random.default_rng(args.seed)
    hashes = ChainHashes()
    t = time.perf_counter()
    wl = build_workload(args.trace_dir, p["warm"], p["lookups"], p["variants"], args.seed, hashes)
    n_chunks = len(wl.reference)
    print(f"cache: {sum(p['warm'].values())} prompts, {n_chunks:,} distinct {CHUNK_TOKENS}-token chunks; "
          f"{len(wl.lookups):,} lookups {wl.shape['lookups_by_kind']}", flush=True)
    t = phase("workload", t)

    sketcher = ChunkSketcher()
    matchers = [TrieMatcher(hashes), SetMatcher(hashes)] + [BloomMatcher(hashes, n_chunks, r) for r in BLOOM_RATES]
    matchers.append(MinHashMatcher(sketcher))
    by_name = {m.name: m for m in matchers}
    memory = measure_memory(matchers, wl)
    t = phase("build under tracemalloc", t)

    claims = {m.name: [m.probe(m.prepare(x.tokens)) for x in wl.lookups] for m in matchers}
    t = phase("accuracy (every lookup once)", t)

    pick = sorted(int(i) for i in rng.choice(len(wl.lookups), size=min(p["sample"], len(wl.lookups)), replace=False))
    sample = [wl.lookups[i] for i in pick]
    speed = measure_speed(matchers, sample, hashes, p["repeats"], rng)
    t = phase("speed", t)
    gate = bloom_gate(by_name["kvcached trie"], by_name["Bloom 1 %"], speed.pop("sample_hashes"), len(sample),
                      p["repeats"], rng)
    fp = {m.name: false_positive_rate(m.bloom, p["fp_probes"], args.seed + 1)
          for m in matchers if isinstance(m, BloomMatcher)}
    longest = max(sample, key=lambda x: len(x.tokens)).tokens
    sketching = sketch_speed(sketcher, longest, min(32, len(longest) // CHUNK_TOKENS) or 1)
    t = phase("Bloom gate, false positives, sketch speed", t)

    contenders = {}
    for m in matchers:
        row = {"accuracy": score_by_kind(wl.lookups, claims[m.name]), "memory": memory[m.name],
               "end_to_end": speed["end_to_end"][m.name], "probe_only": speed["probe_only"][m.name],
               "one_token_edit_by_position": edits_by_position(wl.lookups, claims[m.name])}
        if isinstance(m, BloomMatcher):
            row["false_positive_rate"] = {"stated": m.rate, "measured": fp[m.name], "probes": p["fp_probes"]}
        contenders[m.name] = row
    lsh = by_name["MinHash-LSH"].lsh
    res = {
        "question": " ".join(__doc__.strip().split("\n\n")[0].split()),
        "parameters": {"seed": args.seed, "shingle_tokens": SHINGLE, "num_perm": NUM_PERM,
                       "lsh_threshold": LSH_THRESHOLD, "lsh_bands_rows": [lsh.b, lsh.r],
                       "bloom_rates": list(BLOOM_RATES), "timing_sample": len(sample), "repeats": p["repeats"],
                       "trace_dir": os.path.basename(os.path.normpath(args.trace_dir)), "layout": LAYOUT.to_dict()},
        "workload": wl.shape,
        "contenders": contenders,
        "chain_hashing": speed["chain_hashing"],
        "minhash_sketch_speed": sketching,
        "bloom_gate_in_front_of_trie": gate,
        "router_index": memory["router HostIndex layout"],
        "remote_tier": remote_tier_figures(),
        "source_claims": source_comparison(contenders, n_chunks),
        "phase_seconds": phases,
    }
    res["conclusions"] = conclusions(res)
    res["wall_seconds"] = time.perf_counter() - t_all
    return res


def edits_by_position(lookups: Sequence[Lookup], claims: Sequence[int]) -> dict:
    """One-token edits by where the edit falls (thirds of the prompt's full chunks)."""
    out = {}
    for lo, hi, label in ((0.0, 1 / 3, "first third"), (1 / 3, 2 / 3, "middle third"), (2 / 3, 1.01, "last third")):
        idx = [i for i, x in enumerate(lookups) if x.kind == "one_token_edit" and lo <= x.detail < hi]
        if idx:
            out[label] = score([claims[i] for i in idx], [lookups[i].truth for i in idx])
    return out


def bloom_gate(trie: TrieMatcher, bloom: BloomMatcher, sample_hashes: list[list[ChunkHash]], n: int, repeats: int,
               rng: np.random.Generator) -> dict:
    """trie.match alone vs "the first hash in the Bloom filter, else 0; then trie.match", on the
    lookup sample and on prompts of 64 chunks that all miss (fresh random tokens)."""
    chain = ChainHashes()
    miss = [chain(rng.integers(VOCAB, size=64 * CHUNK_TOKENS, dtype=np.uint32)) for _ in range(n)]

    def bloom_gated(hs: list[ChunkHash]) -> int:
        return trie.probe(hs) if hs and hs[0] in bloom.bloom else 0

    def dict_gated(hs: list[ChunkHash]) -> int:  # the same gate, asking the trie's own dict
        return trie.probe(hs) if hs and hs[0] in trie.index else 0

    fns = {"trie": lambda: trie.probe, "Bloom gate + trie": lambda: bloom_gated,
           "trie-dict gate + trie": lambda: dict_gated}
    out = {}
    for label, hs in (("lookup sample", sample_hashes), ("all-miss prompts", miss)):
        t = time_contenders(fns, {n: (lambda hs=hs: fresh_hashes(hs)) for n in fns}, repeats, rng)
        out[label] = {**t, "bloom_gated_over_trie_p50": ratio(t["Bloom gate + trie"]["p50_us"], t["trie"]["p50_us"]),
                      "bloom_gated_over_dict_gated_p50": ratio(t["Bloom gate + trie"]["p50_us"],
                                                               t["trie-dict gate + trie"]["p50_us"]),
                      "saved_us_p50": t["trie"]["p50_us"] - t["Bloom gate + trie"]["p50_us"]}
    return out


def remote_tier_figures() -> dict:
    """The remote tier's measured cost of a miss, quoted from its own benchmark's JSON."""
    path = os.path.join(RESULTS_DIR, "remote_tier.json")
    try:
        with open(path) as f:
            miss = json.load(f)["miss"]
        return {"source": "bench/results/remote_tier.json",
                "saved_per_miss_us_by_a_perfect_filter": miss["saved_per_miss_us_by_a_perfect_filter"],
                "saved_over_prefill": miss["saved_over_prefill"],
                "bloom_false_positive_rate_measured": miss["bloom_false_positive_rate_measured"]}
    except (OSError, KeyError, ValueError) as e:
        return {"source": "bench/results/remote_tier.json", "error": f"{type(e).__name__}: {e}"}


def source_comparison(contenders: dict, n_chunks: int) -> dict:
    """The source's figures beside ours: what its memory would hold at our bytes per chunk."""
    out = {}
    for name, claim in SOURCE_CLAIMS.items():
        c = contenders[name]
        per = c["memory"]["bytes_per_chunk"]
        out[name] = {"claimed": claim,
                     "measured": {"exact": c["accuracy"]["all"]["exact"], "safe": c["accuracy"]["all"]["safe"],
                                  "recall": c["accuracy"]["all"]["recall"], "bytes_per_chunk": per,
                                  "memory_at_our_cache_bytes": per * n_chunks,
                                  "lookups_per_s": c["end_to_end"]["lookups_per_s"]},
                     "claimed_memory_in_chunks": claim["memory_bytes"] / per,
                     "claimed_memory_in_tokens": claim["memory_bytes"] / per * CHUNK_TOKENS,
                     "claimed_memory_indexes_kv_bytes": claim["memory_bytes"] / per * LAYOUT.chunk_bytes}
    return out


def conclusions(res: dict) -> list[str]:
    """What the figures say, with the figures (printed, and kept in the JSON)."""
    c = res["contenders"]
    trie, st, b1, mh = c["kvcached trie"], c["chained-hash set"], c["Bloom 1 %"], c["MinHash-LSH"]
    gate = res["bloom_gate_in_front_of_trie"]
    miss, hit = gate["all-miss prompts"], gate["lookup sample"]
    dict_saved = miss["trie"]["p50_us"] - miss["trie-dict gate + trie"]["p50_us"]
    hashing = res["chain_hashing"]["p50_us"]
    trie_per = trie["memory"]["bytes_per_chunk"]
    router_per = res["router_index"]["bytes_per_chunk"]
    chunk_mib = LAYOUT.chunk_bytes / 2**20
    chunks_per_tib = 2**40 // LAYOUT.chunk_bytes
    out = [
        f"Exact matching: the trie and the set claim exactly the cached prefix on every lookup "
        f"({trie['accuracy']['all']['exact']:.3f}, {st['accuracy']['all']['exact']:.3f}); the trie's "
        f"{trie_per:.0f} B/chunk against the set's {st['memory']['bytes_per_chunk']:.0f} pay for what the daemon "
        f"needs and a set cannot hold (tiers, pins, pool offsets, eviction order). Against the "
        f"{chunk_mib:.0f} MiB of KV one chunk of {LAYOUT.model} holds, that is {trie_per / LAYOUT.chunk_bytes:.1e} "
        f"of it.",
        f"Bloom 1 %: {b1['memory']['bytes_per_chunk']:.2f} B/chunk, false-positive rate "
        f"{b1['false_positive_rate']['measured']:.4f} measured; it over-claims on "
        f"{b1['accuracy']['all']['over_claimed_lookups']} of {b1['accuracy']['all']['lookups']} lookups (KV served "
        f"for tokens it was not computed for) and cannot say where a chunk is, so it could only be a pre-check.",
        f"MinHash-LSH over-claims on {mh['accuracy']['one_token_edit']['over_claimed_lookups']} of "
        f"{mh['accuracy']['one_token_edit']['lookups']} one-token edits (a similar chunk is not the same KV: "
        f"every chunk after an edit was computed with another prefix), costs {mh['memory']['bytes_per_chunk']:.0f} "
        f"B/chunk and reaches {mh['end_to_end']['lookups_per_s']:.0f} lookups/s against the trie's "
        f"{trie['end_to_end']['lookups_per_s']:.0f}.",
        f"Bloom gate in front of the trie (first hash in the filter, else 0), does not pay: on prompts that all "
        f"miss it saves {miss['saved_us_p50']:.2f} us p50 ({miss['bloom_gated_over_trie_p50']:.2f}x the trie alone), "
        f"of which the same gate asking the trie's own dict already saves {dict_saved:.2f} us (the skipped match() "
        f"call, no filter needed); on the lookup sample it costs {hit['bloom_gated_over_trie_p50']:.2f}x; and both "
        f"need the chain hashes, {hashing:.0f} us p50 per lookup, so the saving is "
        f"{max(0.0, miss['saved_us_p50']) / hashing:.1%} of a lookup's hashing alone.",
        f"Router index, does not pay: its HostIndex layout costs {router_per:.0f} B/chunk against the filter's "
        f"{b1['memory']['bytes_per_chunk']:.1f}, but a host's chunks are large ({chunk_mib:.0f} MiB here), so 1 TiB "
        f"of KV per host is {chunks_per_tib:,} chunks and {chunks_per_tib * router_per / 2**20:.1f} MiB of router "
        f"index; a plain Bloom filter cannot forget evicted chunks (BlockRemoved), and its "
        f"{b1['accuracy']['all']['over_claimed_lookups'] / b1['accuracy']['all']['lookups']:.1%} over-claimed "
        f"lookups could each send a request to a host without its prefix (the routing target: < 0.1 % wrong routes).",
    ]
    rt = res["remote_tier"]
    if "saved_per_miss_us_by_a_perfect_filter" in rt:
        out.append(f"Remote tier, does not pay (remote_tier.json): a perfect filter would save "
                   f"{rt['saved_per_miss_us_by_a_perfect_filter']:.0f} us per miss, {rt['saved_over_prefill']:.1e} "
                   f"of the prefill that follows the miss.")
    return out


# -- report ----------------------------------------------------------------------------------------


def print_report(res: dict) -> None:
    c = res["contenders"]
    kinds = [k for k in res["workload"]["lookups_by_kind"]]
    print("\naccuracy (all lookups): exact = claimed == truth, safe = claimed <= truth")
    rows = []
    for name, d in c.items():
        a = d["accuracy"]["all"]
        rows.append([name, a["exact"], a["safe"], a["chunk_precision"], a["recall"], a["over_claimed_lookups"],
                     a["over_claimed_chunks"], d["memory"]["bytes_per_chunk"], d["end_to_end"]["lookups_per_s"],
                     d["probe_only"]["lookups_per_s"]])
    print(format_table(["contender", "exact", "safe", "chunk prec", "recall", "over lkps", "over chunks", "B/chunk",
                        "lookups/s", "probe/s"], rows))
    print("\nsafe share (claimed <= truth) by lookup kind")
    print(format_table(["contender", *kinds], [[n, *(d["accuracy"][k]["safe"] for k in kinds)] for n, d in c.items()]))
    print("\nrecall by lookup kind")
    print(format_table(["contender", *kinds], [[n, *(d["accuracy"][k]["recall"] for k in kinds)] for n, d in c.items()]))
    for name in ("Bloom 1 %", "Bloom 0.1 %"):
        fp = c[name]["false_positive_rate"]
        print(f"{name}: stated false-positive rate {fp['stated']}, measured {fp['measured']:.5f} on {fp['probes']:,} keys")
    print(f"chain hashing alone: p50 {res['chain_hashing']['p50_us']:.1f} us per lookup; MinHash sketch "
          f"{res['minhash_sketch_speed']['vectorised_us_per_chunk']:.1f} us/chunk vectorised vs "
          f"{res['minhash_sketch_speed']['datasketch_update_batch_sha1_us_per_chunk']:.1f} with datasketch's SHA-1")
    print("\nsource claims vs measured")
    rows = []
    for name, s in res["source_claims"].items():
        rows.append([name, s["claimed"]["accuracy"], s["measured"]["exact"], s["claimed"]["memory_bytes"] / 1e9,
                     s["measured"]["bytes_per_chunk"], s["claimed_memory_in_tokens"] / 1e6, s["claimed"]["qps"],
                     s["measured"]["lookups_per_s"]])
    print(format_table(["contender", "claimed acc", "our exact", "claimed GB", "our B/chunk", "claimed GB = M tokens",
                        "claimed QPS", "our lookups/s"], rows))
    print("\nconclusions")
    for line in res["conclusions"]:
        print(" -", line)


def plot(res: dict, path: str) -> None:
    c = res["contenders"]
    names = list(c)
    colors = ["tab:blue", "tab:gray", "tab:orange", "tab:red", "tab:green"][: len(names)]
    xs = np.arange(len(names))
    fig, axes = subplots(1, 3, figsize=(15, 4.8))
    panels = (
        ("safe lookups (claimed <= truth): all / one-token edits",
         [[c[n]["accuracy"]["all"]["safe"] for n in names], [c[n]["accuracy"]["one_token_edit"]["safe"] for n in names]],
         False),
        ("index bytes per chunk (log)", [[c[n]["memory"]["bytes_per_chunk"] for n in names]], True),
        ("lookups/s (log): end to end / probe only",
         [[c[n]["end_to_end"]["lookups_per_s"] for n in names], [c[n]["probe_only"]["lookups_per_s"] for n in names]],
         True),
    )
    for ax, (title, series, log) in zip(axes, panels):
        width = 0.8 / len(series)
        for k, values in enumerate(series):
            pos = xs - 0.4 + width * (k + 0.5)
            ax.bar(pos, values, width=width, color=colors, alpha=1.0 if k == 0 else 0.45, edgecolor="black", lw=0.4)
            for x, v in zip(pos, values):
                ax.annotate(f"{v:.3g}", (x, v), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(xs)
        ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        if log:
            ax.set_yscale("log")
        else:
            ax.set_ylim(0, 1.08)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"Prefix matchers on Mooncake-trace prompts and edited variants "
                 f"({res['workload']['cached_chunks']:,} cached {CHUNK_TOKENS}-token chunks)")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, "a small cache and few lookups (< 30 s)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--trace-dir", default=TRACE_DIR, help="the Mooncake FAST'25 traces (default: ../shared/traces)")
    args = p.parse_args(argv)
    res = run(args)
    finish("matchers", res, args, print_report, plot=plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
