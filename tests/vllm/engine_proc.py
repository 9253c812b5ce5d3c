"""A vLLM CPU engine in its own process, driven by the tests over stdin/stdout (one JSON per line).

    python -m tests.vllm.engine_proc MODEL_DIR [--socket PATH] [--extra JSON] [--connector MODULE:CLASS] [--tp N]

Without ``--socket`` the engine runs without a connector (the reference). Commands:

* ``{"op": "generate", "prompts": [[ids...], ...], "max_tokens": 8, "kv": {...}, "salt": "s",
  "ignore_eos": false}``: greedy generation; ``kv`` is the requests' ``kv_transfer_params``,
  ``salt`` their ``cache_salt``; ``max_tokens`` and ``salt`` may be lists (one per prompt). Answers ``tokens``,
  ``num_cached`` (per prompt) and the connector's counters.
* ``{"op": "add", "id": "r1", "prompt": [ids...], "max_tokens": 8, ...}``, ``{"op": "step", "n": 1}``,
  ``{"op": "abort", "ids": ["r1"]}``, ``{"op": "drain"}``: the engine stepped by hand (what
  ``generate`` hides), to abort a request between two steps; ``step``/``drain`` answer the
  requests finished so far.
* ``{"op": "reset"}``: empties vLLM's own prefix cache (so the next hit can only come from kvcached).
* ``{"op": "quit"}``.

Answers are printed as ``KVJSON {...}`` lines; everything else on stdout is vLLM's log.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _connector(llm):  # the scheduler-side connector object, in this process (no multiprocessing)
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def _worker_connector():
    """The worker-side connector, when the (single) worker runs in this process; None with
    ``--tp`` > 1, whose workers are processes of their own (their stats are then left out)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--socket")
    p.add_argument("--extra", default="{}")
    p.add_argument("--connector", default="kvcached_client.vllm:KvcachedConnector")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-bytes", type=int, default=64 << 20, help="vLLM's KV cache (small: requests get preempted)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="requests running at once (1: the rest queue)")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (> 1: one worker process per rank)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="per step (small: chunked prefill)")
    p.add_argument("--kv-cache-dtype", default=None, help="e.g. fp8")
    p.add_argument("--attention-backend", default=None, help="e.g. CPU_MLA (vLLM picks AMX_MLA on a CPU with AMX)")
    a = p.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = {}
    if a.tp > 1:  # the workers in processes of their own (vLLM's multiprocessing executor, gloo on CPU)
        kw.update(tensor_parallel_size=a.tp, distributed_executor_backend="mp")
        # vLLM's CPU build binds each rank's OpenMP threads to a NUMA node of its own by default
        # ("auto"), and refuses TP > the number of NUMA nodes; one thread per rank, unbound, here.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if a.socket:
        module, cls = a.connector.split(":")
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector=cls, kv_connector_module_path=module, kv_role="kv_both",
            kv_connector_extra_config={"socket": a.socket, "retry_s": 0.2, **json.loads(a.extra)})
    llm = LLM(model=a.model, dtype="float32", enforce_eager=True, max_model_len=a.max_model_len,
              kv_cache_memory_bytes=a.kv_bytes, enable_prefix_caching=True, seed=0,
              **({"max_num_seqs": a.max_num_seqs} if a.max_num_seqs else {}),
              **({"max_num_batched_tokens": a.max_num_batched_tokens} if a.max_num_batched_tokens else {}),
              **({"kv_cache_dtype": a.kv_cache_dtype} if a.kv_cache_dtype else {}),
              **({"attention_backend": a.attention_backend} if a.attention_backend else {}), **kw)
    engine = llm.llm_engine
    finished: dict[str, dict] = {}
    print("KVJSON " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            break
        if op == "reset":
            ok = llm.reset_prefix_cache()
            out = {"reset": bool(ok)}
        elif op == "add":  # one request, stepped by "step" / "abort" / "drain" (what generate hides)
            extra = {"kv_transfer_params": cmd["kv"]} if cmd.get("kv") else None
            sp = SamplingParams(max_tokens=cmd.get("max_tokens", 8), temperature=0, extra_args=extra,
                                ignore_eos=bool(cmd.get("ignore_eos")))
            salt = cmd.get("salt")
            engine.add_request(cmd["id"], TokensPrompt(prompt_token_ids=cmd["prompt"], **({"cache_salt": salt} if salt else {})), sp)
            out = {"added": cmd["id"], "t": time.monotonic()}
        elif op in ("step", "drain"):
            steps = 0
            # The engine core's view, as `vllm serve`'s busy loop has it: it also steps while the
            # connector waits for the workers' reports (offline LLM.generate stops with its requests).
            core = engine.engine_core.engine_core.scheduler
            while (engine.has_unfinished_requests() or core.has_requests()) and (op == "drain" or steps < cmd.get("n", 1)):
                for r in engine.step():
                    if r.finished:
                        finished[r.request_id] = {"tokens": list(r.outputs[0].token_ids),
                                                  "num_cached": r.num_cached_tokens, "t": time.monotonic()}
                steps += 1
            out = {"steps": steps, "finished": finished, "unfinished": engine.has_unfinished_requests() or core.has_requests()}
            if op == "drain":
                finished = {}
        elif op == "abort":
            engine.abort_request(cmd["ids"])
            out = {"aborted": cmd["ids"]}
        elif op == "generate":
            extra = {"kv_transfer_params": cmd["kv"]} if cmd.get("kv") else None
            n = len(cmd["prompts"])
            max_tokens = cmd.get("max_tokens", 8)
            max_tokens = max_tokens if isinstance(max_tokens, list) else [max_tokens] * n
            sps = [SamplingParams(max_tokens=m, temperature=0, extra_args=extra, ignore_eos=bool(cmd.get("ignore_eos")))
                   for m in max_tokens]
            salt = cmd.get("salt")
            salts = salt if isinstance(salt, list) else [salt] * n
            prompts = [TokensPrompt(prompt_token_ids=ids, **({"cache_salt": s} if s else {}))
                       for ids, s in zip(cmd["prompts"], salts)]
            res = llm.generate(prompts, sps, use_tqdm=False)
            # As `vllm serve`'s busy loop does (LLM.generate stops with its requests): step while
            # the connector still works for finished ones (an answer being stored, reports owed).
            core = engine.engine_core.engine_core.scheduler
            for _ in range(10_000):
                if not core.has_requests():
                    break
                engine.step()
            out = {"tokens": [list(r.outputs[0].token_ids) for r in res],
                   "num_cached": [r.num_cached_tokens for r in res]}
        else:
            out = {"error": f"unknown op {op}"}
        if a.socket:
            s = _connector(llm).scheduler
            w = _worker_connector()
            out["scheduler"] = dict(s.stats)
            out["tracked_requests"] = s.tracked_requests
            out["live_attempts"] = s.live_attempts
            out["waiting_for_kv"] = sorted(r.request_id.rsplit("-", 1)[0]  # vLLM adds "-<random>" to the caller's id
                                           for r in engine.engine_core.engine_core.scheduler.requests.values()
                                           if r.status.name == "WAITING_FOR_REMOTE_KVS")
            out["fail_open"] = {f"{k[0]}:{k[1]}": v for k, v in s.fail.counts.items()}
            if w is not None and w.worker is not None:
                out["worker"] = dict(w.worker.stats)
                out["fail_open"].update({f"{k[0]}:{k[1]}": v for k, v in w.worker.fail.counts.items()})
        print("KVJSON " + json.dumps(out), flush=True)
    os._exit(0)  # vLLM's teardown of an in-process engine can hang on its background threads


if __name__ == "__main__":
    main()
