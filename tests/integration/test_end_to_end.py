"""The whole agent: fixture host golden output, the daemon over HTTP, record and replay."""
from __future__ import annotations

import os
import socket
import shutil
import subprocess
import time

import httpx
import pytest

from hybridmon.agent.config import load_config
from hybridmon.agent.daemon import Agent
from tests.support import fake_nvml
from tests.support.agent_helpers import (
    FIXTURE_ENVIRONMENT,
    HYBRIDMON,
    REPO,
    fixture_config,
    free_port,
    run_every_collector_once,
    start_daemon,
    stop_daemon,
    subprocess_environment,
    wait_for,
)

GOLDEN = REPO / "tests" / "golden" / "fixture-host.prom"


@pytest.fixture(autouse=True)
def default_fake_gpus():
    fake_nvml.reset()
    yield
    fake_nvml.reset()


TIMING_METRICS = ("hybridmon_process_numa_maps_read_seconds",)


def without_timings(text: str) -> str:
    """Measured read times differ run to run; everything else on the fixture host is fixed."""
    return "\n".join(
        line.rsplit(" ", 1)[0] + " <timing>" if line.startswith(TIMING_METRICS) else line
        for line in text.splitlines()
    ) + "\n"


def fixture_exposition() -> bytes:
    agent = Agent(fixture_config())
    try:
        run_every_collector_once(agent, at=1_700_000_000.0)
        failures = {i.collector.name: i.state.last_error for i in agent.sampler.scheduled if not i.state.last_success}
        assert failures == {}
        return agent.exposition.samples_text()
    finally:
        agent.stop()


def test_fixture_host_metrics_match_the_golden_file(update_golden):
    text = without_timings(fixture_exposition().decode())
    if update_golden:
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "run pytest --update-golden after an intended change"


def test_golden_output_passes_promtool_lint():
    promtool = shutil.which("promtool")
    assert promtool, "promtool is installed by scripts/test (Debian package prometheus)"
    agent = Agent(fixture_config())
    try:
        run_every_collector_once(agent, at=1_700_000_000.0)
        text = agent.exposition.render()
    finally:
        agent.stop()
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


def test_fixture_host_carries_what_the_issue_names():
    text = fixture_exposition().decode()
    expected = [
        'hybridmon_gpu_info{driver_version=',
        'hybridmon_gpu_pcie_link_generation{gpu="1"',
        'hybridmon_pcie_link_width_lanes{pci_bus_id="0000:ca:00.0"} 8.0',
        'hybridmon_pcie_aer_errors_total{pci_bus_id="0000:17:00.0",severity="correctable"}',
        'hybridmon_pcie_device_numa_node{pci_bus_id="0000:ca:00.0"} 1.0',
        'hybridmon_numa_node_memory_total_bytes{node="1"}',
        'hybridmon_process_swap_bytes{pid="4242",process_name="python3"}',
        'hybridmon_process_resident_off_gpu_node_bytes{gpu_node="0",pid="4242",process_name="python3"}',
        'hybridmon_pressure_stalled_seconds_total{resource="memory",scope="full"}',
        'hybridmon_sysctl_value{sysctl="vm.swappiness"} 60.0',
    ]
    missing = [line for line in expected if line not in text]
    assert missing == []


def scrape(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text


def scrape_containing(port: int, *needles: str):
    """A predicate for wait_for: the scrape text once it holds every needle, else None."""
    def predicate():
        text = scrape(port)
        return text if all(needle in text for needle in needles) else None
    return predicate


def test_daemon_serves_the_fixture_host_and_stops_on_sigterm():
    port = free_port()
    daemon = start_daemon(["run", "--listen", f"127.0.0.1:{port}"], FIXTURE_ENVIRONMENT)
    try:
        text = wait_for(scrape_containing(port, "hybridmon_gpu_info", 'collector="process_numa"'), 15, "GPU metrics")
        assert 'hybridmon_collector_success{collector="gpu"} 1.0' in text
        health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).json()
        assert health["status"] == "ok" and health["mode"] == "live"
    finally:
        code, err = stop_daemon(daemon)
    assert code == 0, err
    assert "Traceback" not in err


def test_daemon_on_this_host_runs_without_a_gpu_and_says_why_once():
    port = free_port()
    daemon = start_daemon(["run", "--listen", f"127.0.0.1:{port}"], {})
    try:
        text = wait_for(scrape_containing(port, "hybridmon_memory_total_bytes", 'hybridmon_collector_runs_total{collector="gpu"} 3'), 15, "three GPU collector runs")
        assert 'hybridmon_collector_no_data{collector="gpu"} 1.0' in text
        assert "hybridmon_gpu_memory_used_bytes" not in text
    finally:
        code, err = stop_daemon(daemon)
    assert code == 0, err
    assert err.count("NVIDIA driver not found") == 1, err


def test_daemon_refuses_a_taken_port_clearly():
    port = free_port()
    first = start_daemon(["run", "--listen", f"127.0.0.1:{port}"], FIXTURE_ENVIRONMENT)
    try:
        wait_for(lambda: scrape(port), 15, "first daemon")
        second = subprocess.run(HYBRIDMON + ["run", "--listen", f"127.0.0.1:{port}"], env=subprocess_environment(FIXTURE_ENVIRONMENT), cwd=REPO, capture_output=True, text=True, timeout=20)
        assert second.returncode == 74  # EX_IOERR: the OS refused the port
        assert f"cannot listen on 127.0.0.1:{port}" in second.stderr and "Traceback" not in second.stderr
    finally:
        stop_daemon(first)


def test_malformed_config_file_is_refused_with_the_key(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("[process]\npids = ['many']\n")
    result = subprocess.run(HYBRIDMON + ["run", "--config", str(config)], env=subprocess_environment(), cwd=REPO, capture_output=True, text=True, timeout=20)
    assert result.returncode == 78  # EX_CONFIG
    assert "process.pids.0 = 'many'" in result.stderr and "Traceback" not in result.stderr


def test_record_then_replay_exports_what_was_exported_live_on_this_host(tmp_path):
    """The real /proc and /sys of this machine change between ticks; the replay must match anyway."""
    trace = tmp_path / "live.jsonl.gz"
    config = load_config(environ={"HYBRIDMON_PROCESS__PIDS": f"[{os.getpid()}]"})
    recorder = Agent(config, record_to=trace)
    try:
        for tick in range(3):
            run_every_collector_once(recorder, at=1_700_000_000.0 + tick)
            _ = [bytearray(1 << 20) for _ in range(20)]  # move this process's counters between ticks
        live = recorder.exposition.samples_text()
    finally:
        recorder.stop()
    assert f'pid="{os.getpid()}"'.encode() in live

    replayer = Agent(load_config(environ={}), replay_from=trace)
    try:
        assert replayer.replay(speed=0) == 3 * len(recorder.sampler.scheduled)
        assert replayer.exposition.samples_text() == live
    finally:
        replayer.stop()


def test_record_and_replay_commands_on_the_fixture_host(tmp_path):
    trace = tmp_path / "fixture.jsonl.gz"
    recorded = subprocess.run(
        HYBRIDMON + ["record", "--duration", "3.5", "--output", str(trace)],
        env=subprocess_environment(FIXTURE_ENVIRONMENT), cwd=REPO, capture_output=True, text=True, timeout=30,
    )
    assert recorded.returncode == 0, recorded.stderr
    port = free_port()
    daemon = start_daemon(["run", "--replay", str(trace), "--speed", "0", "--listen", f"127.0.0.1:{port}"], {})
    try:
        text = wait_for(scrape_containing(port, 'mode="replay"', "hybridmon_gpu_info"), 15, "replayed GPU metrics")
        time.sleep(0.5)
        again = scrape(port)  # the trace is over: the last state stays served
    finally:
        code, err = stop_daemon(daemon)
    assert code == 0 and "Traceback" not in err
    replayed = text.split("# HELP hybridmon_collector_success")[0]
    assert again.split("# HELP hybridmon_collector_success")[0] == replayed
    assert without_timings(replayed) == without_timings(fixture_exposition().decode())


def raw_request(port: int, payload: bytes) -> bytes:
    import socket as sockets

    with sockets.create_connection(("127.0.0.1", port), timeout=3) as conn:
        try:
            conn.sendall(payload)
            conn.shutdown(sockets.SHUT_WR)
        except OSError:
            pass  # the server may answer and close before reading all of an oversized request
        chunks = []
        try:
            while chunk := conn.recv(65536):
                chunks.append(chunk)
        except OSError:
            pass
    return b"".join(chunks)


def test_hostile_requests_get_errors_and_the_agent_keeps_serving():
    port = free_port()
    daemon = start_daemon(["run", "--listen", f"127.0.0.1:{port}"], FIXTURE_ENVIRONMENT)
    try:
        wait_for(scrape_containing(port, "hybridmon_gpu_info"), 15, "first scrape")
        garbage = raw_request(port, b"\x00\xff\xfe garbage \r\n\r\n")
        assert garbage.startswith(b"HTTP/1.1 400 Bad Request")
        huge_header = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n"
        assert raw_request(port, huge_header).startswith(b"HTTP/1.1 400 Bad Request")
        assert httpx.get(f"http://127.0.0.1:{port}/../../etc/passwd", timeout=2).status_code == 404
        assert httpx.post(f"http://127.0.0.1:{port}/metrics", content=b"x" * 100_000, timeout=2).status_code == 405
        assert httpx.get(f"http://127.0.0.1:{port}/metrics?" + "a=1&" * 5000, timeout=2).status_code == 200
        import socket as sockets
        idle = [sockets.create_connection(("127.0.0.1", port), timeout=3) for _ in range(200)]
        try:  # idle and half-sent connections must not lock scrapes out
            idle[0].sendall(b"GET /metrics HTTP/1.1\r\nHost: slow")
            statuses = [httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code for _ in range(3)]
            assert statuses == [200, 200, 200]
        finally:
            for conn in idle:
                conn.close()
        wait_for(scrape_containing(port, "hybridmon_gpu_info"), 10, "scrape after the abuse")
        assert daemon.poll() is None
    finally:
        code, err = stop_daemon(daemon)
    assert code == 0 and "Traceback" not in err


def test_sigterm_stops_the_daemon_even_with_gpu_reads_hung_in_nvml(tmp_path):
    layout = tmp_path / "hung.json"
    hung = fake_nvml.FakeNvml()
    hung.configure(throughput_delay_seconds=3600)  # a GPU whose NVML call never returns
    hung.dump_layout(str(layout))
    port = free_port()
    daemon = start_daemon(["run", "--listen", f"127.0.0.1:{port}"], {**FIXTURE_ENVIRONMENT, "HYBRIDMON_FAKE_NVML_LAYOUT": str(layout)})
    try:
        # The GPU collector waits for its GPUs' reads only read_budget_seconds (issue 29): it
        # finishes its runs, the GPUs whose reads hang reported down from the second, and the
        # other collectors run too.
        text = wait_for(scrape_containing(port, 'hybridmon_gpu_up{gpu="0",uuid="GPU-0a1b2c3d-0000-4000-8000-000000000000"} 0.0'), 20, "the hung GPU reported down")
        assert 'hybridmon_collector_runs_total{collector="process"} 0.0' not in text
    finally:
        started = time.monotonic()
        code, err = stop_daemon(daemon)
    # The reads still hang in NVML at exit: their threads must not keep the agent from exiting.
    assert code == 0, err
    assert time.monotonic() - started < 9


def test_listening_socket_is_tcp_so_scrapes_get_nodelay():
    from hybridmon.agent.api.server import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()


def test_a_commit_rerenders_only_its_collectors_part(monkeypatch):
    """After the GPU collector commits, the scrape renders the GPU's families again and serves
    every other collector's cached text (the exposition's cost after a tick is what changed)."""
    from hybridmon.agent.publish.exposition_lines import LineCache

    agent = Agent(fixture_config())
    run_every_collector_once(agent, 1_700_000_000.0)
    first = agent.exposition.samples_text()
    rendered = []
    real = LineCache.render
    monkeypatch.setattr(LineCache, "render", lambda cache, samples: rendered.append(samples) or real(cache, samples))
    gpu = next(item for item in agent.sampler.scheduled if item.collector.name == "gpu")
    agent.sampler.run_collector(gpu, at=1_700_000_001.0)
    again = agent.exposition.samples_text()
    assert len(rendered) == 1 and rendered[0] is agent.history.latest()["gpu"][1]
    assert sorted(again.splitlines()) == sorted(first.splitlines())  # the fake NVML did not move
    assert agent.exposition.samples_text() is again and len(rendered) == 1  # cached until a commit


def test_the_agents_own_process_metrics_are_its_own_whatever_procfs_it_reads():
    """Issue 32: process_* as every Prometheus exporter has them, from the agent's own /proc entry,
    though its collectors read the fixture host's procfs."""
    import psutil

    agent = Agent(fixture_config())
    try:
        run_every_collector_once(agent, at=1_700_000_000.0)
        lines = dict(line.rsplit(" ", 1) for line in agent.exposition.render().decode().splitlines()
                     if line.startswith("process_"))
    finally:
        agent.stop()
    me = psutil.Process()
    assert float(lines["process_resident_memory_bytes"]) == pytest.approx(me.memory_info().rss, rel=0.2)
    assert float(lines["process_start_time_seconds"]) == pytest.approx(me.create_time(), abs=2)
    assert float(lines["process_open_fds"]) > 0 and float(lines["process_cpu_seconds_total"]) > 0
