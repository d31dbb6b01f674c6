"""A wall clock that steps, and one that differs from Alertmanager's (issue 30, item 4).

On 113ef0e, after the clock jumped forward and back, the detectors stopped evaluating until the
clock caught up with the future time they last ran at (agent/daemon.py compared wall times), and
an agent whose finding started at that future time sent endsAt before startsAt: a real
Alertmanager answered 400 to every push. An agent an hour behind its Alertmanager sent endsAt an
hour in Alertmanager's past, and the alert was resolved there within seconds.
"""
from __future__ import annotations

import time
from datetime import datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmon.agent.daemon import Agent
from hybridmon.agent.detectors.engine import Engine
from hybridmon.agent.loop.history import History
from hybridmon.agent.loop.sampler import CLOCK_STEP_SECONDS, Sampler, Scheduled
from hybridmon.agent.publish.alertmanager import CLOCK_SKEW_SECONDS, AlertmanagerPusher
from hybridmon.exporters.base import MetricSpec, Samples
from tests.support.agent_helpers import fixture_config
from tests.support.alertmanager_helpers import Alertmanager, Switch, WebhookReceiver

HOUR = 3600.0
TICK = MetricSpec("hybridmon_test_tick", "a tick", "gauge", ())


def active_in(alertmanager: Alertmanager) -> list[dict]:
    return [alert for alert in alertmanager.alerts() if alert["status"]["state"] == "active"]


def seconds(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


class Ticks:
    """A collector whose one series is its run's number."""

    name = "ticks"

    def __init__(self) -> None:
        self.runs = 0

    def collect(self) -> Samples:
        self.runs += 1
        samples = Samples()
        samples.add(TICK, self.runs)
        return samples

    def close(self) -> None:
        pass


class Clocks:
    """A wall clock and a monotonic clock that the test moves: `advance` moves both, `step` the
    wall clock alone."""

    def __init__(self, wall: float) -> None:
        self.wall, self.ticked = wall, 0.0

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.ticked += seconds

    def step(self, seconds: float) -> None:
        self.wall += seconds


@pytest.fixture
def stepping_agent(tmp_path):
    """A fixture-host agent whose only detector is a Switch with a 60 s `for`, wired to a sampler
    of one collector on clocks the test moves (the agent's own sampler reads the real ones)."""
    agent = Agent(fixture_config(state_dir=str(tmp_path)))
    switch = Switch(for_seconds=60)
    agent.engine = Engine([switch], agent.history)
    clocks = Clocks(1000.0)
    sampler = Sampler([Scheduled(Ticks(), 10.0, None)], agent.history, 10.0,
                      wall_clock=lambda: clocks.wall, monotonic=lambda: clocks.ticked)
    # what Agent.__init__ wires to its own sampler
    sampler.on_commit.append(agent._maybe_evaluate)
    sampler.on_clock_step.append(agent._follow_clock_step)
    yield agent, switch, clocks, sampler
    agent.stop()


def run(sampler: Sampler) -> None:
    sampler.run_collector(sampler.scheduled[0])


def test_a_clock_that_jumps_forward_then_back_neither_pages_early_nor_freezes_the_detectors(stepping_agent):
    agent, switch, clocks, sampler = stepping_agent
    switch.on = True
    run(sampler)                          # 1000: pending
    [pending] = agent.engine.pending()
    clocks.advance(30)
    clocks.step(HOUR)                     # the clock jumps an hour forward
    run(sampler)
    # the finding has waited 30 s, not an hour and 30 s: still pending (it used to fire at once)
    assert agent.engine.firing() == [] and sampler.clock_steps == 1
    clocks.advance(30)
    clocks.step(-HOUR)                    # ...and back
    run(sampler)
    # evaluations go on at once (they froze until the clock passed the future time it last ran
    # at), and the finding fires after its 60 s, all in the new clock's times
    assert sampler.clock_steps == 2 and agent.engine.last_evaluated_at == 1060.0
    [firing] = agent.engine.firing()
    assert (firing.pending_since, firing.firing_since) == (1000.0, 1060.0)
    # the history's ticks stay in order, 30 s apart
    [series] = agent.history.series(TICK.name)
    assert list(series.times) == [1000.0, 1030.0, 1060.0] and list(series.values) == [1.0, 2.0, 3.0]


def test_a_slow_drift_is_not_a_step(stepping_agent):
    agent, switch, clocks, sampler = stepping_agent
    switch.on = True
    for _ in range(7):
        run(sampler)
        clocks.advance(10)
        clocks.step(CLOCK_STEP_SECONDS / 10)   # under a step at every commit
    assert sampler.clock_steps == 0 and len(agent.engine.firing()) == 1


@pytest.mark.slow
def test_alerts_stay_active_in_an_alertmanager_whose_clock_differs_or_after_a_step(tmp_path):
    receiver = WebhookReceiver()
    alertmanager = Alertmanager(tmp_path, receiver.url)
    try:
        # An agent an hour behind: its first push tells it Alertmanager's clock (the Date header),
        # from the second on the times it sends are in Alertmanager's clock.
        switch = Switch()
        switch.on = True
        behind = lambda: time.time() - HOUR  # noqa: E731 - the agent's clock
        engine = Engine([switch], History(60), clock=behind)
        engine.evaluate()
        pusher = AlertmanagerPusher(engine, [alertmanager.url], "http://agent:9787/runbooks", interval_seconds=30)
        assert pusher.push_once() == 1 and pusher.push_once() == 1
        name = alertmanager.url.removeprefix("http://")
        assert pusher.health()[name]["clock_offset_seconds"] == pytest.approx(HOUR, abs=2)
        assert abs(pusher.health()[name]["clock_offset_seconds"]) >= CLOCK_SKEW_SECONDS
        [alert] = active_in(alertmanager)
        assert seconds(alert["endsAt"]) > time.time() + 60

        # A finding whose start was stamped by a clock since stepped back an hour: startsAt after
        # endsAt, which Alertmanager refuses with a 400 to the whole push.
        switch.gpus = ["1"]
        future = Engine([switch], History(60))
        future.evaluate(time.time() + HOUR)
        pusher = AlertmanagerPusher(future, [alertmanager.url], "http://agent:9787/runbooks", interval_seconds=30)
        assert pusher.push_once() == 1, pusher.health()
        assert {alert["labels"]["gpu"] for alert in active_in(alertmanager)} == {"0", "1"}
    finally:
        alertmanager.close()
        receiver.close()


@settings(max_examples=60, deadline=None)
@given(started=st.floats(-2 * HOUR, 2 * HOUR), resolved=st.one_of(st.none(), st.floats(-2 * HOUR, 2 * HOUR)),
       offset=st.floats(-3 * HOUR, 3 * HOUR))
def test_no_clock_makes_an_alert_end_before_it_starts(started, resolved, offset):
    """Whatever times a finding was stamped with (a clock stepped either way since) and however far
    Alertmanager's clock is from ours: startsAt is never after endsAt, nor after now in
    Alertmanager's clock, and every time is moved by the offset."""
    now = 1_700_000_000.0
    switch = Switch()
    switch.on = True
    engine = Engine([switch], History(60))
    engine.evaluate(now + started)
    if resolved is not None:
        switch.on = False
        engine.evaluate(now + started + abs(resolved))
    pusher = AlertmanagerPusher(engine, ["http://127.0.0.1:1"], "http://agent:9787/runbooks", interval_seconds=30,
                                clock=lambda: now)
    [alert] = pusher.alerts(now, offset)
    starts, ends = seconds(alert["startsAt"]), seconds(alert["endsAt"])
    assert starts <= ends and starts <= now + offset + 1e-3
