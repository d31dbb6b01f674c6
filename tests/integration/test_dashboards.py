"""The Grafana dashboards: generated JSON current, every panel with a unit and the $datasource
variable, every query valid PromQL (parsed by a real Prometheus, Debian's `prometheus` package, which
scripts/test installs) over metrics the agent exports or rules/ records, thresholds from the agent's
thresholds file, runbook links to runbooks that exist; and, evaluated by promtool over the fixture
host's /metrics with rules/ loaded, the joins compute what the panels say.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from hybridmon.agent.alerts.catalogue import load_thresholds
from hybridmon.dashboards import JSON_DIR, all_panel_queries, load_dashboards, panels
from hybridmon.dashboards import generate
from hybridmon.dashboards.common import DEFAULT_RUNBOOK_BASE_URL
from hybridmon.rules.promql import number
from tests.support.agent_helpers import free_port

REPO = Path(__file__).resolve().parents[2]
VARIABLES = {"datasource": "prometheus", "instance": "127.0.0.1:9400", "gpu": "0", "endpoint": ".*",
             "__rate_interval": "1m", "__interval": "15s", "__range": "1h"}
PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}


def dashboards() -> list[dict]:
    found = load_dashboards()
    assert {d["uid"] for d in found} == {"hybridmon-host", "hybridmon-gpu"}
    return found


def every_panel():
    return [(d["uid"], panel) for d in dashboards() for panel in panels(d)]


# --- generated and current ----------------------------------------------------------------------

def test_committed_json_is_what_the_generator_writes():
    assert generate.main(["--check"]) == 0


def test_check_fails_with_a_diff_when_the_json_was_edited(tmp_path, capsys):
    assert generate.main(["--output-dir", str(tmp_path)]) == 0
    edited = tmp_path / "hybridmon-host.json"
    edited.write_text(edited.read_text().replace('"refresh": "30s"', '"refresh": "5s"'))
    (tmp_path / "old.json").write_text("{}")
    assert generate.main(["--check", "--output-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert '-  "refresh": "5s"' in out and '+  "refresh": "30s"' in out
    assert "old.json: not generated any more" in out


def test_bad_thresholds_file_is_refused_with_its_name(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[pcie_starvation]\ntraffic_share_of_capacity = 'most'\n")
    assert generate.main(["--check", "--thresholds", str(bad)]) == 2
    assert str(bad) in capsys.readouterr().err


# --- units, datasource, variables ---------------------------------------------------------------

def test_every_panel_has_a_unit_and_the_datasource_variable():
    found = every_panel()
    assert len(found) > 30
    for uid, panel in found:
        where = f"{uid}: {panel['title']}"
        assert panel["fieldConfig"]["defaults"].get("unit"), where
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert panel["targets"], where
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], where
            assert target["expr"].strip(), where


def test_template_variables_datasource_instance_gpu_endpoint():
    for dashboard in dashboards():
        overview = dashboard["uid"] == "hybridmon-host"
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        assert list(variables) == ["datasource", "instance", "gpu", *(["endpoint"] if overview else [])]
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        for name in set(variables) - {"datasource"}:
            assert variables[name]["datasource"]["uid"] == "${datasource}"
        # the overview shows every GPU chosen, the drill-down exactly one
        assert variables["gpu"]["multi"] is overview
    # Every endpoint the agent scrapes, failing ones too (they have no server series); All is .*
    [host] = [d for d in dashboards() if d["uid"] == "hybridmon-host"]
    endpoint = next(v for v in host["templating"]["list"] if v["name"] == "endpoint")
    assert endpoint["query"] == 'label_values(hybridmon_inference_scrape_success{instance="$instance"}, endpoint)'
    assert endpoint["multi"] and endpoint["includeAll"] and endpoint["allValue"] == ".*"


def test_one_inference_row_per_endpoint_with_every_server_signal():
    """The overview repeats its inference-server row over $endpoint; every panel in it filters by
    the endpoint, and together they show what the issue asks: tokens/s, requests, TTFT and
    inter-token latency, KV cache, preemptions, prefix cache, KV offload beside PCIe host -> device
    traffic and the measured capacity."""
    [host] = [d for d in dashboards() if d["uid"] == "hybridmon-host"]
    [row] = [p for p in host["panels"] if p["type"] == "row" and p.get("repeat") == "endpoint"]
    assert row["title"] == "Inference server: $endpoint" and not row.get("collapsed")
    after = host["panels"][host["panels"].index(row) + 1:]
    inside = after[:next(i for i, p in enumerate(after) if p["type"] == "row")]
    exprs = {panel["title"]: [t["expr"] for t in panel["targets"]] for panel in inside}
    for title, queries in exprs.items():
        assert all('endpoint=~"$endpoint"' in q for q in queries if "hybridmon_inference_" in q), title
    every = "\n".join(q for queries in exprs.values() for q in queries)
    for metric in ("generated_tokens_total", "prompt_tokens_total", "requests_running", "requests_waiting",
                   "time_to_first_token_percentile_seconds", "inter_token_latency_percentile_seconds",
                   "time_to_first_token_observations_total", "inter_token_latency_seconds_total",
                   "kv_cache_usage_ratio", "preemptions_total", "prefix_cache_hit_tokens_total",
                   "prefix_cache_hit_ratio", "kv_offload_bytes_total"):
        assert f"hybridmon_inference_{metric}" in every, metric
    offload = " ".join(exprs["KV offload vs PCIe host → device"])
    assert 'hybridmon_gpu_pcie_throughput_bytes_per_second{instance="$instance", gpu=~"$gpu", ' \
           'direction="host_to_device"}' in offload
    assert "hybridmon_gpu_pcie_measured_capacity_bytes_per_second" in offload
    scrapes = [p for p in host["panels"] if p["title"] in ("Inference endpoints: last scrape", "Inference scrape errors")]
    assert len(scrapes) == 2 and all(p not in inside for p in scrapes)  # one table for every endpoint


def test_all_panel_queries_substitutes_every_variable_and_names_a_missing_one():
    queries = all_panel_queries(VARIABLES)
    assert len(queries) > 50
    for q in queries:
        assert "$" not in q.expr, q
    assert any('instance="127.0.0.1:9400", gpu=~"0"' in q.expr for q in queries)
    assert any("[1m]" in q.expr for q in queries) and any("[1h]" in q.expr for q in queries)
    with pytest.raises(ValueError, match=r"hybridmon-\w+ / .* __rate_interval"):
        all_panel_queries({k: v for k, v in VARIABLES.items() if k != "__rate_interval"})


# --- PromQL: parsed by Prometheus, over known metrics -------------------------------------------

@pytest.fixture(scope="module")
def prometheus_url(tmp_path_factory):
    """A real Prometheus with an empty TSDB on loopback: it parses every query it is sent."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is missing: install Debian's `prometheus` package (scripts/test does)"
    directory = tmp_path_factory.mktemp("prometheus")
    (directory / "prometheus.yml").write_text("global:\n  scrape_interval: 15s\n")
    port = free_port()
    process = subprocess.Popen(
        [binary, f"--config.file={directory / 'prometheus.yml'}", f"--storage.tsdb.path={directory / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=1):
                    break
            except OSError:
                assert process.poll() is None, "prometheus exited on start"
                assert time.monotonic() < deadline, "prometheus not ready in 20 s"
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)
        shutil.rmtree(directory, ignore_errors=True)


def promql_status(url: str, expr: str) -> tuple[int, str]:
    request = f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, ""
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()).get("error", "")


def test_every_query_parses_in_prometheus(prometheus_url):
    assert promql_status(prometheus_url, "sum by (gpu (hybridmon_gpu_up)")[0] == 400  # the check can fail
    variable_selectors = [re.fullmatch(r"label_values\((.*), \w+\)", v["query"]).group(1)
                          for d in dashboards() for v in d["templating"]["list"] if v["type"] == "query"]
    exprs = [q.expr for q in all_panel_queries(VARIABLES)]
    exprs += [expr.replace("$instance", VARIABLES["instance"]) for expr in variable_selectors]
    failures = [(expr, error) for expr in exprs
                for status, error in [promql_status(prometheus_url, expr)] if status != 200]
    assert not failures


def known_metrics() -> dict[str, tuple[str, ...] | None]:
    """Metric name -> its labels (None: not checked) from docs/metrics.md and the recording rules."""
    known: dict[str, tuple[str, ...] | None] = {}
    for name, labels in re.findall(r"^\| `(\w+)` \| \w+ \| ([^|]*) \|", (REPO / "docs/metrics.md").read_text(), re.M):
        known[name] = None if labels.strip() == "per alert" else tuple(filter(None, labels.replace(" ", "").split(",")))
    for record in re.findall(r"^\s+- record: (\S+)$", (REPO / "rules/hybridmon.rules.yml").read_text(), re.M):
        known[record] = None
    known["ALERTS"] = None
    return known


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords, label
    names in braces or grouping clauses, strings or durations."""
    expr = re.sub(r'"[^"]*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    return {name for name in re.findall(r"(?<![\w.:])[a-zA-Z_:][\w:]*(?![\w:])(?!\s*\()", expr)
            if name not in PROMQL_WORDS}


def test_metric_name_extraction():
    assert metric_names('max without (direction) (rate(a_total{x="y"}[5m]) * 60) / on (gpu) b:c:d '
                        'or label_replace(e, "f", "g", "h", "") > 1e-12') == {"a_total", "b:c:d", "e"}


def test_every_query_reads_metrics_and_labels_that_exist():
    known = known_metrics()
    selectors = 0
    for q in all_panel_queries(VARIABLES):
        for name in metric_names(q.expr):
            assert name in known, f"{q.dashboard_uid} / {q.panel_title}: unknown metric {name}"
        for name, matchers in re.findall(r"([a-zA-Z_:][\w:]*)\{([^}]*)\}", q.expr):
            selectors += 1
            labels = set(re.findall(r"(\w+)\s*[=!~]", matchers))
            if known[name] is not None:
                assert labels <= {"instance", "job", *known[name]}, f"{q.panel_title}: {name}{{{matchers}}}"
    assert selectors > 50


# --- thresholds from thresholds.toml ------------------------------------------------------------

def threshold_values(panel: dict) -> list[float]:
    steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
    return [step["value"] for step in steps if step["value"] is not None]


def expected_thresholds(t) -> dict[tuple[str, str], list[float]]:
    host, gpu = "hybridmon-host", "hybridmon-gpu"
    shared = {
        "PCIe traffic, share of capacity": [t.pcie_starvation.traffic_share_of_capacity],
        "GPU utilization": sorted([t.pcie_link_degraded.busy_utilization_at_least,
                                   t.pcie_starvation.gpu_utilization_at_most]),
        "PCIe AER errors per hour": [t.pcie_errors.aer_correctable_per_hour],
        "GPU memory used, share of total": [t.gpu_memory_headroom.used_share],
    }
    swap, pressure = t.swap_thrash, t.kv_offload_pressure
    return {
        **{(uid, title): v for title, v in shared.items() for uid in (host, gpu)},
        (host, "Swap in and out"): [swap.swap_in_bytes_per_second],
        (host, "Major page faults per second"): [swap.major_faults_per_second],
        (host, "Pressure stall (PSI)"): [swap.memory_pressure_some_ratio],
        (host, "Watched processes: memory in swap"): [swap.process_swap_bytes],
        (host, "Watched processes: major faults per second"): [swap.process_major_faults_per_second],
        (host, "Watched processes: share off their GPU's NUMA node"): [t.numa_misplacement.share_off_gpu_node],
        (host, "KV cache usage"): [pressure.kv_cache_usage_at_least],
        (host, "Preemptions per second"): [pressure.preemptions_per_second_above],
        (host, "KV offload loads, share of host → device capacity"): [pressure.offload_load_share_of_capacity],
    }


def check_thresholds(documents: list[dict], t) -> None:
    by_title = {(d["uid"], p["title"]): p for d in documents for p in panels(d)}
    for key, values in expected_thresholds(t).items():
        assert threshold_values(by_title[key]) == [float(v) for v in values], key
        assert by_title[key]["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] == "dashed", key
    swap = by_title[("hybridmon-host", "Swap in and out")]["fieldConfig"]["overrides"]
    assert [o["properties"][0]["value"]["steps"][1]["value"] for o in swap
            if o["matcher"] == {"id": "byFrameRefID", "options": "B"}] == [t.swap_thrash.swap_out_bytes_per_second]
    for uid in ("hybridmon-host", "hybridmon-gpu"):
        traffic = next(p for (u, title), p in by_title.items() if u == uid and title.startswith("PCIe traffic vs"))
        level = next(target["expr"] for target in traffic["targets"] if target["refId"] == "D")
        assert level.startswith(f"{number(t.pcie_starvation.traffic_share_of_capacity)} * "), level


def test_thresholds_in_the_json_are_those_of_thresholds_toml():
    check_thresholds(dashboards(), load_thresholds())


def test_other_thresholds_give_other_lines():
    t = load_thresholds()
    other = t.model_copy(update={
        "pcie_starvation": t.pcie_starvation.model_copy(update={"traffic_share_of_capacity": 0.7}),
        "swap_thrash": t.swap_thrash.model_copy(update={"swap_out_bytes_per_second": 2097152.0,
                                                        "major_faults_per_second": 20.0}),
        "numa_misplacement": t.numa_misplacement.model_copy(update={"share_off_gpu_node": 0.25}),
        "kv_offload_pressure": t.kv_offload_pressure.model_copy(update={
            "kv_cache_usage_at_least": 0.9, "preemptions_per_second_above": 0.5,
            "offload_load_share_of_capacity": 0.6}),
    })
    documents = [json.loads(text) for text in generate.render(other).values()]
    check_thresholds(documents, other)
    assert documents != [json.loads(text) for text in generate.render(t).values()]


# --- runbook links ------------------------------------------------------------------------------

def link_urls(node) -> list[str]:
    """Every link URL anywhere in a dashboard: dashboard links, panel links, data links."""
    if isinstance(node, dict):
        own = [node["url"]] if isinstance(node.get("url"), str) and "title" in node else []
        return own + [url for value in node.values() for url in link_urls(value)]
    if isinstance(node, list):
        return [url for value in node for url in link_urls(value)]
    return []


def test_runbook_links_point_at_existing_runbooks():
    runbooks = {path.stem for path in (REPO / "runbooks").glob("*.md")} - {"README"}
    alertnames = set(re.findall(r"^\s+- alert: (\w+)$", (REPO / "rules/hybridmon.rules.yml").read_text(), re.M))
    assert alertnames and alertnames <= runbooks  # what the findings tables link by alertname exists
    linked = set()
    for dashboard in dashboards():
        urls = [url for url in link_urls(dashboard) if "/runbooks" in url]
        assert urls
        for url in urls:
            assert url.startswith(DEFAULT_RUNBOOK_BASE_URL), url
            name = url[len(DEFAULT_RUNBOOK_BASE_URL):].lstrip("/")
            assert name in runbooks or name in ("", "${__value.raw}"), url
            linked.add(name)
        for table in (p for p in panels(dashboard)
                      if p["title"] in ("Active findings (agent)", "Alerts from Prometheus rules")):
            [override] = [o for o in table["fieldConfig"]["overrides"] if o["matcher"]["options"] == "alertname"]
            assert override["properties"][0]["value"][0]["url"] == f"{DEFAULT_RUNBOOK_BASE_URL}/${{__value.raw}}"
    assert {"GpuPcieStarvation", "GpuPcieLinkDegraded", "HostSwapThrash", "InferenceProcessNumaMisplaced",
            "GpuMemoryHeadroomLow", "PcieAerErrors", "GpuPcieReplayErrors", "GpuLost",
            "InferenceThroughputDecay", "InferenceKvOffloadPressure", "InferenceServerScrapeFailing"} <= linked


def test_runbook_base_url_is_an_option(tmp_path):
    assert generate.main(["--output-dir", str(tmp_path), "--runbook-base-url", "https://runbooks.example/hm/"]) == 0
    text = (tmp_path / "hybridmon-host.json").read_text()
    assert "https://runbooks.example/hm/GpuPcieStarvation" in text and "${instance}/runbooks" not in text
    assert json.loads(text)["uid"] == "hybridmon-host" and JSON_DIR.is_dir()


# --- what the joins compute: promtool evaluates panel queries over the fixture host's /metrics ----

GOLDEN_SAMPLE = re.compile(r"^(\w+)(?:\{(.*)\})? ([^<\s]\S*)$")  # not the <timing> placeholders
MEASURED_GPU0 = {"host_to_device": 25.0e9, "device_to_host": 24.0e9}
# each direction while both copied: low, as nvbandwidth issue #15 saw on some Gen4 hosts (11-16 GB/s)
MEASURED_BOTH_WAYS_GPU0 = {"host_to_device": 13.0e9, "device_to_host": 12.0e9}
UUID0 = "GPU-0a1b2c3d-0000-4000-8000-000000000000"


def fixture_host_scrapes(count: int) -> list[dict]:
    """tests/golden/fixture-host.prom (the agent's /metrics on the fixture host) scraped `count`
    times, 15 s apart, plus a benchmark measurement on GPU0 and a correctable AER error each scrape."""
    golden = {}
    for line in (REPO / "tests/golden/fixture-host.prom").read_text().splitlines():
        if match := GOLDEN_SAMPLE.match(line):
            name, labels, value = match.groups()
            golden[(name, tuple(sorted(re.findall(r'(\w+)="([^"]*)"', labels or ""))))] = float(value)
    for direction, value in MEASURED_GPU0.items():
        golden[("hybridmon_gpu_pcie_measured_capacity_bytes_per_second",
                (("direction", direction), ("gpu", "0"), ("uuid", UUID0)))] = value
    for direction, value in MEASURED_BOTH_WAYS_GPU0.items():
        golden[("hybridmon_gpu_pcie_measured_bidirectional_capacity_bytes_per_second",
                (("direction", direction), ("gpu", "0"), ("uuid", UUID0)))] = value
    aer = ("hybridmon_pcie_aer_errors_total", (("pci_bus_id", "0000:17:00.0"), ("severity", "correctable")))
    # The fixture has no task/ directories, so no CPU time off the GPU's node: the servers run as
    # CPU_CORES_ON_NODE says, counted from the first scrape, their CPU time with it.
    def cpu(n: int) -> dict:
        counters = {}
        for (pid, name), gpu_node in GPU_NODE_OF.items():
            cores = {node: c for (p, _, node), c in CPU_CORES_ON_NODE.items() if p == pid}
            counters[("hybridmon_process_cpu_seconds_total", (("pid", pid), ("process_name", name)))] = (
                sum(cores.values()) * 15 * n)
            counters[("hybridmon_process_cpu_seconds_off_gpu_node_total",
                      (("gpu_node", gpu_node), ("pid", pid), ("process_name", name)))] = (
                sum(c for node, c in cores.items() if node != gpu_node) * 15 * n)
        return counters
    return [{**golden, aer: golden[aer] + n, **cpu(n)} for n in range(count)]


# (pid, process_name, node) -> cores its threads run there
CPU_CORES_ON_NODE = {("4242", "python3", "0"): 1.2, ("4242", "python3", "1"): 0.3,
                     ("5151", "llama-server", "0"): 0.0, ("5151", "llama-server", "1"): 6.0}
# (pid, process_name) -> the NUMA node of its GPU (the sysfs numa_node of its PCI device)
GPU_NODE_OF = {("4242", "python3"): "0", ("5151", "llama-server"): "1"}


def evaluate(queries, scrapes: list[dict], directory: Path) -> list[list[tuple[dict, float]]]:
    """Each query's result at the last scrape, as promtool computes it with rules/ loaded."""
    from tests.support.promtool_replay import input_series, parse_samples, promtool

    end = f"{(len(scrapes) - 1) * 15}s"
    document = {"rule_files": [str(REPO / "rules/hybridmon.rules.yml")], "evaluation_interval": "15s",
                "tests": [{"interval": "15s", "input_series": input_series(scrapes, VARIABLES["instance"]),
                           "promql_expr_test": [{"expr": q.expr, "eval_time": end, "exp_samples": []}
                                                for q in queries]}]}
    path = directory / "panels.promtool.yml"
    path.write_text(json.dumps(document))
    result = subprocess.run([promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    got = re.findall(r"^\s*got: (.*)$", result.stdout + result.stderr, re.M)
    assert len(got) == len(queries), f"a query returned nothing:\n{result.stdout}{result.stderr}"
    return [parse_samples(line) for line in got]


def by(results: list[tuple[dict, float]], *labels: str) -> dict[tuple[str, ...], float]:
    return {tuple(sample.get(label, "") for label in labels): value for sample, value in results}


def sample(scrape: dict, name: str, **labels: str) -> float:
    """The one value of `name` in `scrape` whose labels include `labels`."""
    [value] = [v for (n, pairs), v in scrape.items() if n == name and labels.items() <= dict(pairs).items()]
    return value


def test_panel_joins_compute_what_they_say(tmp_path):
    from hybridmon.pcie_rates import achievable_capacity, bidirectional_capacity

    scrapes = fixture_host_scrapes(41)
    last = scrapes[-1]
    tables = {("hybridmon-gpu", "Watched processes on this GPU"),
              ("hybridmon-host", "Watched processes off their GPUs' NUMA nodes"),
              ("hybridmon-host", "Watched processes vs their GPUs' NUMA nodes"),
              ("hybridmon-host", "PCIe link now: generation and width vs maximum")}
    graphs = {("hybridmon-host", "PCIe traffic, share of capacity", "A"),
              ("hybridmon-host", "PCIe AER errors per hour", "A"),
              ("hybridmon-gpu", "PCIe traffic vs capacity", "D")}
    queries = [q for q in all_panel_queries({**VARIABLES, "gpu": "0|1"})
               if (q.dashboard_uid, q.panel_title) in tables or (q.dashboard_uid, q.panel_title, q.ref_id) in graphs]
    assert len(queries) == 13 + len(graphs)
    results = {(q.panel_title, q.ref_id): r for q, r in zip(queries, evaluate(queries, scrapes, tmp_path))}

    # Grafana's merge makes one row of the samples with equal labels: every query of a table must
    # give the same label sets, without the metric name.
    for _, title in tables:
        label_sets = {ref: sorted(str(sorted(labels.items())) for labels, _ in result)
                      for (t, ref), result in results.items() if t == title}
        assert len({str(sets) for sets in label_sets.values()}) == 1, (title, label_sets)
        assert "__name__" not in str(label_sets), title

    # The GPU's node is its PCI device's sysfs numa_node (NVML's NumaNodeId is GPU memory's own).
    for pid, bus in (("4242", "0000:17:00.0"), ("5151", "0000:ca:00.0")):
        node = str(int(sample(last, "hybridmon_pcie_device_numa_node", pci_bus_id=bus)))
        expected = {
            "A": sample(last, "hybridmon_gpu_process_memory_used_bytes", pid=pid),
            "B": sample(last, "hybridmon_process_resident_bytes", pid=pid),
            "C": sample(last, "hybridmon_process_swap_bytes", pid=pid),
            "D": 1 - sum(cores for (p, _, n), cores in CPU_CORES_ON_NODE.items() if p == pid and n == node)
                   / sum(cores for (p, _, _), cores in CPU_CORES_ON_NODE.items() if p == pid),
            "E": sample(last, "hybridmon_process_resident_off_gpu_node_bytes", pid=pid, gpu_node=node)
                 / sample(last, "hybridmon_process_resident_bytes", pid=pid),
        }
        for ref, value in expected.items():
            got = by(results[("Watched processes on this GPU", ref)], "pid")[(pid,)]
            assert got == pytest.approx(value), (pid, ref)

    traffic = {(gpu, d): sample(last, "hybridmon_gpu_pcie_throughput_bytes_per_second", gpu=gpu, direction=d)
               for gpu in "01" for d in MEASURED_GPU0}
    # GPU 1 has no benchmark: its capacity is what copies achieve on its link (constant here)
    capacity_gpu1 = achievable_capacity(sample(last, "hybridmon_gpu_pcie_link_generation", gpu="1"),
                                           sample(last, "hybridmon_gpu_pcie_link_width_lanes", gpu="1"))
    # What GpuPcieStarvation compares: the fuller of each direction over its capacity and both
    # together over the bidirectional capacity: GPU 0's measured sum (which here is the fuller), GPU
    # 1's from the bidirectional factor.
    both_ways = {"0": sum(MEASURED_BOTH_WAYS_GPU0.values()),
                 "1": bidirectional_capacity(sample(last, "hybridmon_gpu_pcie_link_generation", gpu="1"),
                                             sample(last, "hybridmon_gpu_pcie_link_width_lanes", gpu="1"))}
    assert sum(traffic[("0", d)] for d in MEASURED_GPU0) / both_ways["0"] > max(
        traffic[("0", d)] / MEASURED_GPU0[d] for d in MEASURED_GPU0)
    assert by(results[("PCIe traffic, share of capacity", "A")], "gpu") == pytest.approx({
        ("0",): max(*(traffic[("0", d)] / MEASURED_GPU0[d] for d in MEASURED_GPU0),
                    sum(traffic[("0", d)] for d in MEASURED_GPU0) / both_ways["0"]),
        ("1",): max(*(traffic[("1", d)] / capacity_gpu1 for d in MEASURED_GPU0),
                    sum(traffic[("1", d)] for d in MEASURED_GPU0) / both_ways["1"])})
    share = load_thresholds().pcie_starvation.traffic_share_of_capacity
    assert by(results[("PCIe traffic vs capacity", "D")], "gpu", "direction") == pytest.approx({
        **{("0", d): share * v for d, v in MEASURED_GPU0.items()},
        **{("1", d): share * capacity_gpu1 for d in MEASURED_GPU0}})
    # one correctable error per 15 s scrape, on GPU0's PCI function only
    assert by(results[("PCIe AER errors per hour", "A")], "gpu", "pci_bus_id", "severity") == pytest.approx({
        ("0", "0000:17:00.0", "correctable"): 240.0, ("0", "0000:17:00.0", "nonfatal"): 0.0,
        ("0", "0000:17:00.0", "fatal"): 0.0})


def test_the_shared_uplink_panel_sums_the_traffic_of_the_gpus_behind_it(tmp_path):
    """The fixture host's two GPUs placed behind one switch port (its topology series added, as
    exporters/pcie_topology.py exports them for tests/fixtures/host-switch): the panel's traffic is
    their sum per direction, against what a Gen4 x16 uplink carries. Chosen GPU 1 alone, the
    uplink it shares is still shown; the other way round too."""
    from hybridmon.pcie_rates import achievable_capacity

    uplink, root_port = "0000:e1:00.0", "0000:e0:01.0"
    topology = {("hybridmon_pcie_uplink_generation", (("uplink", uplink),)): 4.0,
                ("hybridmon_pcie_uplink_width_lanes", (("uplink", uplink),)): 16.0,
                **{("hybridmon_pcie_uplink_info", (("pci_bus_id", bus), ("root_port", root_port), ("uplink", uplink))): 1.0
                   for bus in ("0000:17:00.0", "0000:ca:00.0")}}
    scrapes = [{**scrape, **topology} for scrape in fixture_host_scrapes(9)]
    last = scrapes[-1]
    for chosen in ("1", "0|1"):
        queries = [q for q in all_panel_queries({**VARIABLES, "gpu": chosen})
                   if q.panel_title == "Shared PCIe uplink: traffic of the GPUs behind it vs capacity"]
        assert [q.ref_id for q in queries] == ["A", "B", "C"]
        results = {q.ref_id: r for q, r in zip(queries, evaluate(queries, scrapes, tmp_path))}
        assert by(results["A"], "uplink", "direction") == pytest.approx({
            (uplink, d): sum(sample(last, "hybridmon_gpu_pcie_throughput_bytes_per_second", gpu=gpu, direction=d)
                             for gpu in "01") for d in MEASURED_GPU0})
        carries = achievable_capacity(4, 16)
        assert by(results["B"], "uplink") == pytest.approx({(uplink,): carries})
        share = load_thresholds().pcie_uplink_starvation.traffic_share_of_capacity
        assert by(results["C"], "uplink") == pytest.approx({(uplink,): share * carries})


SERVER_LABELS = {"server": "vllm", "model": "m"}
SERVED_BY_4242, NO_PID = "http://127.0.0.1:18000/metrics", "http://127.0.0.1:8001/metrics"
OFF_GPU = "http://127.0.0.1:8002/metrics"  # pid 7777 holds no GPU memory


def with_inference_servers(scrapes: list[dict]) -> list[dict]:
    """Three vLLM endpoints added to the fixture host's scrapes: one served by pid 4242 (on GPU0,
    whose link was measured), one whose pid the agent does not know (label absent, as Prometheus
    stores an empty label), one served by a pid on no GPU. Per 15 s scrape: 30 GB loaded and 1.5 GB stored, 15,000 tokens
    generated with 10 requests running, 60 first tokens in 12 s of waiting."""
    served = []
    for n, scrape in enumerate(scrapes):
        added = dict(scrape)
        for endpoint, pid in ((SERVED_BY_4242, {"pid": "4242"}), (NO_PID, {}), (OFF_GPU, {"pid": "7777"})):
            labels = {**SERVER_LABELS, "endpoint": endpoint, **pid}
            key = lambda **extra: tuple(sorted({**labels, **extra}.items()))  # noqa: E731
            added[("hybridmon_inference_kv_offload_bytes_total", key(direction="load"))] = 30e9 * n
            added[("hybridmon_inference_kv_offload_bytes_total", key(direction="store"))] = 1.5e9 * n
            added[("hybridmon_inference_generated_tokens_total", key())] = 15_000.0 * n
            added[("hybridmon_inference_requests_running", key())] = 10.0
            added[("hybridmon_inference_time_to_first_token_seconds_total", key())] = 12.0 * n
            added[("hybridmon_inference_time_to_first_token_observations_total", key())] = 60.0 * n
        served.append(added)
    return served


def test_inference_panels_compute_what_they_say(tmp_path):
    from hybridmon.pcie_rates import achievable_capacity

    scrapes = with_inference_servers(fixture_host_scrapes(9))
    last = scrapes[-1]
    wanted = {("KV offload loads, share of host → device capacity", "A"), ("KV offload vs PCIe host → device", "A"),
              ("Generated tokens/s per running request", "A"), ("Time to first token", "B")}
    queries = [q for q in all_panel_queries({**VARIABLES, "gpu": "0|1", "__rate_interval": "2m"})
               if (q.panel_title, q.ref_id) in wanted]
    assert len(queries) == len(wanted)
    results = {(q.panel_title, q.ref_id): r for q, r in zip(queries, evaluate(queries, scrapes, tmp_path))}

    loads = 30e9 / 15
    # GPU 1 has no benchmark: its capacity is what copies achieve on its link (constant here)
    capacity_gpu1 = achievable_capacity(sample(last, "hybridmon_gpu_pcie_link_generation", gpu="1"),
                                           sample(last, "hybridmon_gpu_pcie_link_width_lanes", gpu="1"))
    # pid 4242 holds memory on GPU0 only: its loads cross GPU0's link, at the rate measured there.
    # Without a pid, or with one on no GPU, the loads are set against every link of the host.
    every_link = MEASURED_GPU0["host_to_device"] + capacity_gpu1
    assert by(results[("KV offload loads, share of host → device capacity", "A")], "endpoint", "pid") == pytest.approx({
        (SERVED_BY_4242, "4242"): loads / MEASURED_GPU0["host_to_device"],
        (NO_PID, ""): loads / every_link, (OFF_GPU, "7777"): loads / every_link})
    endpoints = (SERVED_BY_4242, NO_PID, OFF_GPU)
    assert by(results[("KV offload vs PCIe host → device", "A")], "endpoint", "direction") == pytest.approx({
        (endpoint, direction): rate for endpoint in endpoints for direction, rate in (("load", loads), ("store", 1.5e9 / 15))})
    assert by(results[("Generated tokens/s per running request", "A")], "endpoint") == pytest.approx(
        {(endpoint,): 100.0 for endpoint in endpoints})
    assert by(results[("Time to first token", "B")], "endpoint") == pytest.approx({(endpoint,): 0.2 for endpoint in endpoints})


def test_the_tier_panels_read_h10s_figures_from_the_scenario(scenarios, tmp_path):
    """kv_tier_h10 (the seeds' experiment H10: a single-tier and a tiered vLLM on one host)
    replayed and scraped every 15 s as Prometheus would, the tiered-KV panels' queries evaluated
    by promtool at the end of its hour: the comparison table over the hour and the per-endpoint
    graphs over 10 min give H10's table. The preempted share (ref A, and "Share of requests
    preempted") needs the collector to read vllm:request_success_total (branch kvread)."""
    from hybridmon.agent.config import load_config
    from hybridmon.agent.daemon import Agent
    from hybridmon.dashboards.inference import TIER_COMPARISON_TITLE
    from tests.support.promtool_replay import Scraper
    from tests.support.scenarios import SCENARIOS, START_TIME, history_seconds_for
    from tests.support.scenarios.inference import ENDPOINT
    from tests.support.scenarios.kv_tier_library import SINGLE_TIER, TIERED, TIERED_ENDPOINT

    scenario = SCENARIOS["kv_tier_h10"]
    agent = Agent(load_config(environ={}, overrides={"history_seconds": history_seconds_for(scenario)}),
                  replay_from=scenarios.summary("kv_tier_h10").path)
    scraper = Scraper(agent, START_TIME, 15.0)
    try:
        agent.replay(speed=0)
    finally:
        agent.stop()
    scraper.finish(START_TIME + scenario.duration_seconds)
    scrapes = [{key: value for key, value in scrape.items() if key[0].startswith("hybridmon_inference_")}
               for scrape in scraper.scrapes]
    graphs = {"Share of requests preempted", "Prefix cache hits by tier", "Time to first token"}
    # the table's "Host KV tier used" (I) needs tokens held, which vLLM does not publish
    queries = [q for q in all_panel_queries({**VARIABLES, "__rate_interval": "10m"})
               if (q.panel_title == TIER_COMPARISON_TITLE and q.ref_id != "I") or q.panel_title in graphs]
    results = {(q.panel_title, q.ref_id): by(r, "endpoint")
               for q, r in zip(queries, evaluate(queries, scrapes, tmp_path))}

    def h10(figure: str) -> dict[tuple[str], float]:
        return {(ENDPOINT,): SINGLE_TIER[figure], (TIERED_ENDPOINT,): TIERED[figure]}

    for title, refs in ((TIER_COMPARISON_TITLE, {"preempted": "A", "all": "D", "ttft": "E"}),
                        ("Share of requests preempted", {"preempted": "A"}),
                        ("Prefix cache hits by tier", {"all": "C"}), ("Time to first token", {"ttft": "B"})):
        for figure, ref in refs.items():
            expected = h10({"preempted": "preempted_share", "all": "prefix_hit_share",
                            "ttft": "time_to_first_token_mean_seconds"}[figure])
            assert results[(title, ref)] == pytest.approx(expected, rel=0.01), (title, ref)
    # GPU hits equal on both (H10's 0.51 %); the tiered server's gain came from host memory, and
    # the single-tier server publishes no host hits: its row is absent, not 0.
    assert results[(TIER_COMPARISON_TITLE, "B")] == pytest.approx(
        {key: SINGLE_TIER["prefix_hit_share"] for key in h10("prefix_hit_share")}, rel=0.01)
    assert results[(TIER_COMPARISON_TITLE, "C")] == pytest.approx(
        {(TIERED_ENDPOINT,): TIERED["prefix_hit_share"] - SINGLE_TIER["prefix_hit_share"]}, rel=0.01)
    assert set(results[(TIER_COMPARISON_TITLE, "G")]) == {(TIERED_ENDPOINT,)}


def test_prefix_hits_by_tier_follow_what_each_servers_hit_counter_holds(tmp_path):
    """Per 15 s scrape, each endpoint looks up 15,000 prompt tokens, its hit counter grows by 1,500
    and its host hits by 450. vLLM's hits are its GPU's own (0.33: prompt_tokens_cached_by_source
    sums to prefix_cache_hits + external hits): GPU 10 %, host 3 %, all 13 %. SGLang's
    cached_tokens_total holds every tier: GPU 7 %, host 3 %, all 10 %. A vLLM without host hits:
    GPU 10 %, all 10 %, no host series (absent, not 0). SGLang's HiCache host tier holds 300 of its
    1,000 tokens: the comparison table reads it 30 % used, and nothing for the vLLMs."""
    from hybridmon.dashboards.inference import TIER_COMPARISON_TITLE

    vllm, sglang, single = ("http://127.0.0.1:18000/metrics", "http://127.0.0.1:30000/metrics",
                            "http://127.0.0.1:8001/metrics")
    scrapes = []
    for n, scrape in enumerate(fixture_host_scrapes(9)):
        added = dict(scrape)
        for endpoint, server, host_hits in ((vllm, "vllm", True), (sglang, "sglang", True), (single, "vllm", False)):
            key = tuple(sorted({"server": server, "model": "m", "endpoint": endpoint}.items()))
            added[("hybridmon_inference_prefix_cache_queried_tokens_total", key)] = 15_000.0 * n
            added[("hybridmon_inference_prefix_cache_hit_tokens_total", key)] = 1_500.0 * n
            if host_hits:
                added[("hybridmon_inference_prefix_cache_host_hit_tokens_total", key)] = 450.0 * n
        key = tuple(sorted({"server": "sglang", "model": "m", "endpoint": sglang}.items()))
        added[("hybridmon_inference_kv_offload_host_tier_used_tokens", key)] = 300.0
        added[("hybridmon_inference_kv_offload_host_tier_tokens", key)] = 1_000.0
        scrapes.append(added)
    queries = [q for q in all_panel_queries({**VARIABLES, "__rate_interval": "2m"})
               if q.panel_title == "Prefix cache hits by tier" or (q.panel_title, q.ref_id) == (TIER_COMPARISON_TITLE, "I")]
    results = {q.ref_id: by(r, "endpoint") for q, r in zip(queries, evaluate(queries, scrapes, tmp_path))}
    assert results["I"] == pytest.approx({(sglang,): 0.3})
    assert results["A"] == pytest.approx({(vllm,): 0.10, (sglang,): 0.07, (single,): 0.10})
    assert results["B"] == pytest.approx({(vllm,): 0.03, (sglang,): 0.03})
    assert results["C"] == pytest.approx({(vllm,): 0.13, (sglang,): 0.10, (single,): 0.10})
