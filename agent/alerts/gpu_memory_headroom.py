"""The `gpu_memory_headroom` alert family (ADAPTER: to be moved into this module, see family.py)."""
from __future__ import annotations

from hybridmon.agent.alerts.family import AlertFamily
from hybridmon.agent.detectors.base import GpuMemoryHeadroom as Settings
from hybridmon.agent.detectors.gpu_memory import GpuMemoryHeadroomDetector
from hybridmon.rules import cases_gpu, pcie

FAMILY = AlertFamily(
    section="gpu_memory_headroom",
    settings=Settings,
    alertnames=('GpuMemoryHeadroomLow',),
    group="hybridmon-gpu-memory",
    detector=GpuMemoryHeadroomDetector,
    alerts=lambda t: tuple(pcie.memory_headroom(t)),
    cases=lambda t, catalog: [cases_gpu.headroom_used(t, catalog), cases_gpu.headroom_forecast(t, catalog)],
    collectors=('gpu',),
    lookback_seconds=lambda settings: settings.trend_window_seconds,
)
