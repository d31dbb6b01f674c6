"""exporters/gpu.py: the real collector and adapter driven by the fake NVML."""
from __future__ import annotations

import json
from dataclasses import replace
import os
import shutil
import subprocess
import time
import sys

import pytest

from hybridmon.exporters.sources import LiveSource, RecordingSource, ReplaySource
from hybridmon.exporters.base import NoDataError
from hybridmon.exporters.gpu import SLOW_READS_EVERY, GpuCollector
from tests.support import fake_nvml
from tests.support.paths import FIXTURES
from tests.support.fake_nvml import (FOREIGN_PID, GIB, MIB, UUID0, UUID1, XORG_PID, FakeClock,
                                     FakeNvml, FakeProcess, grace_hopper_gpu, mig_gpu,
                                     real_nvml_library_loads,
                                     uniform_gpus)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml()


@pytest.fixture
def collector(fake):
    collector = GpuCollector(LiveSource(), fake)
    yield collector
    collector.close()


def as_dict(samples) -> dict[tuple, float]:
    return {(s.spec.name, s.label_values): s.value for s in samples}


def gpu_series(samples, gpu: str) -> set[str]:
    return {s.spec.name for s in samples if s.label_values[0] == gpu}


# What a down GPU reports: that it is down, for how many collections in a row, and its blips.
DOWN_SERIES = {"hybridmon_gpu_up", "hybridmon_gpu_down_consecutive_readings", "hybridmon_gpu_down_blips_total"}


EXPECTED_GPU0 = {
    ("hybridmon_gpu_up", ("0", UUID0)): 1,
    ("hybridmon_gpu_down_consecutive_readings", ("0", UUID0)): 0,
    ("hybridmon_gpu_down_blips_total", ("0", UUID0)): 0,
    ("hybridmon_gpu_info", ("0", UUID0, "NVIDIA L40S", "0000:17:00.0", "550.54.15")): 1,
    ("hybridmon_gpu_memory_used_bytes", ("0", UUID0)): 31 * GIB,
    ("hybridmon_gpu_memory_total_bytes", ("0", UUID0)): 48 * GIB,
    ("hybridmon_gpu_memory_reserved_bytes", ("0", UUID0)): 512 * MIB,
    ("hybridmon_gpu_pcie_throughput_bytes_per_second", ("0", UUID0, "host_to_device")): 1_200_000 * 1024,
    ("hybridmon_gpu_pcie_throughput_bytes_per_second", ("0", UUID0, "device_to_host")): 300_000 * 1024,
    ("hybridmon_gpu_pcie_link_generation", ("0", UUID0)): 4,
    ("hybridmon_gpu_pcie_link_max_generation", ("0", UUID0)): 4,
    ("hybridmon_gpu_pcie_link_width_lanes", ("0", UUID0)): 16,
    ("hybridmon_gpu_pcie_link_max_width_lanes", ("0", UUID0)): 16,
    ("hybridmon_gpu_pcie_replays_total", ("0", UUID0)): 0,
    ("hybridmon_gpu_utilization_ratio", ("0", UUID0)): 0.87,
    # no hybridmon_gpu_numa_node: NOT_SUPPORTED on x86 hosts; no hybridmon_gpu_mig_mode: no MIG
    ("hybridmon_gpu_process_memory_used_bytes", ("0", UUID0, "4242", "python3")): 30 * GIB,
    ("hybridmon_gpu_process_memory_used_bytes", ("0", UUID0, str(XORG_PID), "Xorg")): 18 * MIB,
    # driver 550 has no PCIe byte counters (R555+) and the L40S no GPM: one window a tick
    ("hybridmon_gpu_pcie_traffic_method", ("0", UUID0, "sampled")): 1,
}
EXPECTED_GPU1 = {
    ("hybridmon_gpu_up", ("1", UUID1)): 1,
    ("hybridmon_gpu_down_consecutive_readings", ("1", UUID1)): 0,
    ("hybridmon_gpu_down_blips_total", ("1", UUID1)): 0,
    ("hybridmon_gpu_info", ("1", UUID1, "NVIDIA A10", "0000:ca:00.0", "550.54.15")): 1,
    ("hybridmon_gpu_memory_used_bytes", ("1", UUID1)): 11 * GIB,
    ("hybridmon_gpu_memory_total_bytes", ("1", UUID1)): 24 * GIB,
    ("hybridmon_gpu_memory_reserved_bytes", ("1", UUID1)): 384 * MIB,
    ("hybridmon_gpu_pcie_throughput_bytes_per_second", ("1", UUID1, "host_to_device")): 250_000 * 1024,
    ("hybridmon_gpu_pcie_throughput_bytes_per_second", ("1", UUID1, "device_to_host")): 80_000 * 1024,
    ("hybridmon_gpu_pcie_link_generation", ("1", UUID1)): 3,
    ("hybridmon_gpu_pcie_link_max_generation", ("1", UUID1)): 4,
    ("hybridmon_gpu_pcie_link_width_lanes", ("1", UUID1)): 8,
    ("hybridmon_gpu_pcie_link_max_width_lanes", ("1", UUID1)): 16,
    ("hybridmon_gpu_pcie_replays_total", ("1", UUID1)): 17,
    ("hybridmon_gpu_utilization_ratio", ("1", UUID1)): 0.35,
    ("hybridmon_gpu_process_memory_used_bytes", ("1", UUID1, "5151", "llama-server")): 10 * GIB,
    ("hybridmon_gpu_process_memory_used_bytes", ("1", UUID1, str(XORG_PID), "Xorg")): 12 * MIB,
    ("hybridmon_gpu_pcie_traffic_method", ("1", UUID1, "sampled")): 1,
}


def test_collect_exact_samples(collector):
    for _ in range(2):  # the second tick reads cached identity and must not differ
        assert as_dict(collector.collect()) == {**EXPECTED_GPU0, **EXPECTED_GPU1}
    assert collector.gpu_processes() == {4242: "python3", 5151: "llama-server", XORG_PID: "Xorg"}


def test_each_gpu_process_comes_with_the_pci_bus_ids_of_its_gpus(fake, collector):
    # what process_numa judges a process against: the NUMA node of each of its GPUs' PCI devices
    collector.collect()
    assert collector.gpu_buses_of_processes() == {4242: ("0000:17:00.0",), 5151: ("0000:ca:00.0",),
                                                  XORG_PID: ("0000:17:00.0", "0000:ca:00.0")}
    fake.lose_gpu(1)
    collector.collect()
    assert collector.gpu_buses_of_processes() == {4242: ("0000:17:00.0",), XORG_PID: ("0000:17:00.0",)}


def test_process_lists_link_state_and_replays_are_asked_every_5th_read(fake, collector):
    # SLOW_READS_EVERY: six of the nine calls of a read, where what judges them looks at minutes
    def asked(function: str) -> int:
        return fake.calls[function]

    collector.collect()
    slow_calls = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v3",
                  "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkWidth",
                  "nvmlDeviceGetPcieReplayCounter")
    before = {function: asked(function) for function in (*slow_calls, "nvmlDeviceGetMemoryInfo_v2",
                                                         "nvmlDeviceGetUtilizationRates")}
    for _ in range(SLOW_READS_EVERY):
        collector.collect()
    asked_since = {function: asked(function) - count for function, count in before.items()}
    # of these reads of the 2 GPUs, only the last was slow; memory and utilization every time
    assert asked_since == {**{function: 2 for function in slow_calls},
                           "nvmlDeviceGetMemoryInfo_v2": 2 * SLOW_READS_EVERY,
                           "nvmlDeviceGetUtilizationRates": 2 * SLOW_READS_EVERY}


def test_a_process_that_starts_or_exits_is_listed_at_the_read_that_sees_its_memory(fake, collector):
    # its CUDA context and buffers move the GPU's used memory: the lists are asked again then, so
    # the processes given always add up against the memory read with them
    collector.collect()
    fake.gpus[0].processes.append(FakeProcess(6001, "python3", 2 * GIB))  # a server starts
    fake.gpus[0].memory_used_bytes += 2 * GIB
    samples = collector.collect()
    assert 6001 in collector.gpu_processes()
    assert samples.value("hybridmon_gpu_process_memory_used_bytes", gpu="0", pid="6001") == 2 * GIB
    fake.gpus[0].processes.pop()   # and exits
    fake.gpus[0].memory_used_bytes -= 2 * GIB
    samples = collector.collect()
    assert 6001 not in collector.gpu_processes()
    assert samples.find("hybridmon_gpu_process_memory_used_bytes", gpu="0", pid="6001") == []


def test_a_gpu_back_from_lost_is_asked_its_slow_answers_at_once(fake, collector):
    collector.collect()
    fake.lose_gpu(1)
    collector.collect()
    fake.gpus[1].processes.append(FakeProcess(6002, "python3", GIB))
    fake.restore_gpu(1)
    collector.collect()
    assert 6002 in collector.gpu_processes()


def test_metric_specs_declare_every_family(fake):
    fake.gpus[1].numa_node = 1  # as on a platform where GPU memory is a NUMA node
    fake.gpus.append(mig_gpu())
    fake.configure(privileged=True)  # root: the MIG instances' processes are listed
    fake.gpus.append(grace_hopper_gpu())  # C2C, and GPM for its PCIe traffic
    fake.gpus[0].pcie_byte_counters = True  # counted; the others (driver 550) are sampled
    collector = GpuCollector(LiveSource(), fake, pcie_samples_per_second=10)
    names = {spec.name for spec in GpuCollector.metric_specs}
    try:
        collector.collect()
        time.sleep(0.11)  # GPM needs two samples over 100 ms apart (nvml.h) for C2C traffic
        assert {s.spec.name for s in collector.collect()} == names
    finally:
        collector.close()
    assert collector.name == "gpu" and collector.default_interval_seconds == 1.0


def test_unsupported_call_leaves_only_its_series_out(fake, collector):
    fake.fail("nvmlDeviceGetMaxPcieLinkWidth", "NVMLError_NotSupported")
    fake.fail("nvmlDeviceGetPcieReplayCounter", "NVMLError_FunctionNotFound", gpu=1)
    samples = as_dict(collector.collect())
    expected = {**EXPECTED_GPU0, **EXPECTED_GPU1}
    for key in [("hybridmon_gpu_pcie_link_max_width_lanes", ("0", UUID0)),
                ("hybridmon_gpu_pcie_link_max_width_lanes", ("1", UUID1)),
                ("hybridmon_gpu_pcie_replays_total", ("1", UUID1))]:
        del expected[key]
    assert samples == expected


def test_memory_v1_fallback_drops_reserved(fake, collector):
    fake.configure(memory_v2_supported=False)
    for _ in range(3):
        samples = collector.collect()
    assert samples.value("hybridmon_gpu_memory_used_bytes", gpu="0") == 31 * GIB + 512 * MIB
    assert samples.find("hybridmon_gpu_memory_reserved_bytes") == []
    assert fake.calls["nvmlDeviceGetMemoryInfo_v2"] == 1


def test_gpu_lost_mid_run_keeps_only_up_and_others_continue(fake, collector):
    collector.collect()
    fake.lose_gpu(1)
    samples = collector.collect()
    assert samples.value("hybridmon_gpu_up", gpu="1", uuid=UUID1) == 0
    assert gpu_series(samples, "1") == DOWN_SERIES
    assert {k: v for k, v in as_dict(samples).items() if k[1][0] == "0"} == EXPECTED_GPU0
    assert collector.gpu_processes() == {4242: "python3", XORG_PID: "Xorg"}
    fake.restore_gpu(1)
    fake.fail("*", "NVMLError_Unknown", gpu=1, times=1)  # NVML's answer right after a loss
    samples = collector.collect()
    assert gpu_series(samples, "1") == DOWN_SERIES
    assert samples.value("hybridmon_gpu_down_consecutive_readings", gpu="1") == 2
    # down at two collections: a loss, not a blip
    assert as_dict(collector.collect()) == {**EXPECTED_GPU0, **EXPECTED_GPU1}


def test_gpu_down_readings_count_a_loss_and_a_blip_apart(fake, collector, caplog):
    """Issue 28: one collection of GPU_IS_LOST that does not hold is a blip (counted, logged once
    as such); a GPU lost at three collections in a row counts 1, 2, 3 and no blip when it is
    reset, since it was lost. The count is what GpuLost's confirmation reads."""
    def down(samples, gpu: str) -> tuple[float, float]:
        return (samples.value("hybridmon_gpu_down_consecutive_readings", gpu=gpu),
                samples.value("hybridmon_gpu_down_blips_total", gpu=gpu))

    collector.collect()
    fake.lose_gpu(1)
    assert down(collector.collect(), "1") == (1, 0)
    fake.restore_gpu(1)
    with caplog.at_level("WARNING", logger="hybridmon.exporters.gpu"):
        assert down(collector.collect(), "1") == (0, 1)
    assert [r.getMessage() for r in caplog.records if r.name == "hybridmon.exporters.gpu"] == [
        "GPU 1 was down for one collection only (NVML answered lost, or nothing) and answers "
        "again: a reading that did not hold, not paged as GpuLost; counted in "
        "hybridmon_gpu_down_blips_total"]
    fake.lose_gpu(1)
    assert [down(collector.collect(), "1") for _ in range(3)] == [(1, 1), (2, 1), (3, 1)]
    fake.restore_gpu(1)
    assert down(collector.collect(), "1") == (0, 1)
    assert down(collector.collect(), "0") == (0, 0)


def test_gpu_that_answers_nothing_is_down(fake, collector):
    collector.collect()
    fake.fail("*", "NVMLError_DriverNotLoaded")  # the driver unloaded under the running agent
    samples = collector.collect()
    assert as_dict(samples) == {(name, (gpu, uuid)): 1 if "consecutive" in name else 0
                                for gpu, uuid in (("0", UUID0), ("1", UUID1)) for name in DOWN_SERIES}
    assert collector.gpu_processes() == {}
    fake.heal()
    # down at one collection only: each GPU counts a blip
    blips = {("hybridmon_gpu_down_blips_total", (gpu, uuid)): 1 for gpu, uuid in (("0", UUID0), ("1", UUID1))}
    assert as_dict(collector.collect()) == {**EXPECTED_GPU0, **EXPECTED_GPU1, **blips}


def test_gpu_up_with_one_gpu_silent_and_the_other_answering(fake, collector):
    collector.collect()
    fake.fail("*", "NVMLError_Unknown", gpu=1)
    samples = collector.collect()
    assert gpu_series(samples, "1") == DOWN_SERIES
    assert samples.value("hybridmon_gpu_up", gpu="1") == 0
    assert {k: v for k, v in as_dict(samples).items() if k[1][0] == "0"} == EXPECTED_GPU0


def test_gpu_lost_before_its_uuid_was_read(fake, collector):
    fake.lose_gpu(0)
    samples = collector.collect()
    assert samples.value("hybridmon_gpu_up", gpu="0", uuid="") == 0
    assert gpu_series(samples, "0") == DOWN_SERIES
    assert samples.value("hybridmon_gpu_up", gpu="1", uuid=UUID1) == 1


def test_timeout_is_absent_this_tick_then_back(fake, collector):
    fake.fail("nvmlDeviceGetPcieThroughput", "NVMLError_Timeout", gpu=0, times=2)
    samples = collector.collect()
    assert samples.find("hybridmon_gpu_pcie_throughput_bytes_per_second", gpu="0") == []
    assert len(samples.find("hybridmon_gpu_pcie_throughput_bytes_per_second", gpu="1")) == 2
    assert as_dict(collector.collect()) == {**EXPECTED_GPU0, **EXPECTED_GPU1}


def test_process_memory_unknown_or_split_across_instances(fake, collector):
    fake.gpus[0].processes = [FakeProcess(4242, "python3", None)]
    fake.gpus[1].processes = [FakeProcess(5151, "llama-server", 4 * GIB, gpu_instance_id=1),
                              FakeProcess(5151, "llama-server", 6 * GIB, gpu_instance_id=2)]
    samples = collector.collect()
    assert samples.find("hybridmon_gpu_process_memory_used_bytes", gpu="0") == []
    assert samples.value("hybridmon_gpu_process_memory_used_bytes", gpu="1", pid="5151") == 10 * GIB
    assert collector.gpu_processes() == {4242: "python3", 5151: "llama-server"}


def test_library_missing_then_installed(fake):
    fake.configure(library_missing=True)
    clock = FakeClock()
    collector = GpuCollector(LiveSource(), fake, clock=clock)
    with pytest.raises(NoDataError, match="install the NVIDIA driver"):
        collector.collect()
    fake.configure(library_missing=False)
    clock.now += 30
    with pytest.raises(NoDataError):
        collector.collect()
    clock.now += 30
    assert as_dict(collector.collect()) == {**EXPECTED_GPU0, **EXPECTED_GPU1}
    assert fake.calls["nvmlInit"] == 2
    collector.close()


def test_no_gpus_is_no_data(fake, collector):
    fake.configure(gpus=[])
    with pytest.raises(NoDataError, match="no NVIDIA GPU"):
        collector.collect()


def test_real_pynvml_on_this_host():
    collector = GpuCollector(LiveSource())  # the real pynvml and whatever driver this host has
    try:
        if not real_nvml_library_loads():
            with pytest.raises(NoDataError, match=r"libnvidia-ml\.so\.1 could not be loaded"):
                collector.collect()
            return
        try:
            samples = collector.collect()
        except NoDataError as error:  # driver installed but its kernel module not loaded, or no GPU
            assert "kernel module is not running" in str(error) or "no NVIDIA GPU" in str(error)
            return
        up = samples.find("hybridmon_gpu_up")
        assert up and all(sample.value == 1 for sample in up)
        for sample in up:
            gpu, uuid = sample.label_values
            assert uuid.startswith("GPU-")
            assert samples.value("hybridmon_gpu_memory_total_bytes", gpu=gpu) > 0
            assert len(samples.find("hybridmon_gpu_info", gpu=gpu)) == 1
    finally:
        collector.close()


def test_gpus_are_read_concurrently():
    # Structural, not timed: throughput calls (which block ~40 ms per GPU in real NVML) of
    # different GPUs overlap with the default pool and never with one worker.
    for max_workers, overlap in ((8, True), (1, False)):
        fake = FakeNvml(uniform_gpus(8), throughput_delay_seconds=0.01)
        collector = GpuCollector(LiveSource(), fake, max_workers=max_workers)
        try:
            assert len(collector.collect().find("hybridmon_gpu_up")) == 8
        finally:
            collector.close()
        assert fake.calls["nvmlDeviceGetPcieThroughput"] == 16
        if overlap:
            assert fake.max_throughput_in_flight > 1
        else:
            assert fake.max_throughput_in_flight == 1


def test_a_gpu_whose_call_hangs_leaves_the_others_on_time(caplog):
    fake = FakeNvml(uniform_gpus(4))
    fake.hang("nvmlDeviceGetMemoryInfo_v2", gpu=2, seconds=1.5)  # e.g. a GPU falling off the bus
    recording = RecordingSource()
    collector = GpuCollector(recording, fake, read_budget_seconds=0.4)
    ticks = []
    try:
        started = time.monotonic()
        first = collector.collect()
        took = time.monotonic() - started
        ticks.append((sorted(as_dict(first).items()), recording.take_readings()))
        second = collector.collect()  # GPU 2's read still hangs: it is not asked again
        ticks.append((sorted(as_dict(second).items()), recording.take_readings()))
    finally:
        fake.hang("nvmlDeviceGetMemoryInfo_v2", gpu=2, seconds=0)
        collector.close()
    assert took < 1.0  # the budget, not the hang
    for samples in (first, second):
        assert [samples.value("hybridmon_gpu_up", gpu=gpu) for gpu in "013"] == [1, 1, 1]
        assert samples.value("hybridmon_gpu_memory_used_bytes", gpu="3") == 20 * GIB
    # Late once: no series (a slow read is not a GPU down); still reading at the next: down.
    assert gpu_series(first, "2") == set()
    assert gpu_series(second, "2") == DOWN_SERIES
    assert second.value("hybridmon_gpu_up", gpu="2") == 0
    assert second.value("hybridmon_gpu_down_consecutive_readings", gpu="2") == 1
    # the v2 probe on GPU 0, then four GPUs, then three: GPU 2 asked on the first tick only
    assert fake.calls["nvmlDeviceGetMemoryInfo_v2"] == 1 + 4 + 3
    assert caplog.text.count("GPU 2: its NVML reads took longer than 0.4 s (read budget): its "
                             "series are absent from this collection") == 1
    # A replay leaves out the same GPU, without waiting.
    source = ReplaySource()
    replay = GpuCollector(source, None)
    for outcome, readings in ticks:
        source.load(json.loads(json.dumps(readings)))
        assert sorted(as_dict(replay.collect()).items()) == outcome


def test_close_stops_the_pool_and_nvml(fake, collector):
    collector.collect()
    pool = collector._pool
    collector.close()
    assert pool.shut_down and fake.calls["nvmlShutdown"] == 1


def round_trip(fake: FakeNvml, steps) -> None:
    """Record each tick through RecordingSource, then replay the JSON trace with no NVML module."""
    recording = RecordingSource()
    live = GpuCollector(recording, fake)
    recorded = []
    for step in steps:
        step(fake)
        try:
            outcome = sorted(as_dict(live.collect()).items())
        except NoDataError as error:
            outcome = str(error)
        recorded.append((outcome, json.loads(json.dumps(recording.take_readings()))))
    live.close()
    source = ReplaySource()
    replay = GpuCollector(source, None)
    for outcome, readings in recorded:
        source.load(readings)
        try:
            assert sorted(as_dict(replay.collect()).items()) == outcome
        except NoDataError as error:
            assert str(error) == outcome
    replay.close()


def test_record_replay_round_trip_with_lost_gpu_and_failures(fake):
    round_trip(fake, [
        lambda f: None,
        lambda f: f.lose_gpu(1),
        lambda f: (f.restore_gpu(1),
                   f.fail("nvmlDeviceGetPcieThroughput", "NVMLError_Timeout", gpu=0, times=1)),
        lambda f: f.fail("nvmlDeviceGetNumaNodeId", "NVMLError_NotSupported"),
        lambda f: f.gpus[1].processes.append(FakeProcess(77, "vllm", None)),
        lambda f: f.fail("*", "NVMLError_DriverNotLoaded"),
        lambda f: f.heal(),
    ])


def test_record_replay_round_trip_v1_and_missing_library():
    round_trip(FakeNvml(memory_v2_supported=False), [lambda f: None, lambda f: None])
    round_trip(FakeNvml(library_missing=True), [lambda f: None, lambda f: None])


@pytest.mark.slow
def test_module_by_dotted_name_and_layout_from_environment(tmp_path):
    try:
        collector = GpuCollector(LiveSource(), "tests.support.fake_nvml")
        assert as_dict(collector.collect()) == {**EXPECTED_GPU0, **EXPECTED_GPU1}
        collector.close()
    finally:
        fake_nvml.reset()
    layout = tmp_path / "layout.json"
    FakeNvml(uniform_gpus(8), driver_version="560.35.03").dump_layout(str(layout))
    script = ("from hybridmon.exporters.sources import LiveSource; from hybridmon.exporters.gpu import GpuCollector; "
              "s = GpuCollector(LiveSource(), 'tests.support.fake_nvml').collect(); "
              "print(len(s.find('hybridmon_gpu_up')), s.find('hybridmon_gpu_info')[0].label_values[4])")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "HYBRIDMON_FAKE_NVML_LAYOUT": str(layout)}, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["8", "560.35.03"]


# --- real pynvml, with libnvidia-ml.so.1 simulated by ctypes callbacks ----------------------------
def simulated_libnvml(pynvml):
    """C entry points as pynvml calls them, so its real wrappers, structs and errors run here."""
    from ctypes import CFUNCTYPE, POINTER, c_char, c_int, c_uint, c_void_p, cast, memmove

    device_t = pynvml.c_nvmlDevice_t
    memory = {0: (48 * GIB, 512 * MIB, 31 * GIB), 1: (24 * GIB, 384 * MIB, 11 * GIB)}

    def index(device) -> int:
        return cast(device, c_void_p).value - 0x1000

    def text(value: str):
        def write(buffer, size):
            memmove(buffer, value.encode() + b"\0", min(len(value) + 1, size))
            return 0
        return write

    def per_gpu(values, c_type=c_uint):
        def read(device, out):
            out[0] = values[index(device)]
            return 0
        return CFUNCTYPE(c_int, device_t, POINTER(c_type))(read)

    def handle(i, out):
        out[0] = cast(c_void_p(0x1000 + i), device_t)
        return 0

    def pci(device, out):
        out[0].busId = [b"00000000:17:00.0", b"00000000:CA:00.0"][index(device)]
        return 0

    def memory_v2(device, out):
        total, reserved, used = memory[index(device)]
        out[0].total, out[0].reserved, out[0].used = total, reserved, used
        out[0].free = total - reserved - used
        return 0

    def throughput(device, counter, out):
        rx = counter == pynvml.NVML_PCIE_UTIL_RX_BYTES
        out[0] = (1_200_000 if rx else 300_000) >> index(device)
        return 0

    def utilization(device, out):
        out[0].gpu = (87, 35)[index(device)]
        return 0

    def processes(device, count, infos):
        if not infos:
            count[0] = 1
            return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        count[0] = 1
        infos[0].pid = (4242, 5151)[index(device)]
        not_available = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
        infos[0].usedGpuMemory = (30 * GIB, not_available)[index(device)]
        return 0

    def process_name(pid, buffer, size):
        return text({4242: "python3", 5151: "llama-server"}[pid])(buffer, size)

    string_out = CFUNCTYPE(c_int, POINTER(c_char), c_uint)
    by_device_string = CFUNCTYPE(c_int, device_t, POINTER(c_char), c_uint)
    uuids = ["GPU-0a1b2c3d-0000-4000-8000-000000000000", "GPU-1a1b2c3d-0000-4000-8000-000000000001"]
    names = ["NVIDIA L40S", "NVIDIA A10"]
    return type("SimulatedLibNvml", (), {
        "nvmlInitWithFlags": CFUNCTYPE(c_int, c_uint)(lambda flags: 0),
        "nvmlShutdown": CFUNCTYPE(c_int)(lambda: 0),
        "nvmlDeviceGetCount_v2": CFUNCTYPE(c_int, POINTER(c_uint))(lambda out: out.__setitem__(0, 2) or 0),
        "nvmlSystemGetDriverVersion": string_out(text("550.54.15")),
        "nvmlDeviceGetHandleByIndex_v2": CFUNCTYPE(c_int, c_uint, POINTER(device_t))(handle),
        "nvmlDeviceGetUUID": by_device_string(lambda d, b, s: text(uuids[index(d)])(b, s)),
        "nvmlDeviceGetName": by_device_string(lambda d, b, s: text(names[index(d)])(b, s)),
        "nvmlDeviceGetPciInfo_v3": CFUNCTYPE(c_int, device_t, POINTER(pynvml.nvmlPciInfo_t))(pci),
        "nvmlDeviceGetMemoryInfo_v2": CFUNCTYPE(
            c_int, device_t, POINTER(pynvml.c_nvmlMemory_v2_t))(memory_v2),
        "nvmlDeviceGetPcieThroughput": CFUNCTYPE(c_int, device_t, c_uint, POINTER(c_uint))(throughput),
        "nvmlDeviceGetCurrPcieLinkGeneration": per_gpu([4, 3]),
        "nvmlDeviceGetCurrPcieLinkWidth": per_gpu([16, 8]),
        "nvmlDeviceGetMaxPcieLinkGeneration": per_gpu([4, 4]),
        "nvmlDeviceGetMaxPcieLinkWidth": per_gpu([16, 16]),
        "nvmlDeviceGetPcieReplayCounter": per_gpu([0, 17]),
        "nvmlDeviceGetUtilizationRates": CFUNCTYPE(
            c_int, device_t, POINTER(pynvml.c_nvmlUtilization_t))(utilization),
        "nvmlDeviceGetNumaNodeId": CFUNCTYPE(c_int, device_t, POINTER(c_int))(
            lambda device, out: pynvml.NVML_ERROR_NOT_SUPPORTED),
        "nvmlDeviceGetComputeRunningProcesses_v3": CFUNCTYPE(
            c_int, device_t, POINTER(c_uint), POINTER(pynvml.c_nvmlProcessInfo_v3_t))(processes),
        "nvmlSystemGetProcessName": CFUNCTYPE(c_int, c_uint, POINTER(c_char), c_uint)(process_name),
    })()


def test_real_pynvml_wrappers_against_a_simulated_library(monkeypatch):
    import pynvml

    monkeypatch.setattr(pynvml, "nvmlLib", simulated_libnvml(pynvml))
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    recording = RecordingSource()
    collector = GpuCollector(recording, "pynvml")
    samples = as_dict(collector.collect())
    collector.close()
    expected = {**EXPECTED_GPU0, **EXPECTED_GPU1}
    # The library answers NumaNodeId NOT_SUPPORTED, lacks MigMode and the graphics/MPS lists.
    for gpu, uuid in (("0", UUID0), ("1", UUID1)):
        del expected[("hybridmon_gpu_process_memory_used_bytes", (gpu, uuid, str(XORG_PID), "Xorg"))]
    del expected[("hybridmon_gpu_process_memory_used_bytes", ("1", UUID1, "5151", "llama-server"))]
    # RX_BYTES (what the GPU receives) is host to device; GPU1 answers half of GPU0.
    for direction, kilobytes in (("host_to_device", 600_000), ("device_to_host", 150_000)):
        key = ("hybridmon_gpu_pcie_throughput_bytes_per_second", ("1", UUID1, direction))
        expected[key] = kilobytes * 1024
    assert samples == expected
    assert collector.gpu_processes() == {4242: "python3", 5151: "llama-server"}
    readings = json.loads(json.dumps(recording.take_readings()))  # what pynvml gave is plain data
    assert ["call", "nvml.nvmlDeviceGetNumaNodeId(0)", False,
            {"type": "NVMLError_NotSupported", "detail": 3}] in readings
    replay_source = ReplaySource()
    replay_source.load(readings)
    assert as_dict(GpuCollector(replay_source, None).collect()) == samples


# --- NVML as real hosts answer it (issue 13) --------------------------------------------------------
def test_mig_gpu_exports_its_mode_and_leaves_per_instance_signals_out(caplog):
    fake = FakeNvml([mig_gpu()])  # not root: the parent refuses its instances' process lists
    collector = GpuCollector(LiveSource(), fake)
    try:
        for _ in range(2):
            samples = collector.collect()
    finally:
        collector.close()
    assert samples.value("hybridmon_gpu_mig_mode", gpu="0") == 1
    assert samples.find("hybridmon_gpu_utilization_ratio") == []
    assert samples.find("hybridmon_gpu_process_memory_used_bytes") == []
    assert samples.value("hybridmon_gpu_up", gpu="0") == 1
    assert samples.value("hybridmon_gpu_memory_used_bytes", gpu="0") == 30 * GIB
    assert len(samples.find("hybridmon_gpu_pcie_throughput_bytes_per_second", gpu="0")) == 2
    # Utilization is not asked; each process list once (NO_PERMISSION does not change while the
    # agent runs), and the reason is said once.
    assert fake.calls["nvmlDeviceGetUtilizationRates"] == 0
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses_v3"] == 1
    assert fake.calls["nvmlDeviceGetMigMode"] == 1
    assert caplog.text.count("GPU 0 has MIG enabled and NVML lists its instances' processes only "
                             "to root") == 1


def test_mig_instances_processes_are_read_as_root():
    fake = FakeNvml([mig_gpu()], privileged=True)
    fake.gpus[0].processes.append(FakeProcess(6161, "python3", 1 * GIB, gpu_instance_id=2))
    collector = GpuCollector(LiveSource(), fake)
    try:
        samples = collector.collect()
    finally:
        collector.close()
    # Each instance's process, from the parent's list; a pid in two instances summed per GPU.
    assert samples.value("hybridmon_gpu_process_memory_used_bytes", gpu="0", pid="6161") == 21 * GIB
    assert samples.value("hybridmon_gpu_process_memory_used_bytes", gpu="0", pid="6262") == 9 * GIB
    # and per instance, with its gpuInstanceId
    per_instance = {(s.label_values[2], s.label_values[3]): s.value
                    for s in samples.find("hybridmon_gpu_instance_process_memory_used_bytes")}
    assert per_instance == {("1", "6161"): 20 * GIB, ("2", "6161"): 1 * GIB, ("2", "6262"): 9 * GIB}
    assert collector.gpu_processes() == {6161: "python3", 6262: "python3"}


def test_mig_disabled_is_zero_and_changes_nothing_else(fake, collector):
    fake.gpus[0].mig_mode = fake_nvml.NVML_DEVICE_MIG_DISABLE
    assert as_dict(collector.collect()) == {
        **EXPECTED_GPU0, **EXPECTED_GPU1, ("hybridmon_gpu_mig_mode", ("0", UUID0)): 0}


def test_graphics_only_and_foreign_processes_are_exported(fake, collector):
    # llama.cpp on Vulkan is only in the graphics list; a pid from another pid namespace has no
    # name NVML can find here, so it is named by its pid.
    fake.gpus[1].processes = [FakeProcess(5151, "llama-server", 6 * GIB, ("graphics",)),
                              FakeProcess(FOREIGN_PID, None, 2 * GIB)]
    samples = collector.collect()
    assert samples.value("hybridmon_gpu_process_memory_used_bytes", gpu="1", pid="5151",
                         process_name="llama-server") == 6 * GIB
    assert samples.value("hybridmon_gpu_process_memory_used_bytes", gpu="1", pid=str(FOREIGN_PID),
                         process_name=str(FOREIGN_PID)) == 2 * GIB
    assert {5151, FOREIGN_PID} <= set(collector.gpu_processes())


def test_processes_on_a_driver_without_the_v3_entry_points():
    # The old adapter called the unversioned wrapper, which pynvml turns into
    # NVMLLibraryMismatchError there: processes vanished for good although _v2 works.
    fake = FakeNvml(process_entry_points=("v2",))
    collector = GpuCollector(LiveSource(), fake)
    try:
        for _ in range(2):
            assert as_dict(collector.collect()) == {**EXPECTED_GPU0, **EXPECTED_GPU1}
    finally:
        collector.close()


def test_an_idle_gpu_reports_its_link_at_gen1(fake, collector):
    fake.gpus[0].utilization_percent = 0
    fake.gpus[0].pcie_rx_kilobytes_per_second = fake.gpus[0].pcie_tx_kilobytes_per_second = 0
    samples = collector.collect()
    assert samples.value("hybridmon_gpu_pcie_link_generation", gpu="0") == 1
    assert samples.value("hybridmon_gpu_pcie_link_max_generation", gpu="0") == 4
    assert samples.value("hybridmon_gpu_pcie_link_generation", gpu="1") == 3  # busy: as trained


def test_record_replay_round_trip_mig_old_driver_and_old_binding():
    fake = FakeNvml([*fake_nvml.default_gpus(), mig_gpu()], process_entry_points=("v2",),
                    binding_lacks=("nvmlDeviceGetNumaNodeId",))
    round_trip(fake, [lambda f: None, lambda f: None,
                      lambda f: f.gpus[1].processes.append(FakeProcess(FOREIGN_PID, None, GIB))])


def gpu_process_names(samples) -> dict[str, str]:
    return {s.label_values[2]: s.label_values[3]
            for s in samples.find("hybridmon_gpu_process_memory_used_bytes")}


def test_a_gpu_process_is_named_by_its_comm_as_every_process_series_is(fake, fixture_procfs, tmp_path):
    """NVML names a process by its executable path (nvidia-smi's process table shows the same,
    e.g. /usr/bin/python3); the process collector and every process alert by comm. One pid, one
    name: the GPU series takes comm where /proc has it (issue 14, item 6)."""
    fake.gpus[0].processes[0].name = "/usr/bin/python3"
    fake.gpus[1].processes[0].name = "/opt/llama.cpp/build/bin/llama-server"
    named = GpuCollector(LiveSource(), fake, procfs=fixture_procfs).collect()
    # Xorg (pid 2101) is not in the fixture's /proc: NVML's name stays
    assert gpu_process_names(named) == {"4242": "python3", "5151": "llama-server", str(XORG_PID): "Xorg"}
    # a container's own pid namespace: NVML's host pids are not looked up in it
    container = tmp_path / "proc"
    (container / "self" / "ns").mkdir(parents=True)
    (container / "self" / "status").write_text("NSpid:\t7\n")
    os.symlink("pid:[4026532511]", container / "self" / "ns" / "pid")
    (container / "4242").mkdir()
    (container / "4242" / "comm").write_text("unrelated\n")
    unnamed = GpuCollector(LiveSource(), fake, procfs=str(container)).collect()
    assert gpu_process_names(unnamed)["4242"] == "/usr/bin/python3"
    # an outer container's procfs seen from a nested one (a kind node's /proc in a pod): the same
    nested = tmp_path / "nested"
    shutil.copytree(FIXTURES / "pid-namespaces" / "kind-node-mounted-in-pod" / "proc", nested, symlinks=True)
    (nested / "4242").mkdir()
    (nested / "4242" / "comm").write_text("unrelated\n")
    unnamed = GpuCollector(LiveSource(), fake, procfs=str(nested)).collect()
    assert gpu_process_names(unnamed)["4242"] == "/usr/bin/python3"


def test_names_the_process_collector_read_are_not_read_again(fake, fixture_procfs):
    """The process collector reads /proc/<pid>/stat, comm included, every tick for the same pids:
    what it read names the GPU series, and only a pid it does not watch is read from
    /proc/<pid>/comm. Through the source: a replay gets the recorded names, and a trace recorded
    before they were shared (no such reading) falls back to the comm files it holds."""
    fake.gpus[0].processes[0].name = "/usr/bin/python3"
    fake.gpus[1].processes[0].name = "/opt/llama.cpp/build/bin/llama-server"
    recording = RecordingSource(LiveSource())
    collector = GpuCollector(recording, fake, procfs=fixture_procfs)
    collector.share_process_names(lambda: {4242: "from-stat"})
    samples = collector.collect()
    readings = recording.take_readings()
    comm_reads = [path for kind, path, *_ in readings if kind == "text" and path.endswith("/comm")]
    assert sorted(comm_reads) == [os.path.join(fixture_procfs, pid, "comm") for pid in (str(XORG_PID), "5151")]
    assert gpu_process_names(samples) == {"4242": "from-stat", "5151": "llama-server", str(XORG_PID): "Xorg"}

    replay = ReplaySource()
    replayer = GpuCollector(replay, None, procfs=fixture_procfs)
    replayer.share_process_names(lambda: {4242: "never asked in a replay"})
    replay.load(readings)
    assert gpu_process_names(replayer.collect()) == gpu_process_names(samples)
    old_trace = [r for r in readings if r[:2] != ["call", "agent.watched_processes"]]
    replay.load(old_trace + [["text", os.path.join(fixture_procfs, "4242", "comm"), True, "python3\n"]])
    assert gpu_process_names(replayer.collect())["4242"] == "python3"


@pytest.mark.parametrize("counters, samples_per_second, pooled", [
    (True, 0, [1, 0, 0]), (False, 10, [1, 1, 0]), (False, 0, [1, 1, 1])])
def test_gpus_are_read_one_after_the_other_once_none_waits_on_a_window(counters, samples_per_second, pooled):
    """Issue 17: the pool pays for itself only while reads wait on 20 ms throughput windows. With
    byte counters only the first tick reads a window (no interval yet); with sampler threads the
    first tick too (no sample yet), and the pool stays until a tick has read samples. Later ticks
    read the GPUs one after the other. Without either, every tick reads windows: the pool."""
    fake = FakeNvml([replace(gpu, pcie_byte_counters=counters) for gpu in uniform_gpus(8)],
                    throughput_delay_seconds=0.001)
    # A budget no loaded test run reaches: this test is about the tasks, not about late GPUs.
    collector = GpuCollector(LiveSource(), fake, max_workers=8, pcie_samples_per_second=samples_per_second,
                             read_budget_seconds=30)
    tasks = []
    groups = collector._groups
    collector._groups = lambda count: tasks.append(groups(count)) or tasks[-1]
    try:
        for tick in range(3):
            samples = collector.collect()
            assert len(samples.find("hybridmon_gpu_up")) == 8
            assert len(samples.find("hybridmon_gpu_pcie_throughput_bytes_per_second")) == 16
            # a task per GPU, or all eight one after the other in one
            assert tasks[-1] == ([[index] for index in range(8)] if pooled[tick] else [list(range(8))])
            if not samples_per_second:  # (sampler threads call it too)
                assert fake.calls["nvmlDeviceGetPcieThroughput"] == 16 * (tick + 1 if counters is False else 1)
            time.sleep(0.35 if samples_per_second else 0)  # samples (one per 0.1 s slot) for the next tick
    finally:
        collector.close()


# --- NVLink-C2C (issue 29) ---------------------------------------------------------------------------
def test_c2c_mode_links_and_traffic_of_a_grace_hopper_gpu(fake):
    fake.configure(gpus=[grace_hopper_gpu()])
    collector = GpuCollector(LiveSource(), fake)
    try:
        first = collector.collect()
        time.sleep(0.11)  # nvml.h: GPM samples over 100 ms apart
        samples = collector.collect()
    finally:
        collector.close()
    assert first.find("hybridmon_gpu_c2c_throughput_bytes_per_second") == []  # one sample only
    assert samples.value("hybridmon_gpu_c2c_mode_enabled", gpu="0") == 1
    assert samples.value("hybridmon_gpu_c2c_link_count", gpu="0") == 10
    assert len(samples.find("hybridmon_gpu_c2c_link_up")) == 10
    assert samples.value("hybridmon_gpu_c2c_link_up", gpu="0", link="9") == 1
    # field 172 is "in MBps" (nvml.h): 45,000 MB/s
    assert samples.value("hybridmon_gpu_c2c_link_max_bytes_per_second", gpu="0", link="3") == 45e9
    # GPM C2C RX is what the GPU receives: host to device (MiB/s x 2^20)
    assert samples.value("hybridmon_gpu_c2c_throughput_bytes_per_second", gpu="0",
                         direction="host_to_device") == pytest.approx(40 * GIB, rel=1e-6)
    assert samples.value("hybridmon_gpu_c2c_throughput_bytes_per_second", gpu="0",
                         direction="device_to_host") == pytest.approx(10 * GIB, rel=1e-6)
    assert fake.calls["nvmlDeviceGetC2cModeInfoV"] == 1  # the platform's: read once


def test_c2c_link_down_and_mode_off(fake):
    gpu = grace_hopper_gpu()
    gpu.c2c_links[4][0] = False
    fake.configure(gpus=[gpu, replace(grace_hopper_gpu("GPU-4a1b2c3d-0000-4000-8000-000000000004"),
                                      c2c_enabled=False)])
    collector = GpuCollector(LiveSource(), fake)
    try:
        samples = collector.collect()
    finally:
        collector.close()
    assert samples.value("hybridmon_gpu_c2c_link_up", gpu="0", link="4") == 0
    assert samples.value("hybridmon_gpu_c2c_mode_enabled", gpu="1") == 0
    assert samples.find("hybridmon_gpu_c2c_link_count", gpu="1") == []


def test_c2c_without_gpm_says_once_that_its_traffic_cannot_be_read(fake, caplog):
    fake.configure(gpus=[replace(grace_hopper_gpu(), gpm_supported=False)])
    collector = GpuCollector(LiveSource(), fake)
    try:
        for _ in range(3):
            samples = collector.collect()
    finally:
        collector.close()
    assert samples.value("hybridmon_gpu_c2c_mode_enabled", gpu="0") == 1
    assert samples.find("hybridmon_gpu_c2c_throughput_bytes_per_second") == []
    assert caplog.text.count("has NVLink-C2C enabled but no GPM metrics") == 1


def test_no_c2c_series_on_a_pcie_host(collector):
    names = {s.spec.name for s in collector.collect()}
    assert not {name for name in names if "_c2c_" in name}
