"""Prefix reuse for Hugging Face transformers causal LMs.

::

    from kvcached_client import Client
    from kvcached_client.hf import layout_for, prefill, generate

    layout = layout_for(model, model_id="org/name@rev")
    with Client() as c:
        out = generate(c, model, layout, input_ids, max_new_tokens=32)   # greedy
        out.tokens, out.cached_tokens, out.ttft_seconds, out.cache_error

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

**Fail open.** The cache never fails a request. Any exception from the acquire or from reading
the lease (daemon absent or restarting, deadline, pool full, a pool that cannot be mapped, a bad
NVMe read, ...) means the prompt is computed from scratch, and the lease is released all the
same; any exception from the store means nothing is stored. A request whose acquire failed does
not try to store (the daemon just failed it; a second failing call would only add latency).
Each failure is counted in ``kvcached_client_fail_open_total{integration="hf",
op="acquire"|"store", reason}`` and logged once until the operation works again
(:mod:`kvcached_client.failopen`); ``cache_error`` on the result names the request's first one
(``None``: the cache worked, or was not asked). Errors of the caller's own making still raise:
an empty prompt, a layout whose geometry is not the model's (``ValueError``).

**Sliding-window attention** (Mistral's ``sliding_window``; Gemma-2/3, Cohere-2 and gpt-oss
``layer_types`` mixing ``"sliding_attention"`` with ``"full_attention"``; ``"chunked_attention"``)
is cached exactly. The model's own ``DynamicCache`` keeps only the last window of a sliding
layer, too little to store a prompt longer than the window, so the prefill runs on a cache
whose layers all keep every token. The window is still applied: transformers builds the mask
from the config's window and absolute positions (``get_mask_sizes`` of a full layer is offset
0), never by relying on the cache to drop keys. After the store that cache becomes the model's
own kind for decoding: each sliding layer is fed the whole prompt once and keeps its window,
exactly as a plain prefill leaves it. So a miss gives bit-identical logits at every step to
plain generation, and a hit differs only as any suffix-only prefill may (float rounding; it was
bit-identical too for Mistral, Qwen2, Gemma-2/3 and Cohere-2 in tests, 1.6e-7 for gpt-oss).
The cost: during the prefill the sliding layers hold the whole prompt, as full layers do.

**Models kvcached cannot hold** are served without it: recurrent and hybrid models (Mamba,
Jamba, Qwen3-Next, LFM2, ...: ``model._is_stateful``, or layer types without per-token KV),
models whose last layers reuse earlier layers' KV (Gemma-3n), and models whose cache does not
hold the layout's ``[kv_heads, tokens, head_dim]`` keys and values in every layer (e.g.
multi-head latent attention: found at the first store). Nothing is acquired or stored; it is
logged once per model class and said in ``cache_error`` ("unsupported: ..."); it is not counted
as a fail-open, since nothing failed.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvcached.contract.keys import KVLayout
from kvcached_client.failopen import FailOpen
from kvcached_client.policy import CachePolicy

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvcached_client")

#: Counts and logs the cache failures this integration served around (see the module docstring).
FAIL_OPEN = FailOpen("hf")

#: Layer types whose cache is per-token keys and values, transformers' ``DynamicLayer`` or
#: ``DynamicSlidingWindowLayer`` (sliding and chunked differ in the mask only).
_KV_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
_WINDOWED = frozenset({"sliding_attention", "chunked_attention"})


def _text_config(model: Any) -> Any:
    return model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config


def layout_for(model: Any, *, model_id: str | None = None, chunk_tokens: int = 128, lora: tuple[str, str] = ("", "")) -> KVLayout:
    """The KV layout of a transformers model, from its config and dtype.

    ``model_id`` should pin the weights ("org/name@revision"); by default the config's
    ``name_or_path`` plus its commit hash when transformers recorded one. Two models that
    share a layout id share cache entries, so never reuse an id across different weights.

    Never fails for a transformers model: for one kvcached cannot hold (a recurrent model has
    no attention heads) the layout is nominal, and :func:`prefill` serves it without the cache.
    """
    cfg = _text_config(model)
    heads = getattr(cfg, "num_attention_heads", None) or 1
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or getattr(cfg, "hidden_size", 0) // heads or 1
    if model_id is None:
        name = getattr(cfg, "name_or_path", "") or getattr(model.config, "_name_or_path", "") or cfg.model_type
        rev = getattr(model.config, "_commit_hash", None)
        model_id = f"{name}@{rev}" if rev else name
    return KVLayout(
        model=model_id,
        num_layers=getattr(cfg, "num_hidden_layers", None) or 1,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=str(model.dtype).removeprefix("torch."),
        chunk_tokens=chunk_tokens,
        lora_name=lora[0],
        lora_version=lora[1],
        extra=(("architecture", cfg.model_type),),
        vocab_size=getattr(cfg, "vocab_size", None) or 0,
    )


@dataclass(frozen=True)
class _Support:
    unsupported: str | None  # why kvcached cannot hold this model's KV; None: it can
    windowed: bool = False  # some layers keep a window only: prefill on full layers, then trim


_support_of: "weakref.WeakKeyDictionary[Any, _Support]" = weakref.WeakKeyDictionary()
_unsupported_logged: set[tuple[str, str]] = set()
_lock = threading.Lock()


def _layer_types(cfg: Any) -> list[str]:
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:  # older transformers: the same inference, by hand
        types = getattr(cfg, "layer_types", None)
        if types is None:
            sliding = getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True)
            types = ["sliding_attention" if sliding else "full_attention"] * cfg.num_hidden_layers
        return list(types)
    return list(get_layer_types_and_kwargs(cfg)[0])


def _support(model: Any) -> _Support:
    """What kvcached can do for ``model`` (worked out once per model object: ~1 ms for 32 layers)."""
    s = _support_of.get(model)
    if s is None:
        s = _support_of[model] = _work_out_support(model)
    return s


def _work_out_support(model: Any) -> _Support:
    if getattr(model, "_is_stateful", False):
        return _Support("a recurrent or hybrid model (its cache holds recurrent state, not per-token KV)")
    cfg = _text_config(model)
    try:
        types = _layer_types(cfg)
    except Exception as e:  # an exotic config: serve it, without the cache
        return _Support(f"its layer types cannot be read ({type(e).__name__}: {e})")
    other = sorted(set(types) - _KV_LAYER_TYPES)
    if other:
        return _Support(f"layers of type {', '.join(other)} keep no per-token KV")
    layers = getattr(cfg, "num_hidden_layers", None) or len(types)
    if len(types) != layers:  # e.g. Gemma-3n: the last layers reuse earlier layers' KV
        return _Support(f"{layers - len(types)} of its {layers} layers share another layer's KV")
    return _Support(None, windowed=any(t in _WINDOWED for t in types))


def _mark_unsupported(model: Any, reason: str) -> None:
    _support_of[model] = _Support(reason)


def _log_unsupported(model: Any, reason: str) -> str:
    key = (type(model).__name__, reason)
    with _lock:
        first = key not in _unsupported_logged
        _unsupported_logged.add(key)
    if first:
        log.warning("kvcached hf: %s is served without the cache: %s (logged once)", key[0], reason)
    return f"unsupported: {reason}"


def _check_layout(model: Any, layout: KVLayout) -> None:
    """A layout of another geometry than the model's is the caller's mistake: cached KV of that
    shape would break the forward pass, so say so instead of failing open."""
    want = layout_for(model, model_id=layout.model, chunk_tokens=layout.chunk_tokens)
    got = (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype)
    exp = (want.num_layers, want.num_kv_heads, want.head_dim, want.dtype)
    if got != exp:
        raise ValueError(f"layout {layout.model!r} has (layers, kv_heads, head_dim, dtype) {got}, the model {exp}; "
                         "make it with layout_for(model)")


def _cache_geometry_error(cache: Any, layout: KVLayout, n_tokens: int) -> str | None:
    """Why ``cache`` cannot give the layout's KV for ``n_tokens`` tokens; None if it can."""
    layers = getattr(cache, "layers", None)
    if layers is None or len(layers) != layout.num_layers:
        return f"its cache has {len(layers) if layers is not None else 'no'} KV layers, the layout {layout.num_layers}"
    want = (1, layout.num_kv_heads, layout.head_dim)
    for i, layer in enumerate(layers):
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        if k is None or v is None or k.dim() != 4:
            return f"layer {i} keeps no [batch, kv_heads, tokens, head_dim] keys and values"
        if v.shape != k.shape:  # e.g. multi-head latent attention
            return f"layer {i} keeps keys {tuple(k.shape)} and values {tuple(v.shape)} of different shapes"
        if (k.shape[0], k.shape[1], k.shape[3]) != want:
            return f"layer {i} keeps keys of shape {tuple(k.shape)}, the layout [1, {want[1]}, tokens, {want[2]}]"
        if k.shape[2] < n_tokens:
            return f"layer {i} keeps {k.shape[2]} of the prompt's {n_tokens} tokens"
    return None


@dataclass
class PrefillResult:
    logits: "torch.Tensor"  # [vocab] logits for the next token
    past_key_values: Any  # the model's own kind of DynamicCache, after the whole prompt
    cached_tokens: int  # prompt tokens whose KV came from kvcached
    stored_chunks: int  # new chunks handed to kvcached
    ttft_seconds: float  # acquire + suffix prefill (+ nothing else): time to the first token's logits
    store_seconds: float = 0.0
    cache_seconds: float = 0.0  # of ttft: acquire + copying the cached KV into the model's cache
    #: Why the cache did not serve this request fully: the first failure ("acquire: UNAVAILABLE:
    #: ..."), or "unsupported: ..." for a model kvcached cannot hold. None: no cache problem.
    cache_error: str | None = None


@dataclass
class GenerateResult:
    tokens: list[int]
    prefill: PrefillResult
    ttft_seconds: float
    total_seconds: float
    step_logits: list["torch.Tensor"] = field(default_factory=list)

    @property
    def cached_tokens(self) -> int:
        return self.prefill.cached_tokens

    @property
    def cache_error(self) -> str | None:
        return self.prefill.cache_error


_CACHE_NAMES = ("cache", "past_key_values", "cache_params")


@functools.lru_cache(maxsize=None)
def _cache_arg(forward: Any) -> str:
    params = inspect.signature(forward).parameters
    return next((a for a in _CACHE_NAMES if a in params), "past_key_values")


def _forward(model: Any, ids: "torch.Tensor", cache: Any) -> tuple["torch.Tensor", Any]:
    """One forward pass with a KV cache; returns (last-position logits, the updated cache).

    transformers renamed ``past_key_values`` to ``cache`` (argument and output) in 5.x, and
    recurrent models call it ``cache_params``; this speaks whichever the model uses.
    """
    out = model(input_ids=ids, use_cache=True, **{_cache_arg(type(model).forward): cache})
    new_cache = next((out[k] for k in _CACHE_NAMES if k in out), None)
    return out.logits[0, -1], new_cache


def _layers_from_cache(cache: Any, n_tokens: int) -> "list[tuple[torch.Tensor, torch.Tensor]]":
    """Per layer, (keys, values) [kv_heads, n_tokens, head_dim] of a DynamicCache (batch 0):
    views, no copy (``CacheRequest.write`` copies them into the pool layer by layer)."""
    return [(layer.keys[0, :, :n_tokens], layer.values[0, :, :n_tokens]) for layer in cache.layers]


def _kv_from_cache(cache: Any, n_tokens: int) -> "torch.Tensor":
    """[2, layers, kv_heads, n_tokens, head_dim] from a DynamicCache (batch 0): a copy."""
    import torch

    return torch.stack([torch.stack(pair) for pair in _layers_from_cache(cache, n_tokens)], dim=1)


def _full_cache() -> Any:
    """An empty DynamicCache whose every layer keeps every token (built without the model's
    config, which would make sliding layers drop all but their window)."""
    from transformers import DynamicCache

    return DynamicCache()


def _as_model_cache(model: Any, full: Any) -> Any:
    """``full`` (every layer keeps every token) as the cache the model itself would have after
    the same prefill: its sliding layers fed the whole prompt once, so they keep their window
    exactly as a plain prefill leaves them; its full layers are taken over as they are."""
    from transformers import DynamicCache
    from transformers.cache_utils import CacheLayerMixin

    own = DynamicCache(config=model.config)
    for i, (layer, src) in enumerate(zip(own.layers, full.layers)):
        # (a linear-attention layer has no K and V, and is never sliding)
        if isinstance(layer, CacheLayerMixin) and getattr(layer, "is_sliding", False):
            layer.update(src.keys, src.values)
        else:
            own.layers[i] = src
    return own


def _read_prefix(req: Any, n: int, device: Any) -> tuple[int, Any]:
    """(tokens reused, a full cache holding them or None) from a request's lease.

    One copy, straight from the pool into the cache's own tensors (a copy: the lease may end
    now): the buffer is laid out layer by layer, so layer ``i``'s keys and values are views of
    it, with no further copy to make them per layer. (Before, ``lease.kv()``, a per-layer
    ``contiguous()`` and ``DynamicCache(data)``'s concatenation copied the prefix three times:
    hf_path.py times that read beside this one.)"""
    used = min(req.matched_tokens, n - 1)
    if used <= 0:
        return 0, None
    import torch

    from kvcached.contract.kv import torch_dtype

    lay, lease = req.lease.layout, req.lease
    whole = -(-used // lay.chunk_tokens)  # the chunks that hold the used tokens
    buf = torch.empty((lay.num_layers, 2, 1, lay.num_kv_heads, whole * lay.chunk_tokens, lay.head_dim),
                      dtype=torch_dtype(lay.dtype), device=device)
    lease.copy_into(buf.select(2, 0).transpose(0, 1))  # as [2, layers, kv_heads, tokens, head_dim]
    return used, _full_cache_of(buf[..., :used, :])


def _full_cache_of(layers: "torch.Tensor") -> Any:
    """A full cache (as :func:`_full_cache`) over ``layers`` [layers, 2, 1, kv_heads, tokens,
    head_dim]: each layer's keys and values are views of it, not copies.

    ``DynamicCache(data)`` would copy every layer (its layers' ``update`` concatenates onto an
    empty tensor); each layer is initialised with no tokens instead, then handed the views (the
    ``keys`` / ``values`` attributes every transformers cache layer has). The forward pass's own
    ``update`` then concatenates the new tokens onto them, as it would onto any cache."""
    cache = _full_cache()
    for i, layer in enumerate(layers.unbind(0)):
        k, v = layer[0], layer[1]
        cache.update(k[..., :0, :], v[..., :0, :], i)
        cache.layers[i].keys, cache.layers[i].values = k, v
    return cache


def _finish_quietly(req: Any) -> None:
    """Give back what a failed request holds, without raising (its session ending would too)."""
    try:
        req.finish(commit=False)
    except Exception as e:  # pragma: no cover - the daemon is already failing; it cleans up by TTL
        log.debug("giving back a failed request's lease: %s", e)


def _failed(op: str, error: BaseException) -> str:
    return f"{op}: {FAIL_OPEN.failed(op, error)}: {error}"


def prefill(
    client: Any,
    model: Any,
    layout: KVLayout,
    input_ids: "torch.Tensor",
    *,
    policy: CachePolicy = CachePolicy(),
) -> PrefillResult:
    """Run the prompt through ``model`` reusing cached KV; see the module docstring.

    Never raises for a cache problem (``cache_error`` says what went wrong)."""
    import torch

    ids = input_ids.reshape(-1)
    n = ids.numel()
    if n == 0:
        raise ValueError("empty prompt")
    device = next(model.parameters()).device
    support = _support(model)
    if support.unsupported is not None:
        t0 = time.perf_counter()
        with torch.no_grad():
            logits, cache = _forward(model, ids.unsqueeze(0).to(device), None)
        return PrefillResult(logits, cache, 0, 0, time.perf_counter() - t0,
                             cache_error=_log_unsupported(model, support.unsupported))
    _check_layout(model, layout)
    tokens = ids.tolist()
    error: str | None = None
    t0 = time.perf_counter()
    cache, used = None, 0
    full = n // layout.chunk_tokens * layout.chunk_tokens
    store = policy.should_store(n) and full > 0
    req = None
    if policy.read or store:
        # Round trip 1: pin the cached prefix and reserve room for the chunks this prefill computes.
        try:
            req = client.acquire_reserve(layout, tokens, no_cache=not policy.read, no_store=not store)
            used, cache = _read_prefix(req, n, device)
        except Exception as e:  # fail open: compute the whole prompt
            # A store-only request's one call is its store: name the failure after what it was for.
            error, used, cache = _failed("acquire" if policy.read else "store", e), 0, None
            if req is not None:
                _finish_quietly(req)
                req = None
        else:
            FAIL_OPEN.ok("acquire" if policy.read else "store")
    if cache is None:
        cache = _full_cache()
    cache_s = time.perf_counter() - t0
    try:
        with torch.no_grad():
            logits, cache = _forward(model, ids[used:].unsqueeze(0).to(device), cache)
    except BaseException:
        if req is not None:
            _finish_quietly(req)
        raise
    ttft = time.perf_counter() - t0
    stored = 0
    t1 = time.perf_counter()
    if req is not None:
        why = _cache_geometry_error(cache, layout, n) if store else None
        if why is not None:  # the model's KV is not the layout's: nothing of it can be cached
            _mark_unsupported(model, why)
            error = _log_unsupported(model, why)
            _finish_quietly(req)
        else:
            # Round trip 2 (none when nothing was reserved): commit what was computed and release.
            try:
                if req.reservation.slots:
                    req.write(_layers_from_cache(cache, full))  # straight from the cache's layers
                stored = req.finish().stored_chunks
                if req.reservation.not_reserved_tokens and req.reservation.slots:  # more than the free pool: stream the rest
                    stored += client.put(layout, tokens[:full], _kv_from_cache(cache, full)).stored_chunks
            except Exception as e:  # fail open: the request is served, just not stored
                error = _failed("store", e)
                _finish_quietly(req)
            else:
                FAIL_OPEN.ok("store")
    store_s = time.perf_counter() - t1
    if support.windowed:
        cache = _as_model_cache(model, cache)
    return PrefillResult(logits, cache, used, stored, ttft, store_s, cache_s, error)


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
    """Greedy (default) or sampled generation on top of :func:`prefill` (which fails open)."""
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
