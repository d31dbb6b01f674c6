"""The status page at GET /: findings with runbook links, signals per GPU, process and inference
server, the last benchmark and the agent's health; escaped; and rendered by a real browser at
phone width."""
from __future__ import annotations

import gzip
import html
import json
import math
import re
import shutil
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from hybridmon.agent.bench.store import save_run
from hybridmon.agent.config import load_config
from hybridmon.agent.daemon import Agent
from hybridmon.agent.detectors.base import DetectorBase, Finding
from hybridmon.units import human_bytes, human_rate
from hybridmon.agent.detectors.engine import Engine
from hybridmon.pcie_rates import achievable_capacity, theoretical_capacity
from hybridmon.agent.publish.findings import runbook_url
from tests.support.scenarios import SCENARIOS, START_TIME, history_seconds_for
from hybridmon.agent.api.server import create_app
from hybridmon.agent.status.inference import COUNTERS_READ
from hybridmon.agent.status.page import render_status_page
from hybridmon.agent.status.template import SEVERITY_COLOURS
from hybridmon.agent.status.trends import SPAN_SECONDS
from hybridmon.exporters import bench, gpu, numa, process
from hybridmon.exporters.base import Samples
from hybridmon.exporters.inference_names import BY_FIELD, SCRAPE_ERROR, SCRAPE_SUCCESS
from tests.support import fake_nvml
from tests.support.agent_helpers import fixture_config, free_port, run_every_collector_once
from tests.support.bench_helpers import BENCH_FIXTURES
from tests.support.paths import FIXTURE_HOST
from tests.support.live_stack import AdvancingInferenceServer
from tests.support.status_page_helpers import PHONE_WIDTH, PageStructure, chromium, chromium_binary, count_colour
from tests.support.agent_helpers import start_daemon, stop_daemon, wait_for

NOW = 1_700_000_000.0
# PCIe throughput, GPU memory used, resident, swap, GPU memory per process, swap in, swap out, major
# faults, PSI, generated tokens, KV cache usage: the metrics the status page plots (11); the
# tiered-KV view's hour (agent/status/kv_tiers.py): TTFT and ITL percentile, sum and count (6),
# offload bytes, preemptions, requests finished, prefix queried, hit and host-hit tokens, host
# tier size, contents, tokens held and capacity in tokens (10).
PLOTTED_METRICS = 11 + 6 + 10
GPU0 = ("0", "GPU-0a1b2c3d-0000-4000-8000-000000000000")


@pytest.fixture
def fixture_agent(tmp_path):
    """The fixture host sampled twice (rates need two points) and evaluated once. Its own state
    directory, so a benchmark stored on the machine running the tests never shows up."""
    fake_nvml.reset()
    agent = Agent(fixture_config(state_dir=str(tmp_path / "state")))
    try:
        run_every_collector_once(agent, at=NOW - 1)
        run_every_collector_once(agent, at=NOW)
        agent.engine.evaluate(NOW)
        yield agent
    finally:
        agent.stop()
        fake_nvml.reset()


def latest_value(agent: Agent, metric: str, **labels: str) -> float:
    found = [s.value for _at, samples in agent.history.latest().values() for s in samples.find(metric, **labels)]
    assert len(found) == 1, (metric, labels, found)
    return found[0]


def section_text(page: str, section_id: str) -> str:
    """The text of one <section>, as a reader sees it."""
    match = re.search(rf'<section id="{section_id}">(.*?)</section>', page, re.S)
    assert match, f"no section {section_id}"
    return PageStructure(match.group(1)).text


def test_fixture_host_page_lists_findings_by_severity_with_runbooks_and_the_signals(fixture_agent):
    response = TestClient(create_app(fixture_agent)).get("/")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    page = response.text
    parsed = PageStructure(page)
    states = fixture_agent.engine.states()
    assert {s.state for s in states} == {"firing", "pending"}  # the fixture host has both
    for state in states:
        finding = state.finding
        assert html.escape(finding.summary) in page, finding.alertname
        assert runbook_url(fixture_agent.runbook_base_url, finding.alertname) in parsed.links()
        assert f'class="card finding {finding.severity} {state.state}"' in page
    # Pending warnings come before firing infos; only firing ones colour the banner.
    assert page.index('finding warning pending') < page.index('finding info firing')
    firing_infos = [s for s in states if s.state == "firing" and s.finding.severity == "info"]
    assert firing_infos and 'class="banner info"' in page and f"{len(firing_infos)} info firing" in parsed.text

    gpus = section_text(page, "gpus")
    used = latest_value(fixture_agent, gpu.MEMORY_USED.name, gpu="0")
    total = latest_value(fixture_agent, gpu.MEMORY_TOTAL.name, gpu="0")
    assert f"{human_bytes(used)} of {human_bytes(total)}" in gpus
    received = latest_value(fixture_agent, gpu.PCIE_THROUGHPUT.name, gpu="1", direction="host_to_device")
    # read against what GpuPcieStarvation divides by: without a benchmark, what copies achieve
    assert f"{human_rate(received)} of {human_rate(achievable_capacity(3, 8))} achievable" in gpus
    assert "theoretical" not in gpus
    assert "Gen3 x8 (max Gen4 x16)" in gpus and "17 since the driver loaded" in gpus

    processes = section_text(page, "processes")
    on_gpu = latest_value(fixture_agent, gpu.PROCESS_MEMORY_USED.name, pid="4242")
    swapped = latest_value(fixture_agent, process.SWAP.name, pid="4242")
    off_node = latest_value(fixture_agent, numa.PROCESS_RESIDENT_OFF_GPU_NODE.name, pid="4242", gpu_node="0")
    resident = latest_value(fixture_agent, process.RESIDENT.name, pid="4242")
    assert "python3 · pid 4242" in processes and "vllm · meta-llama/Meta-Llama-3-8B-Instruct" in processes
    assert "vllm.entrypoints" not in page  # no command line unless process.export_cmdline is set
    assert f"{human_bytes(on_gpu)} on GPU 0" in processes and human_bytes(swapped) in processes
    assert f"{off_node / resident * 100:.0f} % off node 0" in processes   # vLLM's memory is mostly on node 1
    assert "0.0/s" in processes  # the fixture's counters stand still between the two samples

    host = section_text(page, "host")
    assert "Memory available" in host and "PSI memory some" in host
    assert "No benchmark yet: run hybridmon bench" in section_text(page, "bench")
    health = section_text(page, "agent")
    assert "live" in health and "none failing" in health
    assert "nothing to read on this host: no benchmark results" in health


def test_the_page_shows_the_last_benchmark_and_starvation_uses_its_measured_capacity(tmp_path):
    """A stored run (the fixture report, hand-written, not a measurement) through the real bench
    collector: the GPU's PCIe rows are read against the measured rate, the benchmark card shows
    the largest copies."""
    report = json.loads((BENCH_FIXTURES / "report-gen4-local.json").read_text())
    sampled_at = time.time()  # a live agent: the page measures the run's age by the wall clock
    save_run(tmp_path, {
        "format": 1, "finished_at": sampled_at - 3600, "hybridmon_version": "test",
        "gpu": {"index": 0, "uuid": GPU0[1], "name": "NVIDIA L40S", "pci_bus_id": "0000:17:00.0", "numa_node": 0},
        "link": {"generation": 4, "width": 16, "max_generation": 4, "max_width": 16},
        "contended": None, "placements": [{"placement": "local", "numa_node": 0, "report": report}], "failures": [],
    })
    fake_nvml.reset()
    agent = Agent(fixture_config(state_dir=str(tmp_path)))
    try:
        run_every_collector_once(agent, at=sampled_at)
        agent.engine.evaluate(sampled_at)   # the rows show what GpuPcieStarvation judged
        page = render_status_page(agent)
        measured = latest_value(agent, bench.MEASURED_CAPACITY.name, gpu="0", direction="host_to_device")
        largest = max(item["bytes"] for item in report["results"])
        median = latest_value(agent, bench.BANDWIDTH.name, gpu="0", direction="host_to_device", memory="pinned",
                              placement="local", transfer_bytes=str(largest))
    finally:
        agent.stop()
        fake_nvml.reset()
    gpus = section_text(page, "gpus")
    assert f"of {human_rate(measured)} measured" in gpus.split("GPU 1")[0]
    assert "achievable" in gpus.split("GPU 1")[1]  # GPU 1 has no benchmark
    benchmark = section_text(page, "bench")
    assert "GPU 0" in benchmark and "(1.0 h ago)" in benchmark and f"copies of {human_bytes(largest)}" in benchmark
    assert human_rate(median) in benchmark
    assert f"{median / theoretical_capacity(4, 16) * 100:.0f} %" in benchmark
    assert "No benchmark yet" not in benchmark


def test_inference_servers_section_per_endpoint(tmp_path):
    """The fixture host scraping a stand-in vLLM once a second for a minute (each scrape adds what
    tests/fixtures/inference/vllm-v1-names.2.prom adds to .1: +9,100 generated and +25,000 prompt
    tokens, +5 preemptions, 55 GB loaded and 2 GB stored) and a port nothing listens on."""
    fake_nvml.reset()
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    with AdvancingInferenceServer() as server:
        agent = Agent(fixture_config(state_dir=str(tmp_path), **{"inference.endpoints": [server.url(), dead]}))
        try:
            run_every_collector_once(agent, at=NOW - 60)
            [scrapes] = [item for item in agent.sampler.scheduled if item.collector.name == "inference"]
            for seconds_ago in range(59, -1, -1):
                agent.sampler.run_collector(scrapes, at=NOW - seconds_ago)
            page = render_status_page(agent)
            latency = {(name, p): latest_value(agent, f"hybridmon_inference_{name}_percentile_seconds", percentile=p)
                       for name in ("time_to_first_token", "inter_token_latency") for p in ("p50", "p95")}
        finally:
            agent.stop()
            fake_nvml.reset()
    section = re.search(r'<section id="inference">(.*?)</section>', page, re.S).group(1)
    cards = {text.split("Last scrape")[0]: text for text in
             (PageStructure(card).text for card in re.findall(r'<div class="card ">(.*?)</div>', section))}
    assert set(cards) == {server.url(), dead}
    served = cards[server.url()]
    assert re.match(r"Last scrapeok in \d+ ms", served[len(server.url()):])
    assert "vLLM · meta-llama/Meta-Llama-3-8B-Instruct" in served
    assert "Tokens/s9,100 generated · 25,000 prompt" in served
    assert "Requests14 running · 6 waiting" in served and "KV cache used87 %" in served
    for name, label in (("time_to_first_token", "Time to first token"), ("inter_token_latency", "Inter-token latency")):
        p50, p95 = (latency[(name, p)] * 1000 for p in ("p50", "p95"))
        assert f"{label}p50 {p50:.0f} ms · p95 {p95:.0f} ms" in served
    assert "Preemptions5.0/s" in served and f"KV offloadloads {human_rate(55e9)} · stores {human_rate(2e9)}" in served
    assert re.fullmatch(rf"{re.escape(dead)}Last scrapefailed in \d+ ms: refused the connection: nothing "
                        r"listens there \(refused\)", cards[dead])
    assert re.search(r'<td class="flag">failed in \d+ ms: refused', page)


def test_no_inference_server_says_where_to_name_one(fixture_agent):
    section = section_text(render_status_page(fixture_agent), "inference")
    assert "No inference server scraped" in section and "[inference] endpoints" in section


@pytest.fixture(scope="module")
def swap_thrash_agent(scenarios, tmp_path_factory):
    """Incident 3 replayed with the detectors on: critical, warning and info findings firing."""
    overrides = {"history_seconds": history_seconds_for(SCENARIOS["swap_thrash"]),
                 "state_dir": str(tmp_path_factory.mktemp("state"))}
    agent = Agent(load_config(environ={}, overrides=overrides), replay_from=scenarios.summary("swap_thrash").path)
    try:
        agent.replay(speed=0)
        yield agent
    finally:
        agent.stop()


def test_replayed_swap_thrash_page_reads_like_the_incident(swap_thrash_agent):
    agent = swap_thrash_agent
    reads, plotted = [], []
    original_series, original_bucketed = agent.history.series, agent.history.bucketed

    def recording_series(name, /, **kwargs):
        reads.append((name, kwargs.get("since")))
        return original_series(name, **kwargs)

    def recording_bucketed(name, /, start, end, buckets, **labels):
        plotted.append((name, start, end, buckets))
        return original_bucketed(name, start, end, buckets, **labels)

    agent.history.series, agent.history.bucketed = recording_series, recording_bucketed
    try:
        started = time.perf_counter()
        page = render_status_page(agent)
        seconds = time.perf_counter() - started
    finally:
        del agent.history.series, agent.history.bucketed
    print(f"status page render on the replayed swap_thrash history: {seconds * 1000:.1f} ms")
    last_sample = START_TIME + SCENARIOS["swap_thrash"].duration_seconds
    # Cheap: gauges come from the latest samples; only the last minute of three counters (and of
    # four per inference server) is read.
    assert len(reads) <= 3 + COUNTERS_READ and all(since is not None and since >= last_sample - 60 for _name, since in reads), reads
    # The plots read each metric once, over the last hour only, cut into at most 120 buckets.
    names = [name for name, *_ in plotted]
    assert len(names) == len(set(names)) <= PLOTTED_METRICS, plotted
    assert all(end == last_sample and end - start == SPAN_SECONDS and buckets <= 120
               for _name, start, end, buckets in plotted), plotted

    assert 'class="banner critical"' in page
    thrash = [s for s in agent.engine.firing() if s.finding.alertname == "HostSwapThrash" and s.finding.labels.get("pid")]
    assert thrash and thrash[0].finding.severity == "critical"
    critical = page[page.index("<h3>Critical"):page.index("<h3>Warning")]
    assert html.escape(thrash[0].finding.summary) in critical and "pid 4242 · process_name python3" in critical
    # Ages count from the replay's last sample, not from today's clock.
    firing_since = re.search(r"firing since (2025-11-24 \d\d:\d\d:\d\d UTC) \((\d+) min ago\)", critical)
    assert firing_since and 1 <= int(firing_since.group(2)) <= 10, critical

    processes = section_text(page, "processes")
    vllm = processes[processes.index("python3 · pid 4242"):processes.index("llama-server")]
    faults = float(re.search(r"Major faults([\d.]+)/s", vllm).group(1))
    assert 120 <= faults <= 180  # the scenario's ~150/s
    assert re.search(r"Swapped out(1\.\d|2\.0) GiB", vllm)  # 0 -> 2 GiB over 420 s
    psi_some = float(re.search(r"PSI memory some([\d.]+) %", section_text(page, "host")).group(1))
    assert 25 <= psi_some <= 35  # the scenario's 30 %
    assert "replay" in section_text(page, "agent")


class HostileDetector(DetectorBase):
    name = "hostile"
    alertnames = ("HostSwapThrash",)

    def evaluate(self, _history, _now):
        return [Finding(alertname="HostSwapThrash", severity="critical",
                        labels={"process_name": "<script>alert(1)</script>", "pid": '1" onmouseover="x'},
                        value=1.0, threshold=0.5, summary="swap <b>thrash</b> & <img src=x onerror=alert(2)>",
                        description="</details><script>alert(3)</script>")]


# A server started with secrets on its command line, as issue 11 found them shown.
SECRETS = ("s3cret", "hf_abc", "user:pass", "pw-after-p", "key-after-k", "pass-value", "pwd-value")
SECRET_ARGUMENTS = ("vllm", "serve", "org/served-model", "--api-key", "s3cret", "HF_TOKEN=hf_abc",
                    "--download-dir", "https://user:pass@mirror.example/models", "-p", "pw-after-p",
                    "-k", "key-after-k", "--pass", "pass-value", "--pwd=pwd-value", "--port", "8000")


def agent_with_a_secret_holding_server(tmp_path, **overrides) -> Agent:
    """The fixture host plus pid 7777: a copy of 5151 whose command line holds SECRETS."""
    procfs = tmp_path / "proc"
    shutil.copytree(FIXTURE_HOST / "proc", procfs, symlinks=True)
    shutil.copytree(procfs / "5151", procfs / "7777")
    (procfs / "7777" / "cmdline").write_text("\0".join(SECRET_ARGUMENTS) + "\0")
    fake_nvml.reset()
    agent = Agent(fixture_config(**{"paths.procfs": str(procfs), "state_dir": str(tmp_path / "state"),
                                    **overrides}))
    run_every_collector_once(agent, at=NOW)
    return agent


@pytest.mark.parametrize("export_cmdline", [False, True])
def test_no_secret_of_a_command_line_reaches_metrics_or_the_page(tmp_path, export_cmdline):
    agent = agent_with_a_secret_holding_server(tmp_path, **{"process.export_cmdline": export_cmdline})
    try:
        client = TestClient(create_app(agent))
        metrics, page = client.get("/metrics").text, client.get("/").text
    finally:
        agent.stop()
        fake_nvml.reset()
    for secret in SECRETS:
        assert secret not in metrics and secret not in page, secret
    info = [line for line in metrics.splitlines() if line.startswith('hybridmon_process_info{') and 'pid="7777"' in line]
    assert info == ['hybridmon_process_info{executable="vllm",model="org/served-model",pid="7777",'
                    'process_name="llama-server",root_pid="7777",server="vllm",watch_reason="config"} 1.0']
    processes = section_text(page, "processes")
    assert "llama-server · pid 7777" in processes and "vllm · org/served-model · runs vllm" in processes
    shown = "--api-key <redacted> HF_TOKEN=<redacted>"
    assert (shown in metrics, shown in processes, "--port 8000" in processes) == (export_cmdline,) * 3
    assert ("hybridmon_process_cmdline_info{" in metrics) is export_cmdline


def test_hostile_names_and_command_lines_are_shown_as_text_not_markup(fixture_agent):
    hostile_name = "<script>alert(4)</script>"
    hostile_cmdline = '"><img src=x onerror=alert(5)> --x=\'<iframe>\''
    samples = Samples()
    hostile_executable = "<b>exe</b>"
    samples.add(process.INFO, 1.0, "666", hostile_name, hostile_executable, "vllm", "<i>m</i>", "gpu", "666")
    samples.add(process.CMDLINE_INFO, 1.0, "666", hostile_name, hostile_cmdline)
    samples.add(process.RESIDENT, 2**30, "666", hostile_name)
    fixture_agent.history.commit("process", NOW + 1, samples)
    hostile_endpoint = 'http://127.0.0.1:1/metrics?"><script>alert(7)</script>'
    hostile_model = "<img src=x onerror=alert(8)>"
    hostile_reason = "<iframe src=javascript:alert(9)>"
    server = Samples()
    server.add(SCRAPE_SUCCESS, 0.0, hostile_endpoint)
    server.add(SCRAPE_ERROR, 1.0, hostile_endpoint, hostile_reason)
    server.add(BY_FIELD["requests_running"], 3.0, "<b>vllm</b>", hostile_endpoint, hostile_model, "")
    fixture_agent.history.commit("inference", NOW + 1, server)
    fixture_agent.engine = Engine([HostileDetector()], fixture_agent.history)
    fixture_agent.engine.evaluate(NOW + 1)
    fixture_agent.runbook_base_url = 'http://host/"><script>alert(6)</script>'

    page = render_status_page(fixture_agent)
    parsed = PageStructure(page)
    tags = {tag for tag, _attrs in parsed.tags}
    assert not tags & {"script", "img", "iframe", "b"}, tags
    assert not [name for _tag, attrs in parsed.tags for name in attrs if name.startswith("on")]
    assert "i" not in tags
    for shown in (hostile_name, hostile_cmdline, f"vllm · <i>m</i> · runs {hostile_executable}", "swap <b>thrash</b> & <img src=x onerror=alert(2)>",
                  "</details><script>alert(3)</script>", '1" onmouseover="x', hostile_endpoint,
                  f"<b>vllm</b> · {hostile_model}", f"failed: see the agent log ({hostile_reason})"):
        assert shown in parsed.text, shown
    assert 'http://host/"><script>alert(6)</script>/HostSwapThrash' in parsed.links()


def test_status_page_renders_in_headless_chromium_at_phone_width(scenarios, tmp_path):
    """The real agent replays incident 3 over HTTP; Chromium draws the page at phone width. The
    banner must be drawn in the critical colour and each firing severity's findings appear."""
    browser = chromium_binary()
    trace = scenarios.summary("swap_thrash")
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    daemon = start_daemon(["run", "--replay", str(trace.path), "--speed", "0", "--listen", f"127.0.0.1:{port}"],
                          {"HYBRIDMON_STATE_DIR": str(tmp_path / "state")})
    try:
        def replay_finished():  # every tick runs host_memory once; then the findings stand still
            runs = httpx.get(url + "healthz", timeout=2).json()["collectors"]["host_memory"]["runs"]
            return runs == trace.ticks

        wait_for(replay_finished, 20, "the replay of swap_thrash to finish")
        findings = httpx.get(url + "api/v1/findings", timeout=2).json()["findings"]
        critical = [f for f in findings if f["severity"] == "critical" and f["state"] == "firing"][0]
        screenshot = tmp_path / "phone.png"
        chromium(browser, tmp_path / "profile", url, f"--screenshot={screenshot}")
        dom = chromium(browser, tmp_path / "profile", url, "--dump-dom").stdout
    finally:
        code, err = stop_daemon(daemon)
    assert code == 0 and "Traceback" not in err, err

    assert html.escape(critical["summary"], quote=False) in dom
    assert f'href="http://127.0.0.1:{port}/runbooks/HostSwapThrash"' in dom
    with Image.open(screenshot) as image:
        assert image.size[0] == PHONE_WIDTH
        banner = (0, 0, PHONE_WIDTH, 40)
        assert count_colour(image, banner, SEVERITY_COLOURS["critical"]) > 0.5 * PHONE_WIDTH * 40
        below = (0, 60, PHONE_WIDTH, image.size[1])
        for severity in ("critical", "warning", "info"):  # each card's 6 px left border
            assert count_colour(image, below, SEVERITY_COLOURS[severity]) >= 6 * 40, severity


def test_a_recorded_trace_keeps_no_secret_of_a_command_line_and_replays_the_identity(tmp_path):
    """Traces are handed around (`run --replay` on a laptop): the recording redacts command lines."""
    procfs = tmp_path / "proc"
    shutil.copytree(FIXTURE_HOST / "proc", procfs, symlinks=True)
    shutil.copytree(procfs / "5151", procfs / "7777")
    (procfs / "7777" / "cmdline").write_text("\0".join(SECRET_ARGUMENTS) + "\0")
    fake_nvml.reset()
    trace_path = tmp_path / "incident.jsonl.gz"
    config = fixture_config(**{"paths.procfs": str(procfs), "state_dir": str(tmp_path / "state")})
    recorder = Agent(config, record_to=trace_path)
    run_every_collector_once(recorder, at=NOW)
    live_metrics = recorder.exposition.render().decode()
    recorder.stop()
    recorded = gzip.open(trace_path, "rt").read()
    assert "7777/cmdline" in recorded
    for secret in SECRETS:
        assert secret not in recorded, secret
    replaying = Agent(config, replay_from=trace_path)
    try:
        replaying.replay(speed=0)
        replayed_metrics = replaying.exposition.render().decode()
    finally:
        replaying.stop()
        fake_nvml.reset()
    identity = [line for line in live_metrics.splitlines()
                if line.startswith("hybridmon_process_info{") and 'pid="7777"' in line]
    assert identity and identity[0] in replayed_metrics.splitlines()


# --- never "healthy" before looking (issue 14, item 9) ------------------------------------------

def test_first_evaluation_before_the_host_collectors_report_says_warming_up_not_healthy(tmp_path):
    """The agent evaluates right after the first commit (the GPU collector's), before the host
    settings are read: the fixture host's static risks (swappiness 60, THP always) are there but
    unseen. Before issue 14 the page was green ("no findings firing") and the API's findings empty
    with nothing saying the detectors had not looked."""
    fake_nvml.reset()
    agent = Agent(fixture_config(state_dir=str(tmp_path / "state")))
    try:
        (gpu_collector,) = [item for item in agent.sampler.scheduled if item.collector.name == "gpu"]
        agent.sampler.run_collector(gpu_collector, at=NOW)
        agent.engine.evaluate(NOW)
        assert [s for s in agent.engine.states() if s.state == "firing"] == []  # nothing seen yet
        client = TestClient(create_app(agent))
        page = client.get("/").text
        assert 'class="banner ok"' not in page and "no findings firing" not in page
        assert 'class="banner warming"' in page and "warming up (" in PageStructure(page).text
        body = client.get("/api/v1/findings").json()
        firing = client.get("/api/v1/findings", params={"state": "firing"}).json()
        assert firing["findings"] == [] and firing["status"] == "warming_up"
        assert body["status"] == "warming_up"
        host_config = [w for w in body["warming_up"] if w["detector"] == "host_config"]
        assert host_config and "host_memory" in host_config[0]["waiting_for"]

        # Every collector reports, the next evaluation sees the risks; detectors that compare
        # windows still lack history, so the API keeps naming them.
        run_every_collector_once(agent, at=NOW + 15)
        agent.engine.evaluate(NOW + 15)
        body = client.get("/api/v1/findings").json()
        assert "HostSwappinessHigh" in {f["alertname"] for f in body["findings"]}
        assert all(w["waiting_for"] == [] and w["seconds_left"] > 0 for w in body["warming_up"])
        assert "host_config" not in {w["detector"] for w in body["warming_up"]}

        # Once the span covers the longest min_history_seconds, every detector has judged.
        longest = max(getattr(d, "min_history_seconds", 0.0) for d in agent.engine.detectors)
        run_every_collector_once(agent, at=NOW + longest)
        agent.engine.evaluate(NOW + longest)
        body = client.get("/api/v1/findings").json()
        assert body["status"] == "judged" and body["warming_up"] == []
        assert "warming up" not in client.get("/").text
    finally:
        agent.stop()
        fake_nvml.reset()


# --- the last hour as plots, and what a browser showed wrong (issue 16) ----------------------------

def hour_of_history(agent: Agent, start: float, seconds: int = 3600) -> None:
    """Every collector's latest samples committed again once a second for `seconds`: an hour at the
    agent's default 1 s interval (the values stand still; what the page costs is the points read)."""
    latest = agent.history.latest()
    for tick in range(1, seconds + 1):
        for collector, (_at, samples) in latest.items():
            agent.history.commit(collector, start + tick, samples)


def test_a_full_hour_at_one_second_renders_cheaply(fixture_agent):
    """2 GPUs, the fixture host's watched processes, an hour of 1 s samples: the plots read each
    metric once, in buckets, so the page stays well under a second (a 2-core CI runner)."""
    hour_of_history(fixture_agent, NOW)
    took = []
    for _ in range(3):  # the first render, then two as the 30 s refresh finds them
        started = time.perf_counter()
        page = render_status_page(fixture_agent)
        took.append(time.perf_counter() - started)
    print(f"status page render with an hour of 1 s history (2 GPUs, {fixture_agent.history.series_count()} "
          f"series): first {took[0] * 1000:.0f} ms, best {min(took) * 1000:.0f} ms")
    assert max(took) < 1.0
    parsed = PageStructure(page)
    assert sum(1 for tag, _ in parsed.tags if tag == "svg") >= 2 * 2 + 2 + 3  # GPUs, processes, host
    assert "PCIe traffic, last hour" in parsed.text and "Swap traffic, last hour" in parsed.text


def test_plot_thresholds_are_the_loaded_thresholds_files(tmp_path):
    """The VRAM plot's dashed line is GpuMemoryHeadroomLow's used_share x total, from the thresholds
    file the agent loaded: a copy with 0.80 draws it at 80 %."""
    from hybridmon.agent.alerts.catalogue import DEFAULT_THRESHOLDS_FILE
    copy = tmp_path / "thresholds.toml"
    copy.write_text(DEFAULT_THRESHOLDS_FILE.read_text().replace("used_share = 0.95", "used_share = 0.80"))
    fake_nvml.reset()
    agent = Agent(fixture_config(state_dir=str(tmp_path / "state"), **{"detectors.thresholds_file": str(copy)}))
    try:
        run_every_collector_once(agent, at=NOW - 1)
        run_every_collector_once(agent, at=NOW)
        gpus = section_text(render_status_page(agent), "gpus")
        total = latest_value(agent, gpu.MEMORY_TOTAL.name, gpu="0")
    finally:
        agent.stop()
        fake_nvml.reset()
    assert f"alert at 80 %: {human_bytes(0.80 * total)}" in gpus and "alert at 95 %" not in gpus


def test_a_lost_gpu_is_named_by_what_it_reported_while_it_answered(fixture_agent):
    """GPU 1 falls off the bus: the gpu collector reports up 0 and no gpu_info for it any more
    (exporters/gpu.py). Before issue 16 its card read "unknown model, PCI address unknown"; it is
    named by the identity GpuLost judged it with (its figures), read from the last hour."""
    earlier = {s.label_values[:2]: s for s in fixture_agent.history.latest()["gpu"][1].find(gpu.GPU_INFO.name)}
    lost_key = next(key for key in earlier if key[0] == "1")
    _bus = earlier[lost_key].label_values[3]
    now = Samples()
    for sample in fixture_agent.history.latest()["gpu"][1]:
        if sample.label_values[:2] != lost_key:
            now.add(sample.spec, sample.value, *sample.label_values)
    now.add(gpu.GPU_UP, 0.0, *lost_key)
    fixture_agent.history.commit("gpu", NOW + 1, now)
    fixture_agent.engine.evaluate(NOW + 1)   # the page names it as GpuLost found it
    gpus = section_text(render_status_page(fixture_agent), "gpus")
    lost_card = gpus[gpus.index("GPU 1 ·"):]
    assert lost_card.startswith(f"GPU 1 · {earlier[lost_key].label_values[2]}"), lost_card[:200]
    assert f"{_bus} · {lost_key[1]}" in lost_card and "lost: no NVML call" in lost_card
    assert "unknown" not in lost_card


def test_the_agent_card_counts_collectors_with_nothing_to_read_apart(fixture_agent):
    """The fixture host has no benchmark and no inference server: two collectors read nothing.
    Before issue 16 the card said "9 running, none failing" beside them, and printed its `hybridmon bench` with backticks."""
    page = render_status_page(fixture_agent)
    health = section_text(page, "agent")
    count = len(fixture_agent.sampler.scheduled)
    empty = sorted(item.collector.name for item in fixture_agent.sampler.scheduled if item.state.no_data_reason)
    assert empty == ["bench", "inference"]  # no benchmark run; no server answers beside the processes
    assert f"{count - 2} of {count} reading · 2 with nothing to read on this host · none failing" in health
    assert "running, none failing" not in health
    assert "`" not in health and "run <code>hybridmon bench</code>" in page


def test_quoted_commands_become_code_but_a_command_line_keeps_its_backticks():
    from hybridmon.agent.status.template import key_values, paragraph
    assert paragraph("run `hybridmon bench` <now>") == '<p class="">run <code>hybridmon bench</code> &lt;now&gt;</p>'
    assert "<code>" not in key_values([("Command line", "sh -c `id`", False)])
    assert "`id`" in key_values([("Command line", "sh -c `id`", False)])


def test_sparkline_draws_lines_references_and_firing_spans_escaped():
    from hybridmon.agent.status.plots import Line, Reference, sparkline
    nan = float("nan")
    times = [0.0, 10.0, 20.0, 30.0, 40.0]
    svg = sparkline("<b>title</b>", 0.0, 40.0, [Line("<i>x</i>", times, [1.0, 2.0, nan, 3.0, 4.0])], str,
                    [Reference("alert at", 5.0, "threshold")], [(-100.0, 10.0), (30.0, 80.0), (50.0, 60.0)],
                    "SomeAlert")
    parsed = PageStructure(svg)
    tags = [tag for tag, _ in parsed.tags]
    assert "b" not in tags and "i" not in tags and "<b>title</b>" in parsed.text and "<i>x</i> 4.0" in parsed.text
    polylines = [attrs["points"] for tag, attrs in parsed.tags if tag == "polyline"]
    assert len(polylines) == 2  # the NaN splits the line: no segment drawn across the gap
    assert polylines[0].startswith("0.0,") and polylines[1].endswith(f"300.0,{60 - 4 / (5 * 1.08) * 58:.1f}")
    spans = [(float(attrs["x"]), float(attrs["width"])) for tag, attrs in parsed.tags if tag == "rect"]
    assert spans == [(0.0, 75.0), (225.0, 75.0)]  # clipped to the plot; the span after its end left out
    assert [attrs["class"] for tag, attrs in parsed.tags if tag == "line"] == ["threshold"]
    assert "SomeAlert fired" in parsed.text
    assert sparkline("empty", 0.0, 40.0, [Line("x", times, [nan] * 5)], str) == ""


def test_the_engine_keeps_an_hour_of_firing_intervals():
    from hybridmon.agent.detectors.engine import FIRING_LOG_SECONDS
    from hybridmon.agent.loop.history import History

    class Toggle(DetectorBase):
        name, alertnames = "toggle", ("Toggle",)
        on = True

        def evaluate(self, _history, _now):
            return [Finding(alertname="Toggle", severity="warning", labels={"gpu": "0"}, value=1.0,
                            threshold=0.5, summary="s", description="d")] if self.on else []

    detector = Toggle()
    engine = Engine([detector], History(60), correlate=None)
    engine.evaluate(100.0)
    detector.on = False
    engine.evaluate(200.0)
    detector.on = True
    engine.evaluate(300.0)
    intervals = [(i.alertname, i.labels, i.start, i.end) for i in engine.firing_intervals()]
    assert intervals == [("Toggle", {"gpu": "0"}, 100.0, 200.0), ("Toggle", {"gpu": "0"}, 300.0, None)]
    engine.evaluate(200.0 + FIRING_LOG_SECONDS + 1)  # the resolved span ended over an hour ago
    assert [(i.start, i.end) for i in engine.firing_intervals()] == [(300.0, None)]


def test_history_bucketed_gives_each_buckets_mean_and_last_point():
    """The plots' read (History.bucketed): gauges as bucket means, counters by their last points."""
    from hybridmon.agent.loop.history import History

    history = History(600)
    history.add_collector("process", 1.0)
    for second in range(0, 40):  # 0..39 s; the series is absent from 20 s to 29 s
        samples = Samples()
        if not 20 <= second < 30:
            samples.add(process.RESIDENT, float(second), "1", "p")
        history.commit("process", 1000.0 + second, samples)
    [series] = history.bucketed(process.RESIDENT.name, 1000.0, 1040.0, 4, pid="1")
    assert series.labels == {"pid": "1", "process_name": "p"}
    assert series.means[:2] == [4.5, 14.5] and series.means[2] != series.means[2] and series.means[3] == 34.5
    assert series.last_times[1] == 1019.0 and series.last_values[3] == 39.0
    assert history.bucketed(process.RESIDENT.name, 1000.0, 1040.0, 4, pid="2") == []


def test_a_gpu_behind_a_switch_names_the_uplink_it_shares_and_with_whom(scenarios, tmp_path):
    """pcie_uplink_starvation replayed with the detectors on (its offload over by the end): GPUs 2
    and 3 behind switch port 0000:e1:00.0 each say so, with the link, the other GPU and how full
    PcieUplinkStarvation judged it over the last minute; GPU 0, alone on its root port, says nothing
    of an uplink."""
    name = "pcie_uplink_starvation"
    overrides = {"history_seconds": history_seconds_for(SCENARIOS[name]), "state_dir": str(tmp_path / "state")}
    agent = Agent(load_config(environ={}, overrides=overrides), replay_from=scenarios.summary(name).path)
    try:
        agent.replay(speed=0)
        gpus = section_text(render_status_page(agent), "gpus")
    finally:
        agent.stop()
    cards = {index: gpus[gpus.index(f"GPU {index} · "):] for index in "023"}
    for index, other in (("2", "3"), ("3", "2")):
        row = re.search(r"Shared PCIe uplink(switch port [^;]*); (\d+) % full over the last minute "
                        r"\((GPU \d [\d.]+ %, GPU \d [\d.]+ %) of its traffic\)", cards[index])
        assert row, cards[index][:600]
        assert row.group(1) == f"switch port 0000:e1:00.0 (Gen4 x16), shared with GPU {other}"
        # the last minute: both GPUs back at 0.10 of their links each, 0.20 of a Gen4 x16 together
        assert 20 <= int(row.group(2)) <= 30, row.group(0)
    assert "Shared PCIe uplink" not in cards["0"][:cards["0"].index("GPU 2 · ")]


def test_the_trends_read_each_series_once_however_many_models_the_page_shows():
    """Issue 30: the page asked the trends once per model, and each ask scanned every series of the
    metric: quadratic in models (20,000 of them timed out at 60 s). Each metric's series are now
    walked once, to index them, whatever the number of asks."""
    from hybridmon.agent.loop.history import History
    from hybridmon.agent.status.trends import Trends, server_plots

    class Walked(list):
        walks = 0

        def __iter__(self):
            Walked.walks += 1
            return super().__iter__()

    history = History(3600)
    history.add_collector("inference", 5)
    now = 1_700_000_000.0
    models = [f"m{i}" for i in range(300)]
    for tick in range(3):
        samples = Samples()
        for model in models:
            labels = ("vllm", "http://127.0.0.1:8000/metrics", model, "")
            samples.add(BY_FIELD["generated_tokens"], 100.0 * tick, *labels)
            samples.add(BY_FIELD["kv_cache_usage_ratio"], 0.5, *labels)
        history.commit("inference", now - 10 + 5 * tick, samples)
    engine = Engine([], history)
    trends = Trends(history, engine, load_thresholds_for_page(), now)
    real = history.bucketed
    history.bucketed = lambda *args, **kwargs: Walked(real(*args, **kwargs))
    for model in models:
        server_plots(trends, ("vllm", "http://127.0.0.1:8000/metrics", model, ""))
    # one walk per metric to build its index (two metrics), none per model
    assert Walked.walks == 2
    assert len(trends.series(BY_FIELD["kv_cache_usage_ratio"], model="m7")) == 1


def load_thresholds_for_page():
    from hybridmon.agent.alerts.catalogue import load_thresholds
    return load_thresholds()


def test_the_tiered_kv_comparison_reads_h10s_table(scenarios, tmp_path):
    """kv_tier_h10 replayed (the seeds' experiment H10 as two vLLMs on one host): the last hour's
    comparison puts H10's three figures side by side, single-tier then tiered, and each server's
    card plots its latencies and the tiered one's offload traffic. The preempted share needs the
    collector to read vllm:request_success_total (branch kvread)."""
    from tests.support.scenarios.inference import ENDPOINT, MODEL
    from tests.support.scenarios.kv_tier_library import TIERED_ENDPOINT

    overrides = {"history_seconds": history_seconds_for(SCENARIOS["kv_tier_h10"]), "state_dir": str(tmp_path)}
    agent = Agent(load_config(environ={}, overrides=overrides), replay_from=scenarios.summary("kv_tier_h10").path)
    try:
        agent.replay(speed=0)
        page = render_status_page(agent)
    finally:
        agent.stop()
    section = re.search(r'<section id="inference">(.*?)</section>', page, re.S).group(1)
    comparison = re.search(r'<table class="grid-table">(.*?)</table>', section, re.S).group(1)
    rows = [[PageStructure(cell).text for cell in re.findall(r"<t[hd]>(.*?)</t[hd]>", row)]
            for row in re.findall(r"<tr>(.*?)</tr>", comparison)]
    header, *figures = rows
    assert header[1:] == ["127.0.0.1:18000", "127.0.0.1:18001"]
    table = {row[0]: row[1:] for row in figures}
    assert table["Server"] == ["vLLM · pid 4242", "vLLM"] and table["Model"] == [MODEL, MODEL]
    assert table["Requests preempted"] == ["17.5 %", "8.5 %"]
    assert table["Prefix hits, all tiers"] == ["0.5 %", "4.5 %"]
    assert table["Prefix hits on the GPU"] == ["0.5 %", "0.5 %"]
    assert table["Prefix hits from host memory"] == ["not published", "4.0 %"]
    assert table["Time to first token, mean"] == ["417 ms", "299 ms"]
    assert table["KV loads host → GPU"][0] == "not published" and table["Host KV tier size"][1] == human_bytes(500 * 16 * 131072)
    cards = {PageStructure(card).text.split("Last scrape")[0]: card
             for card in re.findall(r'<div class="card ">(.*?)</div>', section)}
    for endpoint in (ENDPOINT, TIERED_ENDPOINT):
        titles = re.findall(r"<figcaption>(.*?)</figcaption>", cards[endpoint])
        assert {"Time to first token, last hour", "Inter-token latency, last hour"} <= set(titles)
        assert ("KV offload traffic, last hour" in titles) == (endpoint == TIERED_ENDPOINT)
    assert "0.5 % on the GPU · 4.0 % from host memory · 4.5 % in all" in PageStructure(cards[TIERED_ENDPOINT]).text


def test_the_page_splits_prefix_hits_by_what_each_servers_hit_counter_holds():
    """The same counts as the dashboard's test of its tier panel (tests/integration/
    test_dashboards.py): an hour of 15,000 prompt tokens looked up, 1,500 hits and 450 host hits.
    vLLM's hits are its GPU's own, SGLang's hold every tier."""
    from hybridmon.agent.status.kv_tiers import tier_figures

    class HourOfCounts:  # the two Trends methods tier_figures reads, over fixed increases
        grown = {BY_FIELD["prefix_cache_queried_tokens"].name: 15_000.0,
                 BY_FIELD["prefix_cache_hit_tokens"].name: 1_500.0,
                 BY_FIELD["prefix_cache_host_hit_tokens"].name: 450.0}

        def increase(self, spec, **labels):
            return (self.grown[spec.name], 3600.0) if spec.name in self.grown else None

        def gauge(self, spec, **labels):  # SGLang HiCache's host tier: 300 of 1,000 tokens held
            held = {BY_FIELD["kv_offload_host_tier_used_tokens"].name: 300.0,
                    BY_FIELD["kv_offload_host_tier_tokens"].name: 1_000.0}
            return [math.nan, held[spec.name]] if spec.name in held and labels["server"] == "sglang" else None

    vllm = tier_figures(HourOfCounts(), ("vllm", "http://127.0.0.1:18000/metrics", "m", ""))
    sglang = tier_figures(HourOfCounts(), ("sglang", "http://127.0.0.1:30000/metrics", "m", ""))
    assert (vllm.device_hit_share, vllm.host_hit_share, vllm.hit_share) == pytest.approx((0.10, 0.03, 0.13))
    assert (sglang.device_hit_share, sglang.host_hit_share, sglang.hit_share) == pytest.approx((0.07, 0.03, 0.10))
    assert vllm.preempted_share is None and vllm.time_to_first_token_mean is None and vllm.loads_per_second is None
    assert sglang.host_tier_used_share == pytest.approx(0.3) and vllm.host_tier_used_share is None
