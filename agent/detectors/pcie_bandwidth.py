"""GpuPcieBandwidthLow: what `hybridmon bench` measured is far below what the link should carry.

A judgement on a stored measurement, not on live traffic: the finding holds from the moment the
agent reads the run until a new run replaces it. Runs forced beside a busy GPU are not judged
(exporters/bench.py leaves their capacity out), nor GPUs whose maximum link NVML does not report.
"""
from __future__ import annotations

from hybridmon.agent.detectors import common
from hybridmon.agent.detectors.base import Finding, PcieBandwidthLow
from hybridmon.agent.detectors.pcie import (MAX_GENERATION, MAX_WIDTH, MEASURED_CAPACITY, link_name,
                                  theoretical_capacity)
from hybridmon.agent.history import History

BENCH_TIMESTAMP = "hybridmon_bench_timestamp_seconds"


class PcieBandwidthLowDetector:
    """The slower direction of the measured capacity below floor_share(max generation) x the
    theoretical rate of max generation x max width."""

    name = "pcie_bandwidth_low"
    alertnames = ("GpuPcieBandwidthLow",)
    min_history_seconds = 0.0

    def __init__(self, config: PcieBandwidthLow) -> None:
        self.config = config

    def evaluate(self, history: History, now: float) -> list[Finding]:
        max_generation = common.gpu_latest(history, MAX_GENERATION, now)
        max_width = common.gpu_latest(history, MAX_WIDTH, now)
        measured_at = common.gpu_latest(history, BENCH_TIMESTAMP, now)
        measured = common.gpu_directions(history, MEASURED_CAPACITY, now)
        findings = []
        for key, directions in sorted(measured.items()):
            generation, lanes = max_generation.get(key), max_width.get(key)
            best = theoretical_capacity(generation, lanes) if generation and lanes else None
            if best is None:
                continue
            direction, slowest = min(directions.items(), key=lambda item: item[1])
            share, floor = slowest / best, self.config.floor_share(generation)
            if share < floor:
                findings.append(self._finding(key, direction, slowest, share, floor, best,
                                              link_name(generation, lanes), directions,
                                              measured_at.get(key)))
        return findings

    @staticmethod
    def _finding(key, direction, slowest, share, floor, best, link, directions, measured_at) -> Finding:
        details: dict[str, float | str] = {
            "direction": direction, "measured_bytes_per_second": slowest,
            "floor_bytes_per_second": floor * best, "max_capacity_bytes_per_second": best,
            "link": link}
        for name, value in directions.items():
            details[f"{name}_bytes_per_second"] = value
        if measured_at is not None:
            details["measured_at"] = measured_at
        way = direction.replace("_", " ")
        return Finding(
            alertname="GpuPcieBandwidthLow",
            severity="warning",
            labels=common.gpu_entity(key),
            value=share,
            threshold=floor,
            unit="ratio",
            summary=(f"GPU {key[0]} measured {common.human_rate(slowest)} {way} over PCIe, "
                     f"{common.percent(share)} of its {link} link (floor {common.percent(floor)})"),
            description=(
                f"The latest `hybridmon bench` run on GPU {key[0]} ({key[1]}) moved pinned, "
                f"NUMA-local copies {way} at {common.human_rate(slowest)}: "
                f"{common.percent(share)} of the {common.human_rate(best)} a {link} link carries, "
                f"below the floor of {common.percent(floor)} ({common.human_rate(floor * best)}; "
                f"Azure's GPU health checks fail a node below 24 GB/s on Gen4 x16 and 52 GB/s on "
                f"Gen5 x16). Every offloaded KV block and weight reload is that much slower. Usual "
                f"causes: a link trained down under load (slot, riser, seating), host memory on "
                f"the wrong NUMA node, IOMMU or ACS settings, another device sharing the switch. "
                f"First: `nvidia-smi -q -d PCIE` while copying, then run `hybridmon bench` again "
                f"on an idle GPU."),
            details=details,
        )
