"""/healthz tells a liveness probe when the agent stalled (agent/loop/liveness.py): a sampler whose
collectors all block, or whose loop died, answers 503 with the reason within the bound; a working
one, a replay and one hung collector among working ones answer 200."""
from __future__ import annotations

import threading
import time

import pytest
from fastapi.testclient import TestClient

from hybridmon.agent.loop import liveness
from hybridmon.agent.config import load_config
from hybridmon.agent.daemon import Agent
from hybridmon.agent.api.server import create_app

BOUND_SECONDS = 1.0  # the floor, lowered so a test waits a second instead of a minute


@pytest.fixture
def agent(tmp_path, fixture_procfs, fixture_sysfs, monkeypatch):
    """The agent on the fixture host (no GPU library), ticking every 0.1 s, stall bound 1 s (the
    detectors', evaluating every second at most, 2 s)."""
    monkeypatch.setattr(liveness, "STALL_FLOOR_SECONDS", BOUND_SECONDS)
    config = load_config(environ={}, overrides={
        "paths.procfs": fixture_procfs, "paths.sysfs": fixture_sysfs, "state_dir": str(tmp_path),
        "gpu.nvml_module": "hybridmon_no_such_nvml_module", "interval_seconds": 0.1,
        "detectors.evaluation_interval_seconds": 1})
    agent = Agent(config)
    for item in agent.sampler.scheduled:  # every collector every tick: the bound is 1 s for all
        item.interval_seconds = 0.1
    released = threading.Event()
    agent.release = released
    yield agent
    released.set()
    agent.stop(timeout=2)


def healthz_after(agent, seconds: float):
    agent.start()
    time.sleep(seconds)
    return TestClient(create_app(agent)).get("/healthz")


@pytest.mark.slow  # real time waited out
def test_a_sampler_whose_collectors_all_block_answers_503_within_the_bound(agent, monkeypatch):
    """Before: /healthz was a constant "ok", and a probe could not catch a hung sampler."""
    for item in agent.sampler.scheduled:
        monkeypatch.setattr(item.collector, "collect", lambda: agent.release.wait())
    answer = healthz_after(agent, 2 * BOUND_SECONDS + 0.8)
    assert answer.status_code == 503, answer.text
    body = answer.json()
    assert body["status"] == "stalled"
    (collectors, detectors) = body["problems"]
    assert collectors.startswith("no collector has finished a run for ") and "host_memory " in collectors
    assert detectors.startswith("the detectors have not evaluated for ")
    assert body["collectors"]["host_memory"]["running_seconds"] >= BOUND_SECONDS
    assert agent.sampler.loop.ticks > 10  # the loop itself kept ticking: it is not what stalled


@pytest.mark.slow  # real time waited out
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loop's death
def test_a_dead_sampling_loop_answers_503(agent, monkeypatch):
    ticks = []

    def tick_then_die(now=None):
        ticks.append(now)
        if len(ticks) > 3:
            raise RuntimeError("a bug in the loop")
        type(agent.sampler).tick(agent.sampler, now)

    monkeypatch.setattr(agent.sampler, "tick", tick_then_die)
    answer = healthz_after(agent, BOUND_SECONDS + 0.8)
    assert answer.status_code == 503, answer.text
    assert any(p.startswith("the sampling loop has not ticked for ") for p in answer.json()["problems"])


@pytest.mark.slow  # real time waited out
def test_a_working_agent_and_one_hung_collector_among_working_ones_answer_ok(agent, monkeypatch):
    # One source hung (NVML on a lost GPU): shown, not fatal; a restart would not bring it back.
    monkeypatch.setattr(next(i for i in agent.sampler.scheduled if i.collector.name == "pcie").collector,
                        "collect", lambda: agent.release.wait())
    answer = healthz_after(agent, 2 * BOUND_SECONDS + 0.8)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["status"] == "ok" and body["problems"] == []
    assert body["collectors"]["pcie"]["running_seconds"] >= BOUND_SECONDS
    # A working collector is between runs (None) or caught mid-run, well inside the bound: on a
    # loaded machine /healthz can land during host_memory's 1 s run.
    running = body["collectors"]["host_memory"]["running_seconds"]
    assert running is None or running < BOUND_SECONDS


def test_before_the_loop_starts_nothing_is_judged(agent):
    answer = TestClient(create_app(agent)).get("/healthz")
    assert answer.status_code == 200 and answer.json()["status"] == "ok"
