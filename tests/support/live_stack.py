"""Real binaries on loopback for the live alert path: Prometheus (Debian's `prometheus`) scraping
agents that run as `hybridmon run --replay` subprocesses, a watch on an agent's /metrics that
notes when the replay reaches a state, and an inference server whose counters keep moving for the
live agent to scrape. Alertmanager and the webhook receiver are tests/support/alertmanager_helpers.py's.

Every process writes its log to a file in the caller's directory (a pipe nobody reads would block
it once full); the tail goes into the assertion message when a process does not come up.
"""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

import httpx
import yaml

from hybridmon import __version__
from hybridmon.agent.bench.store import save_run
from tests.support.agent_helpers import HYBRIDMON, REPO, free_port, subprocess_environment
from tests.support.fake_inference_server import FakeInferenceServer

RULES_FILE = REPO / "rules" / "hybridmon.rules.yml"
INFERENCE_FIXTURES = REPO / "tests" / "fixtures" / "inference"
# Sample names that only go up: they advance at every scrape; every other sample is a gauge.
COUNTER_SUFFIXES = ("_total", "_count", "_sum", "_bucket")
JOB = "hybridmon"
READY_SECONDS = 20


def require_binary(name: str, package: str) -> str:
    """The binary's path; a missing one fails the test (scripts/test installs it), never skips."""
    path = shutil.which(name)
    assert path, f"{name} is not installed: scripts/test installs Debian's {package} (apt-get install {package})"
    return path


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_ready(url: str, process: subprocess.Popen, log: Path, what: str) -> None:
    deadline = time.monotonic() + READY_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{what} exited with {process.returncode}:\n{log_tail(log)}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{what} not ready at {url} within {READY_SECONDS} s:\n{log_tail(log)}")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class Prometheus:
    """Scrapes `targets` and evaluates `rule_file` every `interval` seconds, alerting to
    `alertmanager` (host:port). The targets need not be up yet. `scrape_configs`, when given,
    replaces the one plain-HTTP job (HTTPS, basic auth: tests/integration/test_web_config_live.py)."""

    def __init__(self, directory: Path, targets: list[str], alertmanager: str,
                 rule_file: Path = RULES_FILE, interval: str = "1s", scrape_configs: list[dict] | None = None) -> None:
        binary = require_binary("prometheus", "prometheus")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = directory / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "rule_files": [str(rule_file)],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]},
            "scrape_configs": scrape_configs or [{"job_name": JOB, "static_configs": [{"targets": targets}]}],
        }))
        self.log = directory / "prometheus.log"
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={directory / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT,
            )
        try:
            wait_ready(f"{self.url}/-/ready", self.process, self.log, "Prometheus")
        except AssertionError:
            self.close()
            raise

    def _get(self, path: str, **params) -> dict | list:
        response = httpx.get(f"{self.url}{path}", params=params, timeout=10)
        body = response.json()
        assert body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr} if at is None else {"query": expr, "time": at}
        return self._get("/api/v1/query", **params)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict]:
        return self._get("/api/v1/query_range", query=expr, start=start, end=end, step=step)["result"]

    def alerts(self) -> list[dict]:
        """Pending and firing alerts now, as Prometheus holds them."""
        return self._get("/api/v1/alerts")["alerts"]

    def rules(self) -> list[dict]:
        """Every rule of every group with its health and last error."""
        return [rule for group in self._get("/api/v1/rules")["groups"] for rule in group["rules"]]

    def close(self) -> None:
        stop(self.process)


class AgentProcess:
    """`hybridmon run` on 127.0.0.1:`port`, replaying `replay` at `speed` when given, else live;
    `environment` adds HYBRIDMON_* settings. Started, not waited for: call wait_ready()."""

    def __init__(self, directory: Path, name: str, port: int, environment: dict[str, str],
                 replay: Path | None = None, speed: float = 1.0) -> None:
        self.name = name
        self.instance = f"127.0.0.1:{port}"
        self.url = f"http://{self.instance}"
        self.log = directory / f"agent-{name}.log"
        arguments = ["run", "--listen", self.instance]
        if replay is not None:
            arguments += ["--replay", str(replay), "--speed", str(speed)]
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                HYBRIDMON + arguments, env=subprocess_environment(environment), cwd=REPO,
                stdout=log, stderr=subprocess.STDOUT,
            )

    def wait_ready(self) -> None:
        wait_ready(f"{self.url}/healthz", self.process, self.log, f"the agent {self.name}")

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=2).text

    def findings(self, states: str = "firing,pending,resolved") -> list[dict]:
        return httpx.get(f"{self.url}/api/v1/findings", params={"state": states}, timeout=2).json()["findings"]

    def close(self) -> None:
        stop(self.process)


def store_bench_run(state_dir: Path, gpu: dict, reports: dict[str, Path], link: dict | None) -> Path:
    """A benchmark run of `gpu` (index, uuid, name, pci_bus_id, numa_node) stored in `state_dir` as
    `hybridmon bench` stores one, from recorded reports of the binary (placement -> file), finished
    now."""
    placements = []
    for placement, path in reports.items():
        report = json.loads(path.read_text())
        placements.append({"placement": placement, "numa_node": report.get("numa_node"), "report": report})
    record = {"format": 1, "finished_at": time.time(), "hybridmon_version": __version__, "gpu": gpu,
              "link": link, "contended": None, "placements": placements, "failures": []}
    return save_run(state_dir, record)


def sample_value(exposition: str, metric: str, **labels: str) -> float | None:
    """The value of the first sample of `metric` carrying `labels`, from /metrics text."""
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    for line in exposition.splitlines():
        if line.startswith(metric + "{") and all(label in line for label in wanted):
            return float(line.rsplit(" ", 1)[1])
    return None


class StateWatch:
    """Polls an agent's /metrics every `period` seconds in a thread and notes when each condition
    first holds, each checked only after the one before it held: the moments a replay reaches
    the states of its story.

    seen[name] = (after, by), wall times (time.time()): the agent committed the state after the
    previous poll was sent (that poll's response was rendered later and did not show it) and no
    later than the response that showed it. `after` is the conservative onset: a delay measured
    from it is never shorter than the real one, and longer by at most a period and a poll."""

    def __init__(self, agent: AgentProcess, conditions: list[tuple[str, Callable[[str], bool]]],
                 period: float = 0.05) -> None:
        self.seen: dict[str, tuple[float, float]] = {}
        self._conditions = conditions
        self._agent = agent
        self._period = period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="state-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pending = list(self._conditions)
        previous_sent = time.time()
        while pending and not self._stop.is_set():
            sent = time.time()
            try:
                text = self._agent.metrics()
            except httpx.HTTPError:
                text = ""
            received = time.time()
            while pending and text and pending[0][1](text):
                self.seen[pending.pop(0)[0]] = (previous_sent, received)
            previous_sent = sent
            self._stop.wait(self._period)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def first_delivery(deliveries: list[tuple[float, dict]], status: str,
                   matches: Callable[[dict], bool]) -> tuple[float, dict] | None:
    """(arrival time, alert) of the first webhook notification holding an alert in `status`
    ("firing" or "resolved") for which `matches(alert)` holds."""
    for arrived, body in list(deliveries):
        for alert in body.get("alerts", []):
            if alert.get("status") == status and matches(alert):
                return arrived, alert
    return None


class AdvancingInferenceServer(FakeInferenceServer):
    """A FakeInferenceServer whose /metrics moves on at every GET, from a fixture's two bodies
    (`<fixture>.1.prom`, `.2.prom`, "5 s apart"): the n-th answer has every counter and histogram
    bucket at `.1 + n x (.2 - .1)` and the gauges of `.2`. Rates and the recent quantiles the
    collector computes from consecutive scrapes are then steady and non-zero however long a test
    runs, each scrape adding what the fixture adds between its two bodies."""

    def __init__(self, fixture: str = "vllm-v1-names") -> None:
        first, second = ((INFERENCE_FIXTURES / f"{fixture}.{n}.prom").read_text().splitlines() for n in (1, 2))
        if len(first) != len(second):
            raise ValueError(f"{fixture}: the two bodies differ in lines")
        self._lines = list(zip(first, second))
        super().__init__({"/metrics": ["placeholder"]})

    def current(self, path: str) -> str | None:
        if path != "/metrics":
            return None
        step = len(self.requests)
        return "".join(advanced(one, two, step) + "\n" for one, two in self._lines)


def advanced(first: str, second: str, step: int) -> str:
    """One exposition line `step` scrapes on: counters advanced, gauges as in `second`."""
    if first.startswith("#") or not first.strip():
        return second
    name_and_labels, first_value = first.rsplit(" ", 1)
    second_name, second_value = second.rsplit(" ", 1)
    if second_name != name_and_labels:
        raise ValueError(f"the two bodies differ: {first!r} vs {second!r}")
    if not name_and_labels.split("{", 1)[0].endswith(COUNTER_SUFFIXES):
        return second
    start, increase = float(first_value), float(second_value) - float(first_value)
    return f"{name_and_labels} {start + step * increase!r}"
