"""Human units for what the daemon and ``kvcachectl`` print (binary multiples, as sizes are parsed)."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """``1073741824`` -> ``"1.0 GiB"``; ``512`` -> ``"512 B"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover
