"""The alert families, listed once. The agent's detectors, `hybridmon check`, the thresholds file's
schema, the Prometheus rule file and its promtool tests, the runbooks and the tests all come from
this list; adding an alert is a family module (family.py) plus a line here.

The order is the rule file's: families in the order of their rule groups, alerts in the order they
appear in their group.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError, create_model

from hybridmon.agent.alerts import (agent_down, alert_delivery, collector_failing, gpu_lost,
                                    gpu_memory_headroom, host_config, inference_scrape,
                                    kv_offload_pressure, memory_growth, numa_misplacement,
                                    pcie_bandwidth_low, pcie_errors, pcie_link_degraded,
                                    pcie_starvation, sampling_lag, swap_thrash, throughput_decay,
                                    offload_host_memory, weight_offload)
from hybridmon.agent.alerts.family import AlertFamily, Section
from hybridmon.agent.detectors.base import Detector
from hybridmon.rules import recordings
from hybridmon.rules.model import Group, Recording

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

FAMILIES: tuple[AlertFamily, ...] = (
    pcie_starvation.FAMILY,
    pcie_link_degraded.FAMILY,
    pcie_errors.FAMILY,
    gpu_lost.FAMILY,
    gpu_memory_headroom.FAMILY,
    pcie_bandwidth_low.FAMILY,
    swap_thrash.FAMILY,
    host_config.FAMILY,
    memory_growth.FAMILY,
    numa_misplacement.FAMILY,
    throughput_decay.FAMILY,
    kv_offload_pressure.FAMILY,
    weight_offload.FAMILY,
    offload_host_memory.FAMILY,
    inference_scrape.FAMILY,
    alert_delivery.FAMILY,
    collector_failing.FAMILY,
    sampling_lag.FAMILY,
    agent_down.FAMILY,
)
# Rule groups in file order, each with the recording rules its alerts share (rules/recordings.py).
GROUPS: tuple[tuple[str, Callable[..., tuple[Recording, ...]]], ...] = (
    ("hybridmon-pcie", recordings.pcie),
    ("hybridmon-gpu-memory", recordings.gpu_memory),
    ("hybridmon-bench", recordings.none),
    ("hybridmon-host-memory", recordings.host_memory),
    ("hybridmon-host-config", recordings.none),
    ("hybridmon-process", recordings.process),
    ("hybridmon-inference", recordings.inference),
    ("hybridmon-agent", recordings.none),
)
DEFAULT_THRESHOLDS_FILE = Path(__file__).resolve().parent / "thresholds.toml"

def _field(family: AlertFamily) -> tuple:
    """A section is required unless every key of it has a default: a family added in a later
    release gives its keys defaults, so a thresholds file copied from an earlier one still loads."""
    try:
        return family.settings, family.settings()
    except ValidationError:
        return family.settings, ...


# The schema of thresholds.toml: one section per family.
Thresholds = create_model(
    "Thresholds", __base__=Section,
    **{family.section: _field(family) for family in FAMILIES},  # type: ignore[call-overload]
)


class ThresholdsError(Exception):
    """The thresholds file is unusable; the message names the file and key."""


def load_thresholds(path: str | Path | None = None):
    path = Path(path) if path else DEFAULT_THRESHOLDS_FILE
    try:
        with path.open("rb") as handle:
            raw = tomllib.load(handle)
    except OSError as error:
        raise ThresholdsError(f"thresholds file {path} cannot be read: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ThresholdsError(f"thresholds file {path} is not valid TOML: {error}") from None
    try:
        return Thresholds.model_validate(raw)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()
        )
        raise ThresholdsError(f"thresholds file {path}: {problems}") from None


def family(section: str) -> AlertFamily:
    for candidate in FAMILIES:
        if candidate.section == section:
            return candidate
    raise KeyError(section)


def all_detectors(thresholds) -> list[Detector]:
    """One detector per family that has one (not the rule-only ones), built from its section, in
    catalogue order."""
    detectors = []
    for family in (f for f in FAMILIES if f.detector is not None):
        settings = getattr(thresholds, family.section)
        detector = family.detector(settings)
        # What the engine lets it read (engine.EvaluationView.reading_back): its family's span
        # plus a minute for its 1-minute averages, as lookback_seconds() counts it.
        detector.lookback_seconds = 60.0 + (family.view_seconds or family.lookback_seconds)(settings)
        detectors.append(detector)
    return detectors


def all_alertnames() -> list[str]:
    """Every alertname any family raises (one runbook each), sorted."""
    return sorted({name for f in FAMILIES for name in f.alertnames})


def lookback_seconds(thresholds) -> float:
    """The longest span of history any detector reads, plus a minute for its 1-minute averages.
    The throughput-decay baseline is the longest: with the default 2 h window it needs the whole
    of the agent's default 2 h history (history_seconds)."""
    return 60.0 + max(f.lookback_seconds(getattr(thresholds, f.section)) for f in FAMILIES)


def rule_groups(thresholds) -> list[Group]:
    """The Prometheus rule groups: each group's shared recordings, then its families' alerts."""
    groups = []
    for name, group_recordings in GROUPS:
        alerts = [alert for f in FAMILIES if f.group == name for alert in f.alerts(thresholds)]
        groups.append(Group(name, (*group_recordings(thresholds), *alerts)))
    unknown = {f.group for f in FAMILIES} - {name for name, _ in GROUPS}
    if unknown:
        raise ValueError(f"families name rule groups that GROUPS lacks: {sorted(unknown)}")
    return groups
