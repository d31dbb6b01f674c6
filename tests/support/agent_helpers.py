"""Building agents on the fixture host for end-to-end tests."""
from __future__ import annotations

import os
import socket
import sys
import time
import subprocess
import signal
from pathlib import Path

import httpx

from hybridmon.agent.config import load_config
from hybridmon.agent.daemon import Agent
from tests.support.paths import FIXTURE_HOST

REPO = Path(__file__).resolve().parents[2]

# The fixture host as environment variables, for daemon subprocesses and in-process configs alike.
FIXTURE_ENVIRONMENT = {
    "HYBRIDMON_PATHS__PROCFS": str(FIXTURE_HOST / "proc"),
    "HYBRIDMON_PATHS__SYSFS": str(FIXTURE_HOST / "sys"),
    "HYBRIDMON_GPU__NVML_MODULE": "tests.support.fake_nvml",
    # One 20 ms window per tick: the fixture's driver (550) has no PCIe byte counters, and what a
    # sampler thread would sample depends on real time, where the fixture's output must be fixed.
    "HYBRIDMON_GPU__PCIE_SAMPLES_PER_SECOND": "0",
    "HYBRIDMON_PCIE__UDEV": "false",
    # Benchmark results: none stored on the fixture host (the directory does not exist).
    "HYBRIDMON_STATE_DIR": str(FIXTURE_HOST / "state"),
}


def fixture_config(**overrides):
    return load_config(environ=FIXTURE_ENVIRONMENT, overrides=overrides)


def run_every_collector_once(agent: Agent, at: float) -> None:
    """In the agent's own order, so the process collector sees the GPU collector's processes."""
    for item in agent.sampler.scheduled:
        agent.sampler.run_collector(item, at=at)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def subprocess_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDMON_")}
    environment["PYTHONPATH"] = str(REPO)
    environment.update(extra or {})
    return environment


HYBRIDMON = [sys.executable, "-m", "hybridmon.agent.cli"]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except httpx.HTTPError as error:
            last = error
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


def start_daemon(args: list[str], extra_env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        HYBRIDMON + args, env=subprocess_environment(extra_env), cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def stop_daemon(process: subprocess.Popen) -> tuple[int, str]:
    process.send_signal(signal.SIGTERM)
    try:
        _out, err = process.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        _out, err = process.communicate()
        raise AssertionError("daemon did not stop within 10 s of SIGTERM:\n" + err)
    return process.returncode, err
