"""Text normalisation for cache keys.

KV reuse needs identical tokens, so anything that changes text before tokenisation changes the
hit rate: a full-width comma, a doubled space or a CJK quotation mark yields different tokens for
what a user would call the same prompt. :func:`normalize` folds those differences and nothing
else:

- Unicode NFKC (full-width Latin letters and digits become ASCII, compatibility forms fold);
- CJK and typographic punctuation mapped to one ASCII form (``。`` → ``.``, ``、`` → ``,``,
  ``「」“”《》`` → ``"``, ``‘’`` → ``'``, …);
- runs of whitespace collapsed to one space, the ends stripped; zero-width characters dropped;
- no space next to a Chinese or Japanese character (Han, kana, CJK symbols): Chinese is
  written without spaces, and writers put them around Latin words, numbers and punctuation
  inconsistently (``5G 套餐`` / ``5G套餐``, ``收不到 , 怎么办``, ``《 红楼梦 》``; the
  ideographic space U+3000 included). Korean (Hangul) keeps its spaces: they separate words.

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
import re
import unicodedata
from typing import Iterable

NORMALIZATION_VERSION = 2

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
#: Han (with its extensions and compatibility block), kana and CJK symbols: the characters a
#: space next to is dropped. Versioned with the rest: part of NORMALIZATION_VERSION 2.
CJK_CHARS = "\u3001-\u303f\u3040-\u30ff\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f"
_SPACE_BY_CJK = re.compile(f"(?<=[{CJK_CHARS}]) | (?=[{CJK_CHARS}])")


def normalize(text: str) -> str:
    """Return ``text`` with width, punctuation and whitespace differences folded.

    Idempotent: ``normalize(normalize(t)) == normalize(t)``. Digits, case and the order of
    words are kept; spaces are kept except next to Chinese or Japanese characters.
    """
    if not isinstance(text, str):
        raise TypeError(f"normalize() takes str, not {type(text).__name__}")
    t = unicodedata.normalize("NFKC", text)
    if not t.isascii():  # both tables map only non-ASCII characters
        t = t.translate(_INVISIBLE).translate(_PUNCT_TABLE)
    # NFKC turns "…" into "...", so the mapping can't reintroduce anything NFKC would change.
    # str.split() splits on exactly the characters r"\s" matches in a str pattern, several times faster.
    t = " ".join(t.split())
    return t if t.isascii() else _SPACE_BY_CJK.sub("", t)


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
