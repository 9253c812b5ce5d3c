"""Text normalisation for cache keys.

KV reuse needs identical tokens, so anything that changes text before tokenisation changes the
hit rate: a full-width comma, a doubled space or a CJK quotation mark yields different tokens for
what a user would call the same prompt. :func:`normalize` folds those differences and nothing
else:

- Unicode NFKC (full-width Latin letters and digits become ASCII, compatibility forms fold);
- CJK and typographic punctuation mapped to one ASCII form (``。`` → ``.``, ``、`` → ``,``,
  ``「」“”《》`` → ``"``, ``‘’`` → ``'``, …);
- runs of whitespace collapsed to one space, the ends stripped; zero-width characters dropped.

Digits, case and word order are kept: ``order 1234`` and ``order 1243`` stay different keys (a
normaliser that masks numbers makes two orders equal, which a cache must never do), and so do
``US`` and ``us``.

The output is versioned: :data:`NORMALIZATION_VERSION` is part of every key derived from
normalised text (:func:`text_key`), so a later change to these rules never makes an old entry
match text the new rules would have told apart.

Where this applies to KV reuse it changes the model's input, so a front end uses it for prompts
only as an explicit option (off by default); the semantic response cache always uses it for its
exact path. No dependencies beyond the standard library.
"""
from __future__ import annotations

import hashlib
import unicodedata
from typing import Iterable

NORMALIZATION_VERSION = 1

# Punctuation NFKC leaves alone (it is not a compatibility form) but that users type
# interchangeably with its ASCII counterpart. Full-width forms (，：；！？（）) NFKC already folds.
_PUNCT = {
    "。": ".", "．": ".", "｡": ".",
    "、": ",", "､": ",",
    "「": '"', "」": '"', "『": '"', "』": '"', "《": '"', "》": '"', "〈": '"', "〉": '"',
    "“": '"', "”": '"', "„": '"', "‟": '"', "«": '"', "»": '"', "＂": '"',
    "‘": "'", "’": "'", "‚": "'", "‛": "'", "＇": "'",
    "【": "[", "】": "]", "〔": "[", "〕": "]", "〖": "[", "〗": "]",
    "～": "~", "〜": "~",
    "—": "-", "–": "-", "―": "-", "−": "-", "‐": "-", "‑": "-",
    "…": "...", "‥": "..",
    "・": "·",
}
_PUNCT_TABLE = str.maketrans(_PUNCT)
# Zero-width characters that change tokens but not what a reader sees.
_INVISIBLE = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff"), None)


def normalize(text: str) -> str:
    """Return ``text`` with width, punctuation and whitespace differences folded.

    Idempotent: ``normalize(normalize(t)) == normalize(t)``. Digits, case and the order of
    words are kept.
    """
    if not isinstance(text, str):
        raise TypeError(f"normalize() takes str, not {type(text).__name__}")
    t = unicodedata.normalize("NFKC", text)
    if not t.isascii():  # both tables map only non-ASCII characters
        t = t.translate(_INVISIBLE).translate(_PUNCT_TABLE)
    # NFKC turns "…" into "...", so the mapping can't reintroduce anything NFKC would change.
    # str.split() splits on exactly the characters r"\s" matches in a str pattern, several times faster.
    return " ".join(t.split())


def text_key(*parts: str, version: int = NORMALIZATION_VERSION) -> str:
    """A stable key over normalised ``parts`` (e.g. tenant, model, system prompt, question).

    Each part is normalised, length-prefixed (so ``("ab", "c")`` and ``("a", "bc")`` differ) and
    hashed with BLAKE2b together with ``version``.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(f"kvcached-text-v{version}".encode())
    for p in parts:
        b = normalize(p).encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def normalize_messages(messages: Iterable[dict]) -> list[dict]:
    """Chat messages with every string ``content`` (and text parts of list contents) normalised."""
    out = []
    for m in messages:
        m = dict(m)
        c = m.get("content")
        if isinstance(c, str):
            m["content"] = normalize(c)
        elif isinstance(c, list):
            m["content"] = [
                {**p, "text": normalize(p["text"])} if isinstance(p, dict) and isinstance(p.get("text"), str) else p
                for p in c
            ]
        out.append(m)
    return out
