"""Both doors of one scenario: its trace replayed into an Agent with its detectors on and its
scrapes run through promtool over rules/hybridmon.rules.yml, each door's firings kept (what
tests/integration/test_rules_vs_detectors*.py compare; the first of those modules says how, and
why the tolerance is what it is)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from hybridmon.agent.config import load_config
from hybridmon.agent.daemon import Agent
from tests.support.scenarios import SCENARIOS, START_TIME, history_seconds_for
from tests.support.scenarios.library import Expectation, Scenario
from tests.support.promtool_replay import RuleFiring, Scraper, first_and_last_firing, input_series, promtool_test

SCRAPE_SECONDS = 15          # Prometheus' scrape interval, the promtool series' interval
RULE_EVALUATION_SECONDS = 15  # promtool's evaluation_interval (rule_evaluation_seconds)
AGENT_EVALUATION_SECONDS = 15  # detectors.evaluation_interval_seconds
WINDOW_SECONDS = 15          # a 1 m average or rate over 15 s scrapes moves a scrape at a time
SUBQUERY_STEP_SECONDS = 60   # trends on a [..:1m] subquery grid move once a minute
TRENDS = {"InferenceProcessMemoryGrowth"}  # expected alerts whose rule reads a [..:1m] subquery


def agent_evaluation_step(scenario: Scenario) -> float:
    """The agent evaluates on its ticks, the first one at least the interval after the last."""
    return math.ceil(AGENT_EVALUATION_SECONDS / scenario.tick_seconds - 1e-9) * scenario.tick_seconds


def rule_evaluation_seconds(scenario: Scenario) -> int:
    """promtool's evaluation_interval: 15 s, the usual one; 30 s on the stories told on 10 s ticks
    (hour-long trends), whose rules move once a minute ([..:1m] subqueries; 10 and 30 min means)
    and whose 2 h replays through promtool cost most of the suite otherwise (issue 28: the memory
    rules' half-window statistics doubled it). The tolerance widens by the same 15 s."""
    return 2 * RULE_EVALUATION_SECONDS if scenario.tick_seconds >= 10 else RULE_EVALUATION_SECONDS


def tolerance(scenario: Scenario, alertname: str) -> float:
    window = SUBQUERY_STEP_SECONDS if alertname in TRENDS else WINDOW_SECONDS
    return SCRAPE_SECONDS + max(rule_evaluation_seconds(scenario), agent_evaluation_step(scenario)) + window


@dataclass
class AgentFiring:
    alertname: str
    labels: dict[str, str]
    severity: str
    first: float                  # seconds from the start: first evaluation firing
    resolved: float | None = None  # the last resolution, None when still firing at the end


@dataclass
class Doors:
    """One scenario seen through both doors."""

    scenario: Scenario
    end: float                       # last scrape and evaluation, seconds from the start
    agent: list[AgentFiring]
    rules: list[RuleFiring]
    replay_seconds: float
    promtool_seconds: float

    def agent_matching(self, expectation: Expectation) -> list[AgentFiring]:
        alertname, labels = expectation
        return [f for f in self.agent if f.alertname == alertname and labels.items() <= f.labels.items()]

    def rules_matching(self, expectation: Expectation) -> list[RuleFiring]:
        alertname, labels = expectation
        return [f for f in self.rules if f.alertname == alertname and labels.items() <= f.labels.items()]

    def rule_resolved(self, firing: RuleFiring) -> float | None:
        """The first evaluation after the last one firing; None when it fires at the end."""
        return None if firing.last >= self.end else firing.last + self.rule_step

    @property
    def rule_step(self) -> float:
        return rule_evaluation_seconds(self.scenario)


def see_both_doors(name: str, trace: Path, directory: Path) -> Doors:
    scenario = SCENARIOS[name]
    began = time.perf_counter()
    overrides = {"history_seconds": history_seconds_for(scenario),
                 "detectors.evaluation_interval_seconds": AGENT_EVALUATION_SECONDS}
    agent = Agent(load_config(environ={}, overrides=overrides), replay_from=trace)
    scraper = Scraper(agent, START_TIME, SCRAPE_SECONDS)
    firings: dict[tuple, AgentFiring] = {}

    def changed(state, change: str) -> None:
        finding = state.finding
        if change == "firing":
            if state.key not in firings:
                firings[state.key] = AgentFiring(finding.alertname, dict(finding.labels), finding.severity,
                                                 state.firing_since - START_TIME)
            firings[state.key].resolved = None
        else:
            firings[state.key].resolved = state.resolved_at - START_TIME

    agent.engine.on_change.append(changed)
    try:
        agent.replay(speed=0)
    finally:
        agent.stop()
    assert not any(agent.engine.detector_errors.values()), agent.engine.detector_errors
    step = rule_evaluation_seconds(scenario)   # a multiple of the scrape interval
    end = math.floor(scenario.duration_seconds / step) * step
    scraper.finish(START_TIME + end)
    replayed = time.perf_counter()
    document = promtool_test(input_series(scraper.scrapes), int(end), SCRAPE_SECONDS, step, name)
    rules, _output = first_and_last_firing(document, directory, name)
    return Doors(scenario, end, list(firings.values()), rules, replayed - began,
                 time.perf_counter() - replayed)


@pytest.fixture(scope="module")
def doors(scenarios, tmp_path_factory):
    """Per scenario, replayed and run through promtool on first use, once for the module."""
    directory = tmp_path_factory.mktemp("rules-vs-detectors")
    seen: dict[str, Doors] = {}

    def get(name: str) -> Doors:
        if name not in seen:
            seen[name] = see_both_doors(name, scenarios.summary(name).path, directory)
        return seen[name]
    return get




# --- every scenario: the cases and their checks ------------------------------------------------------

# Scenarios on 10 s ticks tell hour-long trends (memory growth, throughput decay): the costliest
# replays, kept in a module of their own so that the two test workers share the work.
def long_trends(name: str) -> bool:
    return SCENARIOS[name].tick_seconds >= 10


def expected_cases(names):
    for name in names:
        for alertname, labels in SCENARIOS[name].expected:
            case_id = f"{name}-{alertname}" + "".join(f"-{v}" for k, v in sorted(labels.items())
                                                    if k in ("reason", "resource", "aer_severity", "pci_bus_id", "gpu"))
            yield pytest.param(name, (alertname, labels), id=case_id.replace(":", "_"))


def silence_cases(names):
    for name in names:
        for door in ("detectors", "rules"):
            yield pytest.param(name, door, id=f"{name}-{door}")


def entity(labels: dict[str, str]) -> tuple:
    """An alert's labels but the target's and the severity: what both doors name alike."""
    return tuple(sorted((k, v) for k, v in labels.items() if k not in ("instance", "job", "severity")))


def assert_fire_within_the_tolerance(name: str, expectation: Expectation, seen: Doors) -> None:
    agent, rules = seen.agent_matching(expectation), seen.rules_matching(expectation)
    assert agent, f"{name}: the detector never fired {expectation}"
    assert rules, f"{name}: the rule never fired {expectation}"
    # The same alerts, with the same labels and severity, from both doors.
    assert {(f.alertname, entity(f.labels), f.severity) for f in agent} == \
        {(f.alertname, entity(f.labels), f.labels["severity"]) for f in rules}
    limit = tolerance(seen.scenario, expectation[0])
    t_agent, t_rule = min(f.first for f in agent), min(f.first for f in rules)
    print(f"fired {name} {expectation[0]} {dict(expectation[1])}: detector {t_agent:g} s, rule {t_rule:g} s")
    assert abs(t_rule - t_agent) <= limit, (
        f"{name} {expectation}: detector fired at {t_agent:g} s, rule at {t_rule:g} s "
        f"({t_rule - t_agent:+g} s; tolerance {limit:g} s)")
    by_entity = {entity(f.labels): f for f in rules}
    for firing in agent:
        rule = by_entity[entity(firing.labels)]
        resolved = seen.rule_resolved(rule)
        assert (firing.resolved is None) == (resolved is None), (
            f"{name} {firing.alertname}{firing.labels}: resolved at {firing.resolved} s by the "
            f"detector, at {resolved} s by the rule")
        if resolved is not None:
            assert abs(resolved - firing.resolved) <= limit


def assert_nothing_unexpected(name: str, door: str, seen: Doors) -> None:
    """Healthy scenarios: nothing at all (their `allowed` is empty). Incidents: only their
    expected and allowed alerts."""
    permitted = seen.scenario.expected + seen.scenario.allowed
    fired = seen.agent if door == "detectors" else seen.rules
    unexpected = [(f.alertname, f.labels, f.first) for f in fired
                  if not any(f.alertname == a and labels.items() <= f.labels.items() for a, labels in permitted)]
    assert not unexpected, f"{name}: the {door} fired what the scenario does not allow: {unexpected}"
