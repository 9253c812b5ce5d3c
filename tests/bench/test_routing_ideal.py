"""The routing bench's ideal (bench/routing/run.py ``ideal_windows``): what one host with an
unbounded cache could have served of the requests the users sent, given when each was served.

A chunk exists once the request that computes it has prefilled, so a request sent earlier but
still prefilling when another is served must not count toward the other's ideal; counting it
made the bounded Locust run's realised/ideal ratio move with how loaded the box was.
"""

from __future__ import annotations

from bench.routing.run import ideal_windows

# trace request -> chained chunk hashes (16 tokens each): 0 and 1 share two chunks, 2 shares one with 0
CHUNKS = {0: [1, 2, 3], 1: [1, 2, 9], 2: [1, 7], 3: [4, 5]}


def row(t: float, ttft_ms: float, idx: int, cached: int, ok: bool = True) -> dict:
    prompt = 16 * len(CHUNKS[idx])
    return {"t": t, "ttft_ms": ttft_ms, "ok": ok, "prompt_tokens": prompt, "cached_tokens": cached, "trace_index": idx}


def ideal(rows: list[dict]) -> list[dict]:
    # prewarm 0: the users' trace indices are the trace's; windows of 10 s, no warmup; a last
    # request in a later window closes the windows under test (the last window is left out)
    rows = rows + [row(95.0, 1.0, 3, 0)]
    return ideal_windows(rows, 0, 0.0, 10.0, 0.0, chunks_of=CHUNKS.__getitem__)["windows"]


def test_a_request_still_prefilling_when_another_is_served_counts_for_nothing():
    # request 0 is sent first (window 0) but its prefill ends (t + ttft) after request 1's
    # (window 1): 1 could not have been served 0's chunks, so its ideal is 0; 0, done later,
    # could have been served 1's (the ideal is the most any cache could do)
    ws = ideal([row(9.0, 5000.0, 0, 0), row(11.0, 100.0, 1, 0)])
    assert ws[1]["ideal_hit_rate"] == 0.0
    assert ws[0]["ideal_hit_rate"] == 32 / 48
    # served in the order they were sent, 1 could have had 0's two shared chunks
    ws = ideal([row(9.0, 100.0, 0, 0), row(11.0, 100.0, 1, 0)])
    assert ws[0]["ideal_hit_rate"] == 0.0 and ws[1]["ideal_hit_rate"] == 32 / 48


def test_a_request_served_after_the_first_prefilled_counts_its_shared_prefix():
    w = ideal([row(1.0, 100.0, 0, 0), row(2.0, 100.0, 1, 32)])[0]
    assert w["ideal_hit_rate"] == 32 / 96
    assert w["hit_over_ideal"] == 1.0
    # a routing that missed it realises less than the ideal
    w = ideal([row(1.0, 100.0, 0, 0), row(2.0, 100.0, 1, 0)])[0]
    assert w["hit_over_ideal"] == 0.0


def test_a_failed_request_stores_nothing():
    w = ideal([row(1.0, 100.0, 0, 0, ok=False), row(2.0, 100.0, 2, 0)])[0]
    assert w["ideal_hit_rate"] == 0.0  # only the failed request held chunk 1
    w = ideal([row(1.0, 100.0, 0, 0), row(2.0, 100.0, 2, 16)])[0]
    assert w["ideal_hit_rate"] == 16 / 80


def test_windows_are_by_send_time():
    ws = ideal([row(1.0, 100.0, 0, 0), row(12.0, 100.0, 1, 32)])
    assert [w["t"] for w in ws[:2]] == [10.0, 20.0]
    assert ws[0]["ideal_hit_rate"] == 0.0 and ws[1]["ideal_hit_rate"] == 32 / 48


def test_requests_the_load_bound_moved_are_told_apart():
    rows = [row(1.0, 100.0, 0, 0), dict(row(2.0, 100.0, 1, 0), route="load"), dict(row(3.0, 100.0, 2, 16), route="cache")]
    w = ideal(rows)[0]
    assert w["hit_over_ideal"] == 16 / 48  # 1 was moved off 0's host and missed its 2 chunks
    assert w["hit_over_ideal_not_load_moved"] == 1.0  # what was routed for the cache got all of it
    assert abs(w["load_moved_ideal_share"] - 2 / 3) < 1e-9
