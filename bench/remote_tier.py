"""Question: how fast does kvcached's remote tier (Redis Cluster) hand over 2 MiB / 16 MiB KV
chunks, verified, next to plain redis-py GETs of the same values and LMCache's Redis-cluster
connector; what does a remote fill of an 8k-token prompt cost against prefilling it; and would a
local Bloom filter of known-remote keys pay for itself by skipping probes that miss?

One run, one real Redis Cluster the script starts itself (``bench/harness/redis_servers.py``: 6 nodes on
free loopback ports, 3 primaries + 3 replicas, ``redis-cli --cluster create``; stopped at the end,
also on error or SIGTERM), everything side by side:

1. **Fetch throughput**, per chunk size (2 MiB = Llama-3-8B geometry with 4 layers, 16 MiB = all
   32 layers: 8 KV heads, head_dim 128, bf16, 128 tokens), N = max(8, 64 MiB / chunk) chunks of
   random bytes published with ``RemoteRedisTier.publish``. Concurrency ``TxK``: T threads, each
   fetching K chunks per call (1x1, 1x8, 4x8; keys cycle over the N chunks). Contenders,
   interleaved round by round in a new random order, 5 ms apart, after one untimed warm-up round:

   * ``kvcached fetch``: the tier's direct reader as the Store uses it, ``fetch_into`` K reused
     chunk slots per thread (one pipelined round trip per node, every node read at once, each
     value read with ``recv_into`` straight into its slot and verified there: keyed BLAKE3 MAC,
     header, XXH3-64 of the payload).
   * ``kvcached fetch, redis-py reader``: the tier's reader before (``reader="redis-py"``):
     ``fetch``, values parsed by redis-py, verified, returned as views (the Store then copied
     them into its pool, not timed in this row). The "today's GB/s" the direct reader is held to.
   * ``redis-py GET``: a ``redis.cluster.RedisCluster`` made like the tier's (same timeouts, same
     parser), a non-transactional pipeline of GETs of the same keys; the reference of the target.
   * ``LMCache redis-cluster``: LMCache's ``RedisClusterConnector`` (``redis-cluster://``), run in
     a throwaway venv (``--lmcache-venv``; never the project's) as a child process that this
     script drives round by round over a pipe; same cluster, same chunk size, its own keys
     (metadata + kv_bytes per chunk, no integrity check); T concurrent
     ``batched_get_non_blocking`` calls of K keys on its event loop (``get`` for K = 1). Skipped,
     with the reason, when the venv is missing or LMCache does not import.
   * what-if ``socket GET recv_into``: the same GETs pipelined over plain sockets, one per primary,
     each value read straight into a preallocated buffer (the network + server floor, no client
     parser); ``+ decode``: the same, then kvcached's ``decode`` of each buffer (what the tier
     would cost with such a reader). T = 1 only.
   * ``instrumented: kvcached fetch, redis-py reader 1xK``: that reader again with timers around its
     pipelined round trip (``_pipelined``) and each ``decode`` call: the split of its own time, in
     situ (T = 1).
     (``redis-benchmark`` is not a row: it notices the end of a run only on its 250 ms throughput
     timer, so its requests/s at these sizes measure that tick; the socket rows are the floor.)
   * breakdown, one value, one thread: ``decode`` (MAC + header + XXH3), keyed BLAKE3 alone,
     XXH3-64 alone, a memcpy of the value, BLAKE3 with ``max_threads=AUTO`` (what-if).

   GB/s = payload bytes moved in a contender's round / its wall time; medians over rounds. Per
   core: the reading process's CPU time per GB (``time.process_time``, every thread; LMCache's
   child measures its own), and the Redis servers' (``/proc/<pid>/stat``), which share this
   box's cores here but are other hosts in a deployment. Targets: kvcached >= 0.8x redis-py GET
   at 2 MiB and 16 MiB with several chunks in flight (1x8 and 4x8); >= 2x LMCache at 16 MiB, in
   GB/s and in GB per CPU-second. The redis-py reader's time per GB is split into the socket
   floor, redis-py's parser on top of it, decode, and the rest.

2. **End to end through a Store**: host A (own state dir) puts an 8,192-token prompt (64 chunks
   of 3 MiB: the layout of ``bench/ttft.py``'s CPU Llama, 12 layers, 4 KV heads, head_dim 64,
   fp32, 128 tokens) and publishes it (``publisher.drain()``); host B (own, empty state dir, A's
   ``hash.key`` copied in first, same domain; pool + NVMe tier, write-back idle) acquires it cold:
   remote fetch + reserve/write/commit locally + the acquire. A fresh B per rep (its pool's page
   tables filled first, as a running daemon's are), every rep once with each reader, interleaved:
   the direct reader (values land in the reserved slots) and the redis-py reader (parsed, then
   copied by ``write_reserved``); GB/s and GB per client CPU-second each, and their ratios
   (target: >= 2x both). The time split (fetch / writes into the pool / the rest) comes from
   timing wrappers on B's instance; the GPU break-even below uses the direct reader's figures, and
   the number of client cores that would reach it at the measured GB per CPU-second. Compared
   per token with the cold prefill of ``bench/results/ttft.json`` (its 8,192-token row; same KV
   bytes per token, so no scaling), which the script reads.

3. **Misses and a Bloom filter**: ``RemoteRedisTier.fetch`` and ``probe`` of 64 keys that do not
   exist (attributed with the same 64 GETs through a plain redis-py cluster pipeline and over plain
   sockets), against checking 64 keys in a Python set / an ``rbloom.Bloom`` of 100k known keys
   (1 % false positives), and a Store miss (a never-seen 8k-token prompt) with the remote tier vs
   without it; interleaved, p50/p99. ``rbloom`` is
   optional (``pip install --target /tmp/benchdeps rbloom``, then ``PYTHONPATH=/tmp/benchdeps``);
   without it the set is the lower bound and the run says so.

Run:   PYTHONPATH=/tmp/benchdeps .venv/bin/python bench/remote_tier.py   (~2.5 min on a 2-core box; the
       PYTHONPATH only adds rbloom)
       .venv/bin/python bench/remote_tier.py --quick    (2 MiB only, 1024 tokens, no LMCache; ~15 s)
       --setup-lmcache first creates the throwaway LMCache venv (pip, 10-minute cap).
Output: bench/results/remote_tier.json, bench/results/remote_tier.png (quick: remote_tier.quick.*)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file: import bench

from bench._common import REPO_ROOT, RESULTS_DIR, format_table, install_sigterm_exit, ratio, save_figure, subplots, summarize_ns, write_json
from bench.harness.lmcache_proc import LMCacheProc, setup_lmcache_venv
from bench.harness.redis_servers import REDIS_CLI, REDIS_SERVER, RedisCluster, redis_cpu_s
from bench.harness.resp import RespConn

MiB = 1 << 20
GB = 1e9
TARGET_OVER_RAW = 0.8
TARGET_OVER_LMCACHE = 2.0
TARGET_OVER_BEFORE = 2.0  # the direct reader against the redis-py reader it replaced
#: No GPU on this box: what a GPU would spend is an assumption, stated here and in the JSON.
#: (model, KV bytes per token in bf16, prefill tokens/s of one H100-class GPU at 8k context).
GPU_PREFILL_ASSUMPTIONS = (
    ("Llama-3-8B (32 layers x 8 KV heads x 128, bf16)", 32 * 8 * 128 * 2 * 2, 20_000),
    ("Llama-3-70B TP8 (80 layers x 1 KV head per GPU x 128, bf16)", 80 * 1 * 128 * 2 * 2, 3_000),
)
GPU_ASSUMPTION_NOTE = ("assumed, not measured (no GPU was lent): prefill throughput of one H100-class GPU at 8k "
                       "context, 20k tokens/s for an 8B model and 3k tokens/s per GPU for 70B over TP8; the "
                       "remote fill pays when its GB/s exceeds KV bytes per token x those tokens/s")
SETTLE_S = 0.005
SIZES = {"2MiB": 4, "16MiB": 32}  # Llama-3-8B geometry: layers for that chunk size (8 KV heads, 128 dims, bf16)
CONFIGS_FULL = ((1, 1), (1, 8), (4, 8))
CONFIGS_QUICK = ((1, 1), (1, 8), (2, 8))
DOMAIN = "bench"
DEFAULT_LMCACHE_VENV = "/tmp/lmcvenv"
E2E_TOKENS_FULL = 8192
E2E_TOKENS_QUICK = 1024
MISS_CHUNKS = 64
KNOWN_KEYS = 100_000


def cfg_name(t: int, k: int) -> str:
    return f"{t}x{k}"


def _clean(text: str, extra: dict[str, str] | None = None) -> str:
    """No absolute machine paths in results: the repo, temp dirs, the LMCache venv, home."""
    s = str(text)
    for path, label in (extra or {}).items():
        if path:
            s = s.replace(path, label)
    s = s.replace(REPO_ROOT, "<repo>")
    s = s.replace(tempfile.gettempdir().rstrip("/") + "/", "<tmp>/")
    home = os.path.expanduser("~")
    if home and home != "/":
        s = s.replace(home, "~")
    return s


# ---------------------------------------------------------------------------------------------
# Part 1: fetch throughput
# ---------------------------------------------------------------------------------------------


def make_layout(size: str):
    from kvcached.contract.keys import KVLayout

    return KVLayout(f"bench/remote-tier-{size}@1", num_layers=SIZES[size], num_kv_heads=8, head_dim=128,
                    dtype="bfloat16", chunk_tokens=128)


def raw_cluster_client(rconf):
    """A redis-py client made as the tier makes its own (same timeouts, same parser)."""
    try:
        from kvcached.tiers.remote_redis import _make_client

        return _make_client(rconf)
    except ImportError:  # renamed: build the equivalent
        from redis.cluster import ClusterNode, RedisCluster

        nodes = [ClusterNode(n.rpartition(":")[0], int(n.rpartition(":")[2])) for n in rconf.nodes]
        return RedisCluster(startup_nodes=nodes, socket_timeout=rconf.timeout, socket_connect_timeout=rconf.timeout)


class FetchBench:
    def __init__(self, size: str, cluster, args: argparse.Namespace, lmc: LMCacheProc | None, notes: list[str]) -> None:
        import numpy as np
        from concurrent.futures import ThreadPoolExecutor

        from kvcached.contract.record import ChunkMeta
        from kvcached.contract.record import HEADER_SIZE
        from kvcached.contract.remote_format import MAC_BYTES, mac_key, remote_key
        from kvcached.tiers.remote_redis import RemoteConfig, RemoteRedisTier

        self.size, self.args, self.lmc, self.notes = size, args, lmc, notes
        self.layout = make_layout(size)
        self.lid = self.layout.layout_id
        self.nbytes = self.layout.chunk_bytes
        self.value_bytes = self.nbytes + HEADER_SIZE + MAC_BYTES
        self.n = max(8, math.ceil(64 * MiB / self.nbytes))
        self.configs = CONFIGS_QUICK if args.quick else CONFIGS_FULL
        # The throughput rows keep up to 4 x 8 x 16 MiB in flight on 2 cores: a socket read can
        # wait longer than the tier's interactive default (0.5 s) there, so these use --timeout.
        self.rconf = RemoteConfig(nodes=tuple(f"127.0.0.1:{p}" for _, p in cluster.startup_nodes), domain=DOMAIN,
                                  cluster=True, timeout=args.timeout)
        self.key = mac_key(os.urandom(32))
        self.tier = RemoteRedisTier(self.rconf, self.key)  # the direct reader (the default)
        self.tier_parsed = RemoteRedisTier(self.rconf, self.key, reader="redis-py")  # the reader before
        if not self.tier.direct or self.tier_parsed.direct:
            raise RuntimeError("the tier's readers are not the ones this bench compares")
        self.redis_pids = [n.proc.pid for n in cluster.nodes if n.proc is not None]
        rng = np.random.default_rng(args.seed)
        self.hashes = [rng.bytes(16) for _ in range(self.n)]
        self.crc: list[int] = []
        import zlib

        batch = max(1, (64 * MiB) // self.nbytes)
        for s in range(0, self.n, batch):
            items = []
            for i in range(s, min(self.n, s + batch)):
                payload = rng.integers(0, 256, self.nbytes, dtype=np.uint8).tobytes()
                self.crc.append(zlib.crc32(payload))
                items.append((ChunkMeta(self.hashes[i], rng.bytes(16), self.lid, i, self.layout.chunk_tokens), payload))
            if not self.tier.publish(items):
                raise RuntimeError(f"publishing the {size} chunks failed: {self.tier.stats}")
            del items
        self.names = [remote_key(DOMAIN, self.lid, h) for h in self.hashes]
        self.raw = raw_cluster_client(self.rconf)
        self.pool = ThreadPoolExecutor(max(t for t, _ in self.configs), thread_name_prefix="bench-fetch")
        # the what-if reader: one plain socket per node, K buffers of one value each
        self.conns: dict[str, RespConn] = {}
        self.node_of: list[str] = []
        for nm in self.names:
            node = self.raw.get_node_from_key(nm)
            if node.name not in self.conns:
                self.conns[node.name] = RespConn(node.host, node.port)
            self.node_of.append(node.name)
        kmax = max(k for _, k in self.configs)
        self.bufs = [memoryview(bytearray(self.value_bytes)) for _ in range(kmax)]
        # fetch_into's destinations: per thread, K chunk-sized slots of one arena, touched (as pool
        # slots that have been used before are)
        tmax = max(t for t, _ in self.configs)
        self.arenas = [np.ones(kmax * self.nbytes, dtype=np.uint8) for _ in range(tmax)]
        self.one_value = self.raw.get(self.names[0])
        self.copy_dst = memoryview(bytearray(len(self.one_value)))
        self.lmc_ok = False
        self.lmc_setup: dict | None = None
        if lmc is not None:
            a = lmc.call(timeout=300, op="setup", nodes=list(cluster.startup_nodes), chunk_bytes=self.nbytes, n=self.n,
                         max_in_flight=max(t * k for t, k in self.configs), chunk_tokens=self.layout.chunk_tokens,
                         num_layers=self.layout.num_layers, num_kv_heads=self.layout.num_kv_heads,
                         head_dim=self.layout.head_dim, model=f"bench-lmcache-{size}")
            self.lmc_setup = a
            if a.get("ok") and a.get("verified"):
                self.lmc_ok = True
            else:
                notes.append(f"{size}: LMCache rows skipped: " + _clean(a.get("error") or "its read-back did not verify"))
        self.errors0 = self.tier.stats.errors
        self.split_acc: dict[str, dict] = {}

    # -- contenders: each returns payload bytes moved ------------------------------------------

    def _window(self, ti: int, ci: int, t: int, k: int) -> list[int]:
        start = (ti * k + ci * k * t) % self.n
        return [(start + j) % self.n for j in range(k)]

    def _par(self, t: int, fn) -> int:
        if t == 1:
            return fn(0)
        return sum(f.result() for f in [self.pool.submit(fn, i) for i in range(t)])

    def calls_for(self, t: int, k: int) -> int:
        return max(1, self.args.round_bytes // (t * k * self.nbytes))

    def ours(self, t: int, k: int):
        """The direct reader as the Store uses it: ``fetch_into`` K reused slots per thread."""
        calls = self.calls_for(t, k)
        nb = self.nbytes

        def thread(ti: int) -> int:
            arena = memoryview(self.arenas[ti])
            got = 0
            for ci in range(calls):
                idx = self._window(ti, ci, t, k)
                got += nb * self.tier.fetch_into(self.lid, [self.hashes[i] for i in idx], nb,
                                                 lambda j: arena[j * nb: (j + 1) * nb])
            return got

        return lambda: self._par(t, thread)

    def ours_parsed(self, t: int, k: int):
        """The tier's redis-py reader (its only reader before): ``fetch``, values parsed into objects,
        verified, returned as views (the Store then copied each into its pool: not timed here)."""
        calls = self.calls_for(t, k)

        def thread(ti: int) -> int:
            got = 0
            for ci in range(calls):
                idx = self._window(ti, ci, t, k)
                got += sum(len(p) for p in self.tier_parsed.fetch(self.lid, [self.hashes[i] for i in idx], self.nbytes))
            return got

        return lambda: self._par(t, thread)

    def ours_instrumented(self, k: int):
        """``fetch`` at 1xK with timers around its pipelined round trip and each ``decode`` (in situ:
        the values are the ones redis-py just built, not a warm copy)."""
        import kvcached.tiers.remote_redis as rr

        inner = self.ours_parsed(1, k)
        acc = self.split_acc.setdefault(cfg_name(1, k), {"pipelined_s": 0.0, "decode_s": 0.0, "total_s": 0.0, "bytes": 0})
        pc = time.perf_counter
        tier = self.tier_parsed

        def op() -> int:
            orig_dec, orig_pipe = rr.decode, tier._pipelined

            def dec(*a, **kw):
                s = pc()
                try:
                    return orig_dec(*a, **kw)
                finally:
                    acc["decode_s"] += pc() - s

            def pipe(*a, **kw):
                s = pc()
                try:
                    return orig_pipe(*a, **kw)
                finally:
                    acc["pipelined_s"] += pc() - s

            rr.decode, tier._pipelined = dec, pipe
            s = pc()
            try:
                moved = inner()
            finally:
                rr.decode = orig_dec
                del tier._pipelined
            acc["total_s"] += pc() - s
            acc["bytes"] += moved
            return moved

        return op

    def raw_get(self, t: int, k: int):
        calls = self.calls_for(t, k)
        payload = self.nbytes

        def thread(ti: int) -> int:
            got = 0
            for ci in range(calls):
                p = self.raw.pipeline(transaction=False)
                for i in self._window(ti, ci, t, k):
                    p.get(self.names[i])
                got += sum(payload for v in p.execute() if v is not None)
            return got

        return lambda: self._par(t, thread)

    def socket_get(self, k: int, decode_too: bool):
        from kvcached.contract.remote_format import decode

        calls = self.calls_for(1, k)
        names_b = [n.encode() for n in self.names]

        def op() -> int:
            got = 0
            for ci in range(calls):
                idx = self._window(0, ci, 1, k)
                by_node: dict[str, list[tuple[int, int]]] = {}
                for j, i in enumerate(idx):
                    by_node.setdefault(self.node_of[i], []).append((j, i))
                for node, items in by_node.items():
                    self.conns[node].send_gets([names_b[i] for _, i in items])
                for node, items in by_node.items():
                    c = self.conns[node]
                    for j, i in items:
                        n = c.read_bulk_into(self.bufs[j])
                        if n < 0:
                            continue
                        if decode_too:
                            decode(self.bufs[j][:n], self.hashes[i], self.lid, self.key, self.nbytes)
                        got += self.nbytes
            return got

        return op

    def lmcache(self, t: int, k: int):
        calls = self.calls_for(t, k)

        def op() -> float:
            a = self.lmc.call(timeout=300, op="run", threads=t, per_call=k, calls=calls)
            if "error" in a:
                raise RuntimeError("LMCache: " + a["error"])
            return a  # measured in the child

        return op

    def cpu_ops(self) -> dict:
        import blake3
        import xxhash

        from kvcached.contract.remote_format import MAC_BYTES, decode

        v = self.one_value
        mv = memoryview(v)
        record = mv[:-MAC_BYTES]
        payload = mv[len(v) - MAC_BYTES - self.nbytes: len(v) - MAC_BYTES]
        h0, key, lid, nb = self.hashes[0], self.key, self.lid, self.nbytes
        reps = max(2, self.args.round_bytes // 2 // self.nbytes)

        def loop(fn):
            def op() -> int:
                for _ in range(reps):
                    fn()
                return reps * nb
            return op

        def mcopy() -> None:
            self.copy_dst[:] = mv

        return {
            "breakdown: decode (MAC + header + XXH3), 1 value": loop(lambda: decode(v, h0, lid, key, nb)),
            "breakdown: keyed BLAKE3 alone": loop(lambda: blake3.blake3(record, key=key).digest()),
            "breakdown: XXH3-64 alone": loop(lambda: xxhash.xxh3_64_intdigest(payload)),
            "breakdown: memcpy of the value": loop(mcopy),
            "what-if: keyed BLAKE3, max_threads=AUTO": loop(
                lambda: blake3.blake3(record, key=key, max_threads=blake3.blake3.AUTO).digest()),
        }

    def contenders(self) -> dict:
        """name -> (op, info); op returns bytes moved (timed here) or a dict measured elsewhere."""
        c: dict = {}
        for t, k in self.configs:
            cn = cfg_name(t, k)
            c[f"kvcached fetch {cn}"] = (self.ours(t, k), {"who": "kvcached", "config": cn, "threads": t, "per_call": k})
            c[f"kvcached fetch, redis-py reader {cn}"] = (self.ours_parsed(t, k), {
                "who": "kvcached-parsed", "config": cn, "threads": t, "per_call": k})
            c[f"redis-py GET {cn}"] = (self.raw_get(t, k), {"who": "redis-py", "config": cn, "threads": t, "per_call": k})
            if self.lmc_ok:
                c[f"LMCache redis-cluster {cn}"] = (self.lmcache(t, k),
                                                    {"who": "LMCache", "config": cn, "threads": t, "per_call": k})
        for t, k in self.configs:
            if t == 1:
                cn = cfg_name(t, k)
                c[f"instrumented: kvcached fetch, redis-py reader {cn}"] = (self.ours_instrumented(k), {
                    "who": "kvcached-instrumented", "config": cn, "threads": 1, "per_call": k})
                c[f"what-if: socket GET recv_into {cn}"] = (self.socket_get(k, False),
                                                            {"who": "socket", "config": cn, "threads": 1, "per_call": k})
                if k > 1:
                    c[f"what-if: socket GET recv_into + decode {cn}"] = (
                        self.socket_get(k, True), {"who": "socket+decode", "config": cn, "threads": 1, "per_call": k})
        for name, op in self.cpu_ops().items():
            c[name] = (op, {"who": "cpu", "config": "1 value", "threads": 1, "per_call": 1})
        return c

    def verify(self) -> dict:
        import zlib

        ok_ours = True
        for tier in (self.tier, self.tier_parsed):
            got = tier.fetch(self.lid, self.hashes, self.nbytes)
            ok_ours = ok_ours and len(got) == self.n and [zlib.crc32(p) for p in got] == self.crc
            del got
        arena = memoryview(self.arenas[0])
        nb = self.nbytes
        k = len(self.arenas[0]) // nb
        n_in = self.tier.fetch_into(self.lid, self.hashes[:k], nb, lambda j: arena[j * nb: (j + 1) * nb])
        ok_ours = ok_ours and n_in == k and [zlib.crc32(arena[j * nb: (j + 1) * nb]) for j in range(k)] == self.crc[:k]
        p = self.raw.pipeline(transaction=False)
        for nm in self.names[:8]:
            p.get(nm)
        ok_raw = all(v is not None and len(v) == self.value_bytes for v in p.execute())
        from kvcached.contract.remote_format import MAC_BYTES

        n = self.conns[self.node_of[0]]
        n.send_gets([self.names[0].encode()])
        ln = n.read_bulk_into(self.bufs[0])
        ok_sock = ln == self.value_bytes and zlib.crc32(self.bufs[0][ln - MAC_BYTES - self.nbytes: ln - MAC_BYTES]) == self.crc[0]
        if not (ok_ours and ok_raw and ok_sock):
            raise RuntimeError(f"{self.size}: read-back check failed (kvcached {ok_ours}, redis-py {ok_raw}, socket {ok_sock})")
        return {"kvcached fetch, both readers and fetch_into (all chunks, CRC of every payload)": ok_ours, "redis-py GET (value lengths)": ok_raw,
                "socket GET (CRC of the payload)": ok_sock,
                "LMCache (bytes of one chunk)": bool(self.lmc_setup and self.lmc_setup.get("verified"))}

    def measure(self) -> dict:
        checked = self.verify()
        contenders = self.contenders()
        names = list(contenders)
        per_round: dict[str, list[float]] = {n: [] for n in names}
        cpu_round: dict[str, list[float]] = {n: [] for n in names}  # this process's CPU s per GB moved
        redis_cpu_round: dict[str, list[float]] = {n: [] for n in names}  # the Redis servers' CPU s per GB
        order = random.Random(self.args.seed)
        t_start = time.perf_counter()
        pc = time.perf_counter
        for rnd in range(self.args.rounds + 1):  # round 0: warm-up
            order.shuffle(names)
            for name in names:
                time.sleep(SETTLE_S)
                op, _ = contenders[name]
                gc.disable()
                try:
                    r0, c0 = redis_cpu_s(self.redis_pids), time.process_time()
                    t0 = pc()
                    moved = op()
                    dt = pc() - t0
                    c1, r1 = time.process_time(), redis_cpu_s(self.redis_pids)
                finally:
                    gc.enable()
                if isinstance(moved, dict):  # measured in the LMCache child
                    gbs = moved["bytes"] / moved["seconds"] / GB
                    if moved.get("cpu_s") is not None:
                        cpu_round[name].append(moved["cpu_s"] / (moved["bytes"] / GB))
                    redis_cpu_round[name].append((r1 - r0) / (moved["bytes"] / GB))
                else:
                    gbs = moved / dt / GB
                    if moved:
                        cpu_round[name].append((c1 - c0) / (moved / GB))
                        redis_cpu_round[name].append((r1 - r0) / (moved / GB))
                if rnd:
                    per_round[name].append(gbs)
            if rnd == 0:
                gc.collect()
        wall = time.perf_counter() - t_start
        rows = {}
        for name in contenders:
            xs = per_round[name]
            info = contenders[name][1]
            rows[name] = {**info, "gb_s_median": statistics.median(xs), "gb_s_min": min(xs), "gb_s_max": max(xs),
                          "gb_s_rounds": xs}
            if cpu_round[name]:  # GB per CPU-second of the reading process: the rate one core sustains
                rows[name]["client_cpu_s_per_gb"] = statistics.median(cpu_round[name])
                rows[name]["gb_per_client_cpu_s"] = 1 / rows[name]["client_cpu_s_per_gb"]
            if redis_cpu_round[name]:
                rows[name]["redis_cpu_s_per_gb"] = statistics.median(redis_cpu_round[name])
        errors = self.tier.stats.errors - self.errors0
        if errors:
            self.notes.append(f"{self.size}: the tier counted {errors} failed calls during timing (fail-open: "
                              "fewer bytes were returned, and counted)")
        in_situ = {}
        for cn, a in self.split_acc.items():
            if a["total_s"] and a["pipelined_s"] and a["decode_s"]:
                in_situ[cn] = {"pipelined_GET_share": a["pipelined_s"] / a["total_s"],
                               "decode_share": a["decode_s"] / a["total_s"],
                               "rest_share": 1 - (a["pipelined_s"] + a["decode_s"]) / a["total_s"],
                               "pipelined_GET_gb_s": a["bytes"] / a["pipelined_s"] / GB,
                               "decode_gb_s": a["bytes"] / a["decode_s"] / GB, "fetch_gb_s": a["bytes"] / a["total_s"] / GB,
                               "includes_warmup_round": True}
            else:
                self.notes.append(f"{self.size} {cn}: the in-situ split found no _pipelined/decode calls to time "
                                  "(RemoteRedisTier.fetch was refactored?)")
        return {"chunk_bytes": self.nbytes, "value_bytes": self.value_bytes, "stored_chunks": self.n,
                "in_situ_split": in_situ,
                "layout": self.layout.to_dict(), "rounds": self.args.rounds, "round_bytes": self.args.round_bytes,
                "timed_wall_seconds": wall, "verified": checked, "tier_errors_during_timing": errors,
                "tier_stats": {k: v for k, v in vars(self.tier.stats).items() if isinstance(v, (int, float, dict))},
                "lmcache_setup": self.lmc_setup, "rows": rows}

    def close(self) -> None:
        try:
            p = self.raw.pipeline(transaction=False)
            for nm in self.names:
                p.delete(nm)
            p.execute()
        except Exception as e:  # noqa: BLE001
            self.notes.append(f"{self.size}: deleting the bench keys failed: {e}")
        if self.lmc_ok and self.lmc is not None:
            self.lmc.call(timeout=120, op="cleanup")
        for c in self.conns.values():
            c.close()
        self.pool.shutdown()
        self.tier.close()
        self.tier_parsed.close()
        try:
            self.raw.close()
        except Exception:  # noqa: BLE001
            pass


def fetch_verdicts(m: dict, configs) -> dict:
    rows = m["rows"]
    gb = {n: r["gb_s_median"] for n, r in rows.items()}
    out: dict = {}
    dec = gb["breakdown: decode (MAC + header + XXH3), 1 value"]
    for t, k in configs:
        cn = cfg_name(t, k)
        ours, raw = gb[f"kvcached fetch {cn}"], gb[f"redis-py GET {cn}"]
        lmc = gb.get(f"LMCache redis-cluster {cn}")
        r = {"kvcached_gb_s": ours, "redis_py_gb_s": raw, "kvcached_over_redis_py": ratio(ours, raw),
             "lmcache_gb_s": lmc, "kvcached_over_lmcache": ratio(ours, lmc) if lmc else None,
             "lmcache_over_redis_py": ratio(lmc, raw) if lmc else None}
        parsed = gb.get(f"kvcached fetch, redis-py reader {cn}")
        if parsed:
            r["kvcached_redis_py_reader_gb_s"] = parsed
            r["direct_over_redis_py_reader"] = ratio(ours, parsed)
        per_core = {}
        for who, row in (("kvcached", f"kvcached fetch {cn}"), ("kvcached_redis_py_reader", f"kvcached fetch, redis-py reader {cn}"),
                         ("redis_py_GET", f"redis-py GET {cn}"), ("lmcache", f"LMCache redis-cluster {cn}")):
            if rows.get(row, {}).get("gb_per_client_cpu_s"):
                per_core[who] = rows[row]["gb_per_client_cpu_s"]
        r["gb_per_client_cpu_s"] = per_core
        if per_core.get("kvcached") and per_core.get("kvcached_redis_py_reader"):
            r["per_core_direct_over_redis_py_reader"] = per_core["kvcached"] / per_core["kvcached_redis_py_reader"]
        sock = gb.get(f"what-if: socket GET recv_into {cn}")
        sockd = gb.get(f"what-if: socket GET recv_into + decode {cn}")
        if sock:
            r["socket_floor_gb_s"] = sock
            r["kvcached_over_socket_floor"] = ratio(ours, sock)
            r["redis_py_over_socket_floor"] = ratio(raw, sock)
        if sockd:
            r["what_if_socket_plus_decode_gb_s"] = sockd
            r["what_if_socket_plus_decode_over_redis_py"] = ratio(sockd, raw)
        # time per GB: where the redis-py reader's fetch spends it (1 thread: additive; with threads,
        # decode releases the GIL and overlaps, so the split is an upper bound for decode)
        if not parsed:
            out[cn] = r
            continue
        s_ours, s_raw, s_dec = 1 / parsed, 1 / raw, 1 / dec
        split = {"kvcached_fetch_s_per_GB": s_ours, "redis_py_GET_s_per_GB": s_raw, "decode_s_per_GB (1 thread)": s_dec,
                 "rest_s_per_GB": s_ours - s_raw - s_dec,
                 "share_of_kvcached_time": {"GET (network + server + redis-py)": s_raw / s_ours,
                                            "decode (MAC + XXH3 + header)": s_dec / s_ours,
                                            "rest (calls, lists, stats)": (s_ours - s_raw - s_dec) / s_ours}}
        if sock:
            s_sock = 1 / sock
            split["socket_floor_s_per_GB"] = s_sock
            split["redis_py_parser_s_per_GB (redis-py GET - socket floor)"] = s_raw - s_sock
            split["share_of_kvcached_time"]["of which socket floor (kernel + Redis)"] = s_sock / s_ours
            split["share_of_kvcached_time"]["of which redis-py parsing and copies"] = (s_raw - s_sock) / s_ours
        r["time_split"] = split
        out[cn] = r
    out["cpu_alone_gb_s"] = {n.split(": ", 1)[1]: v for n, v in gb.items() if n.startswith(("breakdown", "what-if: keyed"))}
    return out


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


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def conclusions(res: dict) -> list[str]:
    out = []
    for size, m in res["fetch"].items():
        for cn, v in m["verdicts"].items():
            if not isinstance(v, dict) or "kvcached_over_redis_py" not in v:
                continue
            s = (f"{size} {cn}: kvcached {v['kvcached_gb_s']:.2f} GB/s = {v['kvcached_over_redis_py']:.2f}x redis-py GET "
                 f"({v['redis_py_gb_s']:.2f} GB/s)")
            if v.get("lmcache_gb_s"):
                s += f", {v['kvcached_over_lmcache']:.2f}x LMCache ({v['lmcache_gb_s']:.2f} GB/s)"
            if v.get("socket_floor_gb_s"):
                s += (f"; the plain-socket floor is {v['socket_floor_gb_s']:.2f} GB/s (redis-py reaches "
                      f"{v['redis_py_over_socket_floor']:.2f}x of it)")
            out.append(s)
    for size, m in res["fetch"].items():
        v = m["verdicts"].get("1x8", {})
        pcs = v.get("gb_per_client_cpu_s", {})
        if pcs.get("kvcached") and v.get("direct_over_redis_py_reader"):
            row = m["rows"].get("kvcached fetch 1x8", {})
            s = (f"{size} 1x8 per core: the direct reader moves {pcs['kvcached']:.2f} GB per CPU-second of the reading "
                 f"process ({v['direct_over_redis_py_reader']:.2f}x the redis-py reader's GB/s, "
                 f"{pcs['kvcached'] / pcs.get('kvcached_redis_py_reader', float('nan')):.2f}x its GB per CPU-second")
            if pcs.get("lmcache"):
                s += f", {pcs['kvcached'] / pcs['lmcache']:.2f}x LMCache's"
            s += ")"
            if row.get("redis_cpu_s_per_gb") and v.get("socket_floor_gb_s"):
                s += (f"; the Redis servers, on the same {os.cpu_count()} cores here, spend {row['redis_cpu_s_per_gb']:.2f} "
                      f"CPU-s per GB sending, and plain sockets with no client work reach {v['socket_floor_gb_s']:.2f} GB/s")
            out.append(s)
    m16 = res["fetch"].get("16MiB")
    if m16:
        sp = m16["verdicts"].get("1x8", {}).get("time_split", {})
        sh = sp.get("share_of_kvcached_time", {})
        if sh:
            out.append("16MiB 1x8, where the redis-py reader's fetch time goes: " + ", ".join(f"{k} {v:.0%}" for k, v in sh.items()))
    e = res.get("e2e") or {}
    if e.get("median"):
        x = e["direct_over_redis_py_reader"]
        s = (f"end to end: host B's cold acquire of {e['tokens']} tokens ({e['prompt_bytes'] / MiB:.0f} MiB) takes "
             f"{e['median']['cold_acquire_s'] * 1e3:.0f} ms, {e['cold_acquire_gb_s']:.2f} GB/s "
             f"({e['cold_acquire_us_per_token']:.1f} us/token; {x['gb_s']:.2f}x the redis-py reader's GB/s, "
             f"{x['gb_per_client_cpu_s']:.2f}x its GB per client CPU-second: "
             f"{e['by_reader']['direct']['gb_per_client_cpu_s']:.2f} vs "
             f"{e['by_reader']['redis-py']['gb_per_client_cpu_s']:.2f})")
        pf = e.get("prefill_reference", {})
        if pf.get("usable"):
            s += (f"; the CPU model's prefill costs {pf['prefill_s_per_token'] * 1e3:.2f} ms/token "
                  f"(ttft.json, {pf['tokens']} tokens), {e['prefill_over_cold_acquire']:.0f}x more")
            if e.get("est_ttft_remote_hit_over_cold"):
                s += f"; estimated TTFT of a remote hit {e['est_ttft_remote_hit_over_cold']:.3f}x cold"
        else:
            s += f"; no prefill comparison ({pf.get('why')})"
        out.append(s)
    mi = res.get("miss")
    if mi:
        p = {k: v["p50_us"] for k, v in mi["latency"].items()}
        check_name = next((k for k in p if "rbloom" in k), "check 64 keys in a Python set (100k known)")
        pays = mi["saved_over_prefill"] is not None and mi["saved_over_prefill"] > 0.01
        s = (f"Bloom filter: a remote miss of 64 keys costs {p['remote fetch miss (64 keys, kvcached)']:.0f} us p50 "
             f"(probe {p['remote probe miss (64 keys, kvcached)']:.0f} us), checking 64 keys locally "
             f"{p[check_name]:.1f} us ({'rbloom' if 'rbloom' in check_name else 'Python set, lower bound'}); a Store "
             f"miss costs {p['Store miss acquire, with remote tier (8k tokens)']:.0f} us with the remote tier vs "
             f"{p['Store miss acquire, without remote tier (8k tokens)']:.0f} us without (it looks up "
             f"{mi['store_miss_keys_per_fetch'] or 0:.0f} keys: the Store fetches a first window, and no further "
             f"window after a miss), so a perfect filter saves "
             f"{mi['saved_per_miss_us_by_a_perfect_filter']:.0f} us per missing request")
        if mi["saved_over_prefill"] is not None:
            s += (f", {mi['saved_over_prefill']:.2e} of the {mi['prefill_s_after_a_miss']:.1f} s prefill that a miss "
                  "implies")
        s += (". It does not pay" if not pays else ". It pays") + (
            ": the saving is noise next to the prefill. And a purely local filter cannot know the keys other hosts "
            "published, so it would turn exactly the cross-host hits the remote tier exists for into misses (each "
            "one a full prefill instead of a fill); only a filter kept in sync with the cluster (e.g. fed by keyspace "
            "notifications, or RedisBloom, itself a round trip) could be correct, and it would save less still.")
        out.append(s)
    lm = res.get("lmcache", {})
    if lm.get("status") == "skipped":
        out.append(f"LMCache: skipped: {lm.get('reason')}")
    elif lm.get("status") == "partly":
        out.append("LMCache: ran for some sizes only: " + "; ".join(n for n in res["notes"] if "LMCache" in n))
    return out


def print_report(res: dict) -> None:
    for size, m in res["fetch"].items():
        print(f"\n== fetch {size} ({m['chunk_bytes']:,} B payload, {m['stored_chunks']} chunks stored); "
              f"{m['rounds']} rounds, medians ==")
        v = m["verdicts"]
        rows = []
        for name, r in m["rows"].items():
            raw = v.get(r["config"], {}).get("redis_py_gb_s") if isinstance(v.get(r["config"]), dict) else None
            rows.append([name, r["gb_s_median"], r["gb_s_min"], r["gb_s_max"],
                         ratio(r["gb_s_median"], raw) if raw else float("nan")])
        print(format_table(["contender", "GB/s p50", "min", "max", "x redis-py GET (same TxK)"], rows))
        for cn, x in m.get("in_situ_split", {}).items():
            print(f"  {cn} in situ (timers inside fetch): round trip {x['pipelined_GET_share']:.0%} "
                  f"({x['pipelined_GET_gb_s']:.2f} GB/s), decode {x['decode_share']:.0%} ({x['decode_gb_s']:.2f} GB/s), "
                  f"rest {x['rest_share']:.0%}")
        for cn, x in v.items():
            if isinstance(x, dict) and "time_split" in x:
                sh = x["time_split"]["share_of_kvcached_time"]
                print(f"  {cn}: kvcached/redis-py {x['kvcached_over_redis_py']:.2f}x"
                      + (f", kvcached/LMCache {x['kvcached_over_lmcache']:.2f}x" if x.get("kvcached_over_lmcache") else "")
                      + "; modelled split (from the rows): " + ", ".join(f"{k} {s:.0%}" for k, s in sh.items()))
    e = res.get("e2e")
    if e and e.get("median"):
        md = e["median"]
        print(f"\n== end to end: host B cold acquire of {e['tokens']} tokens ({e['chunks']} x {e['chunk_bytes'] / MiB:.0f} MiB), "
              f"{len(e['reps_detail'])} reps, medians ==")
        rows = []
        for reader, b in e["by_reader"].items():
            m = b["median"]
            rows.append([reader, m["cold_acquire_s"] * 1e3, b["cold_acquire_gb_s"], m["fetch_s"] * 1e3,
                         m["pool_writes_s"] * 1e3, m["rest_s"] * 1e3, m["client_cpu_s"] * 1e3, b["gb_per_client_cpu_s"],
                         m["redis_cpu_s"] * 1e3, m["minor_page_faults"]])
        print(format_table(["reader", "cold ms", "GB/s", "fetch ms", "pool writes ms", "rest ms", "client CPU ms",
                            "GB per client CPU-s", "Redis CPU ms", "minor faults"], rows))
        x = e["direct_over_redis_py_reader"]
        print(f"  direct / redis-py reader: {x['gb_s']:.2f}x GB/s, {x['gb_per_client_cpu_s']:.2f}x GB per client "
              f"CPU-second; warm acquire on B {md['warm_acquire_s'] * 1e3:.2f} ms; host A publish "
              f"{e['host_a']['publish_gb_s']:.2f} GB/s")
        pf = e["prefill_reference"]
        if pf.get("usable"):
            print(f"  prefill (ttft.json, {pf['tokens']} tokens, cold {pf['cold_s']:.1f} s): "
                  f"{pf['prefill_s_per_token'] * 1e3:.2f} ms/token -> prefill / remote fill = "
                  f"{e['prefill_over_cold_acquire']:.0f}x; scaling: {pf['scaling']}")
        else:
            print(f"  no prefill reference: {pf['why']}")
    mi = res.get("miss")
    if mi:
        print("\n== misses (p50 / p99 us) ==")
        print(format_table(["op", "p50 us", "p99 us"], [[k, v["p50_us"], v["p99_us"]] for k, v in mi["latency"].items()]))
        if mi["bloom_false_positive_rate_measured"] is not None:
            print(f"  rbloom false-positive rate measured: {mi['bloom_false_positive_rate_measured']:.4f}")
    lm = res["lmcache"]
    print(f"\nLMCache: {lm['status']}" + (f" ({lm.get('versions')})" if lm.get("versions") else "")
          + (f": {lm['reason']}" if lm.get("reason") else ""))
    print("\ntargets:")
    for t, v in res["targets"].items():
        if isinstance(v, dict):
            print(f"  {t}: {v['value']:.2f} (>= {v['min']}) {'MET' if v['met'] else 'NOT MET'}")
    if res.get("phase_seconds"):
        print("\nphases (s): " + ", ".join(f"{k} {v:.0f}" for k, v in res["phase_seconds"].items()))
    print("\nconclusions:")
    for c in res["conclusions"]:
        print(f"  * {c}")
    for n in res["notes"]:
        print(f"  note: {n}")


def plot(res: dict, path: str) -> None:
    sizes = list(res["fetch"])
    fig, axes = subplots(1, len(sizes), figsize=(6.5 * len(sizes), 4.6), squeeze=False)
    colors = {"kvcached": "#3182bd", "redis-py": "#e6550d", "LMCache": "#31a354", "socket": "#969696",
              "socket+decode": "#636363"}
    for ax, size in zip(axes[0], sizes):
        rows = res["fetch"][size]["rows"]
        configs = []
        for r in rows.values():
            if r["who"] in ("kvcached", "redis-py", "LMCache", "socket", "socket+decode") and r["config"] not in configs:
                configs.append(r["config"])
        whos = [w for w in ("kvcached", "redis-py", "LMCache", "socket", "socket+decode")
                if any(r["who"] == w for r in rows.values())]
        width = 0.8 / max(1, len(whos))
        for wi, who in enumerate(whos):
            xs, ys, lo, hi = [], [], [], []
            for ci, cn in enumerate(configs):
                r = next((r for r in rows.values() if r["who"] == who and r["config"] == cn), None)
                if r is None:
                    continue
                xs.append(ci + (wi - (len(whos) - 1) / 2) * width)
                ys.append(r["gb_s_median"])
                lo.append(r["gb_s_median"] - r["gb_s_min"])
                hi.append(r["gb_s_max"] - r["gb_s_median"])
            label = {"socket": "what-if: plain socket recv_into", "socket+decode": "what-if: socket + kvcached decode",
                     "kvcached": "kvcached fetch (verified)", "redis-py": "redis-py GET pipeline",
                     "LMCache": "LMCache redis-cluster"}[who]
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, color=colors[who], label=label)
            for x, y in zip(xs, ys):
                ax.text(x, y, f"{y:.2f}", ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(configs)), [f"{c}\n(threads x chunks/call)" for c in configs], fontsize=8)
        ax.set_ylabel("GB/s (median over rounds, min-max bars)")
        ax.set_title(f"{size} chunks", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    e = res.get("e2e") or {}
    sub = ""
    if e.get("median"):
        sub = (f"; Store e2e: {e['tokens']} tokens filled from the cluster in {e['median']['cold_acquire_s'] * 1e3:.0f} ms"
               + (f" = 1/{e['prefill_over_cold_acquire']:.0f} of the CPU prefill" if e.get("prefill_over_cold_acquire")
                  else ""))
    fig.suptitle(f"remote tier fetch throughput on a 6-node Redis Cluster (loopback, {os.cpu_count()} cores)\n{sub.lstrip('; ')}",
                 fontsize=10)
    save_figure(fig, path)


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 MiB only, 2 rounds, 1024-token e2e, no LMCache (~25 s)")
    p.add_argument("--sizes", default=None, help="comma-separated: 2MiB,16MiB (default both; quick 2MiB)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 12; quick 2)")
    p.add_argument("--round-mib", type=int, default=None, help="bytes per contender per round (default 128; quick 16)")
    p.add_argument("--e2e-reps", type=int, default=None, help="cold acquires, a fresh host B each (default 5; quick 1)")
    p.add_argument("--lmcache-venv", default=DEFAULT_LMCACHE_VENV,
                   help="throwaway venv with lmcache (default %(default)s); never the project's")
    p.add_argument("--setup-lmcache", action="store_true", help="create that venv first (pip, 10-minute cap)")
    p.add_argument("--no-lmcache", action="store_true")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=5.0,
                   help="socket timeout of the throughput rows' clients, ours and raw (the tier's default is 0.5 s)")
    p.add_argument("--out", default=None, help=f"results directory (default {RESULTS_DIR})")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 12)
    args.round_bytes = (args.round_mib or (16 if args.quick else 128)) * MiB
    args.e2e_reps = args.e2e_reps or (1 if args.quick else 5)
    args.miss_rounds = 2 if args.quick else 6
    args.miss_reps_per_round = 10 if args.quick else 40
    sizes = (args.sizes or ("2MiB" if args.quick else "2MiB,16MiB")).split(",")
    bad = set(sizes) - set(SIZES)
    if bad:
        p.error(f"unknown --sizes {sorted(bad)}; choose from {sorted(SIZES)}")
    install_sigterm_exit()

    import kvcached  # noqa: F401 - fails early without the package

    if not (REDIS_SERVER and REDIS_CLI):
        print("redis-server / redis-cli not found: this benchmark needs them", file=sys.stderr)
        return 2
    import redis
    import redis.utils

    venv_labels = {os.path.abspath(args.lmcache_venv): "<lmcache venv>"}
    notes: list[str] = []
    res: dict = {
        "question": " ".join(__doc__.strip().split("\n\n")[0].split()),
        "parameters": {"sizes": sizes, "configs": [cfg_name(t, k) for t, k in (CONFIGS_QUICK if args.quick else CONFIGS_FULL)],
                       "rounds": args.rounds, "round_bytes": args.round_bytes, "e2e_reps": args.e2e_reps,
                       "miss_rounds": args.miss_rounds, "miss_reps_per_round": args.miss_reps_per_round,
                       "seed": args.seed, "cluster": "6 nodes (3 primaries + 3 replicas), loopback, bench/harness/redis_servers.py",
                       "remote_timeout_s": 0.5, "throughput_rows_timeout_s": args.timeout, "redis_py": redis.__version__,
                       "hiredis": bool(getattr(redis.utils, "HIREDIS_AVAILABLE", False))},
        "fetch": {}, "notes": notes,
    }
    lm: dict = {"status": "skipped"}
    if args.quick or args.no_lmcache:
        lm["reason"] = "--quick" if args.quick else "--no-lmcache"
    else:
        if args.setup_lmcache:
            lm["setup"] = s = setup_lmcache_venv(args.lmcache_venv)
            if s.get("error"):
                lm["reason"] = _clean(s["error"], venv_labels)
        py = os.path.join(args.lmcache_venv, "bin", "python")
        if "reason" not in lm and not os.path.exists(py):
            lm["reason"] = (f"no LMCache venv at {args.lmcache_venv}: run with --setup-lmcache (pip download lmcache, then a "
                            "throwaway venv with torch==2.13.0 and lmcache)")
            lm["reason"] = _clean(lm["reason"], venv_labels)
    res["lmcache"] = lm
    tmp = tempfile.mkdtemp(prefix="kvc-bench-remote-")
    cluster = RedisCluster(os.path.join(tmp, "cluster"))
    lmc: LMCacheProc | None = None
    try:
        if "reason" not in lm:  # started first: its imports overlap the cluster's start
            lmc = LMCacheProc(os.path.join(args.lmcache_venv, "bin", "python"), tmp)
        t0 = time.perf_counter()
        cluster.start()
        res["parameters"]["cluster_start_s"] = time.perf_counter() - t0
        if lmc is not None:
            a = lmc.answer(timeout=180)
            if a.get("ready"):
                lm.update(status="ran", versions=a.get("versions"))
            else:
                lm["reason"] = _clean(a.get("error", "no ready line") + " | " + lmc.log_tail(400), venv_labels)
                lmc.close()
                lmc = None
        phases = res["phase_seconds"] = {"cluster_start": res["parameters"]["cluster_start_s"]}
        for size in sizes:
            print(f"fetch {size} ...", flush=True)
            t_phase = time.perf_counter()
            fb = FetchBench(size, cluster, args, lmc, notes)
            try:
                m = fb.measure()
            finally:
                fb.close()
            m["verdicts"] = fetch_verdicts(m, fb.configs)
            res["fetch"][size] = m
            phases[f"fetch {size} (setup + rounds + cleanup)"] = time.perf_counter() - t_phase
            if lmc is not None and not fb.lmc_ok:
                lm["status"] = "partly"
        print("end to end through a Store ...", flush=True)
        t_phase = time.perf_counter()
        res["e2e"] = measure_e2e(cluster, args, notes)
        phases["e2e"] = time.perf_counter() - t_phase
        print("misses / Bloom filter ...", flush=True)
        t_phase = time.perf_counter()
        res["miss"] = measure_miss(cluster, args, notes)
        phases["misses"] = time.perf_counter() - t_phase
        try:
            info = redis.Redis(port=cluster.startup_nodes[0][1]).info("memory")
            res["redis_used_memory_peak_bytes_node0"] = info.get("used_memory_peak")
        except Exception:  # noqa: BLE001
            pass
    finally:
        if lmc is not None:
            lmc.close()
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    import resource

    res["bench_max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    targets: dict = {}
    for size, m in res["fetch"].items():
        for cn, v in m["verdicts"].items():
            if isinstance(v, dict) and "kvcached_over_redis_py" in v and not cn.endswith("x1"):
                targets[f"{size} {cn}: kvcached fetch >= {TARGET_OVER_RAW}x redis-py GET"] = {
                    "value": v["kvcached_over_redis_py"], "min": TARGET_OVER_RAW,
                    "met": v["kvcached_over_redis_py"] >= TARGET_OVER_RAW}
    for size, m in res["fetch"].items():  # issue 17: >= 2x LMCache's Redis backend, several chunks in flight
        if size != "16MiB":
            continue
        vs = [v["kvcached_over_lmcache"] for cn, v in m["verdicts"].items()
              if isinstance(v, dict) and v.get("kvcached_over_lmcache") and not cn.endswith("x1")]
        if vs:
            targets[f"16MiB: kvcached fetch >= {TARGET_OVER_LMCACHE}x LMCache redis-cluster (worst of the "
                    "multi-chunk configs)"] = {"value": min(vs), "min": TARGET_OVER_LMCACHE,
                                               "met": min(vs) >= TARGET_OVER_LMCACHE}
        # per core used: the reading process's CPU per GB (LMCache's child measures its own)
        pc = [v["gb_per_client_cpu_s"]["kvcached"] / v["gb_per_client_cpu_s"]["lmcache"]
              for cn, v in m["verdicts"].items() if isinstance(v, dict) and not cn.endswith("x1")
              and {"kvcached", "lmcache"} <= set(v.get("gb_per_client_cpu_s", {}))]
        if pc:
            targets[f"16MiB: kvcached GB per client CPU-second >= {TARGET_OVER_LMCACHE}x LMCache's (worst of the "
                    "multi-chunk configs)"] = {"value": min(pc), "min": TARGET_OVER_LMCACHE,
                                               "met": min(pc) >= TARGET_OVER_LMCACHE}
    e2e = res.get("e2e") or {}
    if e2e.get("direct_over_redis_py_reader"):
        x = e2e["direct_over_redis_py_reader"]
        targets[f"end-to-end fill GB/s: direct reader >= {TARGET_OVER_BEFORE}x the redis-py reader (the path before)"] = {
            "value": x["gb_s"], "min": TARGET_OVER_BEFORE, "met": x["gb_s"] >= TARGET_OVER_BEFORE}
        targets[f"end-to-end fill GB per client CPU-second: direct reader >= {TARGET_OVER_BEFORE}x the redis-py reader"] = {
            "value": x["gb_per_client_cpu_s"], "min": TARGET_OVER_BEFORE,
            "met": x["gb_per_client_cpu_s"] >= TARGET_OVER_BEFORE}
    if e2e.get("prefill_over_cold_acquire"):
        targets["cross-host hit of an 8k-token prompt cheaper than its prefill (bench/ttft.py's CPU model, "
                "same KV geometry)"] = {"value": e2e["prefill_over_cold_acquire"], "min": 1.0,
                                        "met": e2e["prefill_over_cold_acquire"] > 1.0}
    if e2e.get("cold_acquire_gb_s"):
        # No GPU here: the GPU comparison is a stated assumption, as break-even bandwidth. A remote
        # fill is cheaper than recomputing when it moves KV faster than the GPU makes it:
        # fetch GB/s > KV bytes per token x prefill tokens/s.
        gb_s = e2e["cold_acquire_gb_s"]
        per_core = e2e["by_reader"]["direct"]["gb_per_client_cpu_s"]
        gpu = {}
        for model, kv_per_token, tps in GPU_PREFILL_ASSUMPTIONS:
            need = kv_per_token * tps / 1e9
            # The sizing rule: a fill's CPU work is the client's (the Redis nodes are other hosts in
            # production), so a host fills at about per_core x the cores it gives the daemon.
            gpu[model] = {"kv_bytes_per_token": kv_per_token, "assumed_prefill_tokens_per_s": tps,
                          "break_even_gb_s": need, "measured_fill_gb_s": gb_s, "fill_over_break_even": gb_s / need,
                          "measured_gb_per_client_cpu_s": per_core,
                          "client_cores_to_break_even": math.ceil(need / per_core)}
        res["gpu_break_even"] = {"assumption": GPU_ASSUMPTION_NOTE, "models": gpu}
        for model, g in gpu.items():
            targets[f"cross-host hit cheaper than prefill on a GPU: {model} (assumed rate, see gpu_break_even)"] = {
                "value": g["fill_over_break_even"], "min": 1.0, "met": g["fill_over_break_even"] > 1.0}
    targets["all_met"] = all(t["met"] for t in targets.values()) if targets else None
    if not targets or targets["all_met"] is None:
        notes.append("no 16 MiB rows in this run: the target is not evaluated")
    res["targets"] = targets
    res["conclusions"] = conclusions(res)
    res["quick"] = args.quick
    print_report(res)
    name = "remote_tier.quick" if args.quick else "remote_tier"
    out_dir = args.out or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    png = os.path.join(out_dir, f"{name}.png")
    plot(res, png)
    path = write_json(name, json.loads(_clean(json.dumps(res, default=str), venv_labels)), args.out)
    print(f"\nwrote {path}\nwrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
