"""Bounded in-memory history of every sampled value, per collector.

Each collector has one ring of tick times and, per series, a ring of float64 values aligned with it
(NaN where the series was absent that tick); a series absent for a whole ring is dropped from it.

Two tiers where the agent asks for them (History(full_resolution_seconds=...)): a collector that
runs faster than the coarse step keeps every tick for the last `full_resolution_seconds` only, and
for the whole retention one tick per `coarse_step_seconds` (each the first at least a step after
the one before, so evenly spaced whatever the tick: a Prometheus scrape's view). The detectors
read every sample of their last 10 minutes and one per 15 s before that
(agent/detectors/engine.py), so 2 h at 1 s was 7,200 values a series of which an evaluation ever
read about 1,070: on a host with 8 GPUs and 64 watched processes that was 62 MiB of rings
(issue 17), now about 11 MiB. The rings and the reads over them: agent/loop/history_rings.py.
"""
from __future__ import annotations

import math
import threading
from typing import Iterator

from hybridmon.agent.loop.history_rings import (  # noqa: F401 (SeriesKey, _kept_by_*: re-exported for tests)
    BucketedSeries, SeriesHistory, SeriesKey, _bucket_points, _bucket_runs, _CollectorRing, _kept_by_bisection,
    _kept_by_walking, _kept_positions, _last_present, _positions_from, _read_parts, _tier_parts)
from hybridmon.exporters.base import Samples


class History:
    """Thread-safe store of the latest samples and the bounded history of every collector."""

    def __init__(self, retention_seconds: float, full_resolution_seconds: float | None = None,
                 coarse_step_seconds: float = 15.0) -> None:
        """`full_resolution_seconds`: keep every tick only this long, and one per
        `coarse_step_seconds` for the rest of `retention_seconds` (the module docstring says
        why); None keeps every tick for the whole retention."""
        self.retention_seconds = retention_seconds
        self.full_resolution_seconds = full_resolution_seconds
        self.coarse_step_seconds = coarse_step_seconds
        self._rings: dict[str, _CollectorRing] = {}
        self._coarse: dict[str, _CollectorRing] = {}     # only for the collectors with two tiers
        self._coarse_last_at: dict[str, float] = {}      # the time of each one's last coarse commit
        self._latest: dict[str, tuple[float, Samples]] = {}
        # collector -> (its tiers' keys_version, its series count): see series_count
        self._series_counts: dict[str, tuple[tuple[int, int], int]] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        """Picklable (a benchmark keeps the history at 10 minutes to time it beside the one at
        2 hours): everything but the lock, which __setstate__ makes anew."""
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def add_collector(self, collector_name: str, interval_seconds: float) -> None:
        two_tiers = (self.full_resolution_seconds is not None
                     and interval_seconds < self.coarse_step_seconds
                     and self.full_resolution_seconds < self.retention_seconds)
        fine_seconds = self.full_resolution_seconds if two_tiers else self.retention_seconds
        with self._lock:
            # +1: a full window of ticks spans one interval less than its length
            self._rings[collector_name] = _CollectorRing(
                max(2, math.ceil(fine_seconds / interval_seconds) + (1 if two_tiers else 0)))
            if two_tiers:
                self._coarse[collector_name] = _CollectorRing(
                    math.ceil(self.retention_seconds / self.coarse_step_seconds) + 1)
                self._coarse_last_at[collector_name] = math.inf  # none yet: the first tick is kept

    def commit(self, collector_name: str, time: float, samples: Samples) -> None:
        with self._lock:
            self._rings[collector_name].commit(time, samples)
            coarse = self._coarse.get(collector_name)
            if coarse is not None:
                last = self._coarse_last_at[collector_name]
                # The first tick at least a step after the last one kept (or one before it: the
                # clock stepped back): every 15th tick at 1 s, every 2nd at 10 s, evenly spaced.
                if not last <= time < last + self.coarse_step_seconds:
                    coarse.commit(time, samples)
                    self._coarse_last_at[collector_name] = time
            self._latest[collector_name] = (time, samples)

    def move_times(self, step: float) -> None:
        """The wall clock stepped by `step` seconds: every time held moves with it, so the ticks
        stay in order and the spans between them hold (agent/daemon.py: issue 30). Without it, the
        ticks stamped before a step back would sit in the future of every window after it."""
        with self._lock:
            for ring in (*self._rings.values(), *self._coarse.values()):
                ring.move_times(step)
            self._coarse_last_at = {name: at + step for name, at in self._coarse_last_at.items()}
            self._latest = {name: (at + step, samples) for name, (at, samples) in self._latest.items()}

    @property
    def source(self) -> "History":
        """Itself: what a reader of the history reads (detectors.base.HistoryReader), as the engine's
        view of one evaluation names the History it reads."""
        return self

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
        keep_from: float | None = None,
        **labels: str,
    ) -> list[SeriesHistory]:
        """Every series of metric `name` whose labels include `labels`, oldest point first.

        `since` leaves out points before that time. Before `coarse_before`, at most one point per
        `coarse_seconds` is kept: an hour-long trend needs a point every 15 s (a Prometheus
        scrape), not every second, and copying 3,600 points of hundreds of series every
        evaluation costs more CPU and memory than the rest of the agent. `keep_from` then leaves
        out the kept points before it: a reader of the last 10 minutes gets exactly the points a
        reader of the last 2 hours gets in those 10 minutes (the coarse steps still counted from
        `since`), without copying the rest.
        """
        found = []
        with self._lock:
            for collector, ring in self._rings.items():
                coarse = self._coarse.get(collector)
                label_names = ring.label_names.get(name)
                if label_names is None and coarse is not None:
                    label_names = coarse.label_names.get(name)
                if label_names is None:
                    continue
                parts = ([(ring, _kept_positions(ring, since, coarse_before, coarse_seconds))] if coarse is None
                         else _tier_parts(ring, coarse, self.coarse_step_seconds, since, coarse_before,
                                          coarse_seconds))
                if keep_from is not None:
                    parts = [(part_ring, _positions_from(part_ring, kept, keep_from)) for part_ring, kept in parts]
                found.extend(_read_parts(name, label_names, parts, labels))
        return found

    def series_every(self, name: str, /, step_seconds: float, since: float | None = None,
                     **labels: str) -> list[SeriesHistory]:
        """As series(), one point per `step_seconds` over the whole span, the newest minutes too:
        what a Prometheus scrape every `step_seconds` holds. A two-tier collector's points are
        then its coarse tier's alone, so a window over them holds the same points whenever it is
        read: an hour-long trend worked out over one need not be worked out again until the
        window moves (agent/alerts/memory_growth/trend.py)."""
        return self.series(name, since=since, coarse_before=math.inf, coarse_seconds=step_seconds,
                           **labels)

    def bucketed(self, name: str, /, start: float, end: float, buckets: int,
                 **labels: str) -> list[BucketedSeries]:
        """Every series of metric `name` whose labels include `labels`, cut into `buckets` equal
        spans of [start, end]. For plots (agent/status/plots.py): each bucket is worked out once
        per collector as runs of ring positions, then read from every series as array slices (C
        speed), not point by point: an hour at 1 s of ~20 series costs a few ms, not tens."""
        width = (end - start) / buckets
        found = []
        with self._lock:
            for collector, ring in self._rings.items():
                coarse = self._coarse.get(collector)
                if coarse is not None:  # ~1,100 points a series at most: bucketed point by point
                    label_names = ring.label_names.get(name, coarse.label_names.get(name))
                    if label_names is not None:
                        parts = _tier_parts(ring, coarse, self.coarse_step_seconds, start, None, 0.0)
                        found.extend(_bucket_points(one, start, end, width, buckets)
                                     for one in _read_parts(name, label_names, parts, labels))
                    continue
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
        """Series held in either tier. Each collector's count is kept until a commit adds or drops
        one of its series: every scrape reads it (hybridmon_history_series), and the union of two
        tiers' keys at each was a seventh of a scrape's CPU at 256 watched processes (issue 33)."""
        with self._lock:
            total = 0
            for name, ring in self._rings.items():
                coarse = self._coarse.get(name)
                version = (ring.keys_version, -1 if coarse is None else coarse.keys_version)
                known = self._series_counts.get(name)
                if known is None or known[0] != version:
                    keys = ring.series.keys() | (coarse.series.keys() if coarse is not None else set())
                    known = self._series_counts[name] = (version, len(keys))
                total += known[1]
            return total

    def value_bytes(self) -> int:
        """Bytes of the value rings, both tiers: what the history's retention costs in memory."""
        with self._lock:
            return sum(8 * ring.capacity * len(ring.series)
                       for ring in [*self._rings.values(), *self._coarse.values()])

    def capacities(self) -> Iterator[tuple[str, int]]:
        with self._lock:
            return iter([(name, ring.capacity) for name, ring in self._rings.items()])
