"""A real SGLang server with kvcached as its HiCache storage: exact reuse, across engines, fail open.

Each server is SGLang's own (``sglang.launch_server``, CPU engine, the test-only shims of
``cpu_shims/``), with the backend loaded the way the docs say. "Exact" means the greedy tokens
of a prompt served from kvcached equal those of the cold run; ``cached_tokens_details.storage``
is SGLang's own count of prompt tokens it loaded from the storage tier.
"""

from __future__ import annotations

import time

import pytest

from bench.harness.daemon import Daemon
from tests.sglang.conftest import PAGE, metric, storage_tokens, wait_chunks

pytestmark = pytest.mark.slow  # real SGLang servers, a minute: run first (tests/conftest.py)

PROMPT = " ".join(f"w{(i * 37) % 1000 + 3}" for i in range(200))  # 200 tokens: 12 full pages
PAGES = 200 // PAGE


def test_engines_share_prompts_through_kvcached_and_serve_without_it(sglang_server, tmp_path):
    (tmp_path / "d").mkdir()
    daemon = Daemon(str(tmp_path / "d"), trust_client_keys=True, pool_bytes="16M")
    # Engine A starts with no daemon: requests are served, storage misses (fail open).
    a = sglang_server(daemon.socket, "a", retry_s=0.2)
    cold = a.generate(PROMPT)
    assert storage_tokens(cold) == 0 and cold["meta_info"]["prompt_tokens"] >= PAGES * PAGE
    warned = a.log_lines("kvcached sglang:")
    assert warned and all("failed (UNAVAILABLE" in w for w in warned), warned
    assert len(warned) <= 2, warned  # one per operation (exists, set), not one per call
    assert metric(a, "kvcached_client_fail_open_total", 'integration="sglang"') >= 1
    try:
        daemon.start()
        time.sleep(0.3)  # past retry_s: the next call tries the daemon again
        # A computes the prompt again (its own cache flushed) and now stores its pages.
        a.flush()
        again = a.generate(PROMPT)
        assert again["output_ids"] == cold["output_ids"]
        assert wait_chunks(daemon.socket, PAGES) == PAGES, a.tail()
        # Flushed again, A loads the whole prompt from kvcached: the same tokens.
        a.flush()
        hit = a.generate(PROMPT)
        assert storage_tokens(hit) == PAGES * PAGE, hit["meta_info"]
        assert hit["output_ids"] == cold["output_ids"]
        assert a.log_lines("works again")
        assert metric(a, "kvcached_sglang_pages_total", 'op="loaded"') == PAGES
        a.stop()
        # A fresh engine B, another process, serves the prompt from what A stored.
        b = sglang_server(daemon.socket, "b")
        fresh = b.generate(PROMPT)
        assert storage_tokens(fresh) == PAGES * PAGE, fresh["meta_info"]
        assert fresh["output_ids"] == cold["output_ids"]
        # and a prompt that shares only its first pages loads those and computes the rest
        b.flush()
        other = PROMPT.rsplit(" ", 100)[0] + " " + " ".join(["w5"] * 100)
        part = b.generate(other)
        assert 0 < storage_tokens(part) < PAGES * PAGE
        assert not b.log_lines("kvcached sglang:")  # no failure logged
    finally:
        if daemon.proc is not None:
            daemon.stop()
