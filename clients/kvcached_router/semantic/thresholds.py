"""Choosing per-tier thresholds for a false-hit target (the search behind ``calibrate``).

Works on scored pairs (:class:`~kvcached_router.semantic.calibrate.Scored`: similarity, tier,
guard refusal, label, category). Pure numpy: a grid of thresholds per tier, the served
should-hit pairs counted, the served traps counted or smoothed, every combination of tiers
checked against the bounds at once.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from statistics import NormalDist
from typing import TYPE_CHECKING

import numpy as np

from .guards import TIERS

if TYPE_CHECKING:
    from .calibrate import Scored

#: Thresholds for a matcher without a calibration file: conservative (close to the exact path).
DEFAULT_THRESHOLDS = {"same": 0.85, "edit": 0.97, "reworded": 0.95}
DEFAULT_MIN_THRESHOLD = 0.5
DEFAULT_SMOOTHING = 0.03
DEFAULT_CONFIDENCE = 0.8
NEVER = 1.01  # a threshold no cosine reaches


def _served(sims: np.ndarray, grid: np.ndarray, smoothing: float) -> np.ndarray:
    """How many of ``sims`` reach each threshold of ``grid``: a count (``smoothing`` 0), or the
    expected count if every similarity were uncertain by a normal error of that deviation,
    cut off at 1 (no cosine exceeds it, so a trap at 0.99 does not reach a threshold of 1)."""
    if sims.size == 0:
        return np.zeros(grid.shape[0])
    if smoothing <= 0:
        return (sims[None, :] >= grid[:, None]).sum(axis=1).astype(float)
    below_one = _phi((1.0 - sims) / smoothing)[None, :]
    below_t = _phi((np.minimum(grid, 1.0)[:, None] - sims[None, :]) / smoothing)
    reach = np.where(grid[:, None] > 1.0, 0.0, (below_one - below_t) / below_one)
    return reach.sum(axis=1)


def _phi(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + _erf(x / math.sqrt(2.0)))


_erf = np.vectorize(math.erf, otypes=[float])


def wilson_upper(k: np.ndarray | float, n: int, z: float) -> np.ndarray | float:
    """The Wilson score upper bound of a rate of ``k`` in ``n`` (``k`` may be fractional)."""
    if n == 0:
        return np.ones_like(k) if isinstance(k, np.ndarray) else 1.0
    p = k / n
    z2 = z * z
    return (p + z2 / (2 * n) + z * np.sqrt(np.maximum(p * (1 - p), 0) / n + z2 / (4 * n * n))) / (1 + z2 / n)


def effective_confidence(target: float, n_traps: int, confidence: float) -> float:
    """``confidence``, or 0.5 (the plain rate) when even zero false hits in ``n_traps`` traps
    cannot show a bound of ``target`` at that confidence (too few traps: 25 traps at 80 % bound
    the rate at 2.8 %, never 2 %)."""
    if confidence <= 0.5 or n_traps == 0:
        return 0.5
    return confidence if wilson_upper(0.0, n_traps, NormalDist().inv_cdf(confidence)) <= target else 0.5


def _combine(per_tier: list[np.ndarray]) -> np.ndarray:
    """Sum per-tier values over every combination of the tiers' grid points: element
    ``[i, j, k]`` is ``per_tier[0][i] + per_tier[1][j] + per_tier[2][k]``."""
    out = np.zeros((1,) * len(per_tier))
    for i, arr in enumerate(per_tier):
        shape = [1] * len(per_tier)
        shape[i] = -1
        out = out + arr.reshape(shape)
    return out


def choose_thresholds(scored: Sequence[Scored], target: float, category_targets: dict[str, float] | None = None,
                      min_threshold: float = DEFAULT_MIN_THRESHOLD, smoothing: float = DEFAULT_SMOOTHING,
                      confidence: float = DEFAULT_CONFIDENCE, step: float = 0.005) -> dict[str, float]:
    """Per-tier thresholds (on a ``step`` grid from ``min_threshold``) that serve the most
    should-hit pairs while the false hits stay <= ``target`` of all traps and <=
    ``category_targets[c]`` of the traps of category ``c``.

    False hits are smoothed (``smoothing``: each trap's similarity counts as a normal of that
    deviation around it): a threshold just above a trap still counts half of it, so the choice
    keeps a margin where traps are dense instead of sitting on the edge of the sample. The overall
    bound is held at ``confidence``: the Wilson upper bound of the false-hit rate must be within
    ``target`` (0.5: the rate itself), so that the bound still holds on pairs not seen here; the
    per-category bounds are held by the (smoothed) counts. With too few traps for the bound
    (:func:`effective_confidence`) the rate itself is held. Ties go to fewer false hits, then
    higher thresholds: each threshold ends up on the lowest should-hit pair it serves. An
    exhaustive search over the grid, tiers together."""
    category_targets = category_targets or {}
    grid = np.append(np.round(np.arange(min_threshold, 1.0 + 1e-9, step), 6), NEVER)
    n_traps = sum(not s.pair.same_answer for s in scored)
    cat_traps = Counter(s.pair.category for s in scored if not s.pair.same_answer)
    limits = {c: t * cat_traps.get(c, 0) + 1e-9 for c, t in category_targets.items()}
    limits[""] = target * n_traps + 1e-9

    hits: list[np.ndarray] = []
    false: dict[str, list[np.ndarray]] = {k: [] for k in limits}
    for tier in TIERS:
        live = [s for s in scored if s.tier == tier and s.refusal is None]
        hit_sims = np.array([s.similarity for s in live if s.pair.same_answer])
        hits.append(_served(hit_sims, grid, 0.0))
        for k in limits:
            trap_sims = np.array([s.similarity for s in live if not s.pair.same_answer and k in ("", s.pair.category)])
            false[k].append(_served(trap_sims, grid, smoothing))

    feasible = np.ones((grid.shape[0],) * len(TIERS), dtype=bool)
    for k, limit in limits.items():
        if k == "" and effective_confidence(target, n_traps, confidence) > 0.5:
            z = NormalDist().inv_cdf(confidence)
            feasible &= wilson_upper(_combine(false[""]), n_traps, z) <= target + 1e-9
        else:
            feasible &= _combine(false[k]) <= limit
    score_hits = np.where(feasible, _combine(hits), -1.0)
    score_false = _combine(false[""])
    score_height = _combine([grid] * len(TIERS))
    order = np.lexsort((score_height.ravel(), -score_false.ravel(), score_hits.ravel()))
    best = np.unravel_index(order[-1], feasible.shape)
    chosen = {tier: float(grid[i]) for tier, i in zip(TIERS, best)}
    for tier in TIERS:  # a tier the pairs never reached keeps its default
        if not any(s.tier == tier for s in scored):
            chosen[tier] = DEFAULT_THRESHOLDS[tier]
    return chosen
