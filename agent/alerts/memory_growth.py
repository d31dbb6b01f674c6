"""The `memory_growth` alert family (ADAPTER: to be moved into this module, see family.py)."""
from __future__ import annotations

from hybridmon.agent.alerts.family import AlertFamily
from hybridmon.agent.detectors.base import MemoryGrowth as Settings
from hybridmon.agent.detectors.memory import MemoryGrowthDetector
from hybridmon.rules import cases_process, process

FAMILY = AlertFamily(
    section="memory_growth",
    settings=Settings,
    alertnames=('InferenceProcessMemoryGrowth',),
    group="hybridmon-process",
    detector=MemoryGrowthDetector,
    alerts=lambda t: tuple(process.memory_growth(t)),
    cases=lambda t, catalog: [cases_process.memory_growth(t, catalog), cases_process.memory_growth_against_server_load(t, catalog)],
    collectors=(),
    lookback_seconds=lambda settings: settings.window_seconds,
)
