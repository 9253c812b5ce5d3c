"""The hash memo must return exactly what the keyed chain computes, for every prompt shape, under
any memory budget and from several threads; and it must stay inside its budget."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcached.config import StoreConfig
from kvcached.hashmemo import HashMemo
from kvcached.contract.keys import ChunkHasher, KVLayout, Namespace
from kvcached.store import Store

KEY = bytes(range(32))
CT = 4  # tokens per chunk: small, so prompts of many chunks stay cheap
STEP = CT * 4
LAYOUT = KVLayout("test/memo@1", num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16", chunk_tokens=CT)
HASHER = ChunkHasher(KEY)
ROOT = HASHER.root(Namespace("default", LAYOUT))


def toks(*chunks: int, extra: int = 0) -> bytes:
    """A prompt whose chunk i is filled with the id ``chunks[i]``, then ``extra`` loose tokens."""
    ids = [c for c in chunks for _ in range(CT)] + [7] * extra
    return np.asarray(ids, dtype="<u4").tobytes()


def reference(t: bytes, root: bytes = ROOT) -> list[bytes]:
    return HASHER.chain(root, t, CT)


def memo_chain(memo: HashMemo, t: bytes, root: bytes = ROOT) -> list[bytes]:
    return memo.chain(root, t, STEP, HASHER.chain_range)


def test_a_repeated_prompt_is_answered_from_the_memo():
    memo = HashMemo(1 << 20)
    p = toks(*range(10))
    assert memo_chain(memo, p) == reference(p)
    assert (memo.hit_chunks, memo.missed_chunks) == (0, 10)
    assert memo_chain(memo, p) == reference(p)
    assert (memo.hit_chunks, memo.missed_chunks) == (10, 10)


@pytest.mark.parametrize("second", [
    toks(*range(10), 50, 51, 52),        # the conversation grew by a turn: old run + a new one
    toks(*range(4)),                     # a shorter prefix of the run
    toks(*range(6), 99, 98),             # diverges inside the run
    toks(99, *range(1, 10)),             # diverges at the first chunk: no run starts there
    toks(*range(10), extra=3),           # trailing tokens that fill no chunk are never hashed
    toks(),                              # empty
    toks(extra=3),                       # no full chunk
])
def test_prompts_that_share_part_of_a_run_get_the_chain_s_hashes(second):
    memo = HashMemo(1 << 20)
    first = toks(*range(10))
    memo_chain(memo, first)
    assert memo_chain(memo, second) == reference(second)
    assert memo_chain(memo, second) == reference(second)  # and again, now from the memo
    assert memo_chain(memo, first) == reference(first)


def test_a_growing_conversation_hashes_only_its_new_chunks():
    memo = HashMemo(1 << 20)
    turns = [toks(*range(n)) for n in (3, 5, 9, 12)]
    for t in turns:
        before = memo.missed_chunks
        assert memo_chain(memo, t) == reference(t)
    assert memo.missed_chunks - before == 3  # the last turn added chunks 9..11 only
    assert memo.missed_chunks == 12


def test_runs_never_cross_namespaces():
    memo = HashMemo(1 << 20)
    other_root = HASHER.root(Namespace("tenant-b", LAYOUT))
    p = toks(*range(8))
    a = memo_chain(memo, p)
    b = memo_chain(memo, p, other_root)
    assert b == reference(p, other_root) and set(a).isdisjoint(b)
    assert memo.hit_chunks == 0  # same tokens, other namespace: nothing taken from the memo


def test_disabled_memo_hashes_every_time_and_keeps_nothing():
    memo = HashMemo(0)
    p = toks(*range(5))
    assert memo_chain(memo, p) == memo_chain(memo, p) == reference(p)
    assert len(memo) == 0 and memo.bytes == 0 and memo.hit_chunks == 0


def test_memory_stays_within_budget_and_a_hot_prompt_survives_a_flood():
    budget = 8 * 1024
    memo = HashMemo(budget)
    hot = toks(*range(1000, 1010))
    memo_chain(memo, hot)
    rng = np.random.default_rng(0)
    for i in range(300):
        cold = toks(*rng.integers(0, 2**31, 10))
        assert memo_chain(memo, cold) == reference(cold)
        assert memo.bytes <= budget
        if i % 3 == 0:  # used regularly, within a generation's worth of new runs
            hits = memo.hit_chunks
            assert memo_chain(memo, hot) == reference(hot)
            assert memo.hit_chunks - hits == 10
    assert len(memo) < 300  # the one-off prompts were dropped


def test_a_run_larger_than_half_the_budget_is_not_kept():
    memo = HashMemo(1024)
    big = toks(*range(100))  # 1,600 token bytes
    assert memo_chain(memo, big) == reference(big)
    assert len(memo) == 0


def test_threads_sharing_a_memo_always_get_the_chain_s_hashes():
    memo = HashMemo(4 * 1024)  # tiny: generations swap all the time
    prompts = [toks(*(list(range(8)) + [i, i + 1, i + 2])) for i in range(40)]
    want = [reference(p) for p in prompts]
    errors: list[str] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(400):
            i = int(rng.integers(len(prompts)))
            if memo_chain(memo, prompts[i]) != want[i]:
                errors.append(f"prompt {i}")

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@settings(max_examples=150, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 3), max_size=12), min_size=1, max_size=12),
    extra=st.integers(0, CT - 1),
    budget=st.sampled_from([0, 600, 2048, 1 << 20]),
)
def test_any_sequence_of_prompts_matches_the_chain(prompts, extra, budget):
    """Prompts over a 4-id chunk alphabet share prefixes, extend and diverge at every depth."""
    memo = HashMemo(budget)
    for chunks in prompts:
        t = toks(*chunks, extra=extra)
        assert memo_chain(memo, t) == reference(t)
        assert memo.bytes <= max(budget, 0)


def test_store_hashes_use_the_memo_and_count_it(tmp_path):
    cfg = StoreConfig(state_dir=str(tmp_path), pool_bytes=LAYOUT.chunk_bytes * 64,
                      pool_prefault=False, nvme_bytes=0)
    with Store(cfg) as store:
        lid = store.register_layout(LAYOUT)
        p = toks(*range(6))
        first = store.hashes(lid, p)
        assert store.hashes(lid, p) == first
        with open(tmp_path / "hash.key", "rb") as f:
            hasher = ChunkHasher(f.read())
        assert first == hasher.chain(hasher.root(Namespace("default", LAYOUT)), p, CT)
        m = store.stats().hash_memo
        assert (m.hashed_chunks, m.memo_chunks, m.runs) == (6, 6, 1) and 0 < m.bytes <= m.max_bytes


def test_store_without_memo_hashes_everything(tmp_path):
    cfg = StoreConfig(state_dir=str(tmp_path), pool_bytes=LAYOUT.chunk_bytes * 64,
                      pool_prefault=False, nvme_bytes=0, hash_memo_bytes=0)
    with Store(cfg) as store:
        lid = store.register_layout(LAYOUT)
        p = toks(*range(6))
        assert store.hashes(lid, p) == store.hashes(lid, p)
        m = store.stats().hash_memo
        assert (m.hashed_chunks, m.memo_chunks, m.runs, m.bytes) == (12, 0, 0, 0)


def test_store_config_refuses_a_negative_budget(tmp_path):
    with pytest.raises(ValueError, match="hash_memo_bytes"):
        StoreConfig(state_dir=str(tmp_path), hash_memo_bytes=-1)


@pytest.mark.parametrize("n_chunks", [1, 8, 64])
def test_the_byte_budget_counts_what_the_memo_really_holds(n_chunks):
    import gc
    import os
    import tracemalloc

    prompts = [bytearray(os.urandom(STEP * n_chunks + 12)) for _ in range(200)]  # + loose tokens
    memo = HashMemo(1 << 40)
    gc.collect()
    tracemalloc.start()
    try:
        for p in prompts:
            memo_chain(memo, bytes(p))  # the only reference to the request's bytes is the memo's
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held <= memo.bytes <= 1.2 * held  # never under-counted, and not far over
