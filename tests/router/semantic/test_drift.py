"""The drift check: PSI of live top-1 similarities against a reference fires on a shifted
distribution and not on one drawn from the reference; the doctor checks read its state."""

from __future__ import annotations

import logging
import random

import pytest

from kvcached_router.semantic.drift import (EDGES, DriftConfig, DriftMonitor, bucket, histogram, psi,
                                            reference_counts, semantic_checks)
from kvcached_router.semantic.shadow import ShadowConfig, ShadowSampler, wilson


def draw(rng: random.Random, n: int, mean: float, sd: float) -> list[float]:
    return [min(max(rng.gauss(mean, sd), -1.0), 1.0) for _ in range(n)]


def test_buckets_cover_the_range():
    assert bucket(-0.3) == 0 and bucket(0.0) == 0 and bucket(0.29) == 0 and bucket(0.3) == 1
    assert bucket(0.97) == EDGES.index(0.96) and bucket(1.0) == len(EDGES) - 1
    assert histogram([0.1, 0.95, 0.95, 1.0]) == [1] + [0] * 9 + [2, 0, 1]


def test_psi_is_zero_for_equal_shares_and_grows_with_the_shift():
    ref = histogram(draw(random.Random(1), 2000, 0.85, 0.06))
    assert psi(ref, ref) == pytest.approx(0.0, abs=1e-12)
    small = psi(histogram(draw(random.Random(2), 2000, 0.83, 0.06)), ref)
    large = psi(histogram(draw(random.Random(3), 2000, 0.65, 0.10)), ref)
    assert 0 < small < 0.25 < large


@pytest.mark.parametrize("seed", range(5))
def test_no_alert_on_a_sample_of_the_calibrated_distribution(seed):
    rng = random.Random(seed)
    mon = DriftMonitor(DriftConfig(), reference=histogram(draw(rng, 600, 0.85, 0.06)))
    for s in draw(rng, 1000, 0.85, 0.06):
        mon.observe(s)
    st = mon.state()
    assert st["reference_source"] == "calibration" and st["live_samples"] == 1000
    assert not st["alert"] and st["alerts"] == 0 and st["psi"] < 0.1


def test_alert_on_a_shifted_distribution_logs_one_event_and_clears(caplog):
    rng = random.Random(7)
    mon = DriftMonitor(DriftConfig(min_samples=200, window=400), reference=histogram(draw(rng, 600, 0.85, 0.06)))
    caplog.set_level(logging.INFO, logger="kvcached_router.semantic")
    for s in draw(rng, 199, 0.62, 0.10):  # new kind of traffic: far lower top-1 similarities
        mon.observe(s)
    assert not mon.alert and mon.psi > 0.25  # shifted, but fewer than min_samples lookups
    mon.observe(0.6)
    assert mon.alert and mon.alerts == 1
    for s in draw(rng, 100, 0.62, 0.10):
        mon.observe(s)
    fired = [r for r in caplog.records if getattr(r, "event", None) == "semantic_drift"]
    assert len(fired) == 1 and fired[0].levelno == logging.WARNING
    assert fired[0].getMessage().startswith("EVENT=semantic_drift psi=")
    for s in draw(rng, 400, 0.85, 0.06):  # the window refills with reference-like traffic
        mon.observe(s)
    assert not mon.alert and mon.alerts == 1
    assert [r.event for r in caplog.records if getattr(r, "event", "").startswith("semantic_drift")] == \
        ["semantic_drift", "semantic_drift_cleared"]


def test_without_a_calibrated_reference_the_first_lookups_become_it():
    rng = random.Random(11)
    mon = DriftMonitor(DriftConfig(reference_samples=500, min_samples=200))
    for s in draw(rng, 500, 0.85, 0.06):
        mon.observe(s)
    st = mon.state()
    assert st["reference_source"] == "live" and st["reference_ready"] and st["reference_samples"] == 500
    assert st["live_samples"] == 0 and st["psi"] is None
    for s in draw(rng, 300, 0.85, 0.06):
        mon.observe(s)
    assert not mon.alert
    for s in draw(rng, 2000, 0.55, 0.1):
        mon.observe(s)
    assert mon.alert


def test_reference_counts_from_a_calibration():
    counts = histogram(draw(random.Random(5), 100, 0.9, 0.03))
    assert reference_counts({"reference_histogram": {"edges": list(EDGES), "counts": counts}}) == counts
    assert reference_counts({"reference_histogram": counts}) == counts
    assert reference_counts({"reference_similarities": [0.95, 0.95, 0.1]}) == histogram([0.95, 0.95, 0.1])
    assert reference_counts({"reference_histogram": {"edges": [0.0, 0.5], "counts": [1, 2]}}) is None
    assert reference_counts(object()) is None


def _state(drift: DriftMonitor, shadow: ShadowSampler) -> dict:
    return {"enabled": True, "drift": drift.state(), "shadow": shadow.state()}


def test_doctor_checks_follow_the_state():
    rng = random.Random(3)
    ref = histogram(draw(rng, 600, 0.85, 0.06))
    drift, shadow = DriftMonitor(DriftConfig(), ref), ShadowSampler(ShadowConfig(rate=0.1, min_samples=50))
    checks = {c["check"]: c for c in semantic_checks(_state(drift, shadow))}
    assert set(checks) == {"semantic drift", "semantic false hits"}
    assert all(set(c) == {"check", "verdict", "detail", "dig"} for c in checks.values())
    assert checks["semantic drift"]["verdict"] == "ok" and "fewer than the 200" in checks["semantic drift"]["detail"]
    for s in draw(rng, 300, 0.6, 0.1):
        drift.observe(s)
    for _ in range(45):
        shadow.record("Open  Settings, then Display。", "Open Settings, then Display.")  # equal once normalised
    for _ in range(5):
        shadow.record("Yes, on Sundays from 9 to 5.", "No, it is closed on Sundays.")
    checks = {c["check"]: c for c in semantic_checks(_state(drift, shadow))}
    assert checks["semantic drift"]["verdict"] == "warn" and "re-calibrate" in checks["semantic drift"]["detail"]
    assert "EVENT=semantic_drift" in checks["semantic drift"]["dig"]
    assert checks["semantic false hits"]["verdict"] == "warn", checks["semantic false hits"]
    assert semantic_checks({"enabled": False}) == [
        {"check": "semantic cache", "verdict": "ok", "detail": "off", "dig": "the router config's [semantic] section"}]


def test_shadow_agreement_and_wilson_interval():
    s = ShadowSampler(ShadowConfig(rate=1.0), similar=lambda a, b: 0.95 if a[:4] == b[:4] else 0.2)
    assert s.should_shadow() and s.sampled == 1
    assert s.record("The clinic opens at 9.", "the  clinic opens at 9.") is False  # case kept; not similar
    assert s.record("The clinic opens at 9.", "The clinic opens at 9 .") is True  # not equal, similar
    assert s.record("Yes.", "No.") is False
    st = s.state()
    assert (st["agree"], st["disagree"]) == (1, 2) and st["false_hit_rate"] == pytest.approx(2 / 3)
    low, high = wilson(2, 3)
    assert st["false_hit_low"] == low and 0 < low < 2 / 3 < high < 1
    assert wilson(0, 100)[0] == 0.0 and wilson(0, 100)[1] < 0.04
    assert not ShadowSampler(ShadowConfig(rate=0.0)).should_shadow()
