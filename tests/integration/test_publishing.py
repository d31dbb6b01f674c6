"""The three doors' shared parts: findings as metrics, as JSON, pushed to a real Alertmanager,
and runbooks served by the agent."""
from __future__ import annotations

import subprocess
import threading
import time
from datetime import datetime

import pytest
from fastapi.testclient import TestClient

from hybridmon.agent.publish.alertmanager import AlertmanagerPusher
from hybridmon.agent.daemon import Agent
from hybridmon.agent.detectors.engine import Engine
from hybridmon.agent.publish.exposition import TEXT
from hybridmon.agent.publish.findings import FindingsCollector
from hybridmon.agent.loop.history import History
from hybridmon.agent.api.runbooks import RunbookLibrary
from hybridmon.agent.api.server import create_app
from tests.support import fake_nvml
from tests.support.agent_helpers import fixture_config, run_every_collector_once
from tests.support.alertmanager_helpers import Alertmanager, Switch, WebhookReceiver, wait_until


def test_firing_findings_are_metrics_with_their_entity_labels():
    switch = Switch()
    engine = Engine([switch], History(60))
    collector = FindingsCollector(engine)
    switch.on = True
    engine.evaluate(100.0)
    samples = {s.name + str(sorted(s.labels.items())): s.value for m in collector.collect() for s in m.samples}
    labels = "[('alertname', 'GpuPcieStarvation'), ('gpu', '0'), ('severity', 'warning'), ('uuid', 'GPU-x0')]"
    assert samples["hybridmon_finding_active" + labels] == 1.0
    assert samples["hybridmon_finding_value" + labels] == 29.1e9
    assert samples["hybridmon_finding_threshold" + labels] == 26.8e9
    switch.on = False
    engine.evaluate(110.0)
    assert not any(k.startswith("hybridmon_finding_active") for k in
                   (s.name for m in collector.collect() for s in m.samples))


def test_the_findings_version_changes_with_every_evaluation_and_only_then():
    engine = Engine([Switch()], History(60))
    collector = FindingsCollector(engine)
    before = collector.version()
    assert collector.version() == before
    engine.evaluate(100.0)
    assert collector.version() != before


def test_the_evaluating_thread_renders_the_findings_not_the_next_scrape(fixture_agent, monkeypatch):
    exposition = fixture_agent.exposition
    for _ in range(2):  # scraped every second, as by Prometheus at 1 s
        exposition.render(TEXT)
    findings = next(c for c in exposition.health_registry.collectors() if isinstance(c, FindingsCollector))
    collected_in = []
    collect = findings.collect
    monkeypatch.setattr(findings, "collect", lambda: collected_in.append(threading.current_thread().name) or collect())
    # one evaluation interval after the fixture agent's own evaluation at 1_700_000_000
    due = 1_700_000_000.0 + fixture_agent.config.detectors.evaluation_interval_seconds
    evaluation = threading.Thread(target=fixture_agent._maybe_evaluate, args=(due,), name="evaluating")
    evaluation.start()
    evaluation.join()
    assert collected_in == ["evaluating"]
    body = exposition.render(TEXT)
    assert collected_in == ["evaluating"] and b"hybridmon_finding_active{" in body
    assert f"hybridmon_detector_evaluations_total {fixture_agent.engine.evaluations}.0".encode() in body


@pytest.fixture
def fixture_agent():
    fake_nvml.reset()
    agent = Agent(fixture_config())
    run_every_collector_once(agent, at=1_700_000_000.0)
    agent.engine.evaluate(1_700_000_000.0)
    yield agent
    agent.stop()
    fake_nvml.reset()


def test_fixture_host_findings_as_json_with_runbook_links_that_resolve(fixture_agent):
    client = TestClient(create_app(fixture_agent))
    body = client.get("/api/v1/findings", params={"state": "firing,pending"}).json()
    by_name = {f["alertname"]: f for f in body["findings"]}
    # The fixture host is misconfigured on purpose (tests/fixtures/README.md).
    assert {"HostSwappinessHigh", "HostTransparentHugepageAlways"} <= set(by_name)
    # vLLM (pid 4242) keeps the 8 MiB memlock default with 4 GiB of VmPin past it, which the
    # kernel lets through only with CAP_IPC_LOCK: the limit binds nothing, no finding
    assert "InferenceProcessMemlockLow" not in by_name
    swappiness = by_name["HostSwappinessHigh"]
    assert swappiness["value"] == 60 and swappiness["threshold"] == 10 and swappiness["severity"] == "info"
    assert swappiness["runbook_url"] == "http://127.0.0.1:9787/runbooks/HostSwappinessHigh"
    for finding in body["findings"]:
        page = client.get(finding["runbook_url"].replace("http://127.0.0.1:9787", ""))
        assert page.status_code == 200 and "<h2>Mitigation</h2>" in page.text, finding["alertname"]
    assert client.get("/api/v1/findings", params={"state": "bogus"}).status_code == 400


def test_fixture_host_findings_in_the_exposition_pass_promtool(fixture_agent):
    text = fixture_agent.exposition.render()
    assert b'hybridmon_finding_active{alertname="HostSwappinessHigh",severity="info"} 1.0' in text
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


@pytest.mark.parametrize("path", ["/runbooks/..%2F..%2Fetc%2Fpasswd", "/runbooks/NoSuchAlert", "/runbooks/lowercase", "/runbooks/" + "A" * 500])
def test_runbook_paths_outside_the_alert_names_are_404(fixture_agent, path):
    assert TestClient(create_app(fixture_agent)).get(path).status_code == 404


def test_runbook_index_lists_every_runbook():
    library = RunbookLibrary()
    index = library.index_html()
    assert library.names() and all(f'href="/runbooks/{name}"' in index for name in library.names())


def parse_time(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()



def test_push_to_a_real_alertmanager_fires_then_resolves(tmp_path):
    receiver = WebhookReceiver()
    alertmanager = Alertmanager(tmp_path, receiver.url)
    try:
        switch = Switch()
        engine = Engine([switch], History(60))
        pusher = AlertmanagerPusher(engine, [alertmanager.url], "http://agent:9787/runbooks",
                                    interval_seconds=30, extra_labels={"host": "gpu-host-1"})
        # Nothing firing: the empty list is pushed too, so a broken Alertmanager shows at once.
        assert pusher.push_once() == 1
        assert pusher.health()[alertmanager.url.removeprefix("http://")]["last_success"] is not None
        assert alertmanager.alerts() == []
        switch.on = True
        now = time.time()
        engine.evaluate(now)
        assert pusher.push_once() == 1
        (alert,) = wait_until(alertmanager.alerts, 10, "the alert in Alertmanager")
        assert alert["labels"] == {"alertname": "GpuPcieStarvation", "severity": "warning", "gpu": "0",
                                   "uuid": "GPU-x0", "host": "gpu-host-1"}
        assert alert["annotations"] == {"summary": "GPU 0 starved", "description": "link pinned",
                                        "runbook_url": "http://agent:9787/runbooks/GpuPcieStarvation"}
        assert abs(parse_time(alert["startsAt"]) - now) < 1
        assert parse_time(alert["endsAt"]) - now == pytest.approx(4 * 30, abs=1)
        firing = wait_until(lambda: [n for n in receiver.notifications if n["status"] == "firing"], 15, "firing webhook")
        assert firing[0]["alerts"][0]["labels"]["gpu"] == "0"

        switch.on = False
        resolved_at = time.time()
        engine.evaluate(resolved_at)
        pusher.push_once()
        resolved = wait_until(lambda: [n for n in receiver.notifications if n["status"] == "resolved"], 15, "resolved webhook")
        assert abs(parse_time(resolved[0]["alerts"][0]["endsAt"]) - resolved_at) < 1
        assert alertmanager.alerts() == []
    finally:
        alertmanager.close()
        receiver.close()


def test_an_unreachable_alertmanager_is_counted_not_fatal():
    switch = Switch()
    engine = Engine([switch], History(60))
    pusher = AlertmanagerPusher(engine, ["http://user:secret@127.0.0.1:9"], "http://x/runbooks", timeout_seconds=1)
    switch.on = True
    engine.evaluate(1.0)
    assert pusher.push_once() == 0
    # no credentials in what we report
    assert {name: record["failures"] for name, record in pusher.health().items()} == {"127.0.0.1:9": 1}


def test_default_runbook_links_name_a_host_a_reader_can_open():
    import socket

    from hybridmon.agent.daemon import default_runbook_base_url

    assert default_runbook_base_url("127.0.0.1:9787") == "http://127.0.0.1:9787/runbooks"
    assert default_runbook_base_url("[::1]:9787") == "http://[::1]:9787/runbooks"
    for wildcard in ("0.0.0.0:9787", "[::]:9787"):
        url = default_runbook_base_url(wildcard)
        assert url == f"http://{socket.getfqdn() or socket.gethostname()}:9787/runbooks"
        assert "0.0.0.0" not in url and "[::]" not in url


def test_an_agent_serving_https_links_its_runbooks_over_https():
    """With a web config that turns TLS on, http:// on the same port answers nothing useful."""
    from hybridmon.agent.config import load_config
    from hybridmon.agent.daemon import Agent

    config = load_config(environ={}, overrides={"paths.procfs": "/nonexistent-proc", "paths.sysfs": "/nonexistent-sys"})
    assert Agent(config, serves_https=True).runbook_base_url == "https://127.0.0.1:9787/runbooks"
    assert Agent(config).runbook_base_url == "http://127.0.0.1:9787/runbooks"
