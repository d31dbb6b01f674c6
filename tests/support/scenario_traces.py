"""Scenario traces generated once per test session and shared by the tests that replay them.

Generating a trace drives a real agent over the synthetic host for every tick, which is most of
what the scenario tests cost. A trace depends only on the code and fixtures that make it (the
scenario, the simulator, the collectors, the fixture host: tests/integration/test_scenarios.py
checks that the same code generates the same values), so traces are kept under the user's cache
directory keyed by a digest of those files and the installed packages' versions: a warm run of
the same code reuses them, any change to them generates afresh, and the two test workers share
one generation through a lock. HYBRIDMON_SCENARIO_CACHE=0 turns the cache off.
"""
from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from hybridmon.agent.config import load_config
from hybridmon.agent.daemon import Agent
from hybridmon.agent.loop.history import History, SeriesHistory
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
            if os.environ.get("HYBRIDMON_SCENARIO_CACHE") == "0":
                self._summaries[name] = write_trace(name, self.directory / f"{name}.jsonl.gz")
            else:
                self._summaries[name] = cached_trace(name, trace_cache_directory())
        return self._summaries[name]

    def replayed(self, name: str) -> Replayed:
        if name not in self._replays:
            self._replays[name] = replay(self.summary(name).path, history_seconds_for(SCENARIOS[name]))
        return self._replays[name]


REPOSITORY = Path(__file__).resolve().parents[2]
# What a trace is made from: the package, the simulator and the fake NVML, the fixture host.
_TRACE_INPUTS = ("agent", "exporters", "hybridmon", "rules", "tests/support", "tests/fixtures/host-2node",
                 "tests/fixtures/inference", "pyproject.toml")
_CACHES_KEPT = 4  # digests kept side by side (branches in turn); older ones are removed


@functools.lru_cache(maxsize=1)
def trace_cache_directory() -> Path:
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root = cache_home / "hybridmon" / "scenario-traces"
    directory = root / _inputs_digest()
    directory.mkdir(parents=True, exist_ok=True)
    os.utime(directory)
    stale = sorted((d for d in root.iterdir() if d.is_dir() and d != directory),
                   key=lambda d: d.stat().st_mtime, reverse=True)[_CACHES_KEPT - 1:]
    for old in stale:
        shutil.rmtree(old, ignore_errors=True)
    return directory


def _inputs_digest() -> str:
    digest = hashlib.sha256(sys.version.encode())
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
        digest.update(f"{dist.metadata['Name']}=={dist.version}\n".encode())
    for name in _TRACE_INPUTS:
        top = REPOSITORY / name
        files = [top] if top.is_file() else sorted(
            p for p in top.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        for path in files:
            digest.update(str(path.relative_to(REPOSITORY)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:20]


def cached_trace(name: str, directory: Path) -> TraceSummary:
    """The trace of scenario `name` from the cache, generated into it first if missing."""
    trace, summary_file = directory / f"{name}.jsonl.gz", directory / f"{name}.summary.json"
    with open(directory / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker waits for this generation, then reads it
        if trace.exists() and summary_file.exists():
            fields = json.loads(summary_file.read_text())
            return TraceSummary(**{**fields, "path": trace})
        partial = directory / f"{name}.partial.jsonl.gz"
        summary = write_trace(name, partial)
        partial.rename(trace)
        summary = dataclasses.replace(summary, path=trace)
        summary_file.write_text(json.dumps({**dataclasses.asdict(summary), "path": str(trace)}))
        return summary


def replay(path: Path, history_seconds: float) -> Replayed:
    """The replayed history; the detectors stay off (their delays on each scenario are tested with
    the detectors)."""
    overrides = {"history_seconds": history_seconds, "detectors.enabled": False}
    # Every tick kept: the tests read this history as the record of what the simulation sampled.
    agent = Agent(load_config(environ={}, overrides=overrides), replay_from=path, every_tick_history=True)
    try:
        records = agent.replay(speed=0)
    finally:
        agent.stop()
    items = agent.sampler.scheduled
    return Replayed(records, {i.collector.name: i.state.last_error for i in items if i.state.errors},
                    {i.collector.name: i.state.no_data_reason for i in items if i.state.no_data_reason},
                    agent.history)


# Reading a replayed scenario's history at scenario times (seconds after its first tick).

@dataclass(frozen=True)
class Change:
    """A finding's change in a replay with the detectors on: fired or resolved, when (seconds from
    the scenario's start) and the finding as it was then."""

    change: str          # "firing" or "resolved"
    at: float
    finding: object


def replay_changes(path: Path, name: str, evaluation_seconds: float) -> list[Change]:
    """Every finding change of scenario `name`'s trace replayed into an Agent with its detectors
    on, evaluating every `evaluation_seconds` of recorded time, in order."""
    config = load_config(environ={}, overrides={
        "history_seconds": history_seconds_for(SCENARIOS[name]),
        "detectors.evaluation_interval_seconds": evaluation_seconds})
    agent = Agent(config, replay_from=path)
    seen: list[Change] = []

    def remember(state, change: str) -> None:
        at = state.resolved_at if change == "resolved" else state.starts_at
        seen.append(Change(change, at - START_TIME, state.finding))

    agent.engine.on_change.append(remember)
    try:
        agent.replay(speed=0)
    finally:
        agent.stop()
    return seen


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


def latest_at(series: SeriesHistory, t: float) -> float:
    """The value of the last point at or before scenario time t: what a reader sees at t of a
    series collected less often than every tick (exporters/pcie.py, every 5 s)."""
    seen = [v for time, v in zip(series.times, series.values) if time - START_TIME <= t + 1e-6]
    assert seen, f"{series.name}{series.labels} has no point at or before t={t}"
    return seen[-1]


def rate(series: SeriesHistory, start: float, end: float) -> float:
    """A counter's average rate per second between two scenario times, as read at each."""
    return (latest_at(series, end) - latest_at(series, start)) / (end - start)
