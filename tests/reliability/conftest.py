"""Reliability and security suite (issue #7): real daemons, real clients in other processes,
faults caused for real (SIGKILL, full tiers, hostile bytes). Each test is bounded in time; the
long versions are scripts under bench/ (see bench/README.md) and feed bench/results/reliability.md."""

from __future__ import annotations

#: Small chunks so a few MiB of pool hold many of them (shared with the benches' scenarios).
from bench.harness.layouts import RELIABILITY_LAYOUT as LAYOUT

__all__ = ["LAYOUT"]
