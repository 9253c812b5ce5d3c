"""Engine configuration. Daemon-level settings (socket, metrics...) come later
and wrap this; defaults follow DESIGN.md section 8."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class StoreConfig:
    """Everything the engine of one trust domain needs.

    ``pool_bytes`` is rounded down to whole ``pool_block_bytes`` blocks. A
    layout whose chunk is larger than one block cannot be registered.
    """

    state_dir: str
    domain: str = "default"
    device: str = "cpu"  # "cpu" (host shared memory) or "cuda[:N]"
    pool_bytes: int = 1 * GiB
    pool_block_bytes: int = 16 * MiB  # one Llama-3-8B bf16 chunk of 128 tokens
    pool_prefault: bool = True
    nvme_bytes: int = 64 * GiB  # 0 disables the NVMe tier
    nvme_map_bytes: int | None = None  # LMDB map size; default 2 x nvme_bytes (sparse)
    cache_ttl: float = 3600.0
    lease_ttl: float = 30.0
    reservation_ttl: float = 30.0
    write_through: bool = False
    prefetch_distance: int = 8
    max_prompt_tokens: int = 1 << 20

    def __post_init__(self) -> None:
        if self.pool_block_bytes <= 0 or self.pool_bytes < self.pool_block_bytes:
            raise ValueError("pool_bytes must hold at least one pool_block_bytes block")
        if self.nvme_bytes < 0:
            raise ValueError("nvme_bytes must be >= 0")
        for name in ("cache_ttl", "lease_ttl", "reservation_ttl"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if not 0 <= self.prefetch_distance <= 1024:
            raise ValueError("prefetch_distance must be in 0..1024")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ValueError(f"device must be cpu or cuda[:N], not {self.device!r}")
        if not self.domain or "/" in self.domain or len(self.domain) > 64:
            raise ValueError("domain must be a short name without '/'")

    @property
    def pool_blocks(self) -> int:
        return self.pool_bytes // self.pool_block_bytes
