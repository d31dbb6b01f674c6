"""The `pcie_bandwidth_low` alert family (ADAPTER: to be moved into this module, see family.py)."""
from __future__ import annotations

from hybridmon.agent.alerts.family import AlertFamily
from hybridmon.agent.detectors.base import PcieBandwidthLow as Settings
from hybridmon.agent.detectors.pcie_bandwidth import PcieBandwidthLowDetector
from hybridmon.rules import bench, cases_bench

FAMILY = AlertFamily(
    section="pcie_bandwidth_low",
    settings=Settings,
    alertnames=('GpuPcieBandwidthLow',),
    group="hybridmon-bench",
    detector=PcieBandwidthLowDetector,
    alerts=lambda t: (bench.bandwidth_low(t),),
    cases=lambda t, catalog: [cases_bench.bandwidth_low(t, catalog)],
    collectors=('gpu', 'bench'),
    lookback_seconds=lambda settings: 0.0,
)
