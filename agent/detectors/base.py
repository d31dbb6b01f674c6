"""What a detector is and what it returns (the thresholds it reads: agent/alerts/).

A detector is a pure function of the agent's history at a moment: `evaluate(history, now)` returns
the findings whose condition holds *now*, each with the `for_seconds` it must hold before it fires.
The engine (engine.py) keeps them pending and fires them, exactly as Prometheus handles an alert
rule's `for`, so an in-agent finding and its Prometheus rule fire at about the same time.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from hybridmon.agent.loop.history import History

Severity = Literal["info", "warning", "critical"]


@dataclass(frozen=True)
class Finding:
    """One thing wrong with the host, about one entity (a GPU, a process, the host)."""

    alertname: str
    severity: Severity
    labels: dict[str, str]          # the entity: gpu, uuid, pid, process_name, pci_bus_id, node...
    value: float                    # the measured value the threshold was compared with
    threshold: float
    summary: str                    # one line, value and entity filled in
    description: str                # why it matters and what was seen, value and threshold filled in
    for_seconds: float = 0.0        # how long the condition must hold before the finding fires
    unit: str = ""                  # unit of value and threshold, for display ("B/s", "ratio", "s")
    details: dict[str, float | str] = field(default_factory=dict)  # extra figures (slope, forecast)
    # What filled the summary's and description's markers (labels, value, the rule's query names):
    # the same text rendered by Prometheus from the same values reads the same (agent/alerts).
    values: dict[str, float | str] = field(default_factory=dict, compare=False)

    @property
    def key(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        return self.alertname, tuple(sorted(self.labels.items()))


class Detector(Protocol):
    name: str                       # section name in thresholds.toml
    alertnames: tuple[str, ...]     # every alertname it can return (one runbook each)
    # Optional `lookback_seconds`: the span of history it reads (catalogue.all_detectors sets it
    # from its family); the engine copies it no more than that (and at least 10 minutes).

    def evaluate(self, history: History, now: float) -> list[Finding]: ...


def add_note(found: Finding, sentence: str) -> Finding:
    """`found` with one sentence only the agent can say (the server's side of a host incident, the
    host signals that moved with a decay) after the rule's text; details["agent_note"] keeps what
    was added, so the text before it stays exactly the rule's."""
    details = dict(found.details)
    details["agent_note"] = f"{details['agent_note']} {sentence}" if "agent_note" in details else sentence
    return replace(found, description=f"{found.description} {sentence}", details=details)
