"""Shared by the daemon tests: a small layout (the daemon fixtures live in tests/conftest.py)."""

from __future__ import annotations

from bench.harness.daemon import run_py
from bench.harness.layouts import DAEMON_LAYOUT as LAYOUT

__all__ = ["LAYOUT", "run_py"]
