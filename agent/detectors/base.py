"""What a detector is and what it returns (the thresholds it reads: agent/alerts/).

A detector is a pure function of the agent's history at a moment: `evaluate(history, now)` returns
the findings whose condition holds *now*, each with the `for_seconds` it must hold before it fires.
The engine (engine.py) keeps them pending and fires them, exactly as Prometheus handles an alert
rule's `for`, so an in-agent finding and its Prometheus rule fire at about the same time.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal, Protocol

from hybridmon.agent.loop.history import History, SeriesHistory
from hybridmon.exporters.base import Samples

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


class HistoryReader(Protocol):
    """What a detector reads of the history: History itself (loop/history.py), or the engine's
    view of one evaluation (engine.EvaluationView), which reads the same History."""

    @property
    def source(self) -> History:
        """The History read: itself, or the one a view reads. A detector that keeps figures from
        one evaluation to the next keeps them for one History only (memory_growth's trends)."""

    def series(self, name: str, /, **labels: str) -> list[SeriesHistory]:
        """Every series of metric `name` whose labels include `labels`, oldest point first."""

    def series_every(self, name: str, /, step_seconds: float, since: float | None = None,
                     **labels: str) -> list[SeriesHistory]:
        """As series(), one point per `step_seconds` over the whole span."""

    def latest(self) -> dict[str, tuple[float, Samples]]:
        """Per collector: the time and samples of its last successful run."""


class RunningAgent(Protocol):
    """What a detector that judges the agent itself reads of it (daemon.Agent), once, at attach."""

    sampler: Any          # loop.sampler.Sampler: its collectors' records and the loop's
    pusher: Any           # publish.alertmanager.AlertmanagerPusher, or None without Alertmanagers


class Detector(Protocol):
    """One alert family's judge (agent/alerts/family.py builds it from its thresholds section).
    DetectorBase below gives every part but evaluate() its usual value."""

    name: str                       # section name in thresholds.toml
    alertnames: tuple[str, ...]     # every alertname it can return (one runbook each)
    # History it needs before its silence means health: `check` skips it on a shorter window and
    # the agent reports it as warming up until the history spans it (agent/warmup.py).
    min_history_seconds: float
    # The span of history the engine lets it read (engine.EvaluationView.reading_back), set by its
    # family when it is built (AlertFamily.build_detector); inf: all the engine's lookback.
    lookback_seconds: float
    # True when it judges the agent itself (its collectors, its loop, its alert delivery) from the
    # parts attach() hands it rather than the host's history: `check` runs no agent to judge.
    judges_the_agent: bool
    # What it judged each entity by at its last evaluation, by the entity's label values (a GPU's
    # (gpu, uuid), a server's (server, endpoint, model, pid)): the figures the status page shows,
    # as decided here, instead of working them out again (detectors/links.py has their types).
    # Replaced whole at each evaluation, so a reader on another thread sees one evaluation's.
    figures: Mapping[tuple[str, ...], Any]

    def attach(self, agent: RunningAgent) -> None:
        """Called once by the running agent before the first evaluation."""

    def evaluate(self, history: HistoryReader, now: float) -> list[Finding]:
        """The findings whose condition holds at `now`; a pure function of the history (and, for
        one that judges the agent, of the parts attach() handed it)."""


class DetectorBase:
    """The usual answers of the Detector contract: no history needed before judging, the whole
    lookback readable until its family sets its span, judges the host, publishes no figures,
    nothing to attach."""

    name: str
    alertnames: tuple[str, ...]
    min_history_seconds: float = 0.0
    lookback_seconds: float = math.inf
    judges_the_agent: bool = False
    figures: Mapping[tuple[str, ...], Any] = MappingProxyType({})

    def attach(self, agent: RunningAgent) -> None:
        """A detector of the host's history reads nothing of the agent."""


def add_note(found: Finding, sentence: str) -> Finding:
    """`found` with one sentence only the agent can say (the server's side of a host incident, the
    host signals that moved with a decay) after the rule's text; details["agent_note"] keeps what
    was added, so the text before it stays exactly the rule's."""
    details = dict(found.details)
    details["agent_note"] = f"{details['agent_note']} {sentence}" if "agent_note" in details else sentence
    return replace(found, description=f"{found.description} {sentence}", details=details)
