"""What a benchmark ran on, printed with its figures: the CPU, its count, the memory and the 1-minute load
average at the run's start and end (absolute times move with that load; ratios from one run far less)."""
from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from provision.units import human_size  # noqa: E402


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class Machine:
    """Made at the start of a run; `figures()` at its end."""

    def __init__(self):
        self.load_start = os.getloadavg()[0]

    def figures(self) -> dict:
        return {"cpu": cpu_model(), "cpus": os.cpu_count(),
                "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                "load_average_1min": [round(self.load_start, 2), round(os.getloadavg()[0], 2)]}


def describe(fig: dict) -> str:
    start, end = fig["load_average_1min"]
    return (f"{fig['cpu']}, {fig['cpus']} CPUs, {human_size(fig['memory_bytes'])}; load average (1 min) {start:.2f} "
            f"at start, {end:.2f} at end")
