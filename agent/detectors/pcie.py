"""PCIe link capacity and the two link detectors: starvation (the link is full while the GPU
waits) and degradation (the link runs below its maximum while the GPU is busy).

Both read NVML's view of the link (hybridmon_gpu_pcie_*), which carries the GPU's gpu and uuid.
"""
from __future__ import annotations

import math
from hybridmon.agent.detectors import common, windows
from hybridmon.agent.detectors.base import Finding, PcieLinkDegraded, PcieStarvation
from hybridmon.agent.history import History
from hybridmon.pcie_rates import LANE_LINE_RATE_BITS_PER_SECOND, link_name, theoretical_capacity  # noqa: F401

THROUGHPUT = "hybridmon_gpu_pcie_throughput_bytes_per_second"
UTILIZATION = "hybridmon_gpu_utilization_ratio"
GENERATION = "hybridmon_gpu_pcie_link_generation"
MAX_GENERATION = "hybridmon_gpu_pcie_link_max_generation"
WIDTH = "hybridmon_gpu_pcie_link_width_lanes"
MAX_WIDTH = "hybridmon_gpu_pcie_link_max_width_lanes"
# Per direction, from the latest `hybridmon bench` run (exporters/bench.py).
MEASURED_CAPACITY = "hybridmon_gpu_pcie_measured_capacity_bytes_per_second"


class PcieStarvationDetector:
    """GpuPcieStarvation: in the direction nearest its capacity, traffic (avg 1m) at or above
    traffic_share_of_capacity x capacity while GPU utilization (avg 1m) is at or below
    gpu_utilization_at_most. Capacity is what `hybridmon bench` measured for that direction
    (hybridmon_gpu_pcie_measured_capacity_bytes_per_second) when there is a measurement, else the
    theoretical rate of the current generation x current width."""

    name = "pcie_starvation"
    alertnames = ("GpuPcieStarvation",)
    min_history_seconds = windows.AVERAGE_SECONDS

    def __init__(self, config: PcieStarvation) -> None:
        self.config = config

    @staticmethod
    def link_capacity(measured: float | None, generation: float | None,
                      lanes: float | None) -> tuple[float, str] | None:
        """(bytes/s, where it comes from) for one direction of one GPU."""
        if measured is not None and measured > 0:
            return measured, "measured"
        if generation is None or lanes is None:
            return None
        theoretical = theoretical_capacity(generation, lanes)
        return (theoretical, "theoretical") if theoretical else None

    def evaluate(self, history: History, now: float) -> list[Finding]:
        utilization = common.gpu_averages(history, UTILIZATION, now)
        generation = common.gpu_latest(history, GENERATION, now)
        width = common.gpu_latest(history, WIDTH, now)
        traffic = common.gpu_directions(history, THROUGHPUT, now, windows.avg_over_time)
        measured = common.gpu_directions(history, MEASURED_CAPACITY, now)
        findings = []
        for key, directions in sorted(traffic.items()):
            busy = utilization.get(key)
            shares = {}
            for direction, value in directions.items():
                capacity = self.link_capacity(measured.get(key, {}).get(direction),
                                              generation.get(key), width.get(key))
                if capacity is not None:
                    shares[direction] = (value / capacity[0], value, capacity)
            if busy is None or not shares:
                continue
            direction, (share, peak, (bytes_per_second, source)) = max(
                shares.items(), key=lambda item: item[1][0])
            if share < self.config.traffic_share_of_capacity or busy > self.config.gpu_utilization_at_most:
                continue
            threshold = self.config.traffic_share_of_capacity * bytes_per_second
            findings.append(self._finding(key, direction, peak, threshold, bytes_per_second,
                                          source, busy, directions, generation.get(key),
                                          width.get(key)))
        return findings

    def _finding(self, key, direction, peak, threshold, capacity, source, busy, directions,
                 generation, lanes) -> Finding:
        gpu = key[0]
        link = link_name(generation, lanes) if generation and lanes else "link"
        share = peak / capacity
        details: dict[str, float | str] = {
            "direction": direction,
            "traffic_bytes_per_second": peak,
            "threshold_bytes_per_second": threshold,
            "capacity_bytes_per_second": capacity,
            "capacity_source": source,
            "gpu_utilization_ratio": busy,
        }
        for name, value in directions.items():
            details[f"{name}_bytes_per_second"] = value
        if generation is not None and lanes is not None:
            details["link_generation"] = generation
            details["link_width_lanes"] = lanes
        return Finding(
            alertname="GpuPcieStarvation",
            severity="warning",
            labels=common.gpu_entity(key),
            value=share,
            threshold=self.config.traffic_share_of_capacity,
            unit="ratio",
            for_seconds=self.config.for_seconds,
            summary=(f"GPU {gpu} PCIe link saturated ({direction.replace('_', ' ')} "
                     f"{common.human_rate(peak)}, {common.percent(share)} of {source} "
                     f"{link} capacity) while the GPU is only {common.percent(busy)} busy"),
            description=(
                f"GPU {gpu} ({key[1]}) moves {common.human_rate(peak)} {direction.replace('_', ' ')} "
                f"over PCIe, averaged over the last minute: at or above the threshold of "
                f"{common.human_rate(threshold)} ({common.percent(self.config.traffic_share_of_capacity)} "
                f"of the {source} {link} capacity of {common.human_rate(capacity)}), while its "
                f"utilization is {common.percent(busy)} (at most "
                f"{common.percent(self.config.gpu_utilization_at_most)}). The GPU is waiting on "
                f"host<->device transfers (offloaded KV cache or weights), so tokens/s falls and "
                f"long contexts stall. First: check what is being offloaded and reduce it (keep the "
                f"hot KV blocks in VRAM, smaller offload pages), and keep the server's cores and "
                f"memory on the GPU's NUMA node."),
            details=details,
        )


class PcieLinkDegradedDetector:
    """GpuPcieLinkDegraded: current generation < max generation or current width < max width
    (current values, not averages: a link state), while utilization (avg 1m) is at least
    busy_utilization_at_least. Idle GPUs are never judged: links drop speed at idle by design."""

    name = "pcie_link_degraded"
    alertnames = ("GpuPcieLinkDegraded",)
    min_history_seconds = windows.AVERAGE_SECONDS

    def __init__(self, config: PcieLinkDegraded) -> None:
        self.config = config

    def evaluate(self, history: History, now: float) -> list[Finding]:
        utilization = common.gpu_averages(history, UTILIZATION, now)
        generation = common.gpu_latest(history, GENERATION, now)
        max_generation = common.gpu_latest(history, MAX_GENERATION, now)
        width = common.gpu_latest(history, WIDTH, now)
        max_width = common.gpu_latest(history, MAX_WIDTH, now)
        findings = []
        for key, busy in sorted(utilization.items()):
            link = (generation.get(key), width.get(key), max_generation.get(key), max_width.get(key))
            if any(value is None for value in link) or busy < self.config.busy_utilization_at_least:
                continue
            gen, lanes, best_gen, best_lanes = link
            if gen >= best_gen and lanes >= best_lanes:
                continue
            findings.append(self._finding(key, busy, gen, lanes, best_gen, best_lanes))
        return findings

    def _finding(self, key, busy, gen, lanes, best_gen, best_lanes) -> Finding:
        current = theoretical_capacity(gen, lanes) or math.nan
        best = theoretical_capacity(best_gen, best_lanes) or math.nan
        what = []
        if gen < best_gen:
            what.append(f"generation {int(gen)} of {int(best_gen)}")
        if lanes < best_lanes:
            what.append(f"{int(lanes)} of {int(best_lanes)} lanes")
        return Finding(
            alertname="GpuPcieLinkDegraded",
            severity="warning",
            labels=common.gpu_entity(key),
            value=current / best,
            threshold=1.0,
            unit="ratio",
            for_seconds=self.config.for_seconds,
            summary=(f"GPU {key[0]} PCIe link runs at {link_name(gen, lanes)} instead of "
                     f"{link_name(best_gen, best_lanes)} while {common.percent(busy)} busy"),
            description=(
                f"GPU {key[0]} ({key[1]}) is {common.percent(busy)} busy (judged from "
                f"{common.percent(self.config.busy_utilization_at_least)}, averaged over the last "
                f"minute) but its PCIe link runs at {link_name(gen, lanes)} "
                f"({' and '.join(what)}): {common.human_rate(current)} per direction where the GPU "
                f"and slot support {link_name(best_gen, best_lanes)} ({common.human_rate(best)}). "
                f"Every offloaded KV block or weight crosses a slower link. A link that trained "
                f"down under load points at the riser, slot, seating or BIOS settings. First: "
                f"`nvidia-smi -q -d PCIE` and `lspci -vv` (LnkSta vs LnkCap) while the GPU is busy."),
            details={"capacity_bytes_per_second": current, "max_capacity_bytes_per_second": best,
                     "link_generation": gen, "link_max_generation": best_gen,
                     "link_width_lanes": lanes, "link_max_width_lanes": best_lanes,
                     "gpu_utilization_ratio": busy},
        )
