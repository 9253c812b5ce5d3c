"""Prefix reuse for Hugging Face transformers causal LMs.

::

    from kvcached_client import Client
    from kvcached_client.hf import layout_for, prefill, generate

    layout = layout_for(model, model_id="org/name@rev")
    with Client() as c:
        out = generate(c, model, layout, input_ids, max_new_tokens=32)   # greedy
        out.tokens, out.cached_tokens, out.ttft_seconds

What :func:`prefill` does for a prompt of T tokens:

1. acquire the cached prefix (whole chunks) from the daemon;
2. copy at most T-1 of those tokens' KV into a ``DynamicCache`` (one token is always
   computed, because the model must produce the next-token logits), then release the lease;
3. run the model on the uncached suffix only;
4. store the prompt's new full chunks (unless ``no_store``), straight from the cache the
   model just filled.

The KV cached by transformers is post-RoPE, per KV head (grouped-query attention keeps
``num_key_value_heads`` heads), which is exactly what a chunk holds: reuse is only valid at
the same absolute positions, and chained chunk hashes guarantee that (a chunk is found only
under its whole prefix).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvcached.keys import KVLayout
from kvcached_client.policy import CachePolicy

if TYPE_CHECKING:
    import torch


def layout_for(model: Any, *, model_id: str | None = None, chunk_tokens: int = 128, lora: tuple[str, str] = ("", "")) -> KVLayout:
    """The KV layout of a transformers model, from its config and dtype.

    ``model_id`` should pin the weights ("org/name@revision"); by default the config's
    ``name_or_path`` plus its commit hash when transformers recorded one. Two models that
    share a layout id share cache entries, so never reuse an id across different weights.
    """
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if model_id is None:
        name = getattr(cfg, "name_or_path", "") or getattr(model.config, "_name_or_path", "") or cfg.model_type
        rev = getattr(model.config, "_commit_hash", None)
        model_id = f"{name}@{rev}" if rev else name
    return KVLayout(
        model=model_id,
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=str(model.dtype).removeprefix("torch."),
        chunk_tokens=chunk_tokens,
        lora_name=lora[0],
        lora_version=lora[1],
        extra=(("architecture", cfg.model_type),),
        vocab_size=cfg.vocab_size,
    )


@dataclass
class PrefillResult:
    logits: "torch.Tensor"  # [vocab] logits for the next token
    past_key_values: Any  # the model's DynamicCache, covering the whole prompt
    cached_tokens: int  # prompt tokens whose KV came from kvcached
    stored_chunks: int  # new chunks handed to kvcached
    ttft_seconds: float  # acquire + suffix prefill (+ nothing else): time to the first token's logits
    store_seconds: float = 0.0
    cache_seconds: float = 0.0  # of ttft: acquire + copying the cached KV into the model's cache


@dataclass
class GenerateResult:
    tokens: list[int]
    prefill: PrefillResult
    ttft_seconds: float
    total_seconds: float
    step_logits: list["torch.Tensor"] = field(default_factory=list)


def _forward(model: Any, ids: "torch.Tensor", cache: Any) -> tuple["torch.Tensor", Any]:
    """One forward pass with a KV cache; returns (last-position logits, the updated cache).

    transformers renamed ``past_key_values`` to ``cache`` (argument and output) in 5.x;
    this speaks whichever the installed version uses.
    """
    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=ids, use_cache=True, **{arg: cache})
    new_cache = out["cache"] if "cache" in out else out["past_key_values"]
    return out.logits[0, -1], new_cache


def _kv_from_cache(cache: Any, n_tokens: int) -> "torch.Tensor":
    """[2, layers, kv_heads, n_tokens, head_dim] from a DynamicCache (batch 0)."""
    import torch

    layers = cache.layers
    return torch.stack([torch.stack([layer.keys[0, :, :n_tokens], layer.values[0, :, :n_tokens]]) for layer in layers], dim=1)


def _cache_from_kv(model: Any, kv: "torch.Tensor") -> Any:
    from transformers import DynamicCache

    pairs = [(kv[0, i].unsqueeze(0).contiguous(), kv[1, i].unsqueeze(0).contiguous()) for i in range(kv.shape[1])]
    return DynamicCache(pairs, config=model.config)


def prefill(
    client: Any,
    model: Any,
    layout: KVLayout,
    input_ids: "torch.Tensor",
    *,
    policy: CachePolicy = CachePolicy(),
) -> PrefillResult:
    """Run the prompt through ``model`` reusing cached KV; see the module docstring."""
    import torch

    ids = input_ids.reshape(-1)
    n = ids.numel()
    if n == 0:
        raise ValueError("empty prompt")
    tokens = ids.tolist()
    device = next(model.parameters()).device
    t0 = time.perf_counter()
    cache = None
    used = 0
    if policy.read:
        with client.acquire(layout, tokens) as lease:
            used = min(lease.matched_tokens, n - 1)
            if used > 0:
                kv = lease.kv()[:, :, :, :used].to(device)  # a copy: the lease ends right here
                cache = _cache_from_kv(model, kv)
    cache_s = time.perf_counter() - t0
    with torch.no_grad():
        logits, cache = _forward(model, ids[used:].unsqueeze(0).to(device), cache)
    ttft = time.perf_counter() - t0
    stored = 0
    t1 = time.perf_counter()
    full = n // layout.chunk_tokens * layout.chunk_tokens
    if policy.should_store(n) and full:
        stored = client.put(layout, tokens[:full], _kv_from_cache(cache, full)).stored_chunks
    return PrefillResult(logits, cache, used, stored, ttft, time.perf_counter() - t1, cache_s)


def generate(
    client: Any,
    model: Any,
    layout: KVLayout,
    input_ids: "torch.Tensor",
    *,
    max_new_tokens: int = 32,
    do_sample: bool = False,
    temperature: float = 1.0,
    generator: "torch.Generator | None" = None,
    policy: CachePolicy = CachePolicy(),
    keep_logits: bool = False,
) -> GenerateResult:
    """Greedy (default) or sampled generation on top of :func:`prefill`."""
    import torch

    t0 = time.perf_counter()
    pre = prefill(client, model, layout, input_ids, policy=policy.with_expected_output(max_new_tokens))
    device = next(model.parameters()).device
    logits, cache = pre.logits, pre.past_key_values
    out_tokens: list[int] = []
    kept: list[torch.Tensor] = []
    with torch.no_grad():
        for step in range(max_new_tokens):
            if keep_logits:
                kept.append(logits.detach().clone())
            if do_sample:
                probs = torch.softmax(logits.float() / max(temperature, 1e-6), dim=-1)
                nxt = int(torch.multinomial(probs, 1, generator=generator))
            else:
                nxt = int(torch.argmax(logits))
            out_tokens.append(nxt)
            if step + 1 == max_new_tokens:
                break
            logits, cache = _forward(model, torch.tensor([[nxt]], device=device), cache)
    return GenerateResult(out_tokens, pre, pre.ttft_seconds, time.perf_counter() - t0, kept)


def reference_generate(model: Any, input_ids: "torch.Tensor", max_new_tokens: int) -> tuple[list[int], "torch.Tensor"]:
    """Plain greedy generation without kvcached, for comparisons: (tokens, first logits)."""
    import torch

    device = next(model.parameters()).device
    with torch.no_grad():
        logits, cache = _forward(model, input_ids.reshape(1, -1).to(device), None)
        first = logits.clone()
        toks: list[int] = []
        for step in range(max_new_tokens):
            nxt = int(torch.argmax(logits))
            toks.append(nxt)
            if step + 1 == max_new_tokens:
                break
            logits, cache = _forward(model, torch.tensor([[nxt]], device=device), cache)
    return toks, first
