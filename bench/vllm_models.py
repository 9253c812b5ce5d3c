"""Question: on the attention kinds the vLLM connector now serves (full, sliding-window hybrids,
MLA), what time to first token does a hit give at 4k tokens, and how much more of a chat's later
turns hits when the answer's KV is stored too?

Part 1, ``ttft`` (one run, side by side per family): random-weight models written by
``kvcached_client.vllm.random_model.build`` (no download), 4 layers, hidden 512, intermediate
1536, vocab 4096, float32, on vLLM 0.32's CPU build: ``llama`` (full attention, 8 heads / 4 KV
heads), ``gemma3`` (windowed and global layers alternating, window 1024), ``mistral`` (every layer
windowed, window 1024), ``deepseek_v2`` (MLA, kv_lora_rank 512 + rope 64, the CPU MLA kernel's
size). Three engines per family, each its own process: ``plain`` (no connector), ``kvc`` (the
connector on a real daemon) and ``fresh`` (the connector, never sees a prompt before it is a hit).
Per repetition, a new 4096-token prompt: ``cold`` = plain computes it; ``miss`` = kvc computes and
stores it; ``hit`` = fresh loads it (TTFT = wall time of ``LLM.generate`` with ``max_tokens=1``).
The first tokens of cold, miss and hit are compared. Target: hit <= 0.2x cold.

Part 2, ``chat``: conversations of several turns on a small random Llama; turn t's prompt is turn
t-1's prompt, its answer (160 generated tokens) and a new 60-token question, after a 300-token
system prompt. Two engines side by side, each on its own daemon: ``answers`` (the default: a
finished request's answer chunks are stored) and ``prompts_only`` (``store_answers: false``).
Before every turn each engine's own prefix cache is reset, as when the turn lands on another
replica, so every cached token came through kvcached. Reported: the hit rate of turns >= 2
(cached prompt tokens / prompt tokens) for both, and the ratio. Target: >= 1.3x.

Run:   .venv/bin/python bench/vllm_models.py              (~10 min on a busy 2-core box)
       .venv/bin/python bench/vllm_models.py --families llama_fp8 --parts ttft
                                    (fp8 KV; needs AVX-512 or AMX; writes vllm_models.llama_fp8.json)
       .venv/bin/python bench/vllm_models.py --families llama_tp2,deepseek_v2_tp2 --parts ttft
                                    (tensor parallelism 2; writes vllm_models.llama_tp2+deepseek_v2_tp2.json)
       .venv/bin/python bench/vllm_models.py --quick      (smaller, 1k tokens, 1 rep: a smoke run)
Output: bench/results/vllm_models.json (``vllm_models.quick.json`` for --quick)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file: import bench

from bench._common import RESULTS_DIR
from bench.harness.daemon import Daemon
from bench.vllm_ttft import Engine, kv_transfer, worker_channel

FAMILIES = ("llama", "gemma3", "mistral", "deepseek_v2")
#: Variants, not in the default run: (the model family, engine settings). ``llama_fp8``: every
#: engine with an fp8 KV cache (vLLM's CPU build runs it only on a CPU with AVX-512 or AMX);
#: ``*_tp2``: every engine with tensor parallelism 2 (a worker process per rank).
VARIANTS = {"llama_fp8": ("llama", {"kv_cache_dtype": "fp8"}), "llama_tp2": ("llama", {"tp": 2}),
            "deepseek_v2_tp2": ("deepseek_v2", {"tp": 2})}


def worker_main(args: argparse.Namespace) -> int:
    """One vLLM engine; one JSON command a line on stdin, one JSON answer a line."""
    send = worker_channel()

    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        kw = {}
        if args.socket:
            kw["kv_transfer_config"] = kv_transfer(args.socket, **json.loads(args.extra))
        if "deepseek" in json.load(open(f"{args.model}/config.json")).get("model_type", ""):
            kw["attention_backend"] = "CPU_MLA"  # on a CPU with AMX vLLM picks AMX_MLA, which needs bf16 weights
        if args.kv_cache_dtype:
            kw["kv_cache_dtype"] = args.kv_cache_dtype
        if args.tp and args.tp > 1:  # as tests/vllm/engine_proc.py: one worker process per rank, unbound threads
            kw.update(tensor_parallel_size=args.tp, distributed_executor_backend="mp")
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        llm = LLM(model=args.model, dtype="float32", enforce_eager=True, max_model_len=args.max_model_len,
                  kv_cache_memory_bytes=args.kv_cache_bytes, enable_prefix_caching=True,
                  max_num_batched_tokens=args.max_batched_tokens, max_num_seqs=4, seed=0, **kw)
    except BaseException:  # noqa: BLE001 - reported to the driver, which raises
        send({"error": traceback.format_exc()})
        return 1
    send({"ready": True})
    engine = llm.llm_engine
    core = engine.engine_core.engine_core.scheduler
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            if cmd.get("reset"):
                assert llm.reset_prefix_cache(), "reset_prefix_cache refused"
            sp = SamplingParams(max_tokens=cmd["max_tokens"], temperature=0.0, ignore_eos=True)
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=cmd["prompt"])], sp, use_tqdm=False)[0]
            wall = time.perf_counter() - t0
            for _ in range(10_000):  # as `vllm serve` does: step while the connector stores an answer
                if not core.has_requests():
                    break
                engine.step()
            send({"wall_s": wall, "tokens": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens})
        except Exception:  # noqa: BLE001
            send({"error": traceback.format_exc()})
    return 0


def build(family: str, quick: bool, tmp: str) -> str:
    from kvcached_client.vllm.random_model import build as build_model

    hidden, layers = (256, 2) if quick else (512, 4)
    base = VARIANTS.get(family, (family, {}))[0]
    return build_model(os.path.join(tmp, family), family=base, layers=layers, hidden=hidden, heads=8, kv_heads=4,
                       vocab=4096, intermediate=3 * hidden, window=256 if quick else 1024, max_positions=8192)


def prompt(n: int, seed: int, vocab: int = 4096) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def start(name: str, model: str, socket: str | None, cfg: dict, log_dir: str, extra: dict | None = None) -> Engine:
    kv = ("--kv-cache-dtype", cfg["kv_cache_dtype"]) if cfg.get("kv_cache_dtype") else ()
    kv += ("--tp", str(cfg["tp"])) if cfg.get("tp") else ()
    e = Engine(name, model, socket, cfg, log_dir, script=os.path.abspath(__file__),
               extra_args=("--extra", json.dumps(extra or {}), *kv))
    e.wait_ready()
    return e


def part_ttft(quick: bool, reps: int, length: int, tmp: str, families: tuple[str, ...]) -> list[dict]:
    rows = []
    base_cfg = {"max_model_len": length + 256, "kv_cache_bytes": 512 << 20, "max_batched_tokens": length + 256}
    for family in families:
        model = build(family, quick, tmp)
        cfg = {**base_cfg, **VARIANTS.get(family, (family, {}))[1]}
        with Daemon.temp({"pool_bytes": "1G", "nvme_bytes": "2G"}) as d:
            engines = {}
            try:
                engines["plain"] = start(f"{family}-plain", model, None, cfg, tmp)
                engines["kvc"] = start(f"{family}-kvc", model, d.socket, cfg, tmp)
                engines["fresh"] = start(f"{family}-fresh", model, d.socket, cfg, tmp)
                engines["kvc"].gen(prompt(length, 999))  # warm-up (kernels, allocator), not measured
                engines["plain"].gen(prompt(length, 998))
                times: dict[str, list[float]] = {"cold": [], "miss": [], "hit": [], "repeat": []}
                same, hit_tokens = True, []
                for r in range(reps):
                    p = prompt(length, 1000 * r + hash(family) % 997)
                    cold = engines["plain"].gen(p)
                    miss = engines["kvc"].gen(p, reset=True)
                    hit = engines["fresh"].gen(p, reset=True)
                    # the same prompt again, from vLLM's own prefix cache: the engine's floor for a hit
                    times["repeat"].append(engines["fresh"].gen(p)["wall_s"])
                    times["cold"].append(cold["wall_s"])
                    times["miss"].append(miss["wall_s"])
                    times["hit"].append(hit["wall_s"])
                    hit_tokens.append(hit["num_cached_tokens"])
                    same &= cold["tokens"] == miss["tokens"] == hit["tokens"]
            finally:
                for e in engines.values():
                    e.close()
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"family": family, "prompt_tokens": length, "median_s": med, "runs_s": times,
               "hit_over_cold": med["hit"] / med["cold"], "miss_over_cold": med["miss"] / med["cold"],
               "repeat_over_cold": med["repeat"] / med["cold"],
               "hit_cached_tokens": hit_tokens, "same_first_token": same}
        rows.append(row)
        print(f"{family:12s} {length} tokens: cold {med['cold']:.3f} s, miss {med['miss']:.3f} s, "
              f"hit {med['hit']:.3f} s: hit/cold {row['hit_over_cold']:.3f}, miss/cold {row['miss_over_cold']:.2f}, "
              f"vLLM's own cache {med['repeat']:.3f} s ({row['repeat_over_cold']:.3f}x), "
              f"cached {hit_tokens}, same token {same}", flush=True)
    return rows


def part_chat(quick: bool, conversations: int, turns: int, tmp: str) -> dict:
    model = build("llama", True, tmp)
    cfg = {"max_model_len": 4096, "kv_cache_bytes": 256 << 20, "max_batched_tokens": 4096}
    system = prompt(300, 7)
    result: dict[str, dict] = {}
    with Daemon.temp({"pool_bytes": "512M", "nvme_bytes": "1G"}) as d1, Daemon.temp({"pool_bytes": "512M", "nvme_bytes": "1G"}) as d2:
        engines = {"answers": start("chat-answers", model, d1.socket, cfg, tmp),
                   "prompts_only": start("chat-prompts", model, d2.socket, cfg, tmp, {"store_answers": False})}
        try:
            for name, e in engines.items():
                cached = total = 0
                per_turn: list[list[float]] = [[] for _ in range(turns)]
                for c in range(conversations):
                    history = system + prompt(60, 100 * c)
                    for t in range(turns):
                        out = e.gen(history, max_tokens=160, reset=True)
                        if t >= 1:
                            cached += out["num_cached_tokens"]
                            total += len(history)
                        per_turn[t].append(out["num_cached_tokens"] / len(history))
                        history = history + out["tokens"] + prompt(60, 100 * c + t + 1)
                result[name] = {"turn2plus_hit_rate": cached / total, "cached_tokens": cached, "prompt_tokens": total,
                                "hit_rate_by_turn": [statistics.mean(x) for x in per_turn]}
                print(f"chat {name:12s}: turns >= 2 hit rate {cached / total:.3f} "
                      f"(by turn: {', '.join(f'{statistics.mean(x):.2f}' for x in per_turn)})", flush=True)
        finally:
            for e in engines.values():
                e.close()
    result["ratio"] = result["answers"]["turn2plus_hit_rate"] / result["prompts_only"]["turn2plus_hit_rate"]
    print(f"chat: answers / prompts_only = {result['ratio']:.2f}x", flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small models, 1024 tokens, 1 rep, 2 conversations")
    ap.add_argument("--reps", type=int, default=0)
    ap.add_argument("--length", type=int, default=0, help="prompt tokens (default 4096; 1024 with --quick)")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--parts", default="ttft,chat")
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--model", "--socket", "--extra", "--kv-cache-dtype"):
        ap.add_argument(flag, help=argparse.SUPPRESS)
    for flag in ("--max-model-len", "--kv-cache-bytes", "--max-batched-tokens", "--tp"):
        ap.add_argument(flag, type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        a.extra = a.extra or "{}"
        return worker_main(a)
    reps = a.reps or (1 if a.quick else 3)
    length = a.length or (1024 if a.quick else 4096)
    parts = set(a.parts.split(","))
    tmp = tempfile.mkdtemp(prefix="kvc-bench-models-")
    out: dict = {"question": __doc__.split("\n\n")[0], "quick": a.quick, "reps": reps}
    t0 = time.perf_counter()
    if "ttft" in parts:
        out["ttft"] = part_ttft(a.quick, reps, length, tmp, tuple(a.families.split(",")))
    if "chat" in parts:
        out["chat"] = part_chat(a.quick, 2 if a.quick else 4, 3 if a.quick else 4, tmp)
    out["targets"] = {
        **({f"{r['family']}_hit_le_0.2x_cold": r["hit_over_cold"] <= 0.2 for r in out.get("ttft", [])}),
        **({f"{r['family']}_same_first_token": r["same_first_token"] for r in out.get("ttft", [])}),
        **({"chat_answers_ge_1.3x": out["chat"]["ratio"] >= 1.3} if "chat" in out else {}),
    }
    out["seconds"] = time.perf_counter() - t0
    os.makedirs(a.out, exist_ok=True)
    name = "vllm_models" if a.families == ",".join(FAMILIES) else "vllm_models." + a.families.replace(",", "+")
    path = os.path.join(a.out, f"{name}.quick.json" if a.quick else f"{name}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print(f"targets: {out['targets']}\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
