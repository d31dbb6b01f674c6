"""The `pcie_errors` alert family (ADAPTER: to be moved into this module, see family.py)."""
from __future__ import annotations

from hybridmon.agent.alerts.family import AlertFamily
from hybridmon.agent.detectors.base import PcieErrors as Settings
from hybridmon.agent.detectors.pcie_errors import PcieErrorsDetector
from hybridmon.rules import cases_gpu, pcie

FAMILY = AlertFamily(
    section="pcie_errors",
    settings=Settings,
    alertnames=('GpuPcieReplayErrors', 'PcieAerErrors'),
    group="hybridmon-pcie",
    detector=PcieErrorsDetector,
    alerts=lambda t: (pcie.replay_errors(t), *pcie.aer_errors(t)),
    cases=lambda t, catalog: [cases_gpu.replay_errors(t, catalog),
                              *([cases_gpu.aer_uncorrectable(t, catalog)] if t.pcie_errors.aer_uncorrectable_any else []),
                              cases_gpu.aer_correctable(t, catalog)],
    collectors=('gpu',),
    lookback_seconds=lambda settings: settings.window_seconds,
)
