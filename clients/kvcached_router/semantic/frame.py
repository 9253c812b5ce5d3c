"""A question's frame: what two texts share at their beginning and end, and the slots between.

Two questions with the same words before and after one short span ask one question about two
things ("does the gym have a sauna" / "... a swimming pool"); the guards compare the spans
(``guards._english_frame``, ``chinese.frame_refusal``). Sequences are anything indexable: stems
of words, or characters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

S = TypeVar("S", bound=Sequence)


def slots(a: S, b: S) -> tuple[int, S, S]:
    """How many items ``a`` and ``b`` share at their beginning and end together, and the two
    spans left between: ``slots("abXcd", "abYYcd") == (4, "X", "YY")``. The shared end never
    overlaps the shared beginning."""
    n = min(len(a), len(b))
    p = 0
    while p < n and a[p] == b[p]:
        p += 1
    e = 0
    while e < n - p and a[-1 - e] == b[-1 - e]:
        e += 1
    return p + e, a[p:len(a) - e], b[p:len(b) - e]  # type: ignore[return-value]
