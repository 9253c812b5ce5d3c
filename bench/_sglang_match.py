"""Run by ``acquire_latency.py`` in SGLang's virtual environment (not a benchmark of its own):
SGLang's ``RadixCache.match_prefix`` on the same prompt, in the same shape of tree.

Reads a JSON job on stdin: ``prompt`` (token ids), ``fillers`` (other prompts to insert first),
``page_sizes``, ``iterations``, ``rounds``. Writes JSON to stdout: per page size, per contender
the nanoseconds of every sample. Contenders, interleaved round by round:

* ``match_prefix``       what SGLang's scheduler calls for a new request
* ``match+lock+unlock``  that plus ``inc_lock_ref`` / ``dec_lock_ref`` of the matched node: the
                         request's pin and its release, as kvcached's acquire + release

The tree holds the prompt and the fillers as SGLang's own KV indices (a torch int64 tensor per
insert, as its scheduler passes them). Needs the test-only CPU shims on ``PYTHONPATH``
(``tests/sglang/cpu_shims``): SGLang does not import on a CPU-only machine without them.
"""

from __future__ import annotations

import gc
import json
import sys
import time
import warnings

warnings.filterwarnings("ignore")


def time_tree(tree, job: dict) -> dict[str, list[int]]:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    prompt = job["prompt"]
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey(prompt)))
    if m.device_prefix_len != len(prompt):
        raise SystemExit(f"SGLang matched {m.device_prefix_len} of {len(prompt)} tokens")

    def match() -> None:
        tree.match_prefix(MatchPrefixParams(key=RadixKey(prompt)))

    def match_lock_unlock() -> None:
        node = tree.match_prefix(MatchPrefixParams(key=RadixKey(prompt))).last_device_node
        tree.inc_lock_ref(node)
        tree.dec_lock_ref(node)

    fns = {"match_prefix": match, "match+lock+unlock": match_lock_unlock}
    out: dict[str, list[int]] = {k: [] for k in fns}
    per_round = max(1, job["iterations"] // job["rounds"])
    pc = time.perf_counter_ns
    for fn in fns.values():  # warm
        for _ in range(50):
            fn()
    gc.collect()
    gc.disable()
    try:
        for _ in range(job["rounds"]):
            for name, fn in fns.items():
                samples = out[name]
                for _ in range(per_round):
                    t0 = pc()
                    fn()
                    samples.append(pc() - t0)
    finally:
        gc.enable()
    return out


def main() -> int:
    job = json.load(sys.stdin)
    import sglang
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    per_page: dict[str, dict] = {}
    for page in job["page_sizes"]:
        tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None,
                                          page_size=page))
        slot = 0
        for toks in job["fillers"] + [job["prompt"]]:
            tree.insert(InsertParams(key=RadixKey(toks), value=torch.arange(slot, slot + len(toks), dtype=torch.int64)))
            slot += len(toks)
        per_page[str(page)] = {"tree_tokens": slot, "samples_ns": time_tree(tree, job)}
    json.dump({"sglang": sglang.__version__, "torch": torch.__version__, "page_sizes": per_page}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
