"""The recording rules of the PCIe and GPU-memory groups: link capacity (theoretical, measured,
effective; one direction and both together), 1 min averages of traffic, utilization and memory,
the replay rate and DCGM's bound, the memory slope; and for GPUs in NVLink-C2C mode (issue 29)
C2C's capacity per direction, traffic and its share, which GpuC2cStarvation reads. The alerts that read them are in
agent/alerts/ (pcie_*, gpu_*).

Gauges are compared as their 1 min average (avg_over_time), counters as 1 min rates, as in the
agent's detectors. Link generation and width are states, not measurements: they are read as they
are now, like the agent reads the latest sample, except where they size the traffic of the last
minute. There the best state over that same minute counts (max_over_time): the link drops to Gen1
within moments of going idle, and a minute's traffic average divided by the Gen1 rate right after
a burst would read as a link many times over full.
"""
from __future__ import annotations

from hybridmon.exporters import bench as bench_metrics
from hybridmon.exporters import gpu as gpu_metrics
from hybridmon.exporters import pcie_topology as topology
from hybridmon.rules.model import Recording, Thresholds
from hybridmon.pcie_rates import (C2C_ACHIEVABLE_SHARE_TEXT, LANE_ACHIEVABLE_TEXT, LANE_BIDIRECTIONAL_TEXT, LANE_BYTES_PER_SECOND_TEXT,
                                  LANE_LINE_RATE_BITS_PER_SECOND_TEXT)
from hybridmon.rules.promql import (by_generation,
                          SLOPE_NOTE, duration, rate_name, robust_slope)

CAPACITY_THEORETICAL = "gpu:hybridmon_gpu_pcie_link_capacity_bytes_per_second:theoretical"
MAX_CAPACITY = "gpu:hybridmon_gpu_pcie_link_max_capacity_bytes_per_second:theoretical"
# What the best link of the last minute carries in practice (theoretical x the copy engines'
# achievable share at its generation): one direction, and both directions together at once.
ACHIEVABLE = "gpu:hybridmon_gpu_pcie_link_achievable_bytes_per_second:best1m"
BIDIRECTIONAL_ACHIEVABLE = "gpu:hybridmon_gpu_pcie_link_bidirectional_achievable_bytes_per_second:best1m"
# The capacity the starvation and KV-offload alerts divide by, per direction: what `hybridmon bench`
# measured on this host where it has run, else ACHIEVABLE.
CAPACITY = "gpu:hybridmon_gpu_pcie_capacity_bytes_per_second:effective"
MEASURED_CAPACITY = bench_metrics.MEASURED_CAPACITY.name
# What the starvation alert divides both directions' sum by: the sum of what `hybridmon bench`
# measured each way while the other way copied too, where it measured both ways, else
# BIDIRECTIONAL_ACHIEVABLE.
BIDIRECTIONAL_CAPACITY = "gpu:hybridmon_gpu_pcie_bidirectional_capacity_bytes_per_second:effective"
MEASURED_BIDIRECTIONAL_CAPACITY = bench_metrics.MEASURED_BIDIRECTIONAL_CAPACITY.name
DIRECTIONS = ("host_to_device", "device_to_host")
# PCIe bytes/s per direction over the last minute: the cumulative counter's rate where NVML has it
# (exact), else the rate of the agent's sampled-bytes estimate (all its samples: 5/s by default),
# else the average of the throughput gauge (only the values Prometheus scraped: 4 a minute at 15 s).
TRAFFIC = "gpu:hybridmon_gpu_pcie_traffic_bytes_per_second:avg1m"
# Traffic over capacity per direction, and (direction="both") the sum of both directions over
# BIDIRECTIONAL_CAPACITY: a link full both ways at once shows neither direction near its own.
TRAFFIC_SHARE = "gpu:hybridmon_gpu_pcie_traffic_share_of_capacity:avg1m"
BOTH = "both"
UTILIZATION = f"gpu:{gpu_metrics.UTILIZATION.name}:avg1m"
# NVLink-C2C (GH200, GB200; issue 29): a GPU in C2C mode moves its host<->device copies over C2C,
# so GpuC2cStarvation judges them there, per direction, and GpuPcieStarvation leaves the GPU's
# near-idle PCIe link alone. The up links' maximum bandwidth NVML states, summed...
C2C_UP_LINKS = "gpu:hybridmon_gpu_c2c_up_links_max_bytes_per_second:sum"
# ...what `hybridmon bench` measured over C2C where it has, else that sum x the share copies achieve
# each way (pcie_rates.C2C_ACHIEVABLE_SHARE)...
C2C_CAPACITY = "gpu:hybridmon_gpu_c2c_capacity_bytes_per_second:effective"
MEASURED_C2C_CAPACITY = bench_metrics.C2C_MEASURED_CAPACITY.name
# ...the GPM C2C throughput's 1 min average, and its share of that capacity.
C2C_TRAFFIC = f"gpu:{gpu_metrics.C2C_THROUGHPUT.name}:avg1m"
C2C_TRAFFIC_SHARE = "gpu:hybridmon_gpu_c2c_traffic_share_of_capacity:avg1m"
C2C_ON = f"{gpu_metrics.C2C_MODE.name} == 1"
# The shared uplink of each GPU behind one (exporters/pcie_topology.py), named by the GPU's gpu and
# uuid labels (the uplink series name it by its PCI address): labels gpu, uuid, uplink.
GPU_UPLINK = f"gpu:{topology.UPLINK_INFO.name}:by_gpu"
# Per shared uplink and direction: the sum of TRAFFIC of the GPUs behind it (labels uplink, direction).
UPLINK_TRAFFIC = "uplink:hybridmon_gpu_pcie_traffic_bytes_per_second:sum_avg1m"
# Each GPU's part of its uplink's traffic, both directions together (labels gpu, uuid, uplink).
UPLINK_TRAFFIC_PART = "gpu:hybridmon_pcie_uplink_traffic_share:avg1m"
# What the uplink carries in practice at the best generation x width of the minute: one direction,
# and both together at once (pcie_rates, as for a GPU's own link; no benchmark measures an uplink).
UPLINK_ACHIEVABLE = "uplink:hybridmon_pcie_uplink_achievable_bytes_per_second:best1m"
UPLINK_BIDIRECTIONAL_ACHIEVABLE = "uplink:hybridmon_pcie_uplink_bidirectional_achievable_bytes_per_second:best1m"
# UPLINK_TRAFFIC over UPLINK_ACHIEVABLE per direction, and (direction="both") the sum of both
# directions over UPLINK_BIDIRECTIONAL_ACHIEVABLE.
UPLINK_TRAFFIC_SHARE = "uplink:hybridmon_pcie_uplink_traffic_share_of_capacity:avg1m"
REPLAY_BOUND = "gpu:hybridmon_gpu_pcie_replays_per_minute:dcgm_bound"
MEMORY_USED = f"gpu:{gpu_metrics.MEMORY_USED.name}:avg1m"


def replay_rate_record(window_seconds: float) -> str:
    """The replay rate over the errors window (pcie_errors.window_seconds)."""
    return f"gpu:{rate_name(gpu_metrics.PCIE_REPLAYS.name)}:rate{duration(window_seconds)}"


def capacity_expr(generation: str, width: str) -> str:
    return (f"({width} > 0)\n*\n(\n"
            f"{by_generation(generation, LANE_BYTES_PER_SECOND_TEXT, '    ')}\n)")


def best_link(table: dict[int, tuple[str, str]], generation: str = gpu_metrics.PCIE_LINK_GENERATION.name,
              width: str = gpu_metrics.PCIE_LINK_WIDTH.name) -> str:
    """`table`'s per-lane rate of the best generation x best width seen over the last minute
    (a GPU's own link; the uplink's series where they are given)."""
    best_generation = f"max_over_time({generation}[1m])"
    return (f"(max_over_time({width}[1m]) > 0)\n*\n(\n"
            f"{by_generation(best_generation, table, '    ')}\n)")


def uplink_recordings() -> tuple[Recording, ...]:
    """A shared uplink's traffic (its GPUs' TRAFFIC summed) against what it carries."""
    per_gpu = (f"{TRAFFIC}\n* ignoring (direction, uplink) group_left (uplink)\n{GPU_UPLINK}")
    return (
        Recording(GPU_UPLINK,
                  "# the uplink of each GPU behind a shared one, by the GPU's gpu and uuid labels\n"
                  f"max without (pci_bus_id, root_port) (\n  {topology.UPLINK_INFO.name}\n"
                  "  * ignoring (gpu, uuid, name, driver_version, uplink, root_port) group_left (gpu, uuid)\n"
                  f"  {gpu_metrics.GPU_INFO.name}\n)"),
        Recording(UPLINK_TRAFFIC,
                  "# bytes/s per direction through the uplink: the sum of its GPUs' traffic\n"
                  f"sum without (gpu, uuid) (\n{per_gpu}\n)"),
        Recording(UPLINK_TRAFFIC_PART,
                  "# each GPU's part of its uplink's traffic, both directions together\n"
                  f"sum without (direction) (\n{per_gpu}\n)\n/ ignoring (gpu, uuid) group_left\n"
                  f"sum without (direction) ({UPLINK_TRAFFIC})"),
        Recording(UPLINK_ACHIEVABLE,
                  "# bytes/s one direction of the uplink carries: best generation x width of the last\n"
                  "# minute, theoretical x the share copy engines achieve (hybridmon/pcie_rates.py)\n"
                  + best_link(LANE_ACHIEVABLE_TEXT, topology.UPLINK_GENERATION.name, topology.UPLINK_WIDTH.name)),
        Recording(UPLINK_BIDIRECTIONAL_ACHIEVABLE,
                  "# bytes/s both directions of the uplink carry together while both copy at once\n"
                  + best_link(LANE_BIDIRECTIONAL_TEXT, topology.UPLINK_GENERATION.name, topology.UPLINK_WIDTH.name)),
        Recording(UPLINK_TRAFFIC_SHARE,
                  f"# each direction against what the uplink carries that way...\n"
                  f"{UPLINK_TRAFFIC} / ignoring (direction) group_left {UPLINK_ACHIEVABLE}\n"
                  "# ...and both together against what it carries both ways at once\nor\n"
                  f'label_replace(\n  sum without (direction) ({UPLINK_TRAFFIC}) / {UPLINK_BIDIRECTIONAL_ACHIEVABLE},\n'
                  f'  "direction", "{BOTH}", "", ""\n)'),
    )


def capacity_recordings() -> tuple[Recording, ...]:
    measured = f'{MEASURED_CAPACITY}{{direction=~"{"|".join(DIRECTIONS)}"}}'
    # A run that failed one direction's bidirectional copy leaves half a sum: it counts only whole.
    measured_both_ways = f'{MEASURED_BIDIRECTIONAL_CAPACITY}{{direction=~"{"|".join(DIRECTIONS)}"}} > 0'
    return (
        Recording(ACHIEVABLE,
                  "# bytes/s one direction carries: best generation x width of the last minute,\n"
                  "# theoretical x the share copy engines achieve (hybridmon/pcie_rates.py)\n"
                  + best_link(LANE_ACHIEVABLE_TEXT)),
        Recording(BIDIRECTIONAL_ACHIEVABLE,
                  "# bytes/s both directions carry together while both copy at once\n"
                  + best_link(LANE_BIDIRECTIONAL_TEXT)),
        Recording(CAPACITY,
                  "# bytes/s per direction: measured by `hybridmon bench`, else achievable\n"
                  f"{measured}\n"
                  + "".join(f'or\nlabel_replace({ACHIEVABLE}, "direction", "{direction}", "", "")\n'
                            for direction in DIRECTIONS).rstrip("\n")),
        Recording(BIDIRECTIONAL_CAPACITY,
                  "# bytes/s both directions together: measured each way while both copied, summed,\n"
                  "# where `hybridmon bench` measured both ways; else the bidirectional share's figure\n"
                  f"sum without (direction) ({measured_both_ways})\nand\n"
                  f"count without (direction) ({measured_both_ways}) == {len(DIRECTIONS)}\nor\n"
                  f"{BIDIRECTIONAL_ACHIEVABLE}"),
        Recording(TRAFFIC,
                  "# exact where NVML counts PCIe bytes; else the agent's estimate from all its samples\n"
                  "# (~10 a second); else the average of the throughput gauge as scraped\n"
                  f"rate({gpu_metrics.PCIE_BYTES.name}[1m])\nor\n"
                  f"rate({gpu_metrics.PCIE_SAMPLED_BYTES.name}[1m])\nor\n"
                  f"avg_over_time({gpu_metrics.PCIE_THROUGHPUT.name}[1m])"),
        Recording(TRAFFIC_SHARE,
                  f"# each direction against its own capacity...\n{TRAFFIC} / {CAPACITY}\n"
                  "# ...and both together against what the link carries both ways at once\nor\n"
                  f'label_replace(\n  sum without (direction) ({TRAFFIC}) / {BIDIRECTIONAL_CAPACITY},\n'
                  f'  "direction", "{BOTH}", "", ""\n)'),
    )


def c2c_recordings() -> tuple[Recording, ...]:
    measured = f'{MEASURED_C2C_CAPACITY}{{direction=~"{"|".join(DIRECTIONS)}"}}'
    achievable = "".join(
        f'or\nlabel_replace({C2C_UP_LINKS} * {C2C_ACHIEVABLE_SHARE_TEXT[direction][0]}, "direction", '
        f'"{direction}", "", "")\n' for direction in DIRECTIONS).rstrip("\n")
    return (
        Recording(C2C_UP_LINKS,
                  "# bytes/s NVML states for the GPU's NVLink-C2C links that are up, summed\n"
                  f"sum without (link) (\n  {gpu_metrics.C2C_LINK_MAX_BANDWIDTH.name}\n  and\n"
                  f"  {gpu_metrics.C2C_LINK_UP.name} == 1\n)"),
        Recording(C2C_CAPACITY,
                  "# bytes/s per direction: measured over C2C by `hybridmon bench`, else the up links'\n"
                  "# maximum x the share copies achieve that way (hybridmon/pcie_rates.py)\n"
                  f"{measured}\n{achievable}"),
        Recording(C2C_TRAFFIC, f"avg_over_time({gpu_metrics.C2C_THROUGHPUT.name}[1m])"),
        Recording(C2C_TRAFFIC_SHARE, f"{C2C_TRAFFIC} / {C2C_CAPACITY}"),
    )


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
        *capacity_recordings(),
        *c2c_recordings(),
        *uplink_recordings(),
        Recording(UTILIZATION, f"avg_over_time({gpu_metrics.UTILIZATION.name}[1m])"),
        Recording(replay_rate_record(t.pcie_errors.window_seconds), f"rate({gpu_metrics.PCIE_REPLAYS.name}[{window}])"),
        Recording(REPLAY_BOUND,
                  "# DCGM's PCIe health watch: ceil(bit error rate x line rate x 60 x lanes) per minute\n"
                  + bound),
    )


def memory_recordings(t: Thresholds) -> tuple[Recording, ...]:
    window = t.gpu_memory_headroom.trend_window_seconds
    return (
        Recording(MEMORY_USED, f"avg_over_time({gpu_metrics.MEMORY_USED.name}[1m])"),
        Recording(memory_slope_record(window), SLOPE_NOTE + robust_slope(gpu_metrics.MEMORY_USED.name, window)),
        Recording(memory_recent_slope_record(window),
                  "# bytes/s: least-squares slope over the newest of the trend window's local slopes\n"
                  f"deriv({gpu_metrics.MEMORY_USED.name}[{duration(local_slope_seconds(window))}])"),
    )


def local_slope_seconds(window_seconds: float) -> float:
    """The span of each local slope robust_slope takes the median of: a sixth of the window."""
    return window_seconds / 6


def memory_slope_record(window_seconds: float) -> str:
    """The used memory's slope over the trend window (gpu_memory_headroom.trend_window_seconds)."""
    return f"gpu:{gpu_metrics.MEMORY_USED.name}:slope{duration(window_seconds)}"


def memory_recent_slope_record(window_seconds: float) -> str:
    """The used memory's slope over the trend window's last sixth: growth that goes on now."""
    return f"gpu:{gpu_metrics.MEMORY_USED.name}:deriv{duration(local_slope_seconds(window_seconds))}"


