"""The recording rules of the host-memory group: swap, major-fault and PSI rates, and the watched
processes' swap and major faults. The alerts that read them are agent/alerts/swap_thrash.py and
host_config.py.

Settings (sysctls, THP mode, swap size, memlock limits) are states and are read as they are now;
measurements are compared as 1 min averages and counters as 1 min rates, as in the agent.
"""
from __future__ import annotations




from hybridmon.exporters import host_memory, numa, pressure
from hybridmon.exporters import process as process_metrics
from hybridmon.rules.model import Recording
from hybridmon.rules.promql import rate_name

SWAP_IN = f"instance:{rate_name(host_memory.SWAP_IN_BYTES.name)}:rate1m"
SWAP_OUT = f"instance:{rate_name(host_memory.SWAP_OUT_BYTES.name)}:rate1m"
MAJOR_FAULTS = f"instance:{rate_name(host_memory.MAJOR_PAGE_FAULTS.name)}:rate1m"
# Swap traffic from the device and from zswap's compressed pool together: pswpin/pswpout do not
# count what zswap stores or serves (exporters/host_memory.py). On a kernel without zswap's
# counters, the device's alone (the `or ... * 0` term), never nothing.
SWAP_IN_WITH_ZSWAP = f"instance:{rate_name(host_memory.SWAP_IN_BYTES.name)}_with_zswap:rate1m"
SWAP_OUT_WITH_ZSWAP = f"instance:{rate_name(host_memory.SWAP_OUT_BYTES.name)}_with_zswap:rate1m"
STALLED = f"instance:{rate_name(pressure.STALLED_SECONDS.name)}:rate1m"
PROCESS_SWAP = f"process:{process_metrics.SWAP.name}:avg1m"
PROCESS_MAJOR_FAULTS = f"process:{rate_name(process_metrics.MAJOR_FAULTS.name)}:rate1m"
NUMA_NODES = f"count without (node) ({numa.NODE_MEMORY_TOTAL.name})"


def _with_zswap(device: str, zswap: str) -> str:
    return f"rate({device}[1m]) + (rate({zswap}[1m]) or rate({device}[1m]) * 0)"


def recordings() -> tuple[Recording, ...]:
    return (
        Recording(SWAP_IN, f"rate({host_memory.SWAP_IN_BYTES.name}[1m])"),
        Recording(SWAP_OUT, f"rate({host_memory.SWAP_OUT_BYTES.name}[1m])"),
        Recording(SWAP_IN_WITH_ZSWAP, _with_zswap(host_memory.SWAP_IN_BYTES.name, host_memory.ZSWAP_IN_BYTES.name)),
        Recording(SWAP_OUT_WITH_ZSWAP, _with_zswap(host_memory.SWAP_OUT_BYTES.name,
                                                   host_memory.ZSWAP_OUT_BYTES.name)),
        Recording(MAJOR_FAULTS, f"rate({host_memory.MAJOR_PAGE_FAULTS.name}[1m])"),
        Recording(STALLED, f"rate({pressure.STALLED_SECONDS.name}[1m])"),
        Recording(PROCESS_SWAP, f"avg_over_time({process_metrics.SWAP.name}[1m])"),
        Recording(PROCESS_MAJOR_FAULTS, f"rate({process_metrics.MAJOR_FAULTS.name}[1m])"),
    )


