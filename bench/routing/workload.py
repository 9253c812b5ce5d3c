"""The routing bench's workload: Mooncake trace requests turned into deterministic prompt text.

The FAST'25 traces (``../shared/traces/mooncake-fast25``, see its README) release no text, only
per request an arrival time, token counts and ``hash_ids``: ids of the request's 512-token
blocks, where equal ids mean an identical prefix up to and including that block. This module
gives every hash id a fixed block of text, so that replaying the trace reproduces its prefix
sharing exactly (shared system prompts, multi-turn conversations that resend the history):

- **Blocks.** Hash id ``h`` becomes ``words_per_block`` words (default 32: the trace's 512-token
  blocks scaled down 16x, so a 2-core box can replay it) drawn from the tokenizer's vocabulary
  (``w0`` .. ``w{V-1}``, see tokenizer.py) by a generator seeded with ``(seed, h)``. Equal hash
  ids give equal text and so equal token ids (one token per word). The request's last block is
  usually partial in the trace (``len(hash_ids) == ceil(input_length / 512)``); it gets the
  same fraction of ``words_per_block`` words, rounded up: the first words of the full block, so
  text stays prefix-consistent whatever the length (``partial_last_block=False``: every block
  full).
- **Completions form** (``prompt``): the blocks' words in order, separated by single spaces.
  Token ids = the word ids, nothing added.
- **Chat form** (``messages``): the first ``system_blocks`` blocks (default 1: in the
  conversation trace every request starts with block 0, the shared system prompt) are the
  system message; all the remaining blocks are ONE user message. The history of a multi-turn
  conversation is not split into user/assistant turns: the trace does not say where turns
  begin, and one user message keeps the property that matters here: a follow-up's rendered chat
  (``<|system|> S\\n<|user|> U\\n<|assistant|>``, tokenizer.py's template) starts with its
  predecessor's rendered text up to the end of their shared blocks, so its token ids share the
  predecessor's prefix up to that point (``[<|system|>] + S + [<|user|>] + U + [<|assistant|>]``).
  A request with no block beyond the system ones has an empty user message.
- **Arrivals and outputs.** ``timestamp_s`` (trace ms / 1000), ``gap_s`` (since the previous
  request of the trace) and ``output_tokens`` = the trace's output length capped at
  ``max_output_tokens`` (default 16; at least 1).

**Users.** The trace has no conversation or user ids. :meth:`Workload.conversations` rebuilds
conversations by shared prefix: a request continues the most recent earlier request with which
it shares the longest prefix of more than ``system_blocks`` blocks (more than the common system
prompt); requests sharing nothing beyond it start a conversation. (In the conversation trace
4,658 of 12,031 requests find a predecessor; 3,833 of those share all of it but its last,
partial, block: the previous turn's prompt, resent with the reply and a new question appended.)
Two requests about the same document land in the same conversation too, which is what a router
should see anyway. :meth:`Workload.user_sessions` deals whole conversations to ``n_users``
users (in order of first arrival, each to the user with the fewest requests so far), so a
conversation's turns are always sent by one user, in trace order; a user's requests are sorted
by arrival, and its think times are the trace's gaps between them (scaled by ``time_scale``).

::

    wl = Workload(os.path.join(TRACE_DIR, "conversation_trace.jsonl"), limit=2000)
    for s in wl.user_sessions(100, time_scale=0.1):
        for think_s, req in s:
            ...  # sleep think_s, then POST wl.chat_body(req, model) to /v1/chat/completions
"""

from __future__ import annotations

import heapq
import json
import math
import os
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Iterator, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # run as a file: import bench

from bench.routing.tokenizer import DEFAULT_VOCAB, SPECIALS, WORD_ID_OFFSET

TRACE_BLOCK_TOKENS = 512  # the Mooncake traces' block size
ROLE_IDS = {"system": SPECIALS.index("<|system|>"), "user": SPECIALS.index("<|user|>"),
            "assistant": SPECIALS.index("<|assistant|>")}


@dataclass(frozen=True)
class TraceRequest:
    """One trace line. Its text comes from :class:`Workload` (``wl.prompt(req)``...)."""

    index: int  # line number in the trace (0-based), after ``skip``
    timestamp_s: float
    gap_s: float  # since the previous request of the trace (0 for the first)
    input_length: int  # the trace's (512-token-block) input length
    output_tokens: int  # the trace's output length, capped
    hash_ids: tuple[int, ...]
    block_words: tuple[int, ...] = field(repr=False)  # words of each block in this request's text

    @property
    def n_words(self) -> int:
        return sum(self.block_words)


@dataclass
class UserSession:
    """One simulated user's requests, in arrival order. Iterating yields ``(think_s, request)``:
    ``think_s`` is how long to wait before sending it (the first one: the user's first arrival
    offset, scaled; each later one: the trace gap since the user's previous request, scaled)."""

    user: int
    requests: list[TraceRequest]
    time_scale: float = 1.0
    origin_s: float = 0.0  # the trace time the run starts at (the first request loaded)

    @property
    def think_times_s(self) -> list[float]:
        out, prev = [], self.origin_s
        for r in self.requests:
            out.append(max(0.0, r.timestamp_s - prev) * self.time_scale)
            prev = r.timestamp_s
        return out

    def __iter__(self) -> Iterator[tuple[float, TraceRequest]]:
        return iter(zip(self.think_times_s, self.requests))

    def __len__(self) -> int:
        return len(self.requests)


class Workload:
    """A Mooncake trace as prompts; see the module docstring for the mapping.

    ``limit``/``skip``: use trace lines ``skip .. skip+limit-1`` only. ``max_blocks``: keep at
    most this many leading blocks of each request (prefix-preserving). ``seed``: another seed
    gives other words for every block (a fresh cache), the same sharing.
    """

    def __init__(self, trace_path: str, words_per_block: int = 32, *, vocab_size: int = DEFAULT_VOCAB,
                 max_output_tokens: int = 16, system_blocks: int = 1, partial_last_block: bool = True,
                 max_blocks: int | None = None, limit: int | None = None, skip: int = 0, seed: int = 0) -> None:
        if words_per_block < 1 or vocab_size < 1 or max_output_tokens < 1 or system_blocks < 0:
            raise ValueError("words_per_block, vocab_size and max_output_tokens must be positive, "
                             "system_blocks non-negative")
        self.trace_path = trace_path
        self.words_per_block = words_per_block
        self.vocab_size = vocab_size
        self.max_output_tokens = max_output_tokens
        self.system_blocks = system_blocks
        self.seed = seed
        self.requests: list[TraceRequest] = []
        prev_t: float | None = None
        with open(trace_path) as f:
            for lineno, line in enumerate(f):
                if lineno < skip or not line.strip():
                    continue
                if limit is not None and len(self.requests) >= limit:
                    break
                d = json.loads(line)
                ids = tuple(int(h) for h in d["hash_ids"])
                n_in = int(d["input_length"])
                words = [words_per_block] * len(ids)
                if ids and partial_last_block:
                    rem = n_in - TRACE_BLOCK_TOKENS * (len(ids) - 1)
                    if 0 < rem < TRACE_BLOCK_TOKENS:
                        words[-1] = max(1, math.ceil(rem * words_per_block / TRACE_BLOCK_TOKENS))
                if max_blocks is not None:
                    ids, words = ids[:max_blocks], words[:max_blocks]
                t = float(d["timestamp"]) / 1000.0
                self.requests.append(TraceRequest(
                    index=len(self.requests), timestamp_s=t, gap_s=0.0 if prev_t is None else max(0.0, t - prev_t),
                    input_length=n_in, output_tokens=max(1, min(int(d.get("output_length", 1)), max_output_tokens)),
                    hash_ids=ids, block_words=tuple(words)))
                prev_t = t
        self._block = lru_cache(maxsize=1 << 16)(self._make_block)

    # -- text -------------------------------------------------------------------------------

    def _make_block(self, hash_id: int) -> tuple[np.ndarray, str]:
        idx = np.random.default_rng([self.seed, hash_id]).integers(0, self.vocab_size, self.words_per_block)
        return idx, " ".join(f"w{i}" for i in idx.tolist())

    def block_word_indices(self, hash_id: int, n_words: int | None = None) -> list[int]:
        """The vocabulary indices (word ``w{i}``) of block ``hash_id``, its first ``n_words``."""
        return self._block(hash_id)[0][: self.words_per_block if n_words is None else n_words].tolist()

    def block_text(self, hash_id: int, n_words: int | None = None) -> str:
        idx, text = self._block(hash_id)
        if n_words is None or n_words >= len(idx):
            return text
        return " ".join(text.split(" ", n_words)[:n_words])

    def _texts(self, req: TraceRequest, blocks: range) -> str:
        return " ".join(self.block_text(req.hash_ids[i], req.block_words[i]) for i in blocks)

    def prompt(self, req: TraceRequest) -> str:
        """Completions form: the blocks' words in order."""
        return self._texts(req, range(len(req.hash_ids)))

    def messages(self, req: TraceRequest) -> list[dict[str, str]]:
        """Chat form: ``[system: first system_blocks blocks, user: the rest]``."""
        k = min(self.system_blocks, len(req.hash_ids))
        msgs = [{"role": "system", "content": self._texts(req, range(k))}] if self.system_blocks else []
        msgs.append({"role": "user", "content": self._texts(req, range(k, len(req.hash_ids)))})
        return msgs

    def _word_ids(self, req: TraceRequest, blocks: range) -> list[int]:
        out: list[int] = []
        for i in blocks:
            out.extend(WORD_ID_OFFSET + w for w in self.block_word_indices(req.hash_ids[i], req.block_words[i]))
        return out

    def token_ids(self, req: TraceRequest, chat: bool = False) -> list[int]:
        """The token ids tokenizer.py's tokenizer gives for :meth:`prompt` (``chat``: for
        :meth:`messages` rendered with its chat template and the generation prompt), computed
        without loading it."""
        n = len(req.hash_ids)
        if not chat:
            return self._word_ids(req, range(n))
        k = min(self.system_blocks, n)
        ids = [ROLE_IDS["system"], *self._word_ids(req, range(k))] if self.system_blocks else []
        return ids + [ROLE_IDS["user"], *self._word_ids(req, range(k, n)), ROLE_IDS["assistant"]]

    def completion_body(self, req: TraceRequest, model: str, *, stream: bool = False) -> dict:
        """A /v1/completions request body."""
        return {"model": model, "prompt": self.prompt(req), "max_tokens": req.output_tokens, "stream": stream,
                "temperature": 0}

    def chat_body(self, req: TraceRequest, model: str, *, stream: bool = False) -> dict:
        """A /v1/chat/completions request body."""
        return {"model": model, "messages": self.messages(req), "max_tokens": req.output_tokens, "stream": stream,
                "temperature": 0}

    # -- arrivals and users ----------------------------------------------------------------

    @property
    def gaps_s(self) -> list[float]:
        """Arrival gaps of the trace, in seconds (the first is 0)."""
        return [r.gap_s for r in self.requests]

    @property
    def duration_s(self) -> float:
        return self.requests[-1].timestamp_s - self.requests[0].timestamp_s if self.requests else 0.0

    def predecessors(self) -> list[int | None]:
        """For each request, the earlier request it continues (see the module docstring), or None."""
        last: dict[int, int] = {}  # hash id -> latest request holding it (ids are prefix ids)
        out: list[int | None] = []
        k_min = self.system_blocks  # a shared prefix must be longer than the system blocks
        for i, r in enumerate(self.requests):
            h, parent = r.hash_ids, None
            for k in range(len(h) - 1, k_min - 1, -1):
                q = last.get(h[k])
                if q is not None and self.requests[q].hash_ids[: k + 1] == h[: k + 1]:
                    parent = q
                    break
            out.append(parent)
            for x in h:
                last[x] = i
        return out

    def conversations(self) -> list[list[int]]:
        """Request indices grouped into conversations, each in arrival order; the groups in order
        of their first request."""
        conv: list[int] = []
        groups: list[list[int]] = []
        for i, p in enumerate(self.predecessors()):
            if p is None:
                conv.append(len(groups))
                groups.append([i])
            else:
                conv.append(conv[p])
                groups[conv[p]].append(i)
        return groups

    def user_sessions(self, n_users: int, *, time_scale: float = 1.0) -> list[UserSession]:
        """Deal the conversations to ``n_users`` users (see the module docstring). Always returns
        ``n_users`` sessions; with fewer conversations than users some are empty."""
        if n_users < 1:
            raise ValueError("n_users must be positive")
        heap = [(0, u) for u in range(n_users)]
        per_user: list[list[int]] = [[] for _ in range(n_users)]
        for group in self.conversations():
            load, u = heapq.heappop(heap)
            per_user[u].extend(group)
            heapq.heappush(heap, (load + len(group), u))
        origin = self.requests[0].timestamp_s if self.requests else 0.0  # with ``skip``, not 0
        return [UserSession(u, [self.requests[i] for i in sorted(idx)], time_scale, origin)
                for u, idx in enumerate(per_user)]

    def shared_prefix_tokens(self, a: TraceRequest, b: TraceRequest, chat: bool = False) -> int:
        """How many leading token ids the two requests share."""
        x, y = self.token_ids(a, chat), self.token_ids(b, chat)
        n = 0
        for p, q in zip(x, y):
            if p != q:
                break
            n += 1
        return n


def trace_path(name: str = "conversation_trace.jsonl") -> str:
    """A trace in bench/_common.TRACE_DIR (``$KVCACHED_TRACES`` or ../shared/traces/mooncake-fast25)."""
    from bench._common import TRACE_DIR

    return os.path.join(TRACE_DIR, name)


def _main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="summarise a trace as the routing bench's workload")
    ap.add_argument("trace", nargs="?", default=trace_path())
    ap.add_argument("--words-per-block", type=int, default=32)
    ap.add_argument("--users", type=int, default=1000)
    ap.add_argument("--limit", type=int)
    a = ap.parse_args(argv)
    wl = Workload(a.trace, a.words_per_block, limit=a.limit)
    convs = wl.conversations()
    sessions = wl.user_sessions(a.users)
    sizes = [len(s) for s in sessions]
    words = [r.n_words for r in wl.requests]
    print(json.dumps({
        "trace": a.trace, "requests": len(wl.requests), "duration_s": wl.duration_s,
        "mean_rate_rps": len(wl.requests) / wl.duration_s if wl.duration_s else None,
        "words_per_request_mean": sum(words) / len(words), "words_per_request_max": max(words),
        "conversations": len(convs), "multi_turn_conversations": sum(1 for c in convs if len(c) > 1),
        "users": a.users, "requests_per_user_min": min(sizes), "requests_per_user_max": max(sizes),
    }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
