"""The benchmark runner, its stored runs, the metrics made from them and `hybridmon bench`, on the
fixture host with a stand-in binary printing hand-written reports (tests/fixtures/bench/README.md)
and the fake NVML. The real binary's no-device path is in test_offload_bench_build.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from hybridmon.agent.commands import budget
from hybridmon.agent.commands.bench import render
from hybridmon.agent.bench.runner import BenchRunner, GpuActivity, GpuBusy, busy_reason, is_display_server
from hybridmon.agent.bench.store import RUNS_KEPT_PER_GPU, save_run
from hybridmon.exporters import bench_report
from hybridmon.exporters.base import NoDataError
from hybridmon.exporters.bench import (BANDWIDTH, C2C_MEASURED_CAPACITY, EFFICIENCY, MEASURED_BIDIRECTIONAL_CAPACITY,
                                      MEASURED_CAPACITY, BenchCollector)
from hybridmon.exporters.bench_runs import (bidirectional_capacity, load_latest, measured_capacity,
                                            parse_stored_run, stands_for_the_link)
from hybridmon.exporters.sources import LiveSource, RecordingSource, ReplaySource
from hybridmon.pcie_rates import theoretical_capacity
from tests.support.agent_helpers import FIXTURE_ENVIRONMENT, REPO
from tests.support.bench_helpers import BENCH_FIXTURES, calls, fake_binary
from tests.support.paths import FIXTURE_HOST
from tests.support.fake_nvml import GIB, FakeNvml, default_gpus
from hybridmon.exporters.bench_report import ReportError, parse_error, parse_progress, parse_report
from tests.support.bench_helpers import stored_run_text
from tests.support.parser_properties import ParserRow, read
from tests.support.paths import FIXTURES

SYSFS = str(FIXTURE_HOST / "sys")
GEN4_X16 = theoretical_capacity(4, 16)


def fixture_text(name: str) -> str:
    return (BENCH_FIXTURES / name).read_text()


def idle_nvml() -> FakeNvml:
    """The fixture host's GPUs with nothing running on them."""
    nvml = FakeNvml()
    gpus = default_gpus()
    for gpu in gpus:
        gpu.processes, gpu.utilization_percent = [], 0
    nvml.configure(gpus=gpus)
    return nvml


def proc_self(tmp_path: Path, cpus: str = "0-63", mems: str = "0-1") -> str:
    """A procfs root whose self/status allows `cpus` and memory nodes `mems` (proc(5) lines);
    the default lets the runner use both of the fixture host's nodes."""
    root = tmp_path / "proc"
    (root / "self").mkdir(parents=True, exist_ok=True)
    (root / "self" / "status").write_text(f"Name:\tpython3\nCpus_allowed_list:\t{cpus}\n"
                                          f"Mems_allowed_list:\t{mems}\n")
    return str(root)


def runner(tmp_path: Path, nvml=None, **options) -> BenchRunner:
    binary = fake_binary(tmp_path, **{k: options.pop(k) for k in ("local", "remote", "status", "local_node")
                                      if k in options})
    options.setdefault("procfs", proc_self(tmp_path))
    return BenchRunner(binary, tmp_path / "state", nvml_module=nvml or idle_nvml(), sysfs=SYSFS, **options)


# --- the binary's output ----------------------------------------------------------------------

def test_report_parses_into_bytes_per_second_with_placement():
    parsed = bench_report.parse_report(fixture_text("report-gen4-local.json"))
    assert parsed.pci_bus_id == "0000:17:00.0" and parsed.numa_node == 0
    assert len(parsed.results) == 40 and parsed.skipped == ()
    peak = [r for r in parsed.results if (r.direction, r.memory, r.transfer_bytes)
            == ("host_to_device", "pinned", 268435456)]
    assert peak[0].median_bytes_per_second == pytest.approx(26.208e9)
    assert peak[0].min_bytes_per_second == pytest.approx(25.422e9)
    assert peak[0].host_numa_node == 0 and peak[0].samples == 10
    assert parsed.cpu_affinity == {"bound": True, "cpus": "0-15", "note": None}
    # Each stream of the bidirectional test on its own, as nvbandwidth reports it: no sum.
    both = {r.direction: r.median_bytes_per_second for r in parsed.results
            if r.transfer_bytes == 268435456 and r.memory == "pinned"}
    assert both == {"host_to_device": pytest.approx(26.208e9), "device_to_host": pytest.approx(26.402e9),
                    "host_to_device_bidirectional": pytest.approx(20.932e9),
                    "device_to_host_bidirectional": pytest.approx(21.185e9)}
    bidirectional = [r for r in parsed.results if r.direction in bench_report.BIDIRECTIONAL]
    assert {r.interfered_throughout for r in bidirectional} == {True}
    assert {(r.memory, r.issue) for r in parsed.results} == {
        ("pinned", "queued"), ("pinned", "loop"), ("pageable", "loop")}


def test_kv_block_sizes_are_read_per_size_queued_and_as_a_copy_loop():
    """Version 3: the 32 KiB - 1 MiB blocks a server copies per layer, each direction alone, both
    with the issue cost hidden (queued) and paid (loop)."""
    parsed = bench_report.parse_report(fixture_text("report-gen4-local.json"))
    loops = {(r.direction, r.transfer_bytes): r.median_bytes_per_second for r in parsed.results if r.issue == "loop"
             and r.memory == "pinned"}
    assert sorted({size for _direction, size in loops}) == [32768, 131072, 262144, 1048576]
    assert loops[("host_to_device", 32768)] == pytest.approx(8.9e9)


def test_a_version_2_report_is_still_read_with_what_it_did_not_record_left_unknown():
    """Before issue 29 both bidirectional streams copied the same bytes and nobody checked that
    the interference held: the figures are read, the check is unknown (None), never True."""
    parsed = bench_report.parse_report(fixture_text("report-v2-gen4-local.json"))
    assert len(parsed.results) == 24
    assert {r.issue for r in parsed.results if r.memory == "pinned"} == {"queued"}
    assert {r.issue for r in parsed.results if r.memory == "pageable"} == {"loop"}
    assert {r.interfered_throughout for r in parsed.results} == {None}


def test_a_version_1_report_is_still_read_and_its_sum_is_named_as_one():
    """Stored runs from before issue 13 keep their figures; the summed one says it is a sum."""
    parsed = bench_report.parse_report(fixture_text("report-v1-gen4-local.json"))
    summed = [r for r in parsed.results if r.transfer_bytes == 268435456 and "bidirectional" in r.direction]
    assert [(r.direction, r.median_bytes_per_second) for r in summed] == [
        ("bidirectional_summed", pytest.approx(42.117e9))]
    assert parsed.cpu_affinity is None
    data = json.loads(fixture_text("report-gen4-local.json"))
    data["results"][2]["direction"] = "bidirectional"  # the version-1 name in a version-3 report
    with pytest.raises(bench_report.ReportError, match="unknown direction"):
        bench_report.parse_report(json.dumps(data))


@pytest.mark.parametrize("mutation, message", [
    (lambda r: r.update(version=4), "schema version 4"),
    (lambda r: r["results"][0].pop("issue"), "missing 'issue'"),
    (lambda r: r["results"][0].update(issue="sideways"), "unknown issue 'sideways'"),
    (lambda r: r["results"][16].update(issue="queued"), "unknown issue 'queued' for pageable memory"),
    (lambda r: r["results"][2].pop("interfered_throughout"), "missing 'interfered_throughout'"),
    (lambda r: r["results"][2].update(interfering_copies_per_sample=0), "must be positive"),
    (lambda r: r["cpu_affinity"].update(bound="yes"), "'bound' is yes"),
    (lambda r: r["results"][0].update(verified=False), "not verified"),
    (lambda r: r["results"][0].update(median_gbps=0), "not positive"),
    (lambda r: r["results"][0].update(min_gbps=99), "out of order"),
    (lambda r: r["results"][0].update(direction="sideways"), "unknown direction"),
    (lambda r: r["results"][0].update(bytes=True), "not a number"),
    (lambda r: r.pop("device"), "missing 'device'"),
])
def test_a_report_that_breaks_its_schema_is_refused_with_the_reason(mutation, message):
    data = json.loads(fixture_text("report-gen4-local.json"))
    mutation(data)
    with pytest.raises(bench_report.ReportError, match=message):
        bench_report.parse_report(json.dumps(data))


def test_error_object_and_progress_lines():
    error = bench_report.parse_error(fixture_text("error-no-device.json"))
    assert error.error == "no CUDA device" and error.detail.startswith("cudaErrorInsufficientDriver")
    step = bench_report.parse_progress('{"progress": {"step": 3, "steps": 20, "direction": "h2d", '
                                       '"memory": "pinned", "bytes": 2097152}}')
    assert (step.step, step.steps, step.direction, step.transfer_bytes) == (3, 20, "host_to_device", 2097152)
    step = bench_report.parse_progress('{"progress": {"step": 9, "steps": 40, "direction": "d2h_bidirectional", '
                                       '"memory": "pinned", "issue": "queued", "bytes": 2097152}}')
    assert (step.direction, step.issue) == ("device_to_host_bidirectional", "queued")
    assert bench_report.parse_progress("NVRM: some driver chatter") is None


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_parsers_raise_only_report_error_on_any_text(text):
    for parse in (bench_report.parse_report, bench_report.parse_error, parse_stored_run):
        try:
            parse(text)
        except bench_report.ReportError:
            pass
    bench_report.parse_progress(text)


# --- busy GPUs ----------------------------------------------------------------------------------

def test_busy_reason_names_processes_and_utilization():
    activity = GpuActivity(((4242, "vllm", 30 * GIB),), 0.87)
    assert busy_reason(activity, 0.05) == "processes pid 4242 (vllm, 30.0 GiB); 87% utilization"
    assert busy_reason(GpuActivity((), 0.04), 0.05) is None
    assert busy_reason(GpuActivity((), None), 0.05) is None  # no other process: utilization may be unknown


def test_a_display_server_alone_leaves_the_gpu_idle_for_the_bench_but_a_compute_process_does_not():
    xorg = (2101, "Xorg", 18 * 2**20)
    assert busy_reason(GpuActivity((), 0.01, display_servers=(xorg,)), 0.05) is None
    assert busy_reason(GpuActivity((), 0.30, display_servers=(xorg,)), 0.05) == "30% utilization"
    assert is_display_server("/usr/lib/xorg/Xorg", frozenset({"graphics"}))  # nvmlSystemGetProcessName's path
    assert is_display_server("gnome-shell", frozenset({"graphics"}))
    assert not is_display_server("Xorg", frozenset({"graphics", "compute"}))  # a CUDA context copies like any
    assert not is_display_server("llama-server", frozenset({"graphics"}))  # a Vulkan client copies too


def test_a_gpu_whose_processes_cannot_be_read_counts_as_in_use():
    """Fail closed (issue 13, item 6): copies by another process show in no utilization figure."""
    for utilization in (None, 0.0):
        reason = busy_reason(GpuActivity(None, utilization), 0.05)
        assert reason and "cannot be told" in reason


@pytest.mark.slow
@pytest.mark.parametrize("error", ["NVMLError_NotSupported", "NVMLError_NoPermission"])
def test_runner_refuses_when_nvml_will_not_list_processes_and_a_forced_run_is_contended(tmp_path, error):
    nvml = idle_nvml()
    for listing in ("Compute", "Graphics", "MPSCompute"):
        for entry_point in ("_v3", "_v2", ""):
            nvml.fail(f"nvmlDevice{listing}RunningProcesses{entry_point}".replace("Device", "DeviceGet"), error)
    with pytest.raises(GpuBusy, match="cannot be told"):
        runner(tmp_path, nvml=nvml).run_gpu(0)
    assert calls(tmp_path) == []
    record = runner(tmp_path, nvml=nvml).run_gpu(0, force=True)
    assert "cannot be told" in record["contended"]
    assert load_latest(tmp_path / "state")[0][0].contended == record["contended"]


def test_runner_refuses_a_busy_gpu_and_runs_nothing(tmp_path):
    busy = FakeNvml()  # the fixture host: pid 4242 runs on GPU 0 at 87 %
    # Its headless Xorg (graphics list only) is a display server: not what makes it busy.
    with pytest.raises(GpuBusy, match=r"in use \(processes pid 4242 \(python3, 30.0 GiB\); 87% utilization\)") as raised:
        runner(tmp_path, nvml=busy).run_gpu(0)
    assert raised.value.exit_code == 4
    assert calls(tmp_path) == [] and not (tmp_path / "state").exists()


@pytest.mark.slow
def test_forced_run_beside_a_busy_gpu_is_stored_as_contended(tmp_path):
    record = runner(tmp_path, nvml=FakeNvml()).run_gpu(0, force=True)
    assert "pid 4242" in record["contended"]
    run = load_latest(tmp_path / "state")[0][0]
    assert run.contended == record["contended"]


# --- a run ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_run_measures_local_then_the_farthest_remote_node_and_stores_both(tmp_path):
    progress = []
    record = runner(tmp_path, progress=lambda gpu, placement, step: progress.append(
        (gpu, placement, step.step))).run_gpu(0)
    # The binary is asked for the GPU's own node first (sysfs numa_node of NVML's bus id), then
    # node 1 (the fixture's distance 21); the fixture host's sysfs has no local_cpulist.
    assert [call[call.index("--numa-node") + 1] for call in calls(tmp_path)] == ["0", "1"]
    assert [call[call.index("--cpus") + 1] for call in calls(tmp_path)] == ["none", "none"]
    assert all(call[:2] == ["--device", "0"] for call in calls(tmp_path))
    assert [entry["placement"] for entry in record["placements"]] == ["local", "remote"]
    assert record["gpu"] == {"index": 0, "uuid": "GPU-0a1b2c3d-0000-4000-8000-000000000000",
                             "name": "NVIDIA L40S", "pci_bus_id": "0000:17:00.0", "numa_node": 0}
    assert record["link"] == {"generation": 4, "width": 16, "max_generation": 4, "max_width": 16}
    assert record["contended"] is None and record["failures"] == [] and record["mig"] is None
    assert record["placements"][0]["notes"] == ["no locality known (no local_cpulist in sysfs): CPUs not bound"]
    # one step per test: local 24 at the transfer sizes + 16 at the KV-block sizes, remote 24
    assert progress[0] == ("0", "local", 1) and progress[-1] == ("0", "remote", 24) and len(progress) == 64
    latest = tmp_path / "state" / "bench" / "latest" / "0000:17:00.0.json"
    assert json.loads(latest.read_text()) == record
    assert len(list((tmp_path / "state" / "bench" / "runs").glob("*-0000:17:00.0.json"))) == 1


@pytest.mark.slow
def test_the_binary_runs_in_pci_bus_order_without_the_callers_device_mask(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    env_dump = tmp_path / "env.json"
    binary = fake_binary(tmp_path, remote=None)
    text = binary.read_text().replace("import json, sys\n", f"import json, os, sys\njson.dump(dict(os.environ), open({str(env_dump)!r}, 'w'))\n", 1)
    binary.write_text(text)
    BenchRunner(binary, tmp_path / "state", nvml_module=idle_nvml(), sysfs=SYSFS, remote=False).run_gpu(0)
    env = json.loads(env_dump.read_text())
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and "CUDA_VISIBLE_DEVICES" not in env


@pytest.mark.slow
def test_a_device_order_mismatch_is_an_error_not_a_mislabelled_result(tmp_path):
    # NVML GPU 1 is 0000:ca:00.0 but the binary (the fixture report) says 0000:17:00.0.
    with pytest.raises(Exception, match="disagree on device order"):
        runner(tmp_path).run_gpu(1)
    assert not (tmp_path / "state").exists()


@pytest.mark.slow
def test_a_failing_remote_run_keeps_the_local_result_and_says_why(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('{"version": 1, "error": "host error", "detail": "mbind failed"}')
    binary = fake_binary(tmp_path, remote=str(broken), remote_status=6)
    record = BenchRunner(binary, tmp_path / "state", nvml_module=idle_nvml(), sysfs=SYSFS,
                         procfs=proc_self(tmp_path)).run_gpu(0)
    assert [entry["placement"] for entry in record["placements"]] == ["local"]
    assert record["failures"][0]["placement"] == "remote"
    assert "exit status 6" in record["failures"][0]["error"] and "mbind failed" in record["failures"][0]["error"]


@pytest.mark.slow
def test_garbage_output_with_status_zero_is_refused(tmp_path):
    garbage = tmp_path / "garbage.json"
    garbage.write_text('{"version": 1, "results": "lots"}')
    with pytest.raises(Exception, match="report for GPU 0 is unusable"):
        runner(tmp_path, local=str(garbage), remote=None).run_gpu(0)
    assert not (tmp_path / "state").exists()


# --- storage ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_store_keeps_the_latest_per_gpu_and_prunes_old_runs(tmp_path):
    record = runner(tmp_path).run_gpu(0)
    for offset in range(RUNS_KEPT_PER_GPU + 5):
        save_run(tmp_path / "state", {**record, "finished_at": record["finished_at"] + 3600 * (offset + 1)})
    runs_dir = tmp_path / "state" / "bench" / "runs"
    assert len(list(runs_dir.iterdir())) == RUNS_KEPT_PER_GPU
    (latest,), problems = load_latest(tmp_path / "state")
    assert problems == [] and latest.finished_at == record["finished_at"] + 3600 * (RUNS_KEPT_PER_GPU + 5)
    assert not [p for p in (tmp_path / "state" / "bench" / "latest").iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_store_refuses_what_it_could_not_read_back(tmp_path):
    record = runner(tmp_path).run_gpu(0)
    with pytest.raises(bench_report.ReportError):
        save_run(tmp_path / "other", {**record, "placements": [{"placement": "moon", "report": {}}]})
    with pytest.raises(bench_report.ReportError, match="PCI bus id"):
        save_run(tmp_path / "other", {**record, "gpu": {**record["gpu"], "pci_bus_id": "../../etc/x"}})
    assert not (tmp_path / "other").exists()


@pytest.mark.slow
def test_measured_capacity_is_the_largest_pinned_local_copy_per_direction(tmp_path):
    run = parse_stored_run(json.dumps(runner(tmp_path).run_gpu(0)))
    assert measured_capacity(run) == {"host_to_device": (pytest.approx(26.208e9), 268435456),
                                      "device_to_host": (pytest.approx(26.402e9), 268435456)}


# --- metrics ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_collector_exports_the_stored_run(tmp_path):
    runner(tmp_path).run_gpu(0)
    samples = BenchCollector(LiveSource(), tmp_path / "state").collect()
    labels = dict(gpu="0", uuid="GPU-0a1b2c3d-0000-4000-8000-000000000000")
    peak = dict(labels, direction="host_to_device", memory="pinned", issue="queued", transfer_bytes="268435456")
    assert samples.value("hybridmon_bench_bandwidth_bytes_per_second", **peak, placement="local",
                         path="pcie") == pytest.approx(26.208e9)
    assert samples.value("hybridmon_bench_bandwidth_bytes_per_second", **peak, placement="remote") == pytest.approx(20.442e9)
    assert samples.value("hybridmon_bench_efficiency_ratio", **peak, placement="local") == pytest.approx(26.208e9 / GEN4_X16)
    both = dict(peak, direction="host_to_device_bidirectional")
    assert samples.value("hybridmon_bench_efficiency_ratio", **both, placement="local") == pytest.approx(20.932e9 / GEN4_X16)
    assert samples.value("hybridmon_bench_link_capacity_bytes_per_second", **labels) == pytest.approx(GEN4_X16)
    assert samples.value("hybridmon_bench_contended", **labels) == 0
    assert samples.value("hybridmon_gpu_pcie_measured_capacity_bytes_per_second", **labels,
                         direction="device_to_host") == pytest.approx(26.402e9)
    # local: 24 transfer-size results + 16 KV-block ones; remote: 24
    assert len(samples.find("hybridmon_bench_bandwidth_bytes_per_second")) == 64
    block = dict(labels, direction="host_to_device", memory="pinned", transfer_bytes="32768", placement="local")
    assert samples.value("hybridmon_bench_bandwidth_bytes_per_second", **block, issue="loop") == pytest.approx(8.9e9)
    assert samples.value("hybridmon_bench_bandwidth_bytes_per_second", **block, issue="queued") == pytest.approx(14.5e9)
    # Efficiency only for the largest copies: 6 (direction, memory) pairs per placement.
    small = dict(labels, direction="host_to_device", memory="pinned", transfer_bytes="2097152")
    assert samples.value("hybridmon_bench_efficiency_ratio", **small, placement="local") is None
    assert len(samples.find("hybridmon_bench_efficiency_ratio")) == 12
    # Capacity: one direction at a time; the bidirectional figures per stream in their own series.
    assert {dict(zip(s.spec.label_names, s.label_values))["direction"] for s in samples.find(MEASURED_CAPACITY.name)} == {
        "host_to_device", "device_to_host"}
    assert samples.value(MEASURED_BIDIRECTIONAL_CAPACITY.name, **labels, direction="host_to_device") == pytest.approx(20.932e9)
    assert samples.value(MEASURED_BIDIRECTIONAL_CAPACITY.name, **labels, direction="device_to_host") == pytest.approx(21.185e9)


def series_paths(samples, spec) -> set[str]:
    return {dict(zip(sample.spec.label_names, sample.label_values))["path"] for sample in samples.find(spec.name)}


@pytest.mark.slow
def test_a_run_over_nvlink_c2c_is_labelled_c2c_and_never_the_pcie_links_capacity(tmp_path, monkeypatch):
    """A GPU in C2C mode (GH200, GB200) copies to and from host memory over NVLink-C2C: the run is
    stored with path "c2c", its results exported with that label, its peak as C2C's measured
    capacity, and nothing of it as the PCIe link's (capacity, both-ways capacity, efficiency
    against the PCIe rate). The figures are the Gen4 fixture report's, standing in for a C2C
    run's: what is checked is where they go, not their size."""
    bench = runner(tmp_path)
    # What Nvml.c2c_mode_enabled answers on a GPU whose C2C link is on (it comes with branch nvml).
    monkeypatch.setattr(bench._nvml, "c2c_mode_enabled", lambda gpu: True, raising=False)
    record = bench.run_gpu(0)
    assert record["path"] == "c2c" and parse_stored_run(json.dumps(record)).path == "c2c"
    samples = BenchCollector(LiveSource(), tmp_path / "state").collect()
    assert series_paths(samples, BANDWIDTH) == {"c2c"}
    for spec in (MEASURED_CAPACITY, MEASURED_BIDIRECTIONAL_CAPACITY, EFFICIENCY):
        assert samples.find(spec.name) == [], spec.name
    assert samples.value(C2C_MEASURED_CAPACITY.name, gpu="0", direction="host_to_device") == pytest.approx(26.208e9)
    assert samples.value(C2C_MEASURED_CAPACITY.name, gpu="0", direction="device_to_host") == pytest.approx(26.402e9)


def test_a_run_stored_before_the_path_reads_as_pcie_and_an_unknown_path_is_refused():
    assert parse_stored_run(stored_run_text()).path == "pcie"
    record = json.loads(stored_run_text())
    assert parse_stored_run(json.dumps({**record, "path": "c2c"})).path == "c2c"
    for wrong in ("nvlink", ["c2c"], None):
        with pytest.raises(ReportError, match="'path'"):
            parse_stored_run(json.dumps({**record, "path": wrong}))


@pytest.mark.slow
def test_a_version_1_run_keeps_its_figures_and_exports_no_bidirectional_capacity(tmp_path):
    runner(tmp_path, local="report-v1-gen4-local.json", remote=None).run_gpu(0)
    samples = BenchCollector(LiveSource(), tmp_path / "state").collect()
    summed = dict(gpu="0", direction="bidirectional_summed", memory="pinned", issue="queued",
                  transfer_bytes="268435456", placement="local")
    assert samples.value("hybridmon_bench_efficiency_ratio", **summed) == pytest.approx(42.117e9 / (2 * GEN4_X16))
    assert samples.value(MEASURED_CAPACITY.name, gpu="0", direction="host_to_device") == pytest.approx(26.208e9)
    assert samples.find(MEASURED_BIDIRECTIONAL_CAPACITY.name) == []


@pytest.mark.slow
def test_a_version_2_run_keeps_its_figures_and_exports_no_bidirectional_capacity(tmp_path):
    """Its bidirectional streams copied equal bytes, so the slower one ran its tail alone and reads
    high (issue 29: +32 % for 12.5 against 24 GB/s): shown, not used to size the link both ways."""
    runner(tmp_path, local="report-v2-gen4-local.json", remote=None).run_gpu(0)
    samples = BenchCollector(LiveSource(), tmp_path / "state").collect()
    stream = dict(gpu="0", direction="host_to_device_bidirectional", memory="pinned", issue="queued",
                  transfer_bytes="268435456", placement="local")
    assert samples.value("hybridmon_bench_bandwidth_bytes_per_second", **stream) == pytest.approx(20.932e9)
    assert samples.value(MEASURED_CAPACITY.name, gpu="0", direction="host_to_device") == pytest.approx(26.208e9)
    assert samples.find(MEASURED_BIDIRECTIONAL_CAPACITY.name) == []


def test_the_command_says_what_sizes_the_link_both_ways_and_when_a_run_does_not():
    record = json.loads(stored_run_text())
    assert ("  both ways at once: device to host 21.18 + host to device 20.93 = 42.12 GB/s"
            in render(record).splitlines())
    record["placements"][0]["report"] = json.loads(fixture_text("report-v2-gen4-local.json"))
    assert "  both ways at once: not from this run (a run before issue 29" in render(record)


def test_a_bidirectional_figure_whose_interference_stopped_first_does_not_size_the_link(tmp_path):
    """Version 3 checks that the opposite direction outlasted the measured one in every sample;
    where it did not (a direction over 8x faster than the other), the figure is shown but is no
    capacity: half a sum would understate the link, so both directions' capacity goes."""
    data = json.loads(fixture_text("report-gen4-local.json"))
    for result in data["results"]:
        if result["direction"] == "d2h_bidirectional":
            result["interfered_throughout"] = False
    record = json.loads(stored_run_text())
    record["placements"] = [{"placement": "local", "numa_node": 0, "report": data}]
    run = parse_stored_run(json.dumps(record))
    assert set(bidirectional_capacity(run)) == {"host_to_device"}
    assert measured_capacity(run)["device_to_host"] == (pytest.approx(26.402e9), 268435456)


def test_a_kv_block_loop_never_sizes_the_link():
    """Only queued pinned copies stand for the link (exporters/bench_runs.stands_for_the_link)."""
    parsed = bench_report.parse_report(fixture_text("report-gen4-local.json"))
    kinds = {(r.memory, r.issue, r.direction in bench_report.BIDIRECTIONAL): stands_for_the_link(r)
             for r in parsed.results}
    assert kinds == {("pinned", "queued", False): True, ("pinned", "queued", True): True,
                     ("pinned", "loop", False): False, ("pageable", "loop", False): False}


@pytest.mark.slow
def test_collector_leaves_the_capacity_of_a_contended_run_out(tmp_path):
    runner(tmp_path, nvml=FakeNvml()).run_gpu(0, force=True)
    samples = BenchCollector(LiveSource(), tmp_path / "state").collect()
    assert samples.value("hybridmon_bench_contended", gpu="0") == 1
    assert samples.find("hybridmon_gpu_pcie_measured_capacity_bytes_per_second") == []
    assert samples.find("hybridmon_bench_bandwidth_bytes_per_second")


@pytest.mark.slow
def test_collector_without_results_and_with_a_corrupt_file(tmp_path):
    with pytest.raises(NoDataError, match="run `hybridmon bench`"):
        BenchCollector(LiveSource(), tmp_path / "state").collect()
    runner(tmp_path).run_gpu(0)
    (tmp_path / "state" / "bench" / "latest" / "0000:ca:00.0.json").write_text('{"format": 1, "gpu"')
    samples = BenchCollector(LiveSource(), tmp_path / "state").collect()
    assert samples.find("hybridmon_bench_timestamp_seconds", gpu="0")  # the good file still counts


@pytest.mark.slow
def test_collector_parses_a_result_file_again_only_when_its_text_changed(tmp_path, monkeypatch):
    """Issue 17: the files change once per benchmark run and are read every 30 s; an unchanged
    text gives the samples it gave, a changed one (or a corrupt one) is parsed again."""
    from hybridmon.exporters import bench as bench_module
    parsed = []
    monkeypatch.setattr(bench_module, "parse_stored_run", lambda text: parsed.append(text) or parse_stored_run(text))
    runner(tmp_path).run_gpu(0)
    collector = BenchCollector(LiveSource(), tmp_path / "state")
    first = list(collector.collect())
    assert list(collector.collect()) == first and len(parsed) == 1
    (path,) = (tmp_path / "state" / "bench" / "latest").glob("*.json")
    run = json.loads(path.read_text())
    run["contended"] = "a forced run beside a busy GPU"
    path.write_text(json.dumps(run))
    assert collector.collect().value("hybridmon_bench_contended", gpu="0") == 1 and len(parsed) == 2
    path.write_text('{"format": 1, "gpu"')
    assert len(collector.collect()) == 0 and len(parsed) == 3  # logged and left out, never reused


@pytest.mark.slow
def test_collector_record_and_replay_give_the_same_samples(tmp_path):
    runner(tmp_path).run_gpu(0)
    recording = RecordingSource()
    live = list(BenchCollector(recording, tmp_path / "state").collect())
    replay = ReplaySource()
    replay.load(recording.take_readings())
    assert list(BenchCollector(replay, tmp_path / "state").collect()) == live


# --- budget -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_budget_uses_the_slowest_measured_host_to_device_capacity(tmp_path):
    assert budget.measured_bandwidth(tmp_path / "state") is None
    runner(tmp_path).run_gpu(0)
    slow = json.loads(fixture_text("report-gen4-slow-local.json"))
    slow["device"]["pci_bus_id"] = "0000:ca:00.0"
    (tmp_path / "slow.json").write_text(json.dumps(slow))
    nvml = idle_nvml()
    BenchRunner(fake_binary(tmp_path, local=str(tmp_path / "slow.json"), remote=None),
                tmp_path / "state", nvml_module=nvml, sysfs=SYSFS).run_gpu(1)
    bandwidth, source = budget.measured_bandwidth(tmp_path / "state")
    assert bandwidth == pytest.approx(round(26.208 * 0.52, 3) * 1e9)
    assert source.startswith("measured on GPU 1 (0000:ca:00.0)")


# --- the command ------------------------------------------------------------------------------

def hybridmon(*args: str, state: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, **FIXTURE_ENVIRONMENT, "HYBRIDMON_STATE_DIR": str(state),
                   "PYTHONPATH": str(REPO), **env}
    return subprocess.run([sys.executable, "-m", "hybridmon.agent.cli", *args], capture_output=True, text=True,
                          env=environment, timeout=60, cwd=REPO)


@pytest.mark.slow
def test_cli_refuses_a_busy_gpu_with_exit_4_and_runs_it_with_force(tmp_path):
    binary = fake_binary(tmp_path)
    refused = hybridmon("bench", "--gpu", "0", "--binary", str(binary), state=tmp_path / "state")
    assert refused.returncode == 4
    assert "GPU 0 is in use (processes pid 4242" in refused.stderr and "--force" in refused.stderr
    forced = hybridmon("bench", "--gpu", "0", "--binary", str(binary), "--force", state=tmp_path / "state")
    assert forced.returncode == 0, forced.stderr
    assert "warning: GPU 0 is in use" in forced.stderr
    # Progress is a live line on a terminal only (tests/agent/test_progress.py); a pipe gets none.
    assert "[ 1/20]" not in forced.stderr and "\r" not in forced.stderr
    assert "not used as link capacity" in forced.stdout
    assert ("    pinned        256 MiB       26.21 (83%)       26.40 (84%)       20.93 (66%)       21.18 (67%)"
            in forced.stdout)
    # A KV block as a server's copy loop issues it, beside the same block queued.
    assert "    pinned loop    32 KiB        8.90 (28%)        9.10 (29%)                 -                 -" in forced.stdout
    assert "    pinned         32 KiB       14.50 (46%)       14.80 (47%)                 -                 -" in forced.stdout
    assert "host->device      device->host  h->d (both ways)  d->h (both ways)" in forced.stdout


@pytest.mark.slow
def test_cli_json_on_an_idle_gpu(tmp_path):
    layout = tmp_path / "layout.json"
    nvml = idle_nvml()
    nvml.dump_layout(str(layout))
    result = hybridmon("bench", "--gpu", "0", "--json", "--binary", str(fake_binary(tmp_path)),
                       state=tmp_path / "state", HYBRIDMON_FAKE_NVML_LAYOUT=str(layout))
    assert result.returncode == 0, result.stderr
    (run,) = json.loads(result.stdout)["runs"]
    assert run["contended"] is None and [p["placement"] for p in run["placements"]] == ["local", "remote"]


@pytest.mark.slow
def test_cli_turns_cudas_missing_device_into_exit_3(tmp_path):
    """NVML lists GPUs but CUDA finds none (e.g. no compute capability in the container): the
    binary's exit 3 and its reason reach the user."""
    binary = fake_binary(tmp_path, local="error-no-device.json", remote=None, status=3)
    result = hybridmon("bench", "--gpu", "0", "--force", "--binary", str(binary), state=tmp_path / "state")
    assert result.returncode == 3
    assert "no CUDA device: cudaErrorInsufficientDriver" in result.stderr
    assert "needs an NVIDIA GPU with a working driver" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "state").exists()


@pytest.mark.slow
def test_cli_names_a_driver_older_than_the_runtime_instead_of_no_device(tmp_path):
    """cudaErrorInsufficientDriver with a driver loaded: the binary's exit 7 and its message (both
    versions, both ways out) reach the user as a failure, not as "no CUDA device" (issue 29)."""
    binary = fake_binary(tmp_path, local="error-driver-too-old.json", remote=None, status=7)
    result = hybridmon("bench", "--gpu", "0", "--force", "--binary", str(binary), state=tmp_path / "state")
    assert result.returncode == 1
    assert ("GPU 0: CUDA driver too old: the CUDA runtime 13.0 this binary was built with needs a newer "
            "driver than the installed one, which supports CUDA up to 12.4: update the NVIDIA driver") in result.stderr
    assert "no CUDA device" not in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "state").exists()


@pytest.mark.slow
def test_without_a_gpu_bench_says_so_before_compiling_anything(tmp_path):
    """Issue 13: nvcc used to compile for ~14 s before the binary said there was no GPU. With no
    driver (real pynvml, no libnvidia-ml here), no <procfs>/driver/nvidia/gpus and no
    /dev/nvidia<N>, the command ends with exit 3 before looking for nvcc at all."""
    if Path("/dev/nvidia0").exists() or Path("/proc/driver/nvidia/gpus").exists():
        pytest.skip("a GPU host: the check would find the GPU and build the benchmark")
    marker = tmp_path / "nvcc-ran"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvcc").write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    (bin_dir / "nvcc").chmod(0o755)
    (tmp_path / "proc").mkdir()
    result = hybridmon("bench", state=tmp_path / "state", HYBRIDMON_GPU__NVML_MODULE="pynvml",
                       HYBRIDMON_PATHS__PROCFS=str(tmp_path / "proc"), XDG_CACHE_HOME=str(tmp_path / "cache"),
                       PATH=f"{bin_dir}:{os.environ['PATH']}")
    assert result.returncode == 3, result.stderr
    assert "hybridmon: no NVIDIA GPU to benchmark: NVIDIA driver not found" in result.stderr
    assert "Nothing was compiled or run" in result.stderr and "Traceback" not in result.stderr
    assert not marker.exists(), "nvcc was invoked before the GPU check"
    assert not (tmp_path / "cache").exists() and not (tmp_path / "state").exists()


@pytest.mark.slow
def test_cli_rejects_a_binary_built_from_another_source(tmp_path):
    binary = fake_binary(tmp_path)
    binary.write_text(binary.read_text().replace('"source_sha256": ', '"source_sha256": "0" + '))
    result = hybridmon("bench", "--binary", str(binary), state=tmp_path / "state")
    assert result.returncode == 1 and "rebuild it with `python -m hybridmon.agent.bench.build`" in result.stderr


@pytest.mark.slow
def test_without_nvml_the_run_goes_ahead_and_is_stored_as_contended(tmp_path):
    """Nothing can be asked without NVML: refusing would stop every such host, so the run is kept
    but marked contended (its capacity may be understated)."""
    bench = runner(tmp_path, nvml="hybridmon_no_such_nvml_module")
    assert bench.nvml_problem
    record = bench.run_gpu(0)
    assert "cannot be told" in record["contended"]
    assert len(calls(tmp_path)) == 2  # local and remote placements ran


# This module's parsers, each with realistic samples, for tests/exporters/test_parsers_robustness.py
# (which holds every parse_* of exporters/ to its one promised error).
_PROGRESS_LINE = ('{"progress": {"step": 3, "steps": 20, "direction": "h2d", "memory": "pinned", '
                  '"bytes": 2097152}}')
PARSER_ROWS = [
    ParserRow(parse_report, read(FIXTURES / "bench/report-gen4-local.json"), ReportError),
    ParserRow(parse_error, read(FIXTURES / "bench/error-no-device.json"), ReportError),
    # Anything that is not a progress line (a driver warning) is None, so it refuses nothing.
    ParserRow(parse_progress, (_PROGRESS_LINE,), ReportError),
    ParserRow(parse_stored_run, (stored_run_text(),), ReportError),
]
