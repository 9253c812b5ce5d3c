"""Synthetic request streams with the shapes that break fixed eviction policies.

Each generator returns requests in the Mooncake trace's form (``timestamp`` ms, ``input_length``
tokens, ``hash_ids``: prefix block ids, so equal ids mean equal prefixes), deterministic for a
seed. Block ids are allocated fresh wherever a prompt diverges, so the ids are prefix hashes.

* ``scan``: a hot set of prompts (Zipf popularity) with one-hit prompts streaming past it:
  recency alone lets the stream flush the hot set.
* ``shift``: one hot set, then a different one from the middle on: counts earned by the first
  hot set keep it cached after it went cold.
* ``agentic``: 40 long agent sessions, 32 in flight, whose context grows every turn (tool
  outputs appended), with sub-agents that start from their parent's current context: the shape
  on which a fixed frequency weight lost to LRU. ``agents_shared``: 96 sessions with shorter
  steps behind a shared tool-definition prefix.
* ``tenants``: three tenants at once: chat conversations, retrieval over a Zipf document set,
  and a batch job of one-off prompts.

Not a benchmark: ``bench/trace_replay.py`` replays these beside the Mooncake traces.
"""

from __future__ import annotations

import random
from typing import Iterator

BLOCK = 512


class _Ids:
    def __init__(self) -> None:
        self.next = 0

    def new(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _request(ts: float, ids: list[int]) -> dict:
    return {"timestamp": int(ts * 1000), "input_length": len(ids) * BLOCK, "hash_ids": list(ids)}


def _zipf_picker(rng: random.Random, n: int, s: float) -> Iterator[int]:
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    order = list(range(n))
    rng.shuffle(order)
    while True:
        for k in rng.choices(range(n), weights=weights, k=256):
            yield order[k]


def scan(seed: int = 1, requests: int = 6000) -> list[dict]:
    rng = random.Random(seed)
    ids = _Ids()
    system = ids.new(4)
    hot = [system + ids.new(8) for _ in range(300)]
    pick = _zipf_picker(rng, len(hot), 0.9)
    out, ts = [], 0.0
    for _ in range(requests):
        ts += rng.expovariate(5.0)
        if rng.random() < 0.45:
            out.append(_request(ts, hot[next(pick)]))
        else:
            out.append(_request(ts, ids.new(rng.randint(8, 16))))  # one-hit: a batch/scan prompt
    return out


def shift(seed: int = 2, requests: int = 6000) -> list[dict]:
    rng = random.Random(seed)
    ids = _Ids()
    out, ts = [], 0.0
    for phase in range(2):
        system = ids.new(2)
        hot = [system + ids.new(rng.randint(4, 12)) for _ in range(400)]
        pick = _zipf_picker(rng, len(hot), 1.0)
        for _ in range(requests // 2):
            ts += rng.expovariate(5.0)
            if rng.random() < 0.8:
                out.append(_request(ts, hot[next(pick)]))
            else:
                out.append(_request(ts, ids.new(rng.randint(4, 10))))
    return out


def agentic(seed: int = 3, sessions: int = 40, in_flight: int = 32, tools_blocks: int = 0,
            turn: tuple[int, int] = (2, 8), active_out: list[list[list[int]]] | None = None) -> list[dict]:
    """Agent sessions: each turn re-sends the whole context plus ``turn`` new blocks; a turn may
    start a sub-agent whose context begins with its parent's. The session a request continues is
    drawn uniformly from the active ones; with ``active_out``, each request appends the contexts
    of every active session at the moment of the draw (what an online policy could know)."""
    rng = random.Random(seed)
    ids = _Ids()
    tools = ids.new(tools_blocks)
    active: list[dict] = []
    started = 0
    out, ts = [], 0.0

    def start(parent: list[int] | None) -> dict:
        base = list(parent) if parent is not None else list(tools)
        return {"ctx": base + ids.new(rng.randint(2, 6)), "left": rng.randint(4, 12) if parent else rng.randint(15, 45),
                "sub": parent is not None}

    while started < sessions or active:
        while started < sessions and sum(not a["sub"] for a in active) < in_flight:
            active.append(start(None))
            started += 1
        if active_out is not None:
            active_out.append([a["ctx"] for a in active])  # contexts are replaced, never mutated
        a = rng.choice(active)
        ts += rng.expovariate(4.0)
        out.append(_request(ts, a["ctx"]))
        a["ctx"] = a["ctx"] + ids.new(rng.randint(*turn))  # the reply and tool output join the context
        a["left"] -= 1
        if not a["sub"] and rng.random() < 0.12:
            active.append(start(a["ctx"]))
        if a["left"] <= 0:
            active.remove(a)
    return out


def tenants(seed: int = 4, requests: int = 7000) -> list[dict]:
    rng = random.Random(seed)
    ids = _Ids()
    chat_system = ids.new(3)
    chats: list[list[int]] = []
    docs = [ids.new(rng.randint(6, 20)) for _ in range(500)]
    rag_system = ids.new(2)
    pick = _zipf_picker(rng, len(docs), 0.8)
    out, ts = [], 0.0
    for _ in range(requests):
        ts += rng.expovariate(6.0)
        u = rng.random()
        if u < 0.4:  # chat: continue a conversation (or start one)
            if not chats or rng.random() < 0.15 or len(chats) < 20:
                chats.append(chat_system + ids.new(rng.randint(1, 4)))
            k = rng.randrange(len(chats))
            out.append(_request(ts, chats[k]))
            chats[k] = chats[k] + ids.new(rng.randint(1, 3))
            if len(chats[k]) > 60 or rng.random() < 0.03:
                chats.pop(k)
        elif u < 0.75:  # retrieval: system + a document + a fresh question
            out.append(_request(ts, rag_system + docs[next(pick)] + ids.new(1)))
        else:  # batch job: one-offs
            out.append(_request(ts, ids.new(rng.randint(6, 14))))
    return out


def agents_shared(seed: int = 5, active_out: list[list[list[int]]] | None = None) -> list[dict]:
    """More, shorter-stepped agent sessions behind one 16-block tool-definition prefix."""
    return agentic(seed, sessions=96, tools_blocks=16, turn=(1, 4), active_out=active_out)


def online_bound(active: list[list[list[int]]], requests: list[dict], capacities: list[int]) -> dict[int, float]:
    """An upper bound on the hit rate any online policy can expect on an agent workload, per
    capacity (in blocks).

    The session a request continues is drawn uniformly from the ``n`` active ones, independently
    of the past. So whatever a policy holds, a cache ``C`` earns in expectation
    ``(1/n) x sum over active sessions s of |prefix of s in C|`` <= ``(1/n) x sum of w(b) over b in C``,
    where ``w(b)`` is how many active sessions' contexts hold block ``b`` (a block already seen:
    nothing else can be cached). The best ``C`` of ``c`` blocks takes the ``c`` largest ``w``;
    ``w`` never grows with depth along a context, so that set is prefix-closed. The bound ignores
    that a cache can only change by storing what requests bring, so it is loose. The offline
    optimum (Belady) beats it by knowing which session is drawn next."""
    seen: set[int] = set()
    total = 0
    expected = dict.fromkeys(capacities, 0.0)
    for contexts, r in zip(active, requests):
        w: dict[int, int] = {}
        for ctx in contexts:
            for b in ctx:
                if b in seen:
                    w[b] = w.get(b, 0) + 1
        top = sorted(w.values(), reverse=True)
        n = len(contexts)
        for c in capacities:
            expected[c] += sum(top[:c]) / n
        total += len(r["hash_ids"])
        seen.update(r["hash_ids"])
    return {c: e / total for c, e in expected.items()}


#: The workloads whose generator can say what an online policy could know (``active_out``).
BOUNDED = ("agentic", "agents_shared")

WORKLOADS = {"scan": scan, "shift": shift, "agentic": agentic, "agents_shared": agents_shared, "tenants": tenants}
