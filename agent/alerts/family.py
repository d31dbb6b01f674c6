"""What an alert family is: everything about one kind of trouble, in one module.

A family is named like its `[section]` in thresholds.toml and its test module. Its module holds,
side by side (as a monitoring mixin keeps an alert's rule, test and config together):

- `Settings`: the pydantic model of its thresholds section;
- its inputs: the exporters' MetricSpec objects it reads (never a metric name typed again);
- its PromQL alerting rule(s) (`rules.model.Alert`), each with ONE summary and description written
  with markers (`rules.templates`): Prometheus renders them as Go templates, the agent renders the
  same text in Python from the finding's values (`finding()` below), so both doors say the same words;
- its in-agent detector, a pure function of the history (`evaluate(history, now)`), unless the
  agent cannot see that trouble from inside (its own death: agent_down has `detector=None`);
- the collectors it judges (so `hybridmon check` can say why it skipped it), how much history
  it reads, its rule group (rules/groups.py), and the synthetic host of the test suite that raises
  its alerts, or why there is none.

Its tests are one module, tests/alerts/test_<section>.py: its detector's tests and its rule's
promtool cases (`promtool_cases`), inputs just past and just inside each threshold, which
`python -m tests.rules.generate` writes to rules/tests/. The agent never loads them.

A family added after a release gives its settings defaults, so thresholds files copied from the
release before still load. The catalogue (catalogue.py) finds the families, every module of this
package; the agent, `check`, the rule generator and the tests iterate what it found.
"""
from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from pydantic import BaseModel, ConfigDict

from hybridmon.agent.detectors.base import Detector, Finding
from hybridmon.exporters.base import MetricSpec
from hybridmon.rules.groups import RuleGroup
from hybridmon.rules.model import Alert
from hybridmon.rules.templates import expected_text, markers

# Prometheus fills <instance> with the scrape target; the agent, which is the target, with its host
# name, so a finding pushed straight to Alertmanager names the same machine.
AGENT_INSTANCE = socket.gethostname()


class Section(BaseModel):
    """One `[section]` of thresholds.toml: unknown keys are an error, values never change."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class AlertFamily:
    section: str                                    # thresholds.toml section (and module name)
    settings: type[Section]
    inputs: tuple[MetricSpec, ...]                  # the series it reads, as the exporters declare them
    alertnames: tuple[str, ...]                     # every alertname it raises: one runbook each
    group: RuleGroup                                # the Prometheus rule group its alerts join
    # built from its settings; None for a rule-only family, whose trouble the agent cannot see
    # from inside (agent_down: its own death)
    detector: Callable[[Any], Detector] | None
    alerts: Callable[[Any], tuple[Alert, ...]]      # built from the whole Thresholds
    collectors: tuple[str, ...] = ()                # what it judges; `check` skips it without them
    lookback_seconds: Callable[[Any], float] = lambda settings: 0.0      # history it reads
    # what of it the detector reads through the engine's view, where it reads the rest itself
    # (memory_growth reads its hour one point per 15 s: History.series_every); None: all of it
    view_seconds: Callable[[Any], float] | None = None
    # What the suite replays to see it fire: the name of a synthetic host of the test suite's
    # scenario library (tests/support/scenarios) whose story raises its alerts, or, where no such
    # host can tell its story, why not (its detector's tests and promtool cases stand alone).
    scenario: str | None = None
    no_scenario: str | None = None

    def build_detector(self, settings: Section) -> Detector | None:
        """Its detector, built from its thresholds section, reading what the engine's view lets
        it: its span plus a minute for its 1-minute averages (None for a rule-only family)."""
        if self.detector is None:
            return None
        detector = self.detector(settings)
        detector.lookback_seconds = 60.0 + (self.view_seconds or self.lookback_seconds)(settings)
        return detector


def render(text: str, values: Mapping[str, float | str]) -> str:
    """An annotation text with its markers filled, exactly as Prometheus fills them. Remembered
    for the same text and figures: a finding that holds (a memlock limit, a host setting) is
    rendered again every evaluation, for each of hundreds of processes."""
    # Keyed by the figures the text shows, not all of them: a summary that shows the value alone
    # is not filled again when another figure moves. repr keeps apart what == does not (1 and
    # 1.0, 0.0 and -0.0), which may print differently; an absent figure is not a None one.
    key = (text, tuple(repr(values.get(name, _ABSENT)) for name in _shown(text)))
    rendered = _RENDERED.get(key)
    if rendered is None:
        if len(_RENDERED) >= _RENDERED_LIMIT:
            _RENDERED.clear()   # figures that change every evaluation must not grow it
        rendered = _RENDERED[key] = expected_text(text, {"instance": AGENT_INSTANCE, **values})
    return rendered


@lru_cache(maxsize=1024)
def _shown(text: str) -> tuple[str, ...]:
    """The names of the figures and labels `text` shows or tests, in order."""
    return tuple(sorted(markers(text)))


_ABSENT = object()
_RENDERED: dict[tuple, str] = {}
_RENDERED_LIMIT = 4096


def finding(alert: Alert, labels: Mapping[str, str], value: float, threshold: float, *,
            values: Mapping[str, float | str] | None = None, unit: str = "",
            details: Mapping[str, float | str] | None = None,
            for_seconds: float | None = None) -> Finding:
    """The in-agent finding of `alert` for one entity. `values` fills the text's query markers
    (the figures the rule's queries fetch); labels and the value fill the rest."""
    filled: dict[str, float | str] = {**alert.labels, **labels, "value": value, **(values or {})}
    return Finding(
        alertname=alert.alert,
        severity=alert.severity,  # type: ignore[arg-type]
        labels={**alert.labels, **labels},
        value=value,
        threshold=threshold,
        summary=render(alert.summary, filled),
        description=render(alert.description, filled),
        for_seconds=alert.for_seconds if for_seconds is None else for_seconds,
        unit=unit,
        details=dict(details or {}),
        values={"instance": AGENT_INSTANCE, **filled},
    )

