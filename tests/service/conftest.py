"""Shared by the daemon tests: a small layout (the daemon fixtures live in tests/conftest.py)."""

from __future__ import annotations

from kvcached.keys import KVLayout
from tests.daemon import run_py

LAYOUT = KVLayout("test/daemon@1", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", chunk_tokens=16)

__all__ = ["LAYOUT", "run_py"]
