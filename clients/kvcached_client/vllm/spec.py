"""What the connector supports, and the :class:`KVLayout` of a vLLM engine.

Decided once, when the engine starts, so that an unsupported model is refused with a clear
message at start instead of failing requests later. Two steps, so that the README's support
table is made by the same code that decides at start (``python -m kvcached_client.vllm.spec``
prints it; a test checks the README against it):

1. :func:`describe` reduces vLLM's configuration to an :class:`EngineShape`: plain facts (the
   KV-cache groups and their kind, the KV dtype and quantisation, the parallelism);
2. :func:`refusal` says why a shape cannot be served exactly, or None.

What is served, and how a chunk holds it (``[2, layers, kv_heads, chunk_tokens, head_dim]``):

* **Full attention** (Llama, Qwen, Mistral without a window, ...): every layer's K and V.
* **Sliding-window attention, alone or interleaved with full attention** (Mistral with a
  window, Gemma-2/3, gpt-oss: vLLM's hybrid allocator with one KV-cache group per kind):
  windowed layers are stored like full ones, every token of the chunk, so a hit at any chunk
  boundary has the window before it. vLLM frees a windowed layer's blocks once they leave the
  window, possibly before a chunk is whole (chunked prefill), so such engines copy each step's
  computed blocks out as the step computes them (:mod:`~kvcached_client.vllm.worker`), not the
  chunk once whole. A hit loads only the blocks vLLM allocated for the window (it gives the
  rest as its null block).
* **MLA** (DeepSeek-V2/V3): the latent cache (``kv_lora_rank + rope`` channels per token and
  layer, one "head") is kept as K = its first half of channels, V = its second half. The latent
  is the same on every tensor-parallel rank, so all ranks share one layout and the chunks are
  stored once per model, by whichever rank's reservation gets them.
* **fp8 KV caches** with per-tensor scales (``--kv-cache-dtype fp8``, ``fp8_e4m3``,
  ``fp8_e5m2``): the engine's bytes, as they are. The scales come from the checkpoint, so the
  weights' identity (``model@revision``) covers them; the KV dtype is part of the layout, so an
  fp8 engine never reads a bf16 engine's chunks nor the reverse. Dynamic scales
  (``calculate_kv_scales``) change per run and are refused.

Refused (with the reason in :func:`refusal`): state-space and linear-attention layers,
chunked-local attention, per-token-head and packed quantised KV, quantised MLA, encoder-decoder
models, pipeline and context parallelism.

Per request, requests that kvcached cannot key by token ids alone (multimodal inputs,
prompt embeddings) are served without the cache: :func:`request_cacheable`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcached.contract.keys import KVLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from kvcached_client.vllm.protocols import VllmLoRARequest, VllmRequest

#: kvcached's default chunk: 128 tokens, rounded up to a whole number of vLLM blocks.
DEFAULT_CHUNK_TOKENS = 128

#: KV-cache group kinds the connector stores (see the module docstring).
ATTENTION_KINDS = ("full", "sliding", "mla")
#: KV dtypes stored as the engine's bytes (per-tensor scales, from the checkpoint).
FP8_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")


class UnsupportedEngineError(ValueError):
    """The engine's model or configuration cannot be served by the connector (raised at start)."""


@dataclass(frozen=True)
class GroupShape:
    """One of vLLM's KV-cache groups (layers that share a block table), as plain facts."""

    kind: str  # full | sliding | mla | chunked_local | mamba | cross | encoder_only | <spec class name>
    layer_names: tuple[str, ...] = ()
    num_kv_heads: int = 0
    head_size: int = 0
    head_size_v: int = 0
    block_size: int = 0
    window: int = 0  # sliding: tokens each position attends to
    quant: str = "NONE"  # vLLM's KVQuantMode name
    dtype: str = ""  # the cache tensor's dtype ("uint8" for fp8)


@dataclass(frozen=True)
class EngineShape:
    """What decides whether, and how, the connector serves an engine."""

    groups: tuple[GroupShape, ...]
    kv_cache_dtype: str = "auto"
    tp: int = 1
    pp: int = 1
    dcp: int = 1
    pcp: int = 1
    encoder_decoder: bool = False
    dynamic_kv_scales: bool = False

    @property
    def attention_groups(self) -> tuple[GroupShape, ...]:
        return tuple(g for g in self.groups if g.kind in ATTENTION_KINDS)

    @property
    def mla(self) -> bool:
        return any(g.kind == "mla" for g in self.groups)

    @property
    def window(self) -> int:
        """The smallest sliding window (0: none). Such layers lose blocks as the request advances:
        each step's blocks are stored as they are computed."""
        return min((g.window for g in self.groups if g.kind == "sliding"), default=0)

    @property
    def layer_names(self) -> tuple[str, ...]:
        """The chunk's layer order: every attention layer, by its index in the model."""
        return tuple(sorted((n for g in self.groups for n in g.layer_names), key=_layer_sort_key))


def _layer_sort_key(name: str) -> tuple[int, str]:
    digits = [int(p) for p in name.split(".") if p.isdigit()]
    return (digits[0] if digits else -1, name)


_STATE_REASON = ("{what} layers keep a recurrent state per request, not every token's K and V, which is what "
                 "a chunk holds; vLLM 0.32's CPU build cannot run them either (no selective_scan_fwd kernel: "
                 "Mamba and Jamba fail at their first forward), so nothing here verifies them")


def refusal(shape: EngineShape) -> str | None:
    """Why the connector cannot serve ``shape`` exactly, or None if it can."""
    if shape.pp > 1:
        return f"pipeline parallelism is not supported (pipeline_parallel_size={shape.pp})"
    if shape.dcp > 1 or shape.pcp > 1:
        return (f"context parallelism is not supported (decode_context_parallel_size={shape.dcp}, "
                f"prefill_context_parallel_size={shape.pcp}): its blocks interleave tokens across ranks")
    if shape.encoder_decoder:
        return "encoder-decoder models are not supported (their cross-attention KV depends on the encoder input)"
    if not shape.groups:
        return "the engine has no KV-cache groups"
    for g in shape.groups:
        if g.kind == "mamba":
            return _STATE_REASON.format(what="state-space (Mamba) and linear-attention")
        if g.kind == "chunked_local":
            return ("chunked-local attention (Llama-4 style) is not supported yet: its blocks are freed per "
                    "attention chunk, and no test engine verifies a layout for it")
        if g.kind not in ATTENTION_KINDS:
            return f"{g.kind} KV caches are not supported"
    if shape.mla and any(g.kind != "mla" for g in shape.groups):
        return "MLA layers mixed with other attention kinds are not supported"
    first = shape.groups[0]
    for g in shape.groups:
        if (g.num_kv_heads, g.head_size, g.block_size, g.dtype) != (first.num_kv_heads, first.head_size,
                                                                       first.block_size, first.dtype):
            return ("KV-cache groups with different KV heads, head sizes, block sizes or dtypes are not supported "
                    f"({first.num_kv_heads}x{first.head_size} vs {g.num_kv_heads}x{g.head_size})")
        if g.kind == "mla":
            if g.head_size % 2:
                return f"an MLA latent of odd width ({g.head_size}) is not supported"
        elif g.head_size_v != g.head_size:
            return "K and V of different head sizes are not supported"
        if g.quant != "NONE":
            if g.kind == "mla":
                return f"quantised MLA caches ({g.quant}) are not supported: their pages pack scales per backend"
            if g.quant != "FP8_PER_TENSOR":
                return (f"quantised KV caches with per-token or packed scales ({g.quant}, e.g. int8/fp8 per token-head, "
                        "TurboQuant, NVFP4) are not supported: the scales live in backend-specific page layouts")
    if shape.kv_cache_dtype not in ("auto", *FP8_DTYPES) and all(g.quant == "NONE" for g in shape.groups):
        return f"kv_cache_dtype={shape.kv_cache_dtype!r} is not supported"
    if shape.kv_cache_dtype in FP8_DTYPES and shape.dynamic_kv_scales:
        return ("fp8 KV with dynamic scales (calculate_kv_scales) is not supported: the scales, and so the bytes, "
                "change from run to run")
    return None


def _group_shape(group: "KVCacheGroupSpec") -> GroupShape:
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        ChunkedLocalAttentionSpec,
        CrossAttentionSpec,
        EncoderOnlyAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    spec = group.kv_cache_spec
    names = tuple(group.layer_names)
    if isinstance(spec, MambaSpec):
        return GroupShape("mamba", names)
    if not isinstance(spec, AttentionSpec):  # no K and V per head (HiSparse's page specs, ...): refused
        return GroupShape(type(spec).__name__, names)
    common: dict[str, Any] = dict(num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                                  head_size_v=getattr(spec, "head_size_v", spec.head_size), block_size=spec.block_size,
                                  quant=spec.kv_quant_mode.name, dtype=str(spec.dtype).removeprefix("torch."))
    if type(spec) is MLAAttentionSpec:
        return GroupShape("mla", names, **common)
    if type(spec) is SlidingWindowSpec:
        return GroupShape("sliding", names, window=spec.sliding_window, **common)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return GroupShape("chunked_local", names, **common)
    if isinstance(spec, CrossAttentionSpec):
        return GroupShape("cross", names, **common)
    if isinstance(spec, EncoderOnlyAttentionSpec):
        return GroupShape("encoder_only", names, **common)
    if type(spec) is FullAttentionSpec:
        if spec.sliding_window is not None:
            return GroupShape("sliding", names, window=spec.sliding_window, **common)
        if spec.attention_chunk_size is not None:
            return GroupShape("chunked_local", names, **common)
        return GroupShape("full", names, **common)
    return GroupShape(type(spec).__name__, names, **common)


def require_kv_cache_config(kv_cache_config: "KVCacheConfig | None") -> "KVCacheConfig":
    """``kv_cache_config`` itself; :class:`UnsupportedEngineError` if vLLM gave none."""
    if kv_cache_config is None:
        raise UnsupportedEngineError("kvcached connector: vLLM passed no KV-cache config (a vLLM older than 0.32?)")
    return kv_cache_config


def describe(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None") -> EngineShape:
    """The engine's :class:`EngineShape` (:class:`UnsupportedEngineError` if vLLM gave no KV config)."""
    kv_cache_config = require_kv_cache_config(kv_cache_config)
    pc = vllm_config.parallel_config
    cc = vllm_config.cache_config
    return EngineShape(
        groups=tuple(_group_shape(g) for g in kv_cache_config.kv_cache_groups),
        kv_cache_dtype=str(cc.cache_dtype),
        tp=pc.tensor_parallel_size,
        pp=pc.pipeline_parallel_size,
        dcp=getattr(pc, "decode_context_parallel_size", 1) or 1,
        pcp=getattr(pc, "prefill_context_parallel_size", 1) or 1,
        encoder_decoder=bool(vllm_config.model_config.is_encoder_decoder),
        dynamic_kv_scales=bool(getattr(cc, "calculate_kv_scales", False)),
    )


def check(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None") -> EngineShape:
    """The engine's shape if the connector serves it; :class:`UnsupportedEngineError` otherwise."""
    shape = describe(vllm_config, kv_cache_config)
    why = refusal(shape)
    if why:
        raise UnsupportedEngineError(f"kvcached connector: {vllm_config.model_config.model}: {why}; "
                                     "run it without the connector")
    return shape


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


def attention_label(shape: EngineShape) -> str:
    """The attention kinds, for the layout's identity: "" for plain full attention (the layouts
    of such engines are unchanged), else e.g. ``sliding64:2,full:2`` or ``mla``."""
    if shape.mla:
        return "mla"
    if all(g.kind == "full" for g in shape.groups):
        return ""
    return ",".join(f"{g.kind}{g.window or ''}:{len(g.layer_names)}" for g in shape.groups)


def engine_layouts(vllm_config: "VllmConfig", shape: EngineShape, chunk_tokens: int, *, model: str) -> tuple[KVLayout, ...]:
    """One layout per tensor-parallel rank (rank r stores its own KV heads under layout r; an
    MLA latent is the same on every rank, so all ranks share one layout).

    Everything that changes a chunk's bytes is in the layout: the weights, layers, KV heads per
    rank, head size, the cache dtype (and the KV quantisation), the attention kinds, the chunk
    size, the TP rank and size, and the engine (vLLM's kernels round differently from
    transformers', so the two never share chunks). LoRA is per request: :func:`with_lora`."""
    g = shape.attention_groups[0]
    hf = vllm_config.model_config.hf_text_config
    extra: list[tuple[str, str]] = [("architecture", getattr(hf, "model_type", "") or ""), ("engine", "vllm")]
    if shape.kv_cache_dtype != "auto":
        extra.append(("kv_cache_dtype", shape.kv_cache_dtype))
    label = attention_label(shape)
    if label:
        extra.append(("attention", label))
    heads, head_dim = (1, g.head_size // 2) if shape.mla else (g.num_kv_heads, g.head_size)
    return tuple(
        KVLayout(
            model=model,
            num_layers=len(shape.layer_names),
            num_kv_heads=heads,
            head_dim=head_dim,
            dtype=g.dtype,
            chunk_tokens=chunk_tokens,
            extra=(*extra, ("tp", f"replicated/{shape.tp}" if shape.mla else f"{r}/{shape.tp}")),
            vocab_size=getattr(hf, "vocab_size", 0) or 0,
        )
        for r in range(shape.tp)
    )


def with_lora(layout: KVLayout, lora_request: "VllmLoRARequest | None") -> KVLayout:
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


def request_cacheable(request: "VllmRequest") -> str | None:
    """Why a request cannot use the cache (None if it can): its KV must follow from its token ids."""
    if getattr(request, "mm_features", None):
        return "multimodal inputs"
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings"
    if not getattr(request, "prompt_token_ids", None):
        return "no prompt token ids"
    return None


# -- the README's support table (python -m kvcached_client.vllm.spec) ---------------------------

def _attn(kind: str, n: int = 2, *, window: int = 0, heads: int = 8, head: int = 128, quant: str = "NONE",
          dtype: str = "bfloat16") -> GroupShape:
    if kind == "mla":
        heads, head = 1, 576
    return GroupShape(kind, tuple(f"model.layers.{i}.attn" for i in range(n)), heads, head,
                      0 if kind == "mla" else head, 16, window, quant, dtype)


_FULL, _SLIDING = _attn("full"), _attn("sliding", window=4096)
_FP8 = dataclasses.replace(_FULL, quant="FP8_PER_TENSOR", dtype="uint8")

#: (model family, attention, KV dtype, TP, the engine's shape as describe() makes it)
SUPPORT_ROWS: tuple[tuple[str, str, str, str, EngineShape], ...] = (
    ("Llama-3, Qwen2.5/3, Mistral (no window), Phi-3", "full", "auto (bf16/fp16/fp32)", "1",
     EngineShape((_FULL,))),
    ("Llama-3, Qwen2.5/3, Mistral (no window), Phi-3", "full", "auto", "2-8",
     EngineShape((_FULL,), tp=4)),
    ("any full or sliding-window model", "full / sliding", "fp8, fp8_e4m3, fp8_e5m2", "any",
     EngineShape((_FP8,), kv_cache_dtype="fp8")),
    ("any, with calculate_kv_scales", "any", "fp8 (dynamic scales)", "any",
     EngineShape((_FP8,), kv_cache_dtype="fp8", dynamic_kv_scales=True)),
    ("any", "any", "int8/fp8 per token-head, int4, TurboQuant, NVFP4", "any",
     EngineShape((dataclasses.replace(_FULL, quant="INT8_PER_TOKEN_HEAD", dtype="int8"),), kv_cache_dtype="int8_per_token_head")),
    ("Mistral-7B-v0.1 (window 4096)", "sliding", "auto", "any",
     EngineShape((_SLIDING,))),
    ("Gemma-2, Gemma-3, gpt-oss", "sliding + full (hybrid allocator)", "auto", "any",
     EngineShape((_SLIDING, _FULL))),
    ("Llama-4", "chunked-local + full", "auto", "any",
     EngineShape((_attn("chunked_local"), _FULL))),
    ("DeepSeek-V2/V3/R1, Kimi-K2", "MLA", "auto", "1",
     EngineShape((_attn("mla"),))),
    ("DeepSeek-V2/V3/R1, Kimi-K2", "MLA", "auto", "2-8",
     EngineShape((_attn("mla"),), tp=8)),
    ("DeepSeek-V3/R1", "MLA", "fp8", "any",
     EngineShape((_attn("mla", quant="FP8_PER_TENSOR", dtype="uint8"),), kv_cache_dtype="fp8")),
    ("Mamba, Jamba, Qwen3-Next, Granite-4.0-H", "state-space / linear + full", "any", "any",
     EngineShape((GroupShape("mamba"), _FULL))),
    ("Whisper, BART, T5", "encoder-decoder", "any", "any",
     EngineShape((_FULL,), encoder_decoder=True)),
    ("any", "any", "any", "pipeline or context parallel", EngineShape((_FULL,), pp=2)),
)


def support_table() -> str:
    """The README's support table, from :func:`refusal` on each row's shape."""
    lines = ["| model family | attention | KV dtype | TP | kvcached |", "| --- | --- | --- | --- | --- |"]
    for family, attention, dtype, tp, shape in SUPPORT_ROWS:
        why = refusal(shape)
        verdict = "supported" if why is None else f"refused at start: {why}"
        lines.append(f"| {family} | {attention} | {dtype} | {tp} | {verdict} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    argparse.ArgumentParser(description="Print the vLLM connector's support table (Markdown).").parse_args()
    print(support_table(), end="")


if __name__ == "__main__":
    main()
