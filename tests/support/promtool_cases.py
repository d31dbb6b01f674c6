"""promtool unit tests, generated from the same thresholds as the rules (tests/rules/generate.py).

Each test is a small host story: healthy series until ONSET, the incident's series after it (from
the next sample on), inputs chosen just past each threshold (or well inside it, for the healthy
counterparts). Every alert gets a "not yet firing" evaluation (its condition holds but for less than
its `for`, or before the onset when `for` is 0) and a "firing" evaluation with every label and
annotation spelled out, the annotations rendered in Python exactly as Prometheus renders them
(rules.templates).

Timing: rules evaluate every minute. The incident's values start at ONSET + 15 s, so the 1 min
averages and rates are fully "after" from ONSET + 2 min; a condition becomes active at ONSET + 1 min
or + 2 min. Hence "not yet firing" at ONSET + 2 min (when `for` > 1 min) and "firing" at
ONSET + 2 min + `for`, rounded up to the minute.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from hybridmon.rules.model import Alert, Group
from hybridmon.rules.promql import duration
from hybridmon.rules.templates import expected_text

JOB = "hybridmon"
HOST = "gpu-host-1:9787"
STEP = 15
ONSET = 120
BEFORE_SAMPLES = ONSET // STEP + 1  # samples at 0, 15 s, ..., ONSET
GPU0 = {"gpu": "0", "uuid": "GPU-0a1b2c3d-0000-4000-8000-000000000000"}
GPU1 = {"gpu": "1", "uuid": "GPU-1a1b2c3d-0000-4000-8000-000000000001"}
GPU2 = {"gpu": "2", "uuid": "GPU-2a1b2c3d-0000-4000-8000-000000000002"}
GPU3 = {"gpu": "3", "uuid": "GPU-3a1b2c3d-0000-4000-8000-000000000003"}
BUS0, BUS1 = "0000:17:00.0", "0000:ca:00.0"
GIB, MIB = 1024 ** 3, 1024 ** 2


def num(value: float) -> str:
    """A sample value as promtool reads it; integers without a fraction, others round-trip exact."""
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def not_yet(for_seconds: float) -> int:
    """When the condition holds but has not held for `for` yet (or, with no `for`, before onset)."""
    return ONSET + 120 if for_seconds > 60 else ONSET


def firing(for_seconds: float) -> int:
    return ONSET + 120 + math.ceil(for_seconds / 60) * 60


def above(share: float) -> float:
    """A ratio clearly past a ">= share" threshold, still at most 1 when the threshold is."""
    return share + (1 - share) / 2


class Catalog:
    """The generated alerting rules, found by name and by what tells same-named rules apart."""

    def __init__(self, groups: list[Group], runbook_base_url: str | None) -> None:
        self.alerts = [alert for group in groups for alert in group.alerts()]
        self.runbook_base_url = runbook_base_url

    def find(self, alertname: str, severity: str | None = None, **static: str) -> Alert:
        matches = [a for a in self.alerts if a.alert == alertname
                   and (severity is None or a.severity == severity) and a.labels == static]
        if len(matches) != 1:
            raise LookupError(f"{len(matches)} rules match {alertname} {severity} {static}")
        return matches[0]

    def runbook_url(self, rule: Alert, instance: str) -> str:
        """The runbook_url Prometheus renders for `rule` on a series of `instance` ("": none)."""
        return expected_text(rule.runbook(self.runbook_base_url), {"instance": instance})


@dataclass
class Test:
    """One promtool test: input series, then evaluations with the alerts expected at each."""

    __test__ = False  # a promtool test, not a pytest one: the families' test modules import it

    name: str
    end: int                        # seconds; series run from 0 to here
    catalog: Catalog
    interval: int = STEP
    series: list[dict] = field(default_factory=list)
    alert_tests: list[dict] = field(default_factory=list)
    expr_tests: list[dict] = field(default_factory=list)

    @property
    def samples(self) -> int:
        return self.end // self.interval + 1

    def add(self, metric: str, values: str, instance: str = HOST, **labels: str) -> None:
        pairs = {"job": JOB, "instance": instance, **labels}
        selector = ", ".join(f'{k}="{v}"' for k, v in pairs.items())
        self.series.append({"series": f"{metric}{{{selector}}}", "values": values})

    def values(self, metric: str, values: list[float], instance: str = HOST, **labels: str) -> None:
        if len(values) != self.samples:
            raise ValueError(f"{metric}: {len(values)} values for {self.samples} samples")
        self.add(metric, " ".join(num(v) for v in values), instance, **labels)

    def constant(self, metric: str, value: float, instance: str = HOST, **labels: str) -> None:
        if math.isinf(value):  # promtool's `axn` shorthand does not take Inf
            self.add(metric, " ".join([num(value)] * self.samples), instance, **labels)
        else:
            self.add(metric, f"{num(value)}x{self.samples - 1}", instance, **labels)

    def gauge(self, metric: str, before: float | None, after: float | None,
              instance: str = HOST, **labels: str) -> None:
        """`before` until ONSET, `after` from the next sample; None: absent (after: stale)."""
        first = f"_x{BEFORE_SAMPLES}" if before is None else f"{num(before)}x{BEFORE_SAMPLES - 1}"
        rest = self.samples - BEFORE_SAMPLES
        second = "stale" if after is None else f"{num(after)}x{rest - 1}"
        self.add(metric, f"{first} {second}", instance, **labels)

    def counter(self, metric: str, rate_before: float, rate_after: float,
                instance: str = HOST, **labels: str) -> None:
        """A counter from 0 rising at `rate_before` per second until ONSET, `rate_after` after."""
        step_before, step_after = rate_before * self.interval, rate_after * self.interval
        at_onset = step_before * (BEFORE_SAMPLES - 1)
        rest = self.samples - BEFORE_SAMPLES
        self.add(metric, f"0+{num(step_before)}x{BEFORE_SAMPLES - 1} "
                         f"{num(at_onset + step_after)}+{num(step_after)}x{rest - 1}", instance, **labels)

    def expect(self, at: int, alertname: str, *alerts: dict) -> None:
        self.alert_tests.append({"eval_time": duration(at), "alertname": alertname,
                                 "exp_alerts": list(alerts)})

    def alert(self, rule: Alert, labels: dict[str, str], instance: str = HOST, **values: float | str) -> dict:
        """The expected alert of `rule` for the entity `labels`, annotations filled from `values`."""
        exp_labels = {"severity": rule.severity, **rule.labels, "job": JOB, "instance": instance, **labels}
        filled = {**exp_labels, **values}
        # Prometheus has no empty labels: a series written with instance="" has none.
        exp_labels = {name: value for name, value in exp_labels.items() if value != ""}
        return {
            "exp_labels": exp_labels,
            "exp_annotations": {
                "summary": expected_text(rule.summary, filled),
                "description": expected_text(rule.description, filled),
                "runbook_url": self.catalog.runbook_url(rule, instance),
            },
        }

    def expect_samples(self, at: int, expr: str, *samples: tuple[dict[str, str], float]) -> None:
        def labels(pairs: dict[str, str]) -> str:
            return "{" + ", ".join(f'{k}="{v}"' for k, v in {"job": JOB, "instance": HOST, **pairs}.items()) + "}"
        self.expr_tests.append({"expr": expr, "eval_time": duration(at), "exp_samples": [
            {"labels": f"{expr}{labels(pairs)}", "value": value} for pairs, value in samples]})

    def to_dict(self) -> dict:
        test: dict = {"name": self.name, "interval": duration(self.interval), "input_series": self.series}
        if self.alert_tests:
            test["alert_rule_test"] = self.alert_tests
        if self.expr_tests:
            test["promql_expr_test"] = self.expr_tests
        return test


def test_files(thresholds, cases: dict[str, object], groups: list[Group], runbook_base_url: str) -> dict[str, dict]:
    """File name (without prefix and suffix) -> promtool test document, one per entry of `cases`
    (name -> `promtool_cases(thresholds, catalog)`) that gives any."""
    catalog = Catalog(groups, runbook_base_url)
    files = {}
    for name, promtool_cases in cases.items():
        tests = promtool_cases(thresholds, catalog)
        if tests:
            files[name] = {
                "rule_files": ["../hybridmon.rules.yml"],
                "evaluation_interval": "1m",
                "tests": [test.to_dict() for test in tests],
            }
    return files
