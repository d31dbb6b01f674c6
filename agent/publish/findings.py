"""Findings out of the agent: as Prometheus metrics and as the JSON of /api/v1/findings."""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Iterable, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from hybridmon.agent.detectors.engine import Engine, FindingState
from hybridmon.agent.detectors.links import BusAccount
from hybridmon.agent.self_metrics import (BUS_BYTES, DETECTOR_DURATION, DETECTOR_ERRORS, DETECTOR_EVALUATIONS,
                                          FINDING_ACTIVE, FINDING_THRESHOLD, FINDING_VALUE)
# The rules' own: a base gives the same BASE/<AlertName> whichever door the alert comes out of.
from hybridmon.rules.runbook_links import runbook_url

SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}


def iso_time(unix: float | None) -> str | None:
    if unix is None:
        return None
    return datetime.fromtimestamp(unix, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def finding_labels(state: FindingState) -> dict[str, str]:
    """alertname and severity first, then the entity; what Alertmanager and Prometheus see."""
    finding = state.finding
    return {"alertname": finding.alertname, "severity": finding.severity, **finding.labels}


def finding_json(state: FindingState, runbook_base_url: str) -> dict:
    finding = state.finding
    return {
        "alertname": finding.alertname,
        "severity": finding.severity,
        "state": state.state,
        "labels": dict(finding.labels),
        "value": finding.value,
        "threshold": finding.threshold,
        "unit": finding.unit,
        "summary": finding.summary,
        "description": finding.description,
        "runbook_url": runbook_url(runbook_base_url, finding.alertname),
        "details": dict(finding.details),
        "pending_since": iso_time(state.pending_since),
        "starts_at": iso_time(state.starts_at),
        "ends_at": iso_time(state.ends_at),
    }


def findings_json(engine: Engine, runbook_base_url: str, include: Iterable[str]) -> list[dict]:
    """Findings in the requested states, most severe first."""
    wanted = set(include)
    states = [s for s in engine.states() if s.state in wanted]
    states.sort(key=lambda s: (SEVERITY_ORDER.get(s.finding.severity, 9), s.finding.alertname, s.key[1]))
    return [finding_json(s, runbook_base_url) for s in states]


class FindingsCollector:
    """hybridmon_finding_* series for firing findings, and the engine's own health.

    The label set differs by alert (a GPU's uuid, a process's pid), so samples are added with
    their own labels rather than one fixed list.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def version(self) -> int:
        """Changes whenever collect() may yield something else: everything it yields is set by an
        evaluation, which counts itself last (Engine.evaluate), so the exposition keeps the
        rendered findings until the next one (agent/publish/exposition.py, HealthCollectors)."""
        return self._engine.evaluations

    def collect(self) -> Iterable[Metric]:
        families = [GaugeMetricFamily(spec.name, spec.documentation) for spec in (FINDING_ACTIVE, FINDING_VALUE, FINDING_THRESHOLD)]
        for state in self._engine.firing():
            labels = finding_labels(state)
            for family, number in zip(families, (1.0, state.finding.value, state.finding.threshold)):
                family.add_sample(family.name, labels, number)
        yield from families
        errors = CounterMetricFamily(DETECTOR_ERRORS.name, DETECTOR_ERRORS.documentation, labels=DETECTOR_ERRORS.label_names)
        for detector, count in sorted(self._engine.detector_errors.items()):
            errors.add_metric([detector], count)
        yield errors
        yield CounterMetricFamily(DETECTOR_EVALUATIONS.name, DETECTOR_EVALUATIONS.documentation, value=self._engine.evaluations)
        if self._engine.last_duration_seconds is not None:
            yield GaugeMetricFamily(DETECTOR_DURATION.name, DETECTOR_DURATION.documentation, value=self._engine.last_duration_seconds)
        accounts: Mapping[tuple[str, ...], BusAccount] = self._engine.figures("weight_offload")
        if accounts:
            bus = GaugeMetricFamily(BUS_BYTES.name, BUS_BYTES.documentation, labels=BUS_BYTES.label_names)
            for (gpu, uuid), account in sorted(accounts.items()):
                for direction, causes in sorted(account.causes.items()):
                    for cause, value in sorted(causes.items()):
                        bus.add_metric([gpu, uuid, direction, cause], value)
            yield bus
