"""``kvcached-router``: an OpenAI-compatible reverse proxy that sends each request to the host
holding its longest cached prefix, within a load bound.

Per request (``/v1/completions``, ``/v1/chat/completions``; everything else is passed to a
healthy host as is):

1. tokenize the prompt as the engine will (the chat template for chat requests) with the
   model's tokenizer from a local directory, and hash its full chunks exactly as the daemons
   do (the trust domain's key file and the engines' KV layout: the hashes *are* the daemons'
   chunk ids, so the index needs no token ids);
2. choose a host (:mod:`kvcached_router.policy`) from the index the daemons' KV events keep
   (:mod:`kvcached_router.subscriber`) and the router's own count of in-flight requests and
   queued prefill tokens per host;
3. forward the request and stream the answer back byte for byte (server-sent events
   included); the chunks it will store count as held there until its daemon confirms them.

With ``[semantic] enabled`` a response cache answers repeated (and, guarded, rephrased)
questions before step 1 (:mod:`kvcached_router.semantic.frontend`); with ``normalize_prompts``
the prompt text is normalised before step 1 and forwarded so.

Fail open: the router must never be the reason a request fails. A body it cannot read or a
prompt it cannot tokenize is still routed (to the least-loaded host, without the cache); a host
that refuses the connection is marked down and the request goes to the next one; a lost event
stream only makes the index forget. Each is logged and counted.

HTTP stack: aiohttp, for its asyncio server *and* client in one well-kept package, streaming
in both directions, a pooled keep-alive client, and no separate ASGI server to run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from aiohttp import ClientConnectionError, ClientSession, ClientTimeout, TCPConnector, web
from prometheus_client import generate_latest

from kvcached.contract.keys import ChunkHash, ChunkHasher, Namespace, load_shared_key
from kvcached_client.text import normalize, normalize_messages
from kvcached_router.config import HostConfig, RouterConfig, RouterConfigError, load_config
from kvcached_router.index import HostIndex
from kvcached_router.metrics import Metrics
from kvcached_router.policy import Decision, HostState, Router
from kvcached_router.subscriber import EventSubscriber

log = logging.getLogger("kvcached_router")

#: With audits on, how long a request waits for the chosen daemon's audit answer before it is
#: forwarded (a Lookup over a local socket: about a millisecond); a later answer is not judged.
AUDIT_WAIT_S = 0.5

#: Headers that describe one hop, not the message (RFC 9110 section 7.6.1), plus those aiohttp sets.
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                  "transfer-encoding", "upgrade", "host", "content-length"})


class RouterService:
    """The router's state and handlers (one per process)."""

    def __init__(self, config: RouterConfig, tokenizer: Any = None, embedder: Any = None) -> None:
        self.config = config
        self.layout = config.layout
        key = load_shared_key(config.hash_key_file)
        self._hasher = ChunkHasher(key)
        self._root = self._hasher.root(Namespace(config.domain, config.layout))
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(config.tokenizer)
        self.hosts = [HostState(h.name, HostIndex(config.provisional_ttl)) for h in config.hosts]
        self.host_config: dict[str, HostConfig] = {h.name: h for h in config.hosts}
        self.router = Router(self.hosts, config.policy, load_factor=config.load_factor,
                             load_slack=config.load_slack, prefix_hash_chunks=config.prefix_hash_chunks,
                             storage_weight=config.storage_weight)
        self.metrics = Metrics()
        self.subscribers: list[EventSubscriber] = []
        self._session: ClientSession | None = None
        self._audit_clients: dict[str, Any] = {}
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Future] = set()  # audits in flight
        self.decisions: list[dict] = []  # the last routes (for /router/state and tests), bounded
        self.semantic = None
        if config.semantic.enabled:
            from kvcached_router.semantic.frontend import build

            self.semantic = build(config.semantic, self.metrics.registry, shadow=self._shadow, embedder=embedder)

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        self._session = ClientSession(connector=TCPConnector(limit=0, ttl_dns_cache=300),
                                      timeout=ClientTimeout(total=self.config.request_timeout, sock_connect=5))
        for h in self.hosts:
            hc = self.host_config[h.name]
            if hc.events:
                sub = EventSubscriber(h.name, h.index, hc.events, hc.replay)
                sub.start()
                self.subscribers.append(sub)
        self._tasks.append(asyncio.get_running_loop().create_task(self._health_loop()))
        if self.config.audit:
            from kvcached_client.aio import AsyncClient

            self._audit_clients = {h.name: AsyncClient(h.daemon_socket, timeout=5.0) for h in self.config.hosts}
        if self.semantic is not None:
            self.semantic.warm_up()

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)  # each has left its finally blocks
        self._tasks.clear()
        for sub in self.subscribers:
            await sub.stop()
        for c in self._audit_clients.values():
            await c.close()
        if self.semantic is not None:
            await self.semantic.close()
        if self._session is not None:
            await self._session.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self.handle_generate)
        app.router.add_post("/v1/chat/completions", self.handle_generate)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/router/state", self.handle_state)
        app.router.add_get("/router/decisions", self.handle_decisions)
        app.router.add_get("/router/semantic", self.handle_semantic)
        app.router.add_route("*", "/{tail:.*}", self.handle_other)

        async def on_startup(_: web.Application) -> None:
            await self.start()

        async def on_cleanup(_: web.Application) -> None:
            await self.stop()

        app.on_startup.append(on_startup)
        app.on_cleanup.append(on_cleanup)
        return app

    # -- the request path ------------------------------------------------------------------------

    def prompt_ids(self, path: str, body: dict) -> list[int]:
        """The token ids the engine will prefill for this request (vLLM's conventions: a chat
        request's rendered template without added special tokens; a text prompt with them)."""
        tok = self.tokenizer
        if path.endswith("/chat/completions"):
            text = tok.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
            return list(tok(text, add_special_tokens=False)["input_ids"])
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]  # a batch: routed by its first prompt
        if isinstance(prompt, list):
            return [int(t) for t in prompt] if prompt and isinstance(prompt[0], int) else \
                list(tok(prompt[0])["input_ids"]) if prompt else []
        return list(tok(str(prompt))["input_ids"])

    def chunk_hashes(self, ids: Sequence[int]) -> list[ChunkHash]:
        packed = np.asarray(ids, dtype="<u4").tobytes()
        return self._hasher.chain(self._root, packed, self.layout.chunk_tokens)

    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        ids: list[int] = []
        hashes: list[ChunkHash] = []
        capture = None
        try:
            body = json.loads(raw)
            if self.config.normalize_prompts:
                body = _normalized(body)
                raw = json.dumps(body, ensure_ascii=False).encode()
            if self.semantic is not None:
                try:
                    served = await self.semantic.lookup(request, body)
                except Exception as e:  # noqa: BLE001 - fail open: the engine answers without the response cache
                    served = None
                    self.metrics.fail_open.labels("semantic_" + type(e).__name__).inc()
                    log.warning("semantic cache lookup failed: %s: %s", type(e).__name__, e,
                                extra={"event": "router_fail_open"})
                if isinstance(served, web.Response):
                    return served
                capture = served
            ids = self.prompt_ids(request.path, body)
            hashes = self.chunk_hashes(ids)
        except Exception as e:  # noqa: BLE001 - fail open: the engine answers what we cannot read
            self.metrics.fail_open.labels(type(e).__name__).inc()
            log.warning("routing %s without the cache: %s: %s", request.path, type(e).__name__, e,
                        extra={"event": "router_fail_open"})
        return await self._route_and_forward(request, raw, ids, hashes, capture)

    async def _shadow(self, path: str, body: dict, headers: dict[str, str]) -> tuple[int, bytes]:
        """Send a request to a host and read its whole answer (the semantic cache's shadow
        sample: nobody waits for it). Counted in the host's in-flight requests."""
        assert self._session is not None
        try:
            hashes = self.chunk_hashes(self.prompt_ids(path, body))
        except Exception:  # noqa: BLE001 - routed without the cache, as handle_generate would
            hashes = []
        decision = self.router.choose(hashes, frozenset())
        if decision is None:
            return 0, b""
        host = decision.host
        host.in_flight += 1
        try:
            url = self.host_config[host.name].url.rstrip("/") + path
            headers = {k: v for k, v in headers.items() if k.lower() not in _HOP and k.lower() != "content-type"}
            async with self._session.post(url, json=body, headers=headers) as r:
                return r.status, await r.read()
        finally:
            host.in_flight -= 1

    async def _route_and_forward(self, request: web.Request, raw: bytes, ids: list[int],
                                 hashes: list[ChunkHash], capture: Any = None) -> web.StreamResponse:
        tried: set[str] = set()
        ct = self.layout.chunk_tokens
        while True:
            decision = self.router.choose(hashes, frozenset(tried))
            if decision is None:
                return web.json_response({"error": {"message": "no healthy host to serve this request",
                                                    "type": "service_unavailable"}}, status=503)
            host = decision.host
            record = self._record(decision, len(ids))
            if self.config.audit and ids:
                answered = asyncio.Event()
                task = asyncio.ensure_future(self._audit(decision, ids, record, answered))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
                # The chosen daemon's answer must reflect the cache the route found, not what this
                # very request stores once forwarded (a fast host had stored it before a late
                # lookup, and the audit then judged the route right): wait for it, bounded.
                try:
                    await asyncio.wait_for(answered.wait(), AUDIT_WAIT_S)
                except asyncio.TimeoutError:
                    record["audit_late"] = True
            queued = _Queued(host, max(len(ids) - decision.cached_chunks * ct, 0))
            host.in_flight += 1
            host.index.expect(hashes[decision.cached_chunks:])
            try:
                return await self._forward(request, raw, host, queued, capture, reason=decision.reason)
            except _Unreachable as e:
                tried.add(host.name)
                host.healthy = False
                self.metrics.failovers.labels(host.name).inc()
                log.warning("host %s unreachable (%s): marked down, request re-routed", host.name, e,
                            extra={"event": "router_host_down", "host": host.name})
            finally:
                host.in_flight -= 1
                queued.started()

    async def _forward(self, request: web.Request, raw: bytes, host: HostState, queued: "_Queued",
                       capture: Any = None, *, reason: str = "") -> web.StreamResponse:
        """Send the request to ``host`` and stream its answer back; ``capture`` (the semantic
        cache's) sees the answer's bytes, and its status once the answer is complete."""
        assert self._session is not None
        url = self.host_config[host.name].url.rstrip("/") + request.path_qs
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        t0 = time.perf_counter()
        try:
            upstream = await self._session.request(request.method, url, data=raw, headers=headers)
        except (ClientConnectionError, asyncio.TimeoutError) as e:
            raise _Unreachable(f"{type(e).__name__}: {e}") from None
        try:
            out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP
                           and k.lower() != "content-encoding"}
            out_headers["X-Kvcached-Host"] = host.name  # which host served it (logs, benches)
            if reason:  # and why: cache / load / balance / ... (the routes_total metric's reasons)
                out_headers["X-Kvcached-Route"] = reason
            ctype = upstream.headers.get("content-type", "")
            if ctype.startswith("text/event-stream"):
                resp = web.StreamResponse(status=upstream.status, headers=out_headers)
                await resp.prepare(request)
                last_data = b""
                async for piece in upstream.content.iter_any():
                    if queued.started():
                        self.metrics.ttft.labels(host.name).observe(time.perf_counter() - t0)
                    last_data = _last_event(last_data + piece)
                    if capture is not None:
                        capture.feed(piece)
                    await resp.write(piece)
                await resp.write_eof()
                self._realised(host, last_data)
                if capture is not None:
                    capture.finish(upstream.status, ctype)
                return resp
            body = await upstream.read()
            queued.started()
            self.metrics.ttft.labels(host.name).observe(time.perf_counter() - t0)
            self._realised(host, body)
            if capture is not None:
                capture.feed(body)
                capture.finish(upstream.status, ctype)
            return web.Response(status=upstream.status, body=body, headers=out_headers)
        finally:
            upstream.release()

    def _record(self, d: Decision, n_tokens: int) -> dict:
        m = self.metrics
        m.routes.labels(d.policy, d.host.name, d.reason).inc()
        m.predicted.labels(d.host.name).inc(min(d.cached_chunks * self.layout.chunk_tokens, n_tokens))
        m.prompt_tokens.labels(d.host.name).inc(n_tokens)
        record = {"host": d.host.name, "reason": d.reason, "cached_chunks": d.cached_chunks,
                  "best_chunks": d.best_chunks, "tokens": n_tokens, "t": time.time()}
        self.decisions.append(record)
        if len(self.decisions) > 10_000:
            del self.decisions[:5_000]
        return record

    def _realised(self, host: HostState, body: bytes) -> None:
        try:
            usage = json.loads(body).get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        except (ValueError, AttributeError):
            return
        if isinstance(cached, int):
            self.metrics.realised.labels(host.name).inc(cached)

    async def _audit(self, d: Decision, ids: list[int], record: dict, answered: asyncio.Event) -> None:
        """Ask every healthy daemon how much of this prompt it holds now (the oracle): the route
        was wrong if another host within the load bound held at least one more chunk. If the
        chosen host's daemon does not answer (it stopped just after the route: nobody could
        have known), or answers only after the request was forwarded (``AUDIT_WAIT_S``: its
        answer may then include what the request stored), the route is counted unaudited, not
        wrong; another daemon that does not answer holds nothing usable. ``answered`` is set
        once the chosen daemon has answered or failed."""
        live = [h for h in self.hosts if h.name in d.loads]
        bound, loads = d.bound, d.loads  # as they were when the route was chosen
        if all(h.name != d.host.name for h in live):  # pragma: no cover - the chosen host is always live
            answered.set()

        async def lookup(name: str) -> int | None:
            try:
                return await self._audit_clients[name].lookup(self.layout, ids)
            except Exception:  # noqa: BLE001 - the daemon did not answer
                return None
            finally:
                if name == d.host.name:
                    answered.set()

        record["index_chunks"] = {h.name: h.index.prefix(self.chunk_hashes(ids)) for h in live}
        record["loads"], record["bound"] = loads, bound
        answers = dict(zip([h.name for h in live], await asyncio.gather(*(lookup(h.name) for h in live))))
        if answers.get(d.host.name) is None or record.get("audit_late"):
            self.metrics.unaudited.inc()
            record["audit"] = ("the chosen daemon did not answer" if answers.get(d.host.name) is None else
                               f"the chosen daemon answered after the request was forwarded (> {AUDIT_WAIT_S} s)")
            return
        got = {name: n or 0 for name, n in answers.items()}
        self.metrics.audited.inc()
        mine = got.get(d.host.name, 0)
        ct = self.layout.chunk_tokens
        if any(n >= mine + ct and loads[name] <= bound for name, n in got.items() if name != d.host.name):
            self.metrics.wrong.inc()
            record["wrong"] = True
        record["oracle_tokens"] = got

    async def handle_other(self, request: web.Request) -> web.StreamResponse:
        """Anything else (/v1/models, ...): to the least-loaded healthy host, unchanged."""
        return await self._route_and_forward(request, await request.read(), [], [])

    async def handle_metrics(self, request: web.Request) -> web.Response:
        m = self.metrics
        for h in self.hosts:
            m.in_flight.labels(h.name).set(h.in_flight)
            m.queued.labels(h.name).set(h.queued_tokens)
            m.healthy.labels(h.name).set(1 if h.healthy else 0)
            m.indexed.labels(h.name).set(len(h.index))
        for sub in self.subscribers:
            m.lag.labels(sub.name).set(sub.lag)
        return web.Response(body=generate_latest(m.registry), content_type="text/plain", charset="utf-8")

    async def handle_health(self, request: web.Request) -> web.Response:
        healthy = [h.name for h in self.hosts if h.healthy]
        return web.json_response({"healthy_hosts": healthy}, status=200 if healthy else 503)

    async def handle_state(self, request: web.Request) -> web.Response:
        subs = {s.name: s for s in self.subscribers}
        return web.json_response({
            "policy": self.config.policy,
            "semantic": self.semantic.summary() if self.semantic is not None else None,
            "hosts": [{"name": h.name, "healthy": h.healthy, "in_flight": h.in_flight, "queued_tokens": h.queued_tokens,
                       "indexed_chunks": len(h.index), "cleared": h.index.cleared,
                       "events_next_seq": subs[h.name].next_seq if h.name in subs else None,
                       "events_restarts": subs[h.name].restarts if h.name in subs else None}
                      for h in self.hosts],
        })

    async def handle_semantic(self, request: web.Request) -> web.Response:
        """The semantic cache: entries, lookups by outcome and reason, drift, shadow sample
        (what :func:`kvcached_router.semantic.drift.semantic_checks` judges)."""
        if self.semantic is None:
            return web.json_response({"enabled": False})
        return await self.semantic.handle_state(request)

    async def handle_decisions(self, request: web.Request) -> web.Response:
        """The last routes (at most 10,000): host, reason, the index's prefix at the chosen host and
        the best one; with audits, what every daemon said (``oracle_tokens``) and ``wrong``."""
        rows = self.decisions
        if request.query.get("wrong"):
            rows = [r for r in rows if r.get("wrong")]
        return web.json_response(rows[-int(request.query.get("limit", "1000")):])

    async def _health_loop(self) -> None:
        assert self._session is not None
        while True:
            for h in self.hosts:
                url = self.host_config[h.name].url.rstrip("/") + "/health"
                try:
                    async with self._session.get(url, timeout=ClientTimeout(total=max(self.config.health_interval, 1))) as r:
                        ok = r.status == 200
                except Exception:  # noqa: BLE001 - any failure is "down"
                    ok = False
                if ok != h.healthy:
                    log.warning("host %s is %s", h.name, "back" if ok else "down",
                                extra={"event": "router_host_up" if ok else "router_host_down", "host": h.name})
                h.healthy = ok
            await asyncio.sleep(self.config.health_interval)


class _Queued:
    """A request's uncached prefill tokens, counted in its host's queue until it starts answering."""

    def __init__(self, host: HostState, tokens: int) -> None:
        self.host = host
        self.tokens = tokens
        host.queued_tokens += tokens

    def started(self) -> bool:
        """Take them out of the queue (once); True the first time."""
        if self.tokens < 0:
            return False
        self.host.queued_tokens -= self.tokens
        self.tokens = -1
        return True


class _Unreachable(Exception):
    """The host refused or dropped the connection before answering: try another."""


def _last_event(buf: bytes) -> bytes:
    """The last complete ``data: {...}`` payload of a server-sent event stream seen so far."""
    end = buf.rfind(b"\n\n")
    if end < 0:
        return buf[-65536:]
    start = buf.rfind(b"data: ", 0, end)
    tail = buf[start + 6:end] if start >= 0 else b""
    if tail.strip() == b"[DONE]":
        prev = buf.rfind(b"data: ", 0, start)
        return buf[prev + 6:start].strip() if prev >= 0 else b""
    return tail if tail else buf[-65536:]


def _normalized(body: dict) -> dict:
    """The body with its prompt text normalised (``normalize_prompts``): every message's text,
    or a completion's prompt string(s). Token-id prompts are left alone."""
    body = dict(body)
    if isinstance(body.get("messages"), list):
        body["messages"] = normalize_messages(body["messages"])
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        body["prompt"] = normalize(prompt)
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        body["prompt"] = [normalize(p) for p in prompt]
    return body


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``kvcached-router --config router.toml`` serves; ``kvcached-router calibrate ...`` picks the
    semantic cache's thresholds from labelled pairs (:mod:`kvcached_router.semantic.calibrate`);
    ``kvcached-router doctor [--url URL]`` checks a running router's semantic cache."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["calibrate"]:
        from kvcached_router.semantic.calibrate import main as calibrate_main

        return calibrate_main(args_list[1:])
    if args_list[:1] == ["doctor"]:
        from kvcached_router.semantic.drift import doctor_main

        return doctor_main(args_list[1:])
    ap = argparse.ArgumentParser(prog="kvcached-router", description="cache-aware OpenAI-compatible router "
                                 "(`kvcached-router calibrate --help`: the semantic cache's thresholds; "
                                 "`kvcached-router doctor --help`: its checks)")
    ap.add_argument("--config", required=True, help="router TOML (see kvcached_router.config)")
    ap.add_argument("--listen", help="HOST:PORT (overrides the config)")
    ap.add_argument("--policy", help="override the config's policy")
    args = ap.parse_args(args_list)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config, listen=args.listen, policy=args.policy)
        service = RouterService(config)
    except (RouterConfigError, ValueError, OSError) as e:
        print(f"kvcached-router: {e}", file=sys.stderr)
        return 2
    host, _, port = config.listen.rpartition(":")
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency
        pass
    semantic = ""
    if config.semantic.enabled:
        semantic = ", semantic cache " + ("on" if config.semantic.match else "on (exact path only)")
    print(f"kvcached-router: {config.policy} policy over {len(config.hosts)} hosts on http://{config.listen}"
          f"{semantic}", flush=True)
    web.run_app(service.app(), host=host or "127.0.0.1", port=int(port), print=None, access_log=None)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
