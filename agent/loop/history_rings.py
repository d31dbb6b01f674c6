"""The rings behind agent/loop/history.py and the reads over them: which ring positions a read keeps
(by bisection on rising tick times), how a two-tier collector's coarse and fine rings are joined,
and the copies out of them (C-level slices and map() rather than Python loops)."""
from __future__ import annotations

import math
from array import array
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from itertools import repeat
from operator import add, ge
from typing import Sequence

from hybridmon.exporters.base import MetricSpec, Samples

SeriesKey = tuple[str, tuple[str, ...]]  # (metric name, label values)
# Read plans (_kept_positions) remembered per ring and tick: an evaluation reads a ring in a few
# ways (the detectors' view, memory growth's one point per 15 s, the status page's plots).
KEPT_PLANS = 4


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
        self.keys_version = 0  # moves whenever a series is added or dropped (History.series_count)
        # metric name -> {label values: ring}: a read of one metric visits its own series only
        self.by_name: dict[str, dict[tuple[str, ...], array]] = {}
        # Tick times only ever rise (the sampler's clock, a replay's recorded times): then the
        # points after a time are found by bisection instead of a walk over the whole ring.
        self.times_rise = True
        self._kept_memo: tuple[int, dict[tuple, tuple[list[int], int]]] | None = None  # (ticks, plans)
        # The last commit's samples in order, each with its ring, when they were every series
        # once: a collector emits the same series in the same order tick after tick, so a commit
        # whose samples match it writes each value by position, without hashing three keys a
        # sample (see commit). `_layout_seen` stands for those series' last_seen meanwhile.
        self._layout: list[tuple[MetricSpec, tuple[str, ...], array]] | None = None
        self._layout_seen = -1

    def move_times(self, step: float) -> None:
        """Every tick's time moved by `step` (the wall clock stepped): the order and the spans
        between ticks are kept; the plans of kept positions, keyed by absolute times, are not."""
        times = self.times
        for position in range(min(self.ticks, self.capacity)):
            times[position] += step
        self._kept_memo = None

    def commit(self, time: float, samples: Samples) -> None:
        ticks = self.ticks
        position = ticks % self.capacity
        if ticks and time < self.times[(ticks - 1) % self.capacity]:
            self.times_rise = False
        self.times[position] = time
        if self._commit_by_layout(samples, position):
            self._layout_seen = ticks
            self.ticks = ticks + 1
            return
        self._end_layout()
        # Locals and tuple unpacking: ~500 samples a tick on the 8-GPU host pass through here.
        series, last_seen = self.series, self.last_seen
        series_get, present_add = series.get, (present := set()).add
        for spec, label_values, value in samples:
            key = (spec.name, label_values)
            ring = series_get(key)
            if ring is None:
                ring = series[key] = array("d", [math.nan]) * self.capacity
                self.by_name.setdefault(spec.name, {})[label_values] = ring
                self.keys_version += 1
                self.label_names[spec.name] = spec.label_names
            ring[position] = value
            last_seen[key] = ticks
            present_add(key)
        # Every series present this tick (most ticks): none to blank and none gone stale, so the
        # walk over all of them is skipped. A series already in the ring that is present is in
        # `present`, so equal sizes mean no series was absent.
        if len(present) != len(series):
            stale = []
            for key, ring in series.items():
                if key in present:
                    continue
                ring[position] = math.nan
                if ticks - last_seen[key] >= self.capacity:
                    stale.append(key)
            for key in stale:
                del series[key], last_seen[key], self.by_name[key[0]][key[1]]
            self.keys_version += len(stale)
        elif len(samples) == len(series):  # each series once: the next commit may match by position
            self._layout = [(spec, label_values, series[spec.name, label_values])
                            for spec, label_values, _ in samples]
        self.ticks = ticks + 1

    def _commit_by_layout(self, samples: Samples, position: int) -> bool:
        """Write the samples by position when they are the layout's series in its order (same
        MetricSpec object, equal label values): True when done. A mismatch part way leaves
        some values written, which the full commit that follows writes again."""
        layout = self._layout
        if layout is None or len(layout) != len(samples):
            return False
        for (spec, label_values, value), (known_spec, known_labels, ring) in zip(samples, layout):
            if spec is not known_spec or label_values != known_labels:
                return False
            ring[position] = value
        return True

    def _end_layout(self) -> None:
        """Before a full commit: the layout's series were last seen at its last commit."""
        if self._layout is not None and self._layout_seen >= 0:
            for spec, label_values, _ in self._layout:
                self.last_seen[spec.name, label_values] = self._layout_seen
        self._layout, self._layout_seen = None, -1

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
                    coarse_seconds: float) -> tuple[list[int], int]:
    """Ring positions of the points a read keeps, oldest first: those at or after `since`, and
    before `coarse_before` at most one per `coarse_seconds`; and the index from which they are
    consecutive ticks (the full-resolution part, copied as array slices). The same for every
    metric of one evaluation, so worked out once per tick and reused."""
    memo_key = (since, coarse_before, coarse_seconds)
    if ring._kept_memo is None or ring._kept_memo[0] != ring.ticks:
        ring._kept_memo = (ring.ticks, {})
    kept_by_read = ring._kept_memo[1]
    parts = kept_by_read.get(memo_key)
    if parts is not None:
        return parts
    if ring.times_rise:
        parts = _kept_split(ring, since, coarse_before, coarse_seconds)
    else:
        kept = _kept_by_walking(ring, since, coarse_before, coarse_seconds)
        parts = (kept, len(kept))   # a clock that stepped back: no consecutive part assumed
    if len(kept_by_read) >= KEPT_PLANS:   # the oldest goes (a replay reads one tick many ways)
        del kept_by_read[next(iter(kept_by_read))]
    kept_by_read[memo_key] = parts
    return parts


def _gather(source: array, positions: list[int], fine: int, capacity: int) -> array:
    """source's values at `positions`, those from index `fine` on being consecutive ticks: the
    scattered ones by map() in C, the consecutive ones as one or two slices (a memory copy)."""
    if fine and positions[fine - 1] - positions[0] == fine - 1:
        # every tick kept and none wrapping round (a coarse tier read a step at a time): a slice
        out = source[positions[0]:positions[fine - 1] + 1]
    else:
        out = array("d", map(source.__getitem__, positions[:fine]))
    if fine < len(positions):
        lo, hi = positions[fine], positions[-1] + 1
        if hi > lo:
            out += source[lo:hi]
        else:   # the run wraps round the ring's end
            out += source[lo:capacity]
            out += source[:hi]
    return out


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
    return _kept_split(ring, since, coarse_before, coarse_seconds)[0]


def _kept_split(ring: _CollectorRing, since: float | None, coarse_before: float | None,
                coarse_seconds: float) -> tuple[list[int], int]:
    """_kept_by_bisection's positions, and the index from which they are every tick to the
    newest (the full-resolution part). The tick times are copied once in tick order (a C-level
    copy of the ring), so every bisection runs in C: the coarse part takes one per point kept, and
    a bisection keyed by a Python function cost ~13 calls each (2 M calls a minute on the 8-GPU
    host at 2 h of history)."""
    count = min(ring.ticks, ring.capacity)
    first = ring.ticks - count  # the oldest tick still held
    capacity = ring.capacity
    start = first % capacity
    ordered = (ring.times[start:start + count] if start + count <= capacity
               else ring.times[start:] + ring.times[:start + count - capacity])
    at = 0 if since is None else bisect_left(ordered, since)
    fine_from = at if coarse_before is None else max(at, bisect_left(ordered, coarse_before))
    if fine_from > at and all(map(ge, ordered[at + 1:fine_from], map(add, ordered[at:fine_from - 1],
                                                                    repeat(coarse_seconds)))):
        # Each tick is at least a step after the one before (a coarse tier; a collector slower
        # than the step): the walk below would keep them all, one bisection each. The same
        # comparisons, made in C, say so; all of them are then one run of positions.
        fine_from = at
    kept = []
    while at < fine_from:  # one point per coarse_seconds: jump to the first at or after the next step
        kept.append((first + at) % capacity)
        at = bisect_left(ordered, ordered[at] + coarse_seconds, at + 1)
    fine = len(kept)
    # every tick from fine_from to the newest (a jump may have passed it), as one or two ranges
    lo, hi = (first + fine_from) % capacity, (first + count) % capacity or capacity
    if fine_from < count:
        kept += range(lo, hi) if lo < hi else [*range(lo, capacity), *range(hi)]
    return kept, fine


def _positions_from(ring: _CollectorRing, parts: tuple[list[int], int],
                    keep_from: float) -> tuple[list[int], int]:
    """The tail of the kept positions (oldest first) whose tick times are at or after
    `keep_from`, and the index its consecutive part starts at: by bisection where tick times
    rise, else by a walk."""
    positions, fine = parts
    times = ring.times
    if ring.times_rise:
        cut = bisect_left(positions, keep_from, key=times.__getitem__)
        return positions[cut:], max(0, fine - cut)
    kept = [p for p in positions if times[p] >= keep_from]
    return kept, len(kept)


Kept = tuple[list[int], int]  # ring positions oldest first, and where their every-tick run starts


def _tier_parts(fine: _CollectorRing, coarse: _CollectorRing, step: float, since: float | None,
                coarse_before: float | None, coarse_seconds: float) -> list[tuple[_CollectorRing, Kept]]:
    """Where a read of a two-tier collector finds its points: the coarse tier before a boundary,
    the fine one from it. The boundary is where the fine ring starts, or later where the read asks
    for no more than one point per coarse step before `coarse_before` (the detectors do)."""
    fine_start = _oldest_time(fine)
    if coarse_before is not None and coarse_seconds >= step:
        boundary = max(fine_start, coarse_before)
        coarse_kept = _kept_positions(coarse, since, boundary, coarse_seconds)
        fine_kept = _kept_positions(fine, boundary if since is None else max(since, boundary), None, 0.0)
    else:
        boundary = fine_start
        coarse_kept = _kept_positions(coarse, since, None, 0.0)
        fine_kept = _kept_positions(fine, since, coarse_before, coarse_seconds)
    return [(coarse, _before(coarse, coarse_kept, boundary)), (fine, fine_kept)]


def _oldest_time(ring: _CollectorRing) -> float:
    if not ring.ticks:
        return math.inf
    if not ring.times_rise:
        return min(ring.times[p] for p in ring.ordered_positions())
    return ring.times[(ring.ticks - min(ring.ticks, ring.capacity)) % ring.capacity]


def _before(ring: _CollectorRing, kept: Kept, boundary: float) -> Kept:
    """The kept positions whose tick time is before `boundary`."""
    positions, fine = kept
    if ring.times_rise:
        cut = bisect_left(positions, boundary, key=ring.times.__getitem__)
    else:
        positions = [p for p in positions if ring.times[p] < boundary]
        cut = fine = len(positions)
    return positions[:cut], min(fine, cut)


def _read_parts(name: str, label_names: tuple[str, ...], parts: list[tuple[_CollectorRing, Kept]],
                labels: dict[str, str]) -> list[SeriesHistory]:
    """Every series of `name` whose labels include `labels`, its points taken from each (ring,
    kept positions) in turn: one ring, or a collector's coarse tier then its fine one.

    Arrays, not lists: 8 bytes a point instead of a 32-byte float object, which is most of what an
    evaluation over hundreds of series allocates. Copied in C (_gather); a series present on every
    kept tick (most are) shares one times array, the others leave their absent (NaN) ticks out."""
    if len(parts) == 1:
        keys = parts[0][0].by_name.get(name, {}).keys()
    else:
        keys = dict.fromkeys(key for ring, _ in parts for key in ring.by_name.get(name, {})).keys()
    shared_times: array | None = None
    found = []
    for label_values in keys:
        have = dict(zip(label_names, label_values))
        if any(have.get(k) != v for k, v in labels.items()):
            continue
        kept = array("d")
        whole = True  # the series has a ring in every part that has points
        for ring, (positions, fine) in parts:
            values = ring.by_name.get(name, {}).get(label_values)
            if values is None:
                whole = whole and not positions
            else:
                kept += _gather(values, positions, fine, ring.capacity)
        # a NaN (absent) anywhere makes the sum NaN; a sum of NaN without one (inf - inf) only
        # takes the slower path below, which gives the same series
        if whole and not math.isnan(sum(kept)):
            if shared_times is None:
                shared_times = array("d")
                for ring, (positions, fine) in parts:
                    shared_times += _gather(ring.times, positions, fine, ring.capacity)
            found.append(SeriesHistory(name, have, shared_times, kept))
            continue
        times, present = array("d"), array("d")
        for ring, (positions, _) in parts:
            values = ring.by_name.get(name, {}).get(label_values)
            if values is None:
                continue
            for p in positions:
                value = values[p]
                if value == value:  # not NaN: present that tick
                    times.append(ring.times[p])
                    present.append(value)
        found.append(SeriesHistory(name, have, times, present))
    return found


def _bucket_points(series: SeriesHistory, start: float, end: float, width: float,
                   buckets: int) -> BucketedSeries:
    """History.bucketed's figures for one series read out of the tiers."""
    sums, counts = [0.0] * buckets, [0] * buckets
    last_times, last_values = [math.nan] * buckets, [math.nan] * buckets
    for at, value in zip(series.times, series.values):
        if not start <= at <= end:
            continue
        bucket = min(buckets - 1, int((at - start) / width))
        sums[bucket] += value
        counts[bucket] += 1
        last_times[bucket], last_values[bucket] = at, value
    means = [total / count if count else math.nan for total, count in zip(sums, counts)]
    return BucketedSeries(series.name, series.labels, means, last_times, last_values)
