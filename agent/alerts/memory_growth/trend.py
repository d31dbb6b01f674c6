"""What memory_growth judges a process's trend on, and the trends it keeps from one evaluation to
the next (issue 17: an evaluation's cost must not grow with the history).

The trend window ends at the last whole minute, as the rule's `[1h:1m]` subqueries do (Prometheus
aligns their steps to absolute time, so the rule's slope moves once a minute too), and it holds
one point per 15 s (engine.COARSE_STEP_SECONDS), what a Prometheus scrape holds: History reads a
two-tier collector's coarse tier alone for it (History.series_every), so the points are evenly
spread in time over the whole hour. (An hour read as the other detectors read it, every tick of
its last 10 minutes and one per 15 s before, gave those 10 minutes 70 % of the 150 points the
Theil-Sen slope picks; and which ticks it held moved at every evaluation.)

Such a window holds the same points at each of the six evaluations of its minute: the slopes,
per-minute rates and load worked out at the first are kept and the five that follow reuse them.
Each reuse is checked first against the points the window holds now: the count and first and
last times of every series it read (a tick's value never changes once written), so a late
commit, a restart or a replay that goes back in time gets its trend worked out anew.
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

from hybridmon.agent.detectors.base import HistoryReader
from hybridmon.agent.detectors import common, servers, windows
from hybridmon.agent.detectors.engine import COARSE_STEP_SECONDS
from hybridmon.agent.loop.history import SeriesHistory
from hybridmon.agent.alerts.memory_growth.load import Load
from hybridmon.exporters.gpu import PROCESS_MEMORY_USED
from hybridmon.exporters.process import (CPU_SECONDS, LOCKED, MAJOR_FAULTS, MINOR_FAULTS, PINNED, RESIDENT,
                                         START_TIME)

TREND_STEP_SECONDS = COARSE_STEP_SECONDS
GRID_SECONDS = 60.0

ProcessKey = tuple[str, ...]   # (pid, process_name)


def trend_end(now: float) -> float:
    """The end of the trend window of an evaluation at `now`: the last whole minute."""
    return math.floor(now / GRID_SECONDS) * GRID_SECONDS


class Inputs:
    """memory_growth's series in one evaluation, one point per TREND_STEP_SECONDS from `since`
    on, by process: (pid, process_name), or (pid,) for NVML's memory and the servers' figures."""

    def __init__(self, history: HistoryReader, since: float) -> None:
        def read(name: str) -> list[SeriesHistory]:
            return history.series_every(name, TREND_STEP_SECONDS, since=since)

        labels = common.PROCESS_LABELS
        self.cpu = windows.by_labels(read(CPU_SECONDS.name), *labels)
        self.resident = windows.by_labels(read(RESIDENT.name), *labels)
        self.locked = windows.group_by(read(LOCKED.name) + read(PINNED.name), *labels)
        self.gpu_memory = windows.group_by(read(PROCESS_MEMORY_USED.name), "pid")
        self.start_times = windows.group_by(read(START_TIME.name), *labels)
        faults = windows.group_by(read(MINOR_FAULTS.name) + read(MAJOR_FAULTS.name), *labels)
        # CPU time first, then the page-fault counters: memory_growth.load.counter_rates' order
        self.counters = {key: [cpu, *faults.get(key, ())] for key, cpu in self.cpu.items()}
        self.tokens = windows.group_by(read(servers.GENERATED_TOKENS), "pid")
        self.running = windows.group_by(read(servers.REQUESTS_RUNNING), "pid")

    def restart_time(self, key: ProcessKey, now: float) -> float | None:
        """When the process now running as this pid was first seen with its current start time:
        points before it belong to an earlier process that had the same pid."""
        for series in self.start_times.get(key, ()):
            return windows.first_of_latest_run(series, now)
        return None

    def servers_of(self, pids: set[str]) -> tuple[list[SeriesHistory], list[SeriesHistory]]:
        """The generation-token counters and running-request gauges of the servers at `pids`."""
        ordered = sorted(pids)
        return ([s for pid in ordered for s in self.tokens.get((pid,), ())],
                [s for pid in ordered for s in self.running.get((pid,), ())])


@dataclass(frozen=True)
class Growing:
    """One resource of a process whose slope may reach its threshold (memory_growth's glance
    and slope): what the judgement at each evaluation needs of its trend."""

    resource: str
    label_name: str          # the alert's process_name
    mean: float
    slope: float             # bytes per second, > 0
    window_seconds: float    # between the window's first and last points
    recent_slope: float      # bytes per second over the window's last recent_seconds
    newest_slope: float      # ...and over the last half of those
    # (window, rise_noise_z standard errors of its rise over that window's halves, bytes per hour)
    noise: tuple[tuple[float, float | None], ...] = ()

    def noise_over(self, window_seconds: float | None) -> float | None:
        return next((noise for seconds, noise in self.noise if seconds == window_seconds), None)


@dataclass(frozen=True)
class Trend:
    """A process's trend over one window: its resources that may grow, and (only where there are
    any) its load."""

    growing: tuple[Growing, ...]
    load: Load | None


def points_held(series: SeriesHistory, start: float, end: float) -> tuple[float, ...]:
    """What tells the points of `series` in [start, end] apart from any other set it can hold:
    their count and first and last times (tick times rise, and a tick's value never changes)."""
    times = series.times
    first, last = bisect_left(times, start), bisect_right(times, end)
    return (last - first, times[first], times[last - 1]) if last > first else (0,)


def trend_signature(since: float | None, start: float, end: float, tied: set[str],
                    judged: dict[str, tuple[str, list[SeriesHistory]]],
                    others: tuple[list[SeriesHistory], ...]) -> tuple:
    """What a process's trend over [start, end] is worked out from: its restart time, the server
    pids tied to it, the points of each resource judged (with the series' labels: a GPU's
    memory), and those of its counters and its servers' series."""
    return (since, end, tuple(sorted(tied)),
            tuple((resource, label_name, tuple((tuple(s.labels.values()), points_held(s, start, end))
                                               for s in series))
                  for resource, (label_name, series) in judged.items()),
            tuple(tuple(points_held(s, start, end) for s in group) for group in others))


class TrendMemory:
    """The trends of the last evaluation, per process, each with the signature of the points it
    was worked out from; those of one history only (a detector asked about another forgets)."""

    def __init__(self) -> None:
        self._history: object | None = None
        self._trends: dict[ProcessKey, tuple[tuple, Trend]] = {}

    def begin(self, history: HistoryReader) -> None:
        owner = history.source  # an evaluation's view is new each time; its History is not
        if owner is not self._history:
            self._history, self._trends = owner, {}

    def recall(self, key: ProcessKey, signature: tuple) -> Trend | None:
        kept = self._trends.get(key)
        return kept[1] if kept is not None and kept[0] == signature else None

    def keep(self, trends: dict[ProcessKey, tuple[tuple, Trend]]) -> None:
        """This evaluation's trends, recalled or new, replacing the last ones (processes gone are
        forgotten: the memory holds at most one trend per watched process)."""
        self._trends = trends
