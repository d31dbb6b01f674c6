"""The `pcie_starvation` alert family (ADAPTER: to be moved into this module, see family.py)."""
from __future__ import annotations

from hybridmon.agent.alerts.family import AlertFamily
from hybridmon.agent.detectors.base import PcieStarvation as Settings
from hybridmon.agent.detectors.pcie import PcieStarvationDetector
from hybridmon.rules import cases_bench, cases_gpu, pcie

FAMILY = AlertFamily(
    section="pcie_starvation",
    settings=Settings,
    alertnames=('GpuPcieStarvation',),
    group="hybridmon-pcie",
    detector=PcieStarvationDetector,
    alerts=lambda t: (pcie.starvation(t),),
    cases=lambda t, catalog: [cases_gpu.starvation(t, catalog), cases_bench.starvation_against_measured_capacity(t, catalog)],
    collectors=('gpu',),
    lookback_seconds=lambda settings: settings.for_seconds,
)
