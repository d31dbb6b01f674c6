"""Bounded in-memory history of every sampled value, per collector.

Each collector has one ring of tick times and, per series, a ring of float64 values aligned with it
(NaN where the series was absent that tick). 8 bytes per value keeps 2 h at 1 s of ~500 series near
30 MB (see docs/performance.md); a series absent for a whole retention window is dropped.
"""
from __future__ import annotations

import math
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


class _CollectorRing:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.times = array("d", [math.nan]) * capacity
        self.series: dict[SeriesKey, array] = {}
        self.label_names: dict[str, tuple[str, ...]] = {}
        self.last_seen: dict[SeriesKey, int] = {}
        self.ticks = 0  # commits so far; the next one goes to ticks % capacity

    def commit(self, time: float, samples: Samples) -> None:
        position = self.ticks % self.capacity
        self.times[position] = time
        present = set()
        for sample in samples:
            key = (sample.spec.name, sample.label_values)
            ring = self.series.get(key)
            if ring is None:
                ring = self.series[key] = array("d", [math.nan]) * self.capacity
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
            del self.series[key], self.last_seen[key]
        self.ticks += 1

    def ordered_positions(self) -> range | list[int]:
        if self.ticks <= self.capacity:
            return range(self.ticks)
        start = self.ticks % self.capacity
        return list(range(start, self.capacity)) + list(range(start))


def _kept_positions(ring: _CollectorRing, since: float | None, coarse_before: float | None,
                    coarse_seconds: float) -> list[int] | range:
    positions = ring.ordered_positions()
    if since is None and coarse_before is None:
        return positions
    kept, next_coarse = [], -math.inf
    for position in positions:
        at = ring.times[position]
        if since is not None and at < since:
            continue
        if coarse_before is not None and at < coarse_before:
            if at < next_coarse:
                continue
            next_coarse = at + coarse_seconds
        kept.append(position)
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
                for (series_name, label_values), values in ring.series.items():
                    if series_name != name:
                        continue
                    have = dict(zip(label_names, label_values))
                    if any(have.get(k) != v for k, v in labels.items()):
                        continue
                    # Arrays, not lists: 8 bytes a point instead of a 32-byte float object, which
                    # is most of what an evaluation over hundreds of series allocates.
                    times, kept = array("d"), array("d")
                    for p in positions:
                        value = values[p]
                        if value == value:  # not NaN: present that tick
                            times.append(ring.times[p])
                            kept.append(value)
                    found.append(SeriesHistory(name, have, times, kept))
        return found

    def series_count(self) -> int:
        with self._lock:
            return sum(len(ring.series) for ring in self._rings.values())

    def capacities(self) -> Iterator[tuple[str, int]]:
        with self._lock:
            return iter([(name, ring.capacity) for name, ring in self._rings.items()])
