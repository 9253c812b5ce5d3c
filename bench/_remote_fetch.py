"""remote_tier.py's shared settings and part 1, fetch throughput: ``RemoteRedisTier.fetch`` (the
direct reader and the redis-py reader) against raw redis-py GETs, plain sockets and LMCache, with
the per-CPU-second figures and the verdicts. Not a benchmark itself: ``bench/remote_tier.py`` runs it."""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import statistics
import tempfile
import time

from bench._common import REPO_ROOT, ratio
from bench.harness.lmcache_proc import LMCacheProc
from bench.harness.redis_servers import redis_cpu_s
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

def clean_paths(text: str, extra: dict[str, str] | None = None) -> str:
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
                notes.append(f"{size}: LMCache rows skipped: " + clean_paths(a.get("error") or "its read-back did not verify"))
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
