"""The prompt-structure report (kvcached.promptshape): where lookups stop matching, and whether the
diverging chunk began the way other prompts began it (a template) or not (new prompts)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import torch

from kvcached.contract.keys import KVLayout
from kvcached.promptshape import BUCKETS, HALVE_EVERY, LEAD_TOKENS, MAX_LAYOUTS, MIN_DIVERGED, PromptShape, judge
from kvcached_client import Client
from tests.service.conftest import LAYOUT

#: 16-token chunks (as the daemon tests' layout), 256 bytes each: a pool of 4096 holds every prompt here.
L16 = KVLayout("test/shape@1", num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16", chunk_tokens=16)
CT = L16.chunk_tokens
TONES = (11, 12, 13, 14, 15)  # the template's variable: five tones


def templated(rng: random.Random, n: int) -> list[list[int]]:
    """``rewrite in ${tone} tone: ${text}``: 5 template tokens with the variable third, then text."""
    return [[101, 102, TONES[i % len(TONES)], 103, 104] + [rng.randrange(1000, 30000) for _ in range(3 * CT - 5)]
            for i in range(n)]


def unique(rng: random.Random, n: int) -> list[list[int]]:
    return [[rng.randrange(1000, 30000) for _ in range(3 * CT)] for _ in range(n)]


def shared_system(rng: random.Random, n: int, system_chunks: int = 3) -> list[list[int]]:
    system = [rng.randrange(1000, 30000) for _ in range(system_chunks * CT)]
    return [system + [rng.randrange(1000, 30000) for _ in range(2 * CT)] for _ in range(n)]


def serve(store, lid, prompts) -> None:
    """What a front end does per request: look the prompt up, then store its chunks."""
    for p in prompts:
        store.lookup(lid, p)
        n = len(p) // CT
        store.put(lid, p, [bytes(L16.chunk_bytes)] * n)


def shape_of(store, lid) -> dict:
    return store.stats().to_dict()["prompt_shape"][lid]


def counts(shape: dict, kind: str) -> dict[str, int]:
    return {b: c[kind] for b, c in shape["first_uncached_chunk"].items() if c[kind]}


# -- the sketch on its own ---------------------------------------------------------------------


def test_each_observation_is_new_shared_repeat_whole_or_short():
    shape = PromptShape()
    raw = lambda toks: b"".join(t.to_bytes(4, "little") for t in toks)  # noqa: E731
    a = [7, 8, 9, 10] + [1] * 12 + [2] * 16
    b = [7, 8, 9, 10] + [3] * 12 + [2] * 16  # begins chunk 0 as a does, differs inside it, then goes on as a
    c = [7, 8, 9, 10] + [4] * 12 + [5] * 16  # begins chunk 0 as a does, and goes on elsewhere
    shape.observe("L", CT, raw(a), [b"a0", b"a1"], 0)
    shape.observe("L", CT, raw(a), [b"a0", b"a1"], 0)  # the same prompt again (Lookup, then Acquire)
    shape.observe("L", CT, raw(b), [b"b0", b"b1"], 0)
    shape.observe("L", CT, raw(c), [b"c0", b"c1"], 0)
    shape.observe("L", CT, raw(a), [b"a0", b"a1"], 1)  # chunk 0 now cached: diverges at chunk 1, new there
    shape.observe("L", CT, raw(a), [b"a0", b"a1"], 2)  # everything cached
    shape.observe("L", CT, raw(a[:10]), [], 0)  # shorter than a chunk
    s = shape.snapshot({"L": "m"})["L"]
    assert (s.model, s.chunk_tokens, s.lead_tokens, s.whole, s.short) == ("m", CT, LEAD_TOKENS, 1, 1)
    assert s.first_uncached_chunk["0"] == {"new": 1, "shared_lead": 1, "shared_after": 1, "repeat": 1}
    assert s.first_uncached_chunk["1"] == {"new": 1, "shared_lead": 0, "shared_after": 0, "repeat": 0}
    assert set(s.first_uncached_chunk) == set(BUCKETS)


def test_short_chunks_probe_half_a_chunk():
    """A probe as long as the chunk could only see chunks that are cached anyway."""
    shape = PromptShape()
    raw = b"".join(t.to_bytes(4, "little") for t in [1, 2, 3, 4, 9, 9, 9, 9])
    other = b"".join(t.to_bytes(4, "little") for t in [1, 2, 5, 6, 9, 9, 9, 9])
    shape.observe("T", 4, raw, [b"x0", b"x1"], 0)
    shape.observe("T", 4, other, [b"y0", b"y1"], 0)  # shares 2 leading tokens and the next chunk
    s = shape.snapshot({})["T"]
    assert s.lead_tokens == 2 and s.first_uncached_chunk["0"] == {"new": 1, "shared_lead": 0, "shared_after": 1,
                                                                    "repeat": 0}


def test_positions_fall_in_power_of_two_buckets():
    shape = PromptShape()
    hashes = [bytes([i]) * 16 for i in range(40)]
    raw = bytes(range(256)) * 10  # 640 tokens
    for p in (0, 1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 39):
        shape.observe("L", CT, raw, hashes, p)
    got = {b: sum(c.values()) for b, c in shape.snapshot({})["L"].first_uncached_chunk.items()}
    assert got == {"0": 1, "1": 1, "2-3": 2, "4-7": 2, "8-15": 2, "16-31": 2, "32+": 2}


def test_counts_halve_so_they_follow_recent_traffic():
    shape = PromptShape()
    raw, hashes = bytes(4 * 2 * CT), [b"x" * 16, b"y" * 16]
    for _ in range(HALVE_EVERY - 1):
        shape.observe("L", CT, raw, hashes, 2)
    shape.observe("L", CT, raw, hashes, 0)  # the HALVE_EVERY-th observation halves, then counts
    s = shape.snapshot({})["L"]
    assert s.whole == (HALVE_EVERY - 1) // 2
    assert s.first_uncached_chunk["0"] == {"new": 1, "shared_lead": 0, "shared_after": 0, "repeat": 0}


def test_memory_is_bounded_by_layouts_tracked():
    shape = PromptShape()
    for i in range(MAX_LAYOUTS + 5):
        shape.observe(f"L{i}", CT, bytes(4 * CT), [b"h" * 16], 0)
    snap = shape.snapshot({})
    assert len(snap) == MAX_LAYOUTS and f"L{MAX_LAYOUTS}" not in snap


# -- workloads through the store ---------------------------------------------------------------


def test_templated_prompts_diverge_at_chunk_0_after_shared_leading_tokens(make_store):
    store = make_store(pool_blocks=4096, nvme_chunks=None, layout=L16)
    lid = store.register_layout(L16)
    serve(store, lid, templated(random.Random(1), 300))
    shape = shape_of(store, lid)
    # Every prompt misses at chunk 0 (the tone and the text sit in it); the first of each tone
    # begins chunk 0 in a new way, the other 295 as an earlier prompt did.
    assert counts(shape, "new") == {"0": len(TONES)} and counts(shape, "shared_lead") == {"0": 300 - len(TONES)}
    assert counts(shape, "repeat") == {} and shape["whole"] == 0
    v = judge(store.stats().to_dict()["prompt_shape"])
    assert v.verdict == "warn"
    assert "prompts diverge at chunk 0–1" in v.detail and "move variables to the end" in v.detail
    assert "of 300 diverging lookups of test/shape@1 (16-token chunks), 0% go on with text other prompts have " \
           "after a different chunk, 98% begin it as others did" in v.detail


def test_a_variable_first_then_a_fixed_body_is_seen_after_the_divergence(make_store):
    """``${date} You are ... <a fixed body>: ${question}``: chunk 0 begins differently every time,
    but the body after it recurs behind a different chunk 0 in every prompt."""
    store = make_store(pool_blocks=4096, nvme_chunks=None, layout=L16)
    lid = store.register_layout(L16)
    rng = random.Random(9)
    body = [rng.randrange(1000, 30000) for _ in range(3 * CT)]
    serve(store, lid, [[rng.randrange(1000, 30000) for _ in range(6)] + body + [rng.randrange(1000, 30000)
                       for _ in range(2 * CT - 6)] for _ in range(250)])
    shape = shape_of(store, lid)
    assert counts(shape, "new") == {"0": 1} and counts(shape, "shared_after") == {"0": 249}
    v = judge(store.stats().to_dict()["prompt_shape"])
    assert v.verdict == "warn" and "100% go on with text other prompts have after a different chunk" in v.detail


def test_unique_prompts_also_miss_at_chunk_0_but_pass(make_store):
    store = make_store(pool_blocks=4096, nvme_chunks=None, layout=L16)
    lid = store.register_layout(L16)
    serve(store, lid, unique(random.Random(2), 300))
    shape = shape_of(store, lid)
    assert counts(shape, "new") == {"0": 300} and counts(shape, "shared_lead") == {}
    v = judge(store.stats().to_dict()["prompt_shape"])
    assert v.verdict == "ok" and "100% diverge at chunk 0–1 with nothing seen before" in v.detail


def test_a_shared_system_prompt_moves_the_divergence_past_it(make_store):
    store = make_store(pool_blocks=4096, nvme_chunks=None, layout=L16)
    lid = store.register_layout(L16)
    serve(store, lid, shared_system(random.Random(3), 300, system_chunks=3))
    shape = shape_of(store, lid)
    # The first prompt finds nothing; every later one finds the 3 system chunks and misses at chunk 3.
    assert counts(shape, "new") == {"0": 1, "2-3": 299} and counts(shape, "shared_lead") == {}
    v = judge(store.stats().to_dict()["prompt_shape"])
    assert v.verdict == "ok" and "most diverge at chunk 2-3" in v.detail


def test_a_shared_head_shorter_than_a_chunk_is_flagged_like_a_template(make_store):
    """Six shared tokens, then the user's text: the head never fills a chunk, so nothing is reused."""
    store = make_store(pool_blocks=4096, nvme_chunks=None, layout=L16)
    lid = store.register_layout(L16)
    rng = random.Random(4)
    serve(store, lid, [[5, 6, 7, 8, 9, 10] + [rng.randrange(1000, 30000) for _ in range(2 * CT)] for _ in range(250)])
    assert counts(shape_of(store, lid), "shared_lead") == {"0": 249}
    assert judge(store.stats().to_dict()["prompt_shape"]).verdict == "warn"


def test_a_mix_warns_only_when_the_template_share_is_large(make_store):
    rng = random.Random(5)
    store = make_store(pool_blocks=4096, nvme_chunks=None, layout=L16)
    lid = store.register_layout(L16)
    serve(store, lid, unique(rng, 200) + templated(rng, 100))  # 95 of 300 begin chunk 0 as another did: 32 %
    assert counts(shape_of(store, lid), "shared_lead") == {"0": 95}
    v = judge(store.stats().to_dict()["prompt_shape"])
    assert v.verdict == "ok" and "32% begin it as others did" in v.detail
    serve(store, lid, templated(rng, 100))  # now 195 of 400: 49 %
    assert judge(store.stats().to_dict()["prompt_shape"]).verdict == "ok"
    serve(store, lid, templated(rng, 10))  # 205 of 410: 50 %
    assert judge(store.stats().to_dict()["prompt_shape"]).verdict == "warn"


def test_below_the_minimum_it_says_not_enough_lookups(make_store):
    store = make_store(pool_blocks=4096, nvme_chunks=None, layout=L16)
    lid = store.register_layout(L16)
    serve(store, lid, templated(random.Random(6), MIN_DIVERGED - 1))
    v = judge(store.stats().to_dict()["prompt_shape"])
    assert v.verdict == "ok" and v.detail.startswith(f"not enough lookups yet: {MIN_DIVERGED - 1} diverging")
    assert judge(None).detail.startswith("not enough lookups yet: 0")


def test_acquire_paths_observe_and_a_repeat_is_not_evidence(make_store):
    """A request's Lookup then its AcquireReserve see the same diverging chunk: the second is a
    repeat. A no-cache acquire (capped at 0 chunks) says nothing about where the prompt diverges."""
    store = make_store(pool_blocks=4096, nvme_chunks=None, layout=L16)
    lid = store.register_layout(L16)
    p = unique(random.Random(7), 1)[0]
    store.lookup(lid, p)
    lease, r = store.acquire_reserve(lid, p)
    for loc in r.slots:
        store.write_reserved(r.reservation_id, loc.position, bytes(L16.chunk_bytes))
    store.commit(r.reservation_id)
    store.acquire_reserve(lid, p, no_cache=True)
    lease = store.acquire(lid, p)
    store.release(lease.lease_id)
    shape = shape_of(store, lid)
    assert counts(shape, "new") == {"0": 1} and counts(shape, "repeat") == {"0": 1}
    assert shape["whole"] == 1  # the last acquire, after the commit


# -- through a daemon ----------------------------------------------------------------------------


def test_stats_and_doctor_report_it_from_a_daemon(daemon):
    rng = random.Random(8)
    prompts = [[101, 102, TONES[i % 5], 103] + [rng.randrange(1000, 30000) for _ in range(2 * 16 - 4)]
               for i in range(MIN_DIVERGED + 20)]
    with Client(daemon.socket) as c:
        for p in prompts:
            c.lookup(LAYOUT, p)
            c.put(LAYOUT, p, torch.zeros(2, 2, 2, len(p), 8))
    exe = os.path.join(os.path.dirname(sys.executable), "kvcachectl")
    r = subprocess.run([exe, "--socket", daemon.socket, "stats", "--json"], capture_output=True, text=True, timeout=60)
    shape = json.loads(r.stdout)["prompt_shape"][LAYOUT.layout_id]
    assert shape["model"] == LAYOUT.model and shape["chunk_tokens"] == 16
    assert counts(shape, "new") == {"0": 5} and counts(shape, "shared_lead") == {"0": len(prompts) - 5}
    r = subprocess.run([exe, "--socket", daemon.socket, "doctor", "--json"], capture_output=True, text=True, timeout=60)
    check = next(x for x in json.loads(r.stdout)["checks"] if x["check"] == "prompt structure")
    assert check["verdict"] == "warn" and "a template variable near the start" in check["detail"]
    assert r.returncode == 1
    r = subprocess.run([exe, "--socket", daemon.socket, "stats"], capture_output=True, text=True, timeout=60)
    assert f"prompt_shape {LAYOUT.layout_id}" in r.stdout and f"0: {len(prompts)}" in r.stdout
