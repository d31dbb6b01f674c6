"""The load a watched process's memory growth is set against (agent/alerts/memory_growth/__init__.py):
how fast the work it does rose over the window, from per-minute figures, and whether its page
faults per CPU second climb. The rule's side is rules/process.py (load_rise, fault_slope).

Every figure here is over the trend window that ends at `end`, the last whole minute
(memory_growth.trend.trend_end), not at the evaluation's own time."""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Sequence

from hybridmon.agent.detectors import servers, windows
from hybridmon.agent.loop.history import SeriesHistory

# Prometheus's lookback delta (5 min by default): how far back an instant query, or a subquery's
# step, finds a gauge's last sample.
LOOKBACK_SECONDS = 300.0

# (a process's window start, the per-minute (times, rates) of its CPU time then its fault counters)
Rated = tuple[float, list[tuple[list[float], list[float]]]]


@dataclass(frozen=True)
class Load:
    """A process's load over the window, from per-minute rates: how fast it rose (a share of its
    mean per hour, never below 0) and the means the text reports."""

    rise_per_hour: float | None                   # None: too little history to tell
    source: str                                   # "server" or "cpu"
    faults_rising: bool
    cpu_seconds_per_second: float | None = None   # means over the window
    tokens_per_second: float | None = None
    requests_running: float | None = None
    rises: tuple[tuple[str, float], ...] = ()     # (what, its rise per hour), for the details
    # the rise beyond its noise (memory_growth's rise_noise_z standard errors): what a finding
    # already firing is held against
    confident_rise_per_hour: float | None = None
    window_seconds: float | None = None           # the window whose halves its rise is judged over


def surely_below(times: Sequence[float], values: Sequence[float], per_second: float,
                 count_pairs: bool = True) -> bool:
    """Whether the Theil-Sen slope of slope_per_hour and the detector's judgement is surely below
    `per_second` (positive), a hair under it so that slope x 3600 >= limit x 3600 cannot hold
    where True; count_pairs as windows.theil_sen_below."""
    return per_second > 0 and windows.theil_sen_below(
        times, values, per_second * (1 - 1e-9), windows.LONG_TREND_POINTS, count_pairs)


def slope_per_hour(times: list[float], values: list[float]) -> float | None:
    slope = windows.theil_sen_slope(times, values, windows.LONG_TREND_POINTS)
    return None if slope is None else slope * 3600


def counter_rates(counters: dict[tuple[str, ...], list[SeriesHistory]], starts: dict[tuple[str, ...], float],
                  end: float) -> dict[tuple[str, ...], Rated]:
    """Per process (its key in `starts`, its window's start): the per-minute rates of its counters
    (`counters[key]`: its CPU time, then its page-fault counters). One collector samples them all on
    the same ticks, so every process's counters are rated together, in passes of arrays
    (windows.rate_steps_of), over the steps of the longest window; a process whose window starts
    later (it restarted) keeps the newer steps, the ones its own window has: a step's rate depends
    only on the points in its minute, so each figure is the one a pass of its own gives."""
    if not starts:
        return {}
    every: list[SeriesHistory] = []
    owners: list[tuple[str, ...]] = []
    for key in starts:
        every += counters[key]
        owners += [key] * len(counters[key])
    rated = windows.rate_steps_of(every, min(starts.values()), end)
    found: dict[tuple[str, ...], Rated] = {key: (start, []) for key, start in starts.items()}
    for key, (times, values) in zip(owners, rated):
        first = bisect_left(times, starts[key] + windows.AVERAGE_SECONDS)
        found[key][1].append((times[first:], values[first:]))
    return found


@dataclass(frozen=True)
class Halves:
    """rules.process.HalfWindow's figures: the means of the per-minute points (times and values)
    of a window's newer and older halves, and the variance of the difference of those means."""

    newer_time: float
    newer_mean: float
    older_time: float
    older_mean: float
    variance: float

    @property
    def span(self) -> float:
        return self.newer_time - self.older_time

    @classmethod
    def of(cls, points: list[tuple[float, float]], end: float, window_seconds: float) -> Halves | None:
        """The halves of the window of `window_seconds` ending at `end` (both ends in both halves,
        as a subquery's steps are); None without a point in each or with their mean times apart
        by nothing."""
        half = window_seconds / 2
        newer = [(t, v) for t, v in points if t >= end - half]
        older = [(t, v) for t, v in points if end - 2 * half <= t <= end - half]
        if not newer or not older:
            return None
        (newer_time, newer_mean), (older_time, older_mean) = (
            (sum(t for t, _ in part) / len(part), sum(v for _, v in part) / len(part))
            for part in (newer, older))
        if newer_time <= older_time:
            return None
        # from the scatter of each half's figures about the line (population variances, as
        # PromQL's stddev_over_time, less the line's part: slope^2 x the variance of their times)
        line = (newer_mean - older_mean) / (newer_time - older_time)
        variance = 0.0
        for part, part_mean, part_time in ((newer, newer_mean, newer_time), (older, older_mean, older_time)):
            values_var = sum((v - part_mean) ** 2 for _, v in part) / len(part)
            times_var = sum((t - part_time) ** 2 for t, _ in part) / len(part)
            variance += max(values_var - line * line * times_var, 0.0) / len(part)
        return cls(newer_time, newer_mean, older_time, older_mean, variance)


def minute_points(times: Sequence[float], values: Sequence[float], end: float,
                  window_seconds: float) -> list[tuple[float, float]]:
    """The points a `[window:1m]` subquery ending at `end` (a whole minute) reads of a gauge: at
    each whole minute of the window, the latest point at or before it, within Prometheus's
    lookback delta of it."""
    found = []
    step = end - window_seconds
    while step <= end:
        at = bisect_right(times, step) - 1
        if at >= 0 and step - times[at] <= LOOKBACK_SECONDS:
            found.append((step, values[at]))
        step += 60.0
    return found


def rise_noise_per_hour(times: Sequence[float], values: Sequence[float], end: float,
                        window_seconds: float, noise_z: float) -> float | None:
    """noise_z standard errors of a memory's rise over the halves of the window, in its units per
    hour (rules.process.memory_rise_noise): what the memory's own scatter about its line leaves
    unknown of its rise. None without a point in each half."""
    found = Halves.of(minute_points(times, values, end, window_seconds), end, window_seconds)
    return None if found is None else noise_z * math.sqrt(found.variance) * 3600 / found.span


class LoadJudge:
    """The load of one process at a time, by memory_growth's settings."""

    def __init__(self, window_seconds: float, growth_per_hour_share: float,
                 min_window_seconds: float | None = None, noise_z: float = 0.0) -> None:
        self.window_seconds = window_seconds
        self.noise_z = noise_z
        self.growth_per_hour_share = growth_per_hour_share
        # until the window's older half holds figures, the rise is judged over this one's halves
        self.short_seconds = window_seconds if min_window_seconds is None else min_window_seconds

    def load(self, rated: Rated, tokens: list[SeriesHistory], running: list[SeriesHistory],
             end: float) -> Load | None:
        """The process's load; `rated`: its window's start and the per-minute rates of its CPU
        time then its page faults (counter_rates); `tokens`, `running`: the generation-token
        counters and running-request gauges of the servers tied to it."""
        start, ((times, rates), *fault_rates) = rated
        # the load's rise needs settled figures in the window's older half, else in the older
        # half of the short window (min_window_seconds); until then it is not judged (as in the
        # rule, whose load_rise recording is absent until then)
        window = next((seconds for seconds, reaching in self._windows()
                       if any(times[0] + 60 <= t <= end - reaching for t in times)), None)
        cpu_mean = sum(rates) / len(rates) if rates else None
        token_times, token_rates = servers.summed_rate_steps(tokens, start, end)
        if len(token_rates) >= 2:   # a server is tied to it: its load is the one judged
            # ...and its faults are judged per generated token: the CPU time of vLLM V1's engine
            # core is one busy core whatever the traffic, so per CPU second its faults rise with
            # the traffic (issue 28)
            rising = self._faults_rising(fault_rates, dict(zip(token_times, token_rates)))
            running_times, running_values = servers.summed_average_steps(running, start, end)
            figures = ((token_times, token_rates), (running_times, running_values))
            rises, confident = (() if window is None else tuple(
                (what, rise) for what, (steps, values) in zip(("tokens", "running"), figures)
                if (rise := self._half_window_rise(steps, values, end, window, z)) is not None)
                for z in (0.0, self.noise_z))
            return Load(None if window is None else max([0.0] + [rise for _, rise in rises]), "server",
                        rising, cpu_mean, sum(token_rates) / len(token_rates),
                        sum(running_values) / len(running_values) if running_values else None,
                        rises, None if window is None else max([0.0] + [rise for _, rise in confident]),
                        window)
        if len(rates) < 2:
            return None
        rising = self._faults_rising(fault_rates, dict(zip(times, rates)))
        rise, confident = (None if window is None else self._half_window_rise(times, rates, end, window, z)
                           for z in (0.0, self.noise_z))
        return Load(None if window is None else max(0.0, rise or 0.0), "cpu", rising, cpu_mean,
                    rises=() if rise is None else (("cpu", rise),),
                    confident_rise_per_hour=None if window is None else max(0.0, confident or 0.0),
                    window_seconds=window)

    @property
    def windows_seconds(self) -> tuple[float, ...]:
        """The windows the load's rise may be judged over, over their halves: the whole window,
        and the short one until the whole one's older half fills."""
        return tuple(seconds for seconds, _ in self._windows())

    def _windows(self) -> tuple[tuple[float, float], ...]:
        """(window, how far back its settled figures must reach): the whole window once its
        older half holds as many minutes as the short window's half (a rise from a few minutes of
        figures moves by percents an hour from noise alone), else the short window's halves."""
        return ((self.window_seconds, (self.window_seconds + self.short_seconds) / 2),
                (self.short_seconds, self.short_seconds / 2))

    @staticmethod
    def _half_window_rise(times: list[float], values: list[float], end: float,
                          window_seconds: float, noise_z: float = 0.0) -> float | None:
        """rules.process.half_window_rise: the line through the means (of times and values) of
        the window's newer and older halves, per hour, over the mean of both halves' values,
        less noise_z standard errors of the difference of the means; None without both halves
        or a load."""
        # as the rule's settled recordings: without the first minute of figures
        points = [(t, v) for t, v in zip(times, values) if times and t >= times[0] + 60]
        found = Halves.of(points, end, window_seconds)
        if found is None:
            return None
        mean = (found.newer_mean + found.older_mean) / 2
        if mean <= 0:
            return 0.0   # idle: nothing explains growth
        rise = found.newer_mean - found.older_mean - noise_z * math.sqrt(found.variance)
        return rise * 3600 / found.span / mean

    def _faults_rising(self, fault_rates: list[tuple[list[float], list[float]]], work_rates: dict) -> bool:
        """Page faults (minor + major: per-minute rates of each series, fault_rates) per unit of
        work (work_rates, by step: its server's generation tokens/s where one is tied to it,
        else its CPU seconds per second), minute by minute, rising by at least
        growth_per_hour_share of their mean per hour: a process that faults more for the same
        work is touching memory it did not touch before."""
        cpu_rates = work_rates
        per_step: dict[float, float] = {}
        for steps, rates in fault_rates:
            for time, value in zip(steps, rates):
                per_step[time] = per_step.get(time, 0.0) + value
        times = [t for t in sorted(per_step) if cpu_rates.get(t, 0) > 0]
        intensity = [per_step[t] / cpu_rates[t] for t in times]
        if len(intensity) < 2:
            return False
        mean = sum(intensity) / len(intensity)
        if mean <= 0 or surely_below(times, intensity, self.growth_per_hour_share * mean / 3600):
            return False
        slope = slope_per_hour(times, intensity)
        return slope is not None and mean > 0 and slope >= self.growth_per_hour_share * mean
