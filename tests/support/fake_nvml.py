"""A fake pynvml: the functions, constants, structs and error classes exporters/nvml.py uses.

It drives the real adapter and collector in tests, and a real daemon when the agent is configured
to load NVML from "tests.support.fake_nvml". Two ways to use it:
- `FakeNvml()` instances (tests): pass the instance where a module is expected; each test owns one.
- this module itself: its nvml* functions and configure/fail/lose_gpu/... act on `DEFAULT`, which
  reads the JSON layout named by $HYBRIDMON_FAKE_NVML_LAYOUT at import (see FakeNvml.load_layout).

The default layout is the fixture host's (tests/conftest.py): GPU0 an L40S at 0000:17:00.0 (sysfs
node 0) running pid 4242 and a headless Xorg (graphics list), GPU1 an A10 at 0000:ca:00.0 (sysfs
node 1), downtrained to Gen3 x8, running pid 5151 and the same Xorg. What real x86 hosts answer, and
so what the defaults answer: nvmlDeviceGetNumaNodeId NOT_SUPPORTED (nvml.h: "only applies to
platforms where the GPUs are NUMA nodes"), nvmlDeviceGetMigMode NOT_SUPPORTED (L40S and A10 have no
MIG), a link at Gen1 while the GPU is idle (anchors.md: "curr link gen drops at idle (pstate)").
Modes real hosts also show, set per test: graphics-only processes (FakeProcess kinds), MIG on
(mig_gpu(); its instances' processes listed to a privileged caller only, `privileged`), a Grace
Hopper GPU with GPM and NVLink-C2C (grace_hopper_gpu()), NVML calls that hang (hang()), drivers without the _v3 process entry points (process_entry_points), an older
nvidia-ml-py without some functions (binding_lacks), pids from another pid namespace
(FOREIGN_PID). Each behaviour names its source next to it; pynvml means nvidia-ml-py 13.615.71's
pynvml.py unless a version is given.
At the end: what tests/exporters/test_gpu.py and tests/exporters/test_nvml.py share (UUIDs, a clock, the real library).
"""
from __future__ import annotations

import ctypes
import json
import math
import os
import string
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

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
# Field ids and value types for nvmlDeviceGetFieldValues (nvml.h 12.9.79, pynvml 13.615.71; pynvml
# names 197/198 from nvidia-ml-py 12.555.43 on).
NVML_FI_DEV_PCIE_COUNT_TX_BYTES = 197
NVML_FI_DEV_PCIE_COUNT_RX_BYTES = 198
NVML_VALUE_TYPE_DOUBLE = 0
NVML_VALUE_TYPE_UNSIGNED_INT = 1
NVML_VALUE_TYPE_UNSIGNED_LONG = 2
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3
NVML_VALUE_TYPE_SIGNED_LONG_LONG = 4
PCIE_SAMPLE_WINDOW_SECONDS = 0.020  # nvml.h: "querying a byte counter over a 20ms interval"
PCIE_COUNTERS_SINCE_DRIVER = 555  # the first driver branch whose nvml.h defines fields 197/198
# NVLink-C2C fields (nvml.h 12.9.79, pynvml): link count, status 0/1, "Link Speed in MBps".
NVML_FI_DEV_C2C_LINK_COUNT = 170
NVML_FI_DEV_C2C_LINK_GET_STATUS = 171
NVML_FI_DEV_C2C_LINK_GET_MAX_BW = 172
# GPM (nvml.h 12.9.79 nvmlGpmMetricId_t, pynvml): the metrics hybridmon reads, all in MiB/s.
NVML_GPM_METRIC_PCIE_TX_PER_SEC = 20
NVML_GPM_METRIC_PCIE_RX_PER_SEC = 21
NVML_GPM_METRIC_C2C_TOTAL_TX_PER_SEC = 100
NVML_GPM_METRIC_C2C_TOTAL_RX_PER_SEC = 101
# what the fake's GPM samples count, each the bytes moved since the GPU's first sample
GPM_MODELLED = (NVML_GPM_METRIC_PCIE_TX_PER_SEC, NVML_GPM_METRIC_PCIE_RX_PER_SEC,
                NVML_GPM_METRIC_C2C_TOTAL_TX_PER_SEC, NVML_GPM_METRIC_C2C_TOTAL_RX_PER_SEC)
NVML_GPM_METRIC_MAX = 477  # pynvml 13.615.71 (nvml.h 12.9.79 has 210; a version-1 struct either way)
NVML_GPM_METRICS_GET_VERSION = 1
NVML_GPM_SUPPORT_VERSION = 1
NVML_DEVICE_MIG_DISABLE = 0x0  # nvml.h 12.9.79, pynvml
NVML_DEVICE_MIG_ENABLE = 0x1
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


class NVMLLibraryMismatchError(Exception):
    """pynvml >= 12.550.52: what its unversioned *RunningProcesses wrappers (@throwOnVersionMismatch)
    raise when the _v3 symbol they call is missing (NVMLError_FunctionNotFound)."""


class c_nvmlMemory_t(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


class c_nvmlMemory_v2_t(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("total", ctypes.c_ulonglong),
                ("reserved", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


class c_nvmlValue_t(ctypes.Union):
    """pynvml 13.615.71's c_nvmlValue_t (nvml.h nvmlValue_t): one 8-byte value, read by valueType."""

    _fields_ = [("dVal", ctypes.c_double), ("uiVal", ctypes.c_uint), ("ulVal", ctypes.c_ulong),
                ("ullVal", ctypes.c_ulonglong), ("sllVal", ctypes.c_longlong),
                ("siVal", ctypes.c_int), ("usVal", ctypes.c_ushort)]


class c_nvmlFieldValue_t(ctypes.Structure):
    """pynvml 13.615.71's c_nvmlFieldValue_t (nvml.h nvmlFieldValue_t; valueType and nvmlReturn
    are C enums, c_uint in pynvml)."""

    _fields_ = [("fieldId", ctypes.c_uint32), ("scopeId", ctypes.c_uint32),
                ("timestamp", ctypes.c_int64), ("latencyUsec", ctypes.c_int64),
                ("valueType", ctypes.c_uint), ("nvmlReturn", ctypes.c_uint),
                ("value", c_nvmlValue_t)]


class c_nvmlC2cModeInfo_v1_t(ctypes.Structure):
    _fields_ = [("isC2cEnabled", ctypes.c_uint)]  # nvml.h nvmlC2cModeInfo_v1_t, pynvml


class c_nvmlGpmSupport_t(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("isSupportedDevice", ctypes.c_uint)]


class c_nvmlGpmMetric_t(ctypes.Structure):
    """pynvml's c_nvmlGpmMetric_t without metricInfo's three name pointers (never read here)."""

    _fields_ = [("metricId", ctypes.c_uint), ("nvmlReturn", ctypes.c_uint),
                ("value", ctypes.c_double)]


class c_nvmlGpmMetricsGet_t(ctypes.Structure):
    """pynvml's c_nvmlGpmMetricsGet_t; the samples are the fake's FakeGpmSample objects (in
    pynvml, pointers to NVML's opaque sample buffers)."""

    _fields_ = [("version", ctypes.c_uint), ("numMetrics", ctypes.c_uint),
                ("sample1", ctypes.py_object), ("sample2", ctypes.py_object),
                ("metrics", c_nvmlGpmMetric_t * NVML_GPM_METRIC_MAX)]


@dataclass
class FakeGpmSample:
    """An NVML GPM sample buffer: what nvmlGpmSampleGet read into it (None until then)."""

    gpu: int | None = None
    taken_at: float = 0.0
    counted: dict = field(default_factory=dict)  # GPM metric id -> bytes counted to taken_at
    freed: bool = False


class nvmlPciInfo_t(ctypes.Structure):
    _fields_ = [("busIdLegacy", ctypes.c_char * 16), ("domain", ctypes.c_uint),
                ("bus", ctypes.c_uint), ("device", ctypes.c_uint), ("pciDeviceId", ctypes.c_uint),
                ("pciSubSystemId", ctypes.c_uint), ("busId", ctypes.c_char * 32)]


class c_nvmlUtilization_t(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class nvmlFriendlyObject:
    """What pynvml returns for each running process: the fields of c_nvmlProcessInfo_v2_t (pid,
    usedGpuMemory, gpuInstanceId, computeInstanceId; nvml.h nvmlProcessInfo_v2_t, which the _v2 and
    _v3 entry points both fill), usedGpuMemory None where NVML reports NVML_VALUE_NOT_AVAILABLE."""

    def __init__(self, fields: dict) -> None:
        self.__dict__.update(fields)


# A pid from another pid namespace (the agent in a container without hostPID): NVML lists host
# pids, which this host's /proc (the fixture's holds 1, 4242, 5151) does not have.
FOREIGN_PID = 3_141_592
PROCESS_KINDS = ("compute", "graphics", "mps")
NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId/computeInstanceId without MIG (nvml.h)


@dataclass
class FakeProcess:
    pid: int
    name: str | None  # None: nvmlSystemGetProcessName answers NOT_FOUND (e.g. a foreign pid)
    used_gpu_memory_bytes: int | None  # None: NVML cannot tell (pynvml reports None)
    # The lists NVML shows it in: CUDA -> compute, OpenGL/Vulkan -> graphics, MPS clients -> mps.
    kinds: tuple[str, ...] = ("compute",)
    gpu_instance_id: int | None = None  # the MIG GPU instance; None without MIG


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
    numa_node: int | None  # None: nvmlDeviceGetNumaNodeId is not supported (every x86 PCIe host)
    processes: list[FakeProcess] = field(default_factory=list)
    mig_mode: int | None = None  # NVML_DEVICE_MIG_ENABLE/DISABLE; None: no MIG (NOT_SUPPORTED)
    # What nvmlDeviceGetCurrPcieLinkGeneration answers while the GPU is idle (no kernel, no PCIe
    # traffic): power-saving GPUs retrain to Gen1 (anchors.md); None keeps link_generation.
    idle_link_generation: int | None = 1
    # PCIe traffic over time; the rates above are its level while on. On for pcie_duty of every
    # pcie_period_seconds, at a random place in each period (seeded by pcie_traffic_seed, periods
    # independent): bursty traffic no sampler can lock its phase to. Duty 1 (default): constant.
    pcie_duty: float = 1.0
    pcie_period_seconds: float = 0.5
    pcie_traffic_seed: int = 0
    # nvmlDeviceGetFieldValues PCIE_COUNT_RX/TX_BYTES: None answers as the driver version says
    # (fields 197/198 are new in R555; older drivers answer NOT_SUPPORTED per field, an assumption
    # from NVML's per-field nvmlReturn, not observed), False NOT_SUPPORTED (GPUs without them),
    # True counts. pcie_counter_value_type: nvml.h does not say; unsigned long long is assumed
    # (as tests/support/stub_nvml does). pcie_counter_start_bytes: the count at the first call
    # (near 2**64 to see the wrap nvml.h announces).
    pcie_byte_counters: bool | None = None
    pcie_counter_value_type: int = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    pcie_counter_start_bytes: int = 0
    # GPM (nvmlGpmQueryDeviceSupport): nvml.h names Hopper and newer; False answers
    # isSupportedDevice 0 (as on the L40S and A10 of the defaults).
    gpm_supported: bool = False
    # NVLink-C2C: c2c_enabled None answers nvmlDeviceGetC2cModeInfoV NOT_SUPPORTED (x86 PCIe
    # hosts); c2c_links one [up, MBps] per link (fields 171/172 with the link as scopeId: the
    # stub's assumption, exporters/nvml.py c2c_links); the C2C traffic GPM reports, constant.
    c2c_enabled: bool | None = None
    c2c_links: list = field(default_factory=list)
    c2c_rx_mib_per_second: float = 0.0
    c2c_tx_mib_per_second: float = 0.0

    @classmethod
    def from_dict(cls, data: dict) -> "FakeGpu":
        processes = [FakeProcess(**{**p, "kinds": tuple(p.get("kinds", ("compute",)))})
                     for p in data.get("processes", [])]
        return cls(**{**data, "processes": processes})

    @property
    def idle(self) -> bool:
        return (self.utilization_percent == 0 and self.pcie_rx_kilobytes_per_second == 0
                and self.pcie_tx_kilobytes_per_second == 0)


XORG_PID = 2101  # a headless X server with a context on each GPU: the graphics list only


def _unit_random(seed: int, period: int) -> float:
    """A uniform [0, 1) number fixed by (seed, period): splitmix64, so the traffic of any period
    can be computed again without keeping state."""
    z = (seed * 0x9E3779B97F4A7C15 + period * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return ((z ^ (z >> 31)) >> 11) / 2**53


def _pcie_on_until(gpu: FakeGpu, t: float) -> float:
    """Seconds the GPU's PCIe traffic was on in [0, t) (its burst model, FakeGpu)."""
    period = gpu.pcie_period_seconds
    on = gpu.pcie_duty * period
    index = math.floor(t / period)
    into = t - index * period
    start = _unit_random(gpu.pcie_traffic_seed, index) * period
    end = start + on
    if end <= period:
        part = min(max(into - start, 0.0), on)
    else:  # the burst wraps to the start of its period
        part = min(into, end - period) + min(max(into - start, 0.0), period - start)
    return index * on + part


def pcie_on_seconds(gpu: FakeGpu, start: float, end: float) -> float:
    """Seconds of [start, end) in which the GPU's PCIe traffic is on."""
    if gpu.pcie_duty >= 1:
        return end - start
    if gpu.pcie_duty <= 0:
        return 0.0
    return _pcie_on_until(gpu, end) - _pcie_on_until(gpu, start)


def default_gpus() -> list[FakeGpu]:
    """The fixture host's two GPUs as a real x86 host's NVML shows them (module docstring)."""
    return [
        FakeGpu("NVIDIA L40S", "GPU-0a1b2c3d-0000-4000-8000-000000000000", "00000000:17:00.0",
                48 * GIB, 31 * GIB, 512 * MIB, 1_200_000, 300_000, 4, 16, 4, 16, 0, 87, None,
                [FakeProcess(4242, "python3", 30 * GIB),
                 FakeProcess(XORG_PID, "Xorg", 18 * MIB, ("graphics",))]),
        FakeGpu("NVIDIA A10", "GPU-1a1b2c3d-0000-4000-8000-000000000001", "00000000:CA:00.0",
                24 * GIB, 11 * GIB, 384 * MIB, 250_000, 80_000, 3, 8, 4, 16, 17, 35, None,
                [FakeProcess(5151, "llama-server", 10 * GIB),
                 FakeProcess(XORG_PID, "Xorg", 12 * MIB, ("graphics",))]),
    ]


def mig_gpu(uuid: str = "GPU-2a1b2c3d-0000-4000-8000-000000000002",
            bus_id: str = "00000000:3B:00.0") -> FakeGpu:
    """An H100 with MIG on and two GPU instances, each running a process, as the parent handle
    shows it: MigMode ENABLE, utilization NOT_SUPPORTED (nvml.h: "On MIG-enabled GPUs, querying
    device utilization rates is not currently supported"), process lists NO_PERMISSION (nvml.h:
    the parent gives aggregate information "only if the caller has appropriate privileges")."""
    return FakeGpu("NVIDIA H100 80GB HBM3", uuid, bus_id, 80 * GIB, 30 * GIB, 600 * MIB,
                   400_000, 100_000, 5, 16, 5, 16, 0, 0, None,
                   [FakeProcess(6161, "python3", 20 * GIB, gpu_instance_id=1),
                    FakeProcess(6262, "python3", 9 * GIB, gpu_instance_id=2)],
                   mig_mode=NVML_DEVICE_MIG_ENABLE)


def grace_hopper_gpu(uuid: str = "GPU-3a1b2c3d-0000-4000-8000-000000000003",
                     bus_id: str = "00000009:01:00.0") -> FakeGpu:
    """A GH200's Hopper GPU, simulated: GPM supported (nvml.h: Hopper and newer), NVLink-C2C on
    with 10 links at 45,000 MBps each (450 GB/s a direction: NVIDIA's 900 GB/s bidirectional
    NVLink-C2C figure spread over the links; the per-link split is this fake's choice), its GPU
    memory a NUMA node (nvmlDeviceGetNumaNodeId answers 2), no PCIe byte counters (driver 550),
    and KV offload traffic crossing C2C at 40 GiB/s in, 10 GiB/s out while PCIe idles."""
    return FakeGpu("NVIDIA GH200 480GB", uuid, bus_id, 96 * GIB, 70 * GIB, 640 * MIB,
                   2_500, 1_700, 5, 16, 5, 16, 0, 60, 2,
                   [FakeProcess(7171, "python3", 70 * GIB)],
                   idle_link_generation=None, gpm_supported=True, c2c_enabled=True,
                   c2c_links=[[True, 45_000] for _ in range(10)],
                   c2c_rx_mib_per_second=40 * 1024, c2c_tx_mib_per_second=10 * 1024)


def uniform_gpus(count: int) -> list[FakeGpu]:
    """`count` identical L40S GPUs (for benchmarks and many-GPU tests), each with one process."""
    return [
        FakeGpu("NVIDIA L40S", f"GPU-{index:08x}-0000-4000-8000-000000000000",
                f"00000000:{(0x17 + index * 0x10) % 0x100:02X}:00.0", 48 * GIB, 20 * GIB, 512 * MIB,
                1_000_000, 250_000, 4, 16, 4, 16, 0, 50, None,
                [FakeProcess(10_000 + index, "python3", 19 * GIB)])
        for index in range(count)
    ]


@dataclass(frozen=True)
class FakeHandle:
    index: int


class FakeNvml:
    """One fake NVML library. Its state is plain attributes; `calls` counts each C entry point."""

    SETTINGS = ("library_missing", "memory_v2_supported", "throughput_delay_seconds",
                "process_entry_points", "binding_lacks", "privileged")

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
        # The process-list C symbols the driver's libnvidia-ml.so.1 has ("v3", "v2"); drivers that
        # predate the _v3 entry points answer _v3 with FunctionNotFound.
        self.process_entry_points: tuple[str, ...] = ("v3", "v2")
        # pynvml functions this binding lacks (getattr raises AttributeError), as nvidia-ml-py
        # 12.535.x lacks nvmlDeviceGetNumaNodeId and every *RunningProcesses_v2.
        self.binding_lacks: tuple[str, ...] = ()
        self.throughput_delay_seconds = 0.0
        # Root (or CAP_SYS_ADMIN): nvml.h lets the parent GPU of MIG instances list their
        # processes, each with its gpuInstanceId, only for privileged callers.
        self.privileged = False
        self.gpm_samples: list[FakeGpmSample] = []
        # gpu -> [time, {metric: bytes}] counted to: each sample integrates the GPU's levels since
        # the last one, so a level that changed between samples counts from when it changed
        self._gpm_counted: dict[int, list] = {}
        # GPM's own time: a simulation that runs faster than real time hands its clock here (and to
        # the agent's Nvml) without changing the 20 ms windows' real sleeps
        self.gpm_clock: Callable[[], float] | None = None
        self.throughput_in_flight = 0
        self.max_throughput_in_flight = 0  # the most nvmlDeviceGetPcieThroughput calls at once
        self.calls: Counter[str] = Counter()
        self.lost: set[int] = set()
        self._failures: list[list] = []  # [function or "*", gpu or None, error class, times left]
        self._hangs: dict[tuple[str, int], float] = {}  # (function, gpu) -> seconds it blocks
        self._init_count = 0
        # Time for the PCIe traffic model: NVML's timestamps are wall-clock microseconds; a
        # simulation swaps in its own clock and sleep (use_clock).
        self.clock = time.time
        self.sleep = time.sleep
        self._pcie_counted: dict[int, list] = {}  # gpu -> [time, rx bytes, tx bytes] counted to

    def configure(self, gpus: list[FakeGpu] | None = None, driver_version: str | None = None,
                  **settings: Any) -> None:
        """Replace the GPUs and/or set one of SETTINGS."""
        if gpus is not None:
            self.gpus = list(gpus)
        if driver_version is not None:
            self.driver_version = driver_version
        for name, value in settings.items():
            if name not in self.SETTINGS:
                raise TypeError(f"FakeNvml has no setting {name!r}")
            setattr(self, name, tuple(value) if isinstance(value, list) else value)

    def use_clock(self, clock, sleep) -> None:
        """Drive the PCIe traffic model (and the throughput call's wait) from a simulated clock."""
        self.clock, self.sleep = clock, sleep

    def fail(self, function_name: str, error: type | str, gpu: int | None = None,
             times: int | None = None) -> None:
        """Make `function_name` ("*" for every call) raise `error` (a class or its name), on one GPU
        or all, `times` times or until heal()."""
        error_class = globals()[error] if isinstance(error, str) else error
        with self._lock:
            self._failures.append([function_name, gpu, error_class, times])

    def hang(self, function_name: str, gpu: int, seconds: float) -> None:
        """Make `function_name` on one GPU block `seconds` before answering (0: stop), as NVML
        calls do on a GPU falling off the bus (sampler.py: "NVML can hang")."""
        with self._lock:
            self._hangs[(function_name, gpu)] = seconds

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
        fields]], and optionally any of SETTINGS}. binding_lacks hides functions of FakeNvml
        instances only: the module's functions are bound to DEFAULT at import."""
        with open(path, encoding="utf-8") as handle:
            layout = json.load(handle)
        gpus = [FakeGpu.from_dict(gpu) for gpu in layout.pop("gpus", [])] or None
        self.configure(gpus=gpus, **layout)

    def dump_layout(self, path: str) -> None:
        layout = {"driver_version": self.driver_version,
                  "gpus": [asdict(gpu) for gpu in self.gpus],
                  **{name: getattr(self, name) for name in self.SETTINGS}}
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
        hang = self._hangs.get((function, None if handle is None else handle.index))
        if hang:
            time.sleep(hang)  # real time: the collector's budget is real time
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
        start = self.clock()
        try:
            if self.throughput_delay_seconds:
                self.sleep(self.throughput_delay_seconds)  # real NVML samples a 20 ms window
        finally:
            with self._lock:
                self.throughput_in_flight -= 1
        if counter == NVML_PCIE_UTIL_RX_BYTES:
            level = gpu.pcie_rx_kilobytes_per_second
        elif counter == NVML_PCIE_UTIL_TX_BYTES:
            level = gpu.pcie_tx_kilobytes_per_second
        else:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if gpu.pcie_duty >= 1:
            return level
        # nvml.h: the bytes counted over a 20 ms window, in KB/s (unsigned int, so truncated).
        on = pcie_on_seconds(gpu, start, start + PCIE_SAMPLE_WINDOW_SECONDS)
        return int(level * on / PCIE_SAMPLE_WINDOW_SECONDS)

    def nvmlDeviceGetFieldValues(self, handle: FakeHandle, fieldIds: list) -> ctypes.Array:
        """As pynvml: a ctypes array of c_nvmlFieldValue_t, each with its own nvmlReturn (nvml.h:
        "you must check the nvmlReturn field of each value"); the call itself fails only for the
        device. Fields other than the PCIe byte counters answer NOT_SUPPORTED here."""
        gpu = self._enter("nvmlDeviceGetFieldValues", handle)
        values = (c_nvmlFieldValue_t * len(fieldIds))()
        for i, field_id in enumerate(fieldIds):
            try:
                (values[i].fieldId, values[i].scopeId) = field_id
            except TypeError:
                values[i].fieldId = field_id
        supported = gpu.pcie_byte_counters
        if supported is None:
            supported = int(self.driver_version.split(".")[0]) >= PCIE_COUNTERS_SINCE_DRIVER
        counted = self._pcie_count(handle.index, gpu) if supported else None
        for value in values:
            value.timestamp = int(self.clock() * 1e6)
            if self._c2c_field(gpu, value):
                continue
            if counted is None or value.fieldId not in (NVML_FI_DEV_PCIE_COUNT_RX_BYTES,
                                                         NVML_FI_DEV_PCIE_COUNT_TX_BYTES):
                value.nvmlReturn = NVML_ERROR_NOT_SUPPORTED
                continue
            count = counted[0] if value.fieldId == NVML_FI_DEV_PCIE_COUNT_RX_BYTES else counted[1]
            value.timestamp = int(counted[2] * 1e6)
            value.valueType = gpu.pcie_counter_value_type
            value.nvmlReturn = NVML_SUCCESS
            if gpu.pcie_counter_value_type == NVML_VALUE_TYPE_UNSIGNED_INT:
                value.value.uiVal = count % 2**32
            else:
                value.value.ullVal = count % 2**64  # "Value can be wrapped" (nvml.h)
        return values

    @staticmethod
    def _c2c_field(gpu: FakeGpu, value: c_nvmlFieldValue_t) -> bool:
        """Fill one NVLink-C2C field (170-172) where the GPU has C2C; False for other fields.
        valueType unsigned int for the count and status, unsigned long long for the speed: nvml.h
        does not say, the stub assumes the same."""
        if gpu.c2c_enabled is None or value.fieldId not in (
                NVML_FI_DEV_C2C_LINK_COUNT, NVML_FI_DEV_C2C_LINK_GET_STATUS,
                NVML_FI_DEV_C2C_LINK_GET_MAX_BW):
            return False
        if value.fieldId == NVML_FI_DEV_C2C_LINK_COUNT:
            value.valueType, value.value.uiVal = NVML_VALUE_TYPE_UNSIGNED_INT, len(gpu.c2c_links)
        elif value.scopeId >= len(gpu.c2c_links):
            value.nvmlReturn = NVML_ERROR_INVALID_ARGUMENT
            return True
        elif value.fieldId == NVML_FI_DEV_C2C_LINK_GET_STATUS:
            value.valueType = NVML_VALUE_TYPE_UNSIGNED_INT
            value.value.uiVal = 1 if gpu.c2c_links[value.scopeId][0] else 0
        else:
            value.valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            value.value.ullVal = gpu.c2c_links[value.scopeId][1]
        value.nvmlReturn = NVML_SUCCESS
        return True

    # --- NVLink-C2C and GPM ----------------------------------------------------------------
    def nvmlDeviceGetC2cModeInfoV(self, handle: FakeHandle) -> c_nvmlC2cModeInfo_v1_t:
        gpu = self._enter("nvmlDeviceGetC2cModeInfoV", handle)
        if gpu.c2c_enabled is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return c_nvmlC2cModeInfo_v1_t(isC2cEnabled=1 if gpu.c2c_enabled else 0)

    def nvmlGpmQueryDeviceSupport(self, handle: FakeHandle) -> c_nvmlGpmSupport_t:
        gpu = self._enter("nvmlGpmQueryDeviceSupport", handle)
        return c_nvmlGpmSupport_t(version=NVML_GPM_SUPPORT_VERSION,
                                  isSupportedDevice=1 if gpu.gpm_supported else 0)

    def nvmlGpmSampleAlloc(self) -> FakeGpmSample:
        self._enter("nvmlGpmSampleAlloc")
        sample = FakeGpmSample()
        self.gpm_samples.append(sample)
        return sample

    def nvmlGpmSampleFree(self, sample: FakeGpmSample) -> None:
        self._enter("nvmlGpmSampleFree")
        sample.freed = True

    def nvmlGpmSampleGet(self, handle: FakeHandle, sample: FakeGpmSample) -> FakeGpmSample:
        """Reads the bytes moved so far: PCIe from the same traffic model as the byte counters,
        C2C at the GPU's constant rates (MiB/s, nvml.h's unit for both GPM metrics)."""
        gpu = self._enter("nvmlGpmSampleGet", handle)
        if not gpu.gpm_supported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        now = (self.gpm_clock or self.clock)()
        with self._lock:
            # Counted from the GPU's first sample: bytes since 1970 would lose precision in a double.
            since, counted = self._gpm_counted.setdefault(handle.index, [now, dict.fromkeys(GPM_MODELLED, 0.0)])
            seconds = max(now - since, 0.0)
            on = pcie_on_seconds(gpu, since, now) if now > since else 0.0
            counted = {NVML_GPM_METRIC_PCIE_RX_PER_SEC: counted[NVML_GPM_METRIC_PCIE_RX_PER_SEC]
                       + gpu.pcie_rx_kilobytes_per_second * 1024 * on,
                       NVML_GPM_METRIC_PCIE_TX_PER_SEC: counted[NVML_GPM_METRIC_PCIE_TX_PER_SEC]
                       + gpu.pcie_tx_kilobytes_per_second * 1024 * on,
                       NVML_GPM_METRIC_C2C_TOTAL_RX_PER_SEC: counted[NVML_GPM_METRIC_C2C_TOTAL_RX_PER_SEC]
                       + gpu.c2c_rx_mib_per_second * MIB * seconds,
                       NVML_GPM_METRIC_C2C_TOTAL_TX_PER_SEC: counted[NVML_GPM_METRIC_C2C_TOTAL_TX_PER_SEC]
                       + gpu.c2c_tx_mib_per_second * MIB * seconds}
            self._gpm_counted[handle.index] = [max(now, since), counted]
        sample.gpu, sample.taken_at, sample.counted = handle.index, now, dict(counted)
        return sample

    def nvmlGpmMetricsGet(self, request: c_nvmlGpmMetricsGet_t) -> c_nvmlGpmMetricsGet_t:
        """Each requested metric over sample1 -> sample2; metrics the fake does not model answer
        NOT_SUPPORTED per metric, as nvml.h's per-metric nvmlReturn allows."""
        self._enter("nvmlGpmMetricsGet")
        first, second = request.sample1, request.sample2
        if (request.version != NVML_GPM_METRICS_GET_VERSION or first.gpu is None
                or first.gpu != second.gpu or second.taken_at <= first.taken_at):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        seconds = second.taken_at - first.taken_at
        for slot in range(request.numMetrics):
            metric = request.metrics[slot]
            if metric.metricId in second.counted:
                moved = second.counted[metric.metricId] - first.counted[metric.metricId]
                metric.value, metric.nvmlReturn = moved / seconds / MIB, NVML_SUCCESS
            else:
                metric.nvmlReturn = NVML_ERROR_NOT_SUPPORTED
        return request

    def _pcie_count(self, index: int, gpu: FakeGpu) -> tuple[int, int, float]:
        """The byte counters now: the traffic model integrated since the last call, at the GPU's
        current levels (a level changed between two calls counts from the earlier one)."""
        now = self.clock()
        with self._lock:
            since, rx, tx = self._pcie_counted.setdefault(
                index, [now, gpu.pcie_counter_start_bytes, gpu.pcie_counter_start_bytes])
            on = pcie_on_seconds(gpu, since, now) if now > since else 0.0
            rx += round(gpu.pcie_rx_kilobytes_per_second * 1024 * on)
            tx += round(gpu.pcie_tx_kilobytes_per_second * 1024 * on)
            self._pcie_counted[index] = [max(now, since), rx, tx]
        return rx, tx, now

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: FakeHandle) -> int:
        gpu = self._enter("nvmlDeviceGetCurrPcieLinkGeneration", handle)
        if gpu.idle and gpu.idle_link_generation is not None:
            return min(gpu.link_generation, gpu.idle_link_generation)
        return gpu.link_generation

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
        if gpu.mig_mode == NVML_DEVICE_MIG_ENABLE:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)  # nvml.h, nvmlDeviceGetUtilizationRates
        return c_nvmlUtilization_t(gpu=gpu.utilization_percent, memory=gpu.utilization_percent // 2)

    def nvmlDeviceGetNumaNodeId(self, handle: FakeHandle) -> int:
        gpu = self._enter("nvmlDeviceGetNumaNodeId", handle)
        if gpu.numa_node is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return gpu.numa_node

    def nvmlDeviceGetMigMode(self, handle: FakeHandle) -> list[int]:
        gpu = self._enter("nvmlDeviceGetMigMode", handle)
        if gpu.mig_mode is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)  # nvml.h: "doesn't support MIG mode"
        return [gpu.mig_mode, gpu.mig_mode]  # pynvml: [current, pending]

    # --- process lists: pynvml's three wrappers per list ------------------------------------
    def _processes(self, handle: FakeHandle, kind: str, entry_point: str) -> list[nvmlFriendlyObject]:
        """One C call, "nvmlDevice<List>_<v3|v2>", as pynvml makes it."""
        function = {"compute": "nvmlDeviceGetComputeRunningProcesses",
                    "graphics": "nvmlDeviceGetGraphicsRunningProcesses",
                    "mps": "nvmlDeviceGetMPSComputeRunningProcesses"}[kind] + "_" + entry_point
        gpu = self._enter(function, handle)
        if entry_point not in self.process_entry_points:
            # pynvml's _nvmlGetFunctionPointer: a symbol libnvidia-ml.so.1 lacks
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        if gpu.mig_mode == NVML_DEVICE_MIG_ENABLE and not self.privileged:
            raise NVMLError(NVML_ERROR_NO_PERMISSION)  # nvml.h: parent handle, unprivileged
        return [nvmlFriendlyObject({
            "pid": p.pid, "usedGpuMemory": p.used_gpu_memory_bytes,
            "gpuInstanceId": NO_INSTANCE if p.gpu_instance_id is None else p.gpu_instance_id,
            "computeInstanceId": NO_INSTANCE if p.gpu_instance_id is None else 0})
            for p in gpu.processes if kind in p.kinds]

    def _unversioned(self, handle: FakeHandle, kind: str) -> list[nvmlFriendlyObject]:
        # pynvml >= 12.550.52: the unversioned name calls _v3 under @throwOnVersionMismatch.
        try:
            return self._processes(handle, kind, "v3")
        except NVMLError as error:
            if error.value != NVML_ERROR_FUNCTION_NOT_FOUND:
                raise
            raise NVMLLibraryMismatchError("Unversioned function called and the pyNVML version "
                                           "does not match the NVML lib version.") from None

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle):
        return self._processes(handle, "compute", "v3")

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle):
        return self._processes(handle, "compute", "v2")

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return self._unversioned(handle, "compute")

    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, handle):
        return self._processes(handle, "graphics", "v3")

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle):
        return self._processes(handle, "graphics", "v2")

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle):
        return self._unversioned(handle, "graphics")

    def nvmlDeviceGetMPSComputeRunningProcesses_v3(self, handle):
        return self._processes(handle, "mps", "v3")

    def nvmlDeviceGetMPSComputeRunningProcesses_v2(self, handle):
        return self._processes(handle, "mps", "v2")

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle):
        return self._unversioned(handle, "mps")

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        self._enter("nvmlSystemGetProcessName")
        for gpu in self.gpus:
            for process in gpu.processes:
                if process.pid == pid and process.name is not None:
                    return process.name
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    def __getattribute__(self, name: str) -> Any:
        # An older nvidia-ml-py: the module has no such function (binding_lacks).
        if name.startswith("nvml") and name in object.__getattribute__(self, "__dict__").get(
                "binding_lacks", ()):
            raise AttributeError(f"module 'pynvml' has no attribute {name!r}")
        return object.__getattribute__(self, name)


for _name, _value in list(globals().items()):
    if _name.startswith(("NVML_", "NVMLError", "nvmlMemory_", "NVMLLibraryMismatchError",
                         "c_nvml")):
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
