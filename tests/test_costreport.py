"""The cost report (kvcached.costreport, `kvcachectl report`): its arithmetic against hand-computed
figures, its refusals, and the command against a daemon."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from kvcached.costreport import CostInputError, Prices, Usage, cost_report, render
from kvcached_client import Client
from tests.service.conftest import LAYOUT

# One day measured: 72 M prompt tokens, 54 M of them hit (75 %), 36 000 requests of 2 000 tokens;
# stated: $2 per GPU-hour, 5 000 prefill tokens/s per GPU.
DAY = Usage(window_s=86_400, prompt_tokens=72_000_000, hit_tokens=54_000_000, lookups=40_000, requests=36_000)
PRICES = Prices(gpu_hour_price=2.0, prefill_tokens_per_s=5_000)


def kvcachectl(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    exe = os.path.join(os.path.dirname(sys.executable), "kvcachectl")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})


def test_a_day_at_75_percent_against_hand_computed_figures():
    r = cost_report(DAY, PRICES)
    # A 30-day month is 30 such days: 2.16 G tokens without the cache, 0.54 G with it.
    assert r.row("prefill tokens").without_cache == pytest.approx(2.16e9)
    assert r.row("prefill tokens").with_cache == pytest.approx(5.4e8)
    # 2.16e9 / 5000 tokens/s = 432 000 GPU-s = 120 GPU-hours; 0.54e9 -> 30.
    assert r.row("prefill GPU-hours").without_cache == pytest.approx(120)
    assert r.row("prefill GPU-hours").with_cache == pytest.approx(30)
    # 120 of the month's 720 hours: a sixth of a GPU on average; 30 / 720 with the cache.
    assert r.row("GPUs busy with prefill (average)").without_cache == pytest.approx(1 / 6)
    assert r.row("GPUs busy with prefill (average)").with_cache == pytest.approx(30 / 720)
    assert r.row("prefill cost").without_cache == pytest.approx(240)
    assert r.row("prefill cost").with_cache == pytest.approx(60)
    # 2 000 tokens a request: 0.4 GPU-s; its 500 uncached tokens: 0.1 GPU-s.
    assert r.row("prefill GPU-seconds per request").without_cache == pytest.approx(0.4)
    assert r.row("prefill GPU-seconds per request").with_cache == pytest.approx(0.1)
    assert all(row.saving == pytest.approx(0.75) for row in r.rows)
    d = r.to_dict()
    assert d["saved_per_month"] == {"gpu_hours": pytest.approx(90), "cost": pytest.approx(180)}
    assert d["measured"]["hit_rate"] == 0.75 and d["warnings"] == []


def test_a_short_window_is_extrapolated_and_says_so():
    ten_min = Usage(window_s=600, prompt_tokens=1_000_000, hit_tokens=250_000, lookups=500, requests=0)
    r = cost_report(ten_min, Prices(3.0, 10_000, month_days=31))
    # 31 days / 10 min = 4464 windows: 4.464 G tokens, 124 GPU-hours, $372 without; 25 % saved.
    assert r.row("prefill tokens").without_cache == pytest.approx(4.464e9)
    assert r.row("prefill GPU-hours").without_cache == pytest.approx(124)
    assert r.row("prefill cost").without_cache == pytest.approx(372)
    assert r.row("prefill cost").with_cache == pytest.approx(279)
    assert r.row("prefill cost").saving == pytest.approx(0.25)
    assert r.row("GPUs busy with prefill (average)").without_cache == pytest.approx(124 / (31 * 24))
    assert "prefill GPU-seconds per request" not in {row.item for row in r.rows}  # no acquires counted
    assert any("10 min only" in w for w in r.warnings)
    assert any("31 days" in a for a in r.assumptions)


def test_no_traffic_saves_nothing_and_says_why():
    r = cost_report(Usage(3600, 0, 0, 0, 0), PRICES)
    assert all(row.without_cache == row.with_cache == 0 and row.saving == 0 for row in r.rows)
    assert r.warnings == ("no lookups yet: nothing measured to extrapolate",)


def test_render_is_an_roi_sheet_with_its_assumptions():
    text = render(cost_report(DAY, PRICES))
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("cost item"))
    assert header.split()[-6:] == ["without", "cache", "with", "cache", "saving", "%"]
    cost = next(line for line in lines if line.startswith("prefill cost"))
    assert cost.split()[-3:] == ["$240.00", "$60.00", "75.0%"]
    assert "saved per month: 90.0 GPU-hours, $180.00" in text
    assert "prefill only: decode" in text and "a month is 30 days at the rate measured over the last 24.0 h" in text


@pytest.mark.parametrize("price, rate, days, match", [
    (-1.0, 5000, 30, "GPU price must be >= 0"),
    (2.0, 0, 30, "prefill throughput must be > 0"),
    (2.0, -5, 30, "prefill throughput must be > 0"),
    (math.nan, 5000, 30, "GPU price must be a finite number"),
    (2.0, math.inf, 30, "prefill throughput must be a finite number"),
    (2.0, 5000, 0, "month must be > 0 days"),
])
def test_bad_prices_are_refused(price, rate, days, match):
    with pytest.raises(CostInputError, match=match):
        Prices(price, rate, days)


def test_inconsistent_counters_are_refused():
    with pytest.raises(CostInputError, match="hit tokens exceed"):
        Usage(60, 10, 11, 1, 1)
    with pytest.raises(CostInputError, match="window must be > 0"):
        Usage(0, 10, 1, 1, 1)


# -- kvcachectl report -------------------------------------------------------------------------


@pytest.mark.parametrize("flags, match", [
    (["--gpu-hour-price", "-2", "--prefill-tokens-per-s", "5000"], "GPU price must be >= 0"),
    (["--gpu-hour-price", "2", "--prefill-tokens-per-s", "0"], "prefill throughput must be > 0"),
    (["--gpu-hour-price", "2"], "state --prefill-tokens-per-s (or report_prefill_tokens_per_s in the config file)"),
])
def test_bad_flags_get_a_clear_error_before_the_daemon_is_asked(tmp_path, flags, match):
    cfg = tmp_path / "empty.toml"
    cfg.write_text("")
    r = kvcachectl("--socket", str(tmp_path / "none.sock"), "report", "--config", str(cfg), *flags)
    assert r.returncode == 2 and match in r.stderr, r.stderr
    r = kvcachectl("--socket", str(tmp_path / "none.sock"), "report", "--config", str(cfg), "--json", *flags)
    assert r.returncode == 2 and match in json.loads(r.stdout)["error"]


def test_report_against_a_daemon_uses_its_counters(daemon, tmp_path):
    with Client(daemon.socket) as c:
        system = list(range(64))
        for user in range(4):  # each request: 64 shared tokens, then 32 of its own
            p = system + [1000 + 32 * user + k for k in range(32)]
            with c.acquire(LAYOUT, p):
                pass
            c.put(LAYOUT, p, torch.zeros(2, 2, 2, len(p), 8))
    cfg = tmp_path / "prices.toml"
    cfg.write_text("report_gpu_hour_price = 4.0\nreport_prefill_tokens_per_s = 8000\n")
    r = kvcachectl("--socket", daemon.socket, "report", "--config", str(cfg), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    # 4 acquires of 96 tokens (6 chunks): the first found nothing, the other 3 the 64 shared ones.
    assert {k: d["measured"][k] for k in ("prompt_tokens", "hit_tokens", "requests", "lookups")} == {
        "prompt_tokens": 384, "hit_tokens": 192, "requests": 4, "lookups": 4}
    assert d["prices"] == {"gpu_hour_price": 4.0, "prefill_tokens_per_s": 8000, "month_days": 30.0}
    window = d["measured"]["window_s"]
    assert 0 < window < 600
    cost = next(row for row in d["per_month"] if row["item"] == "prefill cost")
    assert cost["without_cache"] == pytest.approx(384 * 30 * 86_400 / window / 8000 / 3600 * 4.0)
    assert cost["saving"] == pytest.approx(0.5)
    assert any("only: the month is a long extrapolation" in w for w in d["warnings"])
    r = kvcachectl("--socket", daemon.socket, "report", "--config", str(cfg), "--gpu-hour-price", "1")
    assert r.returncode == 0 and "$1 per GPU-hour, 8000 prefill tokens/s" in r.stdout
    assert next(line for line in r.stdout.splitlines() if line.startswith("prefill cost")).endswith("50.0%")
