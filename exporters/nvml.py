"""The only gate to NVML (the `pynvml` module of nvidia-ml-py).

Every NVML call goes through `Nvml._attempt`, which hands `source.call` a key such as
"nvml.nvmlDeviceGetMemoryInfo(0,v2)" (function, GPU index, distinguishing arguments; never a ctypes
handle) and a fetch that calls the module and turns the answer into plain JSON data. Device handles
are looked up inside the fetch, so a replay (module=None) imports nothing and runs no fetch.

Errors are classified by class name, so real pynvml errors, the test fake's and replayed ones
(exporters.sources.ReplayedCallError carries `type_name`) behave alike:
- NotSupported, FunctionNotFound (driver too old): the value is unsupported (None), logged once;
- LibraryNotFound, DriverNotLoaded at init: NoDataError telling the operator to install the driver;
- GpuIsLost (and Unknown right after it on the same GPU): GpuLostError for that GPU;
- anything else (Timeout, NoPermission, ...): the value is absent this time, logged once per
  function and error.
"""
from __future__ import annotations

import ctypes
import importlib
import logging
import re
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Iterable

from hybridmon.exporters.sources import TraceMissError
from hybridmon.exporters.base import CollectorError, LogOnce, NoDataError, ParseError

logger = logging.getLogger(__name__)

# What NVML (and pynvml on Linux) reports for "this process's GPU memory is not known".
NVML_VALUE_NOT_AVAILABLE = 2**64 - 1

DRIVER_MISSING_MESSAGES = {
    "NVMLError_LibraryNotFound": (
        "NVIDIA driver not found (libnvidia-ml.so.1 could not be loaded): GPU metrics are absent; "
        "install the NVIDIA driver (it ships libnvidia-ml.so.1) if this host has NVIDIA GPUs"
    ),
    "NVMLError_DriverNotLoaded": (
        "NVIDIA driver not loaded (libnvidia-ml.so.1 is present but the nvidia kernel module is "
        "not running): GPU metrics are absent; load it (modprobe nvidia) or reinstall the driver"
    ),
}
_PCI_BUS_ID = re.compile(r"([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])")
OK, UNSUPPORTED, FAILED = "ok", "unsupported", "failed"
UNSUPPORTED_ERRORS = frozenset({
    "NVMLError_NotSupported",
    "NVMLError_FunctionNotFound",
    "NVMLError_ArgumentVersionMismatch",
    "NVMLLibraryMismatchError",  # pynvml's wrapper of FunctionNotFound for unversioned calls
})


class GpuLostError(Exception):
    """NVML says the GPU fell off the bus (GPU_IS_LOST); it needs a reset or a reboot."""

    def __init__(self, gpu: int) -> None:
        super().__init__(f"GPU {gpu} is lost (NVML_ERROR_GPU_IS_LOST): reset it or reboot")
        self.gpu = gpu


@dataclass(frozen=True, slots=True)
class GpuProcess:
    pid: int
    used_memory_bytes: int | None


def normalize_pci_bus_id(bus_id: str) -> str:
    """NVML's "00000000:17:00.0" as sysfs writes it: "0000:17:00.0" (lowercase, 4+ hex domain)."""
    match = _PCI_BUS_ID.fullmatch(bus_id.strip())
    if match is None:
        raise ParseError(f"not a PCI bus id: {bus_id[:40]!r}")
    domain, bus, device, function = (int(part, 16) for part in match.groups())
    if device > 0x1F:
        raise ParseError(f"PCI device number out of range in {bus_id!r}")
    return f"{domain:04x}:{bus:02x}:{device:02x}.{function:x}"


def to_plain(value: Any) -> Any:
    """An NVML answer as JSON data: structs become dicts of their _fields_, bytes become str."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, (ctypes.Structure, ctypes.Union)):
        return {field[0]: to_plain(getattr(value, field[0])) for field in value._fields_}
    if isinstance(value, (ctypes.Array, list, tuple)):
        return [to_plain(item) for item in value]
    if hasattr(value, "__dict__"):  # pynvml's nvmlFriendlyObject (process lists)
        return {key: to_plain(item) for key, item in vars(value).items() if not key.startswith("_")}
    raise TypeError(f"cannot record an NVML answer of type {type(value).__name__}")


def error_name(error: BaseException) -> str:
    return getattr(error, "type_name", None) or type(error).__name__


def _is_nvml_error(name: str) -> bool:
    return name.startswith("NVMLError") or name == "NVMLLibraryMismatchError"


class Nvml:
    """NVML through a RawSource. module: "pynvml" (or another dotted name), a module object, or
    None to replay a trace. Methods name their units; None means unsupported or absent now."""

    def __init__(self, source, module: str | ModuleType | Any | None = "pynvml", *,
                 clock: Callable[[], float] = time.monotonic,
                 init_retry_seconds: float = 60.0) -> None:
        self._source = source
        self._module_spec = module
        self._module: Any = None
        self._clock = clock
        self._init_retry_seconds = init_retry_seconds
        self._log_once = LogOnce(logger)
        self._init_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._initialized = False
        self._init_error: Exception | None = None
        self._next_init_attempt = 0.0
        self._handles: dict[int, Any] = {}
        self._static: dict[tuple[str, int | None], Any] = {}
        self._lost: set[int] = set()
        self._answers: dict[int, int] = {}
        self._memory_version: str | None = None
        self._process_names: dict[int, str] = {}

    # --- lifecycle -------------------------------------------------------------------------
    def _ensure_initialized(self) -> None:
        if self._initialized:
            return
        with self._init_lock:
            if self._initialized:
                return
            replaying = self._module_spec is None
            now = self._clock()
            if self._init_error is not None and not replaying and now < self._next_init_attempt:
                raise self._init_error
            self._next_init_attempt = now + self._init_retry_seconds
            module = self._load_module()
            try:
                self._source.call("nvml.nvmlInit()", lambda: to_plain(module.nvmlInit()))
            except TraceMissError:
                # The recording skipped this retry (it retries at most every init_retry_seconds).
                if replaying and self._init_error is not None:
                    raise self._init_error from None
                raise
            except Exception as error:
                name = error_name(error)
                if name in DRIVER_MISSING_MESSAGES:
                    failure: Exception = NoDataError(DRIVER_MISSING_MESSAGES[name])
                elif _is_nvml_error(name):
                    failure = CollectorError(f"NVML initialisation failed ({name}: {error}); "
                                             f"retrying every {self._init_retry_seconds:g} s")
                else:
                    raise
                # Not logged here: the sampler logs every NoDataError/CollectorError once.
                self._init_error = failure
                raise failure from error
            if self._init_error is not None:
                logger.warning("NVML initialised after an earlier failure; GPU metrics resume")
            self._init_error = None
            self._initialized = True

    def _load_module(self) -> Any:
        if self._module is None and isinstance(self._module_spec, str):
            try:
                self._module = importlib.import_module(self._module_spec)
            except ImportError as error:
                raise NoDataError(f"cannot import {self._module_spec!r} ({error}): GPU metrics "
                                  "are absent; install nvidia-ml-py") from error
        elif self._module is None:
            self._module = self._module_spec
        return self._module

    def close(self) -> None:
        """Shut NVML down. Not recorded: it happens between collects and changes no reading."""
        with self._init_lock:
            if self._initialized and self._module is not None:
                try:
                    self._module.nvmlShutdown()
                except Exception as error:  # shutting down must not fail the agent's exit
                    logger.debug("nvmlShutdown failed: %s", error)
            self._initialized = False
            self._handles.clear()

    # --- the one call path -----------------------------------------------------------------
    def _handle(self, gpu: int) -> Any:
        handle = self._handles.get(gpu)
        if handle is None:
            handle = self._handles[gpu] = self._module.nvmlDeviceGetHandleByIndex(gpu)
        return handle

    def _attempt(self, gpu: int | None, function: str, args: tuple = (), *call_args: Any,
                 **call_kwargs: Any) -> tuple[str, Any]:
        """(OK, value), (UNSUPPORTED, None) or (FAILED, None); GpuLostError if the GPU is lost.

        `args` describe the call in the key; `call_args`/`call_kwargs` follow the handle."""
        self._ensure_initialized()
        parts = ((gpu,) if gpu is not None else ()) + args
        key = f"nvml.{function}({','.join(str(part) for part in parts)})"

        def fetch() -> Any:
            target = getattr(self._module, function)
            if gpu is None:
                return to_plain(target(*call_args, **call_kwargs))
            return to_plain(target(self._handle(gpu), *call_args, **call_kwargs))

        try:
            value = self._source.call(key, fetch)
        except Exception as error:
            name = error_name(error)
            if not _is_nvml_error(name):
                raise
            where = "" if gpu is None else f" on GPU {gpu}"
            if gpu is not None and (name == "NVMLError_GpuIsLost"
                                    or (name == "NVMLError_Unknown" and gpu in self._lost)):
                with self._state_lock:
                    newly_lost = gpu not in self._lost
                    self._lost.add(gpu)
                    self._handles.pop(gpu, None)
                if newly_lost:
                    logger.error("%s (%s in %s)", GpuLostError(gpu), name, function)
                raise GpuLostError(gpu) from error
            if name in UNSUPPORTED_ERRORS:
                self._log_once(f"unsupported:{function}", "NVML %s is not supported%s (%s: the "
                               "driver is too old or the GPU lacks it); its series are absent",
                               function, where, name, level=logging.INFO)
                return UNSUPPORTED, None
            self._log_once(f"failed:{function}:{name}", "NVML %s failed%s (%s: %s); the value is "
                           "absent until it succeeds", function, where, name, error)
            return FAILED, None
        if gpu is not None:
            with self._state_lock:
                self._answers[gpu] = self._answers.get(gpu, 0) + 1
                came_back = gpu in self._lost
                self._lost.discard(gpu)
            if came_back:
                logger.warning("GPU %d answers NVML again", gpu)
        return OK, value

    def _call(self, gpu: int | None, function: str, args: tuple = (), *call_args: Any,
              **call_kwargs: Any) -> Any:
        return self._attempt(gpu, function, args, *call_args, **call_kwargs)[1]

    def _cached(self, gpu: int | None, function: str) -> Any:
        """A value that never changes while NVML is loaded: read until it succeeds, then kept."""
        if (function, gpu) in self._static:
            return self._static[(function, gpu)]
        status, value = self._attempt(gpu, function)
        if status == OK:
            self._static[(function, gpu)] = value
        return value

    # --- system ----------------------------------------------------------------------------
    def device_count(self) -> int:
        """GPUs NVML enumerated at init (their indexes stay fixed while it is loaded)."""
        count = self._cached(None, "nvmlDeviceGetCount")
        if count is None:
            raise CollectorError("NVML could not count the GPUs (nvmlDeviceGetCount failed)")
        return int(count)

    def driver_version(self) -> str | None:
        return self._cached(None, "nvmlSystemGetDriverVersion")

    def memory_info_version(self) -> str | None:
        """"v2" or "v1", decided once: the first GPU that answers the v2 call settles it.

        Call this before reading GPUs concurrently, so the probe order (and a replay) is fixed."""
        if self._memory_version is None:
            for gpu in range(self.device_count()):
                try:
                    status, _ = self._attempt(gpu, "nvmlDeviceGetMemoryInfo", ("v2",),
                                              version=self._module_attr("nvmlMemory_v2"))
                except GpuLostError:
                    continue
                if status == OK:
                    self._memory_version = "v2"
                elif status == UNSUPPORTED:
                    self._memory_version = "v1"
                    logger.warning("NVML memory info v2 is unavailable on this driver; "
                                   "using v1, which has no reserved bytes and whose used bytes "
                                   "include driver-reserved memory on drivers >= 515")
                if self._memory_version is not None:
                    break
        return self._memory_version

    def _module_attr(self, name: str) -> Any:
        return None if self._module is None else getattr(self._module, name)

    # --- per GPU ---------------------------------------------------------------------------
    def name(self, gpu: int) -> str | None:
        return self._cached(gpu, "nvmlDeviceGetName")

    def uuid(self, gpu: int) -> str | None:
        return self._cached(gpu, "nvmlDeviceGetUUID")

    def answer_count(self, gpu: int) -> int:
        """How many NVML calls on this GPU have succeeded since start (cached values not counted)."""
        with self._state_lock:
            return self._answers.get(gpu, 0)

    def known_uuid(self, gpu: int) -> str | None:
        """The UUID read earlier, without calling NVML (for a GPU that is lost now)."""
        return self._static.get(("nvmlDeviceGetUUID", gpu))

    def pci_bus_id(self, gpu: int) -> str | None:
        """sysfs form, e.g. "0000:17:00.0", from nvmlDeviceGetPciInfo's busId."""
        info = self._cached(gpu, "nvmlDeviceGetPciInfo")
        if not info:
            return None
        try:
            return normalize_pci_bus_id(info.get("busId") or info.get("busIdLegacy") or "")
        except ParseError as error:
            self._log_once(f"pci:{gpu}", "GPU %d: %s", gpu, error)
            return None

    def pcie_link_max_generation(self, gpu: int) -> int | None:
        return self._cached(gpu, "nvmlDeviceGetMaxPcieLinkGeneration")

    def pcie_link_max_width_lanes(self, gpu: int) -> int | None:
        return self._cached(gpu, "nvmlDeviceGetMaxPcieLinkWidth")

    def pcie_link_generation(self, gpu: int) -> int | None:
        return self._call(gpu, "nvmlDeviceGetCurrPcieLinkGeneration")

    def pcie_link_width_lanes(self, gpu: int) -> int | None:
        return self._call(gpu, "nvmlDeviceGetCurrPcieLinkWidth")

    def pcie_replay_count(self, gpu: int) -> int | None:
        return self._call(gpu, "nvmlDeviceGetPcieReplayCounter")

    def memory_bytes(self, gpu: int) -> tuple[int, int, int | None] | None:
        """(used, total, reserved); reserved is None with v1. None until the version is decided."""
        version = self._memory_version
        if version == "v2":
            info = self._call(gpu, "nvmlDeviceGetMemoryInfo", ("v2",),
                              version=self._module_attr("nvmlMemory_v2"))
        elif version == "v1":
            info = self._call(gpu, "nvmlDeviceGetMemoryInfo", ("v1",))
        else:
            return None
        if info is None:
            return None
        return int(info["used"]), int(info["total"]), info.get("reserved")

    def pcie_throughput_bytes_per_second(self, gpu: int) -> tuple[int | None, int | None]:
        """(host_to_device, device_to_host) over NVML's 20 ms window; each direction blocks ~20 ms.

        NVML answers in KB/s; RX is what the GPU receives, i.e. host to device."""
        rx = self._call(gpu, "nvmlDeviceGetPcieThroughput", ("rx",),
                        self._module_attr("NVML_PCIE_UTIL_RX_BYTES"))
        tx = self._call(gpu, "nvmlDeviceGetPcieThroughput", ("tx",),
                        self._module_attr("NVML_PCIE_UTIL_TX_BYTES"))
        return (None if rx is None else int(rx) * 1024, None if tx is None else int(tx) * 1024)

    def utilization_ratio(self, gpu: int) -> float | None:
        """Share of the last sample period in which a kernel ran (nvmlDeviceGetUtilizationRates)."""
        rates = self._call(gpu, "nvmlDeviceGetUtilizationRates")
        return None if rates is None else rates["gpu"] / 100.0

    def numa_node(self, gpu: int) -> int | None:
        node = self._call(gpu, "nvmlDeviceGetNumaNodeId")
        return None if node is None or node < 0 else int(node)

    def compute_processes(self, gpu: int) -> list[GpuProcess] | None:
        processes = self._call(gpu, "nvmlDeviceGetComputeRunningProcesses")
        if processes is None:
            return None
        found = []
        for process in processes:
            used = process.get("usedGpuMemory")
            known = used not in (None, NVML_VALUE_NOT_AVAILABLE)
            found.append(GpuProcess(int(process["pid"]), int(used) if known else None))
        return found

    def process_names(self, pids: Iterable[int]) -> dict[int, str]:
        """pid -> name from nvmlSystemGetProcessName (kept per pid; the pid when it fails).

        Names of pids not asked for are forgotten, so a reused pid is looked up again."""
        names = {}
        for pid in sorted(set(pids)):
            name = self._process_names.get(pid)
            if name is None:
                name = self._call(None, "nvmlSystemGetProcessName", (pid,), pid)
                if name:
                    self._process_names[pid] = name
            names[pid] = name or str(pid)
        self._process_names = {pid: n for pid, n in self._process_names.items() if pid in names}
        return names
