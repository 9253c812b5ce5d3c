"""``SemanticMatcher``: does a stored question's answer serve a new one?

It holds entries (id, normalised text, unit vector) and answers :meth:`SemanticMatcher.match`:

1. the ``k`` nearest entries by cosine (:class:`~kvcached_router.semantic.vectors.VectorIndex`);
2. walked from the most similar down, each is compared with the query
   (:func:`~kvcached_router.semantic.guards.compare`): refused if a guard objects, else
   accepted if its similarity reaches the calibrated threshold of its tier;
3. the first accepted one is the hit. The walk stops at the first candidate below the lowest
   threshold of any tier (none after it can pass).

``reason`` says what happened: ``hit``; ``guard:<reason>`` when a candidate was similar enough
for its tier but a guard refused it (the first such refusal); ``below_threshold`` when no
candidate was similar enough; ``empty`` when there were no entries.

The guards read features of both texts (:func:`~kvcached_router.semantic.features.analyse`,
~0.2 ms a text): an entry's are read when it is added (off the lookup path: the cache indexes
after the answer is sent), the query's once per match. Not thread-safe: the cache serialises
calls (it holds one matcher per scope under its matcher lock).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvcached_client.text import NORMALIZATION_VERSION, normalize

from .calibrate import Calibration
from .embed import Embedder
from .features import EMBEDDABLE_SCRIPTS, Features, analyse, language_group
from .guards import GUARDS_VERSION, compare
from .vectors import SearchConfig, VectorIndex

log = logging.getLogger("kvcached_router.semantic")

HIT, BELOW, EMPTY = "hit", "below_threshold", "empty"


@dataclass(frozen=True)
class Verdict:
    """One candidate of a match: its similarity, tier, and why it was not taken (None: taken)."""

    entry_id: int
    similarity: float
    tier: str
    threshold: float
    refusal: str | None  # "below_threshold", "guard:<reason>", or None for the hit


@dataclass(frozen=True)
class MatchResult:
    entry_id: int | None  # the accepted entry, None on a miss
    top1_similarity: float | None  # of the most similar entry (None: no entries)
    similarity: float | None  # of the accepted entry
    reason: str  # "hit" | "below_threshold" | "guard:<reason>" | "empty"
    examined: int  # candidates compared with the query
    tier: str | None = None  # of the accepted entry
    detail: str = ""  # the deciding guard's detail, for logs
    verdicts: tuple[Verdict, ...] = ()

    @property
    def hit(self) -> bool:
        return self.entry_id is not None


class SemanticMatcher:
    """Entries of one scope and the decision over them. ``embedder`` embeds texts added or
    matched without a vector (None: every call passes its vector); ``calibration`` holds the
    per-tier thresholds (None: :class:`Calibration`'s conservative defaults)."""

    def __init__(self, embedder: Embedder | None, calibration: Calibration | None = None, *,
                 search: SearchConfig = SearchConfig(), dim: int | None = None,
                 analyse_text: Callable[[str], Features] = analyse) -> None:
        self.embedder = embedder
        self.calibration = calibration if calibration is not None else Calibration()
        dim = dim if dim is not None else getattr(embedder, "dim", None)
        if dim is None:
            raise ValueError("give an embedder or the vectors' dim")
        self.index = VectorIndex(dim, search)
        self._texts: dict[int, str] = {}
        self._features: dict[int, Features] = {}
        self._analyse = analyse_text
        self._readable = getattr(embedder, "scripts", None) or EMBEDDABLE_SCRIPTS
        self._check_calibration()

    def _check_calibration(self) -> None:
        cal = self.calibration
        name = getattr(self.embedder, "name", None)
        if cal.target is None:
            log.info("semantic matcher: no calibration, default thresholds %s", cal.thresholds)
            return
        for what, mine, theirs in (("embedder", name, cal.model), ("normalization", NORMALIZATION_VERSION,
                                   cal.normalization_version), ("guards", GUARDS_VERSION, cal.guards_version)):
            if mine is not None and theirs and mine != theirs:
                log.warning("semantic matcher: the calibration was made with %s %s, this matcher uses %s: "
                            "re-run kvcached-router calibrate", what, theirs, mine)

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self.index

    def add(self, entry_id: int, text: str, vector: np.ndarray | None = None,
            features: Features | None = None) -> None:
        """Index ``text`` (normalised here) under ``entry_id``, replacing what the id held;
        ``features``: the text's, when the caller has already read them."""
        text = normalize(text)
        if vector is None:
            vector = self._embed(text)
        self.index.add(int(entry_id), vector)
        self._texts[int(entry_id)] = text
        self._features[int(entry_id)] = features if features is not None else self._analyse(text)

    def remove(self, entry_id: int) -> bool:
        """Forget ``entry_id``; False when it was not there."""
        entry_id = int(entry_id)
        if entry_id not in self.index:
            return False
        self.index.remove(entry_id)
        del self._texts[entry_id]
        del self._features[entry_id]
        return True

    def text(self, entry_id: int) -> str:
        return self._texts[int(entry_id)]

    def match(self, text: str, vector: np.ndarray | None = None, features: Features | None = None) -> MatchResult:
        if len(self.index) == 0:
            return MatchResult(None, None, None, EMPTY, 0)
        text = normalize(text)
        if vector is None:
            vector = self._embed(text)
        rows, sims = self.index.search(vector)
        query = features if features is not None else self._analyse(text)
        group = language_group(query)
        floor = self.calibration.lowest_threshold
        verdicts: list[Verdict] = []
        refused: Verdict | None = None
        detail = ""
        for row, sim in zip(rows.tolist(), sims.tolist()):
            if sim < floor:
                break
            entry_id = self.index.id_at(row)
            cmp = compare(query, self._features[entry_id], self._readable)
            threshold = self.calibration.threshold(cmp.tier, group)
            if sim < threshold:
                verdicts.append(Verdict(entry_id, sim, cmp.tier, threshold, BELOW))
            elif cmp.refusal is not None:
                v = Verdict(entry_id, sim, cmp.tier, threshold, f"guard:{cmp.refusal.reason}")
                verdicts.append(v)
                if refused is None:
                    refused, detail = v, cmp.refusal.detail
            else:
                verdicts.append(Verdict(entry_id, sim, cmp.tier, threshold, None))
                return MatchResult(entry_id, float(sims[0]), sim, HIT, len(verdicts), cmp.tier, "", tuple(verdicts))
        reason = refused.refusal if refused is not None else BELOW
        return MatchResult(None, float(sims[0]), None, reason or BELOW, len(verdicts), None, detail, tuple(verdicts))

    def _embed(self, text: str) -> np.ndarray:
        if self.embedder is None:
            raise ValueError("this matcher has no embedder: pass the vector")
        return self.embedder.encode([text])[0]
