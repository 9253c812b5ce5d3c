"""Question: how fast does a client read one leased KV chunk (2 MiB and 16 MiB) into a buffer it
owns, from the mapped pool, from NVMe (through the daemon's promotion, or straight from the LMDB
file), over the gRPC bytes fallback and from Redis, next to a plain memcpy of the same size?

Setup, per chunk size: one real ``kvcached serve`` (own temp dir, default write-back) whose pool
is ``pool_bytes`` = P x chunk, so it holds exactly P = K + 16 chunks (packed pool); K chunks (K x chunk >= 64 MiB, more than the 32 MiB
L3 here) are put and pinned by held leases for the pool reads; M = 17 other chunks (one 128-token
prompt each) cycle through the 16 free chunk slots, so under LRU every acquire of the next one misses
the pool and is promoted from NVMe (checked with the daemon's promotion counter; after the warm-up
cycle every one of them has an NVMe copy, so no timed op writes NVMe). 16 MiB = Llama-3-8B (32
layers, 8 KV heads, head_dim 128, bf16, 128 tokens); 2 MiB = the same with 4 layers. Payloads are
random bytes; every contender's output is checked against them once before timing.

Contenders (one client-owned, preallocated torch tensor is the destination of every copy; torch
runs with 1 intra-op thread, see bench/README.md), interleaved round by round in a new random
order each round, with a 5 ms untimed pause between contenders:

* ``memcpy hot``           ``dst.copy_(src)``, the same two buffers every time (L3-warm at 2 MiB)
* ``memcpy cold``          ``dst.copy_(src[i])`` cycling over >= 64 MiB of sources (memory-bound)
* ``numpy copyto hot/cold`` the same with ``np.copyto``
* ``memcpy hot, N threads`` torch's default thread count (info: bimodal on a busy 2-core box)
* (a) ``pool hot``         ``dst.copy_(lease.chunk(0))``, one pinned chunk (view creation included)
* (a) ``pool hot, view reused`` the copy alone from a view made once; ``lease.chunk(0) alone``
                           the view creation alone (attribution)
* (a) ``pool cold``        the same, cycling over the K pinned chunks
* (b) ``nvme via promotion`` ``lease = c.acquire(...)``: the daemon reads LMDB (checksum checked) into
                           the pool; then ``dst.copy_(lease.chunk(0))``. Timed: acquire + copy;
                           ``+ release`` adds the Release RPC that must follow
* (c) ``nvme direct (LMDB)`` the client's own read-only LMDB env: read txn (buffers=True), get,
                           ``copy_verified`` (header check, then copy + XXH3-64 of the payload
                           fused, 1 MiB at a time), the data path alone: no RPC. Every record is
                           written by this daemon, so in format 2 (checked: ``nvme_record_formats``)
* (c') ``api Client(nvme_read=direct)`` the client library's direct mode, complete: acquire (the
                           daemon pins the NVMe-only chunk and returns its key), ``lease.chunk(0)``
                           (the library reads LMDB, checks, copies into a new tensor), then copy
                           into the buffer (``no copy``: keep the new tensor); ``+ release`` too.
                           Its chunks (4) are never promoted, so they stay NVMe-only (checked).
                           This row against (b) decides the client's default.
* (c) what-ifs:            ``no payload CRC``; ``isal CRC-32`` (same polynomial and values as
                           zlib.crc32, if the ``isal`` package is importable), also ``fused with
                           the copy`` (copy 1 MiB, CRC it while in cache, next: how format 1
                           records are read); ``+ 1 empty RPC`` (a lower bound for the control
                           call a real client would need to learn the key and pin the chunk). The
                           CRC rows check against the CRC-32 a format-1 record of the payload holds
* ``xxh3-64 / crc32 isal / crc32 zlib alone`` the payload checksum alone over one in-memory
                           buffer of the chunk size (attribution: format 2's XXH3-64 vs format
                           1's CRC-32, ratios in ``verdicts.checksum_alone``)
* (d) ``get_bytes (gRPC)`` ``c.get_bytes(layout, tokens)`` of a pool-resident chunk, then copy
* (e) ``redis GET``        GET of the same bytes from 127.0.0.1:6379 (SET once, key prefix
                           ``kvcached-bench:``, deleted at the end), then copy;
                           ``redis GET alone`` without the copy. Skipped if no Redis answers.

Targets from the issue: pool read >= 0.8x memcpy; NVMe (page cache warm) >= 0.6x memcpy; both
>= 10x the Redis GET. "memcpy" there is the faster of the torch and numpy rows (1 thread), hot
(strict) and cold (like for like: pool cold and NVMe reads touch memory that is not in cache);
Redis is ``redis GET`` + copy. The NVMe targets use the faster complete path, (b) or (c'), which
is also named as what the client's ``nvme_read`` default should be.

Run:   .venv/bin/python bench/chunk_read.py            (~1 min on a 2-core box)
       PYTHONPATH=/tmp/benchdeps .venv/bin/python bench/chunk_read.py   (with the isal what-ifs,
                                                         after pip install --target /tmp/benchdeps isal)
       .venv/bin/python bench/chunk_read.py --quick    (a few seconds; writes *.quick.json)
Output: bench/results/chunk_read.json
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
import warnings
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file: import bench

from bench._common import bench_parser, format_table, install_sigterm_exit, ratio, summarize_ns, write_results
from bench.harness.daemon import Daemon

import lmdb
import numpy as np
import torch
from kvcached_client import Client, KvcachedError, KVLayout

import xxhash

from kvcached.contract.record import copy_verified, decode_header, record_version

try:  # optional: a what-if row (drop-in CRC-32, same values as zlib.crc32)
    from isal import isal_zlib  # type: ignore
except ImportError:  # pragma: no cover - depends on the environment
    isal_zlib = None

MiB = 1 << 20
COLD_BYTES = 64 * MiB  # > the 32 MiB L3 of the box these numbers come from
CYCLE = 17  # chunks cycling through the pool's free chunk slots (16): every acquire misses
DIRECT = 4  # NVMe-only chunks the client API reads itself (never promoted, so they stay NVMe-only)
FREE_SLOTS = CYCLE - 1
REDIS_PREFIX = "kvcached-bench:"
API_DIRECT = "c' api Client(nvme_read=direct): acquire + copy_chunk(0, dst)"
API_DIRECT_ONLY = "c' api Client(nvme_read=direct): acquire + chunk(0), no copy"
SETTLE_S = 0.005  # untimed pause between contenders (lets spinning OpenMP workers go to sleep)
FUSE_PIECE = 1 * MiB  # the fused what-if copies and CRCs 1 MiB at a time (fits in L2 here)

TARGET_POOL = 0.8
TARGET_NVME = 0.6
TARGET_VS_REDIS = 10.0

# torch.frombuffer over read-only buffers (LMDB values, bytes) warns; we only read them.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

SIZES = {
    "16MiB": {"model": "bench/llama-3-8b-shape@1", "num_layers": 32, "num_kv_heads": 8, "head_dim": 128},
    "2MiB": {"model": "bench/llama-3-8b-4-layers@1", "num_layers": 4, "num_kv_heads": 8, "head_dim": 128},
}


def make_layout(size: str) -> KVLayout:
    return KVLayout(dtype="bfloat16", chunk_tokens=128, **SIZES[size])


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


class MissingRecords(RuntimeError):
    """Chunks the daemon counts on NVMe whose LMDB records this reader does not see (yet)."""


class Setup:
    """The daemon, the client, the chunks and every handle the contenders need."""

    def __init__(self, size: str, daemon: Daemon, args: argparse.Namespace) -> None:
        self.size = size
        self.d = daemon
        self.layout = make_layout(size)
        self.nbytes = self.layout.chunk_bytes
        self.n_pinned = max(1, math.ceil(COLD_BYTES / self.nbytes))
        self.rng = np.random.default_rng(args.seed)
        self.c = Client(daemon.socket, nvme_read="promote")  # the promotion contender (b) and the builder
        self.cd = None  # Client(nvme_read="direct"), if this client version has it
        self.crc_of: list[int] = []  # payload CRC-32 per chunk index (what a format-1 record stores)
        self.xxh_of: list[int] = []  # payload XXH3-64 per chunk index (what a format-2 record stores)
        self.tokens: list[np.ndarray] = []
        self.held: list = []
        self.env = None
        self.env_owned = False
        self.redis = None
        self.redis_key = None
        self.redis_url = args.redis_url
        self.notes: list[str] = []

    # -- building -------------------------------------------------------------------------

    def put_chunk(self) -> int:
        j = len(self.tokens)
        toks = self.rng.integers(0, 128_000, self.layout.chunk_tokens, dtype=np.uint32)
        payload = bytearray(self.rng.bytes(self.nbytes))
        kv = torch.frombuffer(payload, dtype=torch.bfloat16).view(
            2, self.layout.num_layers, self.layout.num_kv_heads, self.layout.chunk_tokens, self.layout.head_dim)
        assert self.c.put(self.layout, toks, kv).stored_chunks == 1
        self.tokens.append(toks)
        self.crc_of.append(zlib.crc32(payload))
        self.xxh_of.append(xxhash.xxh3_64_intdigest(payload))
        return j

    def build(self) -> None:
        # Put first and never touched again, so LRU pushes them out of the pool (write-back).
        self.direct = [self.put_chunk() for _ in range(DIRECT)]
        self.cycle = [self.put_chunk() for _ in range(CYCLE)]
        self.pinned = [self.put_chunk() for _ in range(self.n_pinned)]
        for j in self.pinned:
            lease = self.c.acquire(self.layout, self.tokens[j], ttl=3600)
            assert lease.matched_tokens == self.layout.chunk_tokens
            self.held.append(lease)
        # Two warm-up cycles: the first demotes every cycling chunk to NVMe (write-back), the
        # second leaves all of them with an NVMe copy, so timed evictions are plain deletes.
        for _ in range(2):
            for j in self.cycle:
                self.c.acquire(self.layout, self.tokens[j]).release()
        st = self.c.stats()
        self.stats_after_build = {k: st.get(k) for k in ("pool", "nvme", "counters")}
        if st["nvme"]["chunks"] < CYCLE:
            raise RuntimeError(f"only {st['nvme']['chunks']} chunks reached NVMe; expected >= {CYCLE}")
        # Write-back commits its LMDB batches in the background: a record counted above may not be
        # visible yet (seen once in CI, under load). Wait for every cycling chunk's record.
        deadline = time.monotonic() + 30
        while True:
            try:
                self.open_lmdb()
                break
            except MissingRecords:
                self.env.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.open_redis()
        try:
            self.cd = Client(self.d.socket, nvme_read="direct")
        except TypeError as e:  # a client without the direct NVMe read
            self.notes.append(f"Client(nvme_read='direct') rows skipped: {e}")
            return
        # py-lmdb opens an environment once per process: the library's reader takes over ours
        # (same flags: readonly, lock, max_dbs=4, readahead off), and the raw rows use its handle.
        self.env.close()
        self.env = None
        lease = self.cd.acquire(self.layout, self.tokens[self.direct[0]])
        try:
            if not lease.locations or not lease.locations[0].nvme_key:
                raise RuntimeError("Client(nvme_read='direct') did not get the chunk as NVMe-only")
            lease.chunk(0)
        finally:
            lease.release()
        self.env, self.db = self.cd._nvme._env, self.cd._nvme._db
        self.env_owned = False

    def open_lmdb(self) -> None:
        """The client's own read-only view of the daemon's LMDB env; find the cycling chunks' keys."""
        self.env = lmdb.open(self.d.nvme_path, readonly=True, lock=True, max_dbs=4, subdir=True, readahead=False)
        self.env_owned = True
        self.db = self.env.open_db(b"chunks", create=False)
        by_sum = {x: j for j, x in enumerate(self.xxh_of)}
        self.key_of: dict[int, bytes] = {}
        self.record_formats: dict[str, int] = {}
        with self.env.begin(db=self.db, buffers=True) as txn:
            for key, value in txn.cursor():
                v = str(record_version(value))
                self.record_formats[v] = self.record_formats.get(v, 0) + 1
                hdr = decode_header(value, key)
                j = by_sum.get(hdr.checksum)
                if j is not None and hdr.payload_len == self.nbytes:
                    self.key_of[j] = bytes(key)
        if set(self.record_formats) != {"2"}:
            raise RuntimeError(f"the daemon wrote NVMe records of formats {self.record_formats}; expected only 2")
        missing = [j for j in self.cycle if j not in self.key_of]
        if missing:
            raise MissingRecords(f"cycling chunks {missing} have no LMDB record")
        self.cycle_keys = [self.key_of[j] for j in self.cycle]

    def open_redis(self) -> None:
        # No Redis here (or no redis-py): the rows are skipped, and the report says so.
        try:
            import redis
        except ImportError as e:
            self.notes.append(f"redis skipped: {e}")
            return
        try:
            r = redis.Redis.from_url(self.redis_url, socket_timeout=30)
            r.ping()
        except (redis.RedisError, OSError, ValueError) as e:
            self.notes.append(f"redis skipped: {type(e).__name__}: {e}")
            return
        self.redis = r
        self.redis_key = f"{REDIS_PREFIX}{os.getpid()}:{self.size}"
        hot = self.held[0]
        r.set(self.redis_key, bytes(u8(hot.chunk(0)).numpy()))

    def close(self) -> None:
        if self.redis is not None and self.redis_key:
            try:
                self.redis.delete(self.redis_key)
            finally:
                self.redis.close()
        if self.env is not None and self.env_owned:
            self.env.close()
        try:
            self.c.release([lease.lease_id for lease in self.held if not lease.released])
        except KvcachedError as e:  # the daemon is stopped next anyway; say why, do not mask the run's error
            print(f"note: releasing the pinned leases failed: {e}", file=sys.stderr)
        self.c.close()
        if self.cd is not None:
            self.cd.close()

    # -- contenders -------------------------------------------------------------------------

    def contenders(self) -> dict:
        """name -> (op, after) where op() is timed and after() (may be None) runs untimed after it."""
        shape = self.layout.chunk_shape
        dst = torch.empty(shape, dtype=torch.bfloat16)
        dst.zero_()
        self.dst = dst
        dst_u8 = u8(dst)
        dst_np = dst_u8.numpy()
        n_cold = max(2, math.ceil(COLD_BYTES / self.nbytes))
        srcs = []
        for _ in range(n_cold):  # torch-allocated (64-byte aligned, like dst and the pool's chunks)
            t = torch.empty(shape, dtype=torch.bfloat16)
            np.copyto(u8(t).numpy(), np.frombuffer(self.rng.bytes(self.nbytes), dtype=np.uint8))
            srcs.append(t)
        src_np = [u8(s).numpy() for s in srcs]
        hot_src, hot_np = srcs[0], src_np[0]
        c, layout, tokens = self.c, self.layout, self.tokens
        hot_lease = self.held[0]
        pinned = self.held
        env, db = self.env, self.db
        keys = self.cycle_keys
        nbytes = self.nbytes
        state = {"cold": 0, "np_cold": 0, "pool": 0, "b": 0, "c": 0, "c2": 0, "c3": 0, "c4": 0, "c5": 0, "c6": 0, "d": 0}
        pending: list = []
        default_threads = self.default_threads

        def nxt(name: str, n: int) -> int:
            i = state[name]
            state[name] = (i + 1) % n
            return i

        def memcpy_hot() -> None:
            dst.copy_(hot_src)

        def memcpy_cold() -> None:
            dst.copy_(srcs[nxt("cold", n_cold)])

        def np_hot() -> None:
            np.copyto(dst_np, hot_np)

        def np_cold() -> None:
            np.copyto(dst_np, src_np[nxt("np_cold", n_cold)])

        def memcpy_threads() -> None:
            torch.set_num_threads(default_threads)
            try:
                dst.copy_(hot_src)
            finally:
                torch.set_num_threads(1)

        def pool_hot() -> None:
            dst.copy_(hot_lease.chunk(0))

        hot_view = hot_lease.chunk(0)

        def pool_hot_view_reused() -> None:
            dst.copy_(hot_view)

        def view_only() -> None:
            hot_lease.chunk(0)

        def pool_cold() -> None:
            dst.copy_(pinned[nxt("pool", len(pinned))].chunk(0))

        cycle_tokens = [tokens[j] for j in self.cycle]

        def nvme_promote() -> None:
            lease = c.acquire(layout, cycle_tokens[nxt("b", len(cycle_tokens))])
            dst.copy_(lease.chunk(0))
            pending.append(lease)

        def release_pending() -> None:
            while pending:
                lease = pending.pop()
                if lease.matched_tokens != layout.chunk_tokens:
                    raise RuntimeError(f"promotion acquire matched {lease.matched_tokens} tokens")
                lease.release()

        # The CRC-32 what-ifs read format-2 records but check what a format-1 record would hold.
        crc_by_key = {self.key_of[j]: self.crc_of[j] for j in self.cycle}

        def lmdb_read(key: bytes, crc) -> None:
            with env.begin(db=db, buffers=True) as txn:
                value = txn.get(key)
                hdr = decode_header(value, key)
                if hdr.payload_len != nbytes:
                    raise RuntimeError(f"payload is {hdr.payload_len} bytes, expected {nbytes}")
                payload = value[hdr.header_size:]
                if crc is not None and crc(payload) != crc_by_key[key]:
                    raise RuntimeError("payload CRC mismatch")
                dst_u8.copy_(torch.frombuffer(payload, dtype=torch.uint8))

        cd = self.cd
        direct_tokens = [tokens[j] for j in self.direct]
        pending_d: list = []
        holder: dict = {}

        def api_direct_acquire():
            lease = cd.acquire(layout, direct_tokens[nxt("d", len(direct_tokens))])
            pending_d.append(lease)
            if not lease.locations or not lease.locations[0].nvme_key:
                raise RuntimeError("Client(nvme_read='direct'): the chunk was not handed out as NVMe-only")
            return lease

        def api_direct_copy() -> None:
            api_direct_acquire().copy_chunk(0, dst)  # the library's one-copy path

        def api_direct_only() -> None:
            holder["t"] = api_direct_acquire().chunk(0)

        def release_direct() -> None:
            while pending_d:
                pending_d.pop().release()

        dst_mv = memoryview(dst_u8.numpy())

        def nvme_direct() -> None:
            # What the client library does: kvcached.contract.record.copy_verified (XXH3-64 fused with the copy).
            key = keys[nxt("c", len(keys))]
            with env.begin(db=db, buffers=True) as txn:
                copy_verified(txn.get(key), key, dst_mv)

        def nvme_direct_zlib() -> None:
            lmdb_read(keys[nxt("c6", len(keys))], zlib.crc32)

        def nvme_direct_nocrc() -> None:
            lmdb_read(keys[nxt("c2", len(keys))], None)

        def nvme_direct_isal() -> None:
            lmdb_read(keys[nxt("c3", len(keys))], isal_zlib.crc32)

        piece = min(FUSE_PIECE, nbytes)

        def nvme_direct_isal_fused() -> None:
            key = keys[nxt("c5", len(keys))]
            with env.begin(db=db, buffers=True) as txn:
                value = txn.get(key)
                hdr = decode_header(value, key)
                if hdr.payload_len != nbytes:
                    raise RuntimeError(f"payload is {hdr.payload_len} bytes, expected {nbytes}")
                payload = value[hdr.header_size:]
                crc = 0
                for off in range(0, nbytes, piece):  # copy a piece, CRC it while it is in cache
                    np.copyto(dst_np[off:off + piece], np.frombuffer(payload[off:off + piece], dtype=np.uint8))
                    crc = isal_zlib.crc32(dst_np[off:off + piece], crc)
                if crc != crc_by_key[key]:
                    raise RuntimeError("payload CRC mismatch")

        def nvme_direct_rpc() -> None:
            c.ping()
            lmdb_read(keys[nxt("c4", len(keys))], zlib.crc32)

        crc_buf = bytes(self.rng.bytes(nbytes))

        def crc_zlib() -> None:
            zlib.crc32(crc_buf)

        def crc_isal() -> None:
            isal_zlib.crc32(crc_buf)

        def xxh3_alone() -> None:
            xxhash.xxh3_64_intdigest(crc_buf)

        hot_tokens = tokens[self.pinned[0]]

        def get_bytes() -> None:
            chunks = c.get_bytes(layout, hot_tokens)
            dst_u8.copy_(torch.frombuffer(chunks[0], dtype=torch.uint8))

        out = {
            "memcpy hot (torch)": (memcpy_hot, None),
            "memcpy cold (torch)": (memcpy_cold, None),
            "numpy copyto hot": (np_hot, None),
            "numpy copyto cold": (np_cold, None),
            f"memcpy hot (torch, {default_threads} threads)": (memcpy_threads, None),
            "a pool hot": (pool_hot, None),
            "a pool hot, view reused": (pool_hot_view_reused, None),
            "lease.chunk(0) alone (view creation)": (view_only, None),
            "a pool cold": (pool_cold, None),
            "b nvme via promotion": (nvme_promote, release_pending),
            "c nvme direct (LMDB)": (nvme_direct, None),
            "c what-if: no payload CRC": (nvme_direct_nocrc, None),
            "c before: zlib CRC-32, then a separate copy": (nvme_direct_zlib, None),
            "c what-if: + 1 empty RPC": (nvme_direct_rpc, None),
            "crc32 zlib alone": (crc_zlib, None),
            "xxh3-64 alone": (xxh3_alone, None),
            "d get_bytes (gRPC)": (get_bytes, None),
        }
        if cd is not None:
            out[API_DIRECT] = (api_direct_copy, release_direct)
            out[API_DIRECT_ONLY] = (api_direct_only, release_direct)
        if isal_zlib is not None:
            out["c what-if: isal CRC-32"] = (nvme_direct_isal, None)
            out["c what-if: isal CRC-32 fused with the copy"] = (nvme_direct_isal_fused, None)
            out["crc32 isal alone"] = (crc_isal, None)
        else:
            self.notes.append("isal not importable: the 'isal CRC-32' what-if rows are skipped")
        if self.redis is not None:
            r, key = self.redis, self.redis_key

            def redis_get() -> None:
                dst_u8.copy_(torch.frombuffer(r.get(key), dtype=torch.uint8))

            def redis_get_only() -> None:
                r.get(key)

            out["e redis GET"] = (redis_get, None)
            out["e redis GET alone (no copy)"] = (redis_get_only, None)
        self._expected_for = {
            "memcpy hot (torch)": lambda: zlib.crc32(u8(hot_src).numpy()),
            "a pool hot": lambda: self.crc_of[self.pinned[0]],
            "a pool hot, view reused": lambda: self.crc_of[self.pinned[0]],
            "d get_bytes (gRPC)": lambda: self.crc_of[self.pinned[0]],
            "e redis GET": lambda: self.crc_of[self.pinned[0]],
        }
        self._state = state
        self._holder = holder
        return out

    def verify(self, contenders: dict) -> dict:
        """Run each copying contender once and check what landed in ``dst``."""
        checked = {}
        for name, (op, after) in contenders.items():
            if "alone" in name:
                continue
            self.dst.zero_()
            before = dict(self._state)
            op()
            got = zlib.crc32(u8(self.dst).numpy())
            if after is not None:
                after()
            if name in self._expected_for:
                want = self._expected_for[name]()
            elif name.startswith("a pool cold"):
                want = self.crc_of[self.pinned[before["pool"]]]
            elif name.startswith("b "):
                want = self.crc_of[self.cycle[before["b"]]]
            elif name in (API_DIRECT, API_DIRECT_ONLY):
                want = self.crc_of[self.direct[before["d"]]]
                if name == API_DIRECT_ONLY:
                    got = zlib.crc32(u8(self._holder["t"]).numpy())
            elif name.startswith("c "):
                k = {"c nvme direct (LMDB)": "c", "c what-if: no payload CRC": "c2",
                     "c what-if: isal CRC-32": "c3", "c what-if: + 1 empty RPC": "c4",
                     "c what-if: isal CRC-32 fused with the copy": "c5",
                     "c before: zlib CRC-32, then a separate copy": "c6"}[name]
                want = self.crc_of[self.cycle[before[k]]]
            else:
                continue  # memcpy rows: checked through "memcpy hot"
            if got != want:
                raise RuntimeError(f"{name}: the copied chunk is wrong (crc {got:#x}, want {want:#x})")
            checked[name] = True
        return checked


def measure(setup: Setup, args: argparse.Namespace) -> dict:
    contenders = setup.contenders()
    checked = setup.verify(contenders)
    # Page cache warm for (c): read every cycling record once; and one untimed pass of everything.
    for key in setup.cycle_keys:
        with setup.env.begin(db=setup.db, buffers=True) as txn:
            zlib.crc32(txn.get(key))
    names = list(contenders)
    reps = args.reps or max(4, (32 * MiB) // setup.nbytes)
    samples = {n: [] for n in names}
    after_ns: dict[str, list[int]] = {n: [] for n in names if contenders[n][1] is not None}
    promotions0 = setup.c.stats()["counters"]["promotions"]
    timed_promote_ops = 0
    pc = time.perf_counter_ns
    t_start = time.perf_counter()
    order_rng = np.random.default_rng(args.seed)
    for rnd in range(args.rounds + 1):  # round 0: warm-up, not recorded
        # A fresh random order every round, so no contender always follows the same one (the
        # 2-thread memcpy leaves an OpenMP worker spinning on the other core for a while), and a
        # short untimed pause between contenders for the same reason.
        for name in [names[i] for i in order_rng.permutation(len(names))]:
            time.sleep(SETTLE_S)
            op, after = contenders[name]
            gc.disable()
            try:
                for _ in range(reps):
                    t0 = pc()
                    op()
                    t1 = pc()
                    if after is not None:
                        after()
                        t2 = pc()
                        if rnd:
                            after_ns[name].append(t2 - t1)
                    if rnd:
                        samples[name].append(t1 - t0)
                    if name.startswith("b "):
                        timed_promote_ops += 1
            finally:
                gc.enable()
    wall = time.perf_counter() - t_start
    promotions = setup.c.stats()["counters"]["promotions"] - promotions0
    if promotions != timed_promote_ops:
        raise RuntimeError(f"{promotions} promotions for {timed_promote_ops} acquires of NVMe-only chunks: "
                           "the cycling chunks were not all NVMe-only")
    stats = {}
    for name in names:
        s = summarize_ns(samples[name])
        moves_bytes = "view creation" not in name
        s["gb_s_at_p50"] = setup.nbytes / (s["p50_us"] * 1e3) if s["p50_us"] and moves_bytes else float("nan")
        stats[name] = s
    for name, xs in after_ns.items():
        tot = [a + b for a, b in zip(samples[name], xs)]
        s = summarize_ns(tot)
        s["gb_s_at_p50"] = setup.nbytes / (s["p50_us"] * 1e3)
        stats[name + " + release"] = s
        stats[name]["release_p50_us"] = summarize_ns(xs)["p50_us"]
    return {
        "chunk_bytes": setup.nbytes,
        "layout": setup.layout.to_dict(),
        "pool_chunks": setup.n_pinned + FREE_SLOTS,
        "pinned_chunks": setup.n_pinned,
        "cycling_chunks": CYCLE,
        "reps_per_round": reps,
        "rounds": args.rounds,
        "timed_wall_seconds": wall,
        "promotions_during_timing": promotions,
        "verified": checked,
        "daemon_after_build": setup.stats_after_build,
        "notes": setup.notes,
        "nvme_record_formats": setup.record_formats,
        "latency": stats,
    }


def verdicts(m: dict) -> dict:
    st = m["latency"]
    gb = {k: v["gb_s_at_p50"] for k, v in st.items()}
    # The reference is the faster of the two single-thread memcpys (torch copy_, np.copyto), so a
    # slow run of one of them cannot flatter the contenders.
    hot = max(gb["memcpy hot (torch)"], gb["numpy copyto hot"])
    cold = max(gb["memcpy cold (torch)"], gb["numpy copyto cold"])
    redis = gb.get("e redis GET")
    b, b_rel, cdir = gb["b nvme via promotion"], gb["b nvme via promotion + release"], gb["c nvme direct (LMDB)"]
    api_d = gb.get(API_DIRECT)
    api_d_rel = gb.get(API_DIRECT + " + release")
    # The client's choice: both complete paths through the public API (acquire RPC included).
    if api_d is not None:
        nvme_best_name = API_DIRECT if api_d >= b else "b nvme via promotion"
        nvme_best = max(b, api_d)
    else:  # no direct mode in this client: the raw data path stands in (it lacks the RPC)
        nvme_best_name = "c nvme direct (LMDB)" if cdir >= b else "b nvme via promotion"
        nvme_best = max(b, cdir)
    v = {
        "memcpy_reference_gb_s": {"hot": hot, "cold": cold,
                                  "definition": "max of torch copy_ and np.copyto (1 thread), p50"},
        "ratios_to_memcpy_hot": {k: ratio(x, hot) for k, x in gb.items()},
        "ratios_to_memcpy_cold": {k: ratio(x, cold) for k, x in gb.items()},
        "ratios_to_redis_get": {k: ratio(x, redis) for k, x in gb.items()} if redis else None,
        "pool_read": {
            "hot_over_memcpy_hot": ratio(gb["a pool hot"], hot),
            "cold_over_memcpy_cold": ratio(gb["a pool cold"], cold),
            "cold_over_memcpy_hot": ratio(gb["a pool cold"], hot),
        },
        "nvme": {
            "faster_method": nvme_best_name,
            "client_default_should_be": ("direct" if nvme_best_name != "b nvme via promotion" else "promote"),
            "api_direct_over_api_promote": ratio(api_d, b) if api_d else None,
            "api_direct_over_api_promote_incl_release": ratio(api_d_rel, b_rel) if api_d_rel else None,
            "data_path_only_direct_over_memcpy_cold": ratio(cdir, cold),
            "direct_over_promotion": ratio(cdir, b),
            "direct_plus_empty_rpc_over_promotion": ratio(gb["c what-if: + 1 empty RPC"], b),
            "direct_over_promotion_incl_release": ratio(cdir, b_rel),
            "best_over_memcpy_hot": ratio(nvme_best, hot),
            "best_over_memcpy_cold": ratio(nvme_best, cold),
            "promotion_over_memcpy_hot": ratio(b, hot),
            "direct_over_memcpy_hot": ratio(cdir, hot),
        },
    }
    v["targets"] = {
        "pool >= 0.8x memcpy (hot vs hot)": v["pool_read"]["hot_over_memcpy_hot"] >= TARGET_POOL,
        "pool >= 0.8x memcpy (cold vs cold)": v["pool_read"]["cold_over_memcpy_cold"] >= TARGET_POOL,
        "nvme >= 0.6x memcpy (best method vs memcpy hot)": v["nvme"]["best_over_memcpy_hot"] >= TARGET_NVME,
        "nvme >= 0.6x memcpy (best method vs memcpy cold)": v["nvme"]["best_over_memcpy_cold"] >= TARGET_NVME,
    }
    xxh, crc_isal, crc_zlib = gb["xxh3-64 alone"], gb.get("crc32 isal alone"), gb["crc32 zlib alone"]
    v["checksum_alone"] = {  # GB/s at p50 of the checksum over one chunk-sized buffer, and ratios
        "xxh3_64_gb_s": xxh,
        "crc32_isal_gb_s": crc_isal,
        "crc32_zlib_gb_s": crc_zlib,
        "xxh3_over_crc32_isal": ratio(xxh, crc_isal) if crc_isal else None,
        "xxh3_over_crc32_zlib": ratio(xxh, crc_zlib),
        "crc32_isal_over_crc32_zlib": ratio(crc_isal, crc_zlib) if crc_isal else None,
    }
    isal = max(gb.get("c what-if: isal CRC-32") or 0.0, gb.get("c what-if: isal CRC-32 fused with the copy") or 0.0)
    if isal:
        v["what_if_isal_crc"] = {
            "direct_isal_over_memcpy_hot": ratio(isal, hot),
            "direct_isal_over_memcpy_cold": ratio(isal, cold),
            "direct_isal_over_redis_get": ratio(isal, redis) if redis else None,
            "nvme >= 0.6x memcpy hot would be met": ratio(isal, hot) >= TARGET_NVME,
            "nvme >= 0.6x memcpy cold would be met": ratio(isal, cold) >= TARGET_NVME,
            "nvme >= 10x redis GET would be met": (ratio(isal, redis) >= TARGET_VS_REDIS) if redis else None,
        }
    if redis:
        v["targets"]["pool >= 10x redis GET (pool hot)"] = ratio(gb["a pool hot"], redis) >= TARGET_VS_REDIS
        v["targets"]["pool >= 10x redis GET (pool cold)"] = ratio(gb["a pool cold"], redis) >= TARGET_VS_REDIS
        v["targets"]["nvme >= 10x redis GET (best method)"] = ratio(nvme_best, redis) >= TARGET_VS_REDIS
    return v


def print_report(res: dict) -> None:
    for size, m in res["sizes"].items():
        st = m["latency"]
        v = m["verdicts"]
        hot = v["memcpy_reference_gb_s"]["hot"]
        cold = v["memcpy_reference_gb_s"]["cold"]
        redis = st.get("e redis GET", {}).get("gb_s_at_p50")
        print(f"\n== {size} chunk ({m['chunk_bytes']:,} bytes); {m['rounds']} rounds x {m['reps_per_round']} reps; "
              f"{m['promotions_during_timing']} promotions timed ==")
        print(f"memcpy reference (faster of torch copy_ / np.copyto, 1 thread): hot {hot:.2f} GB/s, cold {cold:.2f} GB/s")
        rows = []
        for name, s in st.items():
            rows.append([name, s["p50_us"], s["p99_us"], s["gb_s_at_p50"], ratio(s["gb_s_at_p50"], hot),
                         ratio(s["gb_s_at_p50"], cold), ratio(s["gb_s_at_p50"], redis) if redis else float("nan")])
        print(format_table(["contender", "p50 us", "p99 us", "GB/s (p50)", "x memcpy hot", "x memcpy cold",
                            "x redis GET"], rows))
        nv = v["nvme"]
        print(f"NVMe: faster complete path = {nv['faster_method']} -> client default should be "
              f"{nv['client_default_should_be']!r}")
        if nv["api_direct_over_api_promote"]:
            print(f"  api direct / api promote = {nv['api_direct_over_api_promote']:.2f}x "
                  f"(incl. release {nv['api_direct_over_api_promote_incl_release']:.2f}x)")
        print(f"  data path only: raw direct / promotion = {nv['direct_over_promotion']:.2f}x; "
              f"raw direct + empty RPC / promotion = {nv['direct_plus_empty_rpc_over_promotion']:.2f}x")
        print(f"  c nvme direct (LMDB, format-2 records {m['nvme_record_formats']}) / memcpy hot = "
              f"{nv['direct_over_memcpy_hot']:.2f}x")
        for t, ok in v["targets"].items():
            print(f"  target {t:50s} {'MET' if ok else 'NOT MET'}")
        if "what_if_isal_crc" in v:
            w = v["what_if_isal_crc"]
            print(f"  what-if (c) with isal CRC-32 (better of plain / fused): {w['direct_isal_over_memcpy_hot']:.2f}x memcpy hot, "
                  f"{w['direct_isal_over_memcpy_cold']:.2f}x memcpy cold"
                  + (f", {w['direct_isal_over_redis_get']:.1f}x redis GET" if w["direct_isal_over_redis_get"] else ""))
        for note in m["notes"]:
            print(f"  note: {note}")
    print("\n== payload checksum alone (GB/s at p50) and the direct NVMe read, per chunk size ==")
    rows = []
    for size, m in res["sizes"].items():
        ck, nv = m["verdicts"]["checksum_alone"], m["verdicts"]["nvme"]
        nan = float("nan")
        rows.append([size, ck["xxh3_64_gb_s"], ck["crc32_isal_gb_s"] or nan, ck["crc32_zlib_gb_s"],
                     ck["xxh3_over_crc32_isal"] or nan, ck["xxh3_over_crc32_zlib"], ck["crc32_isal_over_crc32_zlib"] or nan,
                     nv["direct_over_memcpy_hot"]])
    print(format_table(["size", "XXH3-64", "CRC-32 isal", "CRC-32 zlib", "xxh3/isal", "xxh3/zlib", "isal/zlib",
                        "direct/memcpy hot"], rows))


def run_size(size: str, args: argparse.Namespace) -> dict:
    layout = make_layout(size)
    n_pinned = max(1, math.ceil(COLD_BYTES / layout.chunk_bytes))
    pool_chunks = n_pinned + FREE_SLOTS
    settings = {
        "pool_bytes": pool_chunks * layout.chunk_bytes,  # exactly pool_chunks chunks of this layout
        "nvme_bytes": 4 * (CYCLE + n_pinned) * (layout.chunk_bytes + 4096),
        "lease_ttl": 3600.0,
        "log_level": "warning",
    }
    with Daemon.temp(settings, prefix=f"kvc-bench-read-{size}-") as d:
        setup = Setup(size, d, args)
        setup.default_threads = args.default_threads
        try:
            setup.build()
            m = measure(setup, args)
        finally:
            setup.close()
        d.stop()
        m["daemon_settings"] = settings
        m["daemon_exit_code"] = d.exit_code
    m["verdicts"] = verdicts(m)
    return m


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, "2 MiB only, few rounds (a few seconds)")
    p.add_argument("--sizes", default=None, help="comma-separated: 2MiB,16MiB (default both; quick 2MiB)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 40; quick 2)")
    p.add_argument("--reps", type=int, default=None, help="ops per contender per round (default 32 MiB / chunk, >= 4)")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0",
                   help="the Redis to compare with (default the local one); rows are skipped if it does not answer")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 40)
    sizes = (args.sizes or ("2MiB" if args.quick else "2MiB,16MiB")).split(",")
    bad = set(sizes) - set(SIZES)
    if bad:
        p.error(f"unknown --sizes {sorted(bad)}; choose from {sorted(SIZES)}")
    install_sigterm_exit()
    args.default_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    res: dict = {
        "question": " ".join(__doc__.strip().split("\n\n")[0].split()),
        "torch": torch.__version__,
        "torch_threads": {"default": args.default_threads, "used": 1},
        "isal": getattr(isal_zlib, "__name__", None) and __import__("isal").__version__,
        "xxhash": xxhash.VERSION,
        "sizes": {},
    }
    for size in sizes:
        print(f"measuring {size} ...", flush=True)
        res["sizes"][size] = run_size(size, args)
    res["quick"] = args.quick
    res["targets"] = {"pool_over_memcpy_min": TARGET_POOL, "nvme_over_memcpy_min": TARGET_NVME,
                      "over_redis_get_min": TARGET_VS_REDIS}
    print_report(res)
    write_results("chunk_read", res, args.out, quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
