"""What the cache saves in prefill GPU time and money: the arithmetic of ``kvcachectl report``.

Pure functions over two frozen inputs: :class:`Usage` (the daemon's counters over a measured
window) and :class:`Prices` (what the operator states: GPU price, prefill throughput). Nothing
here talks to a daemon; the CLI fetches the counters and prints :func:`render`.

The model, stated in every report (:data:`ASSUMPTIONS`):

- tokens per month = tokens in the window x (month / window): the measured rate, extrapolated;
- without the cache every looked-up token is prefilled; with it, only the tokens not hit;
- GPU-hours = tokens / (prefill tokens/s per GPU) / 3600; cost = GPU-hours x $/GPU-hour;
- average GPUs busy with prefill = GPU-hours / hours in the month.

Every row is linear in prefill tokens, so every row saves the same share: the token hit rate.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

HOUR = 3600.0
DAY = 24 * HOUR
#: A window shorter than this makes the monthly figures a long extrapolation: the report says so.
SHORT_WINDOW_S = HOUR


class CostInputError(ValueError):
    """A stated price or throughput, or a counter, cannot be used; the message names it."""


def _finite(name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise CostInputError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Prices:
    """What the operator states. ``gpu_hour_price`` in currency units (USD) per GPU-hour;
    ``prefill_tokens_per_s`` the prefill throughput of one GPU; ``month_days`` the month."""

    gpu_hour_price: float
    prefill_tokens_per_s: float
    month_days: float = 30.0

    def __post_init__(self) -> None:
        if _finite("the GPU price", self.gpu_hour_price) < 0:
            raise CostInputError(f"the GPU price must be >= 0 $/GPU-hour, got {self.gpu_hour_price}")
        if _finite("the prefill throughput", self.prefill_tokens_per_s) <= 0:
            raise CostInputError("the prefill throughput must be > 0 tokens/s per GPU, "
                                 f"got {self.prefill_tokens_per_s}")
        if _finite("the month", self.month_days) <= 0:
            raise CostInputError(f"the month must be > 0 days, got {self.month_days}")


@dataclass(frozen=True)
class Usage:
    """The daemon's counters over ``window_s`` seconds (its uptime: they start at 0 with it)."""

    window_s: float
    prompt_tokens: int  # tokens of whole chunks looked up (Lookup and Acquire)
    hit_tokens: int  # ...of which were cached
    lookups: int
    requests: int  # acquires: one per request of the vLLM and transformers integrations

    def __post_init__(self) -> None:
        if _finite("the measured window", self.window_s) <= 0:
            raise CostInputError(f"the measured window must be > 0 s, got {self.window_s}")
        for name in ("prompt_tokens", "hit_tokens", "lookups", "requests"):
            if getattr(self, name) < 0:
                raise CostInputError(f"counter {name} is negative ({getattr(self, name)})")
        if self.hit_tokens > self.prompt_tokens:
            raise CostInputError(f"{self.hit_tokens} hit tokens exceed {self.prompt_tokens} looked-up tokens")

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any]) -> "Usage":
        """From a Stats RPC answer (``Client.stats()``): counters over the daemon's uptime."""
        c = stats["counters"]
        return cls(float(stats["uptime_seconds"]), int(c["lookup_tokens"]), int(c["hit_tokens"]),
                   int(c["lookups"]), int(c["acquires"]))

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class CostRow:
    """One line of the ROI table: a cost item per month without and with the cache."""

    item: str
    unit: str
    without_cache: float
    with_cache: float

    @property
    def saving(self) -> float:
        """The share saved (0..1); 0 when there is nothing to save."""
        return 1 - self.with_cache / self.without_cache if self.without_cache else 0.0


@dataclass(frozen=True)
class CostReport:
    usage: Usage
    prices: Prices
    rows: tuple[CostRow, ...]
    assumptions: tuple[str, ...]
    warnings: tuple[str, ...]

    def row(self, item: str) -> CostRow:
        return next(r for r in self.rows if r.item == item)

    def to_dict(self) -> dict[str, Any]:
        return {
            "measured": {**asdict(self.usage), "hit_rate": self.usage.hit_rate},
            "prices": asdict(self.prices),
            "per_month": [{**asdict(r), "saving": r.saving} for r in self.rows],
            "saved_per_month": {"gpu_hours": saved(self, "prefill GPU-hours"), "cost": saved(self, "prefill cost")},
            "assumptions": list(self.assumptions),
            "warnings": list(self.warnings),
        }


def month_factor(usage: Usage, prices: Prices) -> float:
    """How many measured windows make a month."""
    return prices.month_days * DAY / usage.window_s


def gpu_hours(tokens: float, prices: Prices) -> float:
    """GPU-hours one GPU at the stated throughput takes to prefill ``tokens``."""
    return tokens / prices.prefill_tokens_per_s / HOUR


def saved(report: CostReport, item: str) -> float:
    r = report.row(item)
    return r.without_cache - r.with_cache


def cost_report(usage: Usage, prices: Prices) -> CostReport:
    """The monthly ROI table at the measured rate."""
    k = month_factor(usage, prices)
    full, rest = usage.prompt_tokens * k, (usage.prompt_tokens - usage.hit_tokens) * k
    hours_full, hours_rest = gpu_hours(full, prices), gpu_hours(rest, prices)
    month_hours = prices.month_days * 24
    rows = [
        CostRow("prefill tokens", "tokens", full, rest),
        CostRow("prefill GPU-hours", "GPU-hours", hours_full, hours_rest),
        CostRow("GPUs busy with prefill (average)", "GPUs", hours_full / month_hours, hours_rest / month_hours),
        CostRow("prefill cost", "$", hours_full * prices.gpu_hour_price, hours_rest * prices.gpu_hour_price),
    ]
    if usage.requests:
        per = usage.requests
        rows.append(CostRow("prefill GPU-seconds per request", "GPU-s",
                            usage.prompt_tokens / per / prices.prefill_tokens_per_s,
                            (usage.prompt_tokens - usage.hit_tokens) / per / prices.prefill_tokens_per_s))
    return CostReport(usage, prices, tuple(rows), assumptions(usage, prices), _warnings(usage))


def assumptions(usage: Usage, prices: Prices) -> tuple[str, ...]:
    return (
        "prefill only: decode, sampling and the network cost the same with and without the cache",
        f"a month is {prices.month_days:g} days at the rate measured over the last {_duration(usage.window_s)} "
        "(the daemon's uptime: its counters start with it)",
        f"prefill runs at a flat {prices.prefill_tokens_per_s:g} tokens/s per GPU whatever the prompt length; "
        "loading cached KV is not charged",
        "tokens count in whole chunks: a prompt's partial last chunk is never cached and is left out",
        "each Lookup and Acquire is counted as one prefill: a client that calls Lookup before the Acquire of "
        "the same prompt doubles the volumes (not the saving %)",
    )


def _warnings(usage: Usage) -> tuple[str, ...]:
    out = []
    if not usage.prompt_tokens:
        out.append("no lookups yet: nothing measured to extrapolate")
    if usage.window_s < SHORT_WINDOW_S:
        out.append(f"measured over {_duration(usage.window_s)} only: the month is a long extrapolation of it")
    return tuple(out)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * HOUR:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * DAY:
        return f"{seconds / HOUR:.1f} h"
    return f"{seconds / DAY:.1f} days"


def _amounts(row: CostRow) -> tuple[str, str]:
    """Both amounts of a row, with the same number of decimals."""
    if row.unit == "$":
        fmt = "${:,.2f}"
    elif row.unit == "tokens":
        fmt = "{:,.0f}"
    else:
        fmt = "{:,.3f}" if max(row.without_cache, row.with_cache) < 100 else "{:,.1f}"
    return fmt.format(row.without_cache), fmt.format(row.with_cache)


def render(report: CostReport) -> str:
    """The report as an operator's ROI sheet: measured figures, the table, assumptions."""
    u, p = report.usage, report.prices
    lines = [
        f"measured over {_duration(u.window_s)}: {u.requests:,} requests, {u.lookups:,} lookups, "
        f"{u.prompt_tokens:,} prompt tokens, {u.hit_tokens:,} hit ({u.hit_rate:.1%})",
        f"stated: ${p.gpu_hour_price:g} per GPU-hour, {p.prefill_tokens_per_s:g} prefill tokens/s per GPU",
        "",
    ]
    header = (f"cost item (per {p.month_days:g}-day month)", "without cache", "with cache", "saving %")
    table = [header] + [(r.item, *_amounts(r), f"{r.saving:.1%}") for r in report.rows]
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    for n, row in enumerate(table):
        lines.append(f"{row[0]:<{widths[0]}}  " + "  ".join(f"{c:>{w}}" for c, w in zip(row[1:], widths[1:])))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += ["", f"saved per month: {saved(report, 'prefill GPU-hours'):,.1f} GPU-hours, "
                  f"${saved(report, 'prefill cost'):,.2f}", "", "assumptions:"]
    lines += [f"  - {a}" for a in report.assumptions]
    lines += [f"warning: {w}" for w in report.warnings]
    return "\n".join(lines)
