"""Question: does background write-back keep puts into a *full* pool as fast as puts into an
empty one (or, where the disk is the limit, keep the disk as busy as a plain sequential write),
and does it keep a reader's acquire latency unchanged while it runs?

Setup: the real in-process ``Store`` (real shared-memory pool, real LMDB NVMe tier in a temp dir
under /tmp, i.e. on the same disk as a plain file there), one layout of 1 MiB chunks (8 layers,
4 KV heads, head_dim 64, float16, 128 tokens per chunk), prompts of 8 chunks (8 MiB, 1,024
tokens) of random tokens, payloads random bytes. Pool 256 MiB, NVMe 4 GiB (quick: 32 / 512 MiB).
Every put is what a kvcached client does: ``reserve`` (store lock), copy the 8 chunks into the
mapped pool (``HostPoolMapping``, no store lock), ``commit``; one put = one new prompt. Every
put is checked to have reserved all 8 chunks.

Contenders, all in one run, a fresh store (and LMDB directory) for each, their order rotated
rep by rep:

* ``empty``       N puts into a pool with room for all of them (N = 3/4 of the pool), the
                  write-back thread never wakes. 3 batches of N with an untimed ``evict`` between.
* ``full/writeback``  fill the pool first (pool / 8 MiB puts; the writer settles), then N more
                  puts, each of which needs room: the default, ``writeback=True``, the writer
                  demotes LRU chunks in batches (one LMDB transaction + one sync each) with the
                  disk I/O outside the store lock; a reservation that finds no room waits for it.
* ``full/sync``   the same with ``writeback=False``: each reservation demotes its victims itself,
                  one fsync'd transaction per chunk, under the store lock (the old behaviour).

Then, on each full store (its writer settled, the reader's prompt acquired once so it is in the
pool), a reader thread loops ``acquire`` + ``release`` of one cached, pool-resident 8-chunk
prompt with a ``--reader-gap-us`` sleep between pairs (a paced client, so it does not just hog
the GIL), timing each call with ``perf_counter_ns`` (gc off):

* ``idle``        nothing else runs (on the write-back store: its writer asleep)
* ``busy/writeback`` while the main thread puts N more prompts into the full write-back pool
* ``busy/sync``   the same on the ``writeback=False`` store: demotions hold the store lock
* ``busy/writeback, store.put`` (info) the same puts through ``Store.put``, which copies the
                  payload under the store lock (an in-process writer; the daemon's clients copy
                  outside it, as above)
* ``busy, room free`` the same puts at the same rate into the write-back store emptied first, so
                  they all fit (no eviction, no write-back: checked): what the puts' own store
                  work costs the reader. ``busy/writeback`` over this is write-back's own share.

The reader's promotions from NVMe are counted (expected 0: its prompt stays pool-resident).
Note: CPython's GIL serialises the threads, so any busy put thread slows the reader somewhat;
``busy/sync`` shows what write-back buys against that baseline.

NVMe write bandwidth: bytes demoted during the full-pool run per second (write-back:
``writeback_bytes`` (+ ``sync_demotions`` x chunk) over the N puts plus the writer's drain after
them; sync: ``demotions`` x chunk over the puts), against a plain sequential write of the same
number of bytes to a file in the LMDB directory, ``os.write`` in 64 MiB pieces with one
``os.fdatasync`` per piece (the batch size, ``writeback_batch_bytes``), made right after each
full-pool run (ratios are paired per rep). This VM's disk has two speeds: blocks it has not
written lately go at ~250-400 MB/s, blocks just written (a file overwritten in place, or freed
and reallocated) at ~1,500-2,500 MB/s, and which ones ext4 hands a growing LMDB file or a new
file is not under the benchmark's control. So the plain write is made twice: a new file
(``plain_write``, the reference for the target, like LMDB's growing file), then the same file
overwritten in place (``plain_rewrite``, the disk's fast mode); and on the sync store a new file
in 1 MiB pieces, one fdatasync each (``plain_write_per_chunk``, the synchronous path's pattern).

Each figure is the median over ``--reps`` reps (quick: 1); latency percentiles are per rep, then
the median over reps. Printed with the counters that explain them.

Targets: full/writeback puts/s >= 0.8x empty, or, when the disk is the limit (empty puts/s x
8 MiB > the plain write's bandwidth), write-back's NVMe bandwidth >= 0.7x the plain write;
acquire p99 while write-back runs <= 1.2x idle. The script states whether each is met.

Run:   .venv/bin/python bench/writeback.py            (~1-2 min on a 2-core box)
       .venv/bin/python bench/writeback.py --quick    (a few seconds; writes *.quick.json/png)
Output: bench/results/writeback.json, bench/results/writeback.png
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file: import bench

import numpy as np
from bench._common import RESULTS_DIR, bench_parser, format_table, ratio, save_figure, subplots, summarize_ns, write_json

from kvcached.config import MiB, StoreConfig
from kvcached.contract.keys import KVLayout
from kvcached.store import Store
from kvcached.contract.poolmap import HostPoolMapping

LAYOUT = KVLayout("bench/wb@1", num_layers=8, num_kv_heads=4, head_dim=64, dtype="float16", chunk_tokens=128)
PROMPT_CHUNKS = 8
PROMPT_TOKENS = PROMPT_CHUNKS * LAYOUT.chunk_tokens
PLAIN_PIECE = 64 * MiB
TARGET_PUTS_RATIO = 0.8
TARGET_BW_RATIO = 0.7
TARGET_P99_RATIO = 1.2
EMPTY_BATCHES = 3

PUT_CASES = ("empty", "full/writeback", "full/sync")
#: reader phases: name -> (store case, key in that case's "latency")
LAT_PHASES = {
    "idle": ("full/writeback", "idle"),
    "busy/writeback": ("full/writeback", "busy"),
    "busy/sync": ("full/sync", "busy"),
    "idle (writeback=False store)": ("full/sync", "idle"),
    "busy/writeback, store.put": ("full/writeback", "busy, store.put"),
    "busy, memcpy only (GIL control)": ("full/writeback", "memcpy only"),
    "busy, room free (same puts, no write-back)": ("full/writeback", "room free"),
}
COUNTERS = ("writeback_batches", "writeback_chunks", "writeback_bytes", "sync_demotions", "writeback_waits",
            "writeback_wait_seconds", "writeback_wait_timeouts", "demotions", "pool_evictions",
            "not_reserved_chunks", "promotions")


class Bench:
    """One store (fresh temp dir) plus the helpers to put prompts and time a reader."""

    def __init__(self, args: argparse.Namespace, *, writeback: bool, rng: np.random.Generator, payload: memoryview):
        self.args = args
        self.dir = tempfile.mkdtemp(prefix="kvc-bench-wb-")
        self.cfg = StoreConfig(
            state_dir=os.path.join(self.dir, "state"),
            pool_bytes=args.pool_mib * MiB,
            nvme_bytes=args.nvme_mib * MiB,
            writeback=writeback,
            cache_ttl=1e9,
            lease_ttl=1e9,
            reservation_ttl=1e9,
        )
        self.store = Store(self.cfg)
        self.lid = self.store.register_layout(LAYOUT)
        self.map = HostPoolMapping(self.store.pool_handle())
        self.rng = rng
        self.payload = payload
        self._payload_np = np.frombuffer(payload, dtype=np.uint8)
        self.partial = 0  # puts that could not reserve every chunk

    @property
    def nvme_dir(self) -> str:
        return os.path.join(self.cfg.state_dir, "nvme", self.cfg.domain)

    def close(self) -> None:
        try:
            self.map.close()
            self.store.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def tokens(self) -> np.ndarray:
        return self.rng.integers(0, 128_000, PROMPT_TOKENS, dtype=np.uint32)

    def put_client(self, toks: np.ndarray) -> None:
        """reserve / copy into the mapped pool outside the store lock / commit. The copy is
        numpy's, which releases the GIL, as the client library's torch copy does: a real client
        is another process and never holds the daemon's GIL. (A memoryview slice assignment
        holds it for each whole 1 MiB copy, and the reader then measures this benchmark's own
        writer thread rather than write-back: 2.5-3x idle at p99 in runs made that way.)"""
        store, payload = self.store, self._payload_np
        pool = np.frombuffer(self.map.view, dtype=np.uint8)
        r = store.reserve(self.lid, toks, open_empty=False)
        if len(r.slots) != PROMPT_CHUNKS:
            self.partial += 1
        for loc in r.slots:
            np.copyto(pool[loc.offset: loc.offset + loc.nbytes], payload)
        if r.reservation_id:
            store.commit(r.reservation_id)

    def put_store(self, toks: np.ndarray) -> None:
        """Store.put: the same, with the copy under the store lock."""
        r = self.store.put(self.lid, toks, [self.payload] * PROMPT_CHUNKS)
        if r.committed_chunks != PROMPT_CHUNKS:
            self.partial += 1

    def puts(self, n: int, put=None) -> tuple[float, list[int]]:
        """``n`` new prompts; (seconds, per-put ns). Tokens are drawn before timing."""
        put = put or self.put_client
        toks = [self.tokens() for _ in range(n)]
        pc = time.perf_counter_ns
        each: list[int] = []
        t0 = time.perf_counter()
        for t in toks:
            a = pc()
            put(t)
            each.append(pc() - a)
        return time.perf_counter() - t0, each

    def paced_puts(self, n: int, rate: float) -> dict:
        """``n`` new prompts at ``rate`` per second (tokens drawn first)."""
        toks = [self.tokens() for _ in range(n)]
        t0 = time.perf_counter()
        for i, t in enumerate(toks):
            self.put_client(t)
            left = t0 + (i + 1) / rate - time.perf_counter()
            if left > 0:
                time.sleep(left)
        return {"puts_per_s": n / (time.perf_counter() - t0), "paced_at": rate, "counters": {"sync_demotions": 0}}

    def counters(self) -> dict:
        c = self.store.stats().counters
        return {k: getattr(c, k) for k in COUNTERS}

    def settle(self, timeout: float = 60.0) -> float:
        """Wait until the write-back thread has nothing to do (no batch in flight, free space at
        or above the low watermark). Seconds waited. Reads the writer's state under the store lock."""
        wb = self.store.writeback
        if wb is None or not wb.running:
            return 0.0
        low = int(self.cfg.writeback_low * self.store.pool.capacity_bytes)
        t0 = time.perf_counter()
        while True:
            with self.store._lock:
                if not wb.busy and self.store.pool.free_bytes >= low:
                    return time.perf_counter() - t0
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"the write-back thread did not settle within {timeout:.0f} s "
                                   f"(free {self.store.pool.free_bytes} < low {low}, busy={wb.busy})")
            time.sleep(0.002)

    def fill(self) -> None:
        """Put prompts until the pool is full: the next put must make room."""
        n = self.store.pool.capacity_bytes // (PROMPT_CHUNKS * LAYOUT.chunk_bytes)
        self.puts(n)
        self.settle()

    # -- reader ---------------------------------------------------------------------------------

    def reader_prompt(self) -> np.ndarray:
        toks = self.tokens()
        self.put_client(toks)
        return toks

    def warm_reader(self, toks: np.ndarray) -> None:
        """Acquire once (promoting it if it was demoted) so the prompt is pool-resident and MRU."""
        r = self.store.acquire(self.lid, toks)
        self.store.release(r.lease_id)
        assert r.matched_tokens == PROMPT_TOKENS and min(r.offsets) >= 0, (r.matched_tokens, r.offsets)
        self.settle()

    def with_reader(self, toks: np.ndarray, work) -> dict:
        """Run ``work()`` on this thread while a reader thread loops acquire + release of ``toks``."""
        store, lid, gap = self.store, self.lid, self.args.reader_gap_us / 1e6
        acq: list[int] = []
        pair: list[int] = []
        misses = [0]
        errors: list[BaseException] = []
        stop = threading.Event()
        started = threading.Event()

        def loop() -> None:
            pc = time.perf_counter_ns
            try:
                started.set()
                while not stop.is_set():
                    t0 = pc()
                    r = store.acquire(lid, toks)
                    t1 = pc()
                    store.release(r.lease_id)
                    t2 = pc()
                    acq.append(t1 - t0)
                    pair.append(t2 - t0)
                    if r.matched_tokens != PROMPT_TOKENS:
                        misses[0] += 1
                    if gap:
                        time.sleep(gap)
            except BaseException as e:  # surfaced to the main thread
                errors.append(e)

        before = self.counters()
        th = threading.Thread(target=loop, name="bench-reader", daemon=True)
        gc.collect()
        gc.disable()
        try:
            th.start()
            started.wait()
            t0 = time.perf_counter()
            out = work()
            wall = time.perf_counter() - t0
        finally:
            stop.set()
            th.join(timeout=60)
            gc.enable()
        if th.is_alive():
            raise RuntimeError("the reader thread did not stop (store deadlock?)")
        if errors:
            raise errors[0]
        after = self.counters()
        return {
            "acquire": summarize_ns(acq), "acquire+release": summarize_ns(pair), "misses": misses[0],
            "wall_s": wall, "reader_promotions": after["promotions"] - before["promotions"],
            "work": out, "_acquire_ns": acq,
        }


def diff(a: dict, b: dict) -> dict:
    return {k: b[k] - a[k] for k in a}


def gil_control(n: int, rate: float, payload: memoryview) -> dict:
    """The put thread's copying alone, no store: ``n`` times 8 x 1 MiB into a private buffer
    (numpy's copy, as the puts make), paced at ``rate`` per second (what the busy write-back
    phase achieved). The reader's latency meanwhile is the floor that CPython's GIL sets for
    any busy writer thread."""
    scratch = np.empty(PROMPT_CHUNKS * LAYOUT.chunk_bytes, dtype=np.uint8)
    src = np.frombuffer(payload, dtype=np.uint8)
    cb = LAYOUT.chunk_bytes
    t0 = time.perf_counter()
    for i in range(n):
        for k in range(PROMPT_CHUNKS):
            np.copyto(scratch[k * cb: (k + 1) * cb], src)
        left = t0 + (i + 1) / rate - time.perf_counter()
        if left > 0:
            time.sleep(left)
    return {"puts_per_s": n / (time.perf_counter() - t0), "paced_at": rate, "counters": {"sync_demotions": 0}}


def plain_write(directory: str, nbytes: int, buf: memoryview, piece_bytes: int, *, rewrite: bool = False) -> float:
    """Sequential write of ``nbytes`` in ``piece_bytes`` pieces, one fdatasync per piece; seconds.
    A new file (kept for a ``rewrite``), or with ``rewrite`` the kept file overwritten in place
    (then deleted): blocks the disk has just written."""
    path = os.path.join(directory, "plain-write.bin")
    fd = os.open(path, os.O_WRONLY if rewrite else os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        left = nbytes
        while left > 0:
            piece = buf[: min(left, piece_bytes)]
            done = 0
            while done < piece.nbytes:
                done += os.write(fd, piece[done:])
            os.fdatasync(fd)
            left -= piece.nbytes
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        if rewrite:
            os.unlink(path)


def run_empty(args, rng, payload) -> dict:
    b = Bench(args, writeback=True, rng=rng, payload=payload)
    try:
        secs = 0.0
        each: list[int] = []
        c0 = b.counters()
        for i in range(EMPTY_BATCHES):
            gc.collect()
            gc.disable()
            try:
                s, e = b.puts(args.puts)
            finally:
                gc.enable()
            secs += s
            each += e
            b.store.evict()
        c = diff(c0, b.counters())
        assert b.store.pool.free_bytes == b.store.pool.capacity_bytes
        n = EMPTY_BATCHES * args.puts
        return {"puts": n, "seconds": secs, "puts_per_s": n / secs, "put": summarize_ns(each),
                "counters": c, "partial_puts": b.partial}
    finally:
        b.close()


def run_full(args, rng, payload, plain_buf, *, writeback: bool) -> dict:
    b = Bench(args, writeback=writeback, rng=rng, payload=payload)
    try:
        reader = b.reader_prompt()
        b.fill()
        chunk = LAYOUT.chunk_bytes
        # -- throughput: N puts into the full pool -------------------------------------------
        c0 = b.counters()
        gc.collect()
        gc.disable()
        try:
            secs, each = b.puts(args.puts)
            c1 = b.counters()
            drain = b.settle()
        finally:
            gc.enable()
        c_puts, c_all = diff(c0, c1), diff(c0, b.counters())
        demoted = c_all["writeback_bytes"] + c_all["sync_demotions"] * chunk if writeback else c_all["demotions"] * chunk
        bw_secs = secs + drain
        out = {
            "puts": args.puts, "seconds": secs, "puts_per_s": args.puts / secs, "put": summarize_ns(each),
            "drain_seconds": drain, "counters": c_puts, "counters_with_drain": c_all,
            "demoted_bytes": demoted, "nvme_write_mb_s": demoted / bw_secs / 1e6 if bw_secs else float("nan"),
            "mean_batch_bytes": (c_all["writeback_bytes"] / c_all["writeback_batches"]
                                 if c_all["writeback_batches"] else None),
        }
        # -- plain writes of the same bytes, same directory, right after (the disk drifts) ------
        if demoted:
            for key, piece, rewrite in (("plain_write", PLAIN_PIECE, False), ("plain_rewrite", PLAIN_PIECE, True),
                                        ("plain_write_per_chunk", chunk, False)):
                if key == "plain_write_per_chunk" and writeback:
                    continue  # what the synchronous path does (one sync per chunk): its store only
                s = plain_write(b.nvme_dir, demoted, plain_buf, piece, rewrite=rewrite)
                if key == "plain_write_per_chunk":
                    os.unlink(os.path.join(b.nvme_dir, "plain-write.bin"))
                out[key] = {"bytes": demoted, "piece_bytes": piece, "seconds": s, "mb_s": demoted / s / 1e6}
        # -- reader latency ---------------------------------------------------------------------
        b.warm_reader(reader)
        lat = {}
        lat["idle"] = b.with_reader(reader, lambda: time.sleep(args.idle_s))
        b.settle()

        def busy(put=None):
            c = b.counters()
            s, e = b.puts(args.puts, put)
            return {"puts_per_s": args.puts / s, "put": summarize_ns(e), "counters": diff(c, b.counters())}

        lat["busy"] = b.with_reader(reader, busy)
        b.settle()
        if writeback:
            lat["busy, store.put"] = b.with_reader(reader, lambda: busy(b.put_store))
            b.settle()
            rate = lat["busy"]["work"]["puts_per_s"]
            lat["memcpy only"] = b.with_reader(reader, lambda: gil_control(args.puts, rate, payload))
            # The same puts at the same rate into this pool emptied first, so that they all fit:
            # what the puts' own store work costs the reader, with no eviction or write-back.
            b.store.evict()
            fresh = b.reader_prompt()
            b.warm_reader(fresh)
            c1 = b.counters()
            fits = int((1 - b.cfg.writeback_low) * b.store.pool.capacity_bytes) // (PROMPT_CHUNKS * LAYOUT.chunk_bytes) - 2
            lat["room free"] = b.with_reader(fresh, lambda: b.paced_puts(min(args.puts, fits), rate))
            wrote = diff(c1, b.counters())
            assert wrote["writeback_batches"] == 0 and wrote["pool_evictions"] == 0, wrote  # as it claims
        out["latency"] = lat
        out["partial_puts"] = b.partial
        return out
    finally:
        b.close()


def med(xs):
    xs = [x for x in xs if x is not None]
    return float(np.median(xs)) if xs else float("nan")


def run(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    payload = memoryview(rng.integers(0, 256, LAYOUT.chunk_bytes, dtype=np.uint8).tobytes())
    plain_buf = memoryview(rng.integers(0, 256, PLAIN_PIECE, dtype=np.uint8).tobytes())
    reps: list[dict] = []
    t_start = time.perf_counter()
    if not args.quick:  # untimed: the first store, LMDB file and fsyncs of a process run slow here
        warm = argparse.Namespace(**{**vars(args), "pool_mib": 32, "nvme_mib": 512, "puts": 3, "idle_s": 0.05})
        for case in PUT_CASES:
            run_empty(warm, rng, payload) if case == "empty" else run_full(warm, rng, payload, plain_buf,
                                                                            writeback=case == "full/writeback")
    for rep in range(args.reps):
        order = list(PUT_CASES[rep % 3:] + PUT_CASES[: rep % 3])
        r: dict = {"order": order}
        for case in order:
            if case == "empty":
                r[case] = run_empty(args, rng, payload)
            else:
                r[case] = run_full(args, rng, payload, plain_buf, writeback=case == "full/writeback")
        reps.append(r)
        print(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{c} {r[c]['puts_per_s']:.1f} puts/s" for c in PUT_CASES),
              flush=True)
    wall = time.perf_counter() - t_start
    return summarize(args, reps, wall)


def summarize(args, reps: list[dict], wall: float) -> dict:
    wb, sy, em = "full/writeback", "full/sync", "empty"
    puts = {c: {"median": med([r[c]["puts_per_s"] for r in reps]), "reps": [r[c]["puts_per_s"] for r in reps],
                "put_p50_ms_median": med([r[c]["put"]["p50_us"] / 1e3 for r in reps]),
                "put_p99_ms_median": med([r[c]["put"]["p99_us"] / 1e3 for r in reps])} for c in PUT_CASES}
    latency, cdf = {}, {}
    for name, (case, key) in LAT_PHASES.items():
        runs = [r[case]["latency"][key] for r in reps]
        latency[name] = {
            "acquire_p50_us": med([x["acquire"]["p50_us"] for x in runs]),
            "acquire_p90_us": med([x["acquire"]["p90_us"] for x in runs]),
            "acquire_p99_us": med([x["acquire"]["p99_us"] for x in runs]),
            "acquire+release_p50_us": med([x["acquire+release"]["p50_us"] for x in runs]),
            "acquire+release_p99_us": med([x["acquire+release"]["p99_us"] for x in runs]),
            "samples_per_rep": [x["acquire"]["n"] for x in runs],
            "misses": sum(x["misses"] for x in runs),
            "reader_promotions": sum(x["reader_promotions"] for x in runs),
            "puts_per_s_meanwhile": med([x["work"]["puts_per_s"] for x in runs]) if key != "idle" else None,
            "sync_demotions_meanwhile": (sum(x["work"]["counters"]["sync_demotions"] for x in runs)
                                         if key != "idle" else None),
            "reps": [{k: v for k, v in x.items() if not k.startswith("_")} for x in runs],
        }
        cdf[name] = sorted(v for x in runs for v in x["_acquire_ns"])
    idle99 = latency["idle"]["acquire_p99_us"]
    lat_ratios = {
        "p99_busy_writeback_over_idle": ratio(latency["busy/writeback"]["acquire_p99_us"], idle99),
        "p99_busy_sync_over_idle": ratio(latency["busy/sync"]["acquire_p99_us"], idle99),
        "p99_busy_writeback_store_put_over_idle": ratio(latency["busy/writeback, store.put"]["acquire_p99_us"], idle99),
        "p99_busy_sync_over_busy_writeback": ratio(latency["busy/sync"]["acquire_p99_us"],
                                                   latency["busy/writeback"]["acquire_p99_us"]),
        "p99_room_free_over_idle": ratio(latency["busy, room free (same puts, no write-back)"]["acquire_p99_us"], idle99),
        "p99_busy_writeback_over_room_free": ratio(latency["busy/writeback"]["acquire_p99_us"],
                                                   latency["busy, room free (same puts, no write-back)"]["acquire_p99_us"]),
        "p99_memcpy_only_over_idle": ratio(latency["busy, memcpy only (GIL control)"]["acquire_p99_us"], idle99),
        "p99_busy_writeback_over_memcpy_only": ratio(latency["busy/writeback"]["acquire_p99_us"],
                                                     latency["busy, memcpy only (GIL control)"]["acquire_p99_us"]),
        "p50_busy_writeback_over_idle": ratio(latency["busy/writeback"]["acquire_p50_us"], latency["idle"]["acquire_p50_us"]),
        "p50_busy_sync_over_idle": ratio(latency["busy/sync"]["acquire_p50_us"], latency["idle"]["acquire_p50_us"]),
    }
    plain_wb = [r[wb].get("plain_write", {}).get("mb_s") for r in reps]  # right after each store's run
    plain_sy = [r[sy].get("plain_write", {}).get("mb_s") for r in reps]
    plain_1m = [r[sy].get("plain_write_per_chunk", {}).get("mb_s") for r in reps]
    rew_wb = [r[wb].get("plain_rewrite", {}).get("mb_s") for r in reps]
    rew_sy = [r[sy].get("plain_rewrite", {}).get("mb_s") for r in reps]
    bw = {
        "writeback_mb_s": med([r[wb]["nvme_write_mb_s"] for r in reps]),
        "sync_mb_s": med([r[sy]["nvme_write_mb_s"] for r in reps]),
        "plain_write_mb_s": med(plain_wb + plain_sy),
        "plain_write_per_chunk_mb_s": med(plain_1m),
        "plain_rewrite_mb_s": med(rew_wb + rew_sy),
        "writeback_reps": [r[wb]["nvme_write_mb_s"] for r in reps],
        "sync_reps": [r[sy]["nvme_write_mb_s"] for r in reps],
        "plain_reps": plain_wb + plain_sy,
        "plain_per_chunk_reps": plain_1m,
        "plain_rewrite_reps": rew_wb + rew_sy,
        "demoted_bytes_writeback": med([r[wb]["demoted_bytes"] for r in reps]),
        "demoted_bytes_sync": med([r[sy]["demoted_bytes"] for r in reps]),
        "drain_seconds_writeback": med([r[wb]["drain_seconds"] for r in reps]),
        "mean_batch_bytes": med([r[wb]["mean_batch_bytes"] for r in reps]),
    }
    # Paired: each run against the plain write made right after it in the same directory (the
    # disk's speed drifts by 2-3x over seconds here), then the median over reps.
    bw_ratios = {
        "writeback_over_plain": med([ratio(r[wb]["nvme_write_mb_s"], x) for r, x in zip(reps, plain_wb) if x]),
        "sync_over_plain": med([ratio(r[sy]["nvme_write_mb_s"], x) for r, x in zip(reps, plain_sy) if x]),
        "sync_over_plain_per_chunk": med([ratio(r[sy]["nvme_write_mb_s"], x) for r, x in zip(reps, plain_1m) if x]),
        "writeback_over_sync": ratio(bw["writeback_mb_s"], bw["sync_mb_s"]),
        "writeback_over_plain_rewrite": med([ratio(r[wb]["nvme_write_mb_s"], x) for r, x in zip(reps, rew_wb) if x]),
        "sync_over_plain_rewrite": med([ratio(r[sy]["nvme_write_mb_s"], x) for r, x in zip(reps, rew_sy) if x]),
        "of_medians_writeback_over_plain": ratio(bw["writeback_mb_s"], bw["plain_write_mb_s"]),
    }
    counters = {}
    for c in (wb, sy):
        counters[c] = {k: med([r[c]["counters_with_drain"][k] for r in reps]) for k in COUNTERS}
        counters[c]["reps"] = [r[c]["counters_with_drain"] for r in reps]
        counters[c]["put_time_waiting_for_writer"] = med([r[c]["counters"]["writeback_wait_seconds"] / r[c]["seconds"]
                                                          for r in reps])
    counters[em] = {k: med([r[em]["counters"][k] for r in reps]) for k in COUNTERS}
    prompt_bytes = PROMPT_CHUNKS * LAYOUT.chunk_bytes
    puts_ratios = {
        "full_writeback_over_empty": ratio(puts[wb]["median"], puts[em]["median"]),
        "full_sync_over_empty": ratio(puts[sy]["median"], puts[em]["median"]),
        "full_writeback_over_full_sync": ratio(puts[wb]["median"], puts[sy]["median"]),
    }
    # Disk-bound: the empty pool's put rate needs more bytes/s than the plain write delivers.
    empty_mb_s = puts[em]["median"] * prompt_bytes / 1e6
    disk_bound = empty_mb_s > bw["plain_write_mb_s"]
    puts_ok = puts_ratios["full_writeback_over_empty"] >= TARGET_PUTS_RATIO
    bw_ok = bw_ratios["writeback_over_plain"] >= TARGET_BW_RATIO
    targets = {
        "full_ge_0.8x_empty": puts_ok,
        "disk_bound": disk_bound,
        "empty_needs_mb_s": empty_mb_s,
        "full_puts_per_s_at_plain_bandwidth": bw["plain_write_mb_s"] * 1e6 / prompt_bytes,
        "nvme_bw_ge_0.7x_plain": bw_ok,
        "puts_target_met": bool(puts_ok or (disk_bound and bw_ok)),
        "acquire_p99_le_1.2x_idle": lat_ratios["p99_busy_writeback_over_idle"] <= TARGET_P99_RATIO,
    }
    partial = {c: sum(r[c]["partial_puts"] for r in reps) for c in PUT_CASES}
    return {
        "question": " ".join(__doc__.strip().split("\n\n")[0].split()),
        "shape": {
            "layout": LAYOUT.to_dict(), "chunk_bytes": LAYOUT.chunk_bytes, "prompt_chunks": PROMPT_CHUNKS,
            "prompt_bytes": prompt_bytes, "pool_bytes": args.pool_mib * MiB, "nvme_bytes": args.nvme_mib * MiB,
            "puts_per_case": args.puts, "empty_batches": EMPTY_BATCHES, "reps": args.reps,
            "reader_gap_us": args.reader_gap_us, "idle_seconds": args.idle_s,
            "writeback_config": {k: getattr(StoreConfig(state_dir="/nonexistent"), k) for k in
                                 ("writeback_low", "writeback_high", "writeback_batch_bytes", "writeback_wait")},
            "plain_write_piece_bytes": PLAIN_PIECE,
            "tmp_dir": tempfile.gettempdir(),
        },
        "wall_seconds": wall,
        "puts_per_s": puts,
        "puts_ratios": puts_ratios,
        "partial_puts": partial,
        "latency": latency,
        "latency_ratios": lat_ratios,
        "bandwidth": bw,
        "bandwidth_ratios": bw_ratios,
        "counters": counters,
        "targets": targets,
        "_cdf": cdf,
    }


def print_report(res: dict) -> None:
    sh = res["shape"]
    print(f"\nwrite-back: {sh['prompt_chunks']}-chunk prompts of {sh['chunk_bytes'] >> 20} MiB chunks, pool "
          f"{sh['pool_bytes'] >> 20} MiB, NVMe {sh['nvme_bytes'] >> 20} MiB, {sh['puts_per_case']} puts per case, "
          f"{sh['reps']} reps (medians), {res['wall_seconds']:.0f} s\n")
    p = res["puts_per_s"]
    em = p["empty"]["median"]
    print(format_table(["puts into", "puts/s", "/ empty", "put p50 ms", "put p99 ms", "reps"],
                       [[c, p[c]["median"], ratio(p[c]["median"], em), p[c]["put_p50_ms_median"],
                         p[c]["put_p99_ms_median"], " ".join(f"{x:.0f}" for x in p[c]["reps"])] for c in PUT_CASES]))
    b = res["bandwidth"]
    print()
    br = res["bandwidth_ratios"]

    def reps_of(xs):
        return " ".join(f"{x:.0f}" for x in xs if x is not None)

    print(format_table(["NVMe writes", "MB/s", "/ plain (paired)", "reps"], [
        ["write-back (batched, outside the lock)", b["writeback_mb_s"], br["writeback_over_plain"],
         reps_of(b["writeback_reps"])],
        ["synchronous demotion (1 txn per chunk)", b["sync_mb_s"], br["sync_over_plain"], reps_of(b["sync_reps"])],
        ["plain os.write, fdatasync per 64 MiB", b["plain_write_mb_s"], 1.0, reps_of(b["plain_reps"])],
        ["  the same file rewritten in place", b["plain_rewrite_mb_s"],
         ratio(b["plain_rewrite_mb_s"], b["plain_write_mb_s"]), reps_of(b["plain_rewrite_reps"])],
        ["plain os.write, fdatasync per 1 MiB", b["plain_write_per_chunk_mb_s"],
         ratio(b["plain_write_per_chunk_mb_s"], b["plain_write_mb_s"]), reps_of(b["plain_per_chunk_reps"])],
    ]))
    print("  (/ plain: each run over the 64 MiB plain write made right after it, same directory; median of reps)")
    print(f"  over the in-place rewrite (the disk's fast mode): write-back {br['writeback_over_plain_rewrite']:.2f}x, "
          f"sync {br['sync_over_plain_rewrite']:.2f}x")
    mb = b["mean_batch_bytes"]
    print(f"  write-back demoted {b['demoted_bytes_writeback'] / 1e6:.0f} MB, mean batch "
          f"{mb / 1e6 if mb == mb else float('nan'):.1f} MB, drain after the last put {b['drain_seconds_writeback']:.2f} s")
    print("\ncounters (full-pool run incl. the writer's drain, median of reps):")
    cs = res["counters"]
    keys = ("writeback_batches", "writeback_chunks", "sync_demotions", "writeback_waits", "writeback_wait_seconds",
            "writeback_wait_timeouts", "demotions", "pool_evictions")
    print(format_table(["case", *keys], [[c, *(float(cs[c][k]) for k in keys)] for c in ("full/writeback", "full/sync")]))
    print(f"  full/writeback puts spent {cs['full/writeback']['put_time_waiting_for_writer']:.0%} of their time waiting "
          "for the writer (writeback_wait_seconds / put phase)")
    lat = res["latency"]
    print(f"\nreader acquire (+release) of a pool-resident {sh['prompt_chunks']}-chunk prompt, "
          f"{sh['reader_gap_us']} us between pairs:")
    print(format_table(["while", "p50 us", "p90 us", "p99 us", "pair p99 us", "p99 / idle", "puts/s meanwhile",
                        "samples", "promotions"],
                       [[k, v["acquire_p50_us"], v["acquire_p90_us"], v["acquire_p99_us"], v["acquire+release_p99_us"],
                         ratio(v["acquire_p99_us"], lat["idle"]["acquire_p99_us"]),
                         v["puts_per_s_meanwhile"] if v["puts_per_s_meanwhile"] is not None else float("nan"),
                         int(np.median(v["samples_per_rep"])), v["reader_promotions"]] for k, v in lat.items()]))
    t = res["targets"]
    pr = res["puts_ratios"]
    print(f"\ntargets:\n  full/writeback puts/s = {pr['full_writeback_over_empty']:.2f}x empty (>= {TARGET_PUTS_RATIO}x): "
          f"{'MET' if t['full_ge_0.8x_empty'] else 'not met'}; full/sync = {pr['full_sync_over_empty']:.2f}x, "
          f"write-back/sync = {pr['full_writeback_over_full_sync']:.2f}x")
    print(f"  disk-bound: {'yes' if t['disk_bound'] else 'no'} (empty puts need {t['empty_needs_mb_s']:.0f} MB/s, the "
          f"plain write gives {b['plain_write_mb_s']:.0f} MB/s = {t['full_puts_per_s_at_plain_bandwidth']:.1f} puts/s)")
    print(f"  write-back NVMe bandwidth = {res['bandwidth_ratios']['writeback_over_plain']:.2f}x the plain write "
          f"(>= {TARGET_BW_RATIO}x): {'MET' if t['nvme_bw_ge_0.7x_plain'] else 'not met'}")
    print(f"  -> puts target {'MET' if t['puts_target_met'] else 'NOT MET'}")
    lr = res["latency_ratios"]
    print(f"  acquire p99 while write-back runs = {lr['p99_busy_writeback_over_idle']:.2f}x idle (<= {TARGET_P99_RATIO}x): "
          f"{'MET' if t['acquire_p99_le_1.2x_idle'] else 'NOT MET'}; with writeback=False "
          f"{lr['p99_busy_sync_over_idle']:.2f}x idle (sync / write-back = {lr['p99_busy_sync_over_busy_writeback']:.2f}x)")
    print(f"  the same puts into a pool with room for them (no eviction, no write-back): reader p99 "
          f"{lr['p99_room_free_over_idle']:.2f}x idle; write-back's own share: "
          f"{lr['p99_busy_writeback_over_room_free']:.2f}x that")
    if any(res["partial_puts"].values()):
        print(f"  WARNING: puts that could not reserve every chunk: {res['partial_puts']}")


def plot(res: dict, path: str) -> None:
    fig, (ax1, ax2, ax3) = subplots(1, 3, figsize=(15, 4.6), gridspec_kw={"width_ratios": [1, 1.6, 1]})
    p = res["puts_per_s"]
    xs = np.arange(len(PUT_CASES))
    ax1.bar(xs, [p[c]["median"] for c in PUT_CASES], color=["#9ecae1", "#3182bd", "#e6550d"])
    for i, c in enumerate(PUT_CASES):
        ax1.plot([i] * len(p[c]["reps"]), p[c]["reps"], "k.", ms=4)
        ax1.text(i, p[c]["median"], f"{p[c]['median']:.0f}", ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(xs, ["empty pool", "full,\nwrite-back", "full,\nwriteback=False"], fontsize=8)
    ax1.set_ylabel("puts/s (8 MiB prompts)")
    ax1.set_title("put throughput", fontsize=9)
    ax1.grid(True, axis="y", alpha=0.3)
    styles = {"idle": ("k", "-"), "busy/writeback": ("#3182bd", "-"), "busy/sync": ("#e6550d", "-"),
              "idle (writeback=False store)": ("grey", ":"), "busy/writeback, store.put": ("#3182bd", "--"),
              "busy, memcpy only (GIL control)": ("#31a354", ":"),
              "busy, room free (same puts, no write-back)": ("#756bb1", "--")}
    for name, xs_ns in res["_cdf"].items():
        if not xs_ns:
            continue
        v = np.asarray(xs_ns) / 1e3
        y = np.arange(1, len(v) + 1) / len(v)
        col, ls = styles.get(name, (None, "-"))
        ax2.plot(v, y, color=col, ls=ls, lw=1.2,
                 label=f"{name}: p50 {res['latency'][name]['acquire_p50_us']:.0f}, p99 "
                       f"{res['latency'][name]['acquire_p99_us']:.0f} us")
    ax2.set_xscale("log")
    ax2.axhline(0.99, color="grey", lw=0.6, ls="--")
    ax2.set_xlabel("acquire latency (us, log)")
    ax2.set_ylabel("fraction of calls")
    ax2.set_title("reader acquire latency CDF (all reps)", fontsize=9)
    ax2.legend(fontsize=7, loc="lower right")
    ax2.grid(True, alpha=0.3)
    b = res["bandwidth"]
    vals = [b["writeback_mb_s"], b["sync_mb_s"], b["plain_write_mb_s"], b["plain_rewrite_mb_s"],
            b["plain_write_per_chunk_mb_s"]]
    per_rep = [b["writeback_reps"], b["sync_reps"], b["plain_reps"], b["plain_rewrite_reps"], b["plain_per_chunk_reps"]]
    ax3.bar(range(5), vals, color=["#3182bd", "#e6550d", "#31a354", "#74c476", "#a1d99b"])
    for i, v in enumerate(vals):
        xs_r = [x for x in per_rep[i] if x is not None]
        ax3.plot([i] * len(xs_r), xs_r, "k.", ms=4)
        ax3.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    ax3.set_xticks(range(5), ["write-back\n(batched)", "sync\ndemotion", "plain\n64 MiB\nnew file",
                              "plain\n64 MiB\nrewrite", "plain\n1 MiB\nnew file"], fontsize=7)
    ax3.set_ylabel("NVMe write MB/s")
    ax3.set_title("bytes demoted per second", fontsize=9)
    ax3.grid(True, axis="y", alpha=0.3)
    sh = res["shape"]
    fig.suptitle(f"kvcached write-back: pool {sh['pool_bytes'] >> 20} MiB, 1 MiB chunks, {sh['reps']} reps", fontsize=10)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, "small pool, one rep (a few seconds)")
    p.add_argument("--reps", type=int, default=None, help="repetitions of every case (default 7; quick 1)")
    p.add_argument("--pool-mib", type=int, default=None, help="pool size (default 256; quick 32)")
    p.add_argument("--nvme-mib", type=int, default=None, help="NVMe tier size (default 4096; quick 512)")
    p.add_argument("--puts", type=int, default=None, help="puts per case (default: 3/4 of the pool's prompts)")
    p.add_argument("--idle-s", type=float, default=None, help="idle reader phase (default 1.0; quick 0.3)")
    p.add_argument("--reader-gap-us", type=int, default=200, help="reader's sleep between acquire+release pairs")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    args.reps = args.reps or (1 if args.quick else 7)
    args.pool_mib = args.pool_mib or (32 if args.quick else 256)
    args.nvme_mib = args.nvme_mib or (512 if args.quick else 4096)
    args.puts = args.puts or max(1, (args.pool_mib * 3 // 4) // (PROMPT_CHUNKS * LAYOUT.chunk_bytes >> 20))
    args.idle_s = args.idle_s if args.idle_s is not None else (0.3 if args.quick else 1.0)
    res = run(args)
    res["quick"] = args.quick
    print_report(res)
    name = "writeback.quick" if args.quick else "writeback"
    out_dir = args.out or RESULTS_DIR
    png = os.path.join(out_dir, f"{name}.png")
    os.makedirs(out_dir, exist_ok=True)
    plot(res, png)
    res.pop("_cdf")
    path = write_json(name, res, args.out)
    print(f"\nwrote {path}\nwrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
