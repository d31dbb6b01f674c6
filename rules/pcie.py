"""The recording rules of the PCIe and GPU-memory groups: link capacity (theoretical, measured,
effective), 1 min averages of traffic, utilization and memory, the replay rate and DCGM's bound,
the memory slope. The alerts that read them are in agent/alerts/ (pcie_*, gpu_*).

Gauges are compared as their 1 min average (avg_over_time), counters as 1 min rates, as in the
agent's detectors. Link generation and width are states, not measurements: they are read as they
are now, like the agent reads the latest sample.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the schema is built from the families, which import these rules
    from hybridmon.agent.alerts.catalogue import Thresholds


from hybridmon.exporters import bench as bench_metrics
from hybridmon.exporters import gpu as gpu_metrics
from hybridmon.rules.model import Recording
from hybridmon.pcie_rates import LANE_BYTES_PER_SECOND_TEXT, LANE_LINE_RATE_BITS_PER_SECOND_TEXT
from hybridmon.rules.promql import (by_generation,
                          SLOPE_NOTE, duration, rate_name, robust_slope)

CAPACITY_THEORETICAL = "gpu:hybridmon_gpu_pcie_link_capacity_bytes_per_second:theoretical"
MAX_CAPACITY = "gpu:hybridmon_gpu_pcie_link_max_capacity_bytes_per_second:theoretical"
# The capacity the starvation alert divides by, per direction: what `hybridmon bench` measured on
# this host where it has run, else the theoretical rate of the current link.
CAPACITY = "gpu:hybridmon_gpu_pcie_capacity_bytes_per_second:effective"
MEASURED_CAPACITY = bench_metrics.MEASURED_CAPACITY.name
THROUGHPUT = f"gpu:{gpu_metrics.PCIE_THROUGHPUT.name}:avg1m"
UTILIZATION = f"gpu:{gpu_metrics.UTILIZATION.name}:avg1m"
REPLAY_BOUND = "gpu:hybridmon_gpu_pcie_replays_per_minute:dcgm_bound"
MEMORY_USED = f"gpu:{gpu_metrics.MEMORY_USED.name}:avg1m"


def replay_rate_record(window_seconds: float) -> str:
    """The replay rate over the errors window (pcie_errors.window_seconds)."""
    return f"gpu:{rate_name(gpu_metrics.PCIE_REPLAYS.name)}:rate{duration(window_seconds)}"


def capacity_expr(generation: str, width: str) -> str:
    return (f"({width} > 0)\n*\n(\n"
            f"{by_generation(generation, LANE_BYTES_PER_SECOND_TEXT, '    ')}\n)")


def recordings(t: Thresholds) -> tuple[Recording, ...]:
    window = duration(t.pcie_errors.window_seconds)
    line_rates = by_generation(gpu_metrics.PCIE_LINK_GENERATION.name, LANE_LINE_RATE_BITS_PER_SECOND_TEXT,
                               " " * 8)
    bound = (f"ceil(\n    {t.pcie_errors.bit_error_rate!r} * 60 * {gpu_metrics.PCIE_LINK_WIDTH.name}\n"
             f"  *\n    (\n{line_rates}\n    )\n)")
    return (
        Recording(CAPACITY_THEORETICAL,
                  "# bytes/s per direction: per-lane rate of the current generation x current width\n"
                  + capacity_expr(gpu_metrics.PCIE_LINK_GENERATION.name, gpu_metrics.PCIE_LINK_WIDTH.name)),
        Recording(MAX_CAPACITY, capacity_expr(gpu_metrics.PCIE_LINK_MAX_GENERATION.name,
                                              gpu_metrics.PCIE_LINK_MAX_WIDTH.name)),
        Recording(CAPACITY,
                  "# bytes/s per direction: measured by `hybridmon bench`, else theoretical\n"
                  f"{MEASURED_CAPACITY}\n"
                  + "".join(f'or\nlabel_replace({CAPACITY_THEORETICAL}, "direction", "{direction}", "", "")\n'
                            for direction in ("host_to_device", "device_to_host")).rstrip("\n")),
        Recording(THROUGHPUT, f"avg_over_time({gpu_metrics.PCIE_THROUGHPUT.name}[1m])"),
        Recording(UTILIZATION, f"avg_over_time({gpu_metrics.UTILIZATION.name}[1m])"),
        Recording(replay_rate_record(t.pcie_errors.window_seconds), f"rate({gpu_metrics.PCIE_REPLAYS.name}[{window}])"),
        Recording(REPLAY_BOUND,
                  "# DCGM's PCIe health watch: ceil(bit error rate x line rate x 60 x lanes) per minute\n"
                  + bound),
    )


def memory_recordings(t: Thresholds) -> tuple[Recording, ...]:
    return (
        Recording(MEMORY_USED, f"avg_over_time({gpu_metrics.MEMORY_USED.name}[1m])"),
        Recording(memory_slope_record(t.gpu_memory_headroom.trend_window_seconds), SLOPE_NOTE + robust_slope(
            gpu_metrics.MEMORY_USED.name, t.gpu_memory_headroom.trend_window_seconds)),
    )


def memory_slope_record(window_seconds: float) -> str:
    """The used memory's slope over the trend window (gpu_memory_headroom.trend_window_seconds)."""
    return f"gpu:{gpu_metrics.MEMORY_USED.name}:slope{duration(window_seconds)}"


