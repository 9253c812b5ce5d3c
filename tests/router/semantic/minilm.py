"""One real MiniLM embedder for the semantic tests of this process (loading it takes seconds)."""

from __future__ import annotations

import functools
import json
import os

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "data", "semantic")
PAIRS = os.path.join(DATA, "pairs.jsonl")


@functools.lru_cache(maxsize=1)
def minilm():
    from kvcached_router.semantic.embed import MiniLMEmbedder

    e = MiniLMEmbedder()
    e.encode(["warm up"])
    return e


def fixture_pairs() -> list[dict]:
    with open(PAIRS) as f:
        return [json.loads(line) for line in f if line.strip()]
