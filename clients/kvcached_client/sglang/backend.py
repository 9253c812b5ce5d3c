"""kvcached as SGLang's HiCache storage backend (the third tier, below GPU and host memory).

Loaded by SGLang at launch (``--hicache-storage-backend dynamic``, see docs/sglang.md); SGLang
builds it as ``KvcachedStorage(storage_config, kwargs)`` and registers its host pool. It speaks
the v1 zero-copy interface (``"interface_v1": 1``): SGLang hands it page keys and the host-pool
slots of those pages, and it moves each page between the host pool and the daemon's pool with
one copy. One daemon round trip per batch call: ``batch_exists`` is a Lookup, ``batch_get_v1``
an Acquire (the lease is held only while its pages are copied), ``batch_set_v1`` a Reserve and a
Commit.

With ``"hicache_storage_pass_prefix_keys": true`` SGLang passes each call's earlier page keys,
and the daemon indexes whole prompts from their first page (see :meth:`KvcachedStorage._words`).

Threads: SGLang calls ``batch_exists``/``batch_get_v1`` from its prefetch thread and
``batch_set_v1`` from its backup thread; the kvcached client is thread-safe, and each call's
state is local to it.

Failure: the daemon absent, restarting or refusing makes every call a miss (``batch_exists`` 0,
``batch_get_v1``/``batch_set_v1`` all False) with one warning per change and
``kvcached_client_fail_open_total{integration="sglang"}``; for ``retry_s`` after a failure, calls
do not even try. SGLang then computes, as without a storage tier.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from prometheus_client import Counter

from kvcached.contract.keys import KVLayout
from kvcached_client.client import Client
from kvcached_client.failopen import FailOpen
from kvcached_client.sglang.pages import KEY_WORDS, HostPages, UnsupportedPool, key_words

log = logging.getLogger("kvcached_client.sglang")

#: What ``--hicache-storage-backend-extra-config`` may hold for this backend (SGLang's own keys,
#: e.g. ``prefetch_threshold`` and ``interface_v1``, are consumed or ignored by SGLang).
EXTRA_KEYS = {
    "socket": "the daemon's socket (default: $KVCACHED_SOCKET, then the default path)",
    "model": "the model's identity in kvcached, 'org/name@revision' (default: SGLang's model path)",
    "timeout": "seconds one daemon call may take (default 2)",
    "retry_s": "after a failure, seconds during which calls are misses without trying (default 1)",
}


#: In SGLang's scheduler process; on its ``/metrics`` with ``--enable-metrics`` (SGLang's
#: Prometheus multiprocess mode collects every registered counter of its processes).
PAGES_TOTAL = Counter("kvcached_sglang_pages", "SGLang pages: asked for (exists), found (hit), "
                      "loaded into the host pool (loaded), stored from it (stored)", ["op"])
SECONDS_TOTAL = Counter("kvcached_sglang_seconds", "Seconds spent in the backend's calls (exists, get, set: "
                        "daemon round trips and copies included; get_copy: the page copies of get alone)", ["op"])


def copy_all(dst: list, src: list) -> None:
    """``dst[i].copy_(src[i])`` for every i, in one torch call (see batch_get_v1)."""
    if dst:
        torch._foreach_copy_(dst, src)


class KvcachedStorage(HiCacheStorage):
    """See the module docstring."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        cfg = storage_config
        extra = dict(cfg.extra_config or {})
        self._config = cfg
        if cfg.dcp_size > 1 or cfg.attn_cp_size > 1:
            raise UnsupportedPool("kvcached does not store context-parallel (DCP/CP) shards yet")
        if os.environ.get("SGLANG_USE_XXH3_HASH", "0") == "1":
            raise UnsupportedPool("SGLANG_USE_XXH3_HASH=1 makes 64-bit page keys, too short to key shared chunks "
                                  "safely; kvcached needs SGLang's SHA-256 page keys")
        self._model = str(extra.get("model") or cfg.model_name or "")
        if not self._model:
            raise UnsupportedPool("no model identity: set \"model\" in --hicache-storage-backend-extra-config")
        self._tp = f"replicated/{cfg.tp_size}" if cfg.is_mla_model else f"{cfg.tp_rank}/{cfg.tp_size}"
        self._pp = f"{cfg.pp_rank}/{cfg.pp_size}"
        # MLA: every TP rank holds the same latent; one writer stores it (SGLang's own rule).
        self._writer = cfg.is_storage_writer
        self._socket = extra.get("socket") or None
        self._timeout = float(extra.get("timeout", 2.0))
        self._retry_s = float(extra.get("retry_s", 1.0))
        self._client: Client | None = None
        self._client_lock = threading.Lock()
        self._fail = FailOpen("sglang")
        self._down_until = 0.0
        self.pages: HostPages | None = None
        self.layout: KVLayout | None = None  # set by register_mem_pool_host
        #: Pages served, stored and asked for, for get_stats and tests (approximate under threads).
        self.counts = {"exists_pages": 0, "hit_pages": 0, "loaded_pages": 0, "stored_pages": 0}

    # -- SGLang's registration -----------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if mem_pool_host.page_size < KEY_WORDS:
            raise UnsupportedPool(f"--page-size {mem_pool_host.page_size} is under {KEY_WORDS} tokens: a page cannot "
                                  "carry its 256-bit key; start SGLang with --page-size 8 or more")
        self.pages = HostPages(mem_pool_host, mla=self._config.is_mla_model)
        self.layout = self.pages.shape.layout_for(self._model, tp=self._tp, pp=self._pp)
        log.info("kvcached storage: %s, %d layers x %d heads x %d, %s, pages of %d tokens, host layout %s",
                 self._model, self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim,
                 self.layout.dtype, self.layout.chunk_tokens, self.pages.shape.layout)
        self._warm_up()

    def _warm_up(self) -> None:
        """At engine start: open the session, register the layout and map the daemon's pool,
        so the first hit pays for none of them. Mapping starts filling this process's page
        tables for the whole pool in the background (``HostPoolMapping``); begun lazily on the
        first hit, that fill raced the hit's copies on a 2-core box (a fresh engine's first
        load: 51 ms of copies against 3-4 ms with the pool mapped ahead). Fails open: a daemon
        that is absent now is tried again on the first call."""
        assert self.layout is not None
        try:
            client = self._client_now()
            client.warm_up()
            client.lookup(self.layout, key_words([], self.layout.chunk_tokens))  # registers the layout
        except Exception as e:  # noqa: BLE001 - fail open: the engine starts without the daemon
            self._failed("start", e)
            return
        self._fail.ok("start")

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang's hybrid models (Mamba, sliding-window, DSA) bring extra host pools through
        the v2 interface, which this backend does not speak: refused at start, with the reason."""
        if str(host_pool_name) != "kv":
            raise UnsupportedPool(f"SGLang's {host_pool_name!r} host pool (a hybrid model) is not supported by kvcached "
                                  "yet: only a model's KV pool is stored")
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def _client_now(self) -> Client:
        with self._client_lock:
            if self._client is None:
                # Unary calls: SGLang calls from its prefetch and backup threads beside its busy
                # scheduler thread, where a call on the session stream waits for the GIL on more
                # threads (bench/hf_path.py, "beside a busy thread").
                self._client = Client(self._socket, timeout=self._timeout, client_name=f"sglang pid {os.getpid()}",
                                      stream_calls=False)
            return self._client

    # -- the calls ---------------------------------------------------------------------

    def _words(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo]) -> tuple[Any, int]:
        """(the daemon's "tokens" for prefix + keys, the number of prefix pages).

        Without prefix keys (SGLang passes None when its ``hicache_storage_pass_prefix_keys`` is
        off, and also for an empty prefix), the call's keys are indexed as if they began the
        prompt. That is still exact, because each SGLang page key commits to every token before
        it: a run of keys names the same pages wherever it starts. What is lost is only the
        daemon's view of whole prompts (its eviction keeps prefixes before their extensions)."""
        prefix = (extra_info.prefix_keys if extra_info is not None else None) or []
        return key_words([*prefix, *keys], self._layout.chunk_tokens), len(prefix)

    @property
    def _layout(self) -> KVLayout:
        """The pages' layout, once SGLang registered its host pool (the batch calls run only then:
        :meth:`_usable`)."""
        assert self.layout is not None, "register_mem_pool_host was not called"
        return self.layout

    def _count(self, what: str, pages: int, t0: float | None = None, *, op: str | None = None) -> None:
        self.counts[f"{what}_pages"] += pages
        PAGES_TOTAL.labels(what).inc(pages)
        if t0 is not None:
            SECONDS_TOTAL.labels(op or what).inc(time.perf_counter() - t0)

    def _usable(self) -> bool:
        return self.layout is not None and time.monotonic() >= self._down_until

    def _failed(self, op: str, error: BaseException) -> None:
        reason = self._fail.failed(op, error)
        self._down_until = time.monotonic() + self._retry_s
        if reason == "UNAVAILABLE":
            # Start the next try on a new channel: one created while the daemon was absent was
            # seen still failing after the daemon came up (tests/sglang/test_server.py, under load).
            with self._client_lock:
                client, self._client = self._client, None
            if client is not None:
                client.close()

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """How many of ``keys``, from the first, the daemon holds (any tier)."""
        t0 = time.perf_counter()
        if not keys or not self._usable():
            return 0
        words, first = self._words(keys, extra_info)
        layout = self._layout
        try:
            cached = self._client_now().lookup(layout, words)
        except Exception as e:  # noqa: BLE001 - fail open: a miss, never an engine error
            self._failed("exists", e)
            return 0
        self._fail.ok("exists")
        hits = max(0, min(len(keys), cached // layout.chunk_tokens - first))
        self._count("exists", len(keys), t0)
        self._count("hit", hits)
        return hits

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Copy the daemon's pages of ``keys`` into their host slots; True for each page loaded."""
        t0 = time.perf_counter()
        ok = [False] * len(keys)
        if not keys or not self._usable():
            return ok
        words, first = self._words(keys, extra_info)
        assert self.pages is not None
        layout = self._layout
        p = layout.chunk_tokens
        starts = host_indices[::p].tolist()
        try:
            lease = self._client_now().acquire(layout, words)
        except Exception as e:  # noqa: BLE001 - fail open: a miss, never an engine error
            self._failed("get", e)
            return ok
        try:
            n = max(0, min(len(keys), len(lease) - first))
            t1 = time.perf_counter()
            # One torch call for every page: each call releases the GIL, and getting it back
            # behind a busy Python thread costs up to a switch interval (5 ms): 32 pages beside a
            # spinning thread took 205 ms page by page, 14 ms in one call.
            copy_all([self.pages.page(s) for s in starts[:n]], lease.chunk_views(first, n))
            ok[:n] = [True] * n
            SECONDS_TOTAL.labels("get_copy").inc(time.perf_counter() - t1)
        except Exception as e:  # noqa: BLE001 - e.g. an NVMe chunk that failed its checksum: a miss
            self._failed("get", e)
        finally:
            lease.release()
        self._fail.ok("get")
        self._count("loaded", sum(ok), t0, op="get")
        return ok

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Store the pages of ``keys`` from their host slots; True for each page the daemon now
        holds (written now, or already there). A page whose earlier pages the daemon no longer
        holds cannot be stored (the daemon keeps prefixes whole): False."""
        t0 = time.perf_counter()
        if not keys:
            return []
        if not self._writer:
            return [True] * len(keys)  # MLA: the writing rank stores the same latent
        ok = [False] * len(keys)
        if not self._usable():
            return ok
        words, first = self._words(keys, extra_info)
        assert self.pages is not None
        layout = self._layout
        p = layout.chunk_tokens
        try:
            res = self._client_now().reserve(layout, words, skip_empty=True)
            slots = res.slots
            if slots and slots[0].position < first:
                res.abort()  # the daemon lost an earlier page, whose bytes this call does not have
                cached = res.cached_tokens
            else:
                starts = host_indices[::p].tolist()
                copy_all([res.view(slot) for slot in slots],
                         [self.pages.page(starts[slot.position - first]) for slot in slots])
                cached = res.commit().cached_tokens
        except Exception as e:  # noqa: BLE001 - fail open: a miss, never an engine error
            self._failed("set", e)
            return ok
        self._fail.ok("set")
        stored = max(0, min(len(keys), cached // p - first))
        self._count("stored", stored, t0, op="set")
        return [j < stored for j in range(len(keys))]

    # -- the rest of SGLang's interface ------------------------------------------------

    def exists(self, key: str) -> bool:
        """A single key without its prefix cannot be looked up; SGLang uses batch_exists."""
        return False

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> None:
        raise NotImplementedError("kvcached storage speaks HiCache's v1 interface: set \"interface_v1\": 1")

    def batch_get(self, keys: List[str], target_locations: Any = None, target_sizes: Any = None) -> None:
        raise NotImplementedError("kvcached storage speaks HiCache's v1 interface: set \"interface_v1\": 1")

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        raise NotImplementedError("kvcached storage speaks HiCache's v1 interface: set \"interface_v1\": 1")

    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        raise NotImplementedError("kvcached storage speaks HiCache's v1 interface: set \"interface_v1\": 1")

    def clear(self) -> None:
        """Nothing: the daemon's cache is shared with other engines; one engine flushing its own
        cache (``/flush_cache``) must not drop theirs. ``kvcachectl evict`` empties kvcached."""

    def close(self) -> None:
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None
