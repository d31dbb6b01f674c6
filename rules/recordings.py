"""The recording rules each rule group's alerts share, by group (agent/alerts/catalogue.GROUPS).

Recording rules are shared vocabulary (a link's capacity, 1 min averages, robust slopes): several
alert families read them, so they live here rather than in one family.
"""
from __future__ import annotations

from hybridmon.rules import host as _host
from hybridmon.rules import inference as _inference
from hybridmon.rules import pcie as _pcie
from hybridmon.rules import process as _process
from hybridmon.rules.model import Recording


def none(thresholds) -> tuple[Recording, ...]:
    return ()


def pcie(thresholds) -> tuple[Recording, ...]:
    return _pcie.recordings(thresholds)


def gpu_memory(thresholds) -> tuple[Recording, ...]:
    return _pcie.memory_recordings(thresholds)


def host_memory(thresholds) -> tuple[Recording, ...]:
    return _host.recordings()


def process(thresholds) -> tuple[Recording, ...]:
    return _process.recordings(thresholds)


def inference(thresholds) -> tuple[Recording, ...]:
    return _inference.recordings(thresholds)
