"""POST/GET /api/v1/bench on an agent of the fixture host: the token, the busy-GPU refusal, one run
at a time, hostile bodies; and the agent taking the stored run's measurements at start."""
from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from hybridmon.agent.daemon import Agent
from hybridmon.agent.api.server import create_app
from tests.support import fake_nvml
from tests.support.agent_helpers import fixture_config, run_every_collector_once
from tests.support.bench_helpers import calls, fake_binary

TOKEN = "0123456789abcdef0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def idle_gpus():
    """The fixture host's GPUs with nothing running (the module-level fake the agent loads)."""
    gpus = fake_nvml.default_gpus()
    for gpu in gpus:
        gpu.processes, gpu.utilization_percent = [], 0
    fake_nvml.configure(gpus=gpus)
    yield
    fake_nvml.reset()


def make_agent(tmp_path, token: str | None = TOKEN, report: str = "report-gen4-local.json",
               **bench) -> Agent:
    token_file = None
    if token is not None:
        token_file = tmp_path / "token"
        token_file.write_text(token + "\n")
        token_file.chmod(0o600)
    config = fixture_config(**{"state_dir": str(tmp_path / "state"),
                               "bench.api_token_file": str(token_file) if token_file else None,
                               "bench.binary": str(fake_binary(tmp_path, local=report)), **bench})
    agent = Agent(config)
    run_every_collector_once(agent, time.time())
    return agent


def client(agent: Agent) -> TestClient:
    return TestClient(create_app(agent))


def finish(test_client: TestClient) -> dict:
    test_client.app.state.bench.wait(30)
    return test_client.get("/api/v1/bench").json()


def test_without_a_token_file_the_endpoint_is_off(tmp_path, idle_gpus):
    api = client(make_agent(tmp_path, token=None))
    answer = api.post("/api/v1/bench", json={}, headers=AUTH)
    assert answer.status_code == 403 and "bench.api_token_file" in answer.json()["error"]
    assert api.get("/api/v1/bench").json() == {"state": "idle", "enabled": False}


def test_a_weak_token_turns_the_endpoint_off(tmp_path, idle_gpus, caplog):
    api = client(make_agent(tmp_path, token="short"))
    assert api.post("/api/v1/bench", json={}, headers={"Authorization": "Bearer short"}).status_code == 403
    assert "at least 16 characters" in caplog.text


@pytest.mark.parametrize("header", [None, "Bearer wrong-token-wrong-token-xx", f"Basic {TOKEN}",
                                    f"Bearer {TOKEN[:-1]}", "Bearer "])
def test_missing_or_wrong_tokens_get_401_and_start_nothing(tmp_path, idle_gpus, header):
    api = client(make_agent(tmp_path))
    answer = api.post("/api/v1/bench", json={}, headers={"Authorization": header} if header else {})
    assert answer.status_code == 401 and answer.headers["WWW-Authenticate"].startswith("Bearer")
    assert calls(tmp_path) == [] and api.get("/api/v1/bench").json()["state"] == "idle"


@pytest.mark.slow
def test_a_busy_gpu_is_refused_unless_forced(tmp_path):
    api = client(make_agent(tmp_path))  # fixture host: pid 4242 on GPU 0 at 87 %
    refused = api.post("/api/v1/bench", json={"gpu": 0}, headers=AUTH)
    assert refused.status_code == 409
    assert "pid 4242 (python3, 30.0 GiB)" in refused.json()["busy"]["0"]
    assert calls(tmp_path) == []
    forced = api.post("/api/v1/bench", json={"gpu": 0, "force": True}, headers=AUTH)
    assert forced.status_code == 202 and forced.json()["state"] == "running"
    status = finish(api)
    assert status["state"] == "finished", status
    assert status["results"] == [{"gpu": 0, "pci_bus_id": "0000:17:00.0"}]
    stored = json.loads((tmp_path / "state/bench/latest/0000:17:00.0.json").read_text())
    assert "pid 4242" in stored["contended"]


@pytest.mark.slow
def test_an_idle_host_runs_every_gpu_and_reports_progress(tmp_path, idle_gpus):
    api = client(make_agent(tmp_path))
    assert api.post("/api/v1/bench", headers=AUTH).status_code == 202  # no body: every GPU
    status = finish(api)
    # GPU 1 is 0000:ca:00.0 but the stand-in binary always answers 0000:17:00.0: refused, said so.
    assert status["state"] == "failed"
    assert status["results"] == [{"gpu": 0, "pci_bus_id": "0000:17:00.0"}]
    assert status["errors"][0]["gpu"] == 1 and "device order" in status["errors"][0]["error"]
    # GPU 1's last step: the stand-in answers its node 1 with report-gen4-remote.json (24 tests,
    # the last a pageable loop)
    assert status["progress"]["steps"] == 24 and status["busy"] == {}
    assert status["progress"]["issue"] == "loop"


@pytest.mark.slow
def test_one_benchmark_at_a_time(tmp_path, idle_gpus):
    agent = make_agent(tmp_path)
    binary = tmp_path / "offload_bench"
    gate = tmp_path / "gate"
    # Hold the stand-in until the test lets it go, so the second request lands during the first.
    binary.write_text(binary.read_text().replace(
        "import json, sys\n",
        f"import json, os, sys, time\nwhile not os.path.exists({str(gate)!r}) and sys.argv[1:] != ['--version']:\n    time.sleep(0.02)\n", 1))
    api = client(agent)
    assert api.post("/api/v1/bench", json={"gpu": 0}, headers=AUTH).status_code == 202
    second = api.post("/api/v1/bench", json={"gpu": 0}, headers=AUTH)
    assert second.status_code == 409 and second.json()["error"] == "a benchmark is already running"
    gate.touch()
    assert finish(api)["state"] == "finished"
    assert api.post("/api/v1/bench", json={"gpu": 0}, headers=AUTH).status_code == 202
    finish(api)


@pytest.mark.parametrize("body, status", [
    (b"not json", 400), (b"[1, 2]", 400), (b'{"gpu": "0"}', 400), (b'{"gpu": -1}', 400),
    (b'{"gpu": 0, "rm": "-rf"}', 400), (b'{"force": "yes"}', 400), (b"x" * 5000, 413),
])
def test_hostile_bodies_are_refused(tmp_path, idle_gpus, body, status):
    api = client(make_agent(tmp_path))
    answer = api.post("/api/v1/bench", content=body, headers=AUTH)
    assert answer.status_code == status and "error" in answer.json()
    assert calls(tmp_path) == []


def test_a_replaying_agent_refuses(tmp_path, idle_gpus):
    agent = make_agent(tmp_path)
    agent.mode = "replay"
    api = client(agent)
    answer = api.post("/api/v1/bench", json={}, headers=AUTH)
    assert answer.status_code == 409 and "replays a trace" in answer.json()["error"]


@pytest.mark.slow
def test_agent_loads_the_latest_run_at_start_and_judges_it(tmp_path, idle_gpus):
    """A slow run stored through the API: a new agent over the same state directory exports it,
    uses it as capacity and raises GpuPcieBandwidthLow (fixture GPU 0 has a Gen4 x16 maximum)."""
    api = client(make_agent(tmp_path, report="report-gen4-slow-local.json"))
    assert api.post("/api/v1/bench", json={"gpu": 0}, headers=AUTH).status_code == 202
    assert finish(api)["state"] == "finished"
    restarted = make_agent(tmp_path)
    restarted.engine.evaluate(time.time())
    text = restarted.exposition.render().decode()
    assert "hybridmon_bench_bandwidth_bytes_per_second{" in text
    assert 'hybridmon_gpu_pcie_measured_capacity_bytes_per_second{direction="host_to_device",gpu="0"' in text
    (state,) = [s for s in restarted.engine.firing() if s.finding.alertname == "GpuPcieBandwidthLow"]
    assert state.finding.labels["gpu"] == "0"
    assert state.finding.value == pytest.approx(13.628e9 / (16 * 1969.2e6), rel=1e-3)
