"""SemanticCache with the real MiniLM embedder, guards and matcher: exact and paraphrased repeats
are served, every trap class is refused (by its guard, not only by a high threshold), nothing
crosses tenants, models or system prompts, the opt-outs, TTL and bounds hold, and the exact path
never waits for a match in progress."""

from __future__ import annotations

import threading
import time

import pytest

from kvcached_client.policy import CachePolicy
from kvcached_router.semantic.cache import EXACT, MISS, SEMANTIC, CacheLimits, CacheRequest, SemanticCache
from kvcached_router.semantic.calibrate import Calibration
from kvcached_router.semantic.embed import HashingEmbedder, MiniLMEmbedder
from kvcached_router.semantic.frontend import request_policy, tenant_of
from kvcached_router.semantic.matcher import SemanticMatcher
from kvcached_router.semantic.vectors import SearchConfig
from tests.conftest import FakeClock

#: Thresholds low enough that only the guards can refuse these traps.
PERMISSIVE = Calibration(thresholds={"same": 0.2, "edit": 0.2, "reworded": 0.2})

#: (guard, what the cache holds, the new question): each answer is wrong for the other question.
TRAPS = [
    ("negation", "Is the clinic open on Sundays?", "Is the clinic closed on Sundays?"),
    ("number", "Can I return an item after 30 days?", "Can I return an item after 60 days?"),
    ("date", "What time does the store open on Monday?", "What time does the store open on Friday?"),
    ("entity", "How do I move money from savings to checking?", "How do I move money from checking to savings?"),
    ("entity", "What is the capital of France?", "What is the capital of Germany?"),
    ("language", "如何关闭深色模式？", "如何打开深色模式？"),  # MiniLM scores these 1.000
    ("slot", "Rewrite in tone: formal", "Rewrite in tone: casual"),
    ("slot", 'Translate "good morning" into Spanish', 'Translate "good night" into Spanish'),
]


@pytest.fixture(scope="module")
def minilm() -> MiniLMEmbedder:
    return MiniLMEmbedder()


def make(embedder=None, calibration: Calibration | None = None, clock=time.monotonic, **limits) -> SemanticCache:
    search = SearchConfig(initial_capacity=4)  # small, so the tests also grow it
    factory = None if embedder is None else (lambda: SemanticMatcher(embedder, calibration, search=search))
    return SemanticCache(CacheLimits(**limits), embedder=embedder, matcher_factory=factory, clock=clock)


def ask(query: str, tenant: str = "t:a", model: str = "m", system: str = "You help.",
        context: str = "{}") -> CacheRequest:
    return CacheRequest(tenant, model, system, context, query)


class CountingEmbedder:
    """``inner`` with a count of the texts it embedded."""

    def __init__(self, inner) -> None:
        self.inner, self.embedded = inner, 0
        self.dim, self.name, self.scripts = inner.dim, inner.name, inner.scripts

    def encode(self, texts):
        self.embedded += len(texts)
        return self.inner.encode(texts)


def test_a_language_without_guards_is_served_by_the_exact_path_only(minilm):
    # with thresholds that would take anything, only the language rule stands between the two
    embedder = CountingEmbedder(minilm)
    cache = make(embedder, PERMISSIVE)
    entry = cache.store(ask("¿Cómo activo la cuenta?"), "Pulse «Activar».", 9)
    assert cache.lookup(ask("¿Cómo activo la cuenta?")).outcome == EXACT
    assert cache.lookup(ask("¿Cómo  activo la cuenta？")).outcome == EXACT  # normalised: spaces, full width
    missed = cache.lookup(ask("¿Cómo desactivo la cuenta?"))
    assert missed.outcome == MISS and missed.reason == "guard:language", missed
    # neither stored nor asked was embedded: it could never be accepted, so it takes no candidate place
    assert embedder.embedded == 0 and not cache.index_semantic(entry)
    cache.store(ask("How do I activate the account?"), "Press Activate.", 15)
    assert embedder.embedded == 1  # an English question is


def test_an_exact_repeat_hits_on_normalised_text_in_microseconds():
    cache = make()
    assert cache.lookup(ask("Where is my order 1234?")).outcome == MISS
    entry = cache.store(ask("Where is my order 1234?"), "It ships today.", 15)
    found = cache.lookup(ask("Where  is my order １２３４？"))  # full-width digits and ？ fold; spaces collapse
    assert (found.outcome, found.reason, found.value, found.entry_id) == (EXACT, "exact", "It ships today.", entry)
    assert cache.lookup(ask("Where is my order 1243?")).outcome == MISS  # digits are kept
    assert cache.lookup(ask("where is my order 1234?")).outcome == MISS  # and so is case
    assert cache.lookup(ask("Where is my parcel?")).reason == "exact_only"  # no embedder: no semantic path
    times = []
    for _ in range(2000):
        req = ask("Where is my order 1234?")  # a fresh request each time: the key is built in the measurement
        t0 = time.perf_counter()
        cache.lookup_exact(req)
        times.append(time.perf_counter() - t0)
    assert sorted(times)[len(times) // 2] < 200e-6  # a dict lookup (10 us unloaded; generous for a busy host)


def test_paraphrases_are_served_by_the_semantic_path(minilm):
    cache = make(minilm)
    a = cache.store(ask("How can I reset my password?"), "Settings > Security > Reset.", 40)
    b = cache.store(ask("Is the clinic open on Sundays?"), "Yes, 9 to 5.", 20)
    for query, entry in (("Can you tell me how to reset my password?", a), ("How do I reset my password, please?", a),
                         ("Does the clinic open on Sundays?", b)):
        found = cache.lookup(ask(query))
        assert (found.outcome, found.reason, found.entry_id) == (SEMANTIC, "hit", entry), (query, found)
        assert 0.9 < found.similarity < 1.0 and found.match_similarity == found.similarity
        assert found.vector is not None and found.vector.shape == (minilm.dim,)
    found = cache.lookup(ask("What are your opening hours?"))  # unrelated: the matcher says why not
    assert (found.outcome, found.reason) == (MISS, "below_threshold") and found.similarity < 0.8


@pytest.mark.parametrize("guard,stored,query", TRAPS, ids=[f"{t[0]}-{i}" for i, t in enumerate(TRAPS)])
def test_every_trap_class_is_refused_by_its_guard(minilm, guard, stored, query):
    for calibration in (None, PERMISSIVE):  # the default thresholds, and thresholds that let everything through
        cache = make(minilm, calibration)
        cache.store(ask(stored), "the stored answer", 20)
        found = cache.lookup(ask(query))
        assert found.outcome == MISS and found.value is None, (calibration, found)
        if calibration is PERMISSIVE:
            assert found.reason == f"guard:{guard}", found
        assert found.similarity is not None  # the lookup reached the matcher: the histogram sees it


def test_with_permissive_thresholds_a_typo_is_still_served(minilm):
    """The control for the trap test: at those thresholds a real paraphrase does get through."""
    cache = make(minilm, PERMISSIVE)
    entry = cache.store(ask("How can I reset my password?"), "answer", 6)
    found = cache.lookup(ask("how do i reset my pasword"))
    assert (found.outcome, found.entry_id) == (SEMANTIC, entry) and found.similarity < 0.85


def test_entries_never_cross_tenants_models_or_system_prompts(minilm):
    cache = make(minilm, PERMISSIVE)
    cache.store(ask("How can I reset my password?", tenant="t:a"), "tenant a's answer", 20)
    cache.store(ask("What is the refund policy?", tenant="t:b"), "tenant b's answer", 20)
    q = "How can I reset my password?"
    for other in (ask(q, tenant="t:b"), ask(q, tenant="t:c"), ask(q, model="m2"), ask(q, system="Be terse."),
                  ask(q, context='{"max_tokens":5}')):
        found = cache.lookup(other)
        assert found.outcome == MISS and found.value is None, (other, found)
    # tenant b's matcher holds only b's entry: b's paraphrase of a's question is compared with it alone
    found = cache.lookup(ask("How do I reset my password?", tenant="t:b"))
    assert found.outcome == MISS and found.similarity < 0.5
    assert cache.lookup(ask("How do I reset my password?", tenant="t:a")).value == "tenant a's answer"
    assert cache.scopes == 2


def test_no_cache_and_no_store():
    cache = make()
    cache.store(ask("q"), "v", 1)
    assert cache.lookup(ask("q"), CachePolicy(no_cache=True)).reason == "no_cache"
    assert cache.lookup(ask("q"), CachePolicy(no_store=True)).outcome == EXACT  # no-store still reads
    assert cache.store(ask("q2"), "v2", 2, policy=CachePolicy(no_store=True)) is None and len(cache) == 1
    assert cache.store(ask("q2"), "v2", 2, policy=CachePolicy(no_cache=True)) is not None and len(cache) == 2
    # the router's headers: Cache-Control and X-Cache-Control (the connector's), case-insensitive
    assert request_policy({"Cache-Control": "no-cache"}) == CachePolicy(no_cache=True)
    assert request_policy({"x-cache-control": "No-Store"}) == CachePolicy(no_store=True)
    assert request_policy({"Cache-Control": "max-age=0, no-store", "X-Cache-Control": "no-cache"}) == \
        CachePolicy(no_store=True, no_cache=True)
    assert request_policy({"Cache-Control": "max-age=60"}) == CachePolicy()


def test_tenants_come_from_the_header_or_the_api_key():
    assert tenant_of({"X-Tenant": "acme", "Authorization": "Bearer k"}, "X-Tenant") == "t:acme"
    k1 = tenant_of({"Authorization": "Bearer k1"}, "X-Tenant")
    assert k1 != tenant_of({"Authorization": "Bearer k2"}, "X-Tenant")
    assert "k1" not in tenant_of({"Authorization": "Bearer k1"}, "X-Tenant")  # a hash, not the key
    assert tenant_of({}, "X-Tenant") == ""
    assert tenant_of({"X-Tenant": "acme"}) == ""  # no tenant header configured: a client cannot choose one


def test_entries_expire_on_both_paths(minilm):
    clock = FakeClock()
    cache = make(minilm, clock=clock, ttl_s=60)
    cache.store(ask("Is the clinic open on Sundays?"), "Yes.", 4)
    clock.advance(59)
    assert cache.lookup(ask("Is the clinic open on Sundays?")).outcome == EXACT
    assert cache.lookup(ask("Does the clinic open on Sundays?")).outcome == SEMANTIC
    clock.advance(2)
    found = cache.lookup(ask("Does the clinic open on Sundays?"))
    assert (found.outcome, found.reason) == (MISS, "expired")  # the matcher still had it; the cache said no
    assert len(cache) == 0 and cache.bytes == 0
    assert cache.lookup(ask("Does the clinic open on Sundays?")).reason == "empty"  # and now it has left the matcher
    assert cache.scopes == 0 and cache.expirations == 1
    cache.store(ask("Is the clinic open on Sundays?"), "Yes.", 4)
    clock.advance(61)
    cache.store(ask("another question"), "x", 1)  # a store sweeps what expired
    assert len(cache) == 1 and cache.expirations == 2


def test_bounds_evict_the_least_recently_used_with_their_matcher_entries():
    embedder = HashingEmbedder()  # vectors without meaning are enough here: the queries are the stored texts
    cache = make(embedder, max_entries=3)
    texts = ["alpha question about billing", "bravo question about shipping", "charlie question about returns",
             "delta question about accounts"]
    ids = [cache.store(ask(t), t.split()[0], 10) for t in texts[:3]]
    assert cache.lookup(ask(texts[0])).outcome == EXACT  # alpha is now the most recently used
    ids.append(cache.store(ask(texts[3]), "delta", 10))
    assert len(cache) == 3 and cache.evictions == 1
    assert cache.lookup(ask(texts[1])).outcome == MISS  # bravo, the least recently used, went
    found = cache.lookup_semantic(ask(texts[1]))  # identical text: its vector would score 1.0 if still indexed
    assert found.entry_id != ids[1] and found.value != "bravo"
    cache.purge()
    assert sum(len(m) for m in cache._scopes.values()) == 3
    for t in (texts[0], texts[2], texts[3]):
        assert cache.lookup_semantic(ask(t)).outcome == SEMANTIC  # the survivors are still matched


def test_the_byte_bound_counts_values_queries_and_embeddings():
    embedder = HashingEmbedder(dim=64)
    cache = make(embedder, max_bytes=1000)
    for k in range(5):
        cache.store(ask(f"question number {k}"), "v", 300)
    per_entry = 300 + len("question number 0") + 4 * 64  # 573: one fits in 1000 bytes, two do not
    assert cache.bytes == per_entry and len(cache) == 1 and cache.evictions == 4
    assert cache.lookup(ask("question number 4")).outcome == EXACT
    assert cache.lookup(ask("question number 0")).outcome == MISS
    assert cache.store(ask("too big"), "v", 2000) is None  # an entry larger than the bound is not stored
    assert cache.lookup(ask("question number 4")).outcome == EXACT  # and evicted nothing


def test_the_exact_path_does_not_wait_for_a_match_in_progress():
    cache = make(HashingEmbedder())
    cache.store(ask("held question"), "v", 1)
    done = threading.Event()
    with cache._match_lock:  # a semantic lookup or index is running on the embedding thread
        def exact_work() -> None:
            cache.lookup_exact(ask("held question"))
            cache.store_exact(ask("new question"), "w", 1)
            done.set()

        t = threading.Thread(target=exact_work)
        t.start()
        assert done.wait(5), "the exact path blocked on the matcher lock"
    t.join()
    assert cache.lookup_exact(ask("new question")).outcome == EXACT
