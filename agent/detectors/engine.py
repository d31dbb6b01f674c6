"""Runs the detectors and keeps each finding's alert state, as Prometheus keeps an alert's.

A finding whose condition holds is pending from the first evaluation that returns it; it fires
once it has been returned at every evaluation for its `for_seconds` (0 fires at once), and
resolves at the first evaluation that no longer returns it. A resolved finding is kept for
`resolved_retention_seconds` so that a publisher can tell Alertmanager its endsAt; one that
comes back after resolving is a new finding, pending again. A pending finding that stops is
dropped without a trace, as Prometheus drops a pending alert.

A detector that raises is counted and logged once; its findings keep the state they had (neither
refreshed nor resolved), as Prometheus leaves a rule's alerts alone when its query fails, and
the other detectors run as usual.

Each finding a detector returns goes through `correlate` (impact.correlate by default) with the
time its condition began, pending_since, before it is stored: PCIe, swap and NUMA findings gain
the inference servers' figures from before that moment and now. A correlation that raises leaves
the finding as the detector returned it (logged once).

The sampler thread calls evaluate(); HTTP handlers read firing()/pending()/resolved() at any
time: every reader gets immutable snapshots.
"""
from __future__ import annotations

import logging
import math
import threading
from bisect import bisect_left
import time
from collections import deque
from dataclasses import dataclass, replace
from collections.abc import Mapping
from typing import Any, Callable, Literal, Sequence

from hybridmon.agent.detectors import impact
from hybridmon.agent.detectors.base import Detector, Finding, HistoryReader
from hybridmon.agent.loop.history import History, SeriesHistory
from hybridmon.exporters.base import Samples

log = logging.getLogger(__name__)

Change = Literal["firing", "resolved"]
DEFAULT_RESOLVED_RETENTION_SECONDS = 15 * 60
# Detectors see every sample of the last FULL_RESOLUTION_SECONDS (their 1 m averages and their
# `for` windows, up to 5 min) and one sample per COARSE_STEP_SECONDS before that (hour-long
# trends), which keeps an evaluation of 8 GPUs and 16 processes over 2 h of history cheap.
FULL_RESOLUTION_SECONDS = 600.0
COARSE_STEP_SECONDS = 15.0
# The status page shades when each alert fired over its last hour of plots (agent/status/plots.py);
# resolved states are dropped after resolved_retention_seconds (15 min), so the engine keeps the
# intervals that ended within this span, at most FIRING_LOG_LIMIT of them (a flapping alert must
# not grow memory without bound; the oldest go first).
FIRING_LOG_SECONDS = 3600.0

FIRING_LOG_LIMIT = 1000


@dataclass(frozen=True)
class FiringInterval:
    """One span in which a finding fired: from firing_since to resolved_at (None: firing now)."""

    alertname: str
    labels: dict[str, str]
    start: float
    end: float | None


@dataclass(frozen=True)
class FindingState:
    """One finding's alert state: the latest finding for its key and when it changed state."""

    finding: Finding
    detector: str                       # the detector (thresholds section) that returned it
    pending_since: float                # first evaluation of this run of the condition
    firing_since: float | None = None
    resolved_at: float | None = None
    last_seen: float = 0.0              # last evaluation that returned it

    @property
    def key(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        return self.finding.key

    @property
    def state(self) -> Literal["pending", "firing", "resolved"]:
        if self.resolved_at is not None:
            return "resolved"
        return "firing" if self.firing_since is not None else "pending"

    @property
    def starts_at(self) -> float | None:
        """Alertmanager's startsAt: when it started firing."""
        return self.firing_since

    @property
    def ends_at(self) -> float | None:
        """Alertmanager's endsAt: when it resolved; None while it fires."""
        return self.resolved_at


ChangeCallback = Callable[[FindingState, Change], None]
# (history, finding, when its condition began, now) -> the finding, with figures added
Correlator = Callable[[HistoryReader, Finding, float, float], Finding]


class EvaluationView:
    """The history as one evaluation sees it: each metric's series are read from History once
    and shared by every detector that asks (several read GPU utilization, link state, gpu_info),
    label filters answered from an index built once per metric and label set (a detector that
    asks for each of 256 processes' series does not scan every process's series each time).
    It reads as detectors.base.HistoryReader promises: series() through the view, series_every()
    and latest() from the History itself.

    `reading_back(seconds)` narrows what the detectors asking next see to the last `seconds`
    (never less than FULL_RESOLUTION_SECONDS): the same points a reader of the whole lookback gets
    in that span, without copying the rest. A detector of 1-minute windows then copies 10 minutes
    of points whatever the history holds; only the hour-long trends read an hour."""

    def __init__(self, history: History, since: float | None = None,
                 coarse_before: float | None = None, now: float | None = None,
                 widest_reads: dict[str, float] | None = None) -> None:
        self._history = history
        self._since = since
        self._coarse_before = coarse_before
        self._now = now
        self._keep_from: float | None = None
        self._by_metric: dict[tuple[str, float | None], list[SeriesHistory]] = {}
        # metric -> the most seconds before `now` a detector asked of it: in the last evaluation
        # (`widest_reads`, read that far at once) and in this one (`reads_back`, for the next)
        self._widest = widest_reads or {}
        self.reads_back: dict[str, float] = {}
        self._indexes: dict[tuple[str, float | None, tuple[str, ...]],
                            dict[tuple[str | None, ...], list[SeriesHistory]]] = {}
        self._shared: dict[tuple, Any] = {}

    def reading_back(self, seconds: float | None) -> "EvaluationView":
        """Narrows the next reads to the last `seconds` before `now` (None: the whole lookback)."""
        if seconds is None or self._now is None:
            self._keep_from = None
        else:
            keep_from = self._now - max(seconds, FULL_RESOLUTION_SECONDS)
            self._keep_from = None if self._since is not None and keep_from <= self._since else keep_from
        return self

    def series(self, name: str, /, **labels: str) -> list[SeriesHistory]:
        key = (name, self._keep_from)
        found = self._by_metric.get(key)
        if found is None:
            found = self._by_metric[key] = self._read(name, self._keep_from)
        if not labels:
            return list(found)
        names = tuple(sorted(labels))
        index = self._indexes.get((*key, names))
        if index is None:
            index = self._indexes[(*key, names)] = {}
            for one in found:
                index.setdefault(tuple(one.labels.get(k) for k in names), []).append(one)
        return list(index.get(tuple(labels[k] for k in names), ()))

    def shared(self, key: tuple, work: Callable[[], Any]) -> Any:
        """`work()` worked out once per evaluation for `key` (and the span reading_back set):
        what several findings of one evaluation each ask for, such as impact.correlate's servers
        (issue 33: the same lists were made again for each correlated finding). The series it
        reads are this view's, read once, so the answer cannot change within the evaluation;
        callers must not change what it returns."""
        key = (key, self._keep_from)
        if key not in self._shared:
            self._shared[key] = work()
        return self._shared[key]

    def _read(self, name: str, keep_from: float | None) -> list[SeriesHistory]:
        """The series of `name` from `keep_from` on. Several detectors read one metric over
        spans of different length (the process series: 10 minutes for most, an hour for memory
        growth); it is read once, over the longest span the last evaluation asked of it, and the
        shorter ones are cut from that: History gives a shorter read exactly the points of a
        longer one in its span (same `since` and coarse steps), so the figures do not change."""
        back = math.inf if keep_from is None or self._now is None else self._now - keep_from
        self.reads_back[name] = max(self.reads_back.get(name, 0.0), back)
        widest = self._widest.get(name, 0.0)
        if widest <= back or self._now is None:
            return self._history.series(name, since=self._since, coarse_before=self._coarse_before,
                                        coarse_seconds=COARSE_STEP_SECONDS, keep_from=keep_from)
        wide_from = None if math.isinf(widest) else self._now - widest
        if wide_from is not None and self._since is not None and wide_from <= self._since:
            wide_from = None   # as reading_back: nothing before `since` is read anyway
        wide = self._by_metric.get((name, wide_from))
        if wide is None:
            wide = self._by_metric[(name, wide_from)] = self._history.series(
                name, since=self._since, coarse_before=self._coarse_before,
                coarse_seconds=COARSE_STEP_SECONDS, keep_from=wide_from)
        return _cut_from(wide, keep_from)

    @property
    def source(self) -> History:
        return self._history

    def series_every(self, name: str, /, step_seconds: float, since: float | None = None,
                     **labels: str) -> list[SeriesHistory]:
        """History.series_every: the reader of an hour at one point per step reads it itself,
        whatever span reading_back() set (AlertFamily.view_seconds)."""
        return self._history.series_every(name, step_seconds, since=since, **labels)

    def latest(self) -> dict[str, tuple[float, Samples]]:
        return self._history.latest()


def _cut_from(series: list[SeriesHistory], keep_from: float | None) -> list[SeriesHistory]:
    """Each series' points from `keep_from` on (times rise); series that shared one times array
    share its cut too."""
    if keep_from is None:
        return series
    cut_times: dict[int, tuple[int, Sequence[float]]] = {}
    found = []
    for one in series:
        cut = cut_times.get(id(one.times))
        if cut is None:
            start = bisect_left(one.times, keep_from)
            cut = cut_times[id(one.times)] = (start, one.times[start:])
        start, times = cut
        found.append(SeriesHistory(one.name, one.labels, times, one.values[start:]))
    return found


class Engine:
    """Evaluates `detectors` over `history` and keeps the state of every finding."""

    def __init__(self, detectors: Sequence[Detector], history: History,
                 clock: Callable[[], float] = time.time,
                 resolved_retention_seconds: float = DEFAULT_RESOLVED_RETENTION_SECONDS,
                 lookback_seconds: float | None = None,
                 correlate: Correlator | None = impact.correlate) -> None:
        self.detectors = tuple(detectors)
        self.correlate = correlate
        self.history = history
        self.clock = clock
        self.resolved_retention_seconds = resolved_retention_seconds
        # The longest span any detector reads; copying older points out of the history is waste.
        self.lookback_seconds = lookback_seconds
        self.on_change: list[ChangeCallback] = []
        self.evaluations = 0
        self.last_evaluated_at: float | None = None
        # What "warming up" is judged by (agent/warmup.py): the first evaluation, which the agent
        # runs at its first commit, starts the history span; and the collectors that had committed
        # once by the last evaluation, i.e. whose samples it could read.
        self.first_evaluated_at: float | None = None
        self.collectors_seen: frozenset[str] = frozenset()
        self.last_duration_seconds: float | None = None
        self._detector_errors: dict[str, int] = {d.name: 0 for d in self.detectors}
        self._logged_failures: set[str] = set()
        self._states: dict[tuple, FindingState] = {}
        self._firing_log: deque[FiringInterval] = deque(maxlen=FIRING_LOG_LIMIT)
        # per metric, how far back the last evaluation's detectors read it (EvaluationView._read)
        self._widest_reads: dict[str, float] = {}
        self._lock = threading.Lock()            # guards the states and counters, held briefly
        self._evaluating = threading.Lock()      # one evaluation at a time

    def figures(self, detector: str) -> Mapping[tuple[str, ...], Any]:
        """What `detector` judged each entity by at its last evaluation (Detector.figures); empty
        for one that publishes none or is not running."""
        for candidate in self.detectors:
            if candidate.name == detector:
                return candidate.figures
        return {}

    @property
    def detector_errors(self) -> dict[str, int]:
        """Evaluations in which each detector raised, by detector name."""
        with self._lock:
            return dict(self._detector_errors)

    def view_at(self, now: float, widest_reads: dict[str, float] | None = None) -> EvaluationView:
        """The history as an evaluation at `now` sees it: the lookback, the coarse tier before the
        last FULL_RESOLUTION_SECONDS, and (evaluate's) the spans the last evaluation read."""
        since = None if self.lookback_seconds is None else now - self.lookback_seconds
        return EvaluationView(self.history, since, coarse_before=now - FULL_RESOLUTION_SECONDS,
                              now=now, widest_reads=widest_reads)

    def evaluate(self, now: float | None = None) -> list[FindingState]:
        """Run every detector at `now` (default: the clock) and update the states; returns the
        findings firing afterwards. on_change callbacks run after the update, in this thread."""
        with self._evaluating:
            now = self.clock() if now is None else now
            started = time.perf_counter()
            returned: dict[tuple, tuple[str, Finding]] = {}
            failed: set[str] = set()
            seen = frozenset(self.history.latest())
            view = self.view_at(now, self._widest_reads)
            for detector in self.detectors:
                # the span its family reads (AlertFamily.build_detector sets it; inf: the whole lookback)
                view.reading_back(None if math.isinf(detector.lookback_seconds) else detector.lookback_seconds)
                try:
                    findings = detector.evaluate(view, now)
                except Exception:
                    failed.add(detector.name)
                    self._detector_failed(detector.name)
                    continue
                for finding in findings:
                    returned[finding.key] = (detector.name, finding)
            if self.correlate is not None:
                # the servers' figures from when a condition began, however long ago
                self._correlate(self.correlate, view.reading_back(None), returned, now)
            self._widest_reads = view.reads_back
            with self._lock:
                changes = self._update(now, returned, failed)
                self.evaluations += 1
                self.last_evaluated_at = now
                if self.first_evaluated_at is None:
                    self.first_evaluated_at = now
                self.collectors_seen = seen
                self.last_duration_seconds = time.perf_counter() - started
                firing = self._select("firing")
            for state, change in changes:
                for callback in list(self.on_change):
                    try:
                        callback(state, change)
                    except Exception:
                        log.exception("finding %s callback failed", change)
            return firing

    def move_times(self, step: float) -> None:
        """The wall clock stepped by `step` seconds (agent/daemon.py tells it from the monotonic
        clock): every time the states hold moves with it, so a pending finding still waits its
        `for` from when it began, a firing one keeps its startsAt before now (Alertmanager refuses
        endsAt before startsAt), a resolved one is kept as long. Unmoved, a clock that jumped
        forward then back left findings pending and the latest evaluation time in the future until
        the clock caught up (issue 30)."""
        def moved(at: float | None) -> float | None:
            return None if at is None else at + step
        with self._evaluating, self._lock:
            self._states = {key: replace(state, pending_since=state.pending_since + step,
                                         firing_since=moved(state.firing_since),
                                         resolved_at=moved(state.resolved_at), last_seen=state.last_seen + step)
                            for key, state in self._states.items()}
            self._firing_log = deque((replace(interval, start=interval.start + step, end=moved(interval.end))
                                      for interval in self._firing_log), maxlen=FIRING_LOG_LIMIT)
            self.first_evaluated_at = moved(self.first_evaluated_at)
            self.last_evaluated_at = moved(self.last_evaluated_at)

    def _update(self, now: float, returned: dict[tuple, tuple[str, Finding]],
                failed: set[str]) -> list[tuple[FindingState, Change]]:
        changes: list[tuple[FindingState, Change]] = []
        states: dict[tuple, FindingState] = {}
        for key, state in self._states.items():
            if key in returned:
                continue
            if state.state == "resolved":
                if now - state.resolved_at <= self.resolved_retention_seconds:
                    states[key] = state
            elif state.detector in failed:
                states[key] = state
            elif state.state == "firing":
                resolved = replace(state, resolved_at=now)
                states[key] = resolved
                changes.append((resolved, "resolved"))
                self._firing_log.append(FiringInterval(state.finding.alertname, dict(state.finding.labels),
                                                       state.firing_since, now))
            # a pending finding whose condition stopped is dropped
        for key, (detector, finding) in returned.items():
            old = self._states.get(key)
            if old is None or old.state == "resolved":
                state = FindingState(finding, detector, pending_since=now, last_seen=now)
            else:
                state = replace(old, finding=finding, detector=detector, last_seen=now)
            if state.firing_since is None and now - state.pending_since >= finding.for_seconds:
                state = replace(state, firing_since=now)
                changes.append((state, "firing"))
            states[key] = state
        self._states = states
        while self._firing_log and self._firing_log[0].end < now - FIRING_LOG_SECONDS:
            self._firing_log.popleft()
        return changes

    def _correlate(self, correlate: Correlator, view: EvaluationView,
                   returned: dict[tuple, tuple[str, Finding]], now: float) -> None:
        with self._lock:
            began = {key: state.pending_since for key, state in self._states.items()
                     if key in returned and state.state != "resolved"}
        for key, (detector, finding) in returned.items():
            try:
                correlated = correlate(view, finding, began.get(key, now), now)
            except Exception:
                with self._lock:
                    first = "correlate" not in self._logged_failures
                    self._logged_failures.add("correlate")
                if first:
                    log.exception("correlating %s with the inference servers failed; findings "
                                  "keep the detector's text (logged once)", finding.alertname)
                continue
            returned[key] = (detector, correlated)

    def _detector_failed(self, name: str) -> None:
        with self._lock:
            self._detector_errors[name] = self._detector_errors.get(name, 0) + 1
            first = name not in self._logged_failures
            self._logged_failures.add(name)
        if first:
            log.exception("detector %s failed; its findings keep their state until it works "
                          "again (logged once, counted in detector_errors)", name)

    def _select(self, state: str) -> list[FindingState]:
        return sorted((s for s in self._states.values() if s.state == state),
                      key=lambda s: (s.finding.alertname, s.key[1]))

    def firing(self) -> list[FindingState]:
        with self._lock:
            return self._select("firing")

    def pending(self) -> list[FindingState]:
        with self._lock:
            return self._select("pending")

    def resolved(self) -> list[FindingState]:
        """Resolved findings still within resolved_retention_seconds."""
        with self._lock:
            return self._select("resolved")

    def firing_intervals(self) -> list[FiringInterval]:
        """When findings fired over the last FIRING_LOG_SECONDS: the resolved spans, oldest first,
        then those firing now (end None)."""
        with self._lock:
            return list(self._firing_log) + [
                FiringInterval(s.finding.alertname, dict(s.finding.labels), s.firing_since, None)
                for s in self._states.values() if s.state == "firing"]

    def states(self) -> list[FindingState]:
        """Every finding the engine holds: pending, firing and recently resolved."""
        with self._lock:
            return sorted(self._states.values(), key=lambda s: (s.finding.alertname, s.key[1]))
