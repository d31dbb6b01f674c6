"""Scenario traces generated once per test session and shared by the tests that replay them."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from hybridmon.agent.config import load_config
from hybridmon.agent.daemon import Agent
from hybridmon.agent.history import History, SeriesHistory
from tests.support.scenarios import SCENARIOS, START_TIME, TraceSummary, history_seconds_for, write_trace


@dataclass
class Replayed:
    records: int
    failures: dict[str, str]
    no_data: dict[str, str]
    history: History


class ScenarioTraces:
    """Traces generated on first use and replayed once, for the whole session."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._summaries: dict[str, TraceSummary] = {}
        self._replays: dict[str, Replayed] = {}

    def summary(self, name: str) -> TraceSummary:
        if name not in self._summaries:
            self._summaries[name] = write_trace(name, self.directory / f"{name}.jsonl.gz")
        return self._summaries[name]

    def replayed(self, name: str) -> Replayed:
        if name not in self._replays:
            self._replays[name] = replay(self.summary(name).path, history_seconds_for(SCENARIOS[name]))
        return self._replays[name]


def replay(path: Path, history_seconds: float) -> Replayed:
    """The replayed history; the detectors stay off (their delays on each scenario are tested with
    the detectors)."""
    overrides = {"history_seconds": history_seconds, "detectors.enabled": False}
    agent = Agent(load_config(environ={}, overrides=overrides), replay_from=path)
    try:
        records = agent.replay(speed=0)
    finally:
        agent.stop()
    items = agent.sampler.scheduled
    return Replayed(records, {i.collector.name: i.state.last_error for i in items if i.state.errors},
                    {i.collector.name: i.state.no_data_reason for i in items if i.state.no_data_reason},
                    agent.history)


# Reading a replayed scenario's history at scenario times (seconds after its first tick).

def one(history: History, metric: str, **labels: str) -> SeriesHistory:
    found = history.series(metric, **labels)
    assert len(found) == 1, f"{metric}{labels}: {len(found)} series"
    return found[0]


def between(series: SeriesHistory, start: float, end: float) -> list[float]:
    """Values at scenario times start <= t < end (seconds after the first tick)."""
    values = [v for t, v in zip(series.times, series.values) if start <= t - START_TIME < end]
    assert values, f"{series.name}{series.labels} has no point in [{start}, {end})"
    return values


def value_at(series: SeriesHistory, t: float) -> float:
    for time, value in zip(series.times, series.values):
        if math.isclose(time - START_TIME, t, abs_tol=1e-6):
            return value
    raise AssertionError(f"{series.name}{series.labels} has no point at t={t}")


def rate(series: SeriesHistory, start: float, end: float) -> float:
    """A counter's average rate per second between two scenario times."""
    return (value_at(series, end) - value_at(series, start)) / (end - start)
