"""kvcached_client.vllm.middleware.CacheControlMiddleware through real ASGI apps (no vLLM needed).

The wrapped apps are small Starlette / FastAPI apps; requests go through httpx.ASGITransport,
Starlette's TestClient, or (where response timing matters) a plain ASGI driver.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket

from kvcached_client.policy import CachePolicy
from kvcached_client.vllm.middleware import CacheControlMiddleware, apply_policy

JSON = {"content-type": "application/json"}


async def echo(request: Request) -> Response:
    """Echo the exact body bytes received, and the framing headers the app saw."""
    body = await request.body()
    return Response(
        body,
        media_type="application/octet-stream",
        headers={
            "x-seen-method": request.method,
            "x-seen-content-length": request.headers.get("content-length", "-"),
            "x-seen-transfer-encoding": request.headers.get("transfer-encoding", "-"),
        },
    )


def make_app(**kw: Any) -> CacheControlMiddleware:
    app = Starlette(routes=[Route("/v1/completions", echo, methods=["GET", "POST", "PUT"])])
    return CacheControlMiddleware(app, **kw)


def send(app: Any, method: str = "POST", path: str = "/v1/completions", *,
         content: bytes | Callable[[], AsyncIterator[bytes]] = b"", headers: Any = None) -> httpx.Response:
    async def go() -> httpx.Response:
        body = content() if callable(content) else content
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await c.request(method, path, content=body, headers=headers)
    return asyncio.run(go())


def seen(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    # the rewritten body and its new content-length agree
    if r.headers["x-seen-content-length"] != "-":
        assert int(r.headers["x-seen-content-length"]) == len(r.content)
    return json.loads(r.content)


BODY = {"model": "m", "prompt": "héllo ☃", "max_tokens": 3, "temperature": 0.1}
RAW = json.dumps(BODY, ensure_ascii=False).encode()


# -- rewriting ---------------------------------------------------------------------------


def test_no_store_header_sets_kv_transfer_params():
    r = send(make_app(), content=RAW, headers={**JSON, "X-Cache-Control": "no-store"})
    got = seen(r)
    assert got == {**BODY, "kv_transfer_params": {"kvcached": {"no_store": True}}}
    assert r.headers["x-seen-content-length"] == str(len(r.content)) != str(len(RAW))


def test_mixed_case_both_directives():
    got = seen(send(make_app(), content=RAW, headers={**JSON, "X-Cache-Control": "No-Cache, no-store"}))
    assert got["kv_transfer_params"] == {"kvcached": {"no_store": True, "no_cache": True}}
    assert {k: v for k, v in got.items() if k != "kv_transfer_params"} == BODY


def test_no_cache_only_and_chat_path_with_charset():
    app = CacheControlMiddleware(Starlette(routes=[Route("/v1/chat/completions", echo, methods=["POST"])]))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    got = seen(send(app, path="/v1/chat/completions", content=json.dumps(body).encode(),
                    headers={"content-type": "application/json; charset=utf-8", "x-cache-control": "NO-CACHE"}))
    assert got == {**body, "kv_transfer_params": {"kvcached": {"no_cache": True}}}


def test_repeated_header_lines_are_combined():
    headers = [("content-type", "application/json"), ("X-Cache-Control", "no-store"), ("X-Cache-Control", "no-cache")]
    got = seen(send(make_app(), content=RAW, headers=headers))
    assert got["kv_transfer_params"] == {"kvcached": {"no_store": True, "no_cache": True}}


def test_merges_with_existing_kv_transfer_params_and_kvcached():
    body = {
        **BODY,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "remote_engine_id": "e1",
            "kvcached": {"no_cache": True, "no_store": False, "tag": "abc"},
        },
    }
    got = seen(send(make_app(), content=json.dumps(body).encode(), headers={**JSON, "X-Cache-Control": "no-store"}))
    assert got["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "remote_engine_id": "e1",
        # the header turns no_store on; the client's no_cache=true stays true; other keys kept
        "kvcached": {"no_cache": True, "no_store": True, "tag": "abc"},
    }
    assert {k: v for k, v in got.items() if k != "kv_transfer_params"} == BODY


def test_null_and_junk_kvcached_are_replaced_but_bad_kv_transfer_params_is_left_for_vllm():
    app = make_app()
    h = {**JSON, "X-Cache-Control": "no-store"}
    got = seen(send(app, content=json.dumps({**BODY, "kv_transfer_params": None}).encode(), headers=h))
    assert got["kv_transfer_params"] == {"kvcached": {"no_store": True}}
    got = seen(send(app, content=json.dumps({**BODY, "kv_transfer_params": {"x": 1, "kvcached": "off"}}).encode(), headers=h))
    assert got["kv_transfer_params"] == {"x": 1, "kvcached": {"no_store": True}}
    raw = json.dumps({**BODY, "kv_transfer_params": [1, 2]}).encode()
    assert send(app, content=raw, headers=h).content == raw  # vLLM answers 400 for a list


def test_header_already_satisfied_passes_original_bytes():
    raw = b'{"prompt": "x",   "kv_transfer_params": {"kvcached": {"no_store": true}}}'
    r = send(make_app(), content=raw, headers={**JSON, "X-Cache-Control": "no-store"})
    assert r.content == raw
    assert r.headers["x-seen-content-length"] == str(len(raw))


def test_apply_policy_never_clears_a_flag():
    body = {"kv_transfer_params": {"kvcached": {"no_store": True, "no_cache": True}}}
    assert not apply_policy(body, CachePolicy(no_store=True))
    assert body == {"kv_transfer_params": {"kvcached": {"no_store": True, "no_cache": True}}}
    assert not apply_policy(body, CachePolicy())


def test_chunked_request_body_in_several_pieces():
    raw = json.dumps({**BODY, "prompt": "☃" * 50}, ensure_ascii=False).encode()
    snowman = raw.index("☃".encode()) + 1  # split inside a multi-byte character, too
    cuts = [0, 1, snowman, len(raw) // 2, len(raw) - 1, len(raw)]
    pieces = [raw[a:b] for a, b in zip(cuts, cuts[1:])]

    async def body() -> AsyncIterator[bytes]:
        for p in pieces:
            await asyncio.sleep(0)
            yield p

    r = send(make_app(), content=body, headers={**JSON, "X-Cache-Control": "no-store, no-cache"})
    got = seen(r)
    assert got == {**BODY, "prompt": "☃" * 50, "kv_transfer_params": {"kvcached": {"no_store": True, "no_cache": True}}}
    # httpx sent it chunked; the app now sees a plain, fully sized body
    assert r.headers["x-seen-transfer-encoding"] == "-"
    assert r.headers["x-seen-content-length"] == str(len(r.content))


class CompletionRequest(BaseModel):
    """The shape of vLLM's field (vllm/entrypoints/openai/completion/protocol.py)."""

    model: str
    prompt: str
    kv_transfer_params: dict[str, Any] | None = None


def test_fastapi_model_receives_kv_transfer_params():
    api = FastAPI()

    @api.post("/v1/completions")
    async def completions(req: CompletionRequest) -> dict[str, Any]:
        return {"kv_transfer_params": req.kv_transfer_params}

    app = CacheControlMiddleware(api)
    r = send(app, content=b'{"model": "m", "prompt": "p"}', headers={**JSON, "X-Cache-Control": "no-store"})
    assert r.json() == {"kv_transfer_params": {"kvcached": {"no_store": True}}}
    r = send(app, content=b'{"model": "m", "prompt": "p"}', headers=JSON)
    assert r.json() == {"kv_transfer_params": None}


# -- pass-through ------------------------------------------------------------------------


def test_no_header_body_byte_identical():
    raw = b'{ "model" : "m",\n  "prompt": "x", "n": 1.50 }'
    r = send(make_app(), content=raw, headers=JSON)
    assert r.content == raw
    assert r.headers["x-seen-content-length"] == str(len(raw))


@pytest.mark.parametrize("value", ["", "max-age=0", "no-transform, private"])
def test_header_without_our_directives_is_byte_identical(value):
    raw = b'{"model": "m",  "prompt": "x"}'
    assert send(make_app(), content=raw, headers={**JSON, "X-Cache-Control": value}).content == raw


@pytest.mark.parametrize("raw", [b'{"model": "m", "prompt": ', b"not json at all", b"\xff\xfe{", b""])
def test_invalid_json_with_header_passes_through(raw):
    assert send(make_app(), content=raw, headers={**JSON, "X-Cache-Control": "no-store"}).content == raw


@pytest.mark.parametrize("raw", [b'[{"prompt": "a"}, {"prompt": "b"}]', b'"just a string"', b"42", b"null"])
def test_non_object_json_body_unchanged(raw):
    assert send(make_app(), content=raw, headers={**JSON, "X-Cache-Control": "no-store"}).content == raw


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"])
def test_non_json_content_type_unchanged(ctype):
    headers = {"X-Cache-Control": "no-store"}
    if ctype:
        headers["content-type"] = ctype
    assert send(make_app(), content=RAW, headers=headers).content == RAW


def test_content_encoded_body_unchanged():
    raw = b"\x1f\x8b\x08\x00 pretend gzip"
    r = send(make_app(), content=raw, headers={**JSON, "content-encoding": "gzip", "X-Cache-Control": "no-store"})
    assert r.content == raw


def test_get_and_put_untouched():
    app = make_app()
    for method in ("GET", "PUT"):
        r = send(app, method, content=RAW, headers={**JSON, "X-Cache-Control": "no-store"})
        assert r.headers["x-seen-method"] == method
        assert r.content == RAW
    r = send(app, "GET", headers={"X-Cache-Control": "no-store"})
    assert r.status_code == 200 and r.content == b""


def test_over_size_cap_passes_through_unchanged(caplog):
    app = make_app(max_body_bytes=64)
    raw = json.dumps({"prompt": "x" * 200}).encode()
    h = {**JSON, "X-Cache-Control": "no-store"}
    with caplog.at_level("WARNING", logger="kvcached_client.vllm.middleware"):
        assert send(app, content=raw, headers=h).content == raw  # content-length says too big
    assert "not applied" in caplog.text

    pieces = [raw[i:i + 16] for i in range(0, len(raw), 16)]

    async def body() -> AsyncIterator[bytes]:  # no content-length: the cap trips while buffering
        for p in pieces:
            yield p

    r = send(app, content=body, headers=h)
    assert r.content == raw
    assert r.headers["x-seen-transfer-encoding"] == "chunked"  # headers untouched too
    # small bodies are still rewritten under the same cap
    assert seen(send(app, content=b'{"p": 1}', headers=h)) == {"p": 1, "kv_transfer_params": {"kvcached": {"no_store": True}}}


def test_max_body_bytes_from_env(monkeypatch):
    monkeypatch.setenv("KVCACHED_MIDDLEWARE_MAX_BODY_BYTES", "10")
    assert CacheControlMiddleware(echo).max_body_bytes == 10
    monkeypatch.setenv("KVCACHED_MIDDLEWARE_MAX_BODY_BYTES", "lots")
    assert CacheControlMiddleware(echo).max_body_bytes == 16 * 1024 * 1024


def test_lifespan_and_websocket_pass_through():
    events: list[str] = []

    async def ws_echo(ws: WebSocket) -> None:
        await ws.accept()
        await ws.send_text("echo:" + await ws.receive_text())
        await ws.close()

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        events.append("startup")
        yield
        events.append("shutdown")

    app = Starlette(routes=[Route("/v1/completions", echo, methods=["POST"]), WebSocketRoute("/ws", ws_echo)],
                    lifespan=lifespan)
    with TestClient(CacheControlMiddleware(app)) as client:
        assert events == ["startup"]
        with client.websocket_connect("/ws", headers={"X-Cache-Control": "no-store"}) as ws:
            ws.send_text('{"a": 1}')
            assert ws.receive_text() == 'echo:{"a": 1}'
        r = client.post("/v1/completions", content=b'{"a": 1}', headers={**JSON, "X-Cache-Control": "no-store"})
        assert json.loads(r.content) == {"a": 1, "kv_transfer_params": {"kvcached": {"no_store": True}}}
    assert events == ["startup", "shutdown"]


# -- responses are not buffered ----------------------------------------------------------


def test_streaming_response_still_streams():
    """Drive the ASGI app by hand: the second chunk is only produced after the *client* has
    received the first, so a middleware that buffered the response would deadlock."""

    async def go() -> list[dict[str, Any]]:
        first_received = asyncio.Event()
        response_done = asyncio.Event()

        async def stream(request: Request) -> StreamingResponse:
            got = await request.json()

            async def chunks() -> AsyncIterator[bytes]:
                yield (json.dumps(got["kv_transfer_params"]) + "\n").encode()
                await first_received.wait()
                for i in range(3):
                    yield f"data: {i}\n\n".encode()

            return StreamingResponse(chunks(), media_type="text/event-stream")

        app = CacheControlMiddleware(Starlette(routes=[Route("/v1/completions", stream, methods=["POST"])]))
        requests = [{"type": "http.request", "body": RAW[:10], "more_body": True},
                    {"type": "http.request", "body": RAW[10:], "more_body": False}]

        async def receive() -> dict[str, Any]:
            if requests:
                return requests.pop(0)
            await response_done.wait()
            return {"type": "http.disconnect"}

        sent: list[dict[str, Any]] = []

        async def send_(message: dict[str, Any]) -> None:
            sent.append(message)
            if message["type"] == "http.response.body":
                first_received.set()
                if not message.get("more_body", False):
                    response_done.set()

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
            "root_path": "", "server": ("test", 80), "client": ("127.0.0.1", 1234),
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(RAW)).encode()),
                        (b"x-cache-control", b"no-store")],
        }
        await asyncio.wait_for(app(scope, receive, send_), timeout=10)
        return sent

    sent = asyncio.run(go())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    bodies = [m["body"] for m in sent[1:] if m["type"] == "http.response.body" and m.get("body")]
    assert json.loads(bodies[0]) == {"kvcached": {"no_store": True}}
    assert bodies[1:] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]  # several separate chunks


def test_module_does_not_import_vllm():
    import ast
    import kvcached_client.vllm.middleware as mod

    tree = ast.parse(open(mod.__file__, encoding="utf-8").read())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m == "vllm" or m.startswith(("vllm.", "kvcached_client.vllm")) for m in imported), imported
    assert not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree))  # no relative imports
