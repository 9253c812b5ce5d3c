"""Tier identities, shared by the index (which records where a chunk lives)
and the tiers (which hold the bytes). A leaf module: it imports nothing."""

from __future__ import annotations

import enum


class TierId(enum.IntFlag):
    """Bit flags: a chunk can live in several tiers at once."""

    NONE = 0
    POOL = 1  # device pool: CUDA memory or host shared memory
    NVME = 2  # LMDB environment on local disk


# Plain-int bits for hot paths: ``int & IntFlag`` goes through enum machinery
# (~1 µs a time), ``int & int`` does not. Equal to the TierId members.
POOL: int = 1
NVME: int = 2
