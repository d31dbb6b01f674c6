"""Numbers written the way an operator reads them, in the finding details, `check` and the status
page alike: memory in binary units (GiB), link bandwidth in decimal units (GB/s, as PCIe is quoted)."""
from __future__ import annotations

import math


def human_bytes(value: float) -> str:
    """Binary units, as memory sizes are quoted (GiB)."""
    if not math.isfinite(value):
        return "unlimited"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def human_rate(bytes_per_second: float) -> str:
    """Decimal units, as link bandwidth is quoted (Gen4 x16 = 31.5 GB/s)."""
    for unit, size in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if abs(bytes_per_second) >= size:
            return f"{bytes_per_second / size:.1f} {unit}"
    return f"{bytes_per_second:.0f} B/s"


def human_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "never"
    seconds = max(0.0, seconds)
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} d"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def percent(ratio: float) -> str:
    return f"{ratio * 100:.0f} %"
