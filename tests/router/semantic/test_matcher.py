"""The vector index (rows, swap-with-last removal, the two-stage search against a full scan) and
the matcher's decision (guards, tier thresholds, reasons, the walk), then with real MiniLM on the
fixture pairs."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from kvcached_router.semantic.calibrate import Calibration
from kvcached_router.semantic.embed import HashingEmbedder, l2_normalise
from kvcached_router.semantic.matcher import SemanticMatcher
from kvcached_router.semantic.vectors import SearchConfig, VectorIndex
from tests.router.semantic.minilm import fixture_pairs, minilm

DIM = 16


def unit(*components: float) -> np.ndarray:
    v = np.zeros(DIM, dtype=np.float32)
    v[: len(components)] = components
    return v / np.linalg.norm(v)


def calibration(same: float = 0.6, edit: float = 0.8, reworded: float = 0.9, **kw) -> Calibration:
    return Calibration(thresholds={"same": same, "edit": edit, "reworded": reworded}, target=0.02,
                       model="test", **kw)


# -- the index ------------------------------------------------------------------------------------


def test_rows_stay_dense_when_entries_leave_and_ids_follow_their_rows():
    ix = VectorIndex(DIM, SearchConfig(initial_capacity=2))
    for i in range(5):  # grows past its capacity twice
        ix.add(100 + i, unit(1, i))
    assert len(ix) == 5 and ix.capacity == 8
    moved = ix.remove(101)  # the last row (id 104) moves into row 1
    assert moved == 4 and ix.row_of(104) == 1 and ix.id_at(1) == 104 and 101 not in ix
    assert ix.remove(104) == 3 and ix.id_at(1) == 103  # row 1 again: 103 moves in
    assert ix.remove(102) is None  # the last row: nothing moves
    assert [ix.id_at(r) for r in range(len(ix))] == [100, 103]
    np.testing.assert_allclose(ix.vector(103), unit(1, 3), atol=1e-6)
    with pytest.raises(KeyError):
        ix.remove(101)


def test_adding_an_id_again_replaces_its_vector_and_vectors_are_normalised():
    ix = VectorIndex(DIM)
    ix.add(7, unit(1, 0) * 5)
    ix.add(7, np.r_[np.zeros(1), np.ones(1), np.zeros(DIM - 2)] * 3)
    assert len(ix) == 1
    rows, sims = ix.search(unit(0, 1))
    assert rows.tolist() == [0] and sims[0] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        ix.add(8, np.zeros(DIM))
    with pytest.raises(ValueError):
        ix.add(8, np.ones(DIM + 1))


def test_search_returns_exact_cosines_most_similar_first():
    rng = np.random.default_rng(1)
    m = l2_normalise(rng.normal(size=(300, DIM)))
    ix = VectorIndex(DIM, SearchConfig(k=5))
    for i, v in enumerate(m):
        ix.add(i, v)
    q = l2_normalise(rng.normal(size=DIM))[0]
    rows, sims = ix.search(q)
    exact = m @ q
    assert [ix.id_at(r) for r in rows] == np.argsort(-exact)[:5].tolist()
    np.testing.assert_allclose(sims, np.sort(exact)[::-1][:5], atol=1e-5)


def test_the_sign_bit_stage_finds_what_a_full_scan_finds_for_near_duplicates():
    rng = np.random.default_rng(2)
    dim, n = 384, 20_000
    m = l2_normalise(rng.normal(size=(n, dim)))
    ix = VectorIndex(dim, SearchConfig(k=8, exact_below=1000, shortlist=256))
    for i, v in enumerate(m):
        ix.add(i, v)
    for probe in rng.choice(n, 50, replace=False):
        q = l2_normalise(m[probe] + rng.normal(scale=0.6 / np.sqrt(dim), size=dim))[0]  # cosine ~0.85
        rows, sims = ix.search(q)
        assert ix.id_at(rows[0]) == probe
        assert sims[0] == pytest.approx(float(m[probe] @ q), abs=1e-5)
    ix_exact = VectorIndex(dim, SearchConfig(k=8, exact_below=n))
    for i, v in enumerate(m[:2000]):
        ix_exact.add(i, v)
    assert len(ix_exact.search(m[3])[0]) == 8


# -- the decision ---------------------------------------------------------------------------------


def test_an_empty_matcher_says_so():
    r = SemanticMatcher(None, calibration(), dim=DIM).match("anything", unit(1))
    assert (r.entry_id, r.reason, r.top1_similarity, r.examined) == (None, "empty", None, 0)


def test_a_hit_reports_the_entry_its_tier_and_similarity():
    m = SemanticMatcher(None, calibration(), dim=DIM)
    m.add(1, "How do I renew my library card?", unit(1, 0))
    m.add(2, "Where is the nearest post office?", unit(0, 1))
    r = m.match("so how do i renew my libary card", unit(1, 0.3))
    assert r.hit and r.entry_id == 1 and r.reason == "hit" and r.tier == "same"
    assert r.similarity == pytest.approx(r.top1_similarity) == pytest.approx(float(unit(1, 0) @ unit(1, 0.3)))
    assert r.verdicts[0].refusal is None and r.examined == 1


def test_a_guard_refusal_is_the_reason_when_the_candidate_was_similar_enough():
    m = SemanticMatcher(None, calibration(), dim=DIM)
    m.add(1, "Is the pool open on Tuesday?", unit(1, 0))
    r = m.match("Is the pool open on Thursday?", unit(1, 0.01))
    assert not r.hit and r.reason == "guard:date" and "tuesday" in r.detail and r.top1_similarity > 0.99


def test_below_threshold_when_nothing_is_similar_enough_for_its_tier():
    m = SemanticMatcher(None, calibration(edit=0.95), dim=DIM)
    m.add(1, "How do I renew my library card?", unit(1, 0))
    r = m.match("How can I extend my library card?", unit(1, 0.5))  # edit tier, cosine 0.89
    assert not r.hit and r.reason == "below_threshold" and r.top1_similarity == pytest.approx(0.894, abs=1e-3)
    assert r.verdicts[0].tier == "edit" and r.verdicts[0].threshold == 0.95


def test_the_walk_passes_a_refused_candidate_and_takes_the_next_acceptable_one():
    m = SemanticMatcher(None, calibration(), dim=DIM)
    m.add(1, "Is the pool open on Tuesday?", unit(1, 0))  # nearest, another day
    m.add(2, "is the pool open on thursday", unit(1, 0.2))  # next, the same question
    m.add(3, "Is the pool open on Thursdays?", unit(0, 1))  # below every threshold: never examined
    r = m.match("Is the pool open on Thursday?", unit(1, 0.05))
    assert r.entry_id == 2 and r.reason == "hit"
    assert [(v.entry_id, v.refusal) for v in r.verdicts] == [(1, "guard:date"), (2, None)]


def test_the_walk_stops_below_the_lowest_threshold():
    m = SemanticMatcher(None, calibration(same=0.7, edit=0.8, reworded=0.9), dim=DIM)
    m.add(1, "Is the pool open on Tuesday?", unit(1, 0))
    m.add(2, "is the pool open on thursday", unit(0.5, 1))  # cosine 0.45 to the query
    r = m.match("Is the pool open on Thursday?", unit(1, 0))
    assert r.examined == 1 and r.reason == "guard:date"


def test_removed_entries_are_not_matched_and_replaced_ones_match_their_new_text():
    m = SemanticMatcher(None, calibration(), dim=DIM)
    m.add(1, "Track order 5512", unit(1, 0))
    m.add(2, "Where is the nearest post office?", unit(0, 1))
    assert len(m) == 2 and m.remove(1) and not m.remove(1) and len(m) == 1 and 1 not in m
    assert m.match("Track order 5512", unit(1, 0)).entry_id is None
    m.add(2, "Track order 5512", unit(1, 0))
    assert m.match("track order 5512", unit(1, 0)).entry_id == 2 and m.text(2) == "Track order 5512"


def test_texts_are_normalised_before_they_are_compared():
    m = SemanticMatcher(HashingEmbedder(DIM), calibration())
    m.add(1, "How   do I pay？")  # full-width question mark, doubled spaces
    assert m.text(1) == "How do I pay?"
    assert m.match("How do I pay?").entry_id == 1


def test_without_an_embedder_vectors_must_be_given():
    m = SemanticMatcher(None, calibration(), dim=DIM)
    with pytest.raises(ValueError):
        m.add(1, "text")
    with pytest.raises(ValueError):
        SemanticMatcher(None, calibration())


def test_a_calibration_made_for_another_embedder_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="kvcached_router.semantic"):
        SemanticMatcher(HashingEmbedder(DIM), calibration())
    assert "re-run kvcached-router calibrate" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvcached_router.semantic"):
        SemanticMatcher(HashingEmbedder(DIM), Calibration(thresholds={"same": 0.6}, target=0.02, model="hashing-v1"))
    assert caplog.text == ""


# -- with MiniLM -----------------------------------------------------------------------------------


def test_with_minilm_every_fixture_question_finds_its_own_repeat_and_no_trap_is_served():
    pairs = fixture_pairs()
    m = SemanticMatcher(minilm(), calibration(same=0.6, edit=0.85, reworded=0.8))
    for i, p in enumerate(pairs):
        m.add(i, p["a"])
    for i, p in enumerate(pairs):
        r = m.match(p["b"])
        if p["same_answer"]:
            assert r.entry_id == i, (p, r)
        else:
            assert r.entry_id is None, (p, r)
            assert r.reason != "hit"


def test_with_minilm_the_chinese_near_twin_is_refused_but_its_exact_repeat_served():
    m = SemanticMatcher(minilm(), calibration())
    m.add(1, "如何关闭深色模式？")
    off = m.match("如何打开深色模式？")
    assert off.entry_id is None and off.reason == "guard:language" and off.top1_similarity > 0.99
    assert m.match("如何关闭深色模式?").entry_id == 1


def test_minilm_embeds_one_text_as_it_embeds_it_in_a_batch():
    """A lookup's single query runs the traced BERT module, a batch runs SentenceTransformer's
    ``encode`` (padded): both must give one vector per text, whatever its length (one word;
    a long text cut at the model's 256 tokens)."""
    e = minilm()
    assert e._single is not e._model[0].auto_model, "the single-text path is not traced"
    texts = ["hi", "how do I turn off dark mode on my phone?",
             "Summarise this: " + " ".join(f"clause {i} of the lease says rent is due monthly" for i in range(60))]
    batch = e.encode(texts + ["pad"])[:3]
    one = np.vstack([e.encode([t]) for t in texts])
    assert np.abs(one - batch).max() < 1e-5
    assert np.allclose(np.linalg.norm(one, axis=1), 1.0, atol=1e-6)
