"""Question: what does the cache cost a request through the Hugging Face integration
(``kvcached_client.hf.prefill``) on a full hit and on a miss, next to one gRPC health check on the
same socket, and what did reading and writing per run of pool blocks (rather than per chunk) buy?

Setup: a real ``kvcached serve`` on a Unix socket (``bench.harness.daemon.Daemon``); a tiny random Llama
(2 layers, hidden 64, 4 heads, 2 KV heads, float32; built from a config, no download) and its
layout from ``layout_for`` with 32-token chunks; 2,048-token prompts, so 64 chunks each.

Contenders, interleaved round by round (order rotated), one sync ``Client``:

* ``health check``      ``grpc.health.v1.Health/Check`` on the daemon's socket (its own channel)
* ``hit``               ``prefill`` of the cached prompt: the cache's part of it, i.e. the acquire
                        (one AcquireReserve, a call on the client's session stream), reading the
                        2,047 reusable tokens' KV into the model's cache, and the finish (the
                        release goes on the stream too, unanswered); the suffix forward pass
                        (one token) is not counted
* ``hit, a copy per chunk`` the same with the lease read chunk by chunk (the client before
                        run reads), patched in for this row only
* ``hit, three copies`` the same with the prefix read as ``prefill`` read it before: ``lease.kv()``
                        (one tensor), a ``contiguous()`` copy per layer, and ``DynamicCache(data)``
                        (its layers concatenate onto empty tensors: a third copy); now the pool is
                        copied once, into the buffer whose views the cache's layers hold
* ``miss``              ``prefill`` of a fresh prompt: the cache's part, i.e. the acquire (nothing
                        cached, 64 chunks reserved) and the store (the KV taken from the model's
                        cache, written into the pool, one Commit on the stream); the forward pass
                        is not counted
* ``miss, a copy per chunk`` the same with the write copying chunk by chunk
* ``miss, stacked KV``  the same with the write as it was before it copied each layer's keys and
                        values straight from the model's cache: the layers stacked into one
                        [2, layers, kv_heads, tokens, head_dim] tensor first (a whole extra copy)
* ``hit, unary calls``, ``miss, unary calls``  the same with the client's calls made as unary RPCs,
                        as they were before they rode the session stream
* ``hit beside a busy thread`` and ``..., unary calls``: the hit while another thread of this
                        process runs pure Python without pause (the worst case of an engine's
                        scheduler thread beside the thread that calls kvcached): every handoff of
                        the GIL then waits for the switch interval (5 ms), and a call on the
                        stream has more of them (its reply crosses gRPC's thread and the
                        stream's reader thread) than a unary call

Then the write alone at a real model's size: the product's ``write_slots`` of one 2,048-token
prompt at Llama-3-8B's KV geometry (32 layers, 8 KV heads, head_dim 128, bfloat16: 256 MiB) from
per-layer (keys, values) views as a model's cache holds them, against stacking the layers into
one tensor first (what ``prefill`` did before), into a plain buffer standing in for the pool.

The cache's part is ``PrefillResult.cache_seconds + store_seconds``. Every hit must reuse 2,047
tokens and every miss store 64 chunks, else the run fails. Targets: hit <= 1.5x and miss <= 2.5x
the health check (p50).

Run:   .venv/bin/python bench/hf_path.py            (~5 min on a 2-core box)
       .venv/bin/python bench/hf_path.py --quick    (a few seconds; writes *.quick.json)
Output: bench/results/hf_path.json
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time
from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file: import bench

import numpy as np
from bench._common import bench_parser, finish, format_table, ratio, summarize_ns
from bench.harness.daemon import Daemon

PROMPT_TOKENS = 2048
CHUNK_TOKENS = 32
TARGET_HIT, TARGET_MISS = 1.5, 2.5
ROWS = ("health check", "hit", "hit, a copy per chunk", "hit, three copies", "hit, unary calls", "miss",
        "miss, a copy per chunk", "miss, stacked KV", "miss, unary calls", "hit beside a busy thread", "hit beside a busy thread, unary calls")


def tiny_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return LlamaForCausalLM(cfg).eval()


@contextmanager
def per_chunk_copies() -> Iterator[None]:
    """The client's reads and writes as they were before runs: a view and a copy per chunk."""
    from kvcached_client import _core

    real_copy_into, real_write = _core.LeaseBase.copy_into, _core.write_slots

    def copy_into(self, out, first=0):
        c = self.layout.chunk_tokens
        for i in range(first, min(len(self), first + out.shape[3] // c)):
            self.copy_chunk(i, out[:, :, :, (i - first) * c:(i - first + 1) * c])
        return out

    def write_slots(pool, layout, slots, kv):
        c = layout.chunk_tokens
        for s in slots:
            a, b = s.position * c, (s.position + 1) * c
            view = pool.view(layout, s.offset, s.nbytes)  # [2, layers, kv_heads, chunk_tokens, head_dim]
            if _core.is_tensor(kv):
                view.copy_(kv[:, :, :, a:b, :])
            else:  # per layer, (keys, values)
                for layer, pair in enumerate(kv):
                    for j, t in enumerate(pair):
                        view[j, layer].copy_(t[:, a:b])

    _core.LeaseBase.copy_into, _core.write_slots = copy_into, write_slots
    try:
        yield
    finally:
        _core.LeaseBase.copy_into, _core.write_slots = real_copy_into, real_write


@contextmanager
def stacked_kv() -> Iterator[None]:
    """``prefill``'s write as it was before it wrote each layer straight from the model's cache:
    the layers stacked into one tensor, then written."""
    import torch

    from kvcached_client import hf

    real = hf._layers_from_cache
    hf._layers_from_cache = lambda cache, n: torch.stack([torch.stack(p) for p in real(cache, n)], dim=1)
    try:
        yield
    finally:
        hf._layers_from_cache = real


@contextmanager
def unary_calls(client) -> Iterator[None]:
    """The client's calls as unary RPCs, as before they rode its session stream."""
    client.stream_calls = False
    try:
        yield
    finally:
        client.stream_calls = True


@contextmanager
def busy_thread(also: Callable[[], Any] | None = None) -> Iterator[None]:
    """Another thread of this process running pure Python without pause (and ``also`` entered)."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(2000))

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        if also is None:
            yield
        else:
            with also():
                yield
    finally:
        stop.set()
        t.join()


@contextmanager
def three_copies() -> Iterator[None]:
    """``prefill``'s read of a cached prefix as it was before it copied the pool once."""
    from transformers import DynamicCache

    from kvcached_client import hf

    def read_prefix(req, n, device):
        used = min(req.matched_tokens, n - 1)
        if used <= 0:
            return 0, None
        kv = req.lease.kv()[:, :, :, :used].to(device)
        return used, DynamicCache([(kv[0, i].unsqueeze(0).contiguous(), kv[1, i].unsqueeze(0).contiguous())
                                   for i in range(kv.shape[1])])

    real = hf._read_prefix
    hf._read_prefix = read_prefix
    try:
        yield
    finally:
        hf._read_prefix = real


#: A real model's geometry for the write alone: Llama-3-8B's KV (32 layers, 8 KV heads, head_dim
#: 128, bfloat16: 128 KiB per token), 128-token chunks.
BIG = dict(layers=32, kv_heads=8, head_dim=128, chunk_tokens=128)


class _BufferPool:
    """The client's pool mapping, as ``write_slots`` uses it, over one torch buffer (a stand-in
    for the mapped pool: the copy is the product's, the memory a plain allocation)."""

    def __init__(self, layout, chunks: int) -> None:
        import torch

        self.buf = torch.empty((chunks, *layout.chunk_shape), dtype=torch.bfloat16)
        self.chunk_bytes = layout.chunk_bytes

    def slab_bases(self) -> list[int]:
        return [0]

    def run_view(self, layout, offset: int, n: int):
        i = offset // self.chunk_bytes
        return self.buf[i:i + n]


def big_write(tokens: int, reps: int) -> dict:
    """``write_slots`` of one prompt's KV at Llama-3-8B's geometry: per layer straight from a
    model-cache-like list of (keys, values), against stacking the layers into one tensor first."""
    import torch

    from kvcached.contract.keys import KVLayout
    from kvcached_client import _core

    torch.manual_seed(0)
    lay = KVLayout(model="bench/llama-3-8b-geometry@1", num_layers=BIG["layers"], num_kv_heads=BIG["kv_heads"],
                   head_dim=BIG["head_dim"], dtype="bfloat16", chunk_tokens=BIG["chunk_tokens"])
    chunks = tokens // lay.chunk_tokens
    pool = _BufferPool(lay, chunks)
    slots = [_core.Location(i, i * lay.chunk_bytes, lay.chunk_bytes, b"") for i in range(chunks)]
    # As a DynamicCache holds them: per layer [1, kv_heads, tokens + 1, head_dim] (one decoded token more).
    cache = [(torch.randn(1, lay.num_kv_heads, tokens + 1, lay.head_dim, dtype=torch.bfloat16),
              torch.randn(1, lay.num_kv_heads, tokens + 1, lay.head_dim, dtype=torch.bfloat16))
             for _ in range(lay.num_layers)]

    def per_layer() -> None:
        _core.write_slots(pool, lay, slots, [(k[0, :, :tokens], v[0, :, :tokens]) for k, v in cache])

    def stacked() -> None:
        kv = torch.stack([torch.stack([k[0, :, :tokens], v[0, :, :tokens]]) for k, v in cache], dim=1)
        _core.write_slots(pool, lay, slots, kv)

    got: dict[str, list[int]] = {"per layer": [], "stacked first": []}
    for rep in range(reps + 1):  # rep 0 warms up
        for name, fn in sorted(got.items(), reverse=bool(rep % 2)):
            t0 = time.perf_counter_ns()
            (per_layer if name == "per layer" else stacked)()
            if rep:
                got[name].append(time.perf_counter_ns() - t0)
    per_layer()
    want = torch.stack([torch.stack([k[0, :, :tokens], v[0, :, :tokens]]) for k, v in cache], dim=1)
    ok = torch.equal(pool.buf.permute(1, 2, 3, 0, 4, 5).reshape(want.shape), want)
    if not ok:
        raise RuntimeError("the per-layer write did not store the prompt's KV")
    lat = {k: summarize_ns(v) for k, v in got.items()}
    return {"geometry": dict(BIG, dtype="bfloat16", tokens=tokens, kv_bytes=tokens * lay.chunk_bytes // lay.chunk_tokens),
            "reps": reps, "latency": lat,
            "per_layer_over_stacked_p50": ratio(lat["per layer"]["p50_us"], lat["stacked first"]["p50_us"])}


def run(args: argparse.Namespace) -> dict:
    import grpc
    import torch
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvcached_client import Client
    from kvcached_client.hf import layout_for, prefill

    torch.set_num_threads(1)
    model = tiny_model()
    layout = layout_for(model, model_id="bench/hf-path-tiny-llama@1", chunk_tokens=CHUNK_TOKENS)
    rng = np.random.default_rng(args.seed)
    hit_prompt = torch.tensor(rng.integers(0, 1000, PROMPT_TOKENS))
    chunks = PROMPT_TOKENS // CHUNK_TOKENS
    misses_per_round = args.per_round
    # Room for every miss of the run, so no miss evicts (and write-back never runs).
    total_misses = 2 * (args.rounds + 1) * misses_per_round + 1
    pool = -(-int(total_misses * chunks * layout.chunk_bytes / 0.8) // (1 << 20)) << 20
    samples: dict[str, list[int]] = {r: [] for r in ROWS}
    with Daemon.temp({"pool_bytes": pool}, prefix="kvc-bench-hf-") as d, Client(d.socket) as c:
        channel = grpc.insecure_channel(f"unix://{d.socket}")
        health = health_pb2_grpc.HealthStub(channel)
        check = health_pb2.HealthCheckRequest(service="")
        c.warm_up()
        c.register(layout)
        first = prefill(c, model, layout, hit_prompt)
        assert first.stored_chunks == chunks, first

        def cache_part(prompt, want_cached: int, want_stored: int) -> int:
            r = prefill(c, model, layout, prompt)
            if r.cached_tokens != want_cached or r.stored_chunks != want_stored or r.cache_error:
                raise RuntimeError(f"cached {r.cached_tokens} (want {want_cached}), stored {r.stored_chunks} "
                                   f"(want {want_stored}), error {r.cache_error}")
            return int((r.cache_seconds + r.store_seconds) * 1e9)

        def health_check() -> int:
            t0 = time.perf_counter_ns()
            assert health.Check(check, timeout=10).status == health_pb2.HealthCheckResponse.SERVING
            return time.perf_counter_ns() - t0

        def fresh() -> "torch.Tensor":
            return torch.tensor(rng.integers(0, 1000, PROMPT_TOKENS))

        ops: dict[str, Callable[[], int]] = {
            "health check": health_check,
            "hit": lambda: cache_part(hit_prompt, PROMPT_TOKENS - 1, 0),
            "miss": lambda: cache_part(fresh(), 0, chunks),
        }
        unary = partial(unary_calls, c)
        patched = {"hit, a copy per chunk": ("hit", per_chunk_copies), "miss, a copy per chunk": ("miss", per_chunk_copies),
                   "miss, stacked KV": ("miss", stacked_kv),
                   "hit, three copies": ("hit", three_copies), "hit, unary calls": ("hit", unary),
                   "miss, unary calls": ("miss", unary), "hit beside a busy thread": ("hit", busy_thread),
                   "hit beside a busy thread, unary calls": ("hit", partial(busy_thread, unary))}
        for rnd in range(args.rounds + 1):  # round 0 warms up
            order = list(ROWS[rnd % len(ROWS):] + ROWS[:rnd % len(ROWS)])
            for name in order:
                op = ops[patched[name][0] if name in patched else name]
                got: list[int] = []
                gc.collect()
                gc.disable()
                try:
                    if name in patched:
                        with patched[name][1]():
                            got = [op() for _ in range(misses_per_round)]
                    else:
                        got = [op() for _ in range(misses_per_round)]
                finally:
                    gc.enable()
                if rnd:
                    samples[name].extend(got)
        c.sync()
        stats = c.stats()
        channel.close()
    lat = {k: summarize_ns(v) for k, v in samples.items()}
    hc = lat["health check"]["p50_us"]
    ratios = {k: ratio(v["p50_us"], hc) for k, v in lat.items()}
    return {
        "question": " ".join(__doc__.strip().split("\n\n")[0].split()),
        "model": "random LlamaForCausalLM: 2 layers, hidden 64, 4 heads, 2 KV heads, float32",
        "layout": layout.to_dict(),
        "prompt_tokens": PROMPT_TOKENS,
        "prompt_chunks": chunks,
        "rounds": args.rounds,
        "samples_per_row": {k: len(v) for k, v in samples.items()},
        "latency": lat,
        "p50_over_health_check": ratios,
        "one_copy_over_three_copies_p50": ratio(lat["hit"]["p50_us"], lat["hit, three copies"]["p50_us"]),
        "per_layer_over_stacked_kv_p50": ratio(lat["miss"]["p50_us"], lat["miss, stacked KV"]["p50_us"]),
        "stream_over_unary_calls_p50": {k: ratio(lat[k]["p50_us"], lat[f"{k}, unary calls"]["p50_us"])
                                        for k in ("hit", "miss", "hit beside a busy thread")},
        "runs_over_per_chunk_p50": {"hit": ratio(lat["hit"]["p50_us"], lat["hit, a copy per chunk"]["p50_us"]),
                                    "miss": ratio(lat["miss"]["p50_us"], lat["miss, a copy per chunk"]["p50_us"])},
        "targets": {"hit_over_health_check_max": TARGET_HIT, "miss_over_health_check_max": TARGET_MISS},
        "hit_target_met": ratios["hit"] <= TARGET_HIT,
        "miss_target_met": ratios["miss"] <= TARGET_MISS,
        "daemon_counters": stats.get("counters"),
        "write_at_llama_3_8b_geometry": big_write(256 if args.quick else 2048, 2 if args.quick else 7),
    }


def print_report(res: dict) -> None:
    lat, r = res["latency"], res["p50_over_health_check"]
    print(f"\nthe cache's part of an HF prefill, {res['prompt_tokens']} tokens ({res['prompt_chunks']} chunks), "
          f"{res['samples_per_row']['hit']} samples each:")
    print(format_table(["row", "p50 us", "p90 us", "p99 us", "p50 / health check"],
                       [[k, v["p50_us"], v["p90_us"], v["p99_us"], r[k]] for k, v in lat.items()]))
    rp = res["runs_over_per_chunk_p50"]
    su = res["stream_over_unary_calls_p50"]
    print(f"\nper run / per chunk (p50): hit {rp['hit']:.2f}x, miss {rp['miss']:.2f}x; "
          f"hit, one copy / three copies: {res['one_copy_over_three_copies_p50']:.2f}x; "
          f"miss, written per layer / stacked first: {res['per_layer_over_stacked_kv_p50']:.2f}x; "
          f"calls on the session stream / unary: hit {su['hit']:.2f}x, miss {su['miss']:.2f}x, "
          f"hit beside a busy thread {su['hit beside a busy thread']:.2f}x")
    big = res["write_at_llama_3_8b_geometry"]
    g, bl = big["geometry"], big["latency"]
    print(f"\nthe write alone at Llama-3-8B's KV geometry ({g['tokens']} tokens, {g['kv_bytes'] >> 20} MiB), p50: "
          f"per layer {bl['per layer']['p50_us'] / 1e3:.1f} ms, stacked first {bl['stacked first']['p50_us'] / 1e3:.1f} ms "
          f"({big['per_layer_over_stacked_p50']:.2f}x)")
    print(f"targets: hit <= {TARGET_HIT}x a health check: {r['hit']:.2f}x -> "
          f"{'MET' if res['hit_target_met'] else 'NOT MET'}; miss <= {TARGET_MISS}x: {r['miss']:.2f}x -> "
          f"{'MET' if res['miss_target_met'] else 'NOT MET'}")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, "few rounds (a few seconds)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 8; quick 1)")
    p.add_argument("--per-round", type=int, default=None, help="requests per row per round (default 25; quick 5)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 8)
    args.per_round = args.per_round or (5 if args.quick else 25)
    res = run(args)
    finish("hf_path", res, args, print_report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
