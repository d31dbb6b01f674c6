"""The sampling loop: runs each collector on its own interval and commits what it returns.

A tick's collectors run one after another on one thread (agent/loop/handoff_pool.py says why), and
one still running after COLLECTOR_HANDOFF_SECONDS leaves the rest to another thread, so a slow or
hung one (NVML can hang when a GPU falls off the bus) never delays the tick, nor the others by more
than that. A collector that is still running when it comes due again
is skipped, not stacked. Every run is timed and its outcome kept for the self metrics.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from hybridmon.agent.loop.handoff_pool import HandoffPool
from hybridmon.agent.loop.history import History
from hybridmon.agent.loop.trace import TraceWriter
from hybridmon.exporters.base import Collector, LogOnce, NoDataError, Samples

log = logging.getLogger(__name__)
# A wall clock that moved this much against the monotonic clock stepped (issue 30). Both are read
# together, so only a step moves their difference: NTP slews at most 500 ppm, 0.03 s a minute. Small
# enough that a step that matters to a `for` of a minute or more is seen.
CLOCK_STEP_SECONDS = 10.0
# How long the tick's other collectors wait behind one that is still running before another thread
# takes them (a quarter of the tick at most). A collector's run takes 0.1-25 ms on the 8-GPU /
# 16-process host, the evaluation it may trigger ~25 ms with 2 h of history (docs/performance.md):
# ten times that is slow or hung, and the others then still commit within the tick.
COLLECTOR_HANDOFF_SECONDS = 0.25


@dataclass
class CollectorState:
    """What the self metrics report about one collector."""

    runs: int = 0
    errors: int = 0
    last_success: bool | None = None
    no_data_reason: str | None = None
    last_duration_seconds: float | None = None
    last_error_time: float | None = None
    last_error: str | None = None
    running_since: float | None = None  # monotonic


@dataclass
class Scheduled:
    collector: Collector
    interval_seconds: float
    source: object  # the RawSource handed to the collector (recording or replay sources need it)
    # Collectors whose first run must finish before this one starts: the process collector needs
    # the GPU collector's processes, process_numa needs the process collector's watch list.
    after: tuple[str, ...] = ()
    state: CollectorState = field(default_factory=CollectorState)
    next_due: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class LoopState:
    ticks: int = 0
    last_lag_seconds: float = 0.0
    max_lag_seconds: float = 0.0
    skipped_ticks: int = 0
    # Monotonic times, for /healthz and HybridmonSamplingLagging: when run_forever began (None in a
    # replay, which runs collectors itself at recorded times, and before start), when the last
    # tick finished and when a collector last committed (from any thread).
    started_at: float | None = None
    last_tick_at: float | None = None
    last_commit_at: float | None = None


class Sampler:
    def __init__(
        self,
        scheduled: list[Scheduled],
        history: History,
        interval_seconds: float,
        recorder: TraceWriter | None = None,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduled = scheduled
        self.history = history
        self.interval_seconds = interval_seconds
        self.loop = LoopState()
        self._recorder = recorder
        self._wall_clock = wall_clock
        self._monotonic = monotonic
        self._log_once = LogOnce(log)
        self._pool = HandoffPool(max(1, len(scheduled)), min(COLLECTOR_HANDOFF_SECONDS, interval_seconds / 4),
                                 "collector")
        self._stop = threading.Event()
        self.on_commit: list[Callable[[float], None]] = []  # called with the commit's time
        # called with the step, in seconds, when the wall clock stepped (before the commit that
        # saw it); the history's times have moved by then
        self.on_clock_step: list[Callable[[float], None]] = []
        self.clock_steps = 0
        self._clock_offset: float | None = None   # the wall clock less the monotonic one, last seen
        self._clock_lock = threading.Lock()
        self._by_name = {item.collector.name: item for item in scheduled}
        for item in scheduled:
            history.add_collector(item.collector.name, item.interval_seconds)

    def run_collector(self, item: Scheduled, at: float | None = None) -> None:
        """Run one collector now (in this thread) and commit its samples at wall time `at`."""
        if not item.lock.acquire(blocking=False):
            return
        try:
            if at is None:   # live: stamped by the wall clock, which may step meanwhile
                self._run_locked(item, self._wall_clock(), self.clock_offset())
            else:            # a replay's recorded time, or a test's
                self._run_locked(item, at)
        finally:
            item.lock.release()

    def _run_locked(self, item: Scheduled, at: float, offset_at_start: float | None = None) -> None:
        state = item.state
        started = self._monotonic()
        state.running_since = started
        samples: Samples | None = None
        try:
            samples = item.collector.collect()
            state.last_success, state.no_data_reason = True, None
        except NoDataError as absent:
            state.last_success, state.no_data_reason = True, str(absent)
            self._log_once(f"nodata:{item.collector.name}:{absent}", "%s: %s", item.collector.name, absent)
        except Exception as error:  # one collector's failure must never reach the loop
            state.last_success = False
            state.errors += 1
            state.last_error_time = at
            state.last_error = f"{type(error).__name__}: {error}"
            self._log_once(
                f"error:{item.collector.name}:{type(error).__name__}",
                "collector %s failed: %s (further failures of this kind are counted, not logged)",
                item.collector.name, state.last_error,
            )
            log.debug("collector %s failed", item.collector.name, exc_info=True)
        finally:
            state.runs += 1
            state.last_duration_seconds = self._monotonic() - started
            state.running_since = None
        if offset_at_start is not None:
            moved = self._follow_clock_step() - offset_at_start
            if abs(moved) >= CLOCK_STEP_SECONDS:
                at += moved   # a step since the run began: its stamp moves as the history did
        self.history.commit(item.collector.name, at, samples if samples is not None else Samples())
        self.loop.last_commit_at = self._monotonic()
        for callback in self.on_commit:
            callback(at)
        if self._recorder is not None:
            # After the commit: a full disk stops the recording, never the sampling.
            self._recorder.write(item.collector.name, at, item.source.take_readings())

    def tick(self, now: float | None = None) -> None:
        """Start every collector that is due and not still running.

        `now` is the tick's nominal time: scheduling from it rather than from the moment the loop
        woke keeps a 1 s collector on every 1 s tick despite wake-up jitter.
        """
        now = self._monotonic() if now is None else now
        for item in self.scheduled:
            if not self._dependencies_ready(item, now):
                continue
            if now >= item.next_due and not item.lock.locked():
                item.next_due += item.interval_seconds
                if item.next_due <= now:  # first run, or after a stall: restart the schedule
                    item.next_due = now + item.interval_seconds
                if self._stop.is_set():
                    return
                try:
                    self._pool.submit(self.run_collector, item)
                except RuntimeError:
                    return  # stop() shut the pool down between the check and the submit
        self.loop.ticks += 1
        self.loop.last_tick_at = self._monotonic()

    def hung(self, seconds: float) -> dict[str, float]:
        """The collectors whose current run has lasted `seconds` or more: name -> seconds so far."""
        now = self._monotonic()
        return {item.collector.name: now - item.state.running_since for item in self.scheduled
                if item.state.running_since is not None and now - item.state.running_since >= seconds}

    def clock_offset(self) -> float:
        """The wall clock less the monotonic clock, both read now: constant while the wall clock
        runs true, it moves by the step when the wall clock steps."""
        return self._wall_clock() - self._monotonic()

    def _follow_clock_step(self) -> float:
        """The clock offset now. Where it moved by CLOCK_STEP_SECONDS or more since the last commit
        (NTP's step at boot, a VM restored, `date -s`; NTP slews at most 500 ppm, 0.03 s a minute),
        the wall clock stepped: the history's times move by the step, so its ticks stay in order
        and the spans between them hold, and on_clock_step hears of it (issue 30: a clock that
        jumped forward then back froze the detectors until it caught up)."""
        with self._clock_lock:
            offset, last = self.clock_offset(), self._clock_offset
            self._clock_offset = offset
            step = 0.0 if last is None else offset - last
            if abs(step) < CLOCK_STEP_SECONDS:
                return offset
            self.clock_steps += 1
            log.warning("the wall clock stepped %s by %.0f s; the history's and the findings' times "
                        "move with it, so their spans hold", "forward" if step > 0 else "back", abs(step))
            self.history.move_times(step)
            for callback in self.on_clock_step:
                callback(step)
            return offset

    def monotonic(self) -> float:
        """The sampler's clock (time.monotonic unless a test injected one), in seconds: what the
        loop's times above are read on."""
        return self._monotonic()

    def _dependencies_ready(self, item: Scheduled, now: float) -> bool:
        """A dependency is ready once its first run finished, or when it has hung for an interval:
        a GPU collector stuck in NVML must not starve the process collectors."""
        for name in item.after:
            dependency = self._by_name.get(name)
            if dependency is None or dependency.state.runs > 0:
                continue
            started = dependency.state.running_since
            if started is None or now - started < dependency.interval_seconds:
                return False
        return True

    def run_forever(self) -> None:
        """Tick every interval until stop() is called; the lag is how late each tick woke up."""
        next_tick = self._monotonic()
        self.loop.started_at = next_tick
        while not self._stop.is_set():
            lag = max(0.0, self._monotonic() - next_tick)
            self.loop.last_lag_seconds = lag
            self.loop.max_lag_seconds = max(self.loop.max_lag_seconds, lag)
            self.tick(next_tick)
            next_tick += self.interval_seconds
            if next_tick < self._monotonic():  # a whole tick behind: skip ticks rather than burst
                self.loop.skipped_ticks += 1
                next_tick = self._monotonic()
            self._stop.wait(max(0.0, next_tick - self._monotonic()))

    def stop(self, timeout: float = 5.0) -> list[str]:
        """Stop ticking and wait up to `timeout` for running collectors; returns those still running."""
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        deadline = self._monotonic() + timeout
        still_running = []
        for item in self.scheduled:
            if item.lock.acquire(timeout=max(0.0, deadline - self._monotonic())):
                item.lock.release()
            else:
                still_running.append(item.collector.name)
        return still_running

    def close_collectors(self, skip: tuple[str, ...] | list[str] = ()) -> None:
        """Close every collector but those in `skip` (hung ones: closing them would block too)."""
        for item in self.scheduled:
            if item.collector.name in skip:
                continue
            try:
                item.collector.close()
            except Exception:
                log.warning("collector %s did not close cleanly", item.collector.name, exc_info=True)
