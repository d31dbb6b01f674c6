"""The `numa_misplacement` alert family (ADAPTER: to be moved into this module, see family.py)."""
from __future__ import annotations

from hybridmon.agent.alerts.family import AlertFamily
from hybridmon.agent.detectors.base import NumaMisplacement as Settings
from hybridmon.agent.detectors.numa import NumaMisplacementDetector
from hybridmon.rules import cases_process, process

FAMILY = AlertFamily(
    section="numa_misplacement",
    settings=Settings,
    alertnames=('InferenceProcessNumaMisplaced',),
    group="hybridmon-process",
    detector=NumaMisplacementDetector,
    alerts=lambda t: tuple(process.numa_misplaced(t)),
    cases=lambda t, catalog: [cases_process.numa(t, catalog)],
    collectors=('gpu',),
    lookback_seconds=lambda settings: 0.0,
)
