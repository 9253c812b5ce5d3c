"""Calibration: the similarity thresholds that hold a false-hit target on labelled pairs.

Input is JSONL, one pair a line: ``a`` (what the cache holds), ``b`` (the new question),
``same_answer`` (would ``a``'s answer serve ``b``?) and ``category`` (for the report; fow-cache's
``data/pairs.jsonl`` has this format). Each pair is normalised, embedded, put through the guards
and placed in a tier (:data:`guards.TIERS`: how far apart the two texts' words are). A pair is
*served* when no guard refuses it and its similarity reaches its tier's threshold. A *false hit*
is a served pair with ``same_answer`` false; the false-hit rate is false hits over all such
pairs (traps), recall is served should-hit pairs over all should-hit pairs.

One threshold for everything does not work (MiniLM at 0.93 serves 1 trap in 6 at 42 % recall),
because similarity means different things at different lexical distances: a pair that differs
only in typos and fillers is the same question at 0.6, while a pair that swaps one noun
("adults" / "children") is a different question at 0.95. So the guards refuse what they can
name, and each tier gets its own threshold for the rest.
:func:`~kvcached_router.semantic.thresholds.choose_thresholds` picks them together: the most
should-hit pairs served while the false-hit rate's 80 % upper bound stays within ``target``
and each ``category_targets`` entry (e.g. negation <= 1 %) holds, trap similarities smoothed
so a threshold keeps a margin from them, none below ``min_threshold``.

``kvcached-router calibrate PAIRS.jsonl --target 0.02 --out FILE`` prints the precision/recall
table and writes the :class:`Calibration` JSON the router's ``[semantic] calibration`` reads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from kvcached_client.text import NORMALIZATION_VERSION, normalize

from .embed import EMBEDDERS, Embedder
from .features import EMBEDDABLE_SCRIPTS, LANGUAGE_GROUPS, analyse, language_group
from .guards import GUARDS_VERSION, TIERS, compare
from .thresholds import (  # noqa: F401 - re-exported: the calibration's vocabulary
    DEFAULT_CONFIDENCE,
    DEFAULT_MIN_THRESHOLD,
    DEFAULT_SMOOTHING,
    DEFAULT_THRESHOLDS,
    NEVER,
    choose_thresholds,
    effective_confidence,
    wilson_upper,
)

FORMAT = 1


@dataclass(frozen=True)
class Pair:
    a: str
    b: str
    same_answer: bool
    category: str = ""


@dataclass(frozen=True)
class Scored:
    """A pair as the matcher would see it: ``b`` the query, ``a`` the stored candidate."""

    pair: Pair
    similarity: float
    tier: str
    refusal: str | None  # the guard's reason, or None
    group: str = "en"  # the query's language group (features.LANGUAGE_GROUPS)


@dataclass(frozen=True)
class TableRow:
    tier: str  # a tier, or "all" (one threshold for every tier)
    threshold: float
    served: int
    false_hits: int
    false_hit_rate: float | None  # false hits / traps (None: no traps)
    recall: float | None  # served should-hit / should-hit (None: no such pairs)
    precision: float | None  # served should-hit / served (None: nothing served)


@dataclass(frozen=True)
class Outcome:
    served: int
    hits: int
    false_hits: int
    should_hit: int
    traps: int
    by_category: dict[str, dict[str, int]]  # category -> {"pairs", "served"}

    @property
    def recall(self) -> float:
        return self.hits / self.should_hit if self.should_hit else float("nan")

    @property
    def false_hit_rate(self) -> float:
        return self.false_hits / self.traps if self.traps else float("nan")

    def category_rate(self, category: str) -> float:
        c = self.by_category.get(category)
        return c["served"] / c["pairs"] if c and c["pairs"] else float("nan")


@dataclass(frozen=True)
class Calibration:
    """Per-tier thresholds and how they were chosen. ``reference_similarities`` are the
    calibration pairs' similarities (the drift monitor's reference distribution)."""

    thresholds: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_THRESHOLDS))
    target: float | None = None  # None: not calibrated (the defaults)
    category_targets: dict[str, float] = field(default_factory=dict)
    model: str = ""
    dim: int = 0
    normalization_version: int = NORMALIZATION_VERSION
    guards_version: int = GUARDS_VERSION
    min_threshold: float = DEFAULT_MIN_THRESHOLD
    smoothing: float = DEFAULT_SMOOTHING
    confidence: float = 0.5  # of the overall bound, as used (0.5: the rate itself, too few traps)
    pairs: int = 0
    expected: dict[str, float | None] = field(default_factory=dict)  # recall, false_hit_rate on the pairs
    table: tuple[TableRow, ...] = ()
    reference_similarities: tuple[float, ...] = ()
    #: Per language group (features.LANGUAGE_GROUPS), its own per-tier thresholds, chosen on that
    #: group's pairs alone; a group not here uses ``thresholds`` (chosen on all pairs).
    languages: dict[str, dict[str, float]] = field(default_factory=dict)

    def threshold(self, tier: str, group: str = "") -> float:
        own = self.languages.get(group)
        if own is not None and tier in own:
            return own[tier]
        return self.thresholds.get(tier, DEFAULT_THRESHOLDS.get(tier, NEVER))

    @property
    def lowest_threshold(self) -> float:
        return min(self.threshold(t, g) for t in TIERS for g in ("", *self.languages))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["format"] = FORMAT
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        if d.get("format", FORMAT) != FORMAT:
            raise ValueError(f"calibration format {d.get('format')} is not {FORMAT}")
        known = {f for f in cls.__dataclass_fields__}
        kw = {k: v for k, v in d.items() if k in known}
        kw["table"] = tuple(TableRow(**r) for r in kw.get("table", ()))
        kw["reference_similarities"] = tuple(kw.get("reference_similarities", ()))
        return cls(**kw)

    def save(self, path: str) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> Calibration:
        with open(path) as f:
            return cls.from_dict(json.load(f))


#: The calibration shipped in the package, for the default embedder (auto): chosen by
#: ``kvcached-router calibrate`` on the project's own calibration pairs and fow-cache's (see the README).
SHIPPED = os.path.join(os.path.dirname(__file__), "data", "calibration-auto.json")


def shipped_calibration(model: str) -> Calibration | None:
    """The shipped calibration when it was made for ``model`` (None otherwise: the defaults)."""
    try:
        cal = Calibration.load(SHIPPED)
    except (OSError, ValueError):
        return None
    return cal if cal.model == model else None


# -- pairs and scores ---------------------------------------------------------------------------


def read_pairs(path: str) -> list[Pair]:
    pairs = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                pairs.append(Pair(str(d["a"]), str(d["b"]), bool(d["same_answer"]), str(d.get("category", ""))))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a labelled pair ({e})") from None
    return pairs


def score(pairs: Sequence[Pair], embedder: Embedder) -> list[Scored]:
    """Embed, guard and tier every pair (query ``b`` against stored ``a``), on normalised text."""
    a = [normalize(p.a) for p in pairs]
    b = [normalize(p.b) for p in pairs]
    vectors = embedder.encode(a + b)
    sims = np.einsum("ij,ij->i", vectors[: len(a)], vectors[len(a):])
    readable = getattr(embedder, "scripts", None) or EMBEDDABLE_SCRIPTS
    out = []
    for p, qa, qb, s in zip(pairs, a, b, sims):
        fb = analyse(qb)
        c = compare(fb, analyse(qa), readable)
        out.append(Scored(p, round(float(s), 6), c.tier, c.refusal.reason if c.refusal else None, language_group(fb)))
    return out


def evaluate(thresholds: dict[str, float] | Calibration, scored: Iterable[Scored], guards: bool = True) -> Outcome:
    """What a matcher with these thresholds (per tier, or a calibration's, per language group
    and tier) serves of ``scored`` (``guards=False``: ignore them)."""
    if isinstance(thresholds, Calibration):
        cal = thresholds
        thresholds = {}
        scored = list(scored)
        outs = [evaluate({t: cal.threshold(t, g) for t in TIERS}, [s for s in scored if s.group == g], guards)
                for g in {s.group for s in scored}]
        merged: dict[str, dict[str, int]] = {}
        for o in outs:
            for cat, d in o.by_category.items():
                e = merged.setdefault(cat, {"pairs": 0, "served": 0})
                e["pairs"] += d["pairs"]
                e["served"] += d["served"]
        return Outcome(sum(o.served for o in outs), sum(o.hits for o in outs), sum(o.false_hits for o in outs),
                       sum(o.should_hit for o in outs), sum(o.traps for o in outs), merged)
    served = hits = false_hits = should_hit = traps = 0
    by_cat: dict[str, dict[str, int]] = {}
    for s in scored:
        ok = (s.refusal is None or not guards) and s.similarity >= thresholds.get(s.tier, NEVER)
        c = by_cat.setdefault(s.pair.category, {"pairs": 0, "served": 0})
        c["pairs"] += 1
        c["served"] += ok
        served += ok
        if s.pair.same_answer:
            should_hit += 1
            hits += ok
        else:
            traps += 1
            false_hits += ok
    return Outcome(served, hits, false_hits, should_hit, traps, by_cat)


# -- choosing thresholds -----------------------------------------------------------------------


def table(scored: Sequence[Scored], thresholds: Iterable[float]) -> tuple[TableRow, ...]:
    """One threshold for every tier (guards on), and each tier alone, at each of ``thresholds``."""
    rows = []
    for tier in ("all",) + TIERS:
        items = [s for s in scored if tier == "all" or s.tier == tier]
        n_hit = sum(s.pair.same_answer for s in scored)
        n_trap = len(scored) - n_hit
        for t in thresholds:
            served = [s for s in items if s.refusal is None and s.similarity >= t]
            fh = sum(not s.pair.same_answer for s in served)
            good = len(served) - fh
            rows.append(TableRow(tier, round(float(t), 4), len(served), fh, fh / n_trap if n_trap else None,
                                 good / n_hit if n_hit else None, good / len(served) if served else None))
    return tuple(rows)


def calibrate(scored: Sequence[Scored], target: float, *, model: str, dim: int,
              category_targets: dict[str, float] | None = None, min_threshold: float = DEFAULT_MIN_THRESHOLD,
              smoothing: float = DEFAULT_SMOOTHING, confidence: float = DEFAULT_CONFIDENCE,
              min_group_pairs: int = 60) -> Calibration:
    """Thresholds for all pairs, and for each language group with ``min_group_pairs`` or more
    pairs its own (chosen on that group's pairs alone, to the same targets)."""
    th = choose_thresholds(scored, target, category_targets, min_threshold, smoothing, confidence)
    languages = {}
    for g in LANGUAGE_GROUPS:
        mine = [s for s in scored if s.group == g]
        if len(mine) >= min_group_pairs and len({s.group for s in scored}) > 1:
            languages[g] = choose_thresholds(mine, target, category_targets, min_threshold, smoothing, confidence)
    out = evaluate(Calibration(thresholds=th, languages=languages), scored)
    grid = [round(float(x), 2) for x in np.arange(0.5, 1.0001, 0.01)]
    used = effective_confidence(target, out.traps, confidence)
    return Calibration(thresholds=th, target=target, category_targets=dict(category_targets or {}), model=model,
                       dim=dim, min_threshold=min_threshold, smoothing=smoothing, confidence=used, pairs=len(scored),
                       expected={"recall": _finite(out.recall), "false_hit_rate": _finite(out.false_hit_rate),
                                 "served": out.served},
                       table=table(scored, grid),
                       reference_similarities=tuple(round(s.similarity, 4) for s in scored), languages=languages)


def _finite(x: float) -> float | None:
    return None if math.isnan(x) else x


# -- the command ----------------------------------------------------------------------------------


def format_table(cal: Calibration, tier: str = "all", step: float = 0.05) -> str:
    lines = [f"{'threshold':>9} | {'served':>6} | {'false hits %':>12} | {'recall %':>8}"]
    for r in cal.table:
        if r.tier == tier and (abs(r.threshold / step - round(r.threshold / step)) < 1e-6):
            lines.append(f"{r.threshold:>9.2f} | {r.served:>6} | {_percent(r.false_hit_rate):>12} | "
                         f"{_percent(r.recall):>8}")
    return "\n".join(lines)


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _category_target(text: str) -> tuple[str, float]:
    name, _, value = text.partition("=")
    if not name or not value:
        raise argparse.ArgumentTypeError("expected CATEGORY=RATE, e.g. negation=0.01")
    return name, float(value)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvcached-router calibrate",
                                 description="Pick the semantic cache's thresholds for a false-hit target from "
                                             "labelled pairs (JSONL: a, b, same_answer, category).")
    ap.add_argument("pairs", nargs="+", help="labelled pairs, JSONL (several files are read as one set)")
    ap.add_argument("--embedder", default="auto", choices=EMBEDDERS,
                    help="the router's [semantic] embedder (default auto: USE for Chinese, MiniLM for the rest)")
    ap.add_argument("--target", type=float, default=0.02, help="false hits / traps to hold (default 0.02)")
    ap.add_argument("--category-target", type=_category_target, action="append", default=[], metavar="CAT=RATE",
                    help="a stricter bound for one category, e.g. negation=0.01 (repeatable)")
    ap.add_argument("--min-threshold", type=float, default=DEFAULT_MIN_THRESHOLD,
                    help=f"no tier's threshold below this (default {DEFAULT_MIN_THRESHOLD})")
    ap.add_argument("--confidence", type=float, default=DEFAULT_CONFIDENCE,
                    help=f"hold the target at this confidence (Wilson bound; default {DEFAULT_CONFIDENCE}; 0.5: the "
                         "rate on the pairs itself)")
    ap.add_argument("--smoothing", type=float, default=DEFAULT_SMOOTHING,
                    help=f"deviation of the kernel over trap similarities (default {DEFAULT_SMOOTHING}; 0: counts)")
    ap.add_argument("--out", help="write the calibration JSON here")
    args = ap.parse_args(list(argv) if argv is not None else None)
    if not 0 <= args.target < 1:
        ap.error("--target must be in [0, 1)")

    from .embed import make_embedder

    embedder = make_embedder(args.embedder)
    pairs = [p for path in args.pairs for p in read_pairs(path)]
    scored = score(pairs, embedder)
    cal = calibrate(scored, args.target, model=embedder.name, dim=embedder.dim,
                    category_targets=dict(args.category_target), min_threshold=args.min_threshold,
                    smoothing=args.smoothing, confidence=args.confidence)
    refused = Counter(s.refusal for s in scored if s.refusal)
    print(f"{len(pairs)} pairs ({sum(p.same_answer for p in pairs)} should hit), {embedder.name}; "
          f"guards refused {sum(refused.values())}: " + ", ".join(f"{k} {v}" for k, v in sorted(refused.items())))
    print("\none threshold for every tier, guards on:")
    print(format_table(cal))
    print("\nchosen, per tier: " + ", ".join(f"{t} {cal.threshold(t):.3f}" for t in TIERS))
    for g, th in cal.languages.items():
        print(f"  {g} ({sum(s.group == g for s in scored)} pairs): " + ", ".join(f"{t} {th[t]:.3f}" for t in TIERS))
    if cal.confidence < args.confidence:
        print(f"note: {sum(not s.pair.same_answer for s in scored)} traps are too few to bound the false-hit rate "
              f"at {100 * args.target:.1f} % with {100 * args.confidence:.0f} % confidence: held on the pairs only")
    print(f"on these pairs: recall {_percent(cal.expected['recall'])} %, false hits "
          f"{_percent(cal.expected['false_hit_rate'])} % (target {100 * args.target:.1f} %)")
    if args.out:
        cal.save(args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
