"""``bench/acquire_latency.py`` fails loudly when a breakdown row's engine internal is renamed: the
row is listed with the reason in ``breakdown_skipped`` and the run exits 1 (the smoke test in
test_bench_smoke.py then fails on both), instead of the JSON quietly losing a figure."""

from __future__ import annotations

import json

from bench import acquire_latency


def run(tmp_path) -> tuple[int, dict]:
    rc = acquire_latency.main(["--quick", "--fill", "200", "--iterations", "4", "--rounds", "1", "--out", str(tmp_path)])
    with open(tmp_path / "acquire_latency.quick.json") as f:
        return rc, json.load(f)


class Renamed:
    """``obj`` as the bench sees it after a refactor renamed its attribute ``gone`` (the engine
    itself keeps working: only the breakdown's view of it changes)."""

    def __init__(self, obj: object, gone: str, inner: dict | None = None) -> None:
        self._obj, self._gone, self._inner = obj, gone, inner or {}

    def __getattr__(self, name: str) -> object:
        if name == self._gone:
            raise AttributeError(f"{type(self._obj).__name__!r} object has no attribute {name!r}")
        value = getattr(self._obj, name)
        return Renamed(value, *self._inner[name]) if name in self._inner else value


def test_a_renamed_internal_is_listed_and_fails_the_run(tmp_path, monkeypatch):
    pieces = acquire_latency.breakdown_pieces
    monkeypatch.setattr(acquire_latency, "breakdown_pieces",  # ReadPath.receipt renamed
                        lambda store, *a: pieces(Renamed(store, "", {"reads": ("receipt",)}), *a))
    monkeypatch.setattr(acquire_latency, "sglang_side", lambda *a: {"skipped": "not part of this test"})
    rc, d = run(tmp_path)
    assert rc == 1
    assert [s.split(":")[0] for s in d["breakdown_skipped"]] == ["lease receipt reads.receipt (64 chunks)"]
    assert "AttributeError" in d["breakdown_skipped"][0]


def test_with_the_internals_as_they_are_nothing_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(acquire_latency, "sglang_side", lambda *a: {"skipped": "not part of this test"})
    rc, d = run(tmp_path)
    assert rc == 0 and d["breakdown_skipped"] == []
    assert "lease receipt reads.receipt (64 chunks)" in d["breakdown_bytes_input"]
