"""hybridmon's NVML wrapper and GPU collector over the REAL pynvml, at the oldest nvidia-ml-py
pyproject.toml allows and the newest known, over a stub libnvidia-ml.so.1 compiled from nvml.h.

Each (version, driver) pair runs in its own subprocess (tests/support/stub_nvml/probe.py):
LD_LIBRARY_PATH points at the stub, PYTHONPATH starts at that version's pynvml. The stub writes
nvml.h's own structs, so a pynvml ctypes class that disagrees with the header shows up here as
wrong values, as it would over a real driver. No GPU is involved: nothing here is a measurement.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridmon.exporters import gpu as gpu_exporter
from hybridmon.exporters import nvml as nvml_module
from tests.support.stub_nvml import build

GIB, MIB = 1024**3, 1024**2
NOT_SUPPORTED, NO_PERMISSION = 3, 4  # nvmlReturn_t, nvml.h
FI_PCIE_TX_BYTES, FI_PCIE_RX_BYTES = 197, 198  # NVML_FI_DEV_PCIE_COUNT_TX/RX_BYTES, nvml.h
INVALID_ARGUMENT = 2  # nvmlReturn_t, nvml.h
# nvml.h nvmlGpmMetricId_t: PCIe "to this GPU" (RX) / "from this GPU" (TX), C2C total RX / TX.
GPM_PCIE_RX, GPM_PCIE_TX, GPM_C2C_RX, GPM_C2C_TX = 21, 20, 101, 100
REPO = Path(__file__).resolve().parents[2]

# Values chosen so that a misread shows: distinct per field, pids far apart from memory sizes,
# and three processes per list, so a wrong struct stride garbles the second and third.
L40S = {
    "name": "NVIDIA L40S", "uuid": "GPU-0c7e4d1a-58f2-4b8e-9a11-6d3e2f7a9b01",
    "bus_id": "00000000:17:00.0", "pci_device_id": "0x26B510DE",
    "memory_total": 48 * GIB, "memory_reserved": 512 * MIB, "memory_used": 31 * GIB + 7 * MIB,
    "pcie_rx_kbps": 1_234_567, "pcie_tx_kbps": 345_678, "link_gen": 4, "link_gen_max": 4,
    "link_width": 16, "link_width_max": 16, "replays": 3, "util_gpu": 87, "util_memory": 41,
    "mig_current": 0, "mig_pending": 0, "cpu_affinity": [0x0000_FFFF_0000_FFFF, 0x1],
    "fields": {FI_PCIE_TX_BYTES: 9_876_543_210_123, FI_PCIE_RX_BYTES: 123_456_789_012_345},
    "processes": [("compute", 104242, 30 * GIB, "python3"),
                  ("compute", 104243, None, "vllm-api-server"),  # NVML cannot tell its memory
                  ("compute", 104250, 1 * GIB + 3 * MIB, "tritonserver"),
                  ("graphics", 1200, 64 * MIB, "Xorg")],
    # x86 PCIe host: nvml.h, nvmlDeviceGetNumaNodeId "only applies to platforms where the GPUs
    # are NUMA nodes".
    "fail": {"nvmlDeviceGetNumaNodeId": NOT_SUPPORTED},
}
GH200 = {
    "name": "NVIDIA GH200 480GB", "uuid": "GPU-7f3b9c20-1d44-4e6a-b7c5-0a9e8d6f4c32",
    "bus_id": "00000009:01:00.0", "pci_device_id": "0x234210DE",
    "memory_total": 96 * GIB, "memory_reserved": 640 * MIB, "memory_used": 70 * GIB + 11 * MIB,
    "pcie_rx_kbps": 2_500, "pcie_tx_kbps": 1_700, "link_gen": 1, "link_gen_max": 5,
    "link_width": 16, "link_width_max": 16, "replays": 7, "util_gpu": 0, "util_memory": 0,
    "numa_node": 2, "mig_current": 0, "mig_pending": 0,
    "fields": {},  # the PCIe byte counters answer NOT_SUPPORTED per field
    # NVLink-C2C on, two links (the second down), each "in MBps" (nvml.h field 172); GPM (Hopper)
    # with PCIe RX/TX and C2C RX/TX in MiB/s, distinct so a swapped direction shows.
    "c2c_mode": 1, "c2c_links": [(True, 45_000), (False, 44_000)],
    "gpm_supported": 1, "gpm_metrics": {GPM_PCIE_RX: 1536.5, GPM_PCIE_TX: 512.25,
                                        GPM_C2C_RX: 40960.0, GPM_C2C_TX: 10240.0},
    "processes": [("compute", 205001, 70 * GIB, "python3"),
                  ("mps", 205002, 2 * GIB, "mps-client"),
                  ("graphics", 205003, 96 * MIB, "Xwayland")],
}
A100_MIG = {
    "name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-3a9d5e61-c2b7-4f08-8e1d-5b6c7a8f9e03",
    "bus_id": "00000000:ca:00.0", "pci_device_id": "0x20B210DE",
    "memory_total": 80 * GIB, "memory_reserved": 600 * MIB, "memory_used": 20 * GIB,
    "pcie_rx_kbps": 10_000, "pcie_tx_kbps": 20_000, "link_gen": 4, "link_gen_max": 4,
    "link_width": 16, "link_width_max": 16, "replays": 0, "util_gpu": 0, "util_memory": 0,
    "mig_current": 1, "mig_pending": 1,
    "fields": {FI_PCIE_TX_BYTES: 5_000_000, FI_PCIE_RX_BYTES: 6_000_000},
    "processes": [("compute", 306001, 10 * GIB, "python3"), ("compute", 306002, 5 * GIB, "python3"),
                  ("compute", 306003, 5 * GIB, "python3")],
    # nvml.h: with MIG on, the parent handle lists processes only for privileged callers, and
    # utilization is per instance.
    "fail": {**{f"nvmlDevice{kind}RunningProcesses{suffix}": NO_PERMISSION
                for kind in ("GetCompute", "GetGraphics", "GetMPSCompute")
                for suffix in ("", "_v2", "_v3")},
             "nvmlDeviceGetUtilizationRates": NOT_SUPPORTED, "nvmlDeviceGetNumaNodeId": NOT_SUPPORTED},
}
LAYOUT = {"driver_version": "550.54.15", "gpus": [L40S, GH200, A100_MIG]}
SYSFS_BUS_IDS = ["0000:17:00.0", "0009:01:00.0", "0000:ca:00.0"]
# Versions below the floor, run to show what it keeps out (why: build.py).
STRUCT_STRIDE_BUG, LACKS_NUMA_NODE_ID = build.STRUCT_STRIDE_BUG, build.LACKS_NUMA_NODE_ID


def stub_unavailable(reason: str) -> None:
    """A missing compiler or download fails in CI (scripts/test installs them), skips elsewhere."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"the stub libnvidia-ml must build in CI: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def layout_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("stub-nvml") / "layout.txt"
    build.write_layout(path, LAYOUT)
    return path


def run_probe(version: str, variant: str, layout: Path) -> dict:
    try:
        stub = build.build_stub(variant)
        binding = build.pynvml_dir(version)
    except build.StubUnavailable as error:
        stub_unavailable(str(error))
    env = {**os.environ, "LD_LIBRARY_PATH": str(stub), "HYBRIDMON_STUB_NVML_LAYOUT": str(layout),
           "PYTHONPATH": os.pathsep.join([str(binding), str(REPO)])}
    result = subprocess.run([sys.executable, "-m", "tests.support.stub_nvml.probe"], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"probe failed under {version}/{variant}:\n{result.stderr[-4000:]}"
    report = json.loads(result.stdout)
    report["stub_folder"], report["binding_folder"] = str(stub), str(binding)
    return report


@pytest.fixture(scope="module")
def probes(layout_file):
    """(version, variant) -> the probe's report, each run once per module."""
    cache: dict[tuple[str, str], dict] = {}

    def get(version: str, variant: str = "current") -> dict:
        if (version, variant) not in cache:
            cache[(version, variant)] = run_probe(version, variant, layout_file)
        return cache[(version, variant)]
    return get


@pytest.fixture(scope="module", params=build.tested_versions())
def version(request) -> str:
    return request.param


def reading(report: dict, gpu: int, name: str):
    """One Nvml reading's value; a failure names the reading and what it raised."""
    answer = report["wrapper"]["gpus"][gpu][name]
    assert "value" in answer, f"Nvml.{name}({gpu}) under {report['pynvml_version']}: {answer}"
    return answer["value"]


def expected_processes(layout_gpu: dict, kinds: set[str]) -> dict[int, int | None]:
    return {pid: used for kind, pid, used, _ in layout_gpu["processes"] if kind in kinds}


# --- it is the real binding over the stub ----------------------------------------------------------
@pytest.mark.slow
def test_the_real_pynvml_at_that_version_drives_the_stub(probes, version):
    report = probes(version)
    assert report["pynvml_version"] == version
    assert Path(report["pynvml_file"]).parent == Path(report["binding_folder"])
    assert report["library"] == str(Path(report["stub_folder"]) / build.LIBRARY_NAME)


def test_the_floor_is_the_one_the_wrapper_names():
    assert build.oldest_allowed() == nvml_module.MIN_NVIDIA_ML_PY


# --- the ABI: pynvml's ctypes classes against nvml.h ---------------------------------------------
def abi_mismatches(report: dict) -> list[str]:
    """Where pynvml's classes would read other bytes than nvml.h's types hold: each field pynvml
    has must sit at the header's offset with the header's size, and each class must have the
    header's sizeof (the stride of an array). Header members pynvml lacks are not a mismatch:
    e.g. nvmlValue_t's usVal, added to nvml.h after 12.560's pynvml, is never read through it."""
    abi = report["abi"]
    assert "value" in abi, abi
    problems = []
    for pair in abi["value"]["pairs"]:
        header, binding = pair["header"], pair.get("pynvml")
        if binding is None:
            problems.append(f"pynvml has no class for {pair['header_type']}")
            continue
        for member, placed in binding.items():
            if member not in header:
                problems.append(f"{pair['pynvml_class']}.{member}: not in nvml.h's "
                                f"{pair['header_type']}")
            elif header[member] != placed:
                problems.append(f"{pair['pynvml_class']}.{member or 'sizeof'}: pynvml {placed}, "
                                f"nvml.h {header[member]}")
    versions = abi["value"]["memory_v2_version"]
    if versions["header"] != versions["pynvml"]:
        problems.append(f"nvmlMemory_v2: pynvml {versions['pynvml']}, nvml.h {versions['header']}")
    return problems


@pytest.mark.slow
def test_pynvml_structs_match_nvml_h(probes, version):
    assert abi_mismatches(probes(version)) == []


@pytest.mark.slow
def test_the_abi_check_catches_the_12_535_77_process_struct(probes):
    problems = abi_mismatches(probes(STRUCT_STRIDE_BUG))
    assert any("c_nvmlProcessInfo_t.sizeof: pynvml [0, 32], nvml.h [0, 24]" in p for p in problems)
    assert any("usedGpuCcProtectedMemory" in p for p in problems)


# --- values marshalled through the real binding ---------------------------------------------------
@pytest.mark.slow
def test_identity(probes, version):
    report = probes(version)
    assert report["wrapper"]["device_count"] == {"value": 3}
    assert report["wrapper"]["driver_version"] == {"value": "550.54.15"}
    for gpu, layout_gpu in enumerate(LAYOUT["gpus"]):
        assert reading(report, gpu, "name") == layout_gpu["name"]
        assert reading(report, gpu, "uuid") == layout_gpu["uuid"]
        assert reading(report, gpu, "pci_bus_id") == SYSFS_BUS_IDS[gpu]


@pytest.mark.slow
def test_memory_info_v2(probes, version):
    report = probes(version)
    assert report["wrapper"]["memory_info_version"] == {"value": "v2"}
    for gpu, layout_gpu in enumerate(LAYOUT["gpus"]):
        assert reading(report, gpu, "memory_bytes") == [
            layout_gpu["memory_used"], layout_gpu["memory_total"], layout_gpu["memory_reserved"]]


@pytest.mark.slow
def test_pcie_link_replays_and_throughput(probes, version):
    report = probes(version)
    for gpu, layout_gpu in enumerate(LAYOUT["gpus"]):
        assert reading(report, gpu, "pcie_link_generation") == layout_gpu["link_gen"]
        assert reading(report, gpu, "pcie_link_max_generation") == layout_gpu["link_gen_max"]
        assert reading(report, gpu, "pcie_link_width_lanes") == layout_gpu["link_width"]
        assert reading(report, gpu, "pcie_link_max_width_lanes") == layout_gpu["link_width_max"]
        assert reading(report, gpu, "pcie_replay_count") == layout_gpu["replays"]
        host_to_device, device_to_host = reading(report, gpu, "pcie_throughput_bytes_per_second")
        # RX is what the GPU receives (host to device); NVML answers KB/s. The KB's size is the
        # pcie-traffic owner's to settle, so only direction and the multiplier's sameness are
        # checked here: no swap, no truncation.
        kilobyte = host_to_device / layout_gpu["pcie_rx_kbps"]
        assert kilobyte in (1000, 1024)
        assert device_to_host == layout_gpu["pcie_tx_kbps"] * kilobyte
        # The sampler's lean path calls the binding's function itself: the same answer, and lean.
        first, second, lean = reading(report, gpu, "pcie_throughput_lean")
        assert first == second == [host_to_device, device_to_host]
        assert lean is True


@pytest.mark.slow
def test_utilization_numa_node_and_not_supported_is_absent(probes, version):
    report = probes(version)
    assert reading(report, 0, "utilization_ratio") == pytest.approx(0.87)
    assert reading(report, 1, "utilization_ratio") == 0
    assert reading(report, 2, "utilization_ratio") is None  # NOT_SUPPORTED with MIG on
    assert reading(report, 0, "numa_node") is None  # NOT_SUPPORTED on x86
    assert reading(report, 1, "numa_node") == 2


@pytest.mark.slow
def test_all_three_processes_of_each_list_come_through(probes, version):
    report = probes(version)
    for gpu in (0, 1):
        listed = reading(report, gpu, "processes")
        assert listed is not None, f"GPU {gpu}: no process list under {version}"
        got = {p["pid"]: (p["used_memory_bytes"], p["kinds"]) for p in listed}
        want = {pid: (used, [kind]) for kind, pid, used, _ in LAYOUT["gpus"][gpu]["processes"]}
        assert got == want
    compute = {p["pid"]: p["used_memory_bytes"] for p in reading(report, 0, "compute_processes")}
    assert compute == expected_processes(L40S, {"compute", "mps"})
    calls = report["calls_after_wrapper"]  # the newest entry point, where the driver has it
    assert calls["nvmlDeviceGetComputeRunningProcesses_v3"] > 0
    assert calls["nvmlDeviceGetComputeRunningProcesses_v2"] == 0


@pytest.mark.slow
def test_pynvml_itself_unmarshals_every_process(probes, version):
    """Without hybridmon: the binding's own list has the right pid and memory in every entry."""
    direct = probes(version)["direct"]["value"]["gpus"][0]
    answer = direct["nvmlDeviceGetComputeRunningProcesses"]
    assert answer == {"value": [[pid, used] for kind, pid, used, _ in L40S["processes"]
                                if kind == "compute"]}


@pytest.mark.slow
def test_cpu_affinity_words(probes, version):
    direct = probes(version)["direct"]["value"]["gpus"][0]
    assert direct["nvmlDeviceGetCpuAffinity"] == {"value": L40S["cpu_affinity"]}


@pytest.mark.slow
def test_the_stub_shows_12_535_77s_garbage_from_the_second_process_on(probes):
    listed = probes(STRUCT_STRIDE_BUG)["direct"]["value"]["gpus"][0]
    pids = [pid for pid, _ in listed["nvmlDeviceGetComputeRunningProcesses"]["value"]]
    assert pids[0] == 104242
    assert pids[1:3] != [104243, 104250]


@pytest.mark.slow
def test_mig_mode(probes, version):
    report = probes(version)
    assert reading(report, 0, "mig_enabled") is False
    assert reading(report, 2, "mig_enabled") is True
    assert reading(report, 2, "processes") is None  # NO_PERMISSION on the parent handle


def received_and_sent(counters) -> tuple[int, int]:
    """Nvml.pcie_byte_counters' answer as (received, sent), in either form it has had: the
    agreed (rx_bytes, tx_bytes) pair or a dict of host_to_device_bytes/device_to_host_bytes."""
    if isinstance(counters, dict):
        return counters["host_to_device_bytes"], counters["device_to_host_bytes"]
    return counters[0], counters[1]


@pytest.mark.slow
def test_pcie_byte_counters_from_field_values(probes, version):
    report = probes(version)
    # RX (198) is what the GPU receives from the host; TX (197) what it sends.
    assert received_and_sent(reading(report, 0, "pcie_byte_counters")) == (
        L40S["fields"][FI_PCIE_RX_BYTES], L40S["fields"][FI_PCIE_TX_BYTES])
    assert reading(report, 1, "pcie_byte_counters") is None  # per-field NOT_SUPPORTED


@pytest.mark.slow
def test_process_names(probes, version):
    names = probes(version)["wrapper"]["process_names"]["value"]
    assert names["104242"] == "python3"
    assert names["104250"] == "tritonserver"


@pytest.mark.slow
def test_no_function_is_missing_from_the_oldest_allowed_binding(probes, version):
    lacking = [line for line in probes(version)["logs"] if "nvidia-ml-py" in line and " lacks " in line]
    assert lacking == []


# --- an old driver: no _v3 process entry points, no memory info v2 ---------------------------------
@pytest.mark.slow
def test_old_driver_lists_processes_through_v2(probes, version):
    report = probes(version, "old-driver")
    calls = report["calls_after_wrapper"]
    assert calls["nvmlDeviceGetComputeRunningProcesses_v3"] == 0  # the symbol is absent
    assert calls["nvmlDeviceGetComputeRunningProcesses_v2"] > 0
    listed = reading(report, 0, "processes")
    assert listed is not None, f"no processes without _v3 under {version}"
    assert {p["pid"]: p["used_memory_bytes"] for p in listed} == expected_processes(
        L40S, {"compute", "graphics", "mps"})


@pytest.mark.slow
def test_old_driver_memory_falls_back_to_v1(probes, version):
    report = probes(version, "old-driver")
    assert report["wrapper"]["memory_info_version"] == {"value": "v1"}
    # nvml.h: v1 `used` is the "Sum of Reserved and Allocated device memory"; no reserved.
    assert reading(report, 0, "memory_bytes") == [
        L40S["memory_used"] + L40S["memory_reserved"], L40S["memory_total"], None]


# --- the collector over the real binding ---------------------------------------------------------
def collected(report: dict) -> dict[tuple, float]:
    answer = report["collector"]
    assert "value" in answer, f"GpuCollector.collect() under {report['pynvml_version']}: {answer}"
    return {(name, tuple(labels)): value for name, labels, value in answer["value"]["samples"]}


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["current", "old-driver"])
def test_collector_exports_the_layout(probes, version, variant):
    samples = collected(probes(version, variant))
    gpu0 = ("0", L40S["uuid"])
    assert samples[(gpu_exporter.GPU_INFO.name, (*gpu0, L40S["name"], SYSFS_BUS_IDS[0],
                                                 "550.54.15"))] == 1
    assert samples[(gpu_exporter.PCIE_LINK_MAX_WIDTH.name, gpu0)] == 16
    assert samples[(gpu_exporter.PCIE_REPLAYS.name, gpu0)] == 3
    assert samples[(gpu_exporter.UTILIZATION.name, gpu0)] == pytest.approx(0.87)
    process_series = {labels[2]: value for (name, labels), value in samples.items()
                      if name == gpu_exporter.PROCESS_MEMORY_USED.name and labels[0] == "0"}
    assert process_series["104242"] == 30 * GIB
    assert process_series["104250"] == 1 * GIB + 3 * MIB
    assert "104243" not in process_series  # NVML cannot tell its memory
    # The GPU's NUMA node (whatever its metric is named now): only the GH200 has one.
    numa_spec = next(spec for spec in gpu_exporter.METRIC_SPECS if "numa" in spec.name)
    assert [key for key in samples if key[0] == numa_spec.name] == [
        (numa_spec.name, ("1", GH200["uuid"]))]
    assert samples[(numa_spec.name, ("1", GH200["uuid"]))] == 2


# --- what the floor excludes, shown over the real binding -----------------------------------------
@pytest.mark.slow
def test_a_binding_without_numa_node_id_still_collects(probes):
    """12.535.x has no nvmlDeviceGetNumaNodeId: unsupported and logged, the tick goes on."""
    report = probes(LACKS_NUMA_NODE_ID)
    assert reading(report, 1, "numa_node") is None
    assert any(f"nvidia-ml-py {LACKS_NUMA_NODE_ID} lacks nvmlDeviceGetNumaNodeId" in line
               for line in report["logs"])
    assert collected(report)[(gpu_exporter.GPU_UP.name, ("0", L40S["uuid"]))] == 1


# --- the builder and the stub's own input handling -------------------------------------------------
def test_a_warm_build_does_not_compile(monkeypatch):
    try:
        first = build.build_stub("current")
    except build.StubUnavailable as error:
        stub_unavailable(str(error))

    def no_compiling(*args, **kwargs):
        raise AssertionError(f"rebuilt although cached: {args}")
    monkeypatch.setattr(build.subprocess, "run", no_compiling)
    assert build.build_stub("current") == first


def test_the_cache_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert build.cache_root() == tmp_path / "hybridmon"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert build.cache_root() == Path.home() / ".cache" / "hybridmon"


@pytest.mark.slow
def test_a_bad_layout_line_fails_init_and_says_which(tmp_path, version):
    try:
        stub, binding = build.build_stub("current"), build.pynvml_dir(version)
    except build.StubUnavailable as error:
        stub_unavailable(str(error))
    layout = tmp_path / "layout.txt"
    layout.write_text("driver_version 550.54.15\ngpu\nname NVIDIA L40S\nlink_speed fast\n")
    env = {**os.environ, "LD_LIBRARY_PATH": str(stub), "HYBRIDMON_STUB_NVML_LAYOUT": str(layout),
           "PYTHONPATH": str(binding)}
    result = subprocess.run([sys.executable, "-c", "import pynvml; pynvml.nvmlInit()"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "line 4 not understood: link_speed fast" in result.stderr
    assert "NVMLError_Unknown" in result.stderr


# --- GPM, NVLink-C2C and field values that fail whole (issue 29) ---------------------------------
@pytest.mark.slow
def test_gpm_metrics_through_the_binding(probes, version):
    report = probes(version)
    assert reading(report, 1, "gpm_supported") is True
    assert reading(report, 0, "gpm_supported") is False  # isSupportedDevice 0 (an Ada L40S)
    first, second = report["wrapper"]["gpus"][1]["gpm_metrics"]
    assert first == {"value": None}  # one sample is no interval
    assert second["value"] == {str(metric): value for metric, value in GH200["gpm_metrics"].items()}
    assert report["wrapper"]["gpus"][0]["gpm_metrics"][1] == {"value": None}


@pytest.mark.slow
def test_gpm_and_c2c_structs_match_nvml_h(probes, version):
    gpm_request = probes(version)["abi"]["value"]["gpm_request"]
    assert gpm_request["pynvml"] == gpm_request["header"]


@pytest.mark.slow
def test_c2c_mode_and_links_through_the_binding(probes, version):
    report = probes(version)
    assert reading(report, 1, "c2c_mode_enabled") is True
    assert reading(report, 0, "c2c_mode_enabled") is None  # NOT_SUPPORTED: a PCIe host
    assert reading(report, 1, "c2c_links") == [
        {"link": 0, "up": True, "max_bytes_per_second": 45_000 * 10**6},
        {"link": 1, "up": False, "max_bytes_per_second": 44_000 * 10**6}]


@pytest.mark.slow
def test_collector_exports_c2c_and_the_traffic_method(probes, version):
    samples = collected(probes(version))
    gh200 = ("1", GH200["uuid"])
    assert samples[(gpu_exporter.C2C_MODE.name, gh200)] == 1
    assert samples[(gpu_exporter.C2C_LINKS.name, gh200)] == 2
    assert samples[(gpu_exporter.C2C_LINK_UP.name, (*gh200, "1"))] == 0
    assert samples[(gpu_exporter.PCIE_TRAFFIC_METHOD.name, ("0", L40S["uuid"], "counters"))] == 1
    assert samples[(gpu_exporter.PCIE_TRAFFIC_METHOD.name, (*gh200, "gpm"))] == 1


@pytest.fixture(scope="module")
def whole_call_failure(tmp_path_factory) -> dict:
    """The newest binding over a driver that fails nvmlDeviceGetFieldValues whole on the L40S,
    with the agent as root: the MIG A100's parent lists its instances' processes."""
    path = tmp_path_factory.mktemp("stub-nvml-fails") / "layout.txt"
    failing = {**L40S, "fail": {**L40S["fail"], "nvmlDeviceGetFieldValues": INVALID_ARGUMENT}}
    as_root = {**A100_MIG, "fail": {function: code for function, code in A100_MIG["fail"].items()
                                    if code != NO_PERMISSION}}
    build.write_layout(path, {**LAYOUT, "gpus": [failing, GH200, as_root]})
    return run_probe(build.NEWEST_NVIDIA_ML_PY, "current", path)


@pytest.mark.slow
def test_mig_instances_processes_as_root_carry_their_instance(whole_call_failure):
    report = whole_call_failure
    listed = reading(report, 2, "processes")
    # The stub puts every MIG process in instance 0 (stub_nvml.c); 0xFFFFFFFF would read as None.
    assert {(p["pid"], p["gpu_instance_id"]) for p in listed} == {
        (306001, 0), (306002, 0), (306003, 0)}
    samples = collected(report)
    a100 = ("2", A100_MIG["uuid"])
    assert samples[(gpu_exporter.INSTANCE_PROCESS_MEMORY_USED.name, (*a100, "0", "306001", "python3"))] == 10 * GIB
    assert samples[(gpu_exporter.PROCESS_MEMORY_USED.name, (*a100, "306002", "python3"))] == 5 * GIB


@pytest.mark.slow
def test_field_values_failing_whole_are_given_up_after_three_reads(whole_call_failure, probes):
    report = whole_call_failure
    assert reading(report, 0, "pcie_byte_counters") is None
    assert reading(report, 0, "pcie_byte_counters_usable_after_3_reads") is False
    assert any("gave no PCIe byte counters 3 times in a row" in line for line in report["logs"])
    # the same three reads where the call answers: the counters stay
    assert reading(probes(build.NEWEST_NVIDIA_ML_PY), 0,
                   "pcie_byte_counters_usable_after_3_reads") is True


# --- the 20 ms window, on the daemon benchmark's 8-GPU host (issue 33) ---------------------------
WINDOW_PROBE = """
import json, threading, time, pynvml
pynvml.nvmlInit()
count = pynvml.nvmlDeviceGetCount()
handle = pynvml.nvmlDeviceGetHandleByIndex(count - 1)
wall, cpu = time.perf_counter(), time.process_time()
for _ in range(5):
    rx = pynvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_RX_BYTES)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
woken, done = [0], threading.Event()
def other_thread():
    while not done.is_set():
        woken[0] += 1
        time.sleep(0.002)
thread = threading.Thread(target=other_thread)
thread.start()
time.sleep(0.005)
before = woken[0]
for _ in range(5):
    pynvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_RX_BYTES)
during = woken[0] - before
done.set(); thread.join()
print(json.dumps({"gpus": count, "rx": rx, "wall": wall, "cpu": cpu, "woken_during": during}))
"""


def probe_benchmark_host_over_stub(tmp_path, probe, byte_counters=False, **layout_options):
    """Run `probe` under the real binding over the stub describing the daemon benchmark's 8-GPU
    host (build.layout_from_fake); returns the fake layout and the probe's JSON report."""
    from tests.support.scaled_host import build_scaled_host

    try:
        stub, binding = build.build_stub("current"), build.pynvml_dir(build.NEWEST_NVIDIA_ML_PY)
    except build.StubUnavailable as error:
        stub_unavailable(str(error))
    fake_layout = json.loads(Path(build_scaled_host(tmp_path / "host").layout).read_text())
    for gpu in fake_layout["gpus"]:
        gpu["pcie_byte_counters"] = byte_counters
    layout = tmp_path / "stub.layout"
    build.write_layout(layout, build.layout_from_fake(fake_layout, **layout_options))
    assert ("pcie_counters_advance 1" in layout.read_text().splitlines()) == byte_counters
    env = {**os.environ, "LD_LIBRARY_PATH": str(stub), "HYBRIDMON_STUB_NVML_LAYOUT": str(layout),
           "PYTHONPATH": str(binding)}
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    return fake_layout, json.loads(result.stdout)


@pytest.mark.slow  # a subprocess: the real binding loads the stub (0.6-0.8 s)
def test_the_stub_blocks_its_20ms_window_on_8_gpus_asleep_and_without_the_gil(tmp_path):
    """build.layout_from_fake on the daemon benchmark's 8-GPU host, pcie_window_us 20000: each
    throughput call takes its window in nanosleep (wall >= 20 ms, next to no CPU), and ctypes has
    released the GIL so another Python thread runs meanwhile, as the benchmark's --nvml stub
    needs. The real driver's way of waiting is the assumption stub_nvml.c names."""
    fake_layout, report = probe_benchmark_host_over_stub(tmp_path, WINDOW_PROBE)
    assert report["gpus"] == len(fake_layout["gpus"]) == 8
    assert report["rx"] == fake_layout["gpus"][-1]["pcie_rx_kilobytes_per_second"]
    assert report["wall"] >= 5 * 0.020
    assert report["cpu"] < 0.2 * report["wall"]  # asleep, not spinning
    assert report["woken_during"] >= 10  # ~50 in the 100 ms: the GIL was free


COUNTER_PROBE = """
import json, time
import pynvml
pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
def read():
    tx, rx = pynvml.nvmlDeviceGetFieldValues(handle, [197, 198])
    assert tx.nvmlReturn == rx.nvmlReturn == 0, (tx.nvmlReturn, rx.nvmlReturn)
    return time.monotonic(), tx.value.ullVal, rx.value.ullVal
first = read(); time.sleep(0.3); last = read()
seconds = last[0] - first[0]
print(json.dumps({"tx": (last[1] - first[1]) / seconds, "rx": (last[2] - first[2]) / seconds}))
"""


@pytest.mark.slow  # a subprocess: the real binding loads the stub (0.6-0.8 s)
def test_the_stub_s_pcie_byte_counters_advance_at_the_layout_s_rates(tmp_path):
    """The daemon benchmark's counters path over the real binding (--nvml stub --pcie-path
    counters): layout_from_fake gives a GPU with byte counters (R555+) fields 197/198 that grow at
    its TX and RX rates, read through nvidia-ml-py's nvmlDeviceGetFieldValues."""
    fake_layout, rates = probe_benchmark_host_over_stub(tmp_path, COUNTER_PROBE, byte_counters=True,
                                                        pcie_window_us=0)
    gpu = fake_layout["gpus"][0]
    assert rates["tx"] == pytest.approx(gpu["pcie_tx_kilobytes_per_second"] * 1000, rel=0.05)
    assert rates["rx"] == pytest.approx(gpu["pcie_rx_kilobytes_per_second"] * 1000, rel=0.05)


def test_layout_from_fake_says_what_the_stub_cannot_do():
    gpu = {"uuid": "GPU-0", "pcie_duty": 0.5}
    with pytest.raises(ValueError, match="static PCIe values"):
        build.layout_from_fake({"gpus": [gpu]})
    with pytest.raises(ValueError, match="at most 8 GPUs"):
        build.layout_from_fake({"gpus": [gpu] * 9})
