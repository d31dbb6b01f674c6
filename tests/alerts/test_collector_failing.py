"""The tests of the collector_failing alert family (agent/alerts/collector_failing.py): its detector, on
histories written sample by sample, and its rule's promtool cases (`promtool_cases`, written
to rules/tests/generated_collector_failing.yml by `python -m tests.rules.generate` and run by
promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

import threading
import time

import pytest

from hybridmon.agent.alerts import collector_failing
from hybridmon.agent.alerts.collector_failing import ALERTNAME, HUNG_ALERTNAME
from hybridmon.agent.config import load_config
from hybridmon.agent.daemon import Agent
from hybridmon.agent.detectors.engine import Engine
from hybridmon.agent.loop.history import History
from hybridmon.agent.self_metrics import COLLECTOR_ERRORS, COLLECTOR_RUNNING, COLLECTOR_SUCCESS
from tests.support.detector_history import THRESHOLDS, assert_says_its_rules_words
from tests.support.promtool_cases import BEFORE_SAMPLES, ONSET, Test, firing, not_yet

T0 = 1_700_000_000.0


class BrokenSource(Exception):
    pass


@pytest.fixture
def agent(tmp_path, fixture_procfs, fixture_sysfs):
    """The agent on the fixture host without a GPU library: gpu has nothing to read (no failure)."""
    config = load_config(environ={}, overrides={
        "paths.procfs": fixture_procfs, "paths.sysfs": fixture_sysfs, "state_dir": str(tmp_path),
        "gpu.nvml_module": "hybridmon_no_such_nvml_module"})
    agent = Agent(config)
    yield agent
    agent.stop()


def scheduled(agent, name):
    (item,) = [item for item in agent.sampler.scheduled if item.collector.name == name]
    return item


def test_a_collector_failing_every_run_fires_after_for_and_says_what_is_blind(agent, monkeypatch):
    def broken(*_args, **_kwargs):
        raise BrokenSource("/proc/meminfo: unexpected line 'MemTotal: lots'")

    host_memory = scheduled(agent, "host_memory")
    monkeypatch.setattr(host_memory.collector, "collect", broken)
    detector = next(d for d in agent.engine.detectors if isinstance(d, collector_failing.Detector))
    engine = Engine([detector], History(600))
    wait = THRESHOLDS.collector_failing.for_seconds
    for step in range(0, int(wait) + 20, 10):
        agent.sampler.run_collector(host_memory)
        agent.sampler.run_collector(scheduled(agent, "gpu"))
        engine.evaluate(T0 + step)
    (state,) = engine.firing()
    finding = state.finding
    assert finding.alertname == "HybridmonCollectorFailing" and finding.labels == {"collector": "host_memory"}
    assert finding.details["errors"] >= wait / 10 and "MemTotal: lots" in finding.details["last_error"]
    assert finding.value == pytest.approx(wait / 10, abs=1)  # failed runs in the last `for`, one each 10 s
    assert_says_its_rules_words(finding)
    assert "Collector host_memory on " in finding.summary and "keeps failing" in finding.summary
    assert "failed for 5m or more" in finding.description
    # the GPU library is absent: nothing to read is not a failure
    assert scheduled(agent, "gpu").state.last_success is True


def test_a_collector_that_recovers_resolves_and_one_that_fails_once_stays_pending(agent, monkeypatch):
    pressure = scheduled(agent, "pressure")
    real = pressure.collector.collect
    monkeypatch.setattr(pressure.collector, "collect", lambda *a, **k: (_ for _ in ()).throw(BrokenSource("x")))
    detector = next(d for d in agent.engine.detectors if isinstance(d, collector_failing.Detector))
    engine = Engine([detector], History(600))
    agent.sampler.run_collector(pressure)
    engine.evaluate(T0)
    assert [s.state for s in engine.states()] == ["pending"]
    monkeypatch.setattr(pressure.collector, "collect", real)
    agent.sampler.run_collector(pressure)
    engine.evaluate(T0 + 10)
    assert engine.firing() == [] and [s.state for s in engine.states() if s.state != "resolved"] == []


def test_a_hung_collector_is_withheld_from_metrics_named_in_healthz_and_found(agent, monkeypatch):
    """Issue 30: with every NVML call blocking, /healthz said ok, gpu_up stayed 1 and the last
    figures stayed exported as live. A run that has not returned for hung_seconds (0.3 s here) has
    its samples withheld, /healthz says degraded and names it, and HybridmonCollectorHung is
    found; once the run returns, all is as before."""
    from fastapi.testclient import TestClient
    from hybridmon.agent.api.server import create_app

    host_memory = scheduled(agent, "host_memory")
    agent.sampler.run_collector(host_memory)
    assert b"hybridmon_memory_available_bytes" in agent.exposition.render()
    released = threading.Event()
    real = host_memory.collector.collect

    def blocked(*args, **kwargs):
        released.wait(30)
        return real(*args, **kwargs)
    monkeypatch.setattr(host_memory.collector, "collect", blocked)
    run = threading.Thread(target=agent.sampler.run_collector, args=(host_memory,))
    run.start()
    agent.exposition.hung_seconds = 0.3
    detector = collector_failing.Detector(collector_failing.Settings(for_seconds=300, hung_seconds=0.3))
    detector.attach(agent)
    api = TestClient(create_app(agent))
    try:
        assert b"hybridmon_memory_available_bytes" in agent.exposition.render()   # not yet hung
        time.sleep(0.4)
        text = agent.exposition.render()
        assert b"hybridmon_memory_available_bytes" not in text
        assert b'hybridmon_collector_running_seconds{collector="host_memory"}' in text
        (found,) = detector.evaluate(None, T0)
        assert found.alertname == HUNG_ALERTNAME and found.labels == {"collector": "host_memory"}
        assert found.value >= 0.3 and "is hung" in found.summary
        health = api.get("/healthz")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert "collector host_memory has not returned" in health.json()["degraded"][0]
    finally:
        released.set()
        run.join()
    assert b"hybridmon_memory_available_bytes" in agent.exposition.render()
    assert detector.evaluate(None, T0 + 10) == [] and api.get("/healthz").json()["status"] == "ok"


def test_the_hung_finding_says_its_rules_words():
    class StuckSampler:
        scheduled: list = []

        @staticmethod
        def hung(seconds):
            return {"gpu": 95.0} if seconds <= 95.0 else {}

    class RunningAgent:
        sampler, pusher = StuckSampler(), None
    detector = collector_failing.Detector(THRESHOLDS.collector_failing)
    detector.attach(RunningAgent())
    (found,) = detector.evaluate(None, T0)
    assert_says_its_rules_words(found)
    assert found.summary.endswith("its run has not returned for 1m 35s")


# --- its rule's promtool cases ------------------------------------------------------------------


def promtool_cases(t, catalog) -> list[Test]:
    """gpu fails every run (one a second) from the onset and fires; process fails every other
    sample (never for the whole `for`) and pcie never fails: both silent."""
    wait = t.collector_failing.for_seconds
    rule = catalog.find(ALERTNAME)
    test = Test("collector failing: gpu failing from the onset fires; process flapping and pcie "
                "healthy stay silent", firing(wait) + 120, catalog)
    rest = test.samples - BEFORE_SAMPLES
    test.gauge(COLLECTOR_SUCCESS.name, 1, 0, collector="gpu")
    test.counter(COLLECTOR_ERRORS.name, 0, 1.0, collector="gpu")
    flapping = " ".join(["0", "1"] * rest)[:2 * rest - 1]
    test.add(COLLECTOR_SUCCESS.name, f"1x{BEFORE_SAMPLES - 1} {flapping}", collector="process")
    test.counter(COLLECTOR_ERRORS.name, 0, 0.5, collector="process")
    test.constant(COLLECTOR_SUCCESS.name, 1, collector="pcie")
    test.constant(COLLECTOR_ERRORS.name, 0, collector="pcie")
    test.expect(not_yet(wait), rule.alert)
    test.expect(firing(wait), rule.alert, test.alert(rule, {"collector": "gpu"}, value=wait * 1.0))
    return [test, _hung(t, catalog)]


def _hung(t, catalog) -> Test:
    """gpu's run never returns from the onset (its running seconds grow with time) and fires once
    they reach hung_seconds; process returns from every run (0 between runs): silent."""
    hung = t.collector_failing.hung_seconds
    rule = catalog.find(HUNG_ALERTNAME)
    test = Test("collector hung: gpu's run not returning from the onset fires at hung_seconds; "
                "process returning from each run stays silent", firing(hung) + 120, catalog)
    test.counter(COLLECTOR_RUNNING.name, 0, 1.0, collector="gpu")
    test.constant(COLLECTOR_RUNNING.name, 0, collector="process")
    test.expect(ONSET, rule.alert)
    test.expect(firing(hung), rule.alert, test.alert(rule, {"collector": "gpu"}, value=float(firing(hung) - ONSET)))
    return test
