"""Pure helpers over SeriesHistory: the PromQL functions the detectors need, computed in the agent.

Every window is closed at both ends, [now - window, now], and only points inside it count, so a
detector asked about the past (a replayed trace) never sees the future. The equivalents:

- `avg_over_time(series, now, 60)`   avg_over_time(x[1m])
- `max_over_time(series, now, 60)`   max_over_time(x[1m])
- `latest(series, now)`              an instant selector `x` (the last point at most a minute old)
- `rate(series, now, 60)`            rate(x[1m]); a drop is a counter reset, as in Prometheus
- `increase(series, now, w)`         increase(x[w]) without extrapolation
- `theil_sen_slope(times, values)`   deriv(x[w]), but robust: the median of pairwise slopes,
                                     where deriv() is a least-squares fit that one spike can tilt
- `seconds_until(current, slope, limit)`  predict_linear solved for the time the limit is reached

rate() here divides the increase by the time between the first and last point in the window;
Prometheus extrapolates the increase to the window's edges and divides by the window, which gives
the same per-second rate when samples cover the window.
"""
from __future__ import annotations

import math
from array import array
from bisect import bisect_left, bisect_right, insort
from functools import lru_cache, reduce
from itertools import repeat
from operator import add, le, lt, sub, truediv
from typing import Iterable, Sequence

from hybridmon.agent.detectors import window_arrays
from hybridmon.agent.loop.history import SeriesHistory

AVERAGE_SECONDS = 60.0
"""Gauges are compared as their average over this window, counters as their rate over it."""
INSTANT_LOOKBACK_SECONDS = 60.0
"""A state gauge's current value is its last point at most this old; older means absent."""
TREND_POINTS = 300
"""Theil-Sen looks at most at this many points (n^2/2 pairwise slopes), picked evenly in time."""
LONG_TREND_POINTS = 121
"""For memory growth's hour-long trends: every other point of the hour's 241 at one per 15 s
(memory_growth.trend.TREND_STEP_SECONDS), evenly spaced, one per 30 s; 7,260 pairwise slopes."""
NUMPY_PAIRS_FROM = 40
"""theil_sen_slope hands trends of at least this many points (780 pairs) to window_arrays
(numpy, the same floats ~30x sooner); below it the pure-Python slopes cost less than the setup."""
NUMPY_STEPS_FROM = 8
"""rate_steps hands subqueries of at least this many steps to window_arrays."""
ROWS_PER_PASS = 48
"""rate_steps_of rates at most this many counters sampled on the same ticks in one pass of arrays
(16 processes' CPU time and page faults): a pass costs ~0.3 ms whatever its size up to there, and
48 counters x an hour's 60 steps x a minute's 60 points stay far below window_arrays.MAX_CELLS."""
RUN_BLOCK = 64
"""first_of_latest_run checks this many points at once (by their least and greatest value)."""
MAX_STEPS = 1440
"""Most evaluation times of one subquery: a day of minutes, far more than any detector's window
(thresholds.toml), so the bound only ever cuts a hostile or broken input."""


def window(series: SeriesHistory, now: float, seconds: float) -> tuple[list[float], list[float]]:
    """The times and values of `series` in [now - seconds, now]."""
    start = bisect_left(series.times, now - seconds)
    end = bisect_right(series.times, now)
    return series.times[start:end], series.values[start:end]


def window_since(series: SeriesHistory, now: float, seconds: float,
                 since: float | None) -> tuple[list[float], list[float]]:
    """As `window`, starting no earlier than `since` (e.g. a process's restart) when given."""
    start_time = now - seconds if since is None else max(now - seconds, since)
    return window(series, now, now - start_time)


def avg_over_time(series: SeriesHistory, now: float,
                  seconds: float = AVERAGE_SECONDS) -> float | None:
    """Mean of the points in the window; None when there are none (the series is absent)."""
    _, values = window(series, now, seconds)
    return sum(values) / len(values) if values else None


def max_over_time(series: SeriesHistory, now: float,
                  seconds: float = AVERAGE_SECONDS) -> float | None:
    """Largest point in the window; None when there are none (the series is absent)."""
    _, values = window(series, now, seconds)
    return max(values) if values else None


def latest(series: SeriesHistory, now: float,
           lookback: float = INSTANT_LOOKBACK_SECONDS) -> float | None:
    """The last value at or before `now`, if it is at most `lookback` seconds old."""
    end = bisect_right(series.times, now)
    if end == 0 or now - series.times[end - 1] > lookback:
        return None
    return series.values[end - 1]


def counter_increase(values: Sequence[float]) -> float:
    """Increase over consecutive counter readings; a drop means the counter restarted from 0."""
    if all(map(le, values, values[1:])):
        # No reset (the common case): the same differences added in the same order from 0.0 as
        # the loop below, by reduce() and map() in C.
        return reduce(add, map(sub, values[1:], values), 0.0)
    total = 0.0
    for previous, current in zip(values, values[1:]):
        total += current - previous if current >= previous else current
    return total


def increase(series: SeriesHistory, now: float, seconds: float) -> float | None:
    """Counter increase across the points in the window; None with fewer than two points."""
    _, values = window(series, now, seconds)
    if len(values) < 2:
        return None
    return counter_increase(values)


def rate(series: SeriesHistory, now: float, seconds: float = AVERAGE_SECONDS) -> float | None:
    """Per-second counter rate over the window the way PromQL's rate() computes it, so a detector
    and its rule agree: the increase seen, extrapolated to the window's edges only where samples
    reach near them (by half a sample interval otherwise, never below zero), over the whole
    window. Resets handled; None with fewer than two points (a new series has no rate yet)."""
    times, values = window(series, now, seconds)
    return _rate_in(times, values, now, seconds)


def _rate_in(times: Sequence[float], values: Sequence[float], now: float,
             seconds: float) -> float | None:
    """rate() over the points of its window [now - seconds, now]."""
    if len(values) < 2 or times[-1] <= times[0]:
        return None
    increase = counter_increase(values)
    sampled = times[-1] - times[0]
    average_step = sampled / (len(values) - 1)
    to_start = times[0] - (now - seconds)
    to_end = now - times[-1]
    if increase > 0 and values[0] >= 0:
        # A counter cannot have been below zero: don't extrapolate past where it would be 0.
        to_start = min(to_start, sampled * values[0] / increase)
    threshold = average_step * 1.1
    covered = sampled + (to_start if to_start < threshold else average_step / 2)
    covered += to_end if to_end < threshold else average_step / 2
    return increase * (covered / sampled) / seconds


def step_times(start: float, end: float, step: float = AVERAGE_SECONDS,
               seconds: float = AVERAGE_SECONDS, at_most: int = MAX_STEPS) -> list[float]:
    """The evaluation times of a `[start, end]` subquery with resolution `step` and a window of
    `seconds`, oldest first: end, end - step, ... while a whole window fits after start, the
    newest `at_most` of them. Whatever the input it ends: none for a time or step that is not
    finite or a step that is not positive, and it stops where subtracting `step` no longer
    changes the time (above about 1e16 s a float cannot tell 60 s apart)."""
    if not all(math.isfinite(x) for x in (start, end, step, seconds)) or step <= 0:
        return []
    times: list[float] = []
    at = end
    while at >= start + seconds and len(times) < at_most:
        times.append(at)
        at, previous = at - step, at
        if at >= previous:
            break
    times.reverse()
    return times


def rate_steps(series: SeriesHistory, start: float, end: float, step: float = AVERAGE_SECONDS,
               seconds: float = AVERAGE_SECONDS) -> tuple[list[float], list[float]]:
    """rate(x[seconds]) evaluated every `step` from `end` back to `start`, oldest first, leaving
    out steps without a rate: PromQL's `rate(x[1m])[w:1m]` subquery (times from step_times)."""
    steps = step_times(start, end, step, seconds)
    points, readings = series.times, series.values
    if len(steps) >= NUMPY_STEPS_FROM and len(points) >= 2:
        found = window_arrays.rate_steps(points, [readings], steps, seconds)
        if found is not None:
            return found[0], found[1][0]
    times: list[float] = []
    values: list[float] = []
    for at in steps:
        # rate(series, at, seconds), its window found here: one call less per step
        first, last = bisect_left(points, at - seconds), bisect_right(points, at)
        value = _rate_in(points[first:last], readings[first:last], at, seconds)
        if value is not None:
            times.append(at)
            values.append(value)
    return times, values


def rate_steps_of(series: Sequence[SeriesHistory], start: float, end: float,
                  step: float = AVERAGE_SECONDS, seconds: float = AVERAGE_SECONDS
                  ) -> list[tuple[list[float], list[float]]]:
    """rate_steps of each series; those sampled at the same times (one collector's counters of
    one process: its CPU time and page faults) worked out together, in one pass of arrays."""
    found: list[tuple[list[float], list[float]] | None] = [None] * len(series)
    groups: list[tuple[Sequence[float], list[int]]] = []
    for index, one in enumerate(series):
        for times, members in groups:
            if times is one.times or _same_floats(times, one.times):
                members.append(index)
                break
        else:
            groups.append((one.times, [index]))
    steps = step_times(start, end, step, seconds)
    for times, members in groups:
        if len(members) > 1 and len(steps) >= NUMPY_STEPS_FROM and len(times) >= 2:
            for first in range(0, len(members), ROWS_PER_PASS):
                chunk = members[first:first + ROWS_PER_PASS]
                together = window_arrays.rate_steps(times, [series[i].values for i in chunk], steps,
                                                    seconds)
                if together is None:
                    break
                kept, rates = together
                for index, rate_list in zip(chunk, rates):
                    found[index] = (list(kept), rate_list)
        for index in members:
            if found[index] is None:
                found[index] = rate_steps(series[index], start, end, step, seconds)
    return found  # type: ignore[return-value]


def evenly(count: int, at_most: int) -> list[int]:
    """Up to `at_most` indices of range(count), evenly spread, first and last included."""
    return list(_picked(count, at_most))


@lru_cache(maxsize=256)
def _picked(count: int, at_most: int) -> tuple[int, ...]:
    """evenly(), remembered: every memory trend of an evaluation has about as many points."""
    if count <= at_most:
        return tuple(range(count))
    if at_most < 2:
        return (count - 1,) if at_most == 1 else ()
    return tuple(sorted({round(k * (count - 1) / (at_most - 1)) for k in range(at_most)}))


def theil_sen_slope(times: Sequence[float], values: Sequence[float],
                    max_points: int = TREND_POINTS) -> float | None:
    """Median of the slopes between every pair of points (units of value per second).

    Robust to outliers: up to 29 % of the points can be anything without moving it. With more
    than `max_points` points, evenly spaced ones are used (deterministic), bounding the O(n^2)
    work. None with fewer than two points at distinct times.
    """
    picked = _picked(len(times), max_points)
    xs = [times[i] for i in picked]
    ys = [values[i] for i in picked]
    if len(xs) >= NUMPY_PAIRS_FROM and all(map(lt, xs, xs[1:])):
        return window_arrays.theil_sen_median(xs, ys)
    if len(set(xs)) == len(xs):
        # Every time distinct: each row's slopes computed by map() in C, the same divisions
        # (and so the same floats) as the comprehension below, in the same order.
        slopes: list[float] = []
        for i in range(len(xs) - 1):
            x, y = xs[i], ys[i]
            slopes.extend(map(truediv, map(sub, ys[i + 1:], repeat(y)), map(sub, xs[i + 1:], repeat(x))))
    else:
        slopes = [
            (ys[j] - ys[i]) / (xs[j] - xs[i])
            for i in range(len(xs)) for j in range(i + 1, len(xs)) if xs[j] != xs[i]
        ]
    if not slopes:
        return None
    slopes.sort()
    return _median_of_sorted(slopes)


def theil_sen_slopes(trends: Sequence[tuple[Sequence[float], Sequence[float]]],
                     max_points: int = TREND_POINTS) -> list[float | None]:
    """theil_sen_slope(times, values, max_points) of each (times, values), the same floats: the
    trends whose picked times are the same (one collector samples every process on the same ticks)
    go to window_arrays together, one pass of arrays for them all; the rest one by one."""
    found: list[float | None] = [None] * len(trends)
    together: dict[tuple[float, ...], list[tuple[int, list[float]]]] = {}
    for index, (times, values) in enumerate(trends):
        picked = _picked(len(times), max_points)
        xs = tuple(times[i] for i in picked)
        if len(xs) >= NUMPY_PAIRS_FROM and all(map(lt, xs, xs[1:])):
            together.setdefault(xs, []).append((index, [values[i] for i in picked]))
        else:
            found[index] = theil_sen_slope(times, values, max_points)
    for xs, members in together.items():
        medians = window_arrays.theil_sen_medians(xs, [ys for _, ys in members])
        for (index, _), median in zip(members, medians):
            found[index] = median
    return found


def _median_of_sorted(ordered: Sequence[float]) -> float:
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def theil_sen_below(times: Sequence[float], values: Sequence[float], limit: float,
                    max_points: int = TREND_POINTS, count_pairs: bool = True) -> bool:
    """True when theil_sen_slope(times, values, max_points) is surely below `limit` (False: it
    may not be, compute it). The median slope is below `limit` when at most (pairs - 1) // 2
    pairs have a slope at or above it, and a pair's slope is at or above it where the later
    point's value less limit x its time is at least the earlier one's: counted for all pairs at
    once by sorting those figures (O(n log n), not the n^2/2 slopes), each pair within a margin
    far wider than their rounding counted as at or above, so a True is never wrong. A flat or
    shrinking series, the common case, is ruled out in a fraction of a millisecond.
    count_pairs=False stops before the count (False unless that first glance rules it out): for
    a caller that works out the slope itself when the count leaves it open."""
    picked = _picked(len(times), max_points)
    xs = [times[i] for i in picked]
    ys = [values[i] for i in picked]
    count = len(xs)
    if count < 2 or not all(map(lt, xs, xs[1:])):
        return False   # repeated or falling times: theil_sen_slope's own pairs differ
    origin = xs[0]
    margin = 1e-9 * (max(map(abs, ys)) + abs(limit) * (xs[-1] - origin)) + 1e-300
    if not math.isfinite(margin) or math.isnan(sum(ys)):
        return False   # an infinite or NaN figure: no safe count, compute the slope
    # No pair rises faster than the whole range over the closest two times: memory that holds
    # still (the common case) is ruled out here, in C.
    closest = min(map(sub, xs[1:], xs))
    if limit > 0 and (max(ys) - min(ys) + margin) < limit * closest * (1 - 1e-9):
        return True
    if not count_pairs:
        return False
    offsets = [y - limit * (x - origin) for x, y in zip(xs, ys)]
    if math.isnan(sum(offsets)):
        return False
    allowed = (count * (count - 1) // 2 - 1) // 2   # pairs at or above the limit a median below allows
    at_or_above = 0
    earlier: list[float] = []
    for offset in offsets:
        at_or_above += bisect_right(earlier, offset + margin)
        if at_or_above > allowed:
            return False
        insort(earlier, offset)
    return True


def seconds_until(current: float, slope_per_second: float | None, limit: float) -> float:
    """Time until a value growing linearly from `current` reaches `limit`: 0 when it already has,
    infinity when it does not grow."""
    if current >= limit:
        return 0.0
    if slope_per_second is None or slope_per_second <= 0:
        return math.inf
    return (limit - current) / slope_per_second


def first_of_latest_run(series: SeriesHistory, now: float, tolerance: float = 0.5) -> float | None:
    """Time of the first point of the run of (nearly) equal values that ends with the latest one
    at or before `now`: where a process's start time last changed, i.e. it restarted under the
    same pid. None for an empty series."""
    end = bisect_right(series.times, now)
    if end == 0:
        return None
    values = series.values
    value = values[end - 1]
    first = end - 1
    # A process runs for hours: skip back a block at a time while the whole block is in the run
    # (its least and greatest values are, so every value between them is), each block twice the
    # last, then halve them to close in on the run's first point.
    size = RUN_BLOCK
    while size >= RUN_BLOCK:
        block = values[max(0, first - size):first]
        if block and abs(min(block) - value) <= tolerance and abs(max(block) - value) <= tolerance:
            first -= len(block)
            size *= 2
        else:
            size //= 2
    while first > 0 and abs(values[first - 1] - value) <= tolerance:
        first -= 1
    return series.times[first]


def by_labels(series: Iterable[SeriesHistory], *names: str) -> dict[tuple[str, ...], SeriesHistory]:
    """Series keyed by the values of the given labels (the entity); the last one wins on a tie."""
    absent = ("",) * len(names)
    return {tuple(map(s.labels.get, names, absent)): s for s in series}


def group_by(series: Iterable[SeriesHistory],
             *names: str) -> dict[tuple[str, ...], list[SeriesHistory]]:
    """Series grouped by the values of the given labels, e.g. a GPU's two PCIe directions."""
    groups: dict[tuple[str, ...], list[SeriesHistory]] = {}
    absent = ("",) * len(names)   # each label's value, "" where the series has none: in C
    for one in series:
        groups.setdefault(tuple(map(one.labels.get, names, absent)), []).append(one)
    return groups


def summed(series: Sequence[SeriesHistory]) -> tuple[Sequence[float], list[float]]:
    """Point-wise sum at each time any of the series has a point (absent ones count as 0): one
    process's memory over several GPUs, sampled by the same collector at the same ticks."""
    if (series and all(one.times is series[0].times or _same_floats(one.times, series[0].times)
                       for one in series)
            and all(map(lt, series[0].times, series[0].times[1:]))):
        # One collector's series present on the same ticks have the same times (one shared array
        # within a metric, History.series), rising: sum point by point, in series order from 0.0
        # as the general case below adds them. The times are returned as they are, not copied.
        sums = [0.0] * len(series[0].times)
        for one in series:
            sums = list(map(add, sums, one.values))
        return series[0].times, sums
    totals: dict[float, float] = {}
    for one in series:
        for time, value in zip(one.times, one.values):
            totals[time] = totals.get(time, 0.0) + value
    times = sorted(totals)
    return times, [totals[t] for t in times]


def _same_floats(first: Sequence[float], second: Sequence[float]) -> bool:
    """Whether two sequences of times hold the same floats; two arrays (as History reads them)
    by their bytes, in C (a -0.0 against a 0.0 differs there: the caller only takes its slower,
    general path)."""
    if isinstance(first, array) and isinstance(second, array) and first.typecode == second.typecode:
        return first.tobytes() == second.tobytes()
    return first == second
