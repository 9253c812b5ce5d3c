"""What the connector supports, and the :class:`KVLayout` of a vLLM engine.

Decided once, when the engine starts, so that an unsupported model is refused with a clear
message at start instead of failing requests later. Supported: decoder-only models whose
layers all use plain full attention (one KV-cache group of ``FullAttentionSpec``, no sliding
window, no chunked-local attention, no KV quantisation, K and V of one head size), with
tensor parallelism (each rank stores its own KV heads), no pipeline and no context
parallelism (decode or prefill: their blocks interleave tokens across ranks).
Refused: sliding-window models (Mistral with a window, Gemma-2/3), hybrid models (Mamba,
linear attention), MLA (DeepSeek), encoder-decoder models. Their KV for a prefix is not
"every token's K and V in every layer", which is what a kvcached chunk holds.

Per request, requests that kvcached cannot key by token ids alone (multimodal inputs,
prompt embeddings) are served without the cache: :func:`request_cacheable`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import TYPE_CHECKING, Any

from kvcached.keys import KVLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig

#: kvcached's default chunk: 128 tokens, rounded up to a whole number of vLLM blocks.
DEFAULT_CHUNK_TOKENS = 128


class UnsupportedEngineError(ValueError):
    """The engine's model or configuration cannot be served by the connector (raised at start)."""


def attention_spec(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None") -> "FullAttentionSpec":
    """The one full-attention KV spec of the engine; :class:`UnsupportedEngineError` otherwise."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode

    model = vllm_config.model_config.model
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise UnsupportedEngineError("kvcached connector: pipeline parallelism is not supported "
                                     f"(pipeline_parallel_size={vllm_config.parallel_config.pipeline_parallel_size})")
    pc = vllm_config.parallel_config
    dcp = getattr(pc, "decode_context_parallel_size", 1) or 1
    pcp = getattr(pc, "prefill_context_parallel_size", 1) or 1
    if dcp > 1 or pcp > 1:
        # The scheduler's blocks are then block_size x dcp x pcp tokens spread over the ranks
        # (interleaved), and a rank's cache holds every n-th token: a chunk is not one rank's slice.
        raise UnsupportedEngineError(
            f"kvcached connector: context parallelism is not supported (decode_context_parallel_size={dcp}, "
            f"prefill_context_parallel_size={pcp}): its blocks interleave tokens across ranks; run without it")
    if vllm_config.model_config.is_encoder_decoder:
        raise UnsupportedEngineError(f"kvcached connector: {model} is an encoder-decoder model; not supported")
    if kv_cache_config is None:
        raise UnsupportedEngineError("kvcached connector: vLLM passed no KV-cache config (a vLLM older than 0.32?)")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
        raise UnsupportedEngineError(
            f"kvcached connector: {model} has {len(groups)} KV-cache groups ({', '.join(kinds)}): hybrid, "
            "sliding-window or mixed attention models are not supported; run it without the connector")
    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec:
        raise UnsupportedEngineError(
            f"kvcached connector: {model} uses {type(spec).__name__} KV caches; only plain full attention "
            "(FullAttentionSpec) is supported (sliding-window, chunked-local, MLA and state-space layers are not)")
    if spec.sliding_window is not None or spec.attention_chunk_size is not None:
        raise UnsupportedEngineError(
            f"kvcached connector: {model} has sliding-window ({spec.sliding_window}) or chunked-local "
            f"({spec.attention_chunk_size}) attention; not supported")
    if spec.kv_quant_mode != KVQuantMode.NONE:
        raise UnsupportedEngineError(f"kvcached connector: quantised KV caches ({spec.kv_quant_mode.name}) are not supported")
    if spec.head_size_v != spec.head_size:
        raise UnsupportedEngineError("kvcached connector: K and V of different head sizes are not supported")
    return spec


def chunk_tokens_for(block_size: int, requested: int | None) -> int:
    """kvcached's chunk size for vLLM blocks of ``block_size`` tokens: ``requested`` if it is a
    whole number of blocks (else :class:`UnsupportedEngineError`), by default 128 tokens rounded
    up to whole blocks."""
    if requested is None:
        return max(1, math.ceil(DEFAULT_CHUNK_TOKENS / block_size)) * block_size
    if requested <= 0 or requested % block_size:
        raise UnsupportedEngineError(
            f"kvcached connector: chunk_tokens={requested} is not a multiple of vLLM's block size {block_size}; "
            f"use a multiple such as {max(1, math.ceil(DEFAULT_CHUNK_TOKENS / block_size)) * block_size}")
    return requested


def model_id(vllm_config: "VllmConfig", override: str | None = None) -> str:
    """The weights' identity: ``model@revision`` (the config's path or hub id, and revision)."""
    if override:
        return override
    mc = vllm_config.model_config
    return f"{mc.model}@{mc.revision}" if mc.revision else mc.model


def engine_layouts(vllm_config: "VllmConfig", spec: "FullAttentionSpec", num_layers: int, chunk_tokens: int,
                   *, model: str) -> tuple[KVLayout, ...]:
    """One layout per tensor-parallel rank (rank r stores its own KV heads under layout r).

    Everything that changes a chunk's bytes is in the layout: the weights, layers, KV heads per
    rank, head size, the cache dtype, the chunk size, the TP rank and size, and the engine
    (vLLM's kernels round differently from transformers', so the two never share chunks).
    LoRA is per request: :func:`with_lora`."""
    tp = vllm_config.parallel_config.tensor_parallel_size
    hf = vllm_config.model_config.hf_text_config
    dtype = str(spec.dtype).removeprefix("torch.")
    return tuple(
        KVLayout(
            model=model,
            num_layers=num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_size,
            dtype=dtype,
            chunk_tokens=chunk_tokens,
            extra=(("architecture", getattr(hf, "model_type", "") or ""), ("engine", "vllm"), ("tp", f"{r}/{tp}")),
            vocab_size=getattr(hf, "vocab_size", 0) or 0,
        )
        for r in range(tp)
    )


def with_lora(layout: KVLayout, lora_request: Any) -> KVLayout:
    """The layout of a request served with a LoRA adapter (its KV differs from the base model's)."""
    if lora_request is None:
        return layout
    return dataclasses.replace(layout, lora_name=lora_request.lora_name,
                               lora_version=f"{lora_request.lora_int_id}:{lora_request.lora_path}")


def with_salt(layout: KVLayout, cache_salt: str | None) -> KVLayout:
    """The layout of a request with vLLM's ``cache_salt`` (tenant isolation): a salted request
    only ever matches chunks stored under the same salt, and never unsalted ones. The salt is
    part of the layout's identity, so it enters every chunk hash; it is kept as a digest (the
    daemon persists layouts, and a salt may be a tenant's secret). Each distinct salt is one
    layout in the daemon."""
    if not cache_salt:
        return layout
    digest = hashlib.sha256(b"vllm cache_salt\0" + cache_salt.encode()).hexdigest()[:32]
    return dataclasses.replace(layout, extra=layout.extra + (("cache_salt", digest),))


def request_cacheable(request: Any) -> str | None:
    """Why a request cannot use the cache (None if it can): its KV must follow from its token ids."""
    if getattr(request, "mm_features", None):
        return "multimodal inputs"
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings"
    if not getattr(request, "prompt_token_ids", None):
        return "no prompt token ids"
    return None
