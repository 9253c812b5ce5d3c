"""remote_tier.py's part 3: misses through the remote tier, and whether a Bloom filter of remote
keys would pay. Not a benchmark itself: ``bench/remote_tier.py`` runs it."""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import tempfile
import time

from bench._common import ratio, summarize_ns
from bench._remote_e2e import e2e_layout, ttft_prefill
from bench._remote_fetch import DOMAIN, KNOWN_KEYS, MISS_CHUNKS, SETTLE_S, raw_cluster_client
from bench.harness.resp import RespConn


# ---------------------------------------------------------------------------------------------
# Part 3: misses, and whether a Bloom filter would pay
# ---------------------------------------------------------------------------------------------


def _bloom_module():
    try:
        import rbloom

        return rbloom, None
    except ImportError as e:
        return None, f"rbloom not importable ({e}); the Python set is the lower bound of a filter's check"


def measure_miss(cluster, args: argparse.Namespace, notes: list[str]) -> dict:
    import numpy as np

    from kvcached.config import StoreConfig
    from kvcached.store import Store
    from kvcached.contract.remote_format import mac_key, remote_key
    from kvcached.tiers.remote_redis import RemoteConfig, RemoteRedisTier

    rng = np.random.default_rng(args.seed + 11)
    rconf = RemoteConfig(nodes=tuple(f"127.0.0.1:{p}" for _, p in cluster.startup_nodes), domain=DOMAIN, cluster=True)
    tier = RemoteRedisTier(rconf, mac_key(os.urandom(32)))
    layout = e2e_layout()
    lid = layout.layout_id
    known = [rng.bytes(16) for _ in range(KNOWN_KEYS)]
    known_set = set(known)
    rbloom, why = _bloom_module()
    bloom = None
    if rbloom is not None:
        bloom = rbloom.Bloom(KNOWN_KEYS, 0.01)
        bloom.update(known)
    else:
        notes.append(why)
    n_sets = 16
    absent = [[rng.bytes(16) for _ in range(MISS_CHUNKS)] for _ in range(n_sets)]
    # attribution: the same 64 GETs through a plain redis-py cluster pipeline, and over plain sockets
    raw = raw_cluster_client(rconf)
    absent_names = [[remote_key(DOMAIN, lid, h) for h in hs] for hs in absent]
    conns: dict[str, RespConn] = {}
    by_node_sets = []
    for names in absent_names:
        by: dict[str, list[bytes]] = {}
        for nm in names:
            node = raw.get_node_from_key(nm)
            if node.name not in conns:
                conns[node.name] = RespConn(node.host, node.port)
            by.setdefault(node.name, []).append(nm.encode())
        by_node_sets.append(by)
    nil = memoryview(bytearray(16))

    def raw_miss(i: int) -> None:
        p = raw.pipeline(transaction=False)
        for nm in absent_names[i]:
            p.get(nm)
        if any(v is not None for v in p.execute()):
            raise RuntimeError("an absent key exists")

    def sock_miss(i: int) -> None:
        by = by_node_sets[i]
        for node, keys in by.items():
            conns[node].send_gets(keys)
        for node, keys in by.items():
            for _ in keys:
                if conns[node].read_bulk_into(nil) != -1:
                    raise RuntimeError("an absent key exists")
    # Stores: one with the remote tier, one without; never-seen 8k-token prompts
    root = tempfile.mkdtemp(prefix="kvc-bench-remote-miss-")
    prompts = [rng.integers(0, layout.vocab_size, MISS_CHUNKS * layout.chunk_tokens, dtype=np.uint32) for _ in range(n_sets)]
    stores = {}
    try:
        for name, remote in (("with remote", rconf), ("without remote", None)):
            stores[name] = Store(StoreConfig(state_dir=os.path.join(root, name.replace(" ", "_")), domain=DOMAIN,
                                             pool_bytes=8 * layout.chunk_bytes, nvme_bytes=0, writeback=False,
                                             remote=remote))
            if stores[name].register_layout(layout) != lid:
                raise RuntimeError("layout id mismatch")
        counted = {"calls": 0, "keys": 0}
        wr = stores["with remote"].remote
        def counting(f):
            def call(lid_, hs, *a, **kw):
                counted["calls"] += 1
                counted["keys"] += len(hs)
                return f(lid_, hs, *a, **kw)
            return call

        wr.fetch, wr.fetch_into = counting(wr.fetch), counting(wr.fetch_into)  # the Store's fill uses fetch_into
        state = {"i": 0}

        def nxt() -> int:
            state["i"] = (state["i"] + 1) % n_sets
            return state["i"]

        def acq(store):
            def op() -> None:
                lease = store.acquire(lid, prompts[nxt()])
                if lease.matched_tokens:
                    raise RuntimeError("a never-seen prompt matched")
                store.release(lease.lease_id)
            return op

        ops = {
            "remote fetch miss (64 keys, kvcached)": lambda: tier.fetch(lid, absent[nxt()], layout.chunk_bytes),
            "remote probe miss (64 keys, kvcached)": lambda: tier.probe(lid, absent[nxt()]),
            "redis-py cluster pipeline, 64 GETs of absent keys (attribution)": lambda: raw_miss(nxt()),
            "plain sockets, 64 pipelined GETs of absent keys (attribution)": lambda: sock_miss(nxt()),
            "check 64 keys in a Python set (100k known)": lambda: [h in known_set for h in absent[nxt()]],
            "Store miss acquire, with remote tier (8k tokens)": acq(stores["with remote"]),
            "Store miss acquire, without remote tier (8k tokens)": acq(stores["without remote"]),
        }
        if bloom is not None:
            ops["check 64 keys in an rbloom Bloom filter (100k known, 1 % fpr)"] = lambda: [h in bloom for h in absent[nxt()]]
        samples: dict[str, list[int]] = {k: [] for k in ops}
        names = list(ops)
        order = random.Random(args.seed + 3)
        per = args.miss_reps_per_round
        pc = time.perf_counter_ns
        for rnd in range(args.miss_rounds + 1):
            order.shuffle(names)
            for name in names:
                time.sleep(SETTLE_S)
                op = ops[name]
                gc.disable()
                try:
                    for _ in range(per):
                        t0 = pc()
                        op()
                        if rnd:
                            samples[name].append(pc() - t0)
                finally:
                    gc.enable()
        fp = None
        if bloom is not None:
            probe = [rng.bytes(16) for _ in range(100_000)]
            fp = sum(h in bloom for h in probe) / len(probe)
        errors = tier.stats.errors + (stores["with remote"].remote.stats.errors if stores["with remote"].remote else 0)
    finally:
        for s in stores.values():
            s.close()
        tier.close()
        for c in conns.values():
            c.close()
        raw.close()
        shutil.rmtree(root, ignore_errors=True)
    lat = {k: summarize_ns(v) for k, v in samples.items()}
    p50 = {k: v["p50_us"] for k, v in lat.items()}
    fetch_miss = p50["remote fetch miss (64 keys, kvcached)"]
    check = p50.get("check 64 keys in an rbloom Bloom filter (100k known, 1 % fpr)",
                    p50["check 64 keys in a Python set (100k known)"])
    with_r = p50["Store miss acquire, with remote tier (8k tokens)"]
    without_r = p50["Store miss acquire, without remote tier (8k tokens)"]
    saved = with_r - without_r - check  # what a perfect filter saves on a request whose chunks nobody has
    pf = ttft_prefill(MISS_CHUNKS * layout.chunk_tokens)
    prefill_s = (pf["cold_s"] if pf["tokens"] == MISS_CHUNKS * layout.chunk_tokens
                 else pf["prefill_s_per_token"] * MISS_CHUNKS * layout.chunk_tokens) if pf["usable"] else None
    import kvcached.remotefill as fill_mod

    out = {
        "latency": lat,
        "store_miss_remote_fetch_calls": counted["calls"],
        "store_miss_keys_per_fetch": counted["keys"] / counted["calls"] if counted["calls"] else None,
        "store_remote_fetch_window_bytes": getattr(fill_mod, "FETCH_WINDOW_BYTES", None),
        "bloom_filter": "rbloom" if bloom is not None else None,
        "bloom_false_positive_rate_measured": fp,
        "known_keys": KNOWN_KEYS, "keys_per_check": MISS_CHUNKS,
        "remote_errors": errors,
        "ratios": {
            "fetch_miss_over_filter_check": ratio(fetch_miss, check),
            "fetch_miss_over_set_check": ratio(fetch_miss, p50["check 64 keys in a Python set (100k known)"]),
            "store_miss_with_remote_over_without": ratio(with_r, without_r),
            "fetch_miss_over_redis_py_pipeline": ratio(fetch_miss, p50["redis-py cluster pipeline, 64 GETs of absent keys (attribution)"]),
            "fetch_miss_over_plain_sockets": ratio(fetch_miss, p50["plain sockets, 64 pipelined GETs of absent keys (attribution)"]),
        },
        "saved_per_miss_us_by_a_perfect_filter": saved,
        "prefill_s_after_a_miss": prefill_s,
        "saved_over_prefill": (saved * 1e-6 / prefill_s) if prefill_s else None,
    }
    return out
