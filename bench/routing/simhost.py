"""A simulated inference host for the routing bench: the MODEL IS SIMULATED, THE CACHE WORK IS REAL.

An OpenAI-compatible HTTP server (aiohttp) that stands in for one engine (vLLM or similar) on
one accelerator, in front of its OWN kvcached daemon (a real ``kvcached serve`` process, reached
on its Unix socket with ``kvcached_client.AsyncClient``). What is simulated and what is not:

- **Simulated: the model.** No weights, no arithmetic. Prefill takes
  ``uncached_prompt_tokens / --prefill-tps`` seconds (default 20,000 tokens/s) and decoding
  emits one token every ``1 / --decode-tps`` seconds per request (default 200 tokens/s). The
  output is ``max_tokens`` words ``w…`` (deterministic in the prompt), ``finish_reason`` "length".
- **Simulated: one accelerator.** Prefills are served one at a time in arrival order (FIFO), so a
  loaded host queues and the time to first token includes that queueing. A prefill's slot lasts
  max(the cache reads, the simulated compute) (the reads overlap it, as a layer-wise KV load
  does), then the put of its new chunks (so the next prefill in the queue sees them). Decoding does not hold
  the accelerator (a continuous-batching engine decodes alongside new prefills).
- **Real: the cache work.** Each request is tokenized with the bench's tokenizer (chat requests
  rendered with its chat template, exactly what the router renders); on arrival the host asks its
  daemon how much of the prompt is cached (Lookup: the queue's ``queued_prefill_tokens``); when its
  prefill starts it pins the cached prefix (Acquire), reads every leased chunk from the daemon's
  shared-memory pool and checks its bytes, and releases the lease; after the prefill it stores the
  prompt's uncached full chunks (Reserve, write into the pool, Commit), each chunk's bytes a
  digest of the prompt up to its end, so a later hit is verified byte for byte
  (``verify_mismatches``). The layout is tiny (1 layer, 1 KV head, head_dim 8, float16,
  ``--chunk-tokens`` 16: 512 bytes a chunk) so the daemon does all its indexing, hashing,
  eviction and KV-event work at a cost this box can afford.
- **Fail open.** A daemon error (down, restarting, full) never fails a request: it is counted
  (``daemon_errors``, and ``failed_open_requests`` for the requests it touched) and the prompt is
  recomputed (its prefill paid in full).

HTTP contract (all JSON):

- ``POST /v1/completions``: ``prompt`` (a string, a list of one string, or a list of token ids),
  ``max_tokens`` (default 16), ``stream``, ``stream_options.include_usage``, ``model`` (echoed).
- ``POST /v1/chat/completions``: ``messages`` (role/content), ``max_tokens`` or
  ``max_completion_tokens``, ``stream``, ``stream_options``.
- Responses as OpenAI's, with ``usage.prompt_tokens``, ``usage.completion_tokens``,
  ``usage.prompt_tokens_details.cached_tokens``; streaming is SSE ``data: {...}\\n\\n`` chunks
  ending with ``data: [DONE]``; the headers of every completion response carry
  ``X-Simhost`` (host name), ``X-Prompt-Tokens``, ``X-Cached-Tokens`` and ``X-Queue-Ms`` (time
  waiting for the accelerator), available at the first byte even when streaming (the headers go
  out when the prefill is done).
- ``GET /stats``: cumulative counters (see :meth:`SimHost.stats`). ``GET /health``: 200 with
  ``{"status": "ok", "daemon": "up"|"down"}`` (the host serves either way). ``GET /v1/models``.

::

    python bench/routing/simhost.py --port 8101 --socket /tmp/h0/kv.sock --tokenizer /tmp/tok \\
        --prefill-tps 20000 --decode-tps 200 --chunk-tokens 16 --name host0
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import web

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # run as a file: import bench

from bench import _common  # noqa: F401 - puts clients/ on sys.path: kvcached_client from the source tree
from kvcached.contract.keys import KVLayout

log = logging.getLogger("simhost")

DEFAULT_MODEL = "kvcached-bench/sim-word"
#: The KVLayout's model id: the simulated model, pinned revision (part of the cache identity).
LAYOUT_MODEL = "kvcached-bench/sim-word@1"


def sim_layout(chunk_tokens: int = 16, model: str = LAYOUT_MODEL) -> KVLayout:
    """The tiny layout every simulated host uses: 512-byte chunks at 16 tokens."""
    return KVLayout(model, num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", chunk_tokens=chunk_tokens)


def chunk_payloads(layout: KVLayout, tokens: list[int]) -> list[bytes]:
    """Deterministic bytes for each full chunk of ``tokens``: chunk i's bytes depend on tokens
    0 .. (i+1)*chunk_tokens-1 (a chained BLAKE2b digest, repeated to the chunk's size), as real KV
    depends on the whole prefix. Equal prefixes give equal bytes on any host."""
    c, n = layout.chunk_tokens, layout.chunk_bytes
    out, prev = [], b"kvcached-simhost"
    reps = n // 32 + 1
    step = 4 * c
    packed = np.asarray(tokens[: len(tokens) // c * c], dtype="<u4").tobytes()
    for off in range(0, len(packed), step):
        prev = hashlib.blake2b(prev + packed[off:off + step], digest_size=32).digest()
        out.append((prev * reps)[:n])
    return out


@dataclass
class Counters:
    requests: int = 0  # accepted completion requests
    completed: int = 0
    errors: int = 0  # requests that failed (bad input, cancelled); never for a daemon error
    prompt_tokens: int = 0  # of the requests whose prefill finished
    cached_tokens: int = 0  # served from the daemon (leased and read)
    uncached_tokens: int = 0  # prefilled (simulated)
    completion_tokens: int = 0
    daemon_errors: int = 0  # failed daemon calls
    failed_open_requests: int = 0  # requests served (in part) without the cache because of one
    verify_mismatches: int = 0  # leased chunks whose bytes were not what was put
    stored_chunks: int = 0
    not_stored_tokens: int = 0  # full chunks the daemon had no room for (a full pool is not an error)
    prefill_busy_s: float = 0.0  # accelerator time spent (prefill + the cache work in its slot)
    queue_wait_s: float = 0.0  # total time requests waited for the accelerator


@dataclass
class Job:
    tokens: list[int]
    estimate: int  # uncached tokens expected at arrival (Lookup), for queued_prefill_tokens
    arrived: float = field(default_factory=time.monotonic)
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    cancelled: bool = False


class SimHost:
    def __init__(self, *, socket: str | None, tokenizer: str, name: str = "simhost", model: str = DEFAULT_MODEL,
                 prefill_tps: float = 20000.0, decode_tps: float = 200.0, chunk_tokens: int = 16,
                 daemon_timeout: float = 2.0, verify: bool = True, lookup_on_arrival: bool = True) -> None:
        if prefill_tps <= 0 or decode_tps <= 0:
            raise ValueError("--prefill-tps and --decode-tps must be positive")
        self.name, self.model = name, model
        self.socket = socket
        self.prefill_tps, self.decode_tps = prefill_tps, decode_tps
        self.layout = sim_layout(chunk_tokens)
        self.verify = verify
        self.lookup_on_arrival = lookup_on_arrival and socket is not None
        self.daemon_timeout = daemon_timeout
        self.c = Counters()
        self.in_flight = 0
        self.queued: list[Job] = []  # waiting for the accelerator, in order (the head is next)
        self.running: Job | None = None
        self.running_uncached = 0
        self.started = time.monotonic()
        self.daemon_up: bool | None = None  # None: not tried yet
        self._queue: asyncio.Queue[Job] | None = None
        self._worker: asyncio.Task | None = None
        self._client: Any = None
        self._bg: set[asyncio.Task] = set()  # lease releases in flight
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(tokenizer)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._worker = asyncio.create_task(self._accelerator())
        if self.socket is not None:
            from kvcached_client import AsyncClient

            self._client = AsyncClient(self.socket, timeout=self.daemon_timeout, client_name=f"simhost {self.name}")
            try:  # register the layout and open the session now, not on the first request
                await self._client.register(self.layout)
                await self._client.session_id()
                self._daemon_ok()
            except Exception as e:  # noqa: BLE001 - fail open, the first request tries again
                self._daemon_error("start", e)

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        if self._bg:
            await asyncio.gather(*self._bg, return_exceptions=True)
        if self._client is not None:
            await self._client.close()

    def _daemon_error(self, what: str, e: BaseException) -> None:
        self.c.daemon_errors += 1
        if self.daemon_up is not False:
            log.warning("%s: daemon %s failed (%s: %s); serving without the cache until it answers again",
                        self.name, what, type(e).__name__, e)
        self.daemon_up = False

    def _daemon_ok(self) -> None:
        if self.daemon_up is False:
            log.warning("%s: the daemon answers again", self.name)
        self.daemon_up = True

    # -- tokenization ----------------------------------------------------------------------

    def render_chat(self, messages: list[dict]) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    # -- the accelerator -------------------------------------------------------------------

    async def _accelerator(self) -> None:
        """One simulated accelerator: prefills one job at a time, in arrival order."""
        assert self._queue is not None
        while True:
            job = await self._queue.get()
            self.queued.remove(job)
            if job.cancelled:
                continue
            self.running = job
            t0 = time.monotonic()
            self.c.queue_wait_s += t0 - job.arrived
            try:
                cached, lease_ok = await self._read_cached(job.tokens)
                uncached = len(job.tokens) - cached
                self.running_uncached = uncached
                # The cache reads overlap the simulated compute (as a layer-wise KV load does): the
                # slot lasts max(reads, uncached / prefill_tps), not their sum.
                await asyncio.sleep(max(0.0, t0 + uncached / self.prefill_tps - time.monotonic()))
                self.c.prompt_tokens += len(job.tokens)
                self.c.cached_tokens += cached
                self.c.uncached_tokens += uncached
                if not job.done.done():
                    job.done.set_result((cached, t0 - job.arrived, not lease_ok))
                if self._client is not None and lease_ok:  # a failed acquire: the daemon is likely down
                    await self._store(job.tokens, cached)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - never lose the worker
                log.exception("%s: prefill failed", self.name)
                if not job.done.done():
                    job.done.set_exception(e)
            finally:
                self.c.prefill_busy_s += time.monotonic() - t0
                self.running, self.running_uncached = None, 0

    async def _read_cached(self, tokens: list[int]) -> tuple[int, bool]:
        """Pin the cached prefix, read (and check) every leased chunk, release. Returns
        (cached tokens, whether the daemon answered)."""
        if self._client is None:
            return 0, True
        try:
            lease = await self._client.acquire(self.layout, tokens)
        except Exception as e:  # noqa: BLE001 - fail open
            self._daemon_error("acquire", e)
            return 0, False
        try:
            matched = lease.matched_tokens
            if len(lease):
                expected = chunk_payloads(self.layout, tokens[:matched]) if self.verify else None
                for i in range(len(lease)):
                    data = lease.chunk(i).numpy().tobytes()  # a read of the pool block (copied)
                    if expected is not None and data != expected[i]:
                        self.c.verify_mismatches += 1
            self._daemon_ok()
            return matched, True
        except Exception as e:  # noqa: BLE001 - a lease we cannot read serves nothing
            self._daemon_error("lease read", e)
            return 0, False
        finally:
            if lease.lease_id:  # nothing matched: no lease to give back
                # Not waited for (the sync client sends releases on its session stream unawaited too).
                task = asyncio.create_task(self._release(lease))
                self._bg.add(task)
                task.add_done_callback(self._bg.discard)
            else:
                lease.released = True

    async def _release(self, lease: Any) -> None:
        try:
            await lease.release()
        except Exception as e:  # noqa: BLE001
            self._daemon_error("release", e)

    async def _store(self, tokens: list[int], cached: int) -> None:
        """Put the prompt's full chunks past the cached prefix (the daemon skips what it has)."""
        c = self.layout.chunk_tokens
        full = len(tokens) // c
        if full * c <= cached:
            return
        import torch

        payloads = chunk_payloads(self.layout, tokens[: full * c])
        buf = bytearray(b"".join(payloads))
        # [full chunks, 2, layers, heads, c, head_dim] -> [2, layers, heads, full*c, head_dim]: chunk i's
        # slice along the token axis is exactly payload i, as written into its pool block.
        kv = torch.frombuffer(buf, dtype=torch.float16).view(full, *self.layout.chunk_shape)
        kv = kv.permute(1, 2, 3, 0, 4, 5).reshape(2, 1, 1, full * c, self.layout.head_dim)
        try:
            r = await self._client.put(self.layout, tokens[: full * c], kv)
            self.c.stored_chunks += r.stored_chunks
            self.c.not_stored_tokens += r.not_stored_tokens
            self._daemon_ok()
        except Exception as e:  # noqa: BLE001 - fail open: not storing is only a later miss
            self._daemon_error("put", e)

    async def prefill(self, tokens: list[int]) -> tuple[int, float, bool]:
        """Queue the prompt for the accelerator; returns (cached tokens, seconds queued, failed open)."""
        assert self._queue is not None
        estimate, failed_open = len(tokens), False
        if self.lookup_on_arrival:
            try:
                estimate -= await self._client.lookup(self.layout, tokens)
                self._daemon_ok()
            except Exception as e:  # noqa: BLE001
                self._daemon_error("lookup", e)
                failed_open = True
        job = Job(tokens, estimate)
        self.queued.append(job)
        self._queue.put_nowait(job)
        try:
            cached, waited, lease_failed = await asyncio.shield(job.done)
        except asyncio.CancelledError:
            job.cancelled = True
            raise
        return cached, waited, failed_open or lease_failed

    # -- HTTP --------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Cumulative counters and the present load."""
        c = self.c
        return {
            "name": self.name, "model": self.model, "uptime_s": time.monotonic() - self.started,
            "requests": c.requests, "completed": c.completed, "errors": c.errors,
            "prompt_tokens": c.prompt_tokens, "cached_tokens": c.cached_tokens, "uncached_tokens": c.uncached_tokens,
            "completion_tokens": c.completion_tokens,
            "in_flight": self.in_flight, "queued_requests": len(self.queued) + (self.running is not None),
            "queued_prefill_tokens": sum(j.estimate for j in self.queued) + self.running_uncached,
            "daemon_errors": c.daemon_errors, "failed_open_requests": c.failed_open_requests,
            "daemon_up": self.daemon_up, "verify_mismatches": c.verify_mismatches,
            "stored_chunks": c.stored_chunks, "not_stored_tokens": c.not_stored_tokens,
            "prefill_busy_s": c.prefill_busy_s, "queue_wait_s": c.queue_wait_s,
            "prefill_tps": self.prefill_tps, "decode_tps": self.decode_tps,
            "layout": self.layout.to_dict(), "simulated_model": True,
        }

    def _output_words(self, tokens: list[int], n: int) -> list[str]:
        seed = hashlib.blake2b(repr(tokens[-64:]).encode(), digest_size=8).digest()
        x = int.from_bytes(seed, "little")
        vocab = max(1, len(self.tok) - 16)
        out = []
        for _ in range(n):
            x = (x * 6364136223846793005 + 1442695040888963407) & (2**64 - 1)
            out.append(f"w{(x >> 33) % vocab}")
        return out

    async def handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            if chat:
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise ValueError("messages must be a non-empty list")
                tokens = self.encode(self.render_chat(messages))
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                    prompt = prompt[0]
                if isinstance(prompt, str):
                    tokens = self.encode(prompt)
                elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                    tokens = list(prompt)
                else:
                    raise ValueError("prompt must be a string, a list of one string, or a list of token ids")
            max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
            if max_tokens < 1 or not tokens:
                raise ValueError("max_tokens must be >= 1 and the prompt non-empty")
            stream = bool(body.get("stream", False))
            include_usage = bool((body.get("stream_options") or {}).get("include_usage", False))
        except (ValueError, TypeError, json.JSONDecodeError) as e:
            self.c.errors += 1
            return web.json_response({"error": {"message": str(e), "type": "invalid_request_error"}}, status=400)

        self.c.requests += 1
        self.in_flight += 1
        try:
            return await self._serve(request, chat, body, tokens, max_tokens, stream, include_usage)
        except asyncio.CancelledError:
            self.c.errors += 1
            raise
        finally:
            self.in_flight -= 1

    async def _serve(self, request: web.Request, chat: bool, body: dict, tokens: list[int], max_tokens: int,
                     stream: bool, include_usage: bool) -> web.StreamResponse:
        cached, waited, failed_open = await self.prefill(tokens)
        if failed_open:
            self.c.failed_open_requests += 1
        words = self._output_words(tokens, max_tokens)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        model = body.get("model") or self.model
        usage = {"prompt_tokens": len(tokens), "completion_tokens": max_tokens,
                 "total_tokens": len(tokens) + max_tokens, "prompt_tokens_details": {"cached_tokens": cached}}
        headers = {"X-Simhost": self.name, "X-Prompt-Tokens": str(len(tokens)), "X-Cached-Tokens": str(cached),
                   "X-Queue-Ms": f"{waited * 1000:.1f}"}
        step = 1.0 / self.decode_tps
        obj = "chat.completion" if chat else "text_completion"
        if not stream:
            await asyncio.sleep(step * (max_tokens - 1))  # the first token came with the prefill
            text = " ".join(words)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"})
            self.c.completed += 1
            self.c.completion_tokens += max_tokens
            return web.json_response({"id": rid, "object": obj, "created": created, "model": model,
                                      "choices": [choice], "usage": usage}, headers=headers)

        resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list, **extra: Any) -> bytes:
            d = {"id": rid, "object": chunk_obj, "created": created, "model": model, "choices": choices, **extra}
            return b"data: " + json.dumps(d, separators=(",", ":")).encode() + b"\n\n"

        try:
            if chat:
                await resp.write(event([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None}]))
            for i, w in enumerate(words):
                if i:
                    await asyncio.sleep(step)
                piece = w if i == 0 else " " + w
                last = "length" if i == len(words) - 1 else None
                choice = ({"index": 0, "delta": {"content": piece}, "finish_reason": last} if chat
                          else {"index": 0, "text": piece, "logprobs": None, "finish_reason": last})
                await resp.write(event([choice]))
            if include_usage:
                await resp.write(event([], usage=usage))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:  # the client went away mid-stream (aiohttp's reset errors derive from it)
            self.c.errors += 1
            return resp
        self.c.completed += 1
        self.c.completion_tokens += max_tokens
        return resp

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)

        async def completions(request: web.Request) -> web.StreamResponse:
            return await self.handle(request, chat=False)

        async def chat_completions(request: web.Request) -> web.StreamResponse:
            return await self.handle(request, chat=True)

        async def stats(request: web.Request) -> web.Response:
            return web.json_response(self.stats())

        async def health(request: web.Request) -> web.Response:
            return web.json_response({"status": "ok", "name": self.name,
                                      "daemon": "down" if self.daemon_up is False else "up"})

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [
                {"id": self.model, "object": "model", "created": int(self.started), "owned_by": "kvcached-bench"}]})

        app.router.add_post("/v1/completions", completions)
        app.router.add_post("/v1/chat/completions", chat_completions)
        app.router.add_get("/stats", stats)
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        return app


async def serve(args: argparse.Namespace) -> None:
    host = SimHost(socket=args.socket, tokenizer=args.tokenizer, name=args.name, model=args.model,
                   prefill_tps=args.prefill_tps, decode_tps=args.decode_tps, chunk_tokens=args.chunk_tokens,
                   daemon_timeout=args.daemon_timeout, verify=not args.no_verify,
                   lookup_on_arrival=not args.no_arrival_lookup)
    await host.start()
    runner = web.AppRunner(host.app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, backlog=2048, reuse_address=True)
    await site.start()
    port = runner.addresses[0][1]
    # The announcement a supervisor waits for (fleet.py parses it): the actual port, even for --port 0.
    print(f"simhost {args.name} listening on http://{args.host}:{port} (daemon {args.socket or 'none'}; "
          f"simulated model: prefill {args.prefill_tps:g} tokens/s, decode {args.decode_tps:g} tokens/s)", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    await host.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="simulated OpenAI-compatible host: simulated model, real kvcached cache")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0: a free port (announced on stdout)")
    ap.add_argument("--socket", help="this host's kvcached daemon socket (omit: no cache at all)")
    ap.add_argument("--tokenizer", required=True, help="tokenizer directory (bench/routing/tokenizer.py)")
    ap.add_argument("--name", default="simhost")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="the served model name (echoed)")
    ap.add_argument("--prefill-tps", type=float, default=20000.0, help="simulated prefill speed, tokens/s")
    ap.add_argument("--decode-tps", type=float, default=200.0, help="simulated decode speed per request, tokens/s")
    ap.add_argument("--chunk-tokens", type=int, default=16, help="the KV layout's chunk size")
    ap.add_argument("--daemon-timeout", type=float, default=2.0, help="seconds per daemon call before failing open")
    ap.add_argument("--no-verify", action="store_true", help="do not check the bytes of leased chunks")
    ap.add_argument("--no-arrival-lookup", action="store_true",
                    help="no Lookup on arrival (queued_prefill_tokens then counts whole prompts)")
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    rc = main()
    # Everything is closed by now; skip the interpreter's teardown of torch and transformers
    # (over a second of CPU on this box, per host, at every fleet stop).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
