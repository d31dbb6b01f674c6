"""Every detector, built from the thresholds: the one list the agent, `check` and the tests use."""
from __future__ import annotations

from agent.detectors.alert_delivery import AlertDeliveryDetector
from agent.detectors.base import Detector, Thresholds
from agent.detectors.host_config import HostConfigDetector
from agent.detectors.inference import KvOffloadPressureDetector, ScrapeFailingDetector
from agent.detectors.gpu_memory import GpuMemoryHeadroomDetector
from agent.detectors.memory import MemoryGrowthDetector
from agent.detectors.numa import NumaMisplacementDetector
from agent.detectors.pcie import PcieLinkDegradedDetector, PcieStarvationDetector
from agent.detectors.pcie_bandwidth import PcieBandwidthLowDetector
from agent.detectors.pcie_errors import GpuLostDetector, PcieErrorsDetector
from agent.detectors.swap import SwapThrashDetector
from agent.detectors.throughput import ThroughputDecayDetector


def all_detectors(thresholds: Thresholds) -> list[Detector]:
    """One detector per thresholds section, in a stable order."""
    return [
        PcieStarvationDetector(thresholds.pcie_starvation),
        PcieLinkDegradedDetector(thresholds.pcie_link_degraded),
        PcieErrorsDetector(thresholds.pcie_errors),
        GpuLostDetector(thresholds.gpu_lost),
        SwapThrashDetector(thresholds.swap_thrash),
        MemoryGrowthDetector(thresholds.memory_growth),
        NumaMisplacementDetector(thresholds.numa_misplacement),
        GpuMemoryHeadroomDetector(thresholds.gpu_memory_headroom),
        HostConfigDetector(thresholds.host_config),
        PcieBandwidthLowDetector(thresholds.pcie_bandwidth_low),
        ThroughputDecayDetector(thresholds.throughput_decay),
        KvOffloadPressureDetector(thresholds.kv_offload_pressure),
        ScrapeFailingDetector(thresholds.inference_scrape),
        AlertDeliveryDetector(thresholds.alert_delivery),
    ]


def all_alertnames(detectors: list[Detector]) -> list[str]:
    """Every alertname the detectors can return (one runbook each), sorted."""
    return sorted({name for detector in detectors for name in detector.alertnames})


def lookback_seconds(thresholds: Thresholds) -> float:
    """The longest span of history any detector reads, plus a minute for its 1-minute averages.
    The throughput-decay baseline is the longest: with the default 2 h window it needs the whole
    of the agent's default 2 h history (history_seconds)."""
    return 60.0 + max(
        thresholds.throughput_decay.window_seconds,
        thresholds.memory_growth.window_seconds,
        thresholds.gpu_memory_headroom.trend_window_seconds,
        thresholds.pcie_errors.window_seconds,
        thresholds.pcie_starvation.for_seconds,
        thresholds.pcie_link_degraded.for_seconds,
    )
