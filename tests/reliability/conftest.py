"""Reliability and security suite (issue #7): real daemons, real clients in other processes,
faults caused for real (SIGKILL, full tiers, hostile bytes). Each test is bounded in time; the
long versions are scripts under bench/ (see bench/README.md) and feed bench/results/reliability.md."""

from __future__ import annotations

from kvcached.keys import KVLayout

#: Small chunks so a few MiB of pool hold many of them.
LAYOUT = KVLayout("test/reliability@1", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", chunk_tokens=16)
