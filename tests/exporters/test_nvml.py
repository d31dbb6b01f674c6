"""exporters/nvml.py driven by the fake NVML, by real pynvml structs and by real pynvml itself."""
from __future__ import annotations

import ctypes
import logging
import time

import pynvml
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridmon.exporters.sources import (LiveSource, RecordingSource, ReplayedCallError, ReplaySource,
                           TraceMissError)
from hybridmon.exporters.base import CollectorError, NoDataError, ParseError
from hybridmon.exporters.nvml_answers import NVML_VALUE_NOT_AVAILABLE
from hybridmon.exporters.nvml import (MIN_NVIDIA_ML_PY, C2cLink, GpuLostError,
                                      GpuProcess, Nvml, normalize_pci_bus_id, to_plain)
from tests.support import fake_nvml
from tests.support.fake_nvml import (FOREIGN_PID, GIB, MIB, UUID0, XORG_PID, FakeClock, FakeNvml,
                                     FakeProcess, grace_hopper_gpu, mig_gpu,
                                     real_nvml_library_loads)
from tests.support.parser_properties import ParserRow


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml()


def make(fake, source=None, **kwargs) -> Nvml:
    return Nvml(source or LiveSource(), fake, **kwargs)


# --- pure helpers ----------------------------------------------------------------------------
@pytest.mark.parametrize("nvml_form, sysfs_form", [
    ("00000000:17:00.0", "0000:17:00.0"),
    ("00000000:CA:00.0", "0000:ca:00.0"),
    ("0000:3B:1F.7", "0000:3b:1f.7"),
    ("00010000:01:00.0", "10000:01:00.0"),  # VMD domains are wider than 4 digits in sysfs too
])
def test_normalize_pci_bus_id(nvml_form, sysfs_form):
    assert normalize_pci_bus_id(nvml_form) == sysfs_form


@pytest.mark.parametrize("garbage", ["", "17:00.0", "0000:17:00", "0000:1g:00.0", "0:100:00.0",
                                     "0000:17:20.0", "0000:17:00.8", "0000:17:00.0:1", "٠:17:00.0",
                                     "0000:0x17:00.0", "0000:1_7:00.0"])
def test_normalize_pci_bus_id_rejects_garbage(garbage):
    with pytest.raises(ParseError):
        normalize_pci_bus_id(garbage)


@given(st.integers(0, 15), st.sampled_from("0123456789abcdefABCDEF:.x -"))
def test_normalize_pci_bus_id_mutated(position, char):
    text = "00000000:17:00.0"
    mutated = text[:position] + char + text[position + 1:]
    try:
        result = normalize_pci_bus_id(mutated)
    except ParseError:
        return
    assert result == result.lower() and len(result.split(":")) == 3


def test_to_plain_on_real_pynvml_structs():
    memory = pynvml.c_nvmlMemory_v2_t(version=pynvml.nvmlMemory_v2, total=48 * GIB,
                                       reserved=512 * MIB, free=16 * GIB, used=31 * GIB)
    assert to_plain(memory) == {"version": pynvml.nvmlMemory_v2, "total": 48 * GIB,
                                "reserved": 512 * MIB, "free": 16 * GIB, "used": 31 * GIB}
    pci = pynvml.nvmlPciInfo_t(busIdLegacy=b"0000:17:00.0", domain=0, bus=0x17,
                               busId=b"00000000:17:00.0")
    assert to_plain(pci)["busId"] == "00000000:17:00.0"
    assert to_plain(pci)["busIdLegacy"] == "0000:17:00.0"
    process = pynvml.nvmlFriendlyObject({"pid": 4242, "usedGpuMemory": None, "gpuInstanceId": 1})
    assert to_plain([process]) == [{"pid": 4242, "usedGpuMemory": None, "gpuInstanceId": 1}]
    assert to_plain((ctypes.c_uint * 2)(3, 4)) == [3, 4]
    assert to_plain(b"550.54.15") == "550.54.15"
    with pytest.raises(TypeError):
        to_plain(object())


def test_fake_errors_and_constants_match_pynvml():
    for code, real_class in pynvml.NVMLError._valClassMapping.items():
        if code in fake_nvml.NVMLError._valClassMapping:
            error = fake_nvml.NVMLError(code)
            assert type(error).__name__ == real_class.__name__ and error.value == code
            assert type(error)().value == code
    for name in ("NVMLError_LibraryNotFound", "NVMLError_NotSupported", "NVMLError_GpuIsLost",
                 "NVMLError_Timeout", "NVMLError_FunctionNotFound", "NVMLError_Uninitialized",
                 "NVMLError_DriverNotLoaded", "NVMLError_Unknown"):
        fake_class, real_class = getattr(fake_nvml, name), getattr(pynvml, name)
        assert issubclass(fake_class, fake_nvml.NVMLError)
        assert fake_class().value == real_class().value
    for name in ("NVML_PCIE_UTIL_RX_BYTES", "NVML_PCIE_UTIL_TX_BYTES", "nvmlMemory_v2",
                 "NVML_DEVICE_MIG_ENABLE", "NVML_DEVICE_MIG_DISABLE"):
        assert getattr(fake_nvml, name) == getattr(pynvml, name) == getattr(FakeNvml, name)
    assert issubclass(fake_nvml.NVMLLibraryMismatchError, Exception)
    assert pynvml.NVMLLibraryMismatchError.__name__ == fake_nvml.NVMLLibraryMismatchError.__name__
    # Every process-list wrapper the adapter may call exists in pynvml, and answers its fields.
    for kind in ("Compute", "Graphics", "MPSCompute"):
        for suffix in ("_v3", "_v2", ""):
            name = f"nvmlDeviceGet{kind}RunningProcesses{suffix}"
            assert callable(getattr(pynvml, name)) and callable(getattr(FakeNvml, name))
    listed = FakeNvml()
    listed.nvmlInit()
    entry = listed.nvmlDeviceGetComputeRunningProcesses_v3(fake_nvml.FakeHandle(0))[0]
    assert list(vars(entry)) == [field[0] for field in pynvml.c_nvmlProcessInfo_v2_t._fields_]
    assert pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value == NVML_VALUE_NOT_AVAILABLE
    for struct in ("c_nvmlMemory_t", "c_nvmlMemory_v2_t", "nvmlPciInfo_t", "c_nvmlUtilization_t"):
        fields = [field[0] for field in getattr(fake_nvml, struct)._fields_]
        assert fields == [field[0] for field in getattr(pynvml, struct)._fields_]


# --- readings and unit conversions ---------------------------------------------------------------
def test_identity_and_values(fake):
    nvml = make(fake)
    assert nvml.device_count() == 2
    assert nvml.driver_version() == "550.54.15"
    assert (nvml.name(0), nvml.uuid(0), nvml.pci_bus_id(0)) == ("NVIDIA L40S", UUID0, "0000:17:00.0")
    assert nvml.pci_bus_id(1) == "0000:ca:00.0"
    assert nvml.memory_info_version() == "v2"
    assert nvml.memory_bytes(0) == (31 * GIB, 48 * GIB, 512 * MIB)
    assert nvml.pcie_throughput_bytes_per_second(0) == (1_200_000 * 1024, 300_000 * 1024)
    assert (nvml.pcie_link_generation(1), nvml.pcie_link_width_lanes(1)) == (3, 8)
    assert (nvml.pcie_link_max_generation(1), nvml.pcie_link_max_width_lanes(1)) == (4, 16)
    assert nvml.pcie_replay_count(1) == 17
    assert nvml.utilization_ratio(0) == pytest.approx(0.87)
    assert (nvml.numa_node(0), nvml.numa_node(1)) == (None, None)  # NOT_SUPPORTED on x86
    assert (nvml.mig_enabled(0), nvml.mig_enabled(1)) == (None, None)  # no MIG on L40S/A10
    assert nvml.compute_processes(1) == [GpuProcess(5151, 10 * GIB)]
    assert nvml.processes(1) == [GpuProcess(5151, 10 * GIB),
                                 GpuProcess(XORG_PID, 12 * MIB, frozenset({"graphics"}))]
    assert nvml.process_names([5151, 4242]) == {4242: "python3", 5151: "llama-server"}


def test_static_identity_is_read_once(fake):
    nvml = make(fake)
    for _ in range(3):
        nvml.uuid(0), nvml.name(0), nvml.pci_bus_id(0), nvml.pcie_link_max_generation(0)
        nvml.driver_version()
    assert fake.calls["nvmlDeviceGetUUID"] == fake.calls["nvmlDeviceGetPciInfo_v3"] == 1
    assert fake.calls["nvmlSystemGetDriverVersion"] == fake.calls["nvmlDeviceGetHandleByIndex_v2"] == 1
    assert fake.calls["nvmlInit"] == 1


def test_keys_name_function_gpu_and_arguments(fake):
    source = RecordingSource()
    nvml = make(fake, source)
    nvml.memory_info_version()
    nvml.pcie_throughput_bytes_per_second(1)
    nvml.process_names([4242])
    assert [reading[1] for reading in source.take_readings()] == [
        "nvml.nvmlInit()", "nvml.nvmlDeviceGetCount()", "nvml.nvmlDeviceGetMemoryInfo(0,v2)",
        "nvml.nvmlDeviceGetPcieThroughput(1,rx)", "nvml.nvmlDeviceGetPcieThroughput(1,tx)",
        "nvml.nvmlSystemGetProcessName(4242)"]


def test_memory_v1_fallback_is_decided_once(fake, caplog):
    fake.configure(memory_v2_supported=False)
    nvml = make(fake)
    with caplog.at_level(logging.WARNING):
        assert nvml.memory_info_version() == "v1"
        for _ in range(3):
            nvml.memory_info_version()
            # v1 counts the reservation as used and has no reserved field.
            assert nvml.memory_bytes(0) == (31 * GIB + 512 * MIB, 48 * GIB, None)
            assert nvml.memory_bytes(1) == (11 * GIB + 384 * MIB, 24 * GIB, None)
    assert fake.calls["nvmlDeviceGetMemoryInfo_v2"] == 1
    assert fake.calls["nvmlDeviceGetMemoryInfo"] == 6
    assert "driver-reserved memory" in caplog.text


def test_memory_version_probe_skips_lost_and_failing_gpus(fake):
    fake.lose_gpu(0)
    fake.fail("nvmlDeviceGetMemoryInfo_v2", "NVMLError_Timeout", gpu=1, times=1)
    nvml = make(fake)
    assert nvml.memory_info_version() is None  # nothing settled it: memory absent this tick
    assert nvml.memory_bytes(1) is None
    assert nvml.memory_info_version() == "v2"
    assert nvml.memory_bytes(1) == (11 * GIB, 24 * GIB, 384 * MIB)


@pytest.mark.parametrize("used", [None, NVML_VALUE_NOT_AVAILABLE])
def test_process_memory_not_available_is_none(fake, used):
    fake.gpus[0].processes = [FakeProcess(4242, "python3", used), FakeProcess(7, "x", 5)]
    assert make(fake).compute_processes(0) == [GpuProcess(4242, None), GpuProcess(7, 5)]


def test_numa_node_negative_or_unsupported_is_none(fake):
    fake.gpus[0].numa_node = -1
    fake.gpus[1].numa_node = 4  # Grace Hopper: the GPU's memory is node 4
    nvml = make(fake)
    assert nvml.numa_node(0) is None and nvml.numa_node(1) == 4
    fake.gpus[1].numa_node = None
    assert make(fake).numa_node(1) is None


def test_numa_node_is_asked_once_per_gpu_unless_the_call_failed(fake):
    """A node or NOT_SUPPORTED is the platform's answer for as long as NVML is loaded; x86 hosts
    raised one NVMLError per GPU per tick asking again."""
    fake.gpus[1].numa_node = 4
    nvml = make(fake)
    for _ in range(3):
        assert (nvml.numa_node(0), nvml.numa_node(1)) == (None, 4)
    assert fake.calls["nvmlDeviceGetNumaNodeId"] == 2
    fake.fail("nvmlDeviceGetNumaNodeId", "NVMLError_Timeout")
    other = make(fake)
    assert other.numa_node(1) is None and other.numa_node(1) is None
    assert fake.calls["nvmlDeviceGetNumaNodeId"] == 4  # a failure is not an answer: asked again


def test_process_names_cached_pruned_and_fall_back_to_pid(fake):
    nvml = make(fake)
    assert nvml.process_names([4242, 999]) == {4242: "python3", 999: "999"}
    assert nvml.process_names([4242]) == {4242: "python3"}
    assert fake.calls["nvmlSystemGetProcessName"] == 2
    nvml.process_names([5151])  # 4242 is forgotten here...
    nvml.process_names([4242])  # ...so a reused pid is looked up again
    assert fake.calls["nvmlSystemGetProcessName"] == 4


# --- error classes -------------------------------------------------------------------------------
@pytest.mark.parametrize("error", ["NVMLError_NotSupported", "NVMLError_FunctionNotFound"])
def test_unsupported_is_none_and_logged_once(fake, caplog, error):
    fake.fail("nvmlDeviceGetPcieReplayCounter", error)
    nvml = make(fake)
    with caplog.at_level(logging.INFO):
        assert [nvml.pcie_replay_count(gpu) for gpu in (0, 1, 0)] == [None, None, None]
    assert caplog.text.count("nvmlDeviceGetPcieReplayCounter is not supported") == 1
    assert nvml.pcie_link_generation(0) == 4


def test_pynvml_library_mismatch_error_counts_as_unsupported(fake):
    # pynvml turns FunctionNotFound into this for unversioned calls such as the process list.
    fake.fail("nvmlDeviceGetPcieReplayCounter", pynvml.NVMLLibraryMismatchError)
    assert make(fake).pcie_replay_count(0) is None


def test_timeout_is_absent_once_then_back(fake, caplog):
    fake.fail("nvmlDeviceGetUtilizationRates", "NVMLError_Timeout", gpu=0, times=1)
    nvml = make(fake)
    with caplog.at_level(logging.WARNING):
        assert nvml.utilization_ratio(0) is None
        assert nvml.utilization_ratio(1) == pytest.approx(0.35)
        assert nvml.utilization_ratio(0) == pytest.approx(0.87)
    assert "nvmlDeviceGetUtilizationRates failed on GPU 0 (NVMLError_Timeout" in caplog.text


def test_gpu_lost_then_unknown_is_still_lost(fake):
    nvml = make(fake)
    assert nvml.uuid(1) == fake.gpus[1].uuid
    fake.lose_gpu(1)
    with pytest.raises(GpuLostError) as lost:
        nvml.utilization_ratio(1)
    assert lost.value.gpu == 1 and nvml.known_uuid(1) == fake.gpus[1].uuid
    fake.restore_gpu(1)
    fake.fail("*", "NVMLError_Unknown", gpu=1, times=1)
    with pytest.raises(GpuLostError):
        nvml.utilization_ratio(1)
    assert nvml.utilization_ratio(1) == pytest.approx(0.35)  # answers again: no longer lost
    fake.fail("*", "NVMLError_Unknown", gpu=1, times=1)
    assert nvml.utilization_ratio(1) is None  # Unknown alone is a transient failure
    assert nvml.utilization_ratio(0) == pytest.approx(0.87)


def test_non_nvml_errors_propagate(fake):
    fake.fail("nvmlDeviceGetName", ValueError)
    with pytest.raises(ValueError):
        make(fake).name(0)


def test_replayed_errors_classify_by_type_name():
    source = ReplaySource()
    source.load([["call", "nvml.nvmlInit()", True, None],
                 ["call", "nvml.nvmlDeviceGetNumaNodeId(0)", False,
                  {"type": "NVMLError_NotSupported", "detail": 3}],
                 ["call", "nvml.nvmlDeviceGetName(0)", False,
                  {"type": "NVMLError_GpuIsLost", "detail": 15}],
                 ["call", "nvml.nvmlDeviceGetUUID(0)", False, {"type": "KeyError", "detail": "x"}]])
    nvml = Nvml(source, None)
    assert nvml.numa_node(0) is None
    with pytest.raises(GpuLostError):
        nvml.name(0)
    with pytest.raises(ReplayedCallError):
        nvml.uuid(0)


# --- init, retry, shutdown -----------------------------------------------------------------------
def test_library_missing_says_install_the_driver_and_retries_every_60_seconds(fake, caplog):
    fake.configure(library_missing=True)
    clock = FakeClock()
    nvml = make(fake, clock=clock)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            with pytest.raises(NoDataError, match=r"libnvidia-ml\.so\.1 could not be loaded.*"
                                                  r"install the NVIDIA driver"):
                nvml.device_count()
    assert fake.calls["nvmlInit"] == 1
    # The adapter leaves logging to the sampler, which logs each NoDataError once.
    assert "NVIDIA driver not found" not in caplog.text
    fake.configure(library_missing=False)  # driver installed while running
    clock.now += 59
    with pytest.raises(NoDataError):
        nvml.device_count()
    assert fake.calls["nvmlInit"] == 1
    clock.now += 1
    assert nvml.device_count() == 2
    assert fake.calls["nvmlInit"] == 2


def test_driver_not_loaded_is_no_data(fake):
    fake.fail("nvmlInit", "NVMLError_DriverNotLoaded")
    with pytest.raises(NoDataError, match="nvidia kernel module is not running"):
        make(fake).device_count()


def test_other_init_failures_are_collector_errors(fake):
    fake.fail("nvmlInit", "NVMLError_Unknown")
    with pytest.raises(CollectorError, match="NVMLError_Unknown"):
        make(fake).device_count()


def test_driver_library_and_kernel_module_mismatch_says_what_to_do(fake):
    fake.fail("nvmlInit", "NVMLError_LibRmVersionMismatch", times=1)
    clock = FakeClock()
    nvml = make(fake, clock=clock)
    with pytest.raises(CollectorError) as raised:
        nvml.device_count()
    assert "kernel module and libnvidia-ml.so.1 are different driver versions" in str(raised.value)
    assert "reboot" in str(raised.value) and "retrying every 60 s" in str(raised.value)
    clock.now += 60  # the module reloaded meanwhile: the retry succeeds
    assert nvml.device_count() == 2


def test_real_pynvml_on_this_host():
    nvml = Nvml(LiveSource())  # default module "pynvml"
    try:
        if not real_nvml_library_loads():
            with pytest.raises(NoDataError) as missing:
                nvml.device_count()
            assert "libnvidia-ml.so.1 could not be loaded" in str(missing.value)
            assert "install the NVIDIA driver" in str(missing.value)
            return
        try:
            count = nvml.device_count()
        except NoDataError as error:  # the library is installed, the kernel module not loaded
            assert "nvidia kernel module is not running" in str(error)
            return
        assert nvml.driver_version()
        assert nvml.memory_info_version() in ("v1", "v2")
        for gpu in range(count):
            assert nvml.uuid(gpu).startswith("GPU-")
            used, total, _ = nvml.memory_bytes(gpu)
            assert 0 <= used <= total and total > 0
    finally:
        nvml.close()


def test_missing_python_module_is_no_data():
    with pytest.raises(NoDataError, match="install nvidia-ml-py"):
        Nvml(LiveSource(), "no_such_nvml_module").device_count()


def test_close_shuts_nvml_down_only_when_initialised(fake):
    nvml = make(fake)
    nvml.close()
    assert fake.calls["nvmlShutdown"] == 0
    nvml.device_count()
    nvml.close()
    assert fake.calls["nvmlShutdown"] == 1 and fake._init_count == 0


def test_replay_imports_nothing_and_tolerates_skipped_init_retries(fake, monkeypatch):
    fake.configure(library_missing=True)
    clock = FakeClock()
    recording = RecordingSource()
    live = make(fake, recording, clock=clock)
    ticks = []
    for step in (0, 10, 60):
        clock.now += step
        if step == 60:
            fake.configure(library_missing=False)
        try:
            outcome = live.device_count()
        except NoDataError:
            outcome = "absent"
        ticks.append((outcome, recording.take_readings()))
    assert [len(readings) for _, readings in ticks] == [1, 0, 2]

    def no_import(name):
        raise AssertionError(f"replay imported {name}")

    monkeypatch.setattr("hybridmon.exporters.nvml.importlib.import_module", no_import)
    source = ReplaySource()
    replay = Nvml(source, None)  # real clock: it would not retry on its own schedule
    for outcome, readings in ticks:
        source.load(readings)
        try:
            assert replay.device_count() == outcome
        except NoDataError:
            assert outcome == "absent"
    source.load([])
    with pytest.raises(TraceMissError):  # a trace miss elsewhere still says so
        Nvml(source, None).device_count()


# --- NVML as the real binding and driver behave (issue 13) ---------------------------------------
def test_a_function_the_binding_lacks_is_unsupported_and_names_the_version_to_install(caplog):
    # nvidia-ml-py 12.535.x has no nvmlDeviceGetNumaNodeId: the old adapter let AttributeError
    # out, which failed the whole GPU collection every tick.
    fake = FakeNvml(binding_lacks=("nvmlDeviceGetNumaNodeId",))
    nvml = make(fake)
    with caplog.at_level(logging.INFO):
        assert [nvml.numa_node(0), nvml.numa_node(1)] == [None, None]
    assert caplog.text.count(f"lacks nvmlDeviceGetNumaNodeId; upgrade to >= {MIN_NVIDIA_ML_PY}") == 1
    assert nvml.utilization_ratio(0) == pytest.approx(0.87)


def test_the_real_pynvml_missing_a_function_names_its_version(monkeypatch, caplog):
    from importlib.metadata import version

    monkeypatch.delattr(pynvml, "nvmlDeviceGetNumaNodeId")
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: index)
    with caplog.at_level(logging.INFO):
        assert Nvml(LiveSource(), pynvml).numa_node(0) is None
    assert f"nvidia-ml-py {version('nvidia-ml-py')} lacks nvmlDeviceGetNumaNodeId" in caplog.text


def test_processes_reads_compute_graphics_and_mps_lists_and_merges_by_pid(fake):
    fake.gpus[0].processes = [
        FakeProcess(4242, "python3", 30 * GIB),
        FakeProcess(XORG_PID, "Xorg", 18 * MIB, ("graphics",)),
        FakeProcess(31, "gl-cuda-app", 2 * GIB, ("compute", "graphics")),  # interop: both lists
        FakeProcess(32, "mps-client", 1 * GIB, ("mps",)),
    ]
    nvml = make(fake)
    found = {process.pid: process for process in nvml.processes(0)}
    assert found == {
        4242: GpuProcess(4242, 30 * GIB, frozenset({"compute"})),
        XORG_PID: GpuProcess(XORG_PID, 18 * MIB, frozenset({"graphics"})),
        31: GpuProcess(31, 2 * GIB, frozenset({"compute", "graphics"})),  # once, not 4 GiB
        32: GpuProcess(32, 1 * GIB, frozenset({"mps"})),
    }
    assert {p.pid for p in nvml.compute_processes(0)} == {4242, 31, 32}
    for kind in ("Compute", "Graphics", "MPSCompute"):
        assert fake.calls[f"nvmlDeviceGet{kind}RunningProcesses_v3"] == 2  # one per call above


def test_a_graphics_only_process_is_listed():
    # A Vulkan llama.cpp is in the graphics list only; the old adapter read the compute list.
    fake = FakeNvml()
    fake.gpus[1].processes = [FakeProcess(5151, "llama-server", 6 * GIB, ("graphics",))]
    assert make(fake).processes(1) == [GpuProcess(5151, 6 * GIB, frozenset({"graphics"}))]


def test_process_lists_fall_back_to_v2_on_drivers_without_v3_and_decide_once(fake):
    fake.configure(process_entry_points=("v2",))
    nvml = make(fake)
    for _ in range(3):
        assert [p.pid for p in nvml.processes(0)] == [4242, XORG_PID]
        assert [p.pid for p in nvml.processes(1)] == [5151, XORG_PID]
    for kind in ("Compute", "Graphics", "MPSCompute"):
        assert fake.calls[f"nvmlDeviceGet{kind}RunningProcesses_v3"] == 2  # once per GPU
        assert fake.calls[f"nvmlDeviceGet{kind}RunningProcesses_v2"] == 6


def test_process_lists_with_neither_v3_nor_a_v2_wrapper_are_none_and_said_once(caplog):
    # nvidia-ml-py 12.535.x (no _v2 wrappers) on a driver without the _v3 symbols.
    lacks = tuple(f"nvmlDeviceGet{kind}RunningProcesses_v2"
                  for kind in ("Compute", "Graphics", "MPSCompute"))
    fake = FakeNvml(process_entry_points=(), binding_lacks=lacks)
    nvml = make(fake)
    with caplog.at_level(logging.INFO):
        assert [nvml.processes(0), nvml.processes(0), nvml.compute_processes(1)] == [None] * 3
    assert caplog.text.count("no NVML entry point for the compute process list answered") == 1
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses_v3"] == 4  # _v3 and unversioned, per GPU


def test_a_failing_list_is_asked_again_and_the_others_still_answer(fake):
    fake.fail("nvmlDeviceGetGraphicsRunningProcesses_v3", "NVMLError_Timeout", times=1)
    nvml = make(fake)
    assert nvml.processes(0) == [GpuProcess(4242, 30 * GIB)]
    assert [p.pid for p in nvml.processes(0)] == [4242, XORG_PID]
    fake.fail("*", "NVMLError_Timeout")
    assert nvml.processes(0) is None


def test_mig_mode_is_read_once_and_the_parent_refuses_processes_and_utilization():
    fake = FakeNvml([mig_gpu()])
    nvml = make(fake)
    assert [nvml.mig_enabled(0) for _ in range(3)] == [True] * 3
    assert fake.calls["nvmlDeviceGetMigMode"] == 1
    assert nvml.utilization_ratio(0) is None and nvml.processes(0) is None
    fake.gpus[0].mig_mode = fake_nvml.NVML_DEVICE_MIG_DISABLE
    assert make(fake).mig_enabled(0) is False
    unsupported = FakeNvml()
    nvml = make(unsupported)
    assert [nvml.mig_enabled(0), nvml.mig_enabled(0)] == [None, None]
    assert unsupported.calls["nvmlDeviceGetMigMode"] == 1  # NOT_SUPPORTED is kept too


def test_processes_of_mig_instances_stay_apart():
    fake = FakeNvml([mig_gpu()])
    fake.gpus[0].mig_mode = fake_nvml.NVML_DEVICE_MIG_DISABLE  # as a privileged caller sees it
    fake.gpus[0].processes.append(FakeProcess(6161, "python3", 1 * GIB, gpu_instance_id=2))
    assert sorted(make(fake).processes(0), key=lambda p: (p.pid, p.gpu_instance_id)) == [
        GpuProcess(6161, 20 * GIB, gpu_instance_id=1), GpuProcess(6161, 1 * GIB, gpu_instance_id=2),
        GpuProcess(6262, 9 * GIB, gpu_instance_id=2)]


def test_a_foreign_pid_is_listed_and_named_by_its_pid(fake):
    fake.gpus[0].processes.append(FakeProcess(FOREIGN_PID, None, 4 * GIB))
    nvml = make(fake)
    assert FOREIGN_PID in {p.pid for p in nvml.processes(0)}
    assert nvml.process_names([FOREIGN_PID]) == {FOREIGN_PID: str(FOREIGN_PID)}


def test_process_list_fallback_and_missing_functions_record_and_replay():
    fake = FakeNvml(process_entry_points=("v2",), binding_lacks=("nvmlDeviceGetNumaNodeId",))
    recording = RecordingSource()
    live = make(fake, recording)
    answers = [(live.processes(0), live.numa_node(0)) for _ in range(2)]
    readings = [recording.take_readings()]
    keys = [reading[1] for reading in readings[0]]
    assert "nvml.nvmlDeviceGetComputeRunningProcesses_v3(0)" in keys
    assert "nvml.nvmlDeviceGetComputeRunningProcesses_v2(0)" in keys
    source = ReplaySource()
    source.load(readings[0])
    replay = Nvml(source, None)
    assert [(replay.processes(0), replay.numa_node(0)) for _ in range(2)] == answers


# This module's parsers, each with realistic samples, for tests/exporters/test_parsers_robustness.py
# (which holds every parse_* of exporters/ to its one promised error).
# A reader under the parsers' contract, though not named parse_*.
PARSER_ROWS = [ParserRow(normalize_pci_bus_id, ("00000000:17:00.0", "00000000:CA:00.0", "00010000:01:00.0"))]


# --- GPM and NVLink-C2C (issue 29) ---------------------------------------------------------------
GPM_IDS = (fake_nvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC, fake_nvml.NVML_GPM_METRIC_C2C_TOTAL_RX_PER_SEC)


def test_gpm_metrics_between_this_sample_and_the_previous():
    fake = FakeNvml([grace_hopper_gpu()])
    clock = FakeClock()
    fake_time = [1_700_000_000.0]
    fake.use_clock(lambda: fake_time[0], lambda seconds: None)
    nvml = make(fake, clock=clock)
    assert nvml.gpm_metrics(0, GPM_IDS) is None  # one sample: no interval yet
    clock.now += 0.05
    fake_time[0] += 0.05
    assert nvml.gpm_metrics(0, GPM_IDS) is None  # nvml.h: samples over 100 ms apart; kept
    assert fake.calls["nvmlGpmSampleGet"] == 1
    clock.now += 1.0
    fake_time[0] += 1.0
    metrics = nvml.gpm_metrics(0, GPM_IDS)
    assert metrics == {GPM_IDS[0]: pytest.approx(2_500 * 1024 / MIB),
                       GPM_IDS[1]: pytest.approx(40 * 1024)}
    nvml.close()
    assert [sample.freed for sample in fake.gpm_samples] == [True, True]


def test_gpm_absent_where_unsupported_or_the_binding_lacks_it(caplog):
    fake = FakeNvml()  # an L40S and an A10: isSupportedDevice 0
    assert make(fake).gpm_metrics(0, GPM_IDS) is None
    assert fake.calls["nvmlGpmSampleGet"] == 0
    old_binding = FakeNvml([grace_hopper_gpu()], binding_lacks=["nvmlGpmQueryDeviceSupport"])
    assert make(old_binding).gpm_metrics(0, GPM_IDS) is None
    assert "lacks nvmlGpmQueryDeviceSupport" in caplog.text


def test_gpm_metric_that_fails_is_left_out_and_said_once(caplog):
    caplog.set_level(logging.INFO)
    fake = FakeNvml([grace_hopper_gpu()])
    clock = FakeClock()
    nvml = make(fake, clock=clock)
    asked = GPM_IDS + (fake_nvml.NVML_GPM_METRIC_MAX - 1,)  # a metric the fake does not model
    for _ in range(3):
        clock.now += 1.0
        time.sleep(0.002)  # the fake's samples use wall time
        metrics = nvml.gpm_metrics(0, asked)
    assert set(metrics) == set(GPM_IDS)
    assert caplog.text.count(f"GPM metric {asked[-1]} answered nvmlReturn 3") == 1


def test_c2c_links_absent_when_the_field_call_fails():
    fake = FakeNvml([grace_hopper_gpu()])
    nvml = make(fake)
    assert nvml.c2c_mode_enabled(0) is True
    assert len(nvml.c2c_links(0)) == 10
    fake.fail("nvmlDeviceGetFieldValues", "NVMLError_Unknown", gpu=0, times=1)
    assert nvml.c2c_links(0) is None
    assert nvml.c2c_links(0)[3] == C2cLink(3, True, 45_000 * 10**6)
    assert make(FakeNvml()).c2c_mode_enabled(0) is None  # NOT_SUPPORTED: an x86 PCIe host
