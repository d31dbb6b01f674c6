"""The `kv_offload_pressure` alert family (ADAPTER: to be moved into this module, see family.py)."""
from __future__ import annotations

from hybridmon.agent.alerts.family import AlertFamily
from hybridmon.agent.detectors.base import KvOffloadPressure as Settings
from hybridmon.agent.detectors.inference import KvOffloadPressureDetector
from hybridmon.rules import cases_inference, inference

FAMILY = AlertFamily(
    section="kv_offload_pressure",
    settings=Settings,
    alertnames=('InferenceKvOffloadPressure',),
    group="hybridmon-inference",
    detector=KvOffloadPressureDetector,
    alerts=lambda t: tuple(inference.kv_offload_pressure(t)),
    cases=lambda t, catalog: [cases_inference.kv_cache_full(t, catalog), cases_inference.offload_link(t, catalog)],
    collectors=('inference',),
    lookback_seconds=lambda settings: 0.0,
)
