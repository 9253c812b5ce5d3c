"""The shadow sample: a few semantic hits are also answered by the engine, to measure false hits.

The matcher's thresholds hold a false-hit bound on the labelled pairs they were calibrated on;
live traffic is not those pairs. So a small fraction (``rate``) of semantic hits is re-run on the
engine in the background (the client already has the cached answer and never waits for it), and
the two answers are compared: equal after :func:`kvcached_client.text.normalize`, or, when a
``similar`` function is given (the router passes the embedder's cosine), at least
``agree_similarity`` alike. A disagreement is a measured false hit. The rate and its 95 % Wilson
interval are what ``/router/semantic`` and the doctor check report against ``false_hit_bound``.

Exact hits are never shadowed: same normalised request, same answer at temperature 0.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvcached_client.text import normalize


@dataclass(frozen=True)
class ShadowConfig:
    rate: float = 0.0  # fraction of semantic hits re-run on the engine
    agree_similarity: float = 0.9  # answers at least this alike (cosine) agree
    false_hit_bound: float = 0.02  # the rate the doctor check holds the measured one to
    min_samples: int = 50  # shadowed hits needed before the check judges

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError("shadow rate must be in [0, 1]")


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of ``k`` successes in ``n`` trials (95 % by default)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(centre - half, 0.0), min(centre + half, 1.0)


class ShadowSampler:
    """Chooses which semantic hits to shadow and keeps the agree/disagree counts (thread-safe)."""

    def __init__(self, config: ShadowConfig, similar: Callable[[str, str], float] | None = None,
                 rng: random.Random | None = None) -> None:
        self.config = config
        self.similar = similar
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self.agree = 0
        self.disagree = 0
        self.errors = 0  # shadow requests the engine did not answer usefully
        self.sampled = 0

    def should_shadow(self) -> bool:
        if self.config.rate <= 0:
            return False
        take = self._rng.random() < self.config.rate
        if take:
            with self._lock:
                self.sampled += 1
        return take

    def agrees(self, cached: str, fresh: str) -> bool:
        """Whether the engine's answer ``fresh`` agrees with the cached one."""
        a, b = normalize(cached), normalize(fresh)
        if a == b:
            return True
        return self.similar is not None and self.similar(a, b) >= self.config.agree_similarity

    def record(self, cached: str, fresh: str) -> bool:
        """Compare and count one shadowed hit; True when they agree."""
        ok = self.agrees(cached, fresh)
        with self._lock:
            if ok:
                self.agree += 1
            else:
                self.disagree += 1
        return ok

    def record_error(self) -> None:
        with self._lock:
            self.errors += 1

    @property
    def false_hit_rate(self) -> float | None:
        n = self.agree + self.disagree
        return self.disagree / n if n else None

    def state(self) -> dict:
        with self._lock:
            n = self.agree + self.disagree
            low, high = wilson(self.disagree, n)
            return {"rate": self.config.rate, "sampled": self.sampled, "agree": self.agree,
                    "disagree": self.disagree, "errors": self.errors,
                    "false_hit_rate": self.disagree / n if n else None,
                    "false_hit_low": low if n else None, "false_hit_high": high if n else None,
                    "false_hit_bound": self.config.false_hit_bound, "min_samples": self.config.min_samples}
