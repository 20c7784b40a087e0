"""Human-readable quantities, one home for every message that shows a size."""
from __future__ import annotations


def human_size(n: float) -> str:
    """Bytes as B / KiB / MiB / GiB with one decimal above bytes."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def ago(stamp: str | None, now: float | None = None) -> str:
    """An ISO-8601 UTC time (as hosts record it) as its age: "42s ago", "5m ago", "3h ago", "2d ago"."""
    import calendar
    import time

    try:
        then = calendar.timegm(time.strptime(str(stamp), "%Y-%m-%dT%H:%M:%SZ"))
    except ValueError:
        return str(stamp)
    secs = max(0, int((time.time() if now is None else now) - then))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{secs // size}{unit} ago"
    return f"{secs}s ago"
