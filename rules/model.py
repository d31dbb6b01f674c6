"""What a generated rule file is made of: recording rules, alerting rules, groups."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridmon.rules.promql import duration
from hybridmon.rules.runbook_links import runbook_text
from hybridmon.rules.templates import go_template, markers

Query = tuple[str, tuple[str, ...]]  # PromQL with %q placeholders, the alert labels filling them
# The loaded thresholds file: agent/alerts/catalogue.Thresholds, a model the catalogue builds at
# import from the alert families, which import these rules. The rules read it by section and key
# (t.pcie_starvation.for_seconds) and name it by this alias, never by importing the catalogue.
Thresholds = Any


@dataclass(frozen=True)
class Recording:
    record: str
    expr: str

    def to_dict(self) -> dict:
        return {"record": self.record, "expr": self.expr}


@dataclass(frozen=True)
class Alert:
    """One alerting rule. Several rules may share an alertname when severity or reason differ."""

    alert: str
    expr: str
    for_seconds: float
    severity: str
    summary: str                    # annotation text with <markers> (rules.templates)
    description: str
    labels: dict[str, str] = field(default_factory=dict)   # static entity labels (reason, resource)
    queries: dict[str, Query] = field(default_factory=dict)
    # False where the alert's instance is an agent that cannot serve its runbook (it is down), so the
    # default runbook_url does not point there (rules/runbook_links.py).
    runbook_served_by_its_agent: bool = True

    def __post_init__(self) -> None:
        used = markers(self.summary) | markers(self.description)
        unknown = set(self.queries) - used
        if unknown:
            raise ValueError(f"{self.alert}: queries never used: {sorted(unknown)}")

    def runbook(self, runbook_base_url: str | None) -> str:
        """The runbook_url annotation as marker text: BASE/<Alert>, or the default where None."""
        return runbook_text(self.alert, runbook_base_url, self.runbook_served_by_its_agent)

    def to_dict(self, runbook_base_url: str | None) -> dict:
        return {
            "alert": self.alert,
            "expr": self.expr,
            "for": duration(self.for_seconds),
            "labels": {"severity": self.severity, **self.labels},
            "annotations": {
                "summary": go_template(self.summary, self.queries),
                "description": go_template(self.description, self.queries),
                "runbook_url": go_template(self.runbook(runbook_base_url), {}),
            },
        }


@dataclass(frozen=True)
class Group:
    name: str
    rules: tuple[Recording | Alert, ...]

    def to_dict(self, runbook_base_url: str | None) -> dict:
        return {
            "name": self.name,
            "rules": [
                rule.to_dict(runbook_base_url) if isinstance(rule, Alert) else rule.to_dict()
                for rule in self.rules
            ],
        }

    def alerts(self) -> list[Alert]:
        return [rule for rule in self.rules if isinstance(rule, Alert)]
