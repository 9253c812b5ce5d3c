"""remote_tier.py's part 2: a cold acquire end to end through a Store whose remote tier holds the
prompt, against the prefill it saves. Not a benchmark itself: ``bench/remote_tier.py`` runs it."""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import tempfile
import time

from bench._common import RESULTS_DIR
from bench._remote_fetch import DOMAIN, E2E_TOKENS_FULL, E2E_TOKENS_QUICK, GB, raw_cluster_client
from bench.harness.redis_servers import redis_cpu_s


# ---------------------------------------------------------------------------------------------
# Part 2: end to end through a Store
# ---------------------------------------------------------------------------------------------


def e2e_layout():
    from kvcached.contract.keys import KVLayout

    # bench/ttft.py's model: 12 layers, 4 KV heads, head_dim 64, float32, 128-token chunks (3 MiB)
    return KVLayout("bench/remote-tier-ttft-llama@random0", num_layers=12, num_kv_heads=4, head_dim=64,
                    dtype="float32", chunk_tokens=128, vocab_size=32000)


def ttft_prefill(tokens: int) -> dict:
    path = os.path.join(RESULTS_DIR, "ttft.json")
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        return {"usable": False, "why": f"bench/results/ttft.json unreadable: {type(e).__name__}"}
    if d.get("quick"):
        return {"usable": False, "why": "bench/results/ttft.json is a --quick run (a small model)"}
    rows = [r for r in d.get("rows", []) if r.get("cold_s")]
    if not rows:
        return {"usable": False, "why": "bench/results/ttft.json has no rows with cold_s"}
    best = min(rows, key=lambda r: abs(r["tokens"] - tokens))
    lay = d.get("layout", {})
    ours = e2e_layout()
    same = all(lay.get(k) == getattr(ours, k) for k in ("num_layers", "num_kv_heads", "head_dim", "dtype", "chunk_tokens"))
    return {"usable": True, "source": "bench/results/ttft.json", "git_commit": d.get("machine", {}).get("git_commit"),
            "time_utc": d.get("machine", {}).get("time_utc"), "tokens": best["tokens"], "cold_s": best["cold_s"],
            "hit_s": best.get("hit_s"), "prefill_s_per_token": best["cold_s"] / best["tokens"],
            "model": d.get("model"), "same_kv_geometry": same,
            "scaling": ("none: the same KV geometry (24 KiB per token) and the same prompt length; the CPU tiny "
                        "model's cold prefill (random-weight Llama, 12 layers, hidden 1024, fp32, 2 threads)"
                        if same and best["tokens"] == tokens else
                        f"per token, from its {best['tokens']}-token row (cold prefill grows faster than linearly)")}


def e2e_rep(cfg, root: str, key_file: str, layout, lid, tokens, crc: list[int], rep: int, reader: str,
            redis_pids: list[int]) -> dict:
    """One cold acquire on a fresh host B whose remote tier reads with ``reader``: ``direct`` (the
    Store's fill reads each value straight into its reserved pool slot) or ``redis-py`` (the path
    before: values parsed by redis-py, verified, then copied into the pool by ``write_reserved``)."""
    import resource
    import zlib

    from kvcached.store import Store

    bdir = os.path.join(root, f"b{rep}-{reader}")
    os.makedirs(bdir, mode=0o700)
    shutil.copy(key_file, os.path.join(bdir, "hash.key"))
    b = Store(cfg(os.path.basename(bdir)))
    try:
        if b.register_layout(layout) != lid:
            raise RuntimeError("host B's layout id differs")
        for t in getattr(b.pool, "populating", []):  # a daemon up for a moment: its pool's page tables filled
            t.join(60)
        b.remote.direct = reader == "direct"
        timing = {"fetch": 0.0, "write": 0.0, "fetch_calls": 0}

        def timed(f, what: str, count: bool):
            def call(*a_, **kw):
                timing["fetch_calls"] += count
                s = time.perf_counter()
                try:
                    return f(*a_, **kw)
                finally:
                    timing[what] += time.perf_counter() - s
            return call

        # direct: fetch_into is the fetch and the pool writes at once (the socket reads land there)
        b.remote.fetch = timed(b.remote.fetch, "fetch", True)
        b.remote.fetch_into = timed(b.remote.fetch_into, "fetch", True)
        b.write_reserved = timed(b.write_reserved, "write", False)
        gc.collect()
        gc.disable()
        try:
            flt0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            r0, c0 = redis_cpu_s(redis_pids), time.process_time()
            s = time.perf_counter()
            lease = b.acquire(lid, tokens)
            cold = time.perf_counter() - s
            c1, r1 = time.process_time(), redis_cpu_s(redis_pids)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - flt0
        finally:
            gc.enable()
        if lease.matched_tokens != len(tokens):
            raise RuntimeError(f"host B ({reader}) matched {lease.matched_tokens} of {len(tokens)} tokens "
                               f"(remote stats {b.remote.stats})")
        if rep == 0:
            got = [zlib.crc32(b.pool.read(c.chunk_hash)) for c in lease.chunks]
            if got != crc:
                raise RuntimeError(f"host B's chunks ({reader}) differ from host A's")
        b.release(lease.lease_id)
        s = time.perf_counter()
        lease2 = b.acquire(lid, tokens)
        warm = time.perf_counter() - s
        b.release(lease2.lease_id)
        st = b.stats()
        return {"reader": reader, "rep": rep, "cold_acquire_s": cold, "fetch_s": timing["fetch"],
                "pool_writes_s": timing["write"], "fetch_calls": timing["fetch_calls"], "minor_page_faults": faults,
                "rest_s": cold - timing["fetch"] - timing["write"], "warm_acquire_s": warm,
                "client_cpu_s": c1 - c0, "redis_cpu_s": r1 - r0,
                "remote_filled_chunks": st.counters.remote_filled_chunks, "remote_hits": b.remote.stats.hits,
                "remote_errors": b.remote.stats.errors,
                "publish_queue_after": len(b.publisher) if b.publisher is not None else 0}
    finally:
        b.close()
        shutil.rmtree(bdir, ignore_errors=True)


def measure_e2e(cluster, args: argparse.Namespace, notes: list[str]) -> dict:
    import numpy as np

    import kvcached.remotefill as fill_mod

    from kvcached.config import StoreConfig
    from kvcached.store import Store
    from kvcached.contract.record import HEADER_SIZE
    from kvcached.contract.remote_format import remote_key
    from kvcached.tiers.remote_redis import RemoteConfig

    layout = e2e_layout()
    tokens_n = E2E_TOKENS_QUICK if args.quick else E2E_TOKENS_FULL
    n_chunks = tokens_n // layout.chunk_tokens
    rng = np.random.default_rng(args.seed + 7)
    tokens = rng.integers(0, layout.vocab_size, tokens_n, dtype=np.uint32)
    rconf = RemoteConfig(nodes=tuple(f"127.0.0.1:{p}" for _, p in cluster.startup_nodes), domain="ignored", cluster=True)
    pool_bytes = int(math.ceil(n_chunks / 0.85)) * layout.chunk_bytes  # the write-back thread stays idle (>10 % free)
    nvme_bytes = 2 * n_chunks * (layout.chunk_bytes + HEADER_SIZE)
    root = tempfile.mkdtemp(prefix="kvc-bench-remote-e2e-")

    def cfg(name: str, **kw) -> StoreConfig:
        return StoreConfig(state_dir=os.path.join(root, name), domain=DOMAIN, pool_bytes=pool_bytes,
                           nvme_bytes=nvme_bytes, remote=rconf, **kw)

    out: dict = {"tokens": tokens_n, "chunks": n_chunks, "chunk_bytes": layout.chunk_bytes,
                 "prompt_bytes": n_chunks * layout.chunk_bytes, "layout": layout.to_dict(), "pool_bytes": pool_bytes,
                 "nvme_bytes": nvme_bytes, "reps": args.e2e_reps,
                 "store_remote_fetch_window_bytes": getattr(fill_mod, "FETCH_WINDOW_BYTES", None)}
    try:
        a = Store(cfg("a", writeback=False))
        try:
            lid = a.register_layout(layout)
            payload_all = rng.integers(0, 256, n_chunks * layout.chunk_bytes, dtype=np.uint8)
            chunks = [memoryview(payload_all[i * layout.chunk_bytes:(i + 1) * layout.chunk_bytes]) for i in range(n_chunks)]
            t0 = time.perf_counter()
            r = a.put(lid, tokens, chunks)
            t1 = time.perf_counter()
            assert a.publisher is not None
            a.publisher.drain()
            t2 = time.perf_counter()
            published = a.remote.stats.published
            if r.committed_chunks != n_chunks or published < n_chunks:
                raise RuntimeError(f"host A committed {r.committed_chunks} and published {published} of {n_chunks} chunks")
            import zlib

            crc = [zlib.crc32(c) for c in chunks]
            out["host_a"] = {"put_s": t1 - t0, "publish_drain_s": t2 - t1, "published": published,
                             "publish_gb_s": n_chunks * layout.chunk_bytes / (t2 - t1) / GB if t2 > t1 else None}
            key_file = os.path.join(a.config.state_dir, "hash.key")
            hashes = a.hashes(lid, tokens)
            remote_names = [remote_key(DOMAIN, lid, h) for h in hashes]  # the store's domain is DOMAIN
            del chunks, payload_all
        finally:
            a.close()
        reps = []
        readers = ("direct", "redis-py")
        redis_pids = [n.proc.pid for n in cluster.nodes if n.proc is not None]
        for rep in range(args.e2e_reps):
            for reader in (readers if rep % 2 == 0 else readers[::-1]):  # interleaved, each first in turn
                reps.append(e2e_rep(cfg, root, key_file, layout, lid, tokens, crc, rep, reader, redis_pids))
        out["reps_detail"] = reps
        keys = ("cold_acquire_s", "fetch_s", "pool_writes_s", "rest_s", "warm_acquire_s", "fetch_calls",
                "minor_page_faults", "client_cpu_s", "redis_cpu_s")
        out["by_reader"] = {}
        for reader in readers:
            mine = [r for r in reps if r["reader"] == reader]
            med = {k: statistics.median(r[k] for r in mine) for k in keys}
            b = out["by_reader"][reader] = {"median": med}
            b["cold_acquire_gb_s"] = out["prompt_bytes"] / med["cold_acquire_s"] / GB
            b["gb_per_client_cpu_s"] = out["prompt_bytes"] / med["client_cpu_s"] / GB
            b["client_cores_busy"] = med["client_cpu_s"] / med["cold_acquire_s"]
            b["fetch_gb_s"] = out["prompt_bytes"] / med["fetch_s"] / GB
            b["split_share"] = {k: med[k] / med["cold_acquire_s"] for k in ("fetch_s", "pool_writes_s", "rest_s")}
        d, p_ = out["by_reader"]["direct"], out["by_reader"]["redis-py"]
        out["direct_over_redis_py_reader"] = {"gb_s": d["cold_acquire_gb_s"] / p_["cold_acquire_gb_s"],
                                              "gb_per_client_cpu_s": d["gb_per_client_cpu_s"] / p_["gb_per_client_cpu_s"]}
        # the product's path (the direct reader) is the e2e figure the rest of the report uses
        med = out["median"] = d["median"]
        out["cold_acquire_gb_s"] = d["cold_acquire_gb_s"]
        out["fetch_gb_s"] = d["fetch_gb_s"]
        out["cold_acquire_us_per_token"] = med["cold_acquire_s"] / tokens_n * 1e6
        out["pool_writes_gb_s"] = out["prompt_bytes"] / med["pool_writes_s"] / GB if med["pool_writes_s"] else None
        out["split_share"] = d["split_share"]
        pf = ttft_prefill(tokens_n)
        out["prefill_reference"] = pf
        if pf["usable"]:
            out["cold_acquire_over_prefill_per_token"] = (med["cold_acquire_s"] / tokens_n) / pf["prefill_s_per_token"]
            out["prefill_over_cold_acquire"] = pf["prefill_s_per_token"] / (med["cold_acquire_s"] / tokens_n)
            if pf.get("hit_s") and pf["tokens"] == tokens_n:
                # TTFT of a remote hit ~ the fill + a local hit's TTFT (ttft.py's hit_s)
                out["est_ttft_remote_hit_s"] = med["cold_acquire_s"] + pf["hit_s"]
                out["est_ttft_remote_hit_over_cold"] = out["est_ttft_remote_hit_s"] / pf["cold_s"]
        else:
            notes.append("no usable prefill time per token: " + pf["why"])
        if remote_names:
            try:
                c = raw_cluster_client(rconf)
                p = c.pipeline(transaction=False)
                for nm in remote_names:
                    p.delete(nm)
                p.execute()
                c.close()
            except Exception as e:  # noqa: BLE001
                notes.append(f"e2e: deleting host A's keys failed: {e}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out
