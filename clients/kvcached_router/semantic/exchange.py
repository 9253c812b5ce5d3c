"""OpenAI requests and answers as the semantic cache stores them.

- :func:`cache_request`: a ``/v1/chat/completions`` or ``/v1/completions`` body as a
  :class:`~kvcached_router.semantic.cache.CacheRequest`, or the reason it is not cached.
  The *query* is the last user message (chat) or the prompt (completions); the *system prompt*
  is the leading system/developer messages; the *context* is everything else that changes the
  answer, as canonical JSON: the earlier turns and every body field except ``model``,
  ``messages``/``prompt``, ``stream``, ``stream_options`` and ``user``. An unknown field is
  therefore part of the key: a parameter this module has never heard of can split entries, never
  merge them.
- Sampled requests are not cached: an answer drawn at temperature > 0 is one sample, and serving
  it again changes what the client asked for. A request without ``temperature`` gets the
  engine's default (``default_temperature``, 1.0 for OpenAI and vLLM) and so is not cached either;
  a client that wants the cache sends ``"temperature": 0``. ``cache_sampled`` turns this off
  (every sampled request then gets the first sample stored for it).
- :func:`answer_from_json` / :func:`answer_from_sse`: the engine's answer (a JSON body or a
  complete server-sent event stream) as a :class:`CachedAnswer`: per choice its text and finish
  reason, and the usage. Tool calls, logprobs, error bodies and streams cut short are not
  stored (None).
- :func:`render_json` / :func:`render_sse`: a cached answer served as a JSON body or replayed
  as OpenAI's stream chunks, with a fresh id and the requesting model's name.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass

from kvcached_client.text import normalize_messages
from kvcached_router.semantic.cache import CacheRequest

#: Body fields that do not change the answer's content.
_NOT_CONTEXT = frozenset({"model", "messages", "prompt", "stream", "stream_options", "user"})
_SYSTEM_ROLES = ("system", "developer")


@dataclass(frozen=True)
class Choice:
    text: str
    finish_reason: str | None


@dataclass(frozen=True)
class CachedAnswer:
    kind: str  # "chat" | "completion"
    choices: tuple[Choice, ...]
    usage: str = "null"  # the engine's usage object, as JSON

    @property
    def size(self) -> int:
        return sum(len(c.text.encode()) + 32 for c in self.choices) + len(self.usage) + 64

    @property
    def text(self) -> str:
        return self.choices[0].text if self.choices else ""


def kind_of(path: str) -> str:
    return "chat" if path.endswith("/chat/completions") else "completion"


def _text_of(content: object) -> str | None:
    """A message content's text, or None when it has parts that are not text (images...)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    return None


def cache_request(path: str, body: dict, tenant: str, *, cache_sampled: bool = False,
                  default_temperature: float = 1.0) -> tuple[CacheRequest | None, str]:
    """The request as the cache sees it, or ``(None, reason)`` when it is not cached:
    ``sampled``, ``token_prompt`` (token ids or a batch), ``unreadable``."""
    kind = kind_of(path)
    if not isinstance(body, dict) or not isinstance(body.get("model", ""), str):
        return None, "unreadable"
    temperature = body.get("temperature")
    if temperature is None:
        temperature = default_temperature
    if not isinstance(temperature, (int, float)):
        return None, "unreadable"
    if temperature > 0 and not cache_sampled:
        return None, "sampled"
    params = {k: v for k, v in body.items() if k not in _NOT_CONTEXT}
    params["temperature"] = temperature
    model = body.get("model", "")
    if kind == "completion":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return None, "token_prompt"
        return CacheRequest(tenant, model, "", _canonical({"params": params}), prompt, kind), "ok"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        return None, "unreadable"
    k = 0
    system: list[str] = []
    while k < len(messages) and messages[k].get("role") in _SYSTEM_ROLES:
        text = _text_of(messages[k].get("content"))
        if text is None:
            break
        system.append(text)
        k += 1
    rest = messages[k:]
    last = rest[-1] if rest else None
    query = _text_of(last.get("content")) if last is not None and last.get("role") == "user" else None
    if query is not None and last is not None and set(last) <= {"role", "content"}:
        history, semantic = rest[:-1], True
    else:
        history, query, semantic = rest, "", False
    context = _canonical({"history": normalize_messages(history), "params": params})
    return CacheRequest(tenant, model, "\n".join(system), context, query, kind, semantic), "ok"


def _canonical(obj: object) -> str:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


# -- answers ----------------------------------------------------------------------------------------

def answer_from_json(kind: str, raw: bytes) -> CachedAnswer | None:
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(body, dict) or "error" in body or not isinstance(body.get("choices"), list):
        return None
    choices = []
    for c in sorted(body["choices"], key=lambda c: c.get("index", 0)):
        if c.get("logprobs"):
            return None
        if kind == "chat":
            msg = c.get("message") or {}
            if msg.get("tool_calls") or msg.get("function_call") or not isinstance(msg.get("content"), str):
                return None
            text = msg["content"]
        else:
            if not isinstance(c.get("text"), str):
                return None
            text = c["text"]
        choices.append(Choice(text, c.get("finish_reason")))
    if not choices:
        return None
    return CachedAnswer(kind, tuple(choices), _canonical(body.get("usage")))


def answer_from_sse(kind: str, raw: bytes) -> CachedAnswer | None:
    """A complete stream's answer: every choice must have finished (a finish reason) and the
    stream must end with ``data: [DONE]``."""
    texts: dict[int, list[str]] = {}
    finish: dict[int, str | None] = {}
    usage: object = None
    done = False
    for line in raw.decode("utf-8", "replace").splitlines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            continue
        try:
            chunk = json.loads(data)
        except ValueError:
            return None
        if not isinstance(chunk, dict) or "error" in chunk:
            return None
        if chunk.get("usage"):
            usage = chunk["usage"]
        for c in chunk.get("choices") or ():
            i = int(c.get("index", 0))
            if c.get("logprobs"):
                return None
            if kind == "chat":
                delta = c.get("delta") or {}
                if delta.get("tool_calls") or delta.get("function_call"):
                    return None
                piece = delta.get("content")
            else:
                piece = c.get("text")
            texts.setdefault(i, [])
            if isinstance(piece, str):
                texts[i].append(piece)
            if c.get("finish_reason"):
                finish[i] = c["finish_reason"]
    if not done or not texts or set(finish) != set(texts):
        return None
    return CachedAnswer(kind, tuple(Choice("".join(texts[i]), finish[i]) for i in sorted(texts)), _canonical(usage))


def _envelope(kind: str, model: str, stream: bool) -> dict:
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    obj = ("chat.completion.chunk" if stream else "chat.completion") if kind == "chat" else "text_completion"
    return {"id": f"{prefix}-cache-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()), "model": model}


def render_json(answer: CachedAnswer, model: str) -> dict:
    out = _envelope(answer.kind, model, stream=False)
    if answer.kind == "chat":
        out["choices"] = [{"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                           "finish_reason": c.finish_reason} for i, c in enumerate(answer.choices)]
    else:
        out["choices"] = [{"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
                          for i, c in enumerate(answer.choices)]
    out["usage"] = json.loads(answer.usage)
    return out


_PIECE = re.compile(r"\s*\S+\s*|\s+")


def _pieces(text: str, words: int = 4) -> list[str]:
    """The text in pieces of a few words (what a stream's deltas look like); their concatenation is
    the text."""
    tokens = _PIECE.findall(text)
    return ["".join(tokens[k:k + words]) for k in range(0, len(tokens), words)]


def render_sse(answer: CachedAnswer, model: str, include_usage: bool = False) -> bytes:
    """The answer as OpenAI's stream: per choice a role chunk (chat), its text a few words per
    chunk, a chunk with the finish reason; then the usage chunk when the request asked for it
    (``stream_options.include_usage``), then ``data: [DONE]``."""
    env = _envelope(answer.kind, model, stream=True)
    events: list[dict] = []
    chat = answer.kind == "chat"
    for i, c in enumerate(answer.choices):
        if chat:
            events.append({**env, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
        for piece in _pieces(c.text):
            choice = {"index": i, "delta": {"content": piece}} if chat else {"index": i, "text": piece}
            events.append({**env, "choices": [{**choice, "logprobs": None, "finish_reason": None}]})
        last = {"index": i, "delta": {}} if chat else {"index": i, "text": ""}
        events.append({**env, "choices": [{**last, "logprobs": None, "finish_reason": c.finish_reason}]})
    if include_usage:
        events.append({**env, "choices": [], "usage": json.loads(answer.usage)})
    out = b"".join(b"data: " + json.dumps(e, ensure_ascii=False).encode() + b"\n\n" for e in events)
    return out + b"data: [DONE]\n\n"
