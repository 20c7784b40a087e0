"""Human-readable quantities, one home for every message that shows a size."""
from __future__ import annotations


def human_size(n: float) -> str:
    """Bytes as B / KiB / MiB / GiB with one decimal above bytes."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
