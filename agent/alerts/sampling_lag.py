"""HybridmonSamplingLagging: the agent's sampling loop runs fewer of its ticks than its interval
schedules, so every collector samples late or not at all; at 0 % the loop has stopped.
Runbook: HybridmonSamplingLagging.md.

The measure is the share of scheduled ticks the loop ran over a window: the increase of ticks run
(hybridmon_loop_ticks_total) over the increase of ticks scheduled (hybridmon_loop_scheduled_ticks_total,
the loop's running time over its interval). A ratio of two rates over the same scrapes, rather
than one rate times the interval: rate() divides by the whole window, so on a series younger than
the window (every agent restart) a single rate reads low and would fire for minutes. A healthy loop wakes within
milliseconds of each deadline (Event.wait on a monotonic clock) and runs every tick (share 1). It
skips a tick only when it wakes a whole interval late (agent/loop/sampler.py run_forever), i.e. when the
agent's process could not run for an interval or more: CPU starvation of the agent's cgroup, its
pages swapped out on a thrashing host, a stopped process, a thread holding the GIL in a long call.
A hung loop runs none (share 0).

Two doors, unequal on purpose:
- the Prometheus rule reads the counter on /metrics, which the HTTP server renders from its own
  thread: it sees a loop that lags and one that has stopped;
- the in-agent detector runs in the detector engine, which evaluates after collector commits, and
  collectors are started by the loop: a stopped loop stops the detector too. It sees lag only.
  A stopped loop is also caught by /healthz (agent/loop/liveness.py), which a liveness probe restarts.
In a replay the loop does not run (recorded time paces the collectors): neither door judges it
(hybridmon_loop_scheduled_ticks_total is absent and the detector sees no started loop).
"""
from __future__ import annotations

from collections import deque
from textwrap import dedent

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors.base import DetectorBase, Finding, HistoryReader, RunningAgent
from hybridmon.agent.self_metrics import LOOP_SCHEDULED, LOOP_SKIPPED, LOOP_TICKS
from hybridmon.rules import groups
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import duration

ALERTNAME = "HybridmonSamplingLagging"
INPUTS = (LOOP_TICKS, LOOP_SCHEDULED)
# Ticks the detector needs in its window before it judges: ticks are counted whole, so over n
# scheduled ticks a healthy loop may show n - 1 (a tick just outside the window); with n >= 20 that
# is still 95 %, clear of the 90 % threshold.
MIN_TICKS_JUDGED = 20


class Settings(Section):
    # Defaults: a thresholds file copied before this alert existed still loads.
    min_tick_share: float = 0.9
    window_seconds: float = 300.0
    for_seconds: float = 120.0


def alert(s: Settings) -> Alert:
    window, wait = duration(s.window_seconds), duration(s.for_seconds)
    return Alert(
        ALERTNAME,
        dedent(f"""\
            # the share of its scheduled ticks the loop ran over the window (absent in a replay)...
            rate({LOOP_TICKS.name}[{window}])
            / on (job, instance) rate({LOOP_SCHEDULED.name}[{window}])
            # ...short of every tick: the agent could not run for whole intervals, or has stopped
            < {s.min_tick_share:g}"""),
        s.for_seconds, "warning",
        f"The sampling loop of hybridmon on <instance> ran <value|humanizePercentage> of its ticks "
        f"over the last {window}",
        f"hybridmon's sampling loop on <instance> ran <value|humanizePercentage> of the ticks its "
        f"interval schedules over the last {window} (threshold: {s.min_tick_share:.0%}), for {wait} or "
        "more. Its collectors sample late or not at all, so the detectors' windows thin out and "
        "every alert reacts late; at 0% the loop has stopped: no collector runs, the agent's own "
        "detectors do not evaluate and the series on /metrics are frozen. A loop falls whole "
        "intervals behind only when the agent cannot run for an interval or more: CPU starvation, "
        "its memory swapped out, a stopped process, a hung thread. "
        f"{LOOP_SKIPPED.name} counts the ticks skipped; /healthz answers 503 once the loop has "
        "not ticked for a minute.",
    )


class Detector(DetectorBase):
    """One finding for the agent, warning: over the last window_seconds (or 20 ticks, if longer)
    the loop ran less than min_tick_share of the ticks its interval schedules; fires once that has
    lasted for_seconds. Its value is that share (0-1). It reads the sampler's own record, on the
    sampler's monotonic clock, not the host's history; it cannot see a stopped loop (module doc)."""

    name = "sampling_lag"
    alertnames = (ALERTNAME,)
    judges_the_agent = True

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.alert = alert(config)
        self._sampler = None
        self._seen: deque[tuple[float, int]] = deque()  # (monotonic time, ticks) at each evaluation

    def attach(self, agent: RunningAgent) -> None:
        """Called once by the agent (daemon.Agent): judge its sampler's loop."""
        self._sampler = agent.sampler

    def evaluate(self, _history: HistoryReader, _now: float) -> list[Finding]:
        sampler = self._sampler
        if sampler is None or sampler.loop.started_at is None:
            return []  # not started, or a replay: no loop to judge
        interval = sampler.interval_seconds
        window = max(self.config.window_seconds, MIN_TICKS_JUDGED * interval)
        clock, ticks = sampler.monotonic(), sampler.loop.ticks
        # Counting starts when the loop did, not at the first evaluation.
        if not self._seen:
            self._seen.append((sampler.loop.started_at, 0))
        self._seen.append((clock, ticks))
        while len(self._seen) > 1 and self._seen[1][0] <= clock - window:
            self._seen.popleft()
        since, ticks_then = self._seen[0]
        span = clock - since
        if span < MIN_TICKS_JUDGED * interval:
            return []
        share = (ticks - ticks_then) * interval / span
        if share >= self.config.min_tick_share:
            return []
        return [finding(self.alert, {}, share, self.config.min_tick_share, unit="ratio",
                        details={"ticks": ticks - ticks_then, "scheduled": round(span / interval),
                                 "skipped_ticks_total": sampler.loop.skipped_ticks,
                                 "last_lag_seconds": round(sampler.loop.last_lag_seconds, 3)})]


FAMILY = AlertFamily(
    section="sampling_lag",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group=groups.AGENT,
    detector=Detector,
    alerts=lambda t: (alert(t.sampling_lag),),
    collectors=(),
    lookback_seconds=lambda settings: 0.0,
    no_scenario=("it judges the sampling loop's own ticks, and a replay runs no loop"),
)
