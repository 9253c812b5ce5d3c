"""SGLang's HiCache pages as kvcached chunks: the keys, the layout, and a view of each page.

No SGLang import here (the backend in :mod:`kvcached_client.sglang.backend` is the only module
that needs SGLang), so this is testable on its own.

**Keys.** A HiCache storage backend is never given token ids, only SGLang's page keys: the hex
SHA-256 chain ``key_i = SHA256(digest_{i-1} ‖ page i's token ids)`` (``get_storage_hash_str``),
seeded by the request's ``extra_key``/``cache_salt`` when it has one. So a page key already
commits to every token before it. The daemon keys chunks by "token ids" it hashes itself; here
those are the page keys' bytes, as uint32 words, one page = one chunk of ``page_size`` words: the
key's 8 words, then zeros. The daemon still derives its own keyed chunk hashes from them (its
chain over the whole prefix), and the layout says ``client_keys = sglang-page-sha256``, so these
chunks never meet chunks keyed by real token ids, and a domain must be configured to accept them
(``trust_client_keys``; DESIGN: clients never supply hashes unless the domain trusts them).

Keys shorter than 128 bits are refused (``SGLANG_USE_XXH3_HASH=1`` gives 64-bit XXH3 keys: with
many pages two prompts would eventually share a key, and a shared key serves the wrong KV).

**Bytes.** A chunk is ``[2, layers, kv_heads, page_size, head_dim]``, K then V, as for every other
kvcached client, whatever SGLang's host layout: :class:`HostPages` gives each page of the host
pool as a strided view in that order, so a page moves with one copy (no staging tensor), and an
engine with a ``layer_first`` host pool and one with ``page_first`` share chunks. MLA keeps its
latent (``kv_lora_rank + rope`` channels) as one head, K = its first half of channels and V the
second, as the vLLM connector does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kvcached.contract.keys import CLIENT_KEYS, KVLayout

#: The ``client_keys`` scheme of chunks keyed by SGLang's SHA-256 page chain.
KEY_SCHEME = "sglang-page-sha256"
#: uint32 words of one SHA-256 page key.
KEY_WORDS = 8
#: Host layouts whose pages :class:`HostPages` can view.
HOST_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


class UnsupportedPool(ValueError):
    """SGLang's host pool or storage config is one this backend cannot serve exactly."""


def key_words(keys: Sequence[str], page_size: int) -> np.ndarray:
    """The "token ids" the daemon is given for ``keys`` (consecutive pages from the first):
    ``page_size`` uint32 words per page, the key's 32 bytes then zeros."""
    if page_size < KEY_WORDS:
        raise UnsupportedPool(f"page_size {page_size} is under {KEY_WORDS} tokens: a page cannot carry its "
                              "256-bit key (start SGLang with --page-size 8 or more)")
    out = np.zeros((len(keys), page_size), dtype="<u4")
    if keys:
        try:
            raw = bytes.fromhex("".join(keys))
        except ValueError:
            raise UnsupportedPool("SGLang page keys are not hex strings") from None
        if len(raw) != 4 * KEY_WORDS * len(keys):
            raise UnsupportedPool(
                f"SGLang page keys are not {4 * KEY_WORDS * 8}-bit SHA-256 digests (got {len(keys[0]) * 4} bits; "
                "SGLANG_USE_XXH3_HASH=1 keys are too short to key shared chunks safely)")
        out[:, :KEY_WORDS] = np.frombuffer(raw, dtype="<u4").reshape(len(keys), KEY_WORDS)
    return out.reshape(-1)


@dataclass(frozen=True)
class PoolShape:
    """What the backend needs of SGLang's host pool (``MHATokenToKVPoolHost`` or
    ``MLATokenToKVPoolHost``), read once at registration."""

    layout: str  # SGLang's host layout: layer_first, page_first, page_first_direct
    mla: bool
    num_layers: int
    num_heads: int  # KV heads on this rank (1 for MLA)
    head_dim: int  # MLA: the latent's width (kv_lora_rank + rope)
    page_size: int
    dtype: str  # torch dtype name

    @classmethod
    def of(cls, pool: Any, *, mla: bool) -> "PoolShape":
        """``mla``: SGLang's ``HiCacheStorageConfig.is_mla_model``."""
        layout = getattr(pool, "layout", "")
        if layout not in HOST_LAYOUTS:
            raise UnsupportedPool(f"host layout {layout!r} is not supported; use --hicache-mem-layout "
                                  f"{' or '.join(HOST_LAYOUTS)}")
        if getattr(pool, "kv_buffer", None) is None:
            raise UnsupportedPool(f"{type(pool).__name__} has no single kv_buffer (a split or hybrid pool)")
        if mla:
            heads, dim = 1, int(pool.kv_cache_dim)
            if dim % 2:
                raise UnsupportedPool(f"MLA latent width {dim} is odd")
        else:
            heads, dim = int(pool.head_num), int(pool.head_dim)
            if int(getattr(pool, "v_head_dim", dim)) != dim:
                raise UnsupportedPool("K and V head sizes differ")
        return cls(layout=layout, mla=mla, num_layers=int(pool.layer_num), num_heads=heads, head_dim=dim,
                   page_size=int(pool.page_size), dtype=str(pool.dtype).removeprefix("torch."))

    def layout_for(self, model: str, *, tp: str, pp: str, extra: Sequence[tuple[str, str]] = ()) -> KVLayout:
        """The kvcached layout of this pool's pages: everything that changes a page's bytes (model,
        layers, heads on this rank, head size, dtype, page size, TP and PP rank, the engine) and
        the key scheme. The host layout is not in it: chunks are in one order whatever it is."""
        heads, dim = (1, self.head_dim // 2) if self.mla else (self.num_heads, self.head_dim)
        return KVLayout(model=model, num_layers=self.num_layers, num_kv_heads=heads, head_dim=dim,
                        dtype=self.dtype, chunk_tokens=self.page_size,
                        extra=(("engine", "sglang"), (CLIENT_KEYS, KEY_SCHEME), ("tp", tp), ("pp", pp),
                               *(("attention", "mla"),) * self.mla, *extra))


class HostPages:
    """Each page of SGLang's host pool as a view in chunk order ``[2, layers, heads, page, dim]``.

    ``page(start)``: ``start`` is the page's first token slot in the host pool (SGLang keeps a
    page's slots consecutive, ``host_indices[i * page_size]`` is page i's). The view shares the
    pool's memory: ``view.copy_(chunk)`` loads a page, ``chunk.copy_(view)`` stores one."""

    def __init__(self, pool: Any, *, mla: bool) -> None:
        self.shape = PoolShape.of(pool, mla=mla)
        self.buf = pool.kv_buffer

    def page(self, start: int) -> Any:
        s, p, buf = self.shape, self.shape.page_size, self.buf
        if not s.mla:
            if s.layout == "layer_first":  # (2, L, size, H, D)
                return buf[:, :, start:start + p].permute(0, 1, 3, 2, 4)
            if s.layout == "page_first":  # (2, size, L, H, D)
                return buf[:, start:start + p].permute(0, 2, 3, 1, 4)
            return buf[:, start // p].permute(0, 1, 3, 2, 4)  # (2, pages, L, P, H, D)
        if s.layout == "layer_first":  # (L, size, 1, Dk)
            lat = buf[:, start:start + p, 0]
        elif s.layout == "page_first":  # (size, L, 1, Dk)
            lat = buf[start:start + p, :, 0].transpose(0, 1)
        else:  # (pages, L, P, 1, Dk)
            lat = buf[start // p, :, :, 0]
        # lat: (L, P, Dk) -> (2, L, 1, P, Dk/2): K = channels [:Dk/2], V = [Dk/2:]
        half = s.head_dim // 2
        sl, sp, sd = lat.stride()
        return lat.as_strided((2, s.num_layers, 1, p, half), (half * sd, sl, 0, sp, sd), lat.storage_offset())
