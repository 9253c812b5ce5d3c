"""Calibration: thresholds chosen on hand-made scores (worked out by hand below), the category
bounds, the confidence bound and the smoothing; the JSON file; the command on the fixture pairs
with real MiniLM."""

from __future__ import annotations

import json
import math

import pytest

from kvcached_router.semantic import calibrate as cal
from kvcached_router.semantic.calibrate import NEVER, Calibration, Pair, Scored, choose_thresholds, evaluate
from tests.router.semantic.minilm import PAIRS, minilm

EXACT = {"smoothing": 0.0, "confidence": 0.5}  # plain counts, the rate itself


def hit(sim: float, tier: str) -> Scored:
    return Scored(Pair("a", "b", True, "paraphrase"), sim, tier, None)


def trap(sim: float, tier: str, category: str = "scope", refusal: str | None = None) -> Scored:
    return Scored(Pair("a", "b", False, category), sim, tier, refusal)


# same: two hits, no trap. edit: four hits, a negation trap at 0.92. reworded: two hits, an
# entity trap at 0.82. A trap the guards refused (0.99) never counts.
SCORES = [
    hit(0.90, "same"), hit(0.70, "same"),
    hit(0.95, "edit"), hit(0.93, "edit"), hit(0.90, "edit"), hit(0.89, "edit"), trap(0.92, "edit", "negation"),
    hit(0.90, "reworded"), hit(0.79, "reworded"), trap(0.82, "reworded", "entity_swap"),
    trap(0.99, "edit", "number_date", refusal="number"),
]


def test_with_no_false_hit_allowed_every_tier_serves_only_what_lies_above_its_highest_trap():
    th = choose_thresholds(SCORES, 0.0, **EXACT)
    # each threshold is the highest one serving the same hits: the lowest hit it keeps.
    # same: both hits (0.70); edit: the hits above the 0.92 trap (0.93); reworded: above 0.82 (0.90)
    assert th == {"same": 0.7, "edit": 0.93, "reworded": 0.9}
    out = evaluate(th, SCORES)
    assert (out.hits, out.false_hits, out.should_hit, out.traps) == (5, 0, 8, 3)


def test_a_budget_of_one_false_hit_is_spent_where_it_buys_most_recall():
    th = choose_thresholds(SCORES, 0.34, **EXACT)  # 3 traps: one may be served
    # serving the edit trap buys two hits (0.90, 0.89); the reworded one would buy one (0.79)
    assert th == {"same": 0.7, "edit": 0.89, "reworded": 0.9}
    out = evaluate(th, SCORES)
    assert (out.hits, out.false_hits) == (7, 1) and out.category_rate("negation") == 1.0


def test_a_category_bound_moves_the_budget_elsewhere():
    th = choose_thresholds(SCORES, 0.34, {"negation": 0.0}, **EXACT)
    assert th == {"same": 0.7, "edit": 0.93, "reworded": 0.79}
    out = evaluate(th, SCORES)
    assert (out.hits, out.false_hits, out.category_rate("negation")) == (6, 1, 0.0)


def test_the_confidence_bound_refuses_a_rate_that_only_holds_on_the_sample():
    # one false hit in 3 traps is 33 %: within 40 %, but its 80 % Wilson bound is 57 %; none in 3
    # bounds the rate at 19 %
    assert cal.wilson_upper(1.0, 3, 0.8416) == pytest.approx(0.573, abs=1e-3)
    assert cal.wilson_upper(0.0, 3, 0.8416) == pytest.approx(0.8416**2 / 3 / (1 + 0.8416**2 / 3), abs=1e-6)
    th = choose_thresholds(SCORES, 0.4, smoothing=0.0, confidence=0.8)
    assert th == choose_thresholds(SCORES, 0.0, **EXACT)
    # a target that no count of 3 traps can show at 80 % falls back to the rate itself
    assert cal.effective_confidence(0.1, 3, 0.8) == 0.5 and cal.effective_confidence(0.4, 3, 0.8) == 0.8
    assert choose_thresholds(SCORES, 0.1, smoothing=0.0, confidence=0.8) == choose_thresholds(SCORES, 0.1, **EXACT)


def test_smoothing_keeps_a_margin_from_the_traps():
    scores = [hit(0.95, "edit"), hit(0.91, "edit"), hit(0.85, "edit"), hit(0.81, "edit"),
              trap(0.90, "edit"), trap(0.80, "edit")]
    plain = choose_thresholds(scores, 0.5, **EXACT)["edit"]
    smooth = choose_thresholds(scores, 0.5, smoothing=0.03, confidence=0.5)["edit"]
    assert plain == 0.81  # serves the 0.90 trap, sits on the lowest hit, right above the 0.80 trap
    # smoothed, the two traps count about Φ((0.90 - t) / 0.03) + Φ((0.80 - t) / 0.03): 1 at t = 0.85
    # (symmetric; the cut-off at 1 takes 2e-5 off), more below it; so the 0.81 hit is given up
    assert smooth == 0.85
    assert evaluate({"edit": smooth}, scores).false_hits == 1


def test_a_tier_without_pairs_keeps_its_default_and_one_with_only_traps_never_serves():
    th = choose_thresholds([hit(0.8, "same"), trap(0.9, "edit")], 0.0, **EXACT)
    assert th == {"same": 0.8, "edit": NEVER, "reworded": cal.DEFAULT_THRESHOLDS["reworded"]}


def test_the_table_counts_served_false_hits_and_recall_per_threshold():
    rows = {(r.tier, r.threshold): r for r in cal.table(SCORES, [0.8, 0.9])}
    r = rows[("all", 0.9)]  # served: same 0.90, edit 0.95 0.93 0.90 + trap 0.92, reworded 0.90
    assert (r.served, r.false_hits) == (6, 1)
    assert r.false_hit_rate == pytest.approx(1 / 3) and r.recall == pytest.approx(5 / 8)
    assert r.precision == pytest.approx(5 / 6)
    assert rows[("reworded", 0.8)].served == 2 and rows[("reworded", 0.8)].false_hits == 1


def test_a_calibration_survives_its_json_file(tmp_path):
    c = cal.calibrate(SCORES, 0.34, model="m", dim=3, category_targets={"negation": 0.0}, smoothing=0.0,
                      confidence=0.5)
    assert c.expected == {"recall": 6 / 8, "false_hit_rate": 1 / 3, "served": 7}
    path = str(tmp_path / "cal.json")
    c.save(path)
    back = Calibration.load(path)
    assert back == c
    assert back.threshold("reworded") == 0.79 and back.lowest_threshold == 0.7
    assert len(back.reference_similarities) == len(SCORES)
    with open(path) as f:
        raw = json.load(f)
    assert raw["format"] == cal.FORMAT and raw["model"] == "m"
    raw["format"] = 99
    with pytest.raises(ValueError):
        Calibration.from_dict(raw)


def test_pairs_files_are_checked_line_by_line(tmp_path):
    p = tmp_path / "pairs.jsonl"
    p.write_text('{"a": "x", "b": "y", "same_answer": true, "category": "c"}\n\n{"a": "x"}\n')
    with pytest.raises(ValueError, match=":3:"):
        cal.read_pairs(str(p))


def test_the_command_calibrates_the_fixture_pairs_with_minilm(tmp_path, capsys):
    out = tmp_path / "cal.json"
    assert cal.main([PAIRS, "--embedder", "minilm", "--target", "0.02", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "threshold | served | false hits % | recall %" in printed and f"wrote {out}" in printed
    assert "too few to bound" in printed  # 25 traps: no count can show 2 % at 80 %
    c = Calibration.load(str(out))
    assert c.model == "all-MiniLM-L6-v2" and c.dim == 384 and c.target == 0.02 and c.confidence == 0.5

    # Every fixture trap is refused by a guard, so each tier's threshold is the highest grid step
    # that still serves all of its should-hit pairs: its lowest hit, rounded down to 0.005.
    scored = cal.score(cal.read_pairs(PAIRS), minilm())
    assert all(s.refusal is not None for s in scored if not s.pair.same_answer)
    for tier in ("same", "edit"):
        lowest = min(s.similarity for s in scored if s.tier == tier and s.pair.same_answer)
        assert c.threshold(tier) == pytest.approx(math.floor(lowest / 0.005) * 0.005, abs=1e-6), tier
    assert c.expected["recall"] == 1.0 and c.expected["false_hit_rate"] == 0.0
