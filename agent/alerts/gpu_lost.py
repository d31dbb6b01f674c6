"""The `gpu_lost` alert family (ADAPTER: to be moved into this module, see family.py)."""
from __future__ import annotations

from hybridmon.agent.alerts.family import AlertFamily
from hybridmon.agent.detectors.base import GpuLost as Settings
from hybridmon.agent.detectors.pcie_errors import GpuLostDetector
from hybridmon.rules import cases_gpu, pcie

FAMILY = AlertFamily(
    section="gpu_lost",
    settings=Settings,
    alertnames=('GpuLost',),
    group="hybridmon-pcie",
    detector=GpuLostDetector,
    alerts=lambda t: (pcie.gpu_lost(t),),
    cases=lambda t, catalog: [cases_gpu.gpu_lost(t, catalog)],
    collectors=('gpu',),
    lookback_seconds=lambda settings: 0.0,
)
