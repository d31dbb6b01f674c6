"""Bounded in-memory history of every sampled value, per collector.

Each collector has one ring of tick times and, per series, a ring of float64 values aligned with it
(NaN where the series was absent that tick). 8 bytes per value keeps 2 h at 1 s of ~500 series near
30 MB (see docs/performance.md); a series absent for a whole retention window is dropped.
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
import threading
from array import array
from dataclasses import dataclass
from typing import Iterator, Sequence

from hybridmon.exporters.base import Samples

SeriesKey = tuple[str, tuple[str, ...]]  # (metric name, label values)


@dataclass(frozen=True)
class SeriesHistory:
    """One series' points in time order, absent ticks left out."""

    name: str
    labels: dict[str, str]
    times: Sequence[float]   # array('d'): indexes, slices and iterates like a list
    values: Sequence[float]


@dataclass(frozen=True)
class BucketedSeries:
    """One series cut into equal time buckets (History.bucketed): per bucket the mean of its points
    (for gauges) and its last point (for counters: the rate between two buckets' last points is
    the exact mean rate between them). NaN where the bucket holds no point."""

    name: str
    labels: dict[str, str]
    means: list[float]
    last_times: list[float]
    last_values: list[float]


class _CollectorRing:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.times = array("d", [math.nan]) * capacity
        self.series: dict[SeriesKey, array] = {}
        self.label_names: dict[str, tuple[str, ...]] = {}
        self.last_seen: dict[SeriesKey, int] = {}
        self.ticks = 0  # commits so far; the next one goes to ticks % capacity
        # metric name -> {label values: ring}: a read of one metric visits its own series only
        self.by_name: dict[str, dict[tuple[str, ...], array]] = {}
        # Tick times only ever rise (the sampler's clock, a replay's recorded times): then the
        # points after a time are found by bisection instead of a walk over the whole ring.
        self.times_rise = True
        self._kept_memo: tuple[tuple, list[int]] | None = None

    def commit(self, time: float, samples: Samples) -> None:
        position = self.ticks % self.capacity
        if self.ticks and time < self.times[(self.ticks - 1) % self.capacity]:
            self.times_rise = False
        self.times[position] = time
        present = set()
        for sample in samples:
            key = (sample.spec.name, sample.label_values)
            ring = self.series.get(key)
            if ring is None:
                ring = self.series[key] = array("d", [math.nan]) * self.capacity
                self.by_name.setdefault(sample.spec.name, {})[sample.label_values] = ring
                self.label_names[sample.spec.name] = sample.spec.label_names
            ring[position] = sample.value
            self.last_seen[key] = self.ticks
            present.add(key)
        stale = []
        for key, ring in self.series.items():
            if key in present:
                continue
            ring[position] = math.nan
            if self.ticks - self.last_seen[key] >= self.capacity:
                stale.append(key)
        for key in stale:
            del self.series[key], self.last_seen[key], self.by_name[key[0]][key[1]]
        self.ticks += 1

    def ordered_positions(self) -> range | list[int]:
        if self.ticks <= self.capacity:
            return range(self.ticks)
        start = self.ticks % self.capacity
        return list(range(start, self.capacity)) + list(range(start))


def _bucket_runs(ring: _CollectorRing, start: float, end: float, width: float,
                 buckets: int) -> list[list[tuple[int, int]]]:
    """Per bucket, the ring positions [lo, hi) whose tick times fall in it, oldest first: one run,
    or two where the bucket spans the ring's wrap-around. Tick times rise commit by commit, so the
    edges are found by bisection on the times in order (a C-level copy), not by a walk."""
    capacity = ring.capacity
    if not ring.times_rise:  # a clock stepped back: walk the ring in commit order instead
        return _walked_runs(ring, start, end, width, buckets)
    if ring.ticks <= capacity:
        offset, ordered = 0, ring.times[:ring.ticks]
    else:
        offset = ring.ticks % capacity
        ordered = ring.times[offset:] + ring.times[:offset]
    edges = [bisect_left(ordered, start + i * width) for i in range(buckets)] + [bisect_right(ordered, end)]
    runs = []
    for lo, hi in zip(edges, edges[1:]):
        lo, hi = lo + offset, max(lo, hi) + offset
        if hi <= capacity:
            runs.append([(lo, hi)] if hi > lo else [])
        elif lo >= capacity:
            runs.append([(lo - capacity, hi - capacity)])
        else:
            runs.append([(lo, capacity), (0, hi - capacity)])
    return runs


def _walked_runs(ring: _CollectorRing, start: float, end: float, width: float,
                 buckets: int) -> list[list[tuple[int, int]]]:
    runs: list[list[tuple[int, int]]] = [[] for _ in range(buckets)]
    for position in ring.ordered_positions():
        at = ring.times[position]
        if not start <= at <= end:
            continue
        bucket = runs[min(buckets - 1, int((at - start) / width))]
        if bucket and bucket[-1][1] == position:
            bucket[-1] = (bucket[-1][0], position + 1)
        else:
            bucket.append((position, position + 1))
    return runs


def _last_present(ring: _CollectorRing, values: array, runs: list[tuple[int, int]]) -> tuple[float, float]:
    for lo, hi in reversed(runs):
        for position in range(hi - 1, lo - 1, -1):
            if values[position] == values[position]:
                return ring.times[position], values[position]
    return math.nan, math.nan


def _kept_positions(ring: _CollectorRing, since: float | None, coarse_before: float | None,
                    coarse_seconds: float) -> list[int] | range:
    """Ring positions of the points a read keeps, oldest first: those at or after `since`, and
    before `coarse_before` at most one per `coarse_seconds`. The same for every metric of one
    evaluation, so worked out once per tick and reused."""
    memo_key = (ring.ticks, since, coarse_before, coarse_seconds)
    if ring._kept_memo is not None and ring._kept_memo[0] == memo_key:
        return ring._kept_memo[1]
    kept = (_kept_by_bisection(ring, since, coarse_before, coarse_seconds) if ring.times_rise
            else _kept_by_walking(ring, since, coarse_before, coarse_seconds))
    ring._kept_memo = (memo_key, kept)
    return kept


def _kept_by_walking(ring: _CollectorRing, since: float | None, coarse_before: float | None,
                     coarse_seconds: float) -> list[int]:
    kept, next_coarse = [], -math.inf
    for position in ring.ordered_positions():
        at = ring.times[position]
        if since is not None and at < since:
            continue
        if coarse_before is not None and at < coarse_before:
            if at < next_coarse:
                continue
            next_coarse = at + coarse_seconds
        kept.append(position)
    return kept


def _kept_by_bisection(ring: _CollectorRing, since: float | None, coarse_before: float | None,
                       coarse_seconds: float) -> list[int]:
    """As _kept_by_walking on a ring whose times rise: O(kept x log n) instead of O(n), so a
    read costs what it returns, not what the history holds."""
    count = min(ring.ticks, ring.capacity)
    first = ring.ticks - count  # the oldest tick still held
    capacity, times = ring.capacity, ring.times

    def time_of(tick: int) -> float:
        return times[tick % capacity]

    ticks = range(first, ring.ticks)
    at = first if since is None else first + bisect_left(ticks, since, key=time_of)
    fine_from = at if coarse_before is None else max(
        at, first + bisect_left(ticks, coarse_before, key=time_of))
    kept = []
    while at < fine_from:  # one point per coarse_seconds: jump to the first at or after the next step
        kept.append(at % capacity)
        at = max(at + 1, bisect_left(ticks, time_of(at) + coarse_seconds, key=time_of) + first)
    kept.extend(tick % capacity for tick in range(fine_from, ring.ticks))  # a jump may pass fine_from
    return kept


class History:
    """Thread-safe store of the latest samples and the bounded history of every collector."""

    def __init__(self, retention_seconds: float) -> None:
        self.retention_seconds = retention_seconds
        self._rings: dict[str, _CollectorRing] = {}
        self._latest: dict[str, tuple[float, Samples]] = {}
        self._lock = threading.Lock()

    def add_collector(self, collector_name: str, interval_seconds: float) -> None:
        capacity = max(2, math.ceil(self.retention_seconds / interval_seconds))
        with self._lock:
            self._rings[collector_name] = _CollectorRing(capacity)

    def commit(self, collector_name: str, time: float, samples: Samples) -> None:
        with self._lock:
            self._rings[collector_name].commit(time, samples)
            self._latest[collector_name] = (time, samples)

    def latest(self) -> dict[str, tuple[float, Samples]]:
        """Per collector: the time and samples of its last successful run."""
        with self._lock:
            return dict(self._latest)

    def series(
        self,
        name: str,
        /,
        since: float | None = None,
        coarse_before: float | None = None,
        coarse_seconds: float = 0.0,
        **labels: str,
    ) -> list[SeriesHistory]:
        """Every series of metric `name` whose labels include `labels`, oldest point first.

        `since` leaves out points before that time. Before `coarse_before`, at most one point per
        `coarse_seconds` is kept: an hour-long trend needs a point every 15 s (a Prometheus
        scrape), not every second, and copying 3,600 points of hundreds of series every
        evaluation costs more CPU and memory than the rest of the agent.
        """
        found = []
        with self._lock:
            for ring in self._rings.values():
                label_names = ring.label_names.get(name)
                if label_names is None:
                    continue
                positions = _kept_positions(ring, since, coarse_before, coarse_seconds)
                all_times = None
                for label_values, values in ring.by_name.get(name, {}).items():
                    have = dict(zip(label_names, label_values))
                    if any(have.get(k) != v for k, v in labels.items()):
                        continue
                    # Arrays, not lists: 8 bytes a point instead of a 32-byte float object, which
                    # is most of what an evaluation over hundreds of series allocates. Copied by
                    # map() in C; a series present on every kept tick (most are) shares one times
                    # array, the others leave their absent (NaN) ticks out.
                    kept = array("d", map(values.__getitem__, positions))
                    if not any(map(math.isnan, kept)):
                        if all_times is None:
                            all_times = array("d", map(ring.times.__getitem__, positions))
                        found.append(SeriesHistory(name, have, all_times, kept))
                        continue
                    times, present = array("d"), array("d")
                    for p, value in zip(positions, kept):
                        if value == value:  # not NaN: present that tick
                            times.append(ring.times[p])
                            present.append(value)
                    found.append(SeriesHistory(name, have, times, present))
        return found

    def bucketed(self, name: str, /, start: float, end: float, buckets: int,
                 **labels: str) -> list[BucketedSeries]:
        """Every series of metric `name` whose labels include `labels`, cut into `buckets` equal
        spans of [start, end]. For plots (agent/status_plots.py): each bucket is worked out once
        per collector as runs of ring positions, then read from every series as array slices (C
        speed), not point by point: an hour at 1 s of ~20 series costs a few ms, not tens."""
        width = (end - start) / buckets
        found = []
        with self._lock:
            for ring in self._rings.values():
                label_names = ring.label_names.get(name)
                if label_names is None:
                    continue
                runs = _bucket_runs(ring, start, end, width, buckets)
                for (series_name, label_values), values in ring.series.items():
                    if series_name != name:
                        continue
                    have = dict(zip(label_names, label_values))
                    if any(have.get(k) != v for k, v in labels.items()):
                        continue
                    means, last_times, last_values = [], [], []
                    for bucket_runs in runs:
                        present = [v for lo, hi in bucket_runs for v in values[lo:hi] if v == v]  # NaN: absent
                        means.append(sum(present) / len(present) if present else math.nan)
                        at, value = _last_present(ring, values, bucket_runs)
                        last_times.append(at)
                        last_values.append(value)
                    found.append(BucketedSeries(name, have, means, last_times, last_values))
        return found

    def series_count(self) -> int:
        with self._lock:
            return sum(len(ring.series) for ring in self._rings.values())

    def capacities(self) -> Iterator[tuple[str, int]]:
        with self._lock:
            return iter([(name, ring.capacity) for name, ring in self._rings.items()])
