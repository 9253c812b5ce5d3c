"""GPU check: the CUDA pool end to end, on a machine with an NVIDIA GPU.

Question: does the daemon's CUDA pool work across processes bit-exactly, how fast is a
leased chunk read compared with a plain device-to-device copy of the same footprint, how fast
does the daemon promote NVMe chunks into GPU memory compared with a plain host-to-device copy,
and is every pool byte free again after a client that held leases is killed?

One run, all on one GPU, in steps; each step is a dict in the JSON with ``ok``, ``error`` (and
its traceback), ``figures``, ``processes`` (every child's exit status, stdout and stderr) and
``seconds``. A failed step does not stop the later ones. The JSON is rewritten after every step
and once more at the end (also on an exception or SIGTERM), with the daemon's log.

0. ``daemon``: ``kvcached serve --device cuda`` in a temp dir: a GPU pool of POOL_PROMPTS prompts,
   NVMe tier on disk, no prefetch (so an acquire promotes exactly what it leases).
1. ``writer``: a process puts a prompt's KV (generated on the GPU); it must store every chunk.
2. ``reader``: another process acquires it (``nvme_read="promote"``): every token matched, every
   chunk a view of the GPU pool, ``kv()`` one CUDA tensor, bit-exact against the writer's.
3. ``leased_copy``: in this process, each leased chunk copied into its own GPU tensor (the
   views built before timing), vs a plain ``copy_`` between as many distinct ordinary GPU tensors
   (same footprint: 2 x chunks x chunk bytes, several times the L2); CUDA events, median over
   rounds, ratio (target >= 0.8x).
4. ``promotion``: fillers push the prompt out of the pool (write-back demotes it to NVMe),
   ``flush()`` writes the fillers to NVMe so that the timed acquire's evictions write nothing
   (checked: no demotion during it), then an acquire (``nvme_read="promote"``) promotes the
   prompt: promoted bytes / wall time of the acquire RPC, median over rounds, vs a plain
   pinned (and pageable) host-to-device copy of the same bytes measured in the same run. The
   NVMe reads are likely served from the page cache (the chunks were just written): this times
   the daemon's promotion path, not the disk. Each promoted prompt is checked bit-exactly.
5. ``vllm_paged``: the vLLM connector's GPU data path without vLLM (its CUDA build does not fit
   the device tool's 64 MiB carry): the leased chunks (CUDA pool) scattered into a paged cache
   in each layout a GPU backend uses (``channel-split``: FlashAttention's token-major NHD and the
   head-major order; kvcached_client/vllm/paged.py), and gathered back: bit-exact, and the
   scatter's GPU time vs a plain device copy of the same bytes (CUDA events).
6. ``killed_client``: a holder process (``nvme_read="promote"``) leases the prompt's pool chunks
   and is killed with SIGKILL; its leases must end with its session, and after evicting the
   unpinned chunks every pool byte must be free (``free_bytes == capacity_bytes``).

The pool is packed (one slab, chunks at 64-byte aligned offsets): ``pool_bytes`` of POOL_PROMPTS
prompts holds exactly that many prompts. Write-back (the daemon's default) is on. A lease the
check releases is released asynchronously (on the session stream), so each step ends with
``c.sync()``: the next step's puts find the room back.

Exit status: 0 only if every step succeeded, 1 otherwise, 2 when CUDA is not available.
Writes $OUT/gpu_check.json when $OUT is set (the device tool), else bench/results/gpu_check.json.

Run: .venv/bin/python bench/gpu_check.py [--chunk-mib 16] [--chunks 8] [--rounds 20]
(``scripts/gpu-check`` runs it on the device machine, with the CUDA tests.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "clients")]

#: The pool holds this many prompts: one more pushes the least recently used out.
POOL_PROMPTS = 2
POOL_ALIGN = 64  # kvcached.config.BLOCK_ALIGN: the pool's size is rounded down to it, chunks start at it
START_TIMEOUT = 120.0  # the daemon's start: torch import, CUDA context, pool allocation
CHILD_TIMEOUT = 120.0  # one child process: torch import, CUDA context, one put or acquire
RELEASE_TIMEOUT = 30.0  # a killed client's leases ending with its session
RPC_TIMEOUT = 60.0  # a put that demotes: NVMe writes inside the Reserve call
TAIL = 20_000  # characters of each captured output kept in the JSON
STEPS = ("daemon", "writer", "reader", "leased_copy", "promotion", "vllm_paged", "killed_client")

WRITER = r"""
import sys, json, torch
from kvcached_client import Client, KVLayout
layout = KVLayout.from_dict(json.loads(sys.argv[2]))
n = int(sys.argv[3])
g = torch.Generator(device="cuda").manual_seed(1234)
kv = torch.randn(2, layout.num_layers, layout.num_kv_heads, n, layout.head_dim, device="cuda", generator=g).to(
    getattr(torch, layout.dtype))
with Client(sys.argv[1], timeout=60) as c:
    stored = c.put(layout, list(range(n)), kv).stored_chunks
torch.save(kv.cpu(), sys.argv[4])
print(json.dumps({"stored_chunks": stored}))
"""

READER = r"""
import sys, json, torch
from kvcached_client import Client, KVLayout
layout = KVLayout.from_dict(json.loads(sys.argv[2]))
n = int(sys.argv[3])
with Client(sys.argv[1], timeout=60, nvme_read="promote") as c:
    with c.acquire(layout, list(range(n))) as lease:
        chunk_devices = sorted({lease.chunk(i).device.type for i in range(len(lease))})
        got = lease.kv()
        kv_device = got.device.type
        got = got.cpu()
want = torch.load(sys.argv[4])
print(json.dumps({"matched_tokens": lease.matched_tokens, "chunks": len(lease), "chunk_devices": chunk_devices,
                  "kv_device": kv_device, "numel": got.numel(),
                  "bit_exact": got.shape == want.shape and bool(torch.equal(got, want))}))
"""

HOLDER = r"""
import sys, json, time
from kvcached_client import Client, KVLayout
layout = KVLayout.from_dict(json.loads(sys.argv[2]))
c = Client(sys.argv[1], timeout=60, nvme_read="promote")
leases = [c.acquire(layout, list(range(int(sys.argv[3]))), ttl=3600) for _ in range(4)]
print(json.dumps({"chunks_leased": sum(len(l) for l in leases),
                  "nvme_chunks": sum(bool(loc.nvme_key) for l in leases for loc in l.locations)}), flush=True)
time.sleep(3600)
"""


class StepFailed(Exception):
    """A step's check did not hold; the message says which."""


class Stopped(BaseException):
    """SIGTERM (the device command's time limit): finish the report and stop the daemon."""


def check(cond: bool, message: str) -> None:
    if not cond:
        raise StepFailed(message)


def tail(text: str | bytes | None) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-TAIL:]


def child_env() -> dict[str, str]:
    """This process's environment with the repo and its client package first on PYTHONPATH."""
    path = [ROOT, os.path.join(ROOT, "clients"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path), PYTHONUNBUFFERED="1")


class Report:
    """The JSON report, rewritten (atomically) after every step."""

    def __init__(self, path: str, **facts: Any) -> None:
        self.path = path
        self.data: dict[str, Any] = {**facts, "ok": False, "steps": {}}

    def step(self, name: str, fn: Callable[[dict], None]) -> bool:
        entry: dict[str, Any] = {"ok": False, "error": None, "figures": {}, "processes": {}}
        self.data["steps"][name] = entry
        t = time.monotonic()
        try:
            fn(entry)
            entry["ok"] = True
        except Exception as e:  # noqa: BLE001 - every failure is the step's result
            entry["error"] = f"{type(e).__name__}: {e}"
            entry["traceback"] = traceback.format_exc()[-TAIL:]
        except BaseException as e:
            entry["error"] = f"interrupted ({type(e).__name__}: {e})"
            raise
        finally:
            entry["seconds"] = round(time.monotonic() - t, 3)
            self.write()
        print(f"gpu_check: {name}: " + ("ok" if entry["ok"] else f"FAILED: {entry['error']}"), flush=True)
        return entry["ok"]

    def finish(self) -> bool:
        steps = self.data["steps"]
        self.data["ok"] = all(name in steps and steps[name]["ok"] for name in STEPS)
        self.write()
        return self.data["ok"]

    def write(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=2, default=str)
        os.replace(tmp, self.path)


class Daemon:
    """``kvcached serve --device cuda`` with its stdout and stderr in a log file."""

    def __init__(self, tmp: str, pool_bytes: int) -> None:
        self.socket = os.path.join(tmp, "kv.sock")
        self.config = os.path.join(tmp, "kvcached.toml")
        self.state_dir = os.path.join(tmp, "state")
        self.log_path = os.path.join(tmp, "daemon.log")
        with open(self.config, "w") as f:
            f.write(f'device = "cuda"\npool_bytes = {pool_bytes}\n'
                    'nvme_bytes = "16G"\nprefetch_distance = 0\nmetrics_addr = "127.0.0.1:0"\n')
        self.proc: subprocess.Popen | None = None

    def start(self, entry: dict) -> None:
        cmd = [sys.executable, "-c", "from kvcached.cli import kvcached_main; raise SystemExit(kvcached_main())",
               "serve", "--config", self.config, "--socket", self.socket, "--state-dir", self.state_dir]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env())
        wait_for("the daemon's ready announcement", lambda: "  layouts:" in self.log(), self, START_TIMEOUT)
        entry["figures"]["announcement"] = self.log()

    def check_alive(self) -> None:
        if self.proc is None:
            raise StepFailed("the daemon was not started")
        rc = self.proc.poll()
        if rc is not None:
            raise StepFailed(f"the daemon exited with status {rc}; its log ends: {self.log()[-2000:]}")

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def stop(self) -> int | None:
        """SIGTERM (it writes pool-only chunks to NVMe first), then SIGKILL after a minute."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def wait_for(what: str, cond: Callable[[], bool], daemon: Daemon, timeout: float) -> None:
    """Poll ``cond`` until it holds; fail after ``timeout`` seconds or as soon as the daemon dies."""
    deadline = time.monotonic() + timeout
    while True:
        daemon.check_alive()
        if cond():
            return
        if time.monotonic() > deadline:
            raise StepFailed(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def run_child(entry: dict, daemon: Daemon, name: str, code: str, *args: str) -> dict:
    """Run a child Python to completion (bounded); record its output; return its last stdout line as JSON."""
    daemon.check_alive()
    try:
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=child_env(),
                           timeout=CHILD_TIMEOUT)
        rc, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = f"killed after {CHILD_TIMEOUT:.0f} s", tail(e.stdout), tail(e.stderr)
    entry["processes"][name] = {"rc": rc, "stdout": tail(out), "stderr": tail(err)}
    check(rc == 0, f"{name} exited with status {rc}: {(tail(err).strip().splitlines() or [''])[-1]}")
    check(bool(out.strip()), f"{name} printed no result")
    return json.loads(out.strip().splitlines()[-1])


def median_time(fn: Callable[[], float], rounds: int) -> float:
    fn()  # warm-up
    return statistics.median(fn() for _ in range(rounds))


def time_copies(pairs: list, passes: int) -> float:
    """GPU seconds per ``dst.copy_(src)``, timed by CUDA events over ``passes`` passes of ``pairs``."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(passes):
        for dst, src in pairs:
            dst.copy_(src)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (passes * len(pairs))


class GpuCheck:
    def __init__(self, args: argparse.Namespace, report: Report, tmp: str) -> None:
        from kvcached_client import KVLayout

        self.args, self.report, self.tmp = args, report, tmp
        layers = 32 if args.chunk_mib == 16 else 4
        self.layout = KVLayout("bench/gpu-check@1", layers, 8, 128, "bfloat16", chunk_tokens=128)
        # A prompt of 128 MiB by default: the leased-copy footprint (2 x the prompt) is several times the L2.
        self.chunks = args.chunks or max(1, (128 << 20) // self.layout.chunk_bytes)
        self.n = self.chunks * self.layout.chunk_tokens
        self.tokens = list(range(self.n))
        self.lay_json = json.dumps(self.layout.to_dict())
        self.want_path = os.path.join(tmp, "kv.pt")
        self.pool_bytes = POOL_PROMPTS * self.chunks * self.layout.chunk_bytes  # holds exactly POOL_PROMPTS prompts
        self.daemon = Daemon(tmp, self.pool_bytes)
        self.fillers = 0
        self.holder: subprocess.Popen | None = None

    def client(self):
        from kvcached_client import Client

        self.daemon.check_alive()
        return Client(self.daemon.socket, timeout=RPC_TIMEOUT, nvme_read="promote")

    def run(self) -> None:
        if not self.report.step("daemon", self.start_daemon):
            return
        for name in STEPS[1:]:
            self.report.step(name, getattr(self, name))

    def close(self) -> None:
        if self.holder is not None and self.holder.poll() is None:
            self.holder.kill()
            self.holder.wait(10)
        self.report.data["daemon"] = {"exit_status": None, "log": tail(self.daemon.log())}
        self.report.write()  # in case this process is killed while the daemon stops
        rc = self.daemon.stop()
        self.report.data["daemon"] = {"exit_status": rc, "log": tail(self.daemon.log())}

    # -- steps -----------------------------------------------------------------------------

    def start_daemon(self, entry: dict) -> None:
        self.daemon.start(entry)
        with self.client() as c:
            h = c.pool_handle()
        entry["figures"].update(pool_kind=h.kind, size_bytes=h.size_bytes, align_bytes=h.align_bytes,
                                pool_bytes=self.pool_bytes)
        check(h.kind == "cuda", f"the daemon's pool is {h.kind!r}, not in GPU memory")
        want = (self.pool_bytes // POOL_ALIGN * POOL_ALIGN, POOL_ALIGN)
        check((h.size_bytes, h.align_bytes) == want, f"pool of {h.size_bytes} bytes aligned to {h.align_bytes}, "
                                                     f"expected {want[0]} aligned to {want[1]}")

    def writer(self, entry: dict) -> None:
        out = run_child(entry, self.daemon, "writer", WRITER, self.daemon.socket, self.lay_json, str(self.n),
                        self.want_path)
        entry["figures"].update(out)
        check(out["stored_chunks"] == self.chunks, f"stored {out['stored_chunks']} of {self.chunks} chunks")

    def reader(self, entry: dict) -> None:
        out = run_child(entry, self.daemon, "reader", READER, self.daemon.socket, self.lay_json, str(self.n),
                        self.want_path)
        entry["figures"].update(out)
        check(out["matched_tokens"] == self.n, f"matched {out['matched_tokens']} of {self.n} tokens")
        check(out["numel"] > 0 and out["bit_exact"], "the leased KV differs from what the writer put")
        check(out["chunk_devices"] == ["cuda"] and out["kv_device"] == "cuda",
              f"chunks on {out['chunk_devices']}, kv() on {out['kv_device']}: expected the GPU pool")

    def leased_copy(self, entry: dict) -> None:
        with self.client() as c:
            self._leased_copy(c, entry["figures"])
            c.sync()  # the release is asynchronous: done before the next step's puts need the room

    def _leased_copy(self, c, fig: dict) -> None:
        import torch

        with c.acquire(self.layout, self.tokens) as lease:
            check(len(lease) == self.chunks and not any(loc.nvme_key for loc in lease.locations),
                  f"lease of {len(lease)} chunks, expected {self.chunks} in the pool")
            views = [lease.chunk(i) for i in range(len(lease))]  # built once, outside the timing
            check(all(v.device.type == "cuda" for v in views), "leased chunks are not on the GPU")
            leased = [(torch.empty_like(v), v) for v in views]
            plain = [(torch.empty_like(v), torch.empty_like(v).normal_()) for v in views]
            passes = 4
            lease_s, plain_s = [], []
            for _ in range(self.args.rounds + 1):  # interleaved, the first round of each is warm-up
                lease_s.append(time_copies(leased, passes))
                plain_s.append(time_copies(plain, passes))
            check(all(torch.equal(d, v) for d, v in leased), "a copied chunk differs from its leased view")
        lm, pm = statistics.median(lease_s[1:]), statistics.median(plain_s[1:])
        chunk = self.layout.chunk_bytes
        fig.update(chunk_bytes=chunk, chunks=len(views), footprint_bytes=2 * len(views) * chunk, passes=passes,
                   rounds=self.args.rounds, leased_gbps=chunk / lm / 1e9, d2d_gbps=chunk / pm / 1e9)
        fig["ratio_vs_d2d"] = pm / lm
        fig["target"], fig["meets_target"] = ">= 0.8", pm / lm >= 0.8
        check(lm > 0 and pm > 0, "a copy took no measurable time")

    def _push_out(self, c) -> None:
        """Put POOL_PROMPTS fresh prompts: the least recently used prompt leaves the pool."""
        import torch

        zeros = torch.zeros(2, self.layout.num_layers, self.layout.num_kv_heads, self.n, self.layout.head_dim,
                            dtype=torch.bfloat16, device="cuda")
        for _ in range(POOL_PROMPTS):
            self.fillers += 1
            stored = c.put(self.layout, [10_000_000 * self.fillers + i for i in range(self.n)], zeros).stored_chunks
            check(stored == self.chunks, f"a filler prompt stored {stored} of {self.chunks} chunks")

    def promotion(self, entry: dict) -> None:
        import torch

        fig = entry["figures"]
        fig["rounds"] = rounds = []
        want = torch.load(self.want_path)
        with self.client() as c:
            for _ in range(self.args.promotion_rounds):
                self._push_out(c)
                flushed = c.flush()
                before = c.stats()["counters"]
                t = time.perf_counter()
                lease = c.acquire(self.layout, self.tokens)
                dt = time.perf_counter() - t
                after = c.stats()["counters"]
                with lease:
                    exact = bool(torch.equal(lease.kv().cpu(), want))
                c.sync()  # the release is asynchronous: done before the next round's fillers need the room
                r = {"flushed_chunks": flushed, "promoted_chunks": after["promotions"] - before["promotions"],
                     "demotions_during_acquire": after["demotions"] - before["demotions"], "seconds": dt,
                     "bit_exact": exact}
                r["gbps"] = r["promoted_chunks"] * self.layout.chunk_bytes / dt / 1e9
                rounds.append(r)
                check(r["promoted_chunks"] == self.chunks, f"promoted {r['promoted_chunks']} of {self.chunks} chunks")
                check(r["demotions_during_acquire"] == 0, "the timed acquire also demoted chunks (flush missed some)")
                check(exact, "a promoted prompt differs from what the writer put")
        nbytes = self.chunks * self.layout.chunk_bytes
        fig["gbps_median"] = promo = statistics.median(r["gbps"] for r in rounds)
        fig["h2d_pinned_gbps"] = pinned = nbytes / self._h2d_seconds(nbytes, pinned=True) / 1e9
        fig["h2d_pageable_gbps"] = nbytes / self._h2d_seconds(nbytes, pinned=False) / 1e9
        fig["promoted_bytes_per_round"] = nbytes
        fig["ratio_vs_h2d_pinned"] = promo / pinned

    def _h2d_seconds(self, nbytes: int, *, pinned: bool) -> float:
        """Median GPU seconds of one plain host-to-device copy of ``nbytes`` (CUDA events)."""
        import torch

        host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned)
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def once() -> float:
            start.record()
            dev.copy_(host, non_blocking=pinned)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return median_time(once, 5)

    def vllm_paged(self, entry: dict) -> None:
        with self.client() as c:
            self._vllm_paged(c, entry["figures"])
            c.sync()  # the release is asynchronous: done before the next step counts leases

    def _vllm_paged(self, c, fig: dict) -> None:
        import torch

        from kvcached_client.vllm.paged import CHANNEL_SPLIT

        lay = self.layout
        block = 16  # vLLM's default GPU block size; one chunk spans chunk_tokens / 16 blocks
        per_chunk = lay.chunk_tokens // block
        with c.acquire(lay, self.tokens) as lease:
            chunks = [lease.chunk(i) for i in range(len(lease))]
            n_blocks = len(chunks) * per_chunk
            for order in ("BNHC", "BHNC"):  # FlashAttention's NHD (token-major), and head-major
                shape = ((n_blocks * 2, block, lay.num_kv_heads, 2 * lay.head_dim) if order == "BNHC"
                         else (n_blocks * 2, lay.num_kv_heads, block, 2 * lay.head_dim))
                caches = [torch.zeros(shape, dtype=chunks[0].dtype, device="cuda") for _ in range(lay.num_layers)]
                views = [t.permute(0, 2, 1, 3) if order == "BNHC" else t for t in caches]
                perm = torch.randperm(n_blocks * 2, device="cuda")[:n_blocks]  # scattered, as vLLM allocates
                ids = [perm[i * per_chunk : (i + 1) * per_chunk] for i in range(len(chunks))]

                def scatter() -> None:
                    for ch, bid in zip(chunks, ids):
                        for layer, v in enumerate(views):
                            CHANNEL_SPLIT.scatter(v, bid, ch[:, layer])

                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                scatter()  # warm-up
                times = []
                for _ in range(self.args.rounds):
                    start.record()
                    scatter()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) / 1e3)
                back = [torch.empty_like(ch) for ch in chunks]
                for ch, bid, out in zip(chunks, ids, back):
                    for layer, v in enumerate(views):
                        CHANNEL_SPLIT.gather(v, bid, out[:, layer])
                exact = all(torch.equal(a, b) for a, b in zip(chunks, back))
                nbytes = len(chunks) * lay.chunk_bytes
                src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
                dst = torch.empty_like(src)

                def plain() -> float:
                    start.record()
                    dst.copy_(src)
                    end.record()
                    end.synchronize()
                    return start.elapsed_time(end) / 1e3

                d2d = median_time(plain, self.args.rounds)
                sc = statistics.median(times)
                fig[order] = {"bit_exact": exact, "scatter_seconds": sc, "d2d_seconds": d2d,
                              "scatter_gbps": nbytes / sc / 1e9, "ratio_vs_d2d": d2d / sc, "bytes": nbytes,
                              "block_size": block, "blocks": n_blocks}
                check(exact, f"{order}: chunks gathered back from the paged cache differ from the leased ones")

    def killed_client(self, entry: dict) -> None:
        fig = entry["figures"]
        out_path, err_path = os.path.join(self.tmp, "holder.out"), os.path.join(self.tmp, "holder.err")
        with self.client() as c:
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                self.holder = subprocess.Popen([sys.executable, "-c", HOLDER, self.daemon.socket, self.lay_json,
                                                str(self.n)], stdout=out, stderr=err, env=child_env())
            try:
                def holding() -> bool:
                    last = (_read(err_path).strip().splitlines() or [""])[-1]
                    check(self.holder.poll() is None, f"the holder exited with status {self.holder.returncode}: {last}")
                    return _read(out_path).endswith("\n")

                wait_for("the holder's leases", holding, self.daemon, CHILD_TIMEOUT)
                fig.update(json.loads(_read(out_path)))
                fig["leased_chunks_before_kill"] = c.stats()["pool"]["leased_chunks"]
                self.holder.send_signal(signal.SIGKILL)
                self.holder.wait(10)
            finally:
                entry["processes"]["holder"] = {"rc": self.holder.poll(), "stdout": tail(_read(out_path)),
                                                "stderr": tail(_read(err_path))}
            check(fig["leased_chunks_before_kill"] > 0, "the holder's leases pinned no pool chunk")
            check(fig["nvme_chunks"] == 0, "the holder leased NVMe chunks, not pool chunks")
            t = time.monotonic()
            wait_for("the killed client's leases to end", lambda: c.stats()["leases_active"] == 0, self.daemon,
                     RELEASE_TIMEOUT)
            fig["seconds_until_released"] = time.monotonic() - t
            fig["evicted_chunks"] = c.evict()[0]
            p = c.stats()["pool"]
        fig.update(free_bytes_after=p["free_bytes"], capacity_bytes=p["capacity_bytes"],
                   leased_chunks_after=p["leased_chunks"], reserved_chunks_after=p["reserved_chunks"],
                   all_free=p["free_bytes"] == p["capacity_bytes"])
        check(fig["all_free"], f"{p['capacity_bytes'] - p['free_bytes']} pool bytes still in use "
                               f"({p['leased_chunks']} chunks leased, {p['reserved_chunks']} reserved)")


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _stop(signum: int, _frame: object) -> None:
    raise Stopped(f"signal {signum}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunk-mib", type=int, default=16, choices=(2, 16))
    ap.add_argument("--chunks", type=int, default=0, help="chunks per prompt (default: a 128 MiB prompt)")
    ap.add_argument("--rounds", type=int, default=20, help="timed rounds of the leased copy")
    ap.add_argument("--promotion-rounds", type=int, default=3)
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print(f"gpu_check: CUDA is not available here (torch {torch.__version__}); nothing to check",
              file=sys.stderr)
        return 2
    out_dir = os.environ.get("OUT") or os.path.join(ROOT, "bench", "results")
    props = torch.cuda.get_device_properties(0)
    report = Report(os.path.join(out_dir, "gpu_check.json"), device=props.name,
                    l2_bytes=getattr(props, "L2_cache_size", None), torch=torch.__version__, cuda=torch.version.cuda,
                    python=sys.version.split()[0], command=sys.argv, pool_prompts=POOL_PROMPTS)
    signal.signal(signal.SIGTERM, _stop)
    tmp = tempfile.mkdtemp(prefix="kvcached-gpu-")
    run = GpuCheck(args, report, tmp)
    report.data.update(chunk_bytes=run.layout.chunk_bytes, chunks_per_prompt=run.chunks)
    try:
        run.run()
    except Stopped as e:
        report.data["stopped"] = f"stopped by {e} before every step ran"
    finally:
        run.close()
        ok = report.finish()
        shutil.rmtree(tmp, ignore_errors=True)
    summary = {name: s["ok"] for name, s in report.data["steps"].items()}
    print(json.dumps({"ok": ok, "steps": summary}, indent=2))
    print(f"wrote {report.path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
