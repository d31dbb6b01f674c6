"""The scenario generator: every scenario's trace is valid, replays without its synthetic host and
without a collector failure, and shows its signal at its stated time (docs/scenarios.md).

Each trace is generated once per test session and replayed once (the `scenarios` fixture), so the
whole file costs about the time it takes to generate and replay every scenario once.
"""
from __future__ import annotations

import gzip
import json
import math
import os
import subprocess

import jsonschema
import pytest

from hybridmon.agent.alerts.catalogue import all_alertnames
from tests.support.scenarios import SCENARIOS, START_TIME, write_trace
from tests.support.scenarios.host import GIB, MIB, SyntheticHost, link_capacity_bytes_per_second
from tests.support.scenarios.library import GPU0_ADDRESS, GPU1_ADDRESS, LLAMA, VLLM
from tests.support.agent_helpers import HYBRIDMON, REPO, subprocess_environment
from hybridmon.exporters.pcie import PcieCollector
from tests.support.scenario_traces import between, latest_at, one, rate, value_at, replay

SCHEMA = json.loads((REPO / "docs" / "trace-format.schema.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
GEN4_X16 = link_capacity_bytes_per_second(4, 16)
ALERTNAMES = set(all_alertnames())  # what a scenario may promise: any alert of the catalogue
HEALTHY = [name for name, scenario in SCENARIOS.items() if scenario.healthy]


# --- the catalogue ---------------------------------------------------------------------------------

def test_every_scenario_is_described_and_timed_consistently():
    assert len(SCENARIOS) >= 20
    for name, scenario in SCENARIOS.items():
        assert scenario.name == name and scenario.description, name
        assert scenario.tick_seconds in (1, 5, 10), name  # 5 s: minutes-long ramps, cheaper than 1 s
        assert scenario.duration_seconds % scenario.tick_seconds == 0, name
        if scenario.healthy:
            assert scenario.onset_seconds is None and scenario.expected == [], name
        else:
            assert 0 <= scenario.onset_seconds < scenario.duration_seconds, name
        for alertname, labels in scenario.expected + scenario.allowed:
            assert alertname in ALERTNAMES, (name, alertname)
            assert all(isinstance(v, str) for v in labels.values()), (name, labels)
    assert {"healthy_idle_downshifted", "healthy_busy_offload", "healthy_swap_unused",
            "healthy_growth_with_load", "healthy_inference_busy"} <= set(HEALTHY)
    # Long scenarios (the memory-growth window is >= 30 min, the throughput decay's 2 h) tick every
    # 10 s; short ones every 1 s.
    for name in ("memory_growth", "throughput_decay"):
        assert SCENARIOS[name].tick_seconds == 10
        assert SCENARIOS[name].duration_seconds - SCENARIOS[name].onset_seconds >= 7200


def test_the_docs_describe_every_scenario():
    text = (REPO / "docs" / "scenarios.md").read_text()
    for name in SCENARIOS:
        assert f"`{name}`" in text, name


# --- every trace -----------------------------------------------------------------------------------

def shape(value):
    """A JSON value's structure and types, without its strings' and numbers' contents."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float, str)):
        return type(value).__name__
    if isinstance(value, list):
        return [shape(item) for item in value]
    return {key: shape(item) for key, item in value.items()}


def signature(line: dict) -> str | None:
    """Reading lines with equal signatures differ only in the text of keys and payloads and in
    numbers, which the schema does not constrain (test_the_schema_constrains_only_structure), so
    one of them stands for all. Header and end lines have none: each is validated."""
    if line.get("kind") != "reading" or not isinstance(line.get("readings"), list):
        return None
    return json.dumps([line["collector"], shape(line["time"]), sorted(set(line) - {"collector", "time", "readings"}),
                       [[raw[0], shape(raw[1]), raw[2], shape(raw[3])] if isinstance(raw, list) and len(raw) == 4
                        else raw for raw in line["readings"]]])


def validate_lines(lines: list[dict], every_line: bool = False) -> int:
    """Validate each line against the schema; returns how many were validated one by one."""
    seen, validated = set(), 0
    for line in lines:
        key = None if every_line else signature(line)
        if key is None or key not in seen:
            VALIDATOR.validate(line)
            validated += 1
            if key is not None:
                seen.add(key)
    return validated


def test_the_schema_constrains_only_structure():
    """What makes validating one line per signature as good as validating every line."""
    value_keywords = {"pattern", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum",
                      "exclusiveMaximum", "multipleOf", "format", "const", "enum"}

    def constrained(node, path):
        if isinstance(node, dict):
            for key, child in node.items():
                if key in value_keywords:
                    yield path
                yield from constrained(child, path + (key,))
        elif isinstance(node, list):
            for index, child in enumerate(node):
                yield from constrained(child, path + (index,))

    places = set(constrained({k: SCHEMA["$defs"][k] for k in ("reading", "raw", "os_error", "call_error")}, ()))
    # Only the line's kind and collector, and each raw reading's kind and ok flag: all kept verbatim
    # in a signature.
    assert places == {
        ("reading", "properties", "kind"), ("reading", "properties", "collector"),
        *{("raw", "oneOf", branch, "prefixItems", position) for branch in range(5) for position in (0, 2)},
    }, places


def test_one_trace_validates_every_line_one_by_one(scenarios):
    with gzip.open(scenarios.summary("gpu_lost").path, "rt", encoding="utf-8") as handle:
        lines = [json.loads(line) for line in handle]
    assert validate_lines(lines, every_line=True) == len(lines)
    assert any(not raw[2] for line in lines[1:-1] for raw in line["readings"])  # failed calls: a lost GPU


@pytest.mark.parametrize("name", SCENARIOS)
def test_trace_validates_line_by_line_and_its_synthetic_host_is_gone(name, scenarios):
    summary = scenarios.summary(name)
    scenario = SCENARIOS[name]
    with gzip.open(summary.path, "rt", encoding="utf-8") as handle:
        lines = [json.loads(line) for line in handle]
    validate_lines(lines)
    header, readings, end = lines[0], lines[1:-1], lines[-1]
    assert header["kind"] == "header" and end == {"kind": "end", "time": end["time"], "records": summary.records}
    assert len(readings) == summary.records
    # The header names the synthetic host, which was removed once the trace was written.
    paths = header["config"]["paths"]
    assert "hybridmon-scenario-" + name in paths["procfs"]
    assert not os.path.exists(paths["procfs"]) and not os.path.exists(paths["sysfs"])
    assert header["config"]["interval_seconds"] == scenario.tick_seconds
    times = sorted({line["time"] - START_TIME for line in readings})
    assert times[0] == 0 and times[-1] == scenario.duration_seconds
    assert len(times) == scenario.ticks
    # Every collector runs on its own interval: the 1 s ones every tick, process_numa every 30 s.
    per_collector = {}
    for line in readings:
        per_collector[line["collector"]] = per_collector.get(line["collector"], 0) + 1
    assert per_collector["gpu"] == per_collector["host_memory"] == scenario.ticks
    assert per_collector["process_numa"] == math.floor(scenario.duration_seconds / max(30, scenario.tick_seconds)) + 1


@pytest.mark.parametrize("name", SCENARIOS)
def test_trace_replays_without_a_collector_failure(name, scenarios):
    replayed = scenarios.replayed(name)
    assert replayed.records == scenarios.summary(name).records
    assert replayed.failures == {}
    # The scenarios model no offload benchmark: that collector finds nothing, and says so. Every
    # scenario has its inference server (even inference_server_down, whose failures are readings).
    assert set(replayed.no_data) <= {"bench"}
    assert "run `hybridmon bench`" in replayed.no_data.get("bench", "run `hybridmon bench`")


@pytest.mark.parametrize("name", SCENARIOS)
def test_counters_never_go_backwards(name, scenarios):
    history = scenarios.replayed(name).history
    metrics = {sample.spec.name for _, samples in history.latest().values() for sample in samples
               if sample.spec.kind == "counter"}
    assert "hybridmon_swap_in_bytes_total" in metrics and "hybridmon_gpu_pcie_replays_total" in metrics
    for metric in metrics:
        for series in history.series(metric):
            assert all(b >= a for a, b in zip(series.values, series.values[1:])), (metric, series.labels)


@pytest.mark.parametrize("name", SCENARIOS)
def test_process_memory_adds_up(name, scenarios):
    """numa_maps pages off the GPU's node are part of VmRSS; swap traffic is whole pages; GPU
    memory holds its processes'."""
    history = scenarios.replayed(name).history
    for pid in (VLLM, LLAMA):
        resident = one(history, "hybridmon_process_resident_bytes", pid=str(pid))
        off_node = history.series("hybridmon_process_resident_off_gpu_node_bytes", pid=str(pid))
        # placed only when on a GPU (numa.on_gpus): vLLM V1's API server holds no GPU memory;
        # each of these servers is on one GPU, so against one node
        assert len(off_node) == bool(history.series("hybridmon_gpu_process_memory_used_bytes", pid=str(pid))), pid
        times = off_node[0].times if off_node else ()
        for index, t in enumerate(times):
            # numa_maps is read at most once a minute (numa.NUMA_MAPS_MIN_AGE_SECONDS), on every
            # other 30 s run from the first, and exported as last read on each
            read_at = times[index - index % 2]
            assert 0 <= off_node[0].values[index] <= value_at(resident, read_at - START_TIME), (pid, t - START_TIME)
    page = os.sysconf("SC_PAGE_SIZE")
    for metric in ("hybridmon_swap_in_bytes_total", "hybridmon_swap_out_bytes_total"):
        assert all(value % page == 0 for value in one(history, metric).values)
    for gpu in ("0", "1"):
        used = one(history, "hybridmon_gpu_memory_used_bytes", gpu=gpu)
        # the server and a graphics client (Xorg) on each GPU: together within what the GPU has used
        processes = history.series("hybridmon_gpu_process_memory_used_bytes", gpu=gpu)
        assert len(processes) >= 2
        # by time: a process that exits (a restarted server, crash_library) has fewer points
        held = [dict(zip(p.times, p.values)) for p in processes]
        for t, u in zip(used.times, used.values):
            assert u >= sum(points.get(t, 0.0) for points in held), t


def test_generation_is_fast(scenarios):
    """docs/scenarios.md promises seconds per scenario; this bound is 10x what a 2-vCPU VM takes."""
    for name in ("gpu_lost", "memory_growth"):
        summary = scenarios.summary(name)
        assert summary.wall_seconds / summary.ticks < 0.03, (name, summary.wall_seconds)


def test_a_scenario_generates_the_same_values_every_time(scenarios, tmp_path):
    again = replay(write_trace("gpu_lost", tmp_path / "again.jsonl.gz").path, 7200).history
    first = scenarios.replayed("gpu_lost").history
    for metric in ("hybridmon_gpu_utilization_ratio", "hybridmon_swap_out_bytes_total",
                   "hybridmon_process_cpu_seconds_total", "hybridmon_pcie_device_present",
                   "hybridmon_inference_generated_tokens_total",
                   "hybridmon_inference_inter_token_latency_percentile_seconds"):
        assert ([(s.labels, s.times, s.values) for s in again.series(metric)]
                == [(s.labels, s.times, s.values) for s in first.series(metric)]), metric


# --- each scenario's signal ------------------------------------------------------------------------

def test_pcie_starvation_pins_the_link_while_the_gpu_stalls(scenarios):
    history = scenarios.replayed("pcie_starvation").history
    onset = SCENARIOS["pcie_starvation"].onset_seconds
    h2d = one(history, "hybridmon_gpu_pcie_throughput_bytes_per_second", gpu="0", direction="host_to_device")
    utilization = one(history, "hybridmon_gpu_utilization_ratio", gpu="0")
    assert max(between(h2d, 0, onset)) < 0.5 * GEN4_X16 and min(between(utilization, 0, onset)) >= 0.8
    # a saturated copy engine: ~0.82 of the theoretical rate (nvbandwidth, Gen4 x16: 25.5-26.3 GB/s)
    assert min(between(h2d, onset, onset + 600)) >= 0.8 * GEN4_X16
    assert max(between(h2d, onset, onset + 600)) <= 0.84 * GEN4_X16
    assert max(between(utilization, onset + 30, onset + 600)) <= 0.25
    # Ten minutes later the offload stops and the GPU works again.
    assert max(between(h2d, onset + 600, 1e9)) < 0.5 * GEN4_X16
    assert min(between(utilization, onset + 600, 1e9)) >= 0.8
    assert set(between(one(history, "hybridmon_gpu_pcie_link_generation", gpu="0"), 0, 1e9)) == {4}


def test_pcie_link_degraded_is_busy_only_after_onset(scenarios):
    history = scenarios.replayed("pcie_link_degraded").history
    onset = SCENARIOS["pcie_link_degraded"].onset_seconds
    for metric, value in (("hybridmon_gpu_pcie_link_generation", 3), ("hybridmon_gpu_pcie_link_width_lanes", 8),
                          ("hybridmon_gpu_pcie_link_max_generation", 4), ("hybridmon_gpu_pcie_link_max_width_lanes", 16)):
        assert set(between(one(history, metric, gpu="1"), 0, 1e9)) == {value}, metric
    assert set(between(one(history, "hybridmon_pcie_link_generation", pci_bus_id=GPU1_ADDRESS), 0, 1e9)) == {3}
    assert set(between(one(history, "hybridmon_pcie_link_width_lanes", pci_bus_id=GPU1_ADDRESS), 0, 1e9)) == {8}
    utilization = one(history, "hybridmon_gpu_utilization_ratio", gpu="1")
    assert max(between(utilization, 0, onset)) <= 0.05
    assert min(between(utilization, onset + 10, 1e9)) >= 0.7


def test_pcie_errors_raise_replays_and_aer_counters(scenarios):
    history = scenarios.replayed("pcie_errors").history
    scenario = SCENARIOS["pcie_errors"]
    onset, end = scenario.onset_seconds, scenario.duration_seconds
    replays = one(history, "hybridmon_gpu_pcie_replays_total", gpu="0")
    assert rate(replays, 0, onset - 1) == 0
    assert 80 <= 60 * rate(replays, onset, end) <= 120  # DCGM's bound for Gen4 x16: 16/min
    nonfatal = one(history, "hybridmon_pcie_aer_errors_total", pci_bus_id=GPU0_ADDRESS, severity="nonfatal")
    # the pcie collector reads sysfs every 5 s: the error counted at onset + 30 shows by onset + 35
    assert latest_at(nonfatal, onset + 29) == value_at(nonfatal, 0) == 1
    assert latest_at(nonfatal, onset + 30 + PcieCollector.default_interval_seconds) == latest_at(nonfatal, end) == 2
    correctable = one(history, "hybridmon_pcie_aer_errors_total", pci_bus_id=GPU0_ADDRESS, severity="correctable")
    assert latest_at(correctable, onset - 1) == 7
    assert 3600 * rate(correctable, onset, onset + 300) >= 100  # threshold: 60 per hour
    assert set(between(one(history, "hybridmon_gpu_pcie_replays_total", gpu="1"), 0, 1e9)) == {17}


def test_gpu_lost_in_nvml_then_gone_from_the_bus(scenarios):
    history = scenarios.replayed("gpu_lost").history
    onset = SCENARIOS["gpu_lost"].onset_seconds
    up = one(history, "hybridmon_gpu_up", gpu="1")
    assert set(between(up, 0, onset)) == {1} and set(between(up, onset, 1e9)) == {0}
    present = one(history, "hybridmon_pcie_device_present", pci_bus_id=GPU1_ADDRESS)
    assert set(between(present, 0, onset + 2)) == {1} and set(between(present, onset + 2, 1e9)) == {0}
    assert set(between(one(history, "hybridmon_gpu_up", gpu="0"), 0, 1e9)) == {1}
    assert set(between(one(history, "hybridmon_pcie_device_present", pci_bus_id=GPU0_ADDRESS), 0, 1e9)) == {1}


def test_swap_thrash_swaps_both_ways_and_the_server_swaps(scenarios):
    history = scenarios.replayed("swap_thrash").history
    scenario = SCENARIOS["swap_thrash"]
    onset, end = scenario.onset_seconds, scenario.duration_seconds
    swap_in, swap_out = (one(history, f"hybridmon_swap_{d}_bytes_total") for d in ("in", "out"))
    assert rate(swap_in, 0, onset - 1) == rate(swap_out, 0, onset - 1) == 0
    assert 7 * MIB <= rate(swap_in, onset, end) <= 9 * MIB
    assert 7.5 * MIB <= rate(swap_out, onset, end) <= 9.5 * MIB
    assert 350 <= rate(one(history, "hybridmon_memory_major_page_faults_total"), onset, end) <= 450
    memory_some = one(history, "hybridmon_pressure_stalled_seconds_total", resource="memory", scope="some")
    assert 0.27 <= rate(memory_some, onset, end) <= 0.33
    vm_swap = one(history, "hybridmon_process_swap_bytes", pid=str(VLLM))
    assert value_at(vm_swap, onset - 1) == 0 and value_at(vm_swap, end) == 2 * GIB
    assert all(b >= a for a, b in zip(vm_swap.values, vm_swap.values[1:]))
    assert rate(one(history, "hybridmon_process_major_faults_total", pid=str(VLLM)), onset, end) >= 100
    assert set(between(one(history, "hybridmon_sysctl_value", sysctl="vm.swappiness"), 0, 1e9)) == {60}
    assert set(between(one(history, "hybridmon_sysctl_value", sysctl="vm.dirty_ratio"), 0, 1e9)) == {20}
    # Swapped-out pages leave the resident set.
    resident = one(history, "hybridmon_process_resident_bytes", pid=str(VLLM))
    assert value_at(resident, onset - 1) - value_at(resident, end) == pytest.approx(2 * GIB, abs=8192)


def test_memory_growth_is_steady_while_the_load_is_flat(scenarios):
    history = scenarios.replayed("memory_growth").history
    scenario = SCENARIOS["memory_growth"]
    onset, end = scenario.onset_seconds, scenario.duration_seconds
    per_second = 1.5e9 / 3600
    gpu_memory = one(history, "hybridmon_gpu_process_memory_used_bytes", gpu="0", pid=str(VLLM))
    resident = one(history, "hybridmon_process_resident_bytes", pid=str(VLLM))
    for series in (gpu_memory, resident):
        assert len(set(between(series, 0, onset + 1))) == 1, series.name  # flat before onset
        assert rate(series, onset, end) == pytest.approx(per_second, rel=0.01), series.name
        for start in range(onset, end - 1800, 1800):  # steady: the same slope in every half hour
            assert rate(series, start, start + 1800) == pytest.approx(per_second, rel=0.01), series.name
        # Fast enough to count: > 5 % of the current size per hour.
        assert 3600 * per_second / value_at(series, end) >= 0.05
    cpu = one(history, "hybridmon_process_cpu_seconds_total", pid=str(VLLM))
    first_hour, last_hour = rate(cpu, onset, onset + 3600), rate(cpu, end - 3600, end)
    assert first_hour == pytest.approx(1.5, rel=0.02) and last_hour == pytest.approx(first_hour, rel=0.02)
    faults = one(history, "hybridmon_process_minor_faults_total", pid=str(VLLM))
    assert rate(faults, end - 3600, end) == pytest.approx(rate(faults, onset, onset + 3600), rel=0.02)


def test_numa_misplacement_moves_the_server_off_its_gpu_node(scenarios):
    history = scenarios.replayed("numa_misplacement").history
    onset = SCENARIOS["numa_misplacement"].onset_seconds
    # x86: NVML's NumaNodeId is not supported (nvml.h); the GPU's node is its PCI device's
    assert history.series("hybridmon_gpu_numa_node", gpu="0") == []
    assert set(between(one(history, "hybridmon_pcie_device_numa_node", pci_bus_id=GPU0_ADDRESS), 0, 1e9)) == {0}
    # pinned to one node's 8 CPUs throughout, node 0's then node 1's: the next test shows the
    # move in its CPU time (the allowed CPUs are a [process] detail_series series); its memory
    # moves off GPU 0's node 0 with it
    shares = memory_shares_off_gpu_node(history, VLLM, "0")
    assert all(share <= 0.05 for t, share in shares if t < onset)
    assert all(share >= 0.9 for t, share in shares if t >= onset + 120)


def memory_shares_off_gpu_node(history, pid: int, gpu_node: str) -> list[tuple[float, float]]:
    """(scenario time, share of VmRSS off the GPU's node) at each numa_maps reading, as the alert's
    two doors divide them."""
    off = one(history, "hybridmon_process_resident_off_gpu_node_bytes", pid=str(pid), gpu_node=gpu_node)
    resident = one(history, "hybridmon_process_resident_bytes", pid=str(pid))
    return [(t - START_TIME, size / value_at(resident, t - START_TIME))
            for index, (t, size) in enumerate(zip(off.times, off.values)) if index % 2 == 0]


def cpu_share_off(history, pid: int, gpu_node: str, start: float, end: float) -> float:
    """The share of the process's CPU time between two readings that ran off its GPU's node."""
    off = one(history, "hybridmon_process_cpu_seconds_off_gpu_node_total", pid=str(pid), gpu_node=gpu_node)
    return rate(off, start, end) / rate(one(history, "hybridmon_process_cpu_seconds_total", pid=str(pid)), start, end)


def test_numa_misplacement_moves_the_servers_cpu_time_with_its_cpus(scenarios):
    history = scenarios.replayed("numa_misplacement").history
    assert cpu_share_off(history, VLLM, "0", 0, 30) == 0.0
    # the reading at the onset counts the 30 s before it on node 1, where the threads are now: a
    # thread's time since the last reading is counted where it runs (exporters/numa.py), and the
    # process's own CPU time (1.5 cores) is split as its threads' was
    assert cpu_share_off(history, VLLM, "0", 90, 690) == pytest.approx(1.0, rel=0.01)


@pytest.mark.parametrize("name", ["healthy_unpinned_local_memory", "numa_unpinned_memory_remote"])
def test_unpinned_servers_run_on_both_nodes(name, scenarios):
    """The default layout: all 16 CPUs allowed, busy threads wandering around half on each node
    (37.5 % to 62.5 % per minute), never mostly on the far one for long."""
    history = scenarios.replayed(name).history
    for pid, node in ((VLLM, "0"), (LLAMA, "1")):
        # from the second reading on: the first sets the baseline of its threads' split
        shares = [cpu_share_off(history, pid, node, start, start + 120) for start in range(30, 360, 30)]
        assert all(0.3 <= share <= 0.7 for share in shares), (pid, shares)
        assert max(shares) - min(shares) >= 0.05   # it wanders
    expected = 0.03 if name == "healthy_unpinned_local_memory" else 0.65
    assert all(share == pytest.approx(expected, abs=0.005) for _, share in memory_shares_off_gpu_node(history, VLLM, "0"))


def test_gpu_memory_headroom_climbs_past_96_percent(scenarios):
    history = scenarios.replayed("gpu_memory_headroom").history
    onset = SCENARIOS["gpu_memory_headroom"].onset_seconds
    used = one(history, "hybridmon_gpu_memory_used_bytes", gpu="0")
    total = value_at(one(history, "hybridmon_gpu_memory_total_bytes", gpu="0"), 0)
    assert {round(v / total, 3) for v in between(used, 0, onset + 1)} == {0.85}
    assert all(v / total >= 0.95 for v in between(used, onset + 251, 1e9))
    assert max(between(used, 0, 1e9)) / total == pytest.approx(0.97, abs=1e-6)
    assert all(b >= a for a, b in zip(used.values, used.values[1:]))


def test_host_config_risks_are_there_from_the_start(scenarios):
    history = scenarios.replayed("host_config_risks").history
    settings = {"vm.swappiness": 60, "vm.dirty_ratio": 20, "kernel.numa_balancing": 1}
    for sysctl, value in settings.items():
        assert set(between(one(history, "hybridmon_sysctl_value", sysctl=sysctl), 0, 1e9)) == {value}
    assert between(one(history, "hybridmon_swap_total_bytes"), 0, 1)[0] > 0
    assert one(history, "hybridmon_transparent_hugepage_mode", setting="enabled").labels["mode"] == "always"
    assert set(between(one(history, "hybridmon_process_memlock_limit_bytes", pid=str(VLLM)), 0, 1e9)) == {8 * MIB}
    for counter in ("locked", "pinned"):   # the default limit on a process that locks nothing
        assert set(between(one(history, f"hybridmon_process_{counter}_bytes", pid=str(VLLM)), 0, 1e9)) == {0}
    # llama-server --mlock rests just under its 4 GiB
    assert set(between(one(history, "hybridmon_process_memlock_limit_bytes", pid=str(LLAMA)), 0, 1e9)) == {4 * GIB}
    assert set(between(one(history, "hybridmon_process_locked_bytes", pid=str(LLAMA)), 0, 1e9)) == {4 * GIB - 40 * MIB}


def test_the_memlock_limit_is_in_each_process_limits_file(tmp_path):
    """Only the memlock row of the fixture's /proc/<pid>/limits changes, in the kernel's columns."""
    host = SyntheticHost.from_fixture(tmp_path / "host")
    host.process(VLLM).memlock_limit_bytes = 64 * MIB
    host.process(LLAMA).memlock_limit_bytes = None
    host.write()
    fixture = (REPO / "tests" / "fixtures" / "host-2node" / "proc" / str(VLLM) / "limits").read_text()
    written = (tmp_path / "host" / "proc" / str(VLLM) / "limits").read_text()
    assert written == fixture.replace(
        "Max locked memory         8388608              8388608              bytes     \n",
        "Max locked memory         67108864             67108864             bytes     \n")
    assert written != fixture
    llama = (tmp_path / "host" / "proc" / str(LLAMA) / "limits").read_text()
    assert "Max locked memory         unlimited            unlimited            bytes     \n" in llama


def test_host_without_swap_has_little_headroom(scenarios):
    history = scenarios.replayed("host_no_swap_low_headroom").history
    assert set(between(one(history, "hybridmon_swap_total_bytes"), 0, 1e9)) == {0}
    total = value_at(one(history, "hybridmon_memory_total_bytes"), 0)
    assert max(between(one(history, "hybridmon_memory_available_bytes"), 0, 1e9)) / total < 0.10


def test_healthy_idle_host_has_downshifted_links_and_no_work(scenarios):
    history = scenarios.replayed("healthy_idle_downshifted").history
    for gpu, address in (("0", GPU0_ADDRESS), ("1", GPU1_ADDRESS)):
        assert set(between(one(history, "hybridmon_gpu_utilization_ratio", gpu=gpu), 0, 1e9)) == {0}
        assert set(between(one(history, "hybridmon_gpu_pcie_link_generation", gpu=gpu), 0, 1e9)) == {1}
        assert set(between(one(history, "hybridmon_gpu_pcie_link_width_lanes", gpu=gpu), 0, 1e9)) == {16}
        assert set(between(one(history, "hybridmon_gpu_pcie_link_max_generation", gpu=gpu), 0, 1e9)) == {4}
        assert set(between(one(history, "hybridmon_pcie_link_generation", pci_bus_id=address), 0, 1e9)) == {1}


def test_healthy_busy_offload_runs_near_but_not_at_capacity(scenarios):
    history = scenarios.replayed("healthy_busy_offload").history
    h2d = between(one(history, "hybridmon_gpu_pcie_throughput_bytes_per_second", gpu="0",
                      direction="host_to_device"), 0, 1e9)
    assert all(0.65 * GEN4_X16 <= v <= 0.75 * GEN4_X16 for v in h2d)
    assert all(v >= 0.8 for v in between(one(history, "hybridmon_gpu_utilization_ratio", gpu="0"), 0, 1e9))


def test_healthy_swap_is_configured_and_unused(scenarios):
    history = scenarios.replayed("healthy_swap_unused").history
    total = one(history, "hybridmon_swap_total_bytes")
    assert min(total.values) > 0 and one(history, "hybridmon_swap_free_bytes").values == total.values
    for metric in ("hybridmon_swap_in_bytes_total", "hybridmon_swap_out_bytes_total"):
        assert len(set(one(history, metric).values)) == 1
    assert rate(one(history, "hybridmon_memory_major_page_faults_total"), 0, 600) < 1


def test_healthy_growth_follows_the_load(scenarios):
    history = scenarios.replayed("healthy_growth_with_load").history
    pid = str(VLLM)
    cpu = one(history, "hybridmon_process_cpu_seconds_total", pid=pid)
    gpu_memory = one(history, "hybridmon_gpu_process_memory_used_bytes", gpu="0", pid=pid)
    assert rate(cpu, 7400, 8400) >= 2.5 * rate(cpu, 0, 600)  # 0.8 -> 2.4 cores
    # Memory added per core of load added is the same early and late: it grows with the load.
    for start in (1200, 4200, 7200):
        added_memory = value_at(gpu_memory, start + 1200) - value_at(gpu_memory, start)
        added_load = rate(cpu, start + 1100, start + 1200) - rate(cpu, start, start + 100)
        assert added_memory / added_load == pytest.approx(1.5e9 * (7800 / 3600) / 1.6, rel=0.15)


@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_hosts_are_configured_as_recommended(name, scenarios):
    history = scenarios.replayed(name).history
    for sysctl, value in {"vm.swappiness": 10, "vm.dirty_ratio": 15, "kernel.numa_balancing": 0}.items():
        assert set(between(one(history, "hybridmon_sysctl_value", sysctl=sysctl), 0, 1e9)) == {value}
    assert one(history, "hybridmon_transparent_hugepage_mode", setting="enabled").labels["mode"] == "madvise"
    assert min(one(history, "hybridmon_swap_total_bytes").values) > 0
    # Each server lives on its GPU's node: 4242 with GPU0 on node 0, 5151 with GPU1 on node 1; it
    # runs there too, pinned (its CPU time all on the node), but for the unpinned default layout
    # (which may run anywhere: about half of it).
    # vLLM V1's API server (4242) holds no GPU memory and is not placed (numa.on_gpus): its engine
    # core (4343, a child with the same CPUs) holds GPU0's memory and is judged instead
    placed = "hybridmon_process_resident_off_gpu_node_bytes"
    engine = 4343 if history.series(placed, pid="4343") else VLLM
    for pid, node in ((engine, "0"), (LLAMA, "1")):
        last = one(history, "hybridmon_process_cpu_seconds_off_gpu_node_total", pid=str(pid)).times[-1] - START_TIME
        cpu_off = cpu_share_off(history, pid, node, 0, last)
        assert cpu_off < 0.05 if name != "healthy_unpinned_local_memory" else 0.3 <= cpu_off <= 0.7, (pid, cpu_off)
        assert all(share < 0.05 for _, share in memory_shares_off_gpu_node(history, pid, node))
    for pid in (VLLM, LLAMA):
        assert set(one(history, "hybridmon_process_memlock_limit_bytes", pid=str(pid)).values) == {math.inf}
    for gpu in ("0", "1"):
        used = one(history, "hybridmon_gpu_memory_used_bytes", gpu=gpu).values
        total = one(history, "hybridmon_gpu_memory_total_bytes", gpu=gpu).values[0]
        assert max(used) / total < 0.9


# --- the command line ------------------------------------------------------------------------------

def test_command_line_lists_and_writes(tmp_path):
    environment = subprocess_environment()
    listed = subprocess.run([HYBRIDMON[0], "-m", "tests.support.scenarios", "list"], capture_output=True, text=True,
                            env=environment, cwd=tmp_path, timeout=60, check=True).stdout
    for name, scenario in SCENARIOS.items():
        assert name in listed
    assert "must stay silent" in listed and 'pci_bus_id="0000:ca:00.0"}' in listed
    written = subprocess.run([HYBRIDMON[0], "-m", "tests.support.scenarios", "write", "host_config_risks", "--output",
                              str(tmp_path / "t.jsonl.gz")], capture_output=True, text=True, env=environment,
                             cwd=tmp_path, timeout=120, check=True).stdout
    assert "host_config_risks:" in written and "records" in written
    assert replay(tmp_path / "t.jsonl.gz", 7200).failures == {}
    unknown = subprocess.run([HYBRIDMON[0], "-m", "tests.support.scenarios", "write", "nope", "-o", str(tmp_path / "x")],
                             capture_output=True, text=True, env=environment, cwd=tmp_path, timeout=60)
    assert unknown.returncode == 2 and "unknown scenario" in unknown.stderr


@pytest.mark.parametrize("name, before, after, stops", [
    ("gpu_memory_fills", 0.80, 0.97, "FILLS_GROWTH_STOPS"),
    ("gpu_memory_ramp_stops", 0.70, 0.88, "RAMP_STOPS_GROWTH_STOPS")])
def test_gpu_memory_ramps_grow_steadily_then_hold(name, before, after, stops, scenarios):
    """The VRAM forecast scenarios (issue 14, item 4): flat before onset, rising every tick until
    the growth stops, flat at `after` from then to the end."""
    from hybridmon.exporters.gpu import MEMORY_TOTAL, MEMORY_USED
    from tests.support.scenarios import library
    stop = getattr(library, stops)
    history = scenarios.replayed(name).history
    onset = SCENARIOS[name].onset_seconds
    used = one(history, MEMORY_USED.name, gpu="0")
    total = value_at(one(history, MEMORY_TOTAL.name, gpu="0"), 0)
    assert {round(v / total, 3) for v in between(used, 0, onset + 1)} == {before}
    growing = between(used, onset + 1, stop)
    assert all(b > a for a, b in zip(growing, growing[1:]))
    assert {round(v / total, 3) for v in between(used, stop, 1e9)} == {after}
