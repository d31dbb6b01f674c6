"""The tests of the sampling_lag alert family (agent/alerts/sampling_lag.py): its detector, on
histories written sample by sample, and its rule's promtool cases (`promtool_cases`, written
to rules/tests/generated_sampling_lag.yml by `python -m tests.rules.generate` and run by
promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

import pytest

from hybridmon.agent.alerts import sampling_lag
from hybridmon.agent.alerts.sampling_lag import ALERTNAME
from hybridmon.agent.detectors.engine import Engine
from hybridmon.agent.loop.history import History
from hybridmon.agent.loop.sampler import Sampler
from hybridmon.agent.self_metrics import LOOP_SCHEDULED, LOOP_TICKS
from tests.support.detector_history import THRESHOLDS, assert_says_its_rules_words
from tests.support.promtool_cases import ONSET, Test, not_yet

T0 = 1_700_000_000.0

SETTINGS = THRESHOLDS.sampling_lag


class Clock:
    def __init__(self) -> None:
        self.now = 5_000.0

    def __call__(self) -> float:
        return self.now


class Loop:
    """A 1 s sampling loop with no collectors, driven tick by tick, its detector evaluated every 10 s."""

    def __init__(self, replay: bool = False) -> None:
        self.clock = Clock()
        self.sampler = Sampler([], History(600), 1.0, monotonic=self.clock)
        if not replay:
            self.sampler.loop.started_at = self.clock.now  # what run_forever records
        self.detector = sampling_lag.Detector(SETTINGS)
        self.detector.attach(self)
        self.engine = Engine([self.detector], History(600))
        self.elapsed = 0.0

    def run(self, seconds: float, seconds_per_tick: float) -> None:
        """Tick every `seconds_per_tick` (1: every tick; 2: half of them) for `seconds`."""
        end = self.elapsed + seconds
        while self.elapsed < end:
            self.sampler.tick(self.clock.now)
            self.clock.now += seconds_per_tick
            self.elapsed += seconds_per_tick
            if int(self.elapsed) % 10 == 0:
                self.engine.evaluate(T0 + self.elapsed)


def test_a_loop_running_half_its_ticks_fires_after_for_with_the_share():
    loop = Loop()
    loop.run(600, 1.0)
    assert loop.engine.states() == []
    loop.run(SETTINGS.window_seconds, 2.0)  # the agent runs only every other tick from here
    (state,) = loop.engine.firing()
    finding = state.finding
    assert finding.alertname == "HybridmonSamplingLagging" and finding.severity == "warning"
    assert finding.value == pytest.approx(0.5, abs=0.01) and finding.threshold == 0.9
    assert finding.details["ticks"] == pytest.approx(SETTINGS.window_seconds / 2, abs=2)
    assert_says_its_rules_words(finding)
    assert "ran 50% of its ticks over the last 5m" in finding.summary
    # fired once the share had been under 90 % for `for`: 90 % falls at 0.2 of the window's ticks
    # lost, i.e. 60 s into the lag, so not before 60 s + for
    assert state.firing_since - (T0 + 600) >= 60 + SETTINGS.for_seconds - 10


def test_every_tick_a_single_stall_and_a_replay_stay_silent():
    steady = Loop()
    steady.run(1200, 1.0)
    assert steady.engine.states() == []
    stalled = Loop()
    stalled.run(600, 1.0)
    stalled.run(20, 20.0)   # one 20 s stall (a swap-in storm): 93 % of the window's ticks still ran
    stalled.run(600, 1.0)
    assert stalled.engine.firing() == [] and stalled.engine.pending() == []
    replay = Loop(replay=True)
    replay.run(1200, 5.0)  # the clock runs, the loop never ticks: nothing to judge
    assert replay.engine.states() == []


def test_a_young_loop_is_not_judged_before_twenty_ticks():
    loop = Loop()
    loop.run(10, 5.0)
    assert loop.engine.states() == []


# --- its rule's promtool cases ------------------------------------------------------------------


def promtool_cases(t, catalog) -> list[Test]:
    """Five agents, the loop at 1 s, all started with the test (young series: the healthy ones
    must not fire while rate() underestimates): one runs half its ticks from the onset and one
    stops (both fire); one runs 95 % (above the threshold), one all, and a replay runs none but
    schedules none either: all three silent. Checked once the whole window is after the onset, where a linear
    counter gives the exact share whatever the Prometheus version's window edges."""
    s = t.sampling_lag
    rule = catalog.find(ALERTNAME)
    at = ONSET + 60 * (int(s.window_seconds + s.for_seconds) // 60 + 1)
    test = Test("sampling loop: half the ticks and none fire; 95 %, every tick and a replay stay "
                "silent", at + 60, catalog)
    agents = {"lagging:9787": 0.5, "stopped:9787": 0.0, "busy:9787": 0.95, "healthy:9787": 1.0}
    for instance, share in agents.items():
        test.counter(LOOP_TICKS.name, 1.0, share, instance=instance)
        test.counter(LOOP_SCHEDULED.name, 1.0, 1.0, instance=instance)
    test.constant(LOOP_TICKS.name, 0, instance="replay:9787")
    test.expect(not_yet(s.for_seconds), rule.alert)
    test.expect(at, rule.alert, *(test.alert(rule, {}, instance=instance, value=agents[instance])
                                  for instance in ("lagging:9787", "stopped:9787")))
    return [test]
