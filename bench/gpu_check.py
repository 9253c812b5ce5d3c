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
   the daemon's promotion path, not the disk. Each promoted prompt is checked bit-exactly. To
   attribute it: this host's copy of the LMDB file into pinned memory, first mapped and mapped.
5. ``vllm_paged``: the vLLM connector's GPU data path without vLLM (its CUDA build does not fit
   the device tool's 64 MiB carry; kvcached_client.vllm.plan falls back to stand-ins for vLLM's
   base classes), checked against a paged cache built independently of the converters
   (``expected_paged``: plain per-token assignment of K to channels [:D] and V to [D:], in each
   layout a GPU backend uses: FlashAttention's token-major NHD and the head-major order). The
   data is a prompt of its own whose K are all positive and V all negative, with magnitudes
   drawn per element (``pattern_kv``), so a K/V swap, a transpose or any offset shows; put, then
   leased from the CUDA pool. Per layout: (a) ``channel-split``'s scatter of the leased chunks
   (kvcached_client/vllm/paged.py) is bit-identical to the expected cache, and gathering back
   gives the chunks; (b) the worker side itself (``WorkerSide``, its side streams and events):
   a synchronous load, with a kernel per layer on the current stream after
   ``wait_for_layer`` that must see the layer loaded, reported loaded only once its copies are
   done, the cache bit-exact; an asynchronous load, reported by ``get_finished``; a store of a
   new prompt (``acquire_reserve``, the paged cache filled from an expected layout, a save
   plan, reported, committed, read back bit-exact). Figures: the scatter's, the worker's load's
   and its store's GPU time (CUDA events) vs a plain device copy of the same bytes, the load and
   the store each beside the worker making one converter call per chunk and layer (same run),
   the host's time in the load's step calls, and how
   often the worker's step calls synchronised the device (``torch.cuda.synchronize`` and the
   stream and event waits, counted): it must be 0.
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
import dataclasses
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


# -- vllm_paged: the connector's data path against an independently built paged layout --------
#
# Module-level so that tests/bench/test_gpu_check_paged.py runs the same code on the CPU (a host
# pool, a CPU paged cache; the worker copies synchronously there), all of it but the CUDA
# streams, events and timings.

#: The physical orders of a channel-split cache: FlashAttention's NHD (token-major blocks,
#: memory [blocks, block_size, heads, 2D]) and head-major blocks (memory [blocks, heads,
#: block_size, 2D]); either is seen by the converter through the logical [B, H, N, 2D] view.
ORDERS = ("BNHC", "BHNC")
PAGED_BLOCK = 16  # vLLM's default GPU block size: a 128-token chunk spans 8 blocks
REPORT_TIMEOUT = 10.0  # the worker reporting a plan whose copies are done (a CUDA event that fired)


def pattern_kv(layers: int, heads: int, tokens: int, head_dim: int, dtype, *, seed: int, device="cpu"):
    """[2, layers, heads, tokens, head_dim] K/V on which any misplaced element shows: K > 0 and
    V < 0 everywhere (a K/V swap flips every sign), magnitudes ``(1 + m / 128) * 2**e`` with m in
    0..127 and e in -8..7 drawn per element (2,048 values, each exact in bfloat16, float16 and
    float32, none zero, no NaN): an element moved onto another place (a transpose, a token,
    head, layer, block or channel offset) differs from what is there with probability
    2047/2048, so over a block's thousands of elements every such error shows. The values are
    built bit by bit as float32 (no arithmetic that could round), then cast exactly."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    shape = (2, layers, heads, tokens, head_dim)
    m = torch.randint(0, 128, shape, generator=g, device=device, dtype=torch.int16).int()
    e = torch.randint(-8, 8, shape, generator=g, device=device, dtype=torch.int16).int()
    bits = ((e + 127) << 23) | (m << 16)  # float32: sign 0, biased exponent, 7 fraction bits
    bits[1] |= torch.iinfo(torch.int32).min  # the sign bit: V negative
    return bits.view(torch.float32).to(dtype)


def physical_shape(order: str, layers: int, num_blocks: int, block: int, heads: int, head_dim: int) -> tuple:
    """The memory shape of a paged cache of every layer, [layers, ...] (one layer: ``[l]``)."""
    if order == "BNHC":
        return (layers, num_blocks, block, heads, 2 * head_dim)
    if order == "BHNC":
        return (layers, num_blocks, heads, block, 2 * head_dim)
    raise ValueError(f"unknown paged order {order!r}")


def logical_view(phys_layer, order: str):
    """One layer's physical cache seen as vLLM's logical [B, H, N, 2D] (what a converter gets)."""
    return phys_layer.permute(0, 2, 1, 3) if order == "BNHC" else phys_layer


def expected_paged(kv, block_ids, block: int, num_blocks: int, order: str):
    """The physical paged cache, [layers, ...] as :func:`physical_shape`, that holds ``kv``
    ([2, layers, heads, tokens, head_dim]: a prompt's K/V from its first token) in ``block_ids``
    (block j of the prompt, tokens ``j * block`` onwards, in block ``block_ids[j]``) and zeros in
    every other block, built by plain per-token assignment from what the layout means, not by a
    converter: for token t of block j (prompt token ``j * block + t``), K in channels [:D] and
    V in channels [D:] of that token's row, for every layer and head at once:

    * BNHC (NHD): ``cache[layer, b, t, h, :D] = K[layer, h, token]``, ``cache[layer, b, t, h, D:] = V[...]``
    * BHNC (HND): ``cache[layer, b, h, t, :D] = K[layer, h, token]``, ``cache[layer, b, h, t, D:] = V[...]``
    """
    import torch

    _, layers, heads, tokens, d = kv.shape
    block_ids = [int(b) for b in block_ids]
    if len(set(block_ids)) != len(block_ids) or not all(0 <= b < num_blocks for b in block_ids):
        raise ValueError(f"block ids must be distinct and in 0..{num_blocks - 1}")
    if len(block_ids) * block > tokens:
        raise ValueError(f"{len(block_ids)} blocks of {block} tokens, but kv holds {tokens} tokens")
    phys = torch.zeros(physical_shape(order, layers, num_blocks, block, heads, d), dtype=kv.dtype, device=kv.device)
    for j, b in enumerate(block_ids):
        for t in range(block):
            token = j * block + t
            if order == "BNHC":
                phys[:, b, t, :, :d] = kv[0, :, :, token]  # [layers, heads, D]
                phys[:, b, t, :, d:] = kv[1, :, :, token]
            else:
                phys[:, b, :, t, :d] = kv[0, :, :, token]
                phys[:, b, :, t, d:] = kv[1, :, :, token]
    return phys


def bits(t):
    """The tensor's bytes as integers of its element size (a view): bit-exact comparisons, with
    -0.0 != 0.0 and NaN == NaN of the same bits."""
    import torch

    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits(a, b) -> bool:
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(bits(a), bits(b)))


def layout_mismatch(got, want, order: str) -> str | None:
    """None if the physical caches ``got`` and ``want`` ([layers, ...]) are bit-identical, else
    where and how they differ."""
    import torch

    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape {list(got.shape)} {got.dtype}, expected {list(want.shape)} {want.dtype}"
    if torch.equal(bits(got), bits(want)):
        return None
    g, w = got.cpu(), want.cpu()
    diff = bits(g) != bits(w)
    i = int(diff.reshape(-1).to(torch.uint8).argmax())  # the first difference (nonzero() would list them all)
    first: tuple[int, ...] = ()
    for size in reversed(diff.shape):
        first, i = (i % size, *first), i // size
    names = ("layer", "block", "token", "head", "channel") if order == "BNHC" else \
            ("layer", "block", "head", "token", "channel")
    where = ", ".join(f"{k} {v}" for k, v in zip(names, first))
    d = w.shape[-1] // 2
    hint = ""
    if torch.equal(bits(g), bits(torch.cat([w[..., d:], w[..., :d]], dim=-1))):
        hint = " (K and V swapped)"
    elif not bool(bits(g).any()):
        hint = " (the cache was not written at all)"
    return (f"{int(diff.sum())} of {diff.numel()} elements differ, first at {where}: "
            f"{g[first].item()!r} instead of {w[first].item()!r}{hint}")


def block_ids_for(n_blocks: int, num_blocks: int, seed: int) -> list[int]:
    """``n_blocks`` distinct block ids out of ``num_blocks``, scattered as vLLM allocates them. Never
    block 0: that is vLLM's null block (a sliding window's padding), which the worker skips."""
    import torch

    perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed))
    return (perm[:n_blocks] + 1).tolist()


def scatter_chunks(converter, views: list, chunks: list, ids_dev, per_chunk: int) -> None:
    """Chunk i of a prompt into blocks ``ids[i * per_chunk : (i + 1) * per_chunk]``, every layer."""
    for i, ch in enumerate(chunks):
        bid = ids_dev[i * per_chunk : (i + 1) * per_chunk]
        for layer, v in enumerate(views):
            converter.scatter(v, bid, ch[:, layer])


def gather_chunks(converter, views: list, like: list, ids_dev, per_chunk: int) -> list:
    import torch

    back = [torch.empty_like(ch) for ch in like]
    for i, out in enumerate(back):
        bid = ids_dev[i * per_chunk : (i + 1) * per_chunk]
        for layer, v in enumerate(views):
            converter.gather(v, bid, out[:, layer])
    return back


class Clock:
    """GPU seconds between two CUDA events on the current stream (on a CUDA device), else wall
    seconds. ``stop`` waits on the host for the end event: call it outside what is watched."""

    def __init__(self, device) -> None:
        import torch

        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._t = 0.0

    def start(self) -> None:
        if self.cuda:
            self._start.record()
        else:
            self._t = time.perf_counter()

    def stop(self) -> float:
        if not self.cuda:
            return time.perf_counter() - self._t
        self._end.record()
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1e3


def d2d_seconds(nbytes: int, device, rounds: int) -> float:
    """Median seconds of one plain ``copy_`` of ``nbytes`` between two tensors on ``device``."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    clock = Clock(device)

    def once() -> float:
        clock.start()
        dst.copy_(src)
        return clock.stop()

    return median_time(once, rounds)


class SyncWatch:
    """Counts the device-, stream- and event-wide CUDA synchronisations (``torch.cuda.synchronize``,
    ``torch.cuda.Stream.synchronize``, ``torch.cuda.Event.synchronize``, looked up at call time
    by whatever calls them) made inside :meth:`call`, and on a CUDA device collects what torch's
    sync debug mode flags there (host-blocking calls such as ``.item()``). Installed for a
    ``with`` block; the patches are undone at its end."""

    KINDS = ("torch.cuda.synchronize", "torch.cuda.Stream.synchronize", "torch.cuda.Event.synchronize")

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.counts = dict.fromkeys(self.KINDS, 0)
        self.flagged: list[str] = []
        self.calls = 0
        self._active = False
        self._saved: list = []

    def __enter__(self) -> "SyncWatch":
        import torch

        targets = [(torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda.Event, "synchronize")]
        for (obj, attr), kind in zip(targets, self.KINDS):
            orig = getattr(obj, attr)
            self._saved.append((obj, attr, orig))
            setattr(obj, attr, self._counting(kind, orig))
        return self

    def __exit__(self, *exc: object) -> None:
        for obj, attr, orig in reversed(self._saved):
            setattr(obj, attr, orig)
        self._saved = []

    def _counting(self, kind: str, orig: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._active:
                self.counts[kind] += 1
            return orig(*args, **kwargs)

        return counted

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def call(self, fn: Callable, *args: Any) -> Any:
        import warnings

        import torch

        self.calls += 1
        self._active = True
        mode = None
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if self.cuda:
                    mode = torch.cuda.get_sync_debug_mode()
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    return fn(*args)
                finally:
                    if mode is not None:
                        torch.cuda.set_sync_debug_mode(mode)
        finally:
            self._active = False
            name = getattr(fn, "__name__", repr(fn))
            self.flagged += [f"{name}: {w.message}"[:300] for w in caught if "synchroniz" in str(w.message)]


def put_pattern(c, layout, tokens: list[int], *, seed: int, device):
    """Put a :func:`pattern_kv` prompt; returns its K/V (on ``device``)."""
    from kvcached.contract.kv import torch_dtype

    kv = pattern_kv(layout.num_layers, layout.num_kv_heads, len(tokens), layout.head_dim, torch_dtype(layout.dtype),
                    seed=seed, device=device)
    stored = c.put(layout, tokens, kv).stored_chunks
    check(stored == len(tokens) // layout.chunk_tokens,
          f"the pattern prompt stored {stored} of {len(tokens) // layout.chunk_tokens} chunks")
    return kv


def converter_check(converter, chunks: list, kv, order: str, *, block: int, rounds: int, seed: int = 11,
                    fig: dict | None = None) -> dict:
    """Scatter a prompt's leased chunks with ``converter`` into a zeroed paged cache of ``order``
    (every layer, twice the blocks the prompt needs, at scattered ids): the physical cache must
    be bit-identical to :func:`expected_paged` of the K/V the chunks hold (``kv``), and
    gathering the blocks back must give the chunks again. The scatter's time against a plain
    copy of the same bytes. The figures go into ``fig`` (as they are found: a failed check
    leaves those before it), which is returned."""
    import torch

    fig = {} if fig is None else fig
    device = chunks[0].device
    _, layers, heads, chunk_tokens, d = chunks[0].shape
    per_chunk = chunk_tokens // block
    n_blocks = len(chunks) * per_chunk
    num_blocks = 2 * n_blocks
    ids = block_ids_for(n_blocks, num_blocks, seed)
    ids_dev = torch.tensor(ids, dtype=torch.long, device=device)
    phys = torch.zeros(physical_shape(order, layers, num_blocks, block, heads, d), dtype=chunks[0].dtype, device=device)
    views = [logical_view(phys[layer], order) for layer in range(layers)]
    want = expected_paged(kv, ids, block, num_blocks, order)
    scatter_chunks(converter, views, chunks, ids_dev, per_chunk)
    wrong = layout_mismatch(phys, want, order)
    clock = Clock(device)

    def timed() -> float:
        clock.start()
        scatter_chunks(converter, views, chunks, ids_dev, per_chunk)
        return clock.stop()

    sc = median_time(timed, rounds)  # the same chunks again: the same bytes
    back = gather_chunks(converter, views, chunks, ids_dev, per_chunk)
    exact_back = all(same_bits(a, b) for a, b in zip(chunks, back))
    nbytes = sum(ch.numel() * ch.element_size() for ch in chunks)
    fig.update(matches_expected_layout=wrong is None, layout_error=wrong, bit_exact=exact_back, scatter_seconds=sc,
               scatter_gbps=nbytes / sc / 1e9, bytes=nbytes, block_size=block, blocks=n_blocks)
    check(wrong is None, f"{order}: the converter's scatter differs from the expected paged layout: {wrong}")
    check(exact_back, f"{order}: chunks gathered back from the paged cache differ from the leased ones")
    return fig


def _wait_report(w, watch: SyncWatch, done: Callable, what: str, timeout: float) -> tuple:
    """Poll the worker (``take_report`` and ``get_finished``, never blocking) until ``done(report,
    finished)``; returns the merged report and the finished set."""
    from kvcached_client.vllm.plan import KvcachedWorkerMetadata

    report, finished = KvcachedWorkerMetadata(), set()
    deadline = time.monotonic() + timeout
    while True:
        r = watch.call(w.take_report)
        if r is not None:
            report = report.aggregate(r)
        finished |= watch.call(w.get_finished)[1]
        if done(report, finished):
            return report, finished
        if time.monotonic() > deadline:
            raise StepFailed(f"timed out after {timeout:.0f} s waiting for the worker to report {what}; it reported "
                             f"loaded={report.loaded}, saved={report.saved}, load_failed={report.load_failed}, "
                             f"finished={finished}")
        time.sleep(0.002)


def worker_check(c, client_factory: Callable, layout, lease, kv, order: str, store_tokens: list[int], *,
                 converter, block: int, rounds: int, watch: SyncWatch, store_seed: int, d2d: float,
                 seed: int = 21, timeout: float = REPORT_TIMEOUT, fig: dict | None = None) -> dict:
    """The connector's worker side (:class:`WorkerSide`, its real stream and event code on a CUDA
    cache) on a paged cache of ``order``, checked against :func:`expected_paged`:

    1. a synchronous load of the whole leased prompt (``kv``): ``begin_step``, ``start_load``,
       then per layer ``wait_for_layer`` and a kernel on the current stream that reads the
       layer's blocks (it must see them loaded: the layer's event orders it), ``finish_step``;
       the plan is reported loaded once (only after its copies are done); the cache bit-exact;
    2. the same load timed, ``rounds`` times (start and end events on the current stream: the
       load stream waits for the first, the last layer's event precedes the second);
    3. an asynchronous load into the zeroed cache: ``get_finished`` says the request is done
       once the copies are, the cache bit-exact;
    4. a store: the cache filled with an independently built prompt (``store_tokens``, not
       cached), reserved with ``acquire_reserve``; a save plan; reported written; committed;
       read back through a lease: the chunks are the K/V the cache was built from.

    Every worker call is made through ``watch``, which counts device synchronisations. The
    figures go into ``fig`` as they are found, which is returned."""
    import torch

    from kvcached.contract.kv import torch_dtype
    from kvcached_client.vllm.plan import KvcachedMetadata, LoadPlan, SavePlan
    from kvcached_client.vllm.worker import WorkerSide

    device = lease.chunk(0).device
    lay, n_chunks = layout, len(lease)
    per_chunk = lay.chunk_tokens // block
    n_blocks = n_chunks * per_chunk
    num_blocks = 2 * n_blocks
    names = [f"model.layers.{i}.self_attn.attn" for i in range(lay.num_layers)]
    phys = torch.zeros(physical_shape(order, lay.num_layers, num_blocks, block, lay.num_kv_heads, lay.head_dim),
                       dtype=torch_dtype(lay.dtype), device=device)
    views = [logical_view(phys[layer], order) for layer in range(lay.num_layers)]
    ids = block_ids_for(n_blocks, num_blocks, seed)
    ids_dev = torch.tensor(ids, dtype=torch.long, device=device)
    want = expected_paged(kv, ids, block, num_blocks, order)
    nbytes = n_chunks * lay.chunk_bytes
    fig = {} if fig is None else fig
    fig.update(blocks=n_blocks, bytes=nbytes)
    clock = Clock(device)

    def load_plan(async_load: bool):
        return KvcachedMetadata(loads=[LoadPlan(req_id="r", key=1, first_block=0, block_ids=(tuple(ids),),
                                                tickets=(lease.ticket(),), loadable_blocks=(n_blocks,),
                                                load_before=time.monotonic() + 60, async_load=async_load)])

    def loaded(what: str) -> tuple:
        report, finished = _wait_report(w, watch, lambda r, f: (1, 0) in r.loaded, what, timeout)
        check(report.loaded == {(1, 0): 1} and not report.load_failed and not report.saved,
              f"{order}: {what}: the worker reported loaded={report.loaded}, load_failed={report.load_failed}, "
              f"saved={report.saved}; expected loaded={{(1, 0): 1}} only")
        failed = watch.call(w.take_failed_blocks)
        check(not failed, f"{order}: {what}: {len(failed)} blocks reported as failed loads")
        return report, finished

    w = WorkerSide(names, block, lay.chunk_tokens, tp_rank=0, converter=converter, client_factory=client_factory)
    try:
        w.register(dict(zip(names, views)))
        fig["side_streams"] = w._load_stream is not None and w._save_stream is not None
        check(fig["side_streams"] == (device.type == "cuda"),
              f"{order}: the worker made side streams: {fig['side_streams']}, for a cache on {device}")

        # 1. synchronous load, the forward reading each layer after its wait
        def layer_sum(layer: int):  # a kernel reading the layer's loaded blocks (no host wait)
            return views[layer].index_select(0, ids_dev).abs().float().sum()

        sums = torch.zeros(lay.num_layers, dtype=torch.float32, device=device)
        meta = load_plan(False)
        watch.call(w.begin_step, meta)
        watch.call(w.start_load, meta)
        for layer, name in enumerate(names):
            watch.call(w.wait_for_layer, name)
            sums[layer] = layer_sum(layer)  # the "forward", on the current stream
        watch.call(w.finish_step)
        _, finished = loaded("a synchronous load")
        check(finished == set(), f"{order}: a synchronous load was reported finished receiving: {finished}")
        wrong = layout_mismatch(phys, want, order)
        fig["sync_load_matches_expected_layout"] = wrong is None
        check(wrong is None, f"{order}: after the worker's synchronous load the paged cache differs from the "
                             f"expected layout: {wrong}")
        ref = torch.stack([layer_sum(layer) for layer in range(lay.num_layers)])  # now that the copies are done
        fig["layer_reads_after_wait"] = ok = bool(torch.allclose(sums, ref, rtol=1e-6, atol=0.0))
        check(ok, f"{order}: a kernel on the current stream after wait_for_layer read other values than the loaded "
                  f"blocks hold (per-layer sums {sums.tolist()[:4]}... vs {ref.tolist()[:4]}...): the layer's wait "
                  "does not order the forward after its copies")

        # 2. the same load, timed: the worker as it is and, side by side (rounds interleaved), the
        # worker making one converter call per chunk and layer (PagedLayout.batches off); GPU time
        # (events on the current stream) and the host's time in the step calls (the engine's thread)
        contenders = {"as_is": converter, "per_chunk_calls": dataclasses.replace(converter, batches=False)}
        times: dict[str, list[float]] = {k: [] for k in contenders}
        host: dict[str, list[float]] = {k: [] for k in contenders}
        for _ in range(max(1, rounds)):
            for mode, conv in contenders.items():
                w.converter = conv
                meta = load_plan(False)
                clock.start()
                t0 = time.perf_counter()
                watch.call(w.begin_step, meta)
                watch.call(w.start_load, meta)
                for name in names:
                    watch.call(w.wait_for_layer, name)
                host[mode].append(time.perf_counter() - t0)
                times[mode].append(clock.stop())
                watch.call(w.finish_step)
                loaded("a timed synchronous load")
        w.converter = converter
        load_s = statistics.median(times["as_is"])
        per_chunk_s = statistics.median(times["per_chunk_calls"])
        fig.update(load_seconds=load_s, load_gbps=nbytes / load_s / 1e9, load_ratio_vs_d2d=d2d / load_s,
                   load_rounds=len(times["as_is"]), load_host_seconds=statistics.median(host["as_is"]),
                   converter_batches=converter.batches, load_seconds_per_chunk_calls=per_chunk_s,
                   load_host_seconds_per_chunk_calls=statistics.median(host["per_chunk_calls"]),
                   load_speedup_vs_per_chunk_calls=per_chunk_s / load_s)

        # 3. asynchronous load into the zeroed cache
        phys.zero_()
        meta = load_plan(True)
        watch.call(w.begin_step, meta)
        watch.call(w.start_load, meta)
        watch.call(w.finish_step)
        report, finished = _wait_report(w, watch, lambda r, f: (1, 0) in r.loaded and "r" in f,
                                        "an asynchronous load", timeout)  # no layer waits: nothing in the step reads it
        check(report.loaded == {(1, 0): 1} and not report.load_failed and finished == {"r"},
              f"{order}: an asynchronous load: the worker reported loaded={report.loaded}, "
              f"load_failed={report.load_failed}, finished receiving {finished}; expected {{(1, 0): 1}} and {{'r'}}")
        failed = watch.call(w.take_failed_blocks)
        check(not failed, f"{order}: an asynchronous load: {len(failed)} blocks reported as failed loads")
        wrong = layout_mismatch(phys, want, order)
        fig["async_load_matches_expected_layout"] = wrong is None
        check(wrong is None, f"{order}: after the worker's asynchronous load the paged cache differs from the "
                             f"expected layout: {wrong}")

        # 4. store: the cache holds a new prompt (as if the forward had computed it)
        kv_s = pattern_kv(lay.num_layers, lay.num_kv_heads, len(store_tokens), lay.head_dim, torch_dtype(lay.dtype),
                          seed=store_seed, device=device)
        ids_s = block_ids_for(n_blocks, num_blocks, seed + 1)
        phys.copy_(expected_paged(kv_s, ids_s, block, num_blocks, order))

        def store(tokens: list[int], conv, what: str) -> float:
            """One store of the cache's prompt under ``tokens`` with converter ``conv``; its GPU seconds,
            after checking it was reported, committed whole and reads back bit-exact."""
            c.sync()  # the previous read-back lease is released on the daemon before this reserve
            w.converter = conv
            req = c.acquire_reserve(lay, tokens, reservation_ttl=600)
            try:
                slots = [s.position for s in req.reservation.slots]
                check(req.matched_tokens == 0 and slots == list(range(n_chunks)),
                      f"{order}: {what}: the store prompt's reservation: {req.matched_tokens} tokens cached, slots "
                      f"{slots}; expected none cached and slots 0..{n_chunks - 1}")
                meta = KvcachedMetadata(saves=[SavePlan(req_id="s", key=2, tickets=(req.reservation.ticket(),),
                                                        from_block=0, to_block=n_blocks, block_ids=(tuple(ids_s),),
                                                        blocks_per_chunk=n_blocks // n_chunks, to_chunk=n_chunks)])
                clock.start()
                watch.call(w.begin_step, meta)
                watch.call(w.start_load, meta)
                watch.call(w.finish_step)  # the compute stream waits for the store's copies
                seconds = clock.stop()
                report, _ = _wait_report(w, watch, lambda r, f: (2, 0) in r.saved, "a store", timeout)
                check(report.saved == {(2, 0): [n_chunks]} and not report.loaded and not report.load_failed,
                      f"{order}: {what}: the worker reported saved={report.saved}, loaded={report.loaded}, "
                      f"load_failed={report.load_failed}; expected saved={{(2, 0): [{n_chunks}]}} only")
                stored = req.finish().stored_chunks
            except BaseException:
                if not req.reservation.done:
                    req.finish(commit=False)
                raise
            finally:
                w.converter = converter
            check(stored == n_chunks, f"{order}: {what}: the commit stored {stored} of {n_chunks} chunks")
            with c.acquire(lay, tokens) as back:
                check(back.matched_tokens == len(tokens),
                      f"{order}: {what}: the stored prompt matched {back.matched_tokens} of {len(tokens)} tokens")
                ct = lay.chunk_tokens
                bad = [i for i in range(len(back)) if not same_bits(back.chunk(i), kv_s[:, :, :, i * ct : (i + 1) * ct])]
            fig["store_bit_exact"] = fig.get("store_bit_exact", True) and not bad
            check(not bad, f"{order}: {what}: stored chunks {bad} differ from the K/V the paged cache was built from")
            fig["stored_chunks"] = stored
            return seconds

        # the worker as it is, then (a contender, one store each) making one converter call per chunk
        # and layer, under other tokens: the same bytes stored again
        store_s = store(store_tokens, converter, "a store")
        per_chunk_store_s = store([t + 500_000 for t in store_tokens], contenders["per_chunk_calls"],
                                  "a store with per-chunk calls")
        fig.update(store_seconds=store_s, store_gbps=nbytes / store_s / 1e9, store_ratio_vs_d2d=d2d / store_s,
                   store_seconds_per_chunk_calls=per_chunk_store_s,
                   store_speedup_vs_per_chunk_calls=per_chunk_store_s / store_s)
    finally:
        w.close()
    return fig


def paged_check(c, client_factory: Callable, layout, n_chunks: int, fig: dict, *, device, rounds: int,
                block: int = PAGED_BLOCK, converter=None, token_base: int = 1_000_000_000) -> None:
    """The ``vllm_paged`` step on the daemon ``c`` talks to (its pool on ``device``): a
    :func:`pattern_kv` prompt put and leased; per order, :func:`converter_check` on the leased
    chunks, then :func:`worker_check`; the worker's step calls must not synchronise the device."""
    import torch

    from kvcached_client.vllm.paged import CHANNEL_SPLIT

    converter = converter or CHANNEL_SPLIT
    n = n_chunks * layout.chunk_tokens
    tokens = [token_base + i for i in range(n)]
    kv = put_pattern(c, layout, tokens, seed=5, device=device)
    nbytes = n_chunks * layout.chunk_bytes
    fig["d2d_seconds"] = d2d = d2d_seconds(nbytes, device, rounds)
    fig["d2d_gbps"] = nbytes / d2d / 1e9
    fig["converter"] = converter.name
    watch = SyncWatch(torch.device(device).type == "cuda")
    try:
        with watch, c.acquire(layout, tokens, ttl=600) as lease:
            check(lease.matched_tokens == n and len(lease) == n_chunks,
                  f"the pattern prompt's lease matched {lease.matched_tokens} of {n} tokens in {len(lease)} chunks")
            check(not any(loc.nvme_key for loc in lease.locations), "the pattern prompt's lease has chunks on NVMe")
            chunks = [lease.chunk(i) for i in range(n_chunks)]
            ct = layout.chunk_tokens
            want = torch.device(device)  # "cuda" names no index; a leased chunk is on cuda:N
            check(all(ch.device.type == want.type and want.index in (None, ch.device.index) for ch in chunks),
                  f"leased chunks are not on {device}: {sorted({str(ch.device) for ch in chunks})}")
            bad = [i for i, ch in enumerate(chunks) if not same_bits(ch, kv[:, :, :, i * ct : (i + 1) * ct])]
            check(not bad, f"leased chunks {bad} differ from the pattern prompt that was put")
            for k, order in enumerate(ORDERS):
                fig[order] = f = {}
                converter_check(converter, chunks, kv, order, block=block, rounds=rounds, fig=f)
                f["ratio_vs_d2d"] = d2d / f["scatter_seconds"]
                store = [token_base + (k + 1) * 1_000_000 + i for i in range(n)]
                f["worker"] = {}
                worker_check(c, client_factory, layout, lease, kv, order, store, converter=converter, block=block,
                             rounds=rounds, watch=watch, store_seed=6 + k, d2d=d2d, fig=f["worker"])
    finally:
        fig["worker_calls_watched"] = watch.calls
        fig["worker_synchronize_calls"] = dict(watch.counts)
        fig["worker_host_syncs_flagged"] = watch.flagged[:20]
    check(watch.total == 0, f"the worker synchronised the device {watch.total} times in its step calls "
                            f"({watch.counts}): it must wait on events, never on the whole device")


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
        fig.update(self._host_read(nbytes))
        fig["ratio_vs_host_read_cold"] = promo / fig["host_read_cold_gbps"]

    def _host_read(self, nbytes: int) -> dict:
        """Attribution: how fast this host copies ``nbytes`` of the NVMe tier's LMDB file (in the
        page cache: just written) into pinned memory, the first time the file is mapped (each 4 KiB
        page faults in, as in the daemon's mapping after a value is rewritten) and again (mapped).
        The daemon's promotion reads a value into pinned staging, then copies it to the GPU."""
        import mmap

        import torch

        paths = [os.path.join(d, f) for d, _, fs in os.walk(self.daemon.state_dir) for f in fs if f == "data.mdb"]
        check(bool(paths), f"no data.mdb under {self.daemon.state_dir}")
        size = min(nbytes, os.path.getsize(paths[0])) // 4096 * 4096
        pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        out = {"host_read_bytes": size}
        for label in ("cold", "warm"):
            if label == "cold":
                f = open(paths[0], "rb")
                mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
            t = time.perf_counter()
            pinned.numpy()[:] = memoryview(mm)[:size]
            out[f"host_read_{label}_gbps"] = size / (time.perf_counter() - t) / 1e9
        mm.close()
        f.close()
        return out

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
        from kvcached_client import Client

        def worker_client(placement: str = "") -> Client:  # the worker side's own client, as a vLLM worker process has
            return Client(self.daemon.socket, timeout=RPC_TIMEOUT, nvme_read="promote", placement=placement)

        with self.client() as c:
            paged_check(c, worker_client, self.layout, self.chunks, entry["figures"], device="cuda",
                        rounds=self.args.rounds)
            c.sync()  # the release is asynchronous: done before the next step counts leases

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
