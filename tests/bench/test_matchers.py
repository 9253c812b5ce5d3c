"""``bench/studies/matchers.py``: its reference, its contenders and its metrics on inputs whose true cached
prefix is known by construction, then the whole run on a small slice of the traces.

Speed is not asserted. Without ``../shared/traces`` the run reads the committed excerpt (tests/data).
"""

from __future__ import annotations

import argparse
import json
import math
import os

import numpy as np
import pytest
from datasketch import MinHash

from bench.studies import _matchers as M
from bench.studies import matchers
from bench._common import write_json

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRACES = os.path.join(ROOT, "..", "shared", "traces", "mooncake-fast25")
EXCERPT = os.path.join(ROOT, "tests", "data", "mooncake-fast25-excerpt")

C = M.CHUNK_TOKENS


def rand_tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(M.VOCAB, size=n, dtype=np.uint32)


@pytest.fixture(scope="module")
def cache():
    """Prompt A (4 chunks), B (A's first chunk + 2 new ones), X (a periodic chunk, then a random
    one); every contender built from them."""
    rng = np.random.default_rng(11)
    a = rand_tokens(rng, 4 * C)
    b = np.concatenate([a[:C], rand_tokens(rng, 2 * C)])
    periodic = np.tile(np.array([1, 2, 3], dtype=np.uint32), C // 3 + 1)[:C]
    x = np.concatenate([periodic, rand_tokens(rng, C)])
    ref = M.ContentIndex()
    hashes = M.ChainHashes()
    stored = M.store_prompts([a, b, x], ref, hashes)
    contenders = [M.TrieMatcher(hashes), M.SetMatcher(hashes), M.BloomMatcher(hashes, len(ref), 1e-7),
                  M.MinHashMatcher(M.ChunkSketcher())]
    for m in contenders:
        m.build(stored)
    return {"a": a, "b": b, "x": x, "ref": ref, "stored": stored, "contenders": contenders, "rng": rng}


def lookups(cache) -> dict[str, tuple[np.ndarray, int]]:
    """Name -> (tokens, true cached chunks, known by construction)."""
    a, b, x, rng = cache["a"], cache["b"], cache["x"], cache["rng"]
    edited = a.copy()
    edited[2 * C + 5] = (edited[2 * C + 5] + 1) % M.VOCAB
    reordered = np.concatenate([a[:C], a[2 * C : 3 * C], a[C : 2 * C], a[3 * C :]])
    shifted = np.concatenate([np.tile(np.array([2, 3, 1], dtype=np.uint32), C // 3 + 1)[:C], x[C:]])
    assert not np.array_equal(shifted[:C], x[:C])  # every token moved, the same three 3-shingles
    return {
        "A": (a, 4),
        "A + new suffix": (np.concatenate([a, rand_tokens(rng, 2 * C)]), 4),
        "A + partial chunk": (np.concatenate([a, rand_tokens(rng, 50)]), 4),
        "A, chunk 2 edited": (edited, 2),
        "A, chunks 1 and 2 swapped": (reordered, 1),
        "A's first 2.5 chunks": (a[: 5 * C // 2], 2),
        "B": (cache["b"], 3),
        "B's first chunk, then A's second": (np.concatenate([b[:C], a[C : 2 * C]]), 2),
        "fresh": (rand_tokens(rng, 3 * C), 0),
        "X with its first chunk shifted": (shifted, 0),
        "shorter than a chunk": (a[: C - 1], 0),
    }


def test_reference_knows_the_true_prefix(cache) -> None:
    assert len(cache["ref"]) == 4 + 2 + 2  # A's chunks, B's two new ones, X's two
    assert [p.known for p in cache["stored"]] == [0, 1, 0]
    for name, (tokens, truth) in lookups(cache).items():
        assert cache["ref"].cached_prefix(tokens) == truth, name


def test_chained_hash_matchers_claim_exactly_the_cached_prefix(cache) -> None:
    trie, chained_set, bloom, _ = cache["contenders"]
    for m in (trie, chained_set, bloom):
        assert m.chunks() == len(cache["ref"]), m.name
        for name, (tokens, truth) in lookups(cache).items():
            assert m.probe(m.prepare(tokens)) == truth, (m.name, name)
    # the trie is the daemon's class, filled as a commit fills it: the matched nodes chain up
    nodes = trie.index.match(trie.prepare(cache["a"]))
    assert [n.depth for n in nodes] == [0, 1, 2, 3]
    assert all(n.parent is p for n, p in zip(nodes[1:], nodes))


def test_minhash_never_under_claims_and_claims_similar_chunks(cache) -> None:
    minhash = cache["contenders"][3]
    assert minhash.chunks() == len(cache["ref"])
    claims = {name: minhash.probe(minhash.prepare(t)) for name, (t, _) in lookups(cache).items()}
    for name, (_, truth) in lookups(cache).items():
        assert claims[name] >= truth, name  # an identical chunk has identical band keys
    for name in ("A", "A + new suffix", "B", "fresh", "A, chunks 1 and 2 swapped", "shorter than a chunk"):
        assert claims[name] == lookups(cache)[name][1], name  # nothing similar but the identical chunks
    # A chunk whose shingle set is another's (Jaccard 1) matches though every token moved: the
    # KV of X would be served for the shifted prompt's two chunks.
    assert claims["X with its first chunk shifted"] == 2
    # The edited chunk is similar (Jaccard ~0.95): either it matches, and then the identical chunk
    # after it does too, or the walk stops at the true prefix.
    assert claims["A, chunk 2 edited"] in (2, 4)


def test_sketch_is_datasketchs_minhash_of_the_shingles() -> None:
    rng = np.random.default_rng(3)
    tokens = rand_tokens(rng, 3 * C)
    sketcher = M.ChunkSketcher()
    values = sketcher.sketch(tokens, 0, 3)
    for i in range(3):
        shingles = M.shingle_hashes(tokens[i * C : (i + 1) * C].reshape(1, C))[0]
        assert len(shingles) == C - M.SHINGLE + 1
        m = MinHash(num_perm=M.NUM_PERM, seed=1, scheme="affine32", hashfunc=lambda v: v)
        m.update_batch(shingles.tolist())
        assert np.array_equal(values[i], m.hashvalues), i
    assert np.array_equal(sketcher.sketch(tokens, 1, 3), values[1:])


def test_shingles_differ_when_tokens_do() -> None:
    chunk = np.arange(C, dtype=np.uint32).reshape(1, C)
    h = M.shingle_hashes(chunk)[0]
    assert len(set(h.tolist())) == len(h)
    edited = chunk.copy()
    edited[0, 10] = 999
    diff = M.shingle_hashes(edited)[0] != h
    assert diff.tolist() == [8 <= i <= 10 for i in range(len(h))]  # the three shingles holding token 10


def test_score_against_hand_computed_figures() -> None:
    s = M.score([3, 3, 2, 1, 0], [3, 3, 1, 0, 2])
    assert s["lookups"] == 5
    assert s["exact"] == 2 / 5
    assert s["safe"] == 3 / 5  # 3<=3, 3<=3, 0<=2
    assert s["claimed_chunks"] == 9 and s["true_chunks"] == 9
    assert s["chunk_precision"] == 7 / 9  # min(c, t): 3 + 3 + 1 + 0 + 0
    assert s["recall"] == 7 / 9
    assert s["over_claimed_chunks"] == 2 and s["over_claimed_lookups"] == 2
    assert s["under_claimed_lookups"] == 1
    assert M.score([0, 0], [0, 0])["recall"] == 1.0  # nothing to find, nothing missed
    with pytest.raises(ValueError):
        M.score([1], [1, 2])


def test_score_by_kind_splits_the_lookups() -> None:
    t = np.zeros(0, dtype=np.uint32)
    ls = [M.Lookup("a", t, 2), M.Lookup("b", t, 1), M.Lookup("a", t, 0)]
    s = M.score_by_kind(ls, [2, 3, 1])
    assert s["a"]["exact"] == 1 / 2 and s["a"]["over_claimed_chunks"] == 1
    assert s["b"]["over_claimed_chunks"] == 2 and s["b"]["recall"] == 1.0
    assert s["all"]["lookups"] == 3 and s["all"]["over_claimed_chunks"] == 3


def test_variants_have_the_true_prefix_their_edit_implies() -> None:
    rng = np.random.default_rng(5)
    cached = [rand_tokens(rng, int(n)) for n in rng.integers(2 * M.BLOCK, 6 * M.BLOCK, size=12)]
    ref = M.ContentIndex()
    M.store_prompts(cached, ref, M.ChainHashes())
    variants = M.make_variants(cached, 25, np.random.default_rng(6))
    assert [v.kind for v in variants] == ["one_token_edit"] * 25 + ["reordered"] * 25 + ["new_suffix"] * 25
    for v in variants:
        src = cached[v.source]
        truth = ref.cached_prefix(v.tokens)
        if v.kind == "one_token_edit":
            assert np.flatnonzero(v.tokens != src).tolist() == [v.position]
            assert v.position < len(src) // C * C
            assert truth == v.position // C
        elif v.kind == "reordered":
            assert len(v.tokens) == len(src) and sorted(v.tokens.tolist()) == sorted(src.tolist())
            assert v.position % M.BLOCK == 0 and np.array_equal(v.tokens[: v.position], src[: v.position])
            assert truth == v.position // C
        else:
            assert np.array_equal(v.tokens[: len(src)], src) and (len(v.tokens) - len(src)) % C == 0
            assert truth == len(src) // C


def test_bloom_false_positive_rate_is_near_the_stated_one() -> None:
    keys = [os.urandom(16) for _ in range(20_000)]
    bloom = M.Bloom(len(keys), 0.01)
    bloom.update(keys)
    assert all(k in bloom for k in keys)  # no false negatives
    measured = matchers.false_positive_rate(bloom, 100_000, seed=1)
    assert 0.006 < measured < 0.015, measured  # 1 % +- 13 standard deviations of 100k draws


def test_whole_run_on_a_small_slice(tmp_path) -> None:
    trace_dir = TRACES if os.path.isdir(TRACES) else EXCERPT
    sizes = {"warm": {"conversation": 40, "synthetic": 20}, "lookups": {"conversation": 30, "synthetic": 10},
             "variants": 6, "sample": 12, "repeats": 1, "fp_probes": 20_000}
    res = matchers.run(argparse.Namespace(quick=True, seed=3, trace_dir=trace_dir), sizes)
    wl = res["workload"]
    assert wl["lookups_by_kind"] == {"conversation": 30, "synthetic": 10, "one_token_edit": 6, "reordered": 6,
                                     "new_suffix": 6}
    assert wl["cached_chunks"] > 0 and wl["true_chunks_by_kind"]["new_suffix"] > 0
    c = res["contenders"]
    assert set(c) == {"kvcached trie", "chained-hash set", "Bloom 1 %", "Bloom 0.1 %", "MinHash-LSH"}
    for name in ("kvcached trie", "chained-hash set"):
        for kind, s in c[name]["accuracy"].items():
            assert s["exact"] == 1.0 and s["over_claimed_chunks"] == 0, (name, kind)
    for name, d in c.items():
        assert d["accuracy"]["all"]["recall"] == 1.0, name  # none of them ever misses a cached chunk
        assert d["accuracy"]["all"]["lookups"] == 30 + 10 + 3 * 6
        for speed in ("end_to_end", "probe_only"):
            assert d[speed]["n"] == 12 and d[speed]["lookups_per_s"] > 0, (name, speed)
        assert d["memory"]["bytes_per_chunk"] > 0, name
    # rbloom's sizing: -ln(p) / ln(2)^2 bits per item, rounded up to whole 64-bit words
    for name, p in (("Bloom 1 %", 0.01), ("Bloom 0.1 %", 0.001)):
        per = c[name]["memory"]["bytes_per_chunk"]
        assert per == pytest.approx(-math.log(p) / math.log(2) ** 2 / 8, rel=0.05), (name, per)
        assert c[name]["false_positive_rate"]["stated"] == p
    for name, s in res["source_claims"].items():
        assert s["claimed_memory_in_chunks"] == pytest.approx(s["claimed"]["memory_bytes"]
                                                              / c[name]["memory"]["bytes_per_chunk"])
    assert len(res["conclusions"]) >= 5 and all(isinstance(x, str) for x in res["conclusions"])
    path = write_json("m", res, str(tmp_path))  # what main() writes: JSON-serialisable
    assert json.load(open(path))["contenders"]["MinHash-LSH"]["accuracy"]["all"]["lookups"] == 30 + 10 + 3 * 6
    png = tmp_path / "m.png"
    matchers.plot(res, str(png))
    assert png.stat().st_size > 0
