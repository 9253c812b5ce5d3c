"""Converters between vLLM's paged KV cache and kvcached chunks, one per attention backend.

A kvcached chunk is ``[2, layers, kv_heads, chunk_tokens, head_dim]`` (K then V, every layer,
token-major within a head). vLLM keeps one tensor per layer, ``[num_blocks, kv_heads,
block_size, 2 * head_dim]`` as a logical view (vLLM 0.32, "[B, H, N, C]"); how the bytes lie
behind that view is the attention backend's business:

* ``channel-split`` (FlashAttention, FlashInfer, Triton, ROCm): the view is exact, K is
  channels ``[:head_dim]`` and V ``[head_dim:]`` of each token; the physical stride order
  (NHD/HND, ...) is carried by the tensor's strides, so indexing through the view is right
  whatever it is.
* ``cpu`` (CPU_ATTN, the "vec"/"vec16" kernels): each (block, head) holds ``2 * block_size *
  head_dim`` elements, K first, stored transposed as ``[head_dim, block_size]``, then V as
  ``[block_size, head_dim]``. Other CPU kernels (AMX, NEON, ...) may lay K out otherwise, so
  :func:`verify_cpu_layout` checks the layout against vLLM's own cache-write kernel when the
  engine starts and refuses what does not match.

* ``mla`` (every MLA backend): one latent tensor per layer, ``[num_blocks, block_size, D]`` on
  GPU backends, ``[num_blocks, 1, block_size, D]`` on the CPU one (``D = kv_lora_rank +
  rope_dim``); a chunk keeps it as one head, K = channels ``[:D/2]`` and V = ``[D/2:]``, i.e.
  channel-split on the view ``[num_blocks, 1, block_size, D]``.

fp8 KV caches (``uint8`` tensors) are moved as bytes by the same converters.

Each converter moves whole blocks: ``gather`` copies blocks into a chunk's token range,
``scatter`` copies a chunk's token range into blocks. ``block_ids`` is a 1-D int64 tensor on
the cache's device; ``kv`` is ``[2, kv_heads, n_blocks * block_size, head_dim]`` (a layer of a
chunk, or part of one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class PagedLayout:
    name: str
    #: (cache [nb, H, N, 2D], block_ids, out [2, H, n*N, D]) -> None
    gather: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
    #: (cache [nb, H, N, 2D], block_ids, kv [2, H, n*N, D]) -> None
    scatter: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
    #: whether the worker should move a layer's blocks of all a step's chunks in one call (their
    #: token ranges concatenated first) rather than one call per chunk: on a GPU the per-chunk
    #: calls are bound by kernel launches and Python (measured on an H200: a 128 MiB load into a
    #: 32-layer cache at 0.008x a device copy, one call per chunk and layer); False where each call
    #: is a loop over blocks anyway and concatenating would move the bytes twice (``cpu``)
    batches: bool = True


def _split_tokens(kv: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """[H, n*N, D] -> [H, n, N, D] (a view)."""
    h, _, d = kv.shape
    return kv.view(h, n, block, d)


# -- channel-split: K = channels [:D], V = channels [D:] of the logical [B, H, N, 2D] view ------

def _cs_gather(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> None:
    n, block, d = block_ids.numel(), cache.shape[2], out.shape[-1]
    blocks = cache.index_select(0, block_ids)  # [n, H, N, 2D], one gather
    _split_tokens(out[0], n, block).copy_(blocks[..., :d].permute(1, 0, 2, 3))
    _split_tokens(out[1], n, block).copy_(blocks[..., d:].permute(1, 0, 2, 3))


def _cs_scatter(cache: torch.Tensor, block_ids: torch.Tensor, kv: torch.Tensor) -> None:
    n, block = block_ids.numel(), cache.shape[2]
    k = _split_tokens(kv[0], n, block).permute(1, 0, 2, 3)  # [n, H, N, D]
    v = _split_tokens(kv[1], n, block).permute(1, 0, 2, 3)
    cache.index_copy_(0, block_ids, torch.cat([k, v], dim=-1).to(cache.dtype))


# -- cpu: per (block, head), K^T [D, N] then V [N, D] -----------------------------------------

def _cpu_regions(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    nb, h, block, d2 = cache.shape
    d = d2 // 2
    flat = cache.view(nb, h, 2, block * d)
    return flat[:, :, 0].view(nb, h, d, block), flat[:, :, 1].view(nb, h, block, d)


def _cpu_gather(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> None:
    # One strided copy per block and half, straight between the cache and ``out``: on the CPU a
    # gather (index_select) then a permuted copy moves the bytes twice (measured 1.5x slower to
    # gather, 2.2x to scatter, for a 256 KiB chunk layer).
    kt, v = _cpu_regions(cache)
    block = cache.shape[2]
    for j, b in enumerate(block_ids.tolist()):
        out[0, :, j * block : (j + 1) * block].copy_(kt[b].transpose(-1, -2))
        out[1, :, j * block : (j + 1) * block].copy_(v[b])


def _cpu_scatter(cache: torch.Tensor, block_ids: torch.Tensor, kv: torch.Tensor) -> None:
    if not cache.is_contiguous():
        raise ValueError("the CPU attention cache is expected to be contiguous")
    kt, v = _cpu_regions(cache)
    block = cache.shape[2]
    for j, b in enumerate(block_ids.tolist()):
        kt[b].copy_(kv[0, :, j * block : (j + 1) * block].transpose(-1, -2))
        v[b].copy_(kv[1, :, j * block : (j + 1) * block])


CHANNEL_SPLIT = PagedLayout("channel-split", _cs_gather, _cs_scatter)
CPU = PagedLayout("cpu", _cpu_gather, _cpu_scatter, batches=False)
def _one_head(cache: torch.Tensor) -> torch.Tensor:
    """An MLA cache as ``[num_blocks, 1, block_size, D]`` (the CPU backend's shape already; GPU
    backends' ``[num_blocks, block_size, D]`` gets the head axis as a view)."""
    return cache.unsqueeze(1) if cache.ndim == 3 else cache


MLA = PagedLayout("mla", lambda cache, ids, out: _cs_gather(_one_head(cache), ids, out),
                  lambda cache, ids, kv: _cs_scatter(_one_head(cache), ids, kv))

#: vLLM attention backend name (``AttentionBackend.get_name()``) -> its converter.
REGISTRY: dict[str, PagedLayout] = {
    "CPU_ATTN": CPU,
    "FLASH_ATTN": CHANNEL_SPLIT,
    "FLASHINFER": CHANNEL_SPLIT,
    "TRITON_ATTN": CHANNEL_SPLIT,
    "ROCM_ATTN": CHANNEL_SPLIT,
    "ROCM_AITER_FA": CHANNEL_SPLIT,
    "ROCM_AITER_UNIFIED_ATTN": CHANNEL_SPLIT,
    "CPU_MLA": MLA,
    "FLASHMLA": MLA,
    "FLASH_ATTN_MLA": MLA,
    "TRITON_MLA": MLA,
    "CUTLASS_MLA": MLA,
    "FLASHINFER_MLA": MLA,
    "ROCM_AITER_MLA": MLA,
}


def converter_for(backend: str) -> PagedLayout:
    try:
        return REGISTRY[backend]
    except KeyError:
        raise ValueError(f"kvcached connector: attention backend {backend!r} has no KV layout converter "
                         f"(known: {', '.join(sorted(REGISTRY))})") from None


def verify_cpu_layout(dtype: torch.dtype, num_kv_heads: int, block_size: int, head_dim: int, isa: str,
                      *, kv_cache_dtype: str = "auto") -> str | None:
    """Write random K/V into a scratch cache with vLLM's own CPU cache-write kernel for ``isa``
    and read them back through :data:`CPU`; None if they round-trip (exactly; for an fp8 cache
    within fp8's rounding, which a wrong layout exceeds by far), else why not."""
    from vllm import _custom_ops as ops

    fp8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}.get(kv_cache_dtype)
    nb, tokens = 3, 2 * block_size
    g = torch.Generator().manual_seed(0)
    key = torch.randn(tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    cache = torch.zeros(nb, num_kv_heads, block_size, 2 * head_dim, dtype=torch.uint8 if fp8 else dtype)
    kc, vc = cache.view(nb, num_kv_heads, 2 * block_size, head_dim).chunk(2, dim=2)
    try:
        ops.cpu_attn_reshape_and_cache(key, value, kc, vc, torch.arange(tokens) + block_size, isa,
                                       kv_cache_dtype=kv_cache_dtype)
    except RuntimeError as e:
        return f"vLLM's CPU cache-write kernel '{isa}' failed on a probe: {e}"
    out = torch.empty(2, num_kv_heads, tokens, head_dim, dtype=cache.dtype)
    CPU.gather(cache, torch.tensor([1, 2]), out)
    want = torch.stack([key.transpose(0, 1), value.transpose(0, 1)])
    if fp8 is None:
        same = torch.equal(out, want)
    else:
        got = out.view(fp8).float()
        same = bool(torch.allclose(got, want.float(), rtol=0.15, atol=0.02))
    if not same:
        return f"the CPU attention kernel '{isa}' does not store K as [head_dim, block_size] per block and head"
    return None
