"""A vLLM CPU engine in its own process, driven by the tests over stdin/stdout (one JSON per line).

    python -m tests.vllm.engine_proc MODEL_DIR [--socket PATH] [--extra JSON] [--connector MODULE:CLASS]

Without ``--socket`` the engine runs without a connector (the reference). Commands:

* ``{"op": "generate", "prompts": [[ids...], ...], "max_tokens": 8, "kv": {...}}``: greedy
  generation; ``kv`` is the requests' ``kv_transfer_params``. Answers ``tokens``,
  ``num_cached`` (per prompt) and the connector's counters.
* ``{"op": "reset"}``: empties vLLM's own prefix cache (so the next hit can only come from kvcached).
* ``{"op": "quit"}``.

Answers are printed as ``KVJSON {...}`` lines; everything else on stdout is vLLM's log.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _connector(llm):  # the scheduler-side connector object, in this process (no multiprocessing)
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def _worker_connector():
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--socket")
    p.add_argument("--extra", default="{}")
    p.add_argument("--connector", default="kvcached_client.vllm:KvcachedConnector")
    p.add_argument("--max-model-len", type=int, default=2048)
    a = p.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = {}
    if a.socket:
        module, cls = a.connector.split(":")
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector=cls, kv_connector_module_path=module, kv_role="kv_both",
            kv_connector_extra_config={"socket": a.socket, "retry_s": 0.2, **json.loads(a.extra)})
    llm = LLM(model=a.model, dtype="float32", enforce_eager=True, max_model_len=a.max_model_len,
              kv_cache_memory_bytes=64 << 20, enable_prefix_caching=True, seed=0, **kw)
    print("KVJSON " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            break
        if op == "reset":
            ok = llm.reset_prefix_cache()
            out = {"reset": bool(ok)}
        elif op == "generate":
            extra = {"kv_transfer_params": cmd["kv"]} if cmd.get("kv") else None
            sp = SamplingParams(max_tokens=cmd.get("max_tokens", 8), temperature=0, extra_args=extra)
            res = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in cmd["prompts"]], sp, use_tqdm=False)
            out = {"tokens": [list(r.outputs[0].token_ids) for r in res],
                   "num_cached": [r.num_cached_tokens for r in res]}
        else:
            out = {"error": f"unknown op {op}"}
        if a.socket:
            s = _connector(llm).scheduler
            w = _worker_connector()
            out["scheduler"] = dict(s.stats)
            out["tracked_requests"] = s.tracked_requests
            out["fail_open"] = {f"{k[0]}:{k[1]}": v for k, v in s.fail.counts.items()}
            if w is not None and w.worker is not None:
                out["worker"] = dict(w.worker.stats)
                out["fail_open"].update({f"{k[0]}:{k[1]}": v for k, v in w.worker.fail.counts.items()})
        print("KVJSON " + json.dumps(out), flush=True)
    os._exit(0)  # vLLM's teardown of an in-process engine can hang on its background threads


if __name__ == "__main__":
    main()
