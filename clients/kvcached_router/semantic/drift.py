"""Drift of the semantic cache's top-1 similarity distribution, and the doctor checks over it.

The thresholds the matcher uses were calibrated on labelled pairs whose similarities had some
distribution. When live traffic's top-1 similarities move away from it (a new kind of question,
another language, a changed system prompt, a different embedder), the calibrated false-hit bound
no longer describes what the cache does. :class:`DriftMonitor` compares the two distributions:

- both are histograms over the fixed buckets :data:`EDGES` (finer where thresholds live);
- the statistic is the population stability index, ``PSI = sum((l - r) * ln(l / r))`` over the
  buckets' shares ``l`` (live) and ``r`` (reference), each share smoothed by half a count per
  bucket so an empty bucket does not make it infinite;
- the alert fires when ``PSI > threshold`` (default 0.25, the usual "the population shifted"
  line; 0.1 to 0.25 is "moderate") over at least ``min_samples`` live lookups (default 200).
  Two samples of the same distribution score about ``(buckets - 1) * (1/n + 1/m)``: 0.08 at
  200 live and 500 reference lookups, well under the line.

The reference is the calibrated one when the calibration carries one (:func:`reference_counts`:
``kvcached-router calibrate`` stores its pairs' similarities); otherwise the first
``reference_samples`` live lookups become it. The live side is a sliding window of the last
``window`` lookups. A caveat on the calibrated reference: labelled pairs are near neighbours by
construction, while live traffic also brings questions with no neighbour at all (top-1 0.2 to
0.6), so a cache whose traffic is mostly new questions drifts from it on day one; the router's
``drift_reference = "live"`` then compares traffic with its own first lookups instead.

When the alert changes, the monitor logs one event (``EVENT=semantic_drift`` at warning,
``EVENT=semantic_drift_cleared`` at info, key=value fields in the message and ``event`` in the
record's extra, as the router's other events). :func:`semantic_checks` turns the router's
``GET /router/semantic`` state into doctor checks.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kvcached_router.semantic")

#: Bucket lower edges; bucket ``i`` is ``[EDGES[i], EDGES[i+1])``, the last one ends at 1 (and
#: holds 1.0 itself). Similarities below 0 count in the first bucket.
EDGES: tuple[float, ...] = (0.0, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.93, 0.96, 0.98)


def bucket(similarity: float) -> int:
    """The index of the :data:`EDGES` bucket holding ``similarity``."""
    return max(bisect.bisect_right(EDGES, similarity) - 1, 0)


def histogram(similarities: Iterable[float]) -> list[int]:
    """Counts per :data:`EDGES` bucket (what a calibration file stores as its reference)."""
    counts = [0] * len(EDGES)
    for s in similarities:
        counts[bucket(s)] += 1
    return counts


def psi(live: Sequence[float], reference: Sequence[float]) -> float:
    """Population stability index of two count vectors over the same buckets (smoothed by half a
    count per bucket)."""
    if len(live) != len(reference):
        raise ValueError("live and reference need the same buckets")
    k = len(live)
    nl, nr = sum(live) + 0.5 * k, sum(reference) + 0.5 * k
    total = 0.0
    for lc, rc in zip(live, reference):
        pl, pr = (lc + 0.5) / nl, (rc + 0.5) / nr
        total += (pl - pr) * math.log(pl / pr)
    return total


def reference_counts(calibration: Any) -> list[int] | None:
    """The reference histogram a calibration carries, as counts over :data:`EDGES`, or None.

    Accepted, as an attribute or key ``reference_histogram``: ``{"edges": [...], "counts": [...]}``
    with the same edges as :data:`EDGES`, or a plain list of counts over them; or, as
    ``reference_similarities``, the top-1 similarities themselves (binned here). Anything else
    (other edges, no such field) gives None: the monitor then takes its reference from live traffic.
    """
    def field(name: str) -> Any:
        if isinstance(calibration, dict):
            return calibration.get(name)
        return getattr(calibration, name, None)

    hist = field("reference_histogram")
    if isinstance(hist, dict):
        edges = [round(float(e), 6) for e in hist.get("edges", ())]
        if edges != [round(e, 6) for e in EDGES]:
            log.warning("the calibration's reference histogram has other buckets: using live traffic instead")
            return None
        hist = hist.get("counts")
    if isinstance(hist, (list, tuple)) and len(hist) == len(EDGES) and sum(hist) > 0:
        return [int(c) for c in hist]
    sims = field("reference_similarities")
    if isinstance(sims, (list, tuple)) and sims:
        return histogram(float(s) for s in sims)
    return None


@dataclass(frozen=True)
class DriftConfig:
    threshold: float = 0.25  # PSI above which the alert fires
    min_samples: int = 200  # live lookups needed before it may fire
    window: int = 2000  # the live side: the last this many lookups
    reference_samples: int = 500  # without a calibrated reference: the first this many lookups

    def __post_init__(self) -> None:
        if self.threshold <= 0 or self.min_samples < 1 or self.reference_samples < 1:
            raise ValueError("drift threshold, min_samples and reference_samples must be positive")
        if self.window < self.min_samples:
            raise ValueError("the drift window must hold at least min_samples lookups")


class DriftMonitor:
    """Live top-1 similarities against a reference; thread-safe (``observe`` is called from the
    lookup thread, ``state`` from the event loop)."""

    def __init__(self, config: DriftConfig = DriftConfig(), reference: Sequence[int] | None = None) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._reference = list(reference) if reference is not None else [0] * len(EDGES)
        self.reference_source = "calibration" if reference is not None else "live"
        self._reference_done = reference is not None
        self._live = [0] * len(EDGES)
        self._window: deque[int] = deque()
        self.psi: float | None = None
        self.alert = False
        self.alerts = 0  # times the alert fired
        self.observed = 0

    def observe(self, similarity: float) -> None:
        """Count one lookup's top-1 similarity; re-evaluates the alert."""
        b = bucket(similarity)
        with self._lock:
            self.observed += 1
            if not self._reference_done:
                self._reference[b] += 1
                self._reference_done = sum(self._reference) >= self.config.reference_samples
                return
            self._window.append(b)
            self._live[b] += 1
            if len(self._window) > self.config.window:
                self._live[self._window.popleft()] -= 1
            self._evaluate()

    def _evaluate(self) -> None:
        n = len(self._window)
        self.psi = psi(self._live, self._reference)
        firing = n >= self.config.min_samples and self.psi > self.config.threshold
        if firing == self.alert:
            return
        self.alert = firing
        if firing:
            self.alerts += 1
            log.warning("EVENT=semantic_drift psi=%.3f threshold=%.3f samples=%d reference=%s: the live top-1 "
                        "similarity distribution moved away from the reference; the calibrated false-hit bound "
                        "may not hold", self.psi, self.config.threshold, n, self.reference_source,
                        extra={"event": "semantic_drift"})
        else:
            log.info("EVENT=semantic_drift_cleared psi=%.3f threshold=%.3f samples=%d", self.psi,
                     self.config.threshold, n, extra={"event": "semantic_drift_cleared"})

    def state(self) -> dict:
        with self._lock:
            return {"psi": self.psi, "threshold": self.config.threshold, "alert": self.alert, "alerts": self.alerts,
                    "live_samples": len(self._window), "min_samples": self.config.min_samples,
                    "reference_source": self.reference_source,
                    "reference_samples": sum(self._reference), "reference_ready": self._reference_done,
                    "edges": list(EDGES), "live": list(self._live), "reference": list(self._reference)}


def semantic_checks(state: dict) -> list[dict]:
    """Doctor checks over the router's ``GET /router/semantic`` state: the drift of the top-1
    similarity distribution and the shadow sample's measured false-hit rate. Each entry has the
    shape of ``kvcachectl.doctor.doctor_checks``' entries: check, verdict (ok/warn/fail), detail, dig."""
    checks: list[dict] = []
    dig = "curl -s ROUTER/router/semantic; journalctl -u kvcached-router EVENT=semantic_drift"

    def add(check: str, verdict: str, detail: str, dig_: str = dig) -> None:
        checks.append({"check": check, "verdict": verdict, "detail": detail, "dig": dig_})

    if not state.get("enabled"):
        add("semantic cache", "ok", "off", "the router config's [semantic] section")
        return checks
    d = state.get("drift") or {}
    if d.get("alert"):
        add("semantic drift", "warn", f"top-1 similarity PSI {d['psi']:.2f} > {d['threshold']:.2f} over the last "
            f"{d['live_samples']} lookups (reference: {d['reference_source']}): traffic changed since calibration; "
            "re-calibrate (kvcached-router calibrate) before trusting the false-hit bound")
    elif not d.get("reference_ready", False):
        add("semantic drift", "ok", f"collecting the reference from live lookups ({d.get('reference_samples', 0)} so "
            "far)")
    elif d.get("live_samples", 0) < d.get("min_samples", 1):
        add("semantic drift", "ok", f"{d.get('live_samples', 0)} lookups since the reference, fewer than the "
            f"{d.get('min_samples')} needed to judge")
    else:
        add("semantic drift", "ok", f"PSI {d['psi']:.2f} <= {d['threshold']:.2f} over {d['live_samples']} lookups")
    s = state.get("shadow") or {}
    n = s.get("agree", 0) + s.get("disagree", 0)
    bound = s.get("false_hit_bound")
    if not s.get("rate"):
        add("semantic false hits", "ok", "no shadow sample (shadow_rate = 0): the false-hit rate is not measured")
    elif n < s.get("min_samples", 1):
        add("semantic false hits", "ok", f"{n} shadowed hits, fewer than the {s.get('min_samples')} needed to judge")
    elif bound is not None and s.get("false_hit_low", 0.0) > bound:
        add("semantic false hits", "warn", f"{s['disagree']} of {n} shadowed semantic hits disagreed with the "
            f"engine ({s['false_hit_rate']:.1%}, at least {s['false_hit_low']:.1%} at 95 %) above the {bound:.1%} "
            "bound: raise the thresholds or re-calibrate", "curl -s ROUTER/router/semantic")
    else:
        add("semantic false hits", "ok", f"{s.get('disagree', 0)} of {n} shadowed semantic hits disagreed "
            f"({s.get('false_hit_rate') or 0.0:.1%})", "curl -s ROUTER/router/semantic")
    return checks


def doctor_main(argv: Sequence[str]) -> int:
    """``kvcached-router doctor [--url URL] [--json]``: :func:`semantic_checks` over a running
    router's ``/router/semantic``, printed as ``kvcachectl doctor`` prints its table; exit 1 when
    a check is not ok, 2 when the router cannot be read."""
    import argparse
    import json
    import urllib.request

    ap = argparse.ArgumentParser(prog="kvcached-router doctor", description="the semantic cache's checks")
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the router (default %(default)s)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(list(argv))
    try:
        with urllib.request.urlopen(args.url.rstrip("/") + "/router/semantic", timeout=10) as r:
            state = json.load(r)
    except (OSError, ValueError) as e:
        print(f"kvcached-router doctor: cannot read {args.url}/router/semantic: {e}")
        return 2
    from kvcachectl.doctor import print_checks  # kvcachectl doctor's format

    return print_checks(semantic_checks(state), args.json, lambda d: d.replace("ROUTER", args.url.rstrip("/")))
