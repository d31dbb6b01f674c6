"""A fake pynvml: the functions, constants, structs and error classes exporters/nvml.py uses.

It drives the real adapter and collector in tests, and a real daemon when the agent is configured
to load NVML from "tests.support.fake_nvml". Two ways to use it:
- `FakeNvml()` instances (tests): pass the instance where a module is expected; each test owns one.
- this module itself: its nvml* functions and configure/fail/lose_gpu/... act on `DEFAULT`, which
  reads the JSON layout named by $HYBRIDMON_FAKE_NVML_LAYOUT at import (see FakeNvml.load_layout).

The default layout is the fixture host's (tests/conftest.py): GPU0 an L40S at 0000:17:00.0 on node 0
running pid 4242, GPU1 an A10 at 0000:ca:00.0 on node 1, downtrained to Gen3 x8, running pid 5151.
At the end: what tests/exporters/test_gpu.py and tests/exporters/test_nvml.py share (UUIDs, a clock, the real library).
"""
from __future__ import annotations

import ctypes
import json
import os
import string
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

GIB = 1024**3
MIB = 1024**2

# Return codes and constants, as pynvml defines them.
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_UNKNOWN = 999
NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1
nvmlMemory_v2 = 0x02000028
NVML_VALUE_NOT_AVAILABLE_ulonglong = ctypes.c_ulonglong(-1)


class NVMLError(Exception):
    """pynvml's error: NVMLError(code) becomes the subclass for that code; `.value` is the code."""

    _valClassMapping: dict[int, type] = {}

    def __new__(cls, value):
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        error = Exception.__new__(cls)
        error.value = value
        return error

    def __str__(self) -> str:
        return _ERROR_STRINGS.get(self.value, f"NVML Error with code {self.value}")


_ERROR_STRINGS = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized", NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NOT_FOUND: "Not Found", NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout", NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found", NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


def _define_error_classes() -> None:
    # Same naming as pynvml: NVML_ERROR_GPU_IS_LOST -> NVMLError_GpuIsLost.
    for constant, code in list(globals().items()):
        if not constant.startswith("NVML_ERROR_"):
            continue
        name = "NVMLError_" + string.capwords(constant[len("NVML_ERROR_"):], "_").replace("_", "")

        def new(typ, *args, _code=code):
            return NVMLError.__new__(typ, _code)

        cls = type(name, (NVMLError,), {"__new__": new})
        cls.__module__ = __name__
        globals()[name] = cls
        NVMLError._valClassMapping[code] = cls


_define_error_classes()


class c_nvmlMemory_t(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


class c_nvmlMemory_v2_t(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("total", ctypes.c_ulonglong),
                ("reserved", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


class nvmlPciInfo_t(ctypes.Structure):
    _fields_ = [("busIdLegacy", ctypes.c_char * 16), ("domain", ctypes.c_uint),
                ("bus", ctypes.c_uint), ("device", ctypes.c_uint), ("pciDeviceId", ctypes.c_uint),
                ("pciSubSystemId", ctypes.c_uint), ("busId", ctypes.c_char * 32)]


class c_nvmlUtilization_t(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class nvmlFriendlyObject:
    """What pynvml returns for each running process (pid, usedGpuMemory, instance ids)."""

    def __init__(self, fields: dict) -> None:
        self.__dict__.update(fields)


@dataclass
class FakeProcess:
    pid: int
    name: str
    used_gpu_memory_bytes: int | None  # None: NVML cannot tell (pynvml reports None)


@dataclass
class FakeGpu:
    name: str
    uuid: str
    pci_bus_id: str  # NVML's form, "00000000:17:00.0"
    memory_total_bytes: int
    memory_used_bytes: int  # v2 meaning: without the driver's reservation
    memory_reserved_bytes: int
    pcie_rx_kilobytes_per_second: int
    pcie_tx_kilobytes_per_second: int
    link_generation: int
    link_width_lanes: int
    max_link_generation: int
    max_link_width_lanes: int
    pcie_replays: int
    utilization_percent: int
    numa_node: int | None  # None: nvmlDeviceGetNumaNodeId is not supported
    processes: list[FakeProcess] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict) -> "FakeGpu":
        return cls(**{**data, "processes": [FakeProcess(**p) for p in data.get("processes", [])]})


def default_gpus() -> list[FakeGpu]:
    return [
        FakeGpu("NVIDIA L40S", "GPU-0a1b2c3d-0000-4000-8000-000000000000", "00000000:17:00.0",
                48 * GIB, 31 * GIB, 512 * MIB, 1_200_000, 300_000, 4, 16, 4, 16, 0, 87, 0,
                [FakeProcess(4242, "python3", 30 * GIB)]),
        FakeGpu("NVIDIA A10", "GPU-1a1b2c3d-0000-4000-8000-000000000001", "00000000:CA:00.0",
                24 * GIB, 11 * GIB, 384 * MIB, 250_000, 80_000, 3, 8, 4, 16, 17, 35, 1,
                [FakeProcess(5151, "llama-server", 10 * GIB)]),
    ]


def uniform_gpus(count: int) -> list[FakeGpu]:
    """`count` identical L40S GPUs (for benchmarks and many-GPU tests), each with one process."""
    return [
        FakeGpu("NVIDIA L40S", f"GPU-{index:08x}-0000-4000-8000-000000000000",
                f"00000000:{(0x17 + index * 0x10) % 0x100:02X}:00.0", 48 * GIB, 20 * GIB, 512 * MIB,
                1_000_000, 250_000, 4, 16, 4, 16, 0, 50, index * 2 // max(count, 1),
                [FakeProcess(10_000 + index, "python3", 19 * GIB)])
        for index in range(count)
    ]


@dataclass(frozen=True)
class FakeHandle:
    index: int


class FakeNvml:
    """One fake NVML library. Its state is plain attributes; `calls` counts each C entry point."""

    def __init__(self, gpus: list[FakeGpu] | None = None, **settings: Any) -> None:
        self._lock = threading.Lock()
        self.reset()
        self.configure(gpus=gpus, **settings)

    # --- programming the fake ------------------------------------------------------------
    def reset(self) -> None:
        self.gpus: list[FakeGpu] = default_gpus()
        self.driver_version = "550.54.15"
        self.library_missing = False
        self.memory_v2_supported = True
        self.throughput_delay_seconds = 0.0
        self.throughput_in_flight = 0
        self.max_throughput_in_flight = 0  # the most nvmlDeviceGetPcieThroughput calls at once
        self.calls: Counter[str] = Counter()
        self.lost: set[int] = set()
        self._failures: list[list] = []  # [function or "*", gpu or None, error class, times left]
        self._init_count = 0

    def configure(self, gpus: list[FakeGpu] | None = None, driver_version: str | None = None,
                  **settings: Any) -> None:
        """Replace the GPUs and/or set library_missing, memory_v2_supported or
        throughput_delay_seconds."""
        if gpus is not None:
            self.gpus = list(gpus)
        if driver_version is not None:
            self.driver_version = driver_version
        for name, value in settings.items():
            if name not in ("library_missing", "memory_v2_supported", "throughput_delay_seconds"):
                raise TypeError(f"FakeNvml has no setting {name!r}")
            setattr(self, name, value)

    def fail(self, function_name: str, error: type | str, gpu: int | None = None,
             times: int | None = None) -> None:
        """Make `function_name` ("*" for every call) raise `error` (a class or its name), on one GPU
        or all, `times` times or until heal()."""
        error_class = globals()[error] if isinstance(error, str) else error
        with self._lock:
            self._failures.append([function_name, gpu, error_class, times])

    def heal(self) -> None:
        with self._lock:
            self._failures.clear()

    def lose_gpu(self, index: int) -> None:
        """Every later call on that GPU's handle raises NVMLError_GpuIsLost."""
        self.lost.add(index)

    def restore_gpu(self, index: int) -> None:
        self.lost.discard(index)

    def load_layout(self, path: str) -> None:
        """Read {"driver_version": ..., "gpus": [FakeGpu fields, with "processes": [FakeProcess
        fields]], and optionally library_missing, memory_v2_supported, throughput_delay_seconds}."""
        with open(path, encoding="utf-8") as handle:
            layout = json.load(handle)
        gpus = [FakeGpu.from_dict(gpu) for gpu in layout.pop("gpus", [])] or None
        self.configure(gpus=gpus, **layout)

    def dump_layout(self, path: str) -> None:
        layout = {"driver_version": self.driver_version,
                  "gpus": [asdict(gpu) for gpu in self.gpus],
                  "library_missing": self.library_missing,
                  "memory_v2_supported": self.memory_v2_supported,
                  "throughput_delay_seconds": self.throughput_delay_seconds}
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(layout, handle, indent=2)

    # --- the library ---------------------------------------------------------------------
    def _enter(self, function: str, handle: FakeHandle | None = None) -> FakeGpu | None:
        with self._lock:
            self.calls[function] += 1
            gpu = None if handle is None else handle.index
            for failure in self._failures:
                name, on_gpu, error_class, times = failure
                if name in (function, "*") and on_gpu in (None, gpu) and times != 0:
                    if times is not None:
                        failure[3] = times - 1
                    raise error_class()
        if function != "nvmlInit" and self._init_count == 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if handle is None:
            return None
        if handle.index in self.lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return self.gpus[handle.index]

    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        if self.library_missing:
            raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)
        self._init_count += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self._init_count -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount_v2")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._enter("nvmlDeviceGetHandleByIndex_v2")
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return FakeHandle(index)

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        return self._enter("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        return self._enter("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetPciInfo(self, handle: FakeHandle) -> nvmlPciInfo_t:
        gpu = self._enter("nvmlDeviceGetPciInfo_v3", handle)
        domain, bus, rest = gpu.pci_bus_id.split(":")
        return nvmlPciInfo_t(busIdLegacy=gpu.pci_bus_id[4:].encode(), domain=int(domain, 16),
                             bus=int(bus, 16), device=int(rest.split(".")[0], 16),
                             busId=gpu.pci_bus_id.encode())

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle, version: int | None = None):
        if not version:
            gpu = self._enter("nvmlDeviceGetMemoryInfo", handle)
            # v1 counts the driver's reservation as used, as real drivers >= 515 do.
            used = gpu.memory_used_bytes + gpu.memory_reserved_bytes
            return c_nvmlMemory_t(total=gpu.memory_total_bytes,
                                  free=gpu.memory_total_bytes - used, used=used)
        gpu = self._enter("nvmlDeviceGetMemoryInfo_v2", handle)
        if not self.memory_v2_supported:
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        free = gpu.memory_total_bytes - gpu.memory_used_bytes - gpu.memory_reserved_bytes
        return c_nvmlMemory_v2_t(version=version, total=gpu.memory_total_bytes,
                                 reserved=gpu.memory_reserved_bytes, free=free,
                                 used=gpu.memory_used_bytes)

    def nvmlDeviceGetPcieThroughput(self, handle: FakeHandle, counter: int) -> int:
        gpu = self._enter("nvmlDeviceGetPcieThroughput", handle)
        with self._lock:
            self.throughput_in_flight += 1
            self.max_throughput_in_flight = max(self.max_throughput_in_flight,
                                                self.throughput_in_flight)
        try:
            if self.throughput_delay_seconds:
                time.sleep(self.throughput_delay_seconds)  # real NVML samples a 20 ms window
        finally:
            with self._lock:
                self.throughput_in_flight -= 1
        if counter == NVML_PCIE_UTIL_RX_BYTES:
            return gpu.pcie_rx_kilobytes_per_second
        if counter == NVML_PCIE_UTIL_TX_BYTES:
            return gpu.pcie_tx_kilobytes_per_second
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: FakeHandle) -> int:
        return self._enter("nvmlDeviceGetCurrPcieLinkGeneration", handle).link_generation

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: FakeHandle) -> int:
        return self._enter("nvmlDeviceGetCurrPcieLinkWidth", handle).link_width_lanes

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: FakeHandle) -> int:
        return self._enter("nvmlDeviceGetMaxPcieLinkGeneration", handle).max_link_generation

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: FakeHandle) -> int:
        return self._enter("nvmlDeviceGetMaxPcieLinkWidth", handle).max_link_width_lanes

    def nvmlDeviceGetPcieReplayCounter(self, handle: FakeHandle) -> int:
        return self._enter("nvmlDeviceGetPcieReplayCounter", handle).pcie_replays

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> c_nvmlUtilization_t:
        gpu = self._enter("nvmlDeviceGetUtilizationRates", handle)
        return c_nvmlUtilization_t(gpu=gpu.utilization_percent, memory=gpu.utilization_percent // 2)

    def nvmlDeviceGetNumaNodeId(self, handle: FakeHandle) -> int:
        gpu = self._enter("nvmlDeviceGetNumaNodeId", handle)
        if gpu.numa_node is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return gpu.numa_node

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeHandle) -> list[nvmlFriendlyObject]:
        gpu = self._enter("nvmlDeviceGetComputeRunningProcesses_v3", handle)
        return [nvmlFriendlyObject({"pid": p.pid, "usedGpuMemory": p.used_gpu_memory_bytes,
                                    "gpuInstanceId": 0xFFFFFFFF, "computeInstanceId": 0xFFFFFFFF})
                for p in gpu.processes]

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        self._enter("nvmlSystemGetProcessName")
        for gpu in self.gpus:
            for process in gpu.processes:
                if process.pid == pid:
                    return process.name
        raise NVMLError(NVML_ERROR_NOT_FOUND)


for _name, _value in list(globals().items()):
    if _name.startswith(("NVML_", "NVMLError", "nvmlMemory_")):
        setattr(FakeNvml, _name, _value)

DEFAULT = FakeNvml()
if os.environ.get("HYBRIDMON_FAKE_NVML_LAYOUT"):
    DEFAULT.load_layout(os.environ["HYBRIDMON_FAKE_NVML_LAYOUT"])

# The module answers like pynvml itself, through DEFAULT.
for _name in dir(FakeNvml):
    if _name.startswith("nvml") and callable(getattr(FakeNvml, _name)):
        globals()[_name] = getattr(DEFAULT, _name)
configure = DEFAULT.configure
fail = DEFAULT.fail
heal = DEFAULT.heal
lose_gpu = DEFAULT.lose_gpu
restore_gpu = DEFAULT.restore_gpu
reset = DEFAULT.reset
load_layout = DEFAULT.load_layout
dump_layout = DEFAULT.dump_layout


# --- shared by the NVML tests ------------------------------------------------------------------
UUID0, UUID1 = (gpu.uuid for gpu in default_gpus())


class FakeClock:
    """A monotonic clock the test moves by hand (`clock.now += 60`)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def real_nvml_library_loads() -> bool:
    """Whether libnvidia-ml.so.1, the NVIDIA driver's NVML, loads here, as pynvml loads it."""
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True
