"""Daemon crash: SIGKILL the daemon at random moments under a put/acquire load from
several client processes, restart it each time, and check the durability contract.

One daemon serves two trust domains, so one SIGKILL hits both durability modes at once:
``default`` is write-back (chunks reach NVMe on eviction or Flush) and ``wt`` is write-through
(Commit writes NVMe before it returns).

The contract checked, after every restart and at the end:

* A chunk is *durable* once (a) a write-through Commit acknowledged it (the reply's
  ``durable_tokens``: what reached NVMe; never merely "the Commit returned"), or (b) a Flush RPC
  that started after its commit returned has returned, on the same daemon incarnation (pool
  generation unchanged across the batch). Workers append what is durable to a file once that
  is so. Every durable chunk is found again (lookup hit) with identical bytes (acquire + read).
* No corrupt chunk is ever served: payloads are a deterministic function of the prompt prefix
  (:func:`chunk_payload`), and every byte any worker or the checker reads is compared.
* The rebuilt index equals the NVMe contents: right after a restart, before any new write,
  ``indexed_chunks`` == NVMe chunks == keys in the LMDB file, and for every prompt ever
  written, Lookup == the number of its leading chunks whose hashes are LMDB keys.
* Clients see UNAVAILABLE while the daemon is down and recover by themselves (same
  ``Client`` object, no reconnect call) once it is back.

The workers (:func:`worker_main`) and the driver (:class:`CrashLoop`) serve both
``tests/reliability/test_crash.py`` (the bounded version) and ``bench/crash_loop.py`` (the long
one, >= 20 kills).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import numpy as np

from bench.harness.daemon import Daemon
from bench.harness.layouts import RELIABILITY_LAYOUT as LAYOUT

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CT = LAYOUT.chunk_tokens
SHARED_PREFIXES = 8  # prompts of every worker start with one of these: cross-process in-flight conflicts

#: The two durability modes, one trust domain each (lane name -> domain, write_through).
LANES = (("wb", "default", False), ("wt", "wt", True))


# -- deterministic data: any process can check any chunk it reads -----------------------------


def prompt_tokens(w: int, j: int) -> list[int]:
    """Prompt ``j`` of worker ``w``: a shared prefix (1-3 chunks) + its own tail (1-4 chunks)."""
    assert 0 <= j < (1 << 18) and 0 <= w < 255
    s = j % SHARED_PREFIXES
    shared = [s * 64 + k for k in range(CT * (1 + s % 3))]
    base = ((w + 1) << 24) + j * 64
    return shared + [base + k for k in range(CT * (1 + (7 * j + w) % 4))]


def chunk_payload(tokens: list[int], i: int) -> bytes:
    """Bytes of chunk ``i``: a function of every token up to the end of that chunk (like real KV).

    float32 values of small integers, so no NaN can make two equal payloads compare unequal."""
    raw = np.asarray(tokens[: (i + 1) * CT], dtype="<u4").tobytes()
    digest = hashlib.shake_128(b"kvc-crash" + raw).digest(LAYOUT.chunk_bytes // 2)
    return np.frombuffer(digest, dtype="<u2").astype("<f4").tobytes()


def kv_tensor(tokens: list[int]) -> Any:
    import torch

    chunks = [torch.frombuffer(bytearray(chunk_payload(tokens, i)), dtype=torch.float32).view(LAYOUT.chunk_shape)
              for i in range(len(tokens) // CT)]
    return torch.cat(chunks, dim=3)


def chunk_bytes_of(lease: Any, i: int) -> bytes:
    return lease.chunk(i).contiguous().numpy().tobytes()


def classify(e: BaseException) -> str:
    """What an error around a crash means.

    ``unavailable``: the daemon is down or restarting (allowed only around an outage).
    ``stale``: an id granted by the previous daemon (lease, reservation, session) is unknown to
    the new one, or a lease held across the restart is refused (allowed).
    ``unexpected``: anything else (the test fails).
    """
    from kvcached_client.errors import (DeadlineExceededError, FailedPreconditionError, NotFoundError,
                                        UnavailableError)

    if isinstance(e, (UnavailableError, DeadlineExceededError)):
        return "unavailable"
    if isinstance(e, (NotFoundError, FailedPreconditionError)):
        d = e.details.lower()
        if any(w in d for w in ("lease", "reservation", "session", "restarted")):
            return "stale"
    return "unexpected"


# -- the load: one client process ----------------------------------------------------------------


class _Lane:
    def __init__(self, name: str, socket: str, write_through: bool, client: Any, durable_path: str) -> None:
        self.name, self.socket, self.write_through, self.client = name, socket, write_through, client
        self.durable = open(durable_path, "a", buffering=1)  # noqa: SIM115 - closed at exit
        self.next_j = 0
        self.ok = True  # last op on this lane succeeded
        self.held: list[Any] = []  # leases kept for a while, re-checked before release
        self.batch: list[tuple[int, int]] = []  # write-back: (j, cached chunks) not yet flushed
        self.batch_gen: str | None = None
        self.puts_since_flush = 0


class _Worker:
    def __init__(self, cfg: dict, w: int) -> None:
        from kvcached_client import Client

        self.cfg, self.w, self.dir = cfg, w, cfg["dir"]
        self.rng = random.Random(cfg["seed"] * 1009 + w)
        nvme_read = cfg["nvme_read"]
        if nvme_read == "mixed":  # both ways NVMe chunks reach a client
            nvme_read = "promote" if w % 3 == 0 else "direct"
        self.lanes = [
            _Lane(name, sock, wt, Client(sock, nvme_read=nvme_read, timeout=10.0),
                  os.path.join(self.dir, f"durable.{name}.{w}"))
            for name, sock, wt in cfg["lanes"]
        ]
        self.events: list[list] = []  # [t, lane, kind, detail]
        self.c: dict[str, int] = {"puts": 0, "chunks_written": 0, "acquires": 0, "chunks_read": 0, "mismatches": 0,
                                  "flushes": 0, "batches_durable": 0, "batches_dropped": 0, "lookups": 0, "puts_not_durable": 0,
                                  "held_rechecked": 0}
        self.errors: dict[str, int] = {}
        self.samples: dict[str, str] = {}  # first message per unexpected error / mismatch
        self.threads_ready = 0
        self.last_up: dict[str, float] = {}

    # one op on a lane; any KvcachedError is handled by the caller
    def op(self, lane: _Lane) -> None:
        r = self.rng.random()
        if r < self.cfg["p_put"]:
            self.put(lane)
        elif r < self.cfg["p_put"] + self.cfg["p_acquire"]:
            self.acquire(lane)
        else:
            w2 = self.rng.randrange(self.cfg["workers"])
            lane.client.lookup(LAYOUT, prompt_tokens(w2, self.rng.randrange(max(1, lane.next_j))))
            self.c["lookups"] += 1

    def put(self, lane: _Lane) -> None:
        c = lane.client
        if not lane.write_through and lane.batch_gen is None:
            lane.batch_gen = c.pool_handle().generation
        j = lane.next_j
        lane.next_j += 1
        toks = prompt_tokens(self.w, j)
        r = c.put(LAYOUT, toks, kv_tensor(toks))
        self.c["puts"] += 1
        self.c["chunks_written"] += r.stored_chunks
        if lane.write_through:
            # What the commit acknowledged as on NVMe is durable; a short acknowledgement (full
            # disk) is counted, never recorded as durable.
            lane.durable.write(f"{j} {r.durable_tokens // CT}\n")
            self.c["puts_not_durable"] += not r.durable
        else:
            cached = c.lookup(LAYOUT, toks) // CT  # in the index now: committed (by us or another writer)
            lane.batch.append((j, cached))
            lane.puts_since_flush += 1
            if lane.puts_since_flush >= self.cfg["flush_every"]:
                self.flush(lane)

    def flush(self, lane: _Lane) -> None:
        c = lane.client
        g1 = c.pool_handle().generation
        c.flush()  # started after every commit of the batch returned
        g2 = c.pool_handle().generation
        self.c["flushes"] += 1
        if lane.batch_gen == g1 == g2:  # same daemon incarnation from the batch's first put to the flush
            lane.durable.writelines(f"{j} {n}\n" for j, n in lane.batch)
            self.c["batches_durable"] += 1
        else:
            self.c["batches_dropped"] += 1
        lane.batch, lane.batch_gen, lane.puts_since_flush = [], g2, 0

    def acquire(self, lane: _Lane) -> None:
        if lane.held and (len(lane.held) >= 2 or self.rng.random() < 0.3):
            self.recheck(lane, lane.held.pop(0))
            return
        if self.rng.random() < 0.5 and lane.next_j:
            w2, j2 = self.w, self.rng.randrange(max(0, lane.next_j - 40), lane.next_j)
        else:
            w2, j2 = self.rng.randrange(self.cfg["workers"]), self.rng.randrange(max(1, lane.next_j + 5))
        toks = prompt_tokens(w2, j2)
        lease = lane.client.acquire(LAYOUT, toks)
        lease.tokens = toks
        self.c["acquires"] += 1
        try:
            self.verify(lane, lease, toks, (w2, j2))
        except BaseException:
            self.release(lane, lease)
            raise
        if self.rng.random() < 0.3:
            lane.held.append(lease)  # keep it while other ops (and maybe a daemon restart) happen
        else:
            self.release(lane, lease)

    def verify(self, lane: _Lane, lease: Any, toks: list[int], who: tuple[int, int]) -> None:
        for i in range(len(lease)):
            got = chunk_bytes_of(lease, i)
            self.c["chunks_read"] += 1
            if got != chunk_payload(toks, i):
                self.c["mismatches"] += 1
                self.samples.setdefault("mismatch", f"lane {lane.name} prompt {who} chunk {i} of {len(lease)}")

    def recheck(self, lane: _Lane, lease: Any) -> None:
        """A lease held across other ops (maybe across a restart): its chunks must still be right,
        or the client must refuse to read them; never wrong bytes."""
        from kvcached_client.nvme import CorruptChunkError

        self.c["held_rechecked"] += 1
        try:
            self.verify(lane, lease, lease.tokens, (-1, -1))
        except CorruptChunkError as e:
            # An NVMe key from a lease of the previous daemon: the chunk may have been dropped since
            # (an orphan at rebuild). Refused, not served: fine.
            if "not in the nvme tier" not in str(e).lower():
                raise
            self.note_error(lane, e, "stale")
        finally:
            self.release(lane, lease)

    def release(self, lane: _Lane, lease: Any) -> None:
        from kvcached_client.errors import KvcachedError

        try:
            lease.release()
        except KvcachedError as e:  # a lease of the previous daemon: its session is not open there
            kind = classify(e)
            if kind == "stale":
                try:
                    current = lane.client.pool_handle().generation
                except KvcachedError:
                    current = None
                if current == lease._generation:  # the daemon that granted it forgot it: a lost lease
                    kind = "unexpected"
            self.note_error(lane, e, kind)

    def note_error(self, lane: _Lane, e: BaseException, kind: str | None = None) -> None:
        kind = kind or classify(e)
        key = f"{kind}:{type(e).__name__}"
        self.errors[key] = self.errors.get(key, 0) + 1
        if kind == "unexpected":
            self.samples.setdefault(key, f"{e}")
        self.events.append([time.monotonic(), lane.name, "err", kind])
        if lane.ok and kind == "unavailable":
            lane.ok = False
            self.events.append([time.monotonic(), lane.name, "down", type(e).__name__])

    def run(self) -> None:
        from kvcached_client.errors import KvcachedError

        stop, pause = os.path.join(self.dir, "stop"), os.path.join(self.dir, "pause")
        ready = False
        while not os.path.exists(stop):
            if os.path.exists(pause):
                self.wait_paused(pause, stop)
                continue
            lane = self.rng.choice(self.lanes)
            try:
                self.op(lane)
            except KvcachedError as e:
                self.note_error(lane, e)
                time.sleep(0.01)
                continue
            if not lane.ok:
                lane.ok = True
                self.events.append([time.monotonic(), lane.name, "up", ""])
                self.last_up[lane.name] = time.monotonic()
                _write_json(os.path.join(self.dir, f"up.{self.w}"), self.last_up)  # the driver waits for it
            if not ready and all(ln.next_j for ln in self.lanes):
                ready = True
                self.threads_ready = threading.active_count()
                _write_json(os.path.join(self.dir, f"ready.{self.w}"), {"t": time.monotonic()})
        # Before close(): what a long-lived client would hold. Threads of failed Session opens exit
        # asynchronously; wait for them (the loop ends as soon as they have; a leaked one never exits).
        deadline = time.monotonic() + 30.0
        while threading.active_count() > self.threads_ready and time.monotonic() < deadline:
            time.sleep(0.02)
        threads_end = threading.active_count()
        for lane in self.lanes:
            for lease in lane.held:
                self.release(lane, lease)
            lane.durable.close()
            lane.client.close()
        _write_json(os.path.join(self.dir, f"result.{self.w}.json"), {
            "counters": self.c, "errors": self.errors, "samples": self.samples, "events": self.events,
            "next_j": {ln.name: ln.next_j for ln in self.lanes},
            "threads_ready": self.threads_ready, "threads_end": threads_end,
        })

    def wait_paused(self, pause: str, stop: str) -> None:
        try:
            epoch = int(open(pause).read() or 0)
        except (OSError, ValueError):
            return
        _write_json(os.path.join(self.dir, f"ack.{self.w}"),
                    {"epoch": epoch, "next_j": {ln.name: ln.next_j for ln in self.lanes}})
        while os.path.exists(pause) and not os.path.exists(stop):
            time.sleep(0.005)
        for lane in self.lanes:  # the next success on each lane is its recovery ("up")
            lane.ok = False
        self.events.append([time.monotonic(), "*", "resume", ""])


def _write_json(path: str, doc: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def worker_main(cfg_path: str, w: int) -> None:
    with open(cfg_path) as f:
        cfg = json.load(f)
    _Worker(cfg, w).run()


# -- the driver --------------------------------------------------------------------------------


class CrashLoop:
    """Start a daemon, start ``workers`` load processes, SIGKILL + restart the daemon ``kills``
    times at random moments, check after each restart, stop, check at the end.

    Every ``quiesce_every``-th restart (and the last) happens with the workers paused, so the
    rebuilt index can be compared with the LMDB file before any new write; the others restart
    under load. Recovery time is measured from the moment clients may talk to the new daemon
    (ready line, or the end of the pause) to each (worker, lane)'s first successful call.
    """

    def __init__(self, root: str, *, workers: int = 3, kills: int = 5, seed: int = 0,
                 load_s: tuple[float, float] = (0.5, 1.5), down_s: tuple[float, float] = (0.2, 0.6),
                 quiesce_every: int = 2, flush_every: int = 8, bytes_sample: int | None = 150,
                 pool_bytes: str = "512K", nvme_bytes: str = "256M", nvme_read: str = "mixed",
                 log: Callable[[str], None] = lambda s: None) -> None:
        self.root, self.workers, self.kills, self.seed = root, workers, kills, seed
        self.rng = random.Random(seed)
        self.load_s, self.down_s, self.quiesce_every = load_s, down_s, quiesce_every
        self.bytes_sample = bytes_sample  # durable prompts whose bytes are read after a restart; None: all
        self.log = log
        self.run_dir = os.path.join(root, "run")
        os.makedirs(self.run_dir, exist_ok=True)
        sockets = {"default": os.path.join(root, "kv.sock"), "wt": os.path.join(root, "wt.sock")}
        self.lanes = [(name, sockets[dom], dom, wt) for name, dom, wt in LANES]
        sizes = {"pool_bytes": pool_bytes, "nvme_bytes": nvme_bytes}
        self.daemon = Daemon(root, **sizes, write_through=False,
                             domains={"wt": {"socket": sockets["wt"], "write_through": True, **sizes}})
        self.cfg = {"dir": self.run_dir, "seed": seed, "workers": workers, "flush_every": flush_every,
                    "p_put": 0.5, "p_acquire": 0.4, "lanes": [(n, s, wt) for n, s, _d, wt in self.lanes],
                    "nvme_read": nvme_read}
        # how the checker reads NVMe chunks ("mixed": a random one of the two per check)
        self.check_reads = ["direct", "promote"] if nvme_read == "mixed" else [nvme_read]
        self.procs: list[subprocess.Popen] = []
        self.restarts: list[dict] = []
        self.checks: list[dict] = []
        self._clients: dict[str, Any] = {}
        self._hasher: Any = None

    # -- processes --

    def _spawn(self, w: int) -> subprocess.Popen:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "clients"), env.get("PYTHONPATH", "")])
        out = open(os.path.join(self.run_dir, f"worker.{w}.log"), "w")  # noqa: SIM115 - the child owns it
        code = ("import sys; from bench.harness.crash import worker_main; "
                "worker_main(sys.argv[1], int(sys.argv[2]))")
        p = subprocess.Popen([sys.executable, "-c", code, os.path.join(self.run_dir, "cfg.json"), str(w)],
                             cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        out.close()
        return p

    def worker_log(self, w: int) -> str:
        try:
            with open(os.path.join(self.run_dir, f"worker.{w}.log")) as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    def _wait_files(self, name: str, timeout: float, pred: Callable[[dict], bool] = lambda d: True) -> dict[int, dict]:
        deadline = time.monotonic() + timeout
        while True:
            got = {}
            for w in range(self.workers):
                try:
                    with open(os.path.join(self.run_dir, f"{name}.{w}")) as f:
                        d = json.load(f)
                    if pred(d):
                        got[w] = d
                except (OSError, ValueError):
                    pass
            if len(got) == self.workers:
                return got
            for w, p in enumerate(self.procs):
                if p.poll() is not None:
                    raise AssertionError(f"worker {w} exited with {p.returncode}:\n{self.worker_log(w)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"workers {sorted(set(range(self.workers)) - set(got))} gave no {name} "
                                     f"within {timeout} s")
            time.sleep(0.01)

    def client(self, lane: str) -> Any:
        from kvcached_client import Client

        if lane not in self._clients:
            sock = next(s for n, s, _d, _w in self.lanes if n == lane)
            self._clients[lane] = Client(sock, session=False, nvme_read=self.check_reads[0])
        return self._clients[lane]

    # -- the run --

    def run(self) -> dict:
        t_begin = time.monotonic()
        with open(os.path.join(self.run_dir, "cfg.json"), "w") as f:
            json.dump(self.cfg, f)
        self.daemon.start()
        try:
            self.procs = [self._spawn(w) for w in range(self.workers)]
            self._wait_files("ready", 120)
            self.log(f"{self.workers} workers loading both lanes")
            for k in range(self.kills):
                self._one_kill(k, last=k == self.kills - 1)
            results = self._finish()
        finally:
            open(os.path.join(self.run_dir, "stop"), "w").close()
            for p in self.procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            for c in self._clients.values():
                c.close()
            if self.daemon.proc is not None:
                self.daemon.stop(signal.SIGKILL)
        results["seconds"] = time.monotonic() - t_begin
        return results

    def _wait_recovered(self, since: float, timeout: float = 10.0) -> None:
        """Until every (worker, lane) has had a successful call after ``since`` (or the timeout:
        the summary then reports it as unrecovered), so that the next kill hits a running load."""
        lanes = [n for n, *_ in self.lanes]
        try:
            self._wait_files("up", timeout, lambda d: all(d.get(n, 0.0) > since for n in lanes))
        except AssertionError as e:
            if "exited" in str(e):
                raise

    def _one_kill(self, k: int, last: bool) -> None:
        if self.restarts:
            self._wait_recovered(self.restarts[-1]["t_kill"])
        time.sleep(self.rng.uniform(*self.load_s))
        t_kill = time.monotonic()
        self.daemon.stop(signal.SIGKILL)  # mid-load: puts, flushes, acquires in flight
        time.sleep(self.rng.uniform(*self.down_s))  # clients keep calling: UNAVAILABLE
        quiesce = last or k % self.quiesce_every == 0
        acks = None
        if last:
            open(os.path.join(self.run_dir, "stop"), "w").close()
            for w, p in enumerate(self.procs):
                assert p.wait(60) == 0, f"worker {w} failed:\n{self.worker_log(w)}"
            acks = {w: self._result(w) for w in range(self.workers)}
        elif quiesce:
            with open(os.path.join(self.run_dir, "pause.tmp"), "w") as f:
                f.write(str(k + 1))
            os.replace(os.path.join(self.run_dir, "pause.tmp"), os.path.join(self.run_dir, "pause"))
            acks = self._wait_files("ack", 60, lambda d: d["epoch"] == k + 1)
        t_down = time.monotonic()
        self.daemon.start()
        t_ready = time.monotonic()
        rec: dict[str, Any] = {"kill": k + 1, "t_kill": t_kill, "t_ready": t_ready, "down_s": t_ready - t_kill,
                               "start_s": t_ready - t_down, "quiesced": quiesce}
        if quiesce:
            assert acks is not None
            rec["index"] = self.check_index({w: a["next_j"] for w, a in acks.items()})
            rec["durable"] = self.check_durable(full=last or self.bytes_sample is None)
            if not last:
                os.unlink(os.path.join(self.run_dir, "pause"))
        rec["t_resume"] = time.monotonic() if quiesce else t_ready
        if not quiesce:
            rec["durable"] = self.check_durable(full=False)  # under load
        self.restarts.append(rec)
        self.log(self._line(rec))

    def _result(self, w: int) -> dict:
        with open(os.path.join(self.run_dir, f"result.{w}.json")) as f:
            return json.load(f)

    def _line(self, rec: dict) -> str:
        d = rec["durable"]
        s = (f"kill {rec['kill']:>2}: down {rec['down_s']:.2f} s, {'quiesced' if rec['quiesced'] else 'under load'}; "
             f"durable: {d['durable_prompts']} prompts, {d['unique_durable_chunks']} chunks, lost {d['lost_chunks']}, "
             f"{d['bytes_checked_chunks']} chunks' bytes checked, {d['mismatches']} wrong")
        if "index" in rec:
            i = rec["index"]
            s += (f"; index {i['indexed']} == nvme {i['nvme_chunks']} == lmdb {i['lmdb_keys']}: "
                  f"{i['equal']}, prefix lookups disagreeing: {i['lookup_disagree']}/{i['prompts']}")
        return s

    # -- checks --

    def _hashes(self, domain: str, toks: list[int]) -> list[bytes]:
        from kvcached.contract.keys import ChunkHasher, Namespace

        if self._hasher is None:
            with open(os.path.join(self.daemon.state_dir, "hash.key"), "rb") as f:
                self._hasher = ChunkHasher(f.read())
        root = self._hasher.root(Namespace(domain, LAYOUT))
        return self._hasher.chain(root, np.asarray(toks, dtype="<u4").tobytes(), CT)

    def lmdb_keys(self, domain: str) -> set[bytes]:
        from kvcached_client.nvme import _acquire_env, _release_env

        path = os.path.join(self.daemon.state_dir, "nvme", domain)
        env, db, _gate = _acquire_env(path)  # the client library's read-only handle (one per process)
        try:
            with env.begin(db=db) as txn:
                return {bytes(k) for k in txn.cursor().iternext(keys=True, values=False)}
        finally:
            _release_env(path)

    def check_index(self, next_j: dict[int, dict[str, int]]) -> dict:
        """Right after a restart, nothing written yet: the index is exactly the LMDB contents."""
        out: dict[str, Any] = {"equal": True, "lookup_disagree": 0, "prompts": 0, "indexed": 0, "nvme_chunks": 0,
                               "lmdb_keys": 0, "examples": []}
        for name, _sock, domain, _wt in self.lanes:
            c = self.client(name)
            s = c.stats()
            keys = self.lmdb_keys(domain)
            out["indexed"] += s["indexed_chunks"]
            out["nvme_chunks"] += s["nvme"]["chunks"]
            out["lmdb_keys"] += len(keys)
            if not s["indexed_chunks"] == s["nvme"]["chunks"] == len(keys):
                out["equal"] = False
                out["examples"].append(f"{name}: indexed {s['indexed_chunks']}, nvme {s['nvme']['chunks']}, "
                                       f"lmdb {len(keys)}")
            prompts = [prompt_tokens(w, j) for w in sorted(next_j) for j in range(next_j[w][name])]
            expect = []
            for toks in prompts:
                n = 0
                for h in self._hashes(domain, toks):
                    if h not in keys:
                        break
                    n += 1
                expect.append(n * CT)
            got = [x for i in range(0, len(prompts), 1024) for x in c.lookup_many(LAYOUT, prompts[i:i + 1024])]
            bad = [(i, e, g) for i, (e, g) in enumerate(zip(expect, got)) if e != g]
            out["prompts"] += len(prompts)
            out["lookup_disagree"] += len(bad)
            out["examples"] += [f"{name}: prompt #{i} nvme prefix {e} tokens, lookup {g}" for i, e, g in bad[:3]]
        self.checks.append(out)
        return out

    def durable_records(self, lane: str) -> dict[tuple[int, int], int]:
        recs: dict[tuple[int, int], int] = {}
        for w in range(self.workers):
            try:
                with open(os.path.join(self.run_dir, f"durable.{lane}.{w}")) as f:
                    lines = f.read().split("\n")
            except FileNotFoundError:
                continue
            for line in lines[:-1]:  # the last one may be half written (the worker is running)
                j, n = map(int, line.split())
                recs[(w, j)] = max(recs.get((w, j), 0), n)
        return recs

    def check_durable(self, full: bool) -> dict:
        """Every durable chunk is found, and (all, or a sample of) their bytes are right."""
        out = {"durable_prompts": 0, "durable_chunks": 0, "unique_durable_chunks": 0, "unique_found_chunks": 0,
               "found_chunks": 0, "lost_chunks": 0,
               "bytes_checked_chunks": 0, "mismatches": 0, "lost_examples": [], "mismatch_examples": []}
        for name, _sock, domain, _wt in self.lanes:
            c = self.client(name)
            unique: set[bytes] = set()
            unique_found: set[bytes] = set()
            recs = [(wj, n) for wj, n in sorted(self.durable_records(name).items()) if n > 0]
            prompts = [prompt_tokens(*wj) for wj, _ in recs]
            got = [x for i in range(0, len(prompts), 1024) for x in c.lookup_many(LAYOUT, prompts[i:i + 1024])]
            for (wj, n), cached, toks in zip(recs, got, prompts):
                hashes = self._hashes(domain, toks)
                unique.update(hashes[:n])
                unique_found.update(hashes[:min(n, cached // CT)])
                out["durable_prompts"] += 1
                out["durable_chunks"] += n
                out["found_chunks"] += min(n, cached // CT)
                if cached // CT < n:
                    out["lost_chunks"] += n - cached // CT
                    out["lost_examples"] = (out["lost_examples"] + [f"{name} w{wj[0]} j{wj[1]}: durable {n}, "
                                                                   f"found {cached // CT}"])[:5]
            out["unique_durable_chunks"] += len(unique)
            out["unique_found_chunks"] += len(unique_found)
            pick = range(len(recs)) if full else sorted(self.rng.sample(range(len(recs)),
                                                                         min(len(recs), self.bytes_sample or 0)))
            c.nvme_read = self.rng.choice(self.check_reads)
            for i in pick:
                (wj, n), toks = recs[i], prompts[i]
                with c.acquire(LAYOUT, toks) as lease:
                    for pos in range(len(lease)):
                        out["bytes_checked_chunks"] += 1
                        if chunk_bytes_of(lease, pos) != chunk_payload(toks, pos):
                            out["mismatches"] += 1
                            out["mismatch_examples"] = (out["mismatch_examples"] + [f"{name} {wj} chunk {pos}"])[:5]
        self.checks.append(out)
        return out

    # -- summary --

    def _finish(self) -> dict:
        res = {w: self._result(w) for w in range(self.workers)}
        kills = self.restarts
        counters: dict[str, int] = {}
        errors: dict[str, int] = {}
        for r in res.values():
            for k, v in r["counters"].items():
                counters[k] = counters.get(k, 0) + v
            for k, v in r["errors"].items():
                errors[k] = errors.get(k, 0) + v
        # UNAVAILABLE seen while the daemon was down, per outage
        unavailable_down = []
        for rec in kills:
            n = sum(1 for r in res.values() for t, _l, kind, d in r["events"]
                    if kind == "err" and d == "unavailable" and rec["t_kill"] <= t <= rec["t_ready"])
            unavailable_down.append(n)
        # recovery of every (worker, lane) after every restart but the last (the workers were stopped)
        recovery: list[float] = []
        recovery_live: list[float] = []
        unrecovered: list[str] = []
        for k, rec in enumerate(kills[:-1]):
            end = kills[k + 1]["t_kill"]
            for w, r in res.items():
                for name, *_ in self.lanes:
                    ups = [t for t, lane, kind, _d in r["events"]
                           if lane == name and kind == "up" and rec["t_kill"] < t < end]
                    if ups:
                        recovery.append(max(0.0, min(ups) - rec["t_resume"]))
                        if not rec["quiesced"]:
                            recovery_live.append(recovery[-1])
                    else:
                        unrecovered.append(f"kill {k + 1} worker {w} lane {name}")
        # errors outside an outage window: UNAVAILABLE is only fine between a kill and recovery
        windows = [(rec["t_kill"], rec["t_resume"] + 5.0) for rec in kills]
        unavailable_outside = sum(1 for r in res.values() for t, _l, kind, d in r["events"]
                                  if kind == "err" and d == "unavailable" and not any(a <= t <= b for a, b in windows))
        samples = {f"worker {w} {k}": v for w, r in res.items() for k, v in r["samples"].items()}
        return {
            "kills": len(kills),
            "workers": self.workers,
            "restarts": kills,
            "counters": counters,
            "errors": errors,
            "samples": samples,
            "chunks_written": counters["chunks_written"],
            "chunks_read_by_workers": counters["chunks_read"],
            "corrupt_served": counters["mismatches"] + sum(c.get("mismatches", 0) for c in self.checks),
            "chunks_lost": sum(c.get("lost_chunks", 0) for c in self.checks),
            "durable_verified_per_restart": [rec["durable"]["unique_found_chunks"] for rec in kills],
            "durable_chunks_final": kills[-1]["durable"]["unique_durable_chunks"],
            "index_checks": [rec["index"] for rec in kills if "index" in rec],
            "unavailable_while_down": unavailable_down,
            "unavailable_outside_outages": unavailable_outside,
            "unexpected_errors": sum(v for k, v in errors.items() if k.startswith("unexpected")),
            "recovery_s": recovery,
            "recovery_median_s": statistics.median(recovery) if recovery else None,
            "recovery_max_s": max(recovery) if recovery else None,
            "recovery_under_load_s": recovery_live,
            "unrecovered": unrecovered,
            "client_thread_growth": max(r["threads_end"] - r["threads_ready"] for r in res.values()),
            "per_worker_unavailable": [sum(v for k, v in r["errors"].items() if k.startswith("unavailable"))
                                       for r in res.values()],
        }


def assert_contract(r: dict) -> None:
    """The contract: checked by the test (tests/reliability/test_crash.py) and bench/crash_loop.py."""
    assert r["corrupt_served"] == 0, f"corrupt chunks served: {r['corrupt_served']} {r['samples']}"
    assert r["chunks_lost"] == 0, f"durable chunks lost: {[x['durable']['lost_examples'] for x in r['restarts']]}"
    for i in r["index_checks"]:
        assert i["equal"] and i["lookup_disagree"] == 0, f"rebuilt index != NVMe: {i['examples']}"
    assert r["unexpected_errors"] == 0, f"unexpected client errors: {r['errors']} {r['samples']}"
    assert all(n > 0 for n in r["unavailable_while_down"]), f"an outage went unnoticed: {r['unavailable_while_down']}"
    assert all(n > 0 for n in r["per_worker_unavailable"]), f"UNAVAILABLE per worker: {r['per_worker_unavailable']}"
    assert r["unavailable_outside_outages"] == 0, f"UNAVAILABLE outside outages: {r['unavailable_outside_outages']}"
    assert not r["unrecovered"], f"clients that never recovered by themselves: {r['unrecovered']}"
    # Surviving restarts must not cost the client anything that piles up (it leaked a Session thread per restart).
    assert r["client_thread_growth"] <= 0, f"client threads grew by {r['client_thread_growth']}"
