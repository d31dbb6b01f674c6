"""The `throughput_decay` alert family (ADAPTER: to be moved into this module, see family.py)."""
from __future__ import annotations

from hybridmon.agent.alerts.family import AlertFamily
from hybridmon.agent.detectors.base import ThroughputDecay as Settings
from hybridmon.agent.detectors.throughput import ThroughputDecayDetector
from hybridmon.rules import cases_inference, inference

FAMILY = AlertFamily(
    section="throughput_decay",
    settings=Settings,
    alertnames=('InferenceThroughputDecay',),
    group="hybridmon-inference",
    detector=ThroughputDecayDetector,
    alerts=lambda t: (inference.throughput_decay(t),),
    cases=lambda t, catalog: [cases_inference.throughput_decay(t, catalog)],
    collectors=('inference',),
    lookback_seconds=lambda settings: settings.window_seconds,
)
