"""ASGI middleware: turn the load balancer's ``X-Cache-Control`` header into vLLM ``kv_transfer_params``.

What it does
------------
A load balancer marks requests whose KV must not be kept (or must not be served from the
cache) with an HTTP header::

    X-Cache-Control: no-store
    X-Cache-Control: No-Cache, no-store

(comma separated, case-insensitive, parsed by :meth:`kvcached_client.policy.CachePolicy.from_headers`;
several ``X-Cache-Control`` header lines are joined with ``,`` as HTTP allows). vLLM's
OpenAI server never looks at that header, so this middleware copies it into the JSON request
body, where vLLM carries it to the engine as the per-request ``kv_transfer_params``.

Exact mapping (only the directives present are set; nothing is ever set to ``false``)::

    no-store  ->  body["kv_transfer_params"]["kvcached"]["no_store"] = true
    no-cache  ->  body["kv_transfer_params"]["kvcached"]["no_cache"] = true

e.g. ``X-Cache-Control: no-store`` on ``{"model": "m", "prompt": "hi"}`` gives
``{"model": "m", "prompt": "hi", "kv_transfer_params": {"kvcached": {"no_store": true}}}``.

Merging: the result is merged into whatever the client already sent. Other keys of
``kv_transfer_params`` and of its ``kvcached`` dict are kept as they are; a client's
``true`` is never turned into ``false`` (the header only adds restrictions), and a client's
``"no_store": false`` is overridden to ``true`` when the header says ``no-store``. A
``kv_transfer_params`` or ``kvcached`` that is ``null`` is replaced by a dict; a ``kvcached``
value that is not a dict is replaced too (a client cannot dodge the header with junk). A
``kv_transfer_params`` that is neither a dict nor ``null`` is left alone: vLLM declares it
``dict[str, Any] | None`` and rejects the request with a 400 anyway. If the merge changes
nothing (the client already set the flags), the original bytes are passed on.

What is rewritten: ``http`` requests with method ``POST``, an ``X-Cache-Control`` header that
has ``no-store`` and/or ``no-cache``, a JSON media type (``application/json`` or ``*/*+json``,
parameters such as ``; charset=utf-8`` allowed), no ``Content-Encoding`` (other than
``identity``), a body of at most ``max_body_bytes`` that parses as a JSON *object*. That
covers ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` and any other JSON
POST. The body is re-serialised as compact UTF-8 JSON, delivered to the app in a single
``http.request`` message, and the ``content-length`` header is set to its new length (a
``transfer-encoding`` header is dropped: the body is no longer chunked). Everything else
passes through byte-for-byte unchanged, so the server gives its normal answer or error:
requests without the header, non-POST methods, other content types, bodies that do not parse
or are not an object (e.g. a JSON array), bodies over the size cap, and ``lifespan`` /
``websocket`` scopes. The request body may arrive in several ``http.request`` messages
(``more_body``); they are buffered (up to the cap) and, when the body is not rewritten,
replayed exactly as received. Responses are never touched: this is a pure ASGI middleware
(no ``BaseHTTPMiddleware``), so streamed (SSE) responses keep streaming.

The size cap defaults to 16 MiB (``DEFAULT_MAX_BODY_BYTES``); set the environment variable
``KVCACHED_MIDDLEWARE_MAX_BODY_BYTES`` to change it (vLLM passes no constructor arguments),
or pass ``max_body_bytes=`` when adding the middleware yourself. A request with the header
whose body is over the cap passes through unmodified and a warning is logged: its directives
are then *not* applied.

How to enable
-------------
::

    vllm serve MODEL --kv-transfer-config '...kvcached connector...' \\
        --middleware kvcached_client.vllm.middleware.CacheControlMiddleware

vLLM imports each ``--middleware`` path and, because this is a class, adds it with
``app.add_middleware(CacheControlMiddleware)`` (a coroutine function would instead be
registered with ``@app.middleware("http")``, i.e. ``BaseHTTPMiddleware``, which this avoids);
see ``vllm/entrypoints/serve/middleware/register.py:65-71`` (vLLM 0.32). Use it together
with the kvcached KV connector: without a connector vLLM logs "Got kv_transfer_params, but
no KVConnector found" for every rewritten request (``vllm/v1/engine/core.py:531``).

Where the directives land (vLLM 0.32)
-------------------------------------
* The request models declare the field ``kv_transfer_params: dict[str, Any] | None``:
  ``CompletionRequest`` (``vllm/entrypoints/openai/completion/protocol.py:238``),
  ``ChatCompletionRequest`` (``.../chat_completion/protocol.py:499``) and ``ResponsesRequest``
  (``.../responses/protocol.py:401``). Other endpoints' models allow extra fields
  (``OpenAIBaseModel``: ``extra="allow"``) and only log the unknown field.
* ``to_sampling_params`` copies it into ``SamplingParams.extra_args["kv_transfer_params"]``
  (``completion/protocol.py:380-382``, ``chat_completion/protocol.py:747-749``,
  ``responses/protocol.py:543-544``).
* The engine's ``Request`` sets ``request.kv_transfer_params =
  sampling_params.extra_args.get("kv_transfer_params")`` (``vllm/v1/request.py:105,119-122``),
  which is what a KV connector sees: ``request.kv_transfer_params["kvcached"]["no_store"]``
  / ``["no_cache"]``.

This module imports neither vLLM nor the rest of ``kvcached_client.vllm``.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Awaitable, Callable, MutableMapping

from kvcached_client.policy import CachePolicy

__all__ = ["CacheControlMiddleware", "DEFAULT_MAX_BODY_BYTES", "apply_policy"]

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_BODY_ENV = "KVCACHED_MIDDLEWARE_MAX_BODY_BYTES"
HEADER = b"x-cache-control"
KV_TRANSFER_PARAMS = "kv_transfer_params"
NAMESPACE = "kvcached"


def _default_max_body_bytes() -> int:
    raw = os.environ.get(MAX_BODY_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_BODY_BYTES
    try:
        value = int(raw)
    except ValueError:
        logger.warning("ignoring %s=%r: not an integer", MAX_BODY_ENV, raw)
        return DEFAULT_MAX_BODY_BYTES
    return max(0, value)


def _is_json_media_type(content_type: str) -> bool:
    media_type = content_type.split(";", 1)[0].strip().lower()
    if "/" not in media_type:
        return False
    main, sub = media_type.split("/", 1)
    return main == "application" and (sub == "json" or sub.endswith("+json"))


def apply_policy(body: Any, policy: CachePolicy) -> bool:
    """Merge ``policy``'s directives into the parsed JSON ``body`` in place.

    Returns whether ``body`` changed. ``body`` must be a dict; a ``kv_transfer_params`` that
    is neither a dict nor ``None`` is left alone (returns False).
    """
    flags = {name: True for name, on in (("no_store", policy.no_store), ("no_cache", policy.no_cache)) if on}
    if not flags or not isinstance(body, dict):
        return False
    params = body.get(KV_TRANSFER_PARAMS)
    if params is None:
        body[KV_TRANSFER_PARAMS] = {NAMESPACE: flags}
        return True
    if not isinstance(params, dict):
        return False  # vLLM rejects it (dict | None); do not mask the client's error
    ours = params.get(NAMESPACE)
    if not isinstance(ours, dict):
        params[NAMESPACE] = flags
        return True
    changed = False
    for name in flags:
        if ours.get(name) is not True:
            ours[name] = True
            changed = True
    return changed


def _dumps(obj: Any) -> bytes:
    try:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates from "\ud800"-style escapes
        return json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class CacheControlMiddleware:
    """Copy ``X-Cache-Control: no-store / no-cache`` into ``kv_transfer_params.kvcached``.

    See the module docstring for the exact mapping and what passes through unchanged.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int | None = None) -> None:
        self.app = app
        self.max_body_bytes = _default_max_body_bytes() if max_body_bytes is None else max(0, int(max_body_bytes))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or str(scope.get("method", "")).upper() != "POST":
            await self.app(scope, receive, send)
            return
        policy = self._policy(scope)
        if policy is None:
            await self.app(scope, receive, send)
            return

        # Buffer the body (up to the cap), keeping the messages so they can be replayed as-is.
        messages: list[Message] = []
        chunks: list[bytes] = []
        size = 0
        complete = False
        while True:
            message = await receive()
            messages.append(message)
            if message.get("type") != "http.request":
                break  # http.disconnect (or anything else): replay and let the app handle it
            chunk = message.get("body", b"") or b""
            chunks.append(chunk)
            size += len(chunk)
            if size > self.max_body_bytes:
                logger.warning(
                    "X-Cache-Control %s not applied: request body over %d bytes (%s)",
                    self._directives(policy), self.max_body_bytes, MAX_BODY_ENV,
                )
                break
            if not message.get("more_body", False):
                complete = True
                break

        new_body = self._rewrite(b"".join(chunks), policy) if complete else None
        if new_body is None:
            await self.app(scope, _replay(messages, receive), send)
            return

        headers = [
            (k, v) for k, v in scope.get("headers", [])
            if k.lower() not in (b"content-length", b"transfer-encoding")
        ]
        headers.append((b"content-length", str(len(new_body)).encode("latin-1")))
        new_scope = dict(scope)
        new_scope["headers"] = headers
        await self.app(new_scope, _replay([{"type": "http.request", "body": new_body, "more_body": False}], receive), send)

    def _policy(self, scope: Scope) -> CachePolicy | None:
        """The policy to apply, or None when this request is passed through without buffering."""
        cache_control: list[str] = []
        content_type = ""
        content_length: int | None = None
        for key, value in scope.get("headers", []):
            key = key.lower()
            if key == HEADER:
                cache_control.append(value.decode("latin-1"))
            elif key == b"content-type":
                content_type = value.decode("latin-1")
            elif key == b"content-encoding":
                if value.decode("latin-1").strip().lower() not in ("", "identity"):
                    return None
            elif key == b"content-length":
                try:
                    content_length = int(value)
                except ValueError:
                    return None
        if not cache_control or not _is_json_media_type(content_type):
            return None
        policy = CachePolicy.from_headers({"x-cache-control": ",".join(cache_control)})
        if not (policy.no_store or policy.no_cache):
            return None
        if content_length is not None and content_length > self.max_body_bytes:
            logger.warning(
                "X-Cache-Control %s not applied: content-length %d over %d bytes (%s)",
                self._directives(policy), content_length, self.max_body_bytes, MAX_BODY_ENV,
            )
            return None
        return policy

    @staticmethod
    def _directives(policy: CachePolicy) -> str:
        return ", ".join(d for d, on in (("no-store", policy.no_store), ("no-cache", policy.no_cache)) if on)

    @staticmethod
    def _rewrite(body: bytes, policy: CachePolicy) -> bytes | None:
        """The new body, or None to pass the original through unchanged."""
        try:
            obj = json.loads(body)  # what Starlette's Request.json() does, so same encodings
        except (ValueError, UnicodeDecodeError, RecursionError):
            return None
        if not isinstance(obj, dict) or not apply_policy(obj, policy):
            return None
        try:
            return _dumps(obj)
        except (ValueError, RecursionError):
            return None


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that returns ``messages`` first, then defers to the real ``receive``."""
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
