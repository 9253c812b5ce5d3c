"""The small KV layouts and the deterministic data the tests and the scenario benches use."""

from __future__ import annotations

from kvcached.contract.keys import KVLayout

#: A tiny layout: 4 tokens per chunk, 2*1*2*4*4 = 64 bytes per token... small enough for
#: hundreds of chunks in a few KiB of shared memory.
TINY = KVLayout("test/tiny@1", num_layers=1, num_kv_heads=2, head_dim=4, dtype="float32", chunk_tokens=4)
#: The daemon tests' layout (tests/service), also the two-hosts-on-a-cluster scenario's.
DAEMON_LAYOUT = KVLayout("test/daemon@1", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", chunk_tokens=16)
#: The reliability scenarios' layout (crash loop, client death, fuzzing).
RELIABILITY_LAYOUT = KVLayout("test/reliability@1", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32",
                              chunk_tokens=16)


def payload(position: int, salt: int = 0, layout: KVLayout = TINY) -> bytes:
    """Distinct, recognisable bytes for chunk ``position``."""
    unit = bytes([(position * 7 + salt * 13 + k) % 256 for k in range(16)])
    return (unit * (layout.chunk_bytes // 16 + 1))[: layout.chunk_bytes]


def prompt(n_chunks: int, start: int = 0, layout: KVLayout = TINY) -> list[int]:
    return list(range(start, start + n_chunks * layout.chunk_tokens))
