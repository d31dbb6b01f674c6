"""The only gate to NVML (the `pynvml` module of nvidia-ml-py).

Every NVML call goes through `Nvml._attempt`, which hands `source.call` a key such as
"nvml.nvmlDeviceGetMemoryInfo(0,v2)" (function, GPU index, distinguishing arguments; never a ctypes
handle) and a fetch that calls the module and turns the answer into plain JSON data. Device handles
are looked up inside the fetch, so a replay (module=None) imports nothing and runs no fetch.

A reading made of several NVML calls (a GPM sample and the metrics since the previous one) is one
fetch under one key (`_run`), so a replay needs none of NVML's state (its sample buffers).

Errors are classified by class name, so real pynvml errors, the test fake's and replayed ones
(exporters.sources.ReplayedCallError carries `type_name`) behave alike:
- NotSupported, FunctionNotFound (driver too old): the value is unsupported (None), logged once;
- a function the pynvml module lacks (nvidia-ml-py older than the function): unsupported too, logged
  once with the version to upgrade to (MIN_NVIDIA_ML_PY);
- LibraryNotFound, DriverNotLoaded at init: NoDataError telling the operator to install the driver;
- LibRmVersionMismatch at init: CollectorError saying the kernel module and the library differ (a
  driver upgraded without a reload) and what to do, retried like any init failure;
- GpuIsLost (and Unknown right after it on the same GPU): GpuLostError for that GPU;
- anything else (Timeout, NoPermission, ...): the value is absent this time, logged once per
  function and error.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import logging
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Iterable

from hybridmon.exporters.sources import TraceMissError
from hybridmon.exporters.base import CollectorError, LogOnce, NoDataError, ParseError
from hybridmon.exporters.nvml_answers import (
    FIELD_VALUE_MEMBERS, NVML_DEVICE_MIG_ENABLE, NVML_FI_DEV_C2C_LINK_COUNT,
    NVML_FI_DEV_C2C_LINK_GET_MAX_BW, NVML_FI_DEV_C2C_LINK_GET_STATUS, C2cLink, NVML_FI_DEV_PCIE_COUNT_RX_BYTES,
    NVML_FI_DEV_PCIE_COUNT_TX_BYTES, NVML_SUCCESS, GpuProcess, PcieByteCount, gpu_process,
    normalize_pci_bus_id, to_plain)

# The answers' types are imported from here by the collectors: this module is the one gate.
__all__ = ["C2cLink", "GpuLostError", "GpuProcess", "Nvml", "PcieByteCount", "PcieThroughputReader", "normalize_pci_bus_id", "MIN_NVIDIA_ML_PY"]

logger = logging.getLogger(__name__)

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
# Not a missing driver but two of them: the kernel module loaded is older or newer than the
# libnvidia-ml.so.1 installed (nvml.h: "RM detects a driver/library version mismatch"), what a driver
# upgrade leaves until the old module is unloaded. Retried like any init failure: a reload heals it.
LIB_RM_MISMATCH_MESSAGE = (
    "NVIDIA kernel module and libnvidia-ml.so.1 are different driver versions "
    "(NVMLError_LibRmVersionMismatch): the driver was upgraded without reloading the module; "
    "reboot, or stop GPU processes and reload it (rmmod nvidia_uvm nvidia_drm nvidia_modeset "
    "nvidia; modprobe nvidia). GPU metrics are absent until then")
OK, UNSUPPORTED, FAILED = "ok", "unsupported", "failed"
# The oldest nvidia-ml-py whose wrappers hybridmon relies on are right, read from the wheels:
# - 12.535.77 sizes the process struct with usedGpuCcProtectedMemory (32 bytes) where the driver
#   writes nvmlProcessInfo_v2_t (24 bytes, nvml.h), so every process after the first is garbage;
#   12.535.108 fixed the struct;
# - every 12.535.x lacks nvmlDeviceGetNumaNodeId and the *RunningProcesses_v2 wrappers (only _v3
#   and the unversioned name, which calls _v3), so no fallback to v2 is possible;
# - 12.550.52 is the first with all of them and with NVMLLibraryMismatchError (there is no 12.545).
MIN_NVIDIA_ML_PY = "12.550.52"
MISSING_FUNCTION_ERRORS = frozenset({
    "NVMLError_FunctionNotFound",  # the driver's libnvidia-ml.so.1 lacks the symbol
    "NVMLLibraryMismatchError",  # pynvml's wrapper of FunctionNotFound for unversioned calls
    "BindingLacksFunctionError",  # the pynvml module lacks the function (see below)
})
UNSUPPORTED_ERRORS = MISSING_FUNCTION_ERRORS | {
    "NVMLError_NotSupported",
    "NVMLError_ArgumentVersionMismatch",
}
# The process lists NVML keeps per GPU (nvitop reads compute and graphics): kind -> pynvml name.
# Vulkan/OpenGL clients (llama.cpp's Vulkan backend too) are only in the graphics list; clients of
# an MPS server only in the MPS list.
PROCESS_LISTS = (("compute", "nvmlDeviceGetComputeRunningProcesses"),
                 ("graphics", "nvmlDeviceGetGraphicsRunningProcesses"),
                 ("mps", "nvmlDeviceGetMPSComputeRunningProcesses"))
# Newest first. pynvml >= 12.550 has all three names for each list; its unversioned one calls _v3
# again and turns FunctionNotFound into NVMLLibraryMismatchError, so it only helps a binding
# whose unversioned wrapper reaches the driver's v1 symbol.
PROCESS_ENTRY_POINTS = ("_v3", "_v2", "")


GPM_MIN_INTERVAL_SECONDS = 0.1
"""nvml.h, nvmlGpmMetricsGet: samples "greater than 100ms" apart, "due to the internal sample
refresh rate"."""


@dataclass
class GpmSamples:
    """One GPU's two NVML GPM sample buffers: the latest sample, and the one the next fills."""

    previous: Any
    spare: Any
    taken_at: float | None = None


class BindingLacksFunctionError(Exception):
    """The pynvml module has no such function: nvidia-ml-py is older than the function.

    Raised inside the recorded fetch, so a trace replays it like an NVML error."""


class GpuLostError(Exception):
    """NVML says the GPU fell off the bus (GPU_IS_LOST); it needs a reset or a reboot."""

    def __init__(self, gpu: int) -> None:
        super().__init__(f"GPU {gpu} is lost (NVML_ERROR_GPU_IS_LOST): reset it or reboot")
        self.gpu = gpu


def error_name(error: BaseException) -> str:
    return getattr(error, "type_name", None) or type(error).__name__


def _is_nvml_error(name: str) -> bool:
    return name.startswith("NVMLError") or name in MISSING_FUNCTION_ERRORS


def _binding_version(module: Any) -> str:
    """The installed nvidia-ml-py's version when `module` is its pynvml, else "(unknown)"."""
    if getattr(module, "__name__", None) != "pynvml":
        return "(unknown)"
    try:
        return importlib.metadata.version("nvidia-ml-py")
    except importlib.metadata.PackageNotFoundError:
        return "(unknown)"


KEY_CACHE_SIZE = 1024
PCIE_COUNTER_FAILURES_TO_GIVE_UP = 3
"""Reads in a row without PCIe byte counters, on a GPU whose counters may yet answer, before they
are given up. One failed call is often a transient (a Timeout while the driver is busy, a GPU
reset's aftermath); three at the 1 s tick is a driver that keeps failing, and each such read
costs a 20 ms blocking window meanwhile, so waiting longer buys little."""
PCIE_COUNTER_RETRY_READS = 60
"""Counters given up are asked again on every 60th read (once a minute at the 1 s tick): the
exact reading is worth recovering after a transient, and one non-blocking call a minute costs
nothing. Counted in reads, not seconds, so a replay asks on the same ticks as the recording."""


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
        self._pcie_counter_bits: dict[int, int | None] = {}  # gpu -> counter width; None: unusable
        # gpu -> reads in a row without counters that may yet answer; reads until the next retry
        # of counters given up.
        self._pcie_counter_failures: dict[int, int] = {}
        self._pcie_counter_retry_in: dict[int, int] = {}
        self._process_names: dict[int, str] = {}
        self._gpm_samples: dict[int, GpmSamples] = {}  # live only: NVML's sample buffers per GPU
        # (function, gpu, args) -> the call's key: built once, not per call (a tick makes ~76
        # calls on 8 GPUs, the PCIe samplers 160 a second); cleared past KEY_CACHE_SIZE, as pids
        # (nvmlSystemGetProcessName) come and go.
        self._keys: dict[tuple, str] = {}
        # (gpu, list kind) -> the pynvml function that answered it; entry points found missing;
        # lists the GPU does not support. Per GPU, so concurrent reads probe in a fixed order.
        self._process_entry: dict[tuple[int, str], str] = {}
        self._process_missing: set[tuple[int, str]] = set()
        self._process_unsupported: set[tuple[int, str]] = set()

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
                elif name == "NVMLError_LibRmVersionMismatch":
                    failure = CollectorError(f"{LIB_RM_MISMATCH_MESSAGE}; retrying every "
                                             f"{self._init_retry_seconds:g} s")
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
                self._free_gpm_samples()
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
        return self._attempt_named(gpu, function, args, *call_args, **call_kwargs)[:2]

    def _attempt_named(self, gpu: int | None, function: str, args: tuple = (), *call_args: Any,
                       **call_kwargs: Any) -> tuple[str, Any, str | None]:
        """_attempt's answer and the error's class name (None on success)."""
        def fetch() -> Any:
            try:  # not self._function: a method call more per NVML call shows (~76 a tick)
                target = getattr(self._module, function)
            except AttributeError:
                target = self._function(function)  # raises BindingLacksFunctionError
            if gpu is None:
                return to_plain(target(*call_args, **call_kwargs))
            return to_plain(target(self._handle(gpu), *call_args, **call_kwargs))

        return self._run(gpu, function, args, fetch)

    def _function(self, name: str) -> Any:
        """The pynvml function `name`; BindingLacksFunctionError where this nvidia-ml-py lacks it."""
        try:
            return getattr(self._module, name)
        except AttributeError:
            raise BindingLacksFunctionError(
                f"nvidia-ml-py {_binding_version(self._module)} lacks {name}; upgrade to "
                f">= {MIN_NVIDIA_ML_PY}") from None

    def _run(self, gpu: int | None, function: str, args: tuple,
             fetch: Callable[[], Any]) -> tuple[str, Any, str | None]:
        """The one call path: `fetch` (plain JSON data out) through the source under the key of
        (function, gpu, args), its errors sorted by class name (module docstring)."""
        self._ensure_initialized()
        key = self._keys.get((function, gpu, args))
        if key is None:
            parts = ((gpu,) if gpu is not None else ()) + args
            key = f"nvml.{function}({','.join(str(part) for part in parts)})"
            if len(self._keys) >= KEY_CACHE_SIZE:
                self._keys.clear()
            self._keys[(function, gpu, args)] = key

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
            if name == "BindingLacksFunctionError":
                # The message (kept as the detail in a trace) names the version to upgrade to.
                self._log_once(f"unsupported:{function}", "%s; its series are absent",
                               getattr(error, "detail", None) or error)
                return UNSUPPORTED, None, name
            if name in UNSUPPORTED_ERRORS:
                self._log_once(f"unsupported:{function}", "NVML %s is not supported%s (%s: the "
                               "driver is too old or the GPU lacks it); its series are absent",
                               function, where, name, level=logging.INFO)
                return UNSUPPORTED, None, name
            self._log_once(f"failed:{function}:{name}", "NVML %s failed%s (%s: %s); the value is "
                           "absent until it succeeds", function, where, name, error)
            return FAILED, None, name
        if gpu is not None:
            with self._state_lock:
                self._answers[gpu] = self._answers.get(gpu, 0) + 1
                came_back = gpu in self._lost
                self._lost.discard(gpu)
            if came_back:
                logger.warning("GPU %d answers NVML again", gpu)
        return OK, value, None

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
        self._ensure_initialized()  # loads the module, whose constants name the counters below
        rx = self._call(gpu, "nvmlDeviceGetPcieThroughput", ("rx",),
                        self._module_attr("NVML_PCIE_UTIL_RX_BYTES"))
        tx = self._call(gpu, "nvmlDeviceGetPcieThroughput", ("tx",),
                        self._module_attr("NVML_PCIE_UTIL_TX_BYTES"))
        return (None if rx is None else int(rx) * 1024, None if tx is None else int(tx) * 1024)

    def pcie_throughput_function(self, gpu: int) -> tuple[Callable[..., int], Any, int, int] | None:
        """For PcieThroughputReader's lean path: the binding's nvmlDeviceGetPcieThroughput, the
        GPU's handle and the RX and TX counter constants, resolved now. None where there is
        nothing to resolve: a replay (no module), NVML not initialised yet, or the handle or the
        function not to be had (the full path says why)."""
        if self._module_spec is None or not self._initialized:
            return None
        try:
            return (self._module.nvmlDeviceGetPcieThroughput, self._handle(gpu),
                    self._module.NVML_PCIE_UTIL_RX_BYTES, self._module.NVML_PCIE_UTIL_TX_BYTES)
        except Exception:  # GPU lost, binding without the function: the full path reports it
            return None

    def pcie_byte_counters(self, gpu: int) -> PcieByteCount | None:
        """The GPU's cumulative PCIe byte counters (NVML_FI_DEV_PCIE_COUNT_RX/TX_BYTES) and NVML's
        timestamp of them, from one nvmlDeviceGetFieldValues call that does not block.

        Whether the GPU has usable counters is decided once, by its first answer: both fields
        SUCCESS with a 64-bit integer valueType. A field answering an error (drivers before R555
        do not know the ids; some GPUs lack them) or a 32-bit value (it would wrap every 4 GiB,
        under 0.1 s at Gen5 x16, so one tick could hide several wraps) means unusable for good,
        logged once; the agent then reads the GPU another way (exporters/pcie_traffic.py).

        A call that gives no counters for another reason (the whole call failing, which nvml.h
        allows: it promises SUCCESS only "if any values were populated"; or fields that answered
        before answering an error now) leaves the GPU as it was; PCIE_COUNTER_FAILURES_TO_GIVE_UP
        of them in a row give the counters up, so the GPU is read another way rather than by one
        20 ms window a tick for good, and they are asked again every PCIE_COUNTER_RETRY_READS
        reads. None: unusable, given up, or no answer this time."""
        if self._pcie_counter_bits.get(gpu, 0) is None:
            return None
        reads_to_retry = self._pcie_counter_retry_in.get(gpu)
        if reads_to_retry is not None and reads_to_retry > 1:
            self._pcie_counter_retry_in[gpu] = reads_to_retry - 1
            return None
        status, fields, error = self._attempt_named(
            gpu, "nvmlDeviceGetFieldValues", ("pcie_bytes",),
            [NVML_FI_DEV_PCIE_COUNT_RX_BYTES, NVML_FI_DEV_PCIE_COUNT_TX_BYTES])
        if status == UNSUPPORTED:
            self._pcie_counter_bits[gpu] = None
            return None
        if status != OK:
            self._pcie_counters_missed(gpu, f"the whole call failed with {error}")
            return None
        by_id = {field["fieldId"]: field for field in fields}
        rx = by_id.get(NVML_FI_DEV_PCIE_COUNT_RX_BYTES, {})
        tx = by_id.get(NVML_FI_DEV_PCIE_COUNT_TX_BYTES, {})
        returns = (rx.get("nvmlReturn"), tx.get("nvmlReturn"))
        bits = {FIELD_VALUE_MEMBERS.get(f.get("valueType"), (None, None))[1] for f in (rx, tx)}
        integer = all(f.get("valueType") in (1, 2, 3, 4) for f in (rx, tx))
        decided = self._pcie_counter_bits.get(gpu, 0)
        if returns == (NVML_SUCCESS, NVML_SUCCESS) and integer and bits == {64}:
            if decided == 0:
                self._pcie_counter_bits[gpu] = 64
            self._pcie_counter_failures.pop(gpu, None)
            if self._pcie_counter_retry_in.pop(gpu, None) is not None:
                logger.warning("GPU %d: its PCIe byte counters answer again; its traffic is read "
                               "from them again", gpu)
            return PcieByteCount(int(rx["value"]), int(tx["value"]),
                                 max(rx["timestamp"], tx["timestamp"]) / 1e6, 64)
        if decided == 0 and reads_to_retry is None:
            self._pcie_counter_bits[gpu] = None
            self._log_once(f"pcie_counters:{gpu}", "GPU %d has no usable PCIe byte counters "
                           "(nvmlDeviceGetFieldValues RX/TX_BYTES answered nvmlReturn %s, value "
                           "types %s; 64-bit counters need driver R555 or later): its PCIe traffic "
                           "is read another way", gpu, returns,
                           (rx.get("valueType"), tx.get("valueType")), level=logging.INFO)
        else:
            self._pcie_counters_missed(gpu, f"the fields answered nvmlReturn {returns}")
        return None

    def _pcie_counters_missed(self, gpu: int, why: str) -> None:
        """One read that gave no counters where they may yet answer: counted, and past
        PCIE_COUNTER_FAILURES_TO_GIVE_UP in a row (or on a retry) the counters are given up."""
        failures = self._pcie_counter_failures[gpu] = self._pcie_counter_failures.get(gpu, 0) + 1
        retrying = gpu in self._pcie_counter_retry_in
        if failures < PCIE_COUNTER_FAILURES_TO_GIVE_UP and not retrying:
            self._log_once(f"pcie_counters_failed:{gpu}", "GPU %d: no PCIe byte counters this "
                           "time (%s); one 20 ms window is read instead", gpu, why)
            return
        self._pcie_counter_retry_in[gpu] = PCIE_COUNTER_RETRY_READS
        if not retrying:
            logger.warning("GPU %d: nvmlDeviceGetFieldValues gave no PCIe byte counters %d times "
                           "in a row (last: %s): its traffic is read another way (GPM or sampled, "
                           "as the traffic method series says) and the counters are asked again "
                           "every %d reads", gpu, failures, why, PCIE_COUNTER_RETRY_READS)

    def pcie_byte_counters_usable(self, gpu: int) -> bool | None:
        """Whether the GPU's traffic comes from its counters: False where pcie_byte_counters found
        them unusable or gave them up; None while not decided (no answer yet)."""
        if gpu in self._pcie_counter_retry_in:
            return False
        if gpu not in self._pcie_counter_bits:
            return None
        return self._pcie_counter_bits[gpu] is not None

    # --- GPM (Hopper and later) -----------------------------------------------------------
    def gpm_supported(self, gpu: int) -> bool:
        """Whether the GPU has GPM metrics (nvmlGpmQueryDeviceSupport isSupportedDevice; nvml.h:
        "Hopper or newer fully supported devices"). Read once: it is the GPU's and the driver's."""
        return bool(self._asked_once(gpu, "nvmlGpmQueryDeviceSupport", lambda unsupported, answer: (
            not unsupported and bool((answer or {}).get("isSupportedDevice")))))

    def gpm_metrics(self, gpu: int, metric_ids: tuple[int, ...]) -> dict[int, float] | None:
        """metric id -> value (the unit nvml.h gives each, e.g. MiB/s) between this call's GPM
        sample and the previous call's, for the metrics that answered SUCCESS. None where GPM is
        unsupported, on the first call (one sample is no interval), within GPM_MIN_INTERVAL_SECONDS
        of the previous sample (kept, so the next call measures from it), or when the call failed.

        One recorded reading per call: the sample and the metrics between it and the previous one
        are taken inside one fetch, so a replay answers from the trace without NVML's samples."""
        if not self.gpm_supported(gpu):
            return None
        status, answered, _ = self._run(gpu, "nvmlGpmMetricsGet", tuple(metric_ids),
                                        lambda: self._gpm_fetch(gpu, metric_ids))
        if status != OK or answered is None:
            return None
        values = {}
        for metric in answered:
            if metric["nvmlReturn"] == NVML_SUCCESS:
                values[int(metric["metricId"])] = float(metric["value"])
            else:
                self._log_once(f"gpm_metric:{gpu}:{metric['metricId']}", "GPU %d: GPM metric %d "
                               "answered nvmlReturn %d; its series are absent", gpu,
                               metric["metricId"], metric["nvmlReturn"], level=logging.INFO)
        return values

    def _gpm_fetch(self, gpu: int, metric_ids: tuple[int, ...]) -> list[dict] | None:
        """Take a GPM sample into the spare buffer and compute the metrics from the previous
        sample to it (nvml.h, nvmlGpmMetricsGet: two nvmlGpmSampleGet calls "greater than 100ms"
        apart); the new sample becomes the previous one. Live only: a replay never runs it."""
        handle = self._handle(gpu)
        state = self._gpm_samples.get(gpu)
        if state is None:
            allocate = self._function("nvmlGpmSampleAlloc")
            state = self._gpm_samples[gpu] = GpmSamples(allocate(), allocate())
        now = self._clock()
        if state.taken_at is not None and now - state.taken_at < GPM_MIN_INTERVAL_SECONDS:
            return None
        self._function("nvmlGpmSampleGet")(handle, state.spare)
        earlier, state.previous, state.spare = state.previous, state.spare, state.previous
        first, state.taken_at = state.taken_at is None, now
        if first:
            return None
        request = self._function("c_nvmlGpmMetricsGet_t")()
        request.version = self._module_attr("NVML_GPM_METRICS_GET_VERSION")
        request.numMetrics = len(metric_ids)
        request.sample1, request.sample2 = earlier, state.previous
        for slot, metric_id in enumerate(metric_ids):
            request.metrics[slot].metricId = metric_id
        self._function("nvmlGpmMetricsGet")(request)
        return [{"metricId": int(request.metrics[slot].metricId),
                 "nvmlReturn": int(request.metrics[slot].nvmlReturn),
                 "value": float(request.metrics[slot].value)} for slot in range(len(metric_ids))]

    def _free_gpm_samples(self) -> None:
        samples, self._gpm_samples = self._gpm_samples, {}
        free = getattr(self._module, "nvmlGpmSampleFree", None)
        for state in samples.values():
            for sample in (state.previous, state.spare):
                try:
                    free(sample)
                except Exception as error:  # freeing must not fail the agent's exit
                    logger.debug("nvmlGpmSampleFree failed: %s", error)

    # --- NVLink-C2C (Grace Hopper, Grace Blackwell) ----------------------------------------
    def c2c_mode_enabled(self, gpu: int) -> bool | None:
        """Whether the GPU's NVLink-C2C link to the CPU is on (nvmlDeviceGetC2cModeInfoV
        isC2cEnabled); None where NVML does not answer (no C2C: NOT_SUPPORTED; older driver or
        binding: the function is missing). Read once: the platform's, fixed while NVML is loaded."""
        return self._asked_once(gpu, "nvmlDeviceGetC2cModeInfoV", lambda unsupported, info: (
            None if unsupported or not info else bool(info.get("isC2cEnabled"))))

    def c2c_links(self, gpu: int) -> list[C2cLink] | None:
        """Each NVLink-C2C link's state from nvmlDeviceGetFieldValues: the count (field 170, read
        until it answers, then kept), then per link its status (171) and maximum bandwidth (172,
        nvml.h: "in MBps", taken as 10^6 bytes/s) with the link as scopeId. nvml.h asks for the
        link in scopeId for the NVLink fields and says nothing for 171/172: the link as scopeId
        is an assumption (nvidia-smi c2c -s lists both per link) only a C2C host can settle.
        None where the count is unknown."""
        count = self._static.get(("c2c_link_count", gpu))
        if count is None:
            fields = self._call(gpu, "nvmlDeviceGetFieldValues", ("c2c_count",),
                                [NVML_FI_DEV_C2C_LINK_COUNT])
            answer = (fields or [{}])[0]
            if answer.get("nvmlReturn") != NVML_SUCCESS or answer.get("value") is None:
                return None
            count = self._static[("c2c_link_count", gpu)] = int(answer["value"])
        if count == 0:
            return []
        requested = [(field_id, link) for link in range(count)
                     for field_id in (NVML_FI_DEV_C2C_LINK_GET_STATUS, NVML_FI_DEV_C2C_LINK_GET_MAX_BW)]
        fields = self._call(gpu, "nvmlDeviceGetFieldValues", ("c2c_links",), requested)
        if fields is None:
            return None
        answers = {(f["fieldId"], f["scopeId"]): f["value"] for f in fields
                   if f["nvmlReturn"] == NVML_SUCCESS and f["value"] is not None}
        links = []
        for link in range(count):
            up = answers.get((NVML_FI_DEV_C2C_LINK_GET_STATUS, link))
            megabytes = answers.get((NVML_FI_DEV_C2C_LINK_GET_MAX_BW, link))
            links.append(C2cLink(link, None if up is None else up == 1,
                                 None if megabytes is None else int(megabytes) * 1_000_000))
        return links

    def utilization_ratio(self, gpu: int) -> float | None:
        """Share of the last sample period in which a kernel ran (nvmlDeviceGetUtilizationRates)."""
        rates = self._call(gpu, "nvmlDeviceGetUtilizationRates")
        return None if rates is None else rates["gpu"] / 100.0

    def numa_node(self, gpu: int) -> int | None:
        """The NUMA node that IS the GPU's memory, nvmlDeviceGetNumaNodeId: nvml.h says it "only
        applies to platforms where the GPUs are NUMA nodes" (Grace Hopper/Blackwell, where GPU
        memory is a CPU-less node) and answers NOT_SUPPORTED elsewhere, e.g. on x86 PCIe hosts.
        NOT the node nearest the GPU: that is its PCI device's sysfs numa_node.

        Read once per GPU, as the MIG mode: the answer, a node or NOT_SUPPORTED, is the
        platform's and cannot change while NVML is loaded; asked every tick, an x86 host raised
        an NVMLError per GPU per second for nothing. A failed call is asked again."""
        return self._asked_once(gpu, "nvmlDeviceGetNumaNodeId", lambda unsupported, node: (
            None if unsupported or node is None or node < 0 else int(node)))

    def mig_enabled(self, gpu: int) -> bool | None:
        """Whether MIG is on (nvmlDeviceGetMigMode's current mode); None where the GPU has no MIG
        (NOT_SUPPORTED: only A100/A30/H100-class GPUs have it) or the call failed.

        Read once per GPU: changing the mode needs a GPU reset (nvml.h, nvmlDeviceSetMigMode)."""
        return self._asked_once(gpu, "nvmlDeviceGetMigMode", lambda unsupported, modes: (
            None if unsupported else modes[0] == NVML_DEVICE_MIG_ENABLE))

    def _asked_once(self, gpu: int, call: str, interpret: Callable[[bool, Any], Any]) -> Any:
        """`call`'s answer for `gpu`, interpreted (NOT_SUPPORTED or not, the answer) and kept for
        good; None, and asked again next time, where the call failed."""
        key = (call, gpu)
        if key in self._static:
            return self._static[key]
        status, answer = self._attempt(gpu, call)
        if status == FAILED:
            return None
        value = self._static[key] = interpret(status == UNSUPPORTED, answer)
        return value

    def processes(self, gpu: int) -> list[GpuProcess] | None:
        """Every process NVML lists on the GPU: its compute, graphics and MPS compute lists, one
        entry per pid (and MIG instance), `kinds` naming the lists it is in. None only when no
        list could be read (all failed or unsupported); with MIG on, the parent GPU's lists need
        privileges (nvml.h: NO_PERMISSION otherwise)."""
        merged: dict[tuple[int, int | None], GpuProcess] = {}
        answered = False
        for kind, function in PROCESS_LISTS:
            listed = self._process_list(gpu, kind, function)
            if listed is None:
                continue
            answered = True
            for entry in listed:
                process = gpu_process(entry, kind)
                key = (process.pid, process.gpu_instance_id)
                earlier = merged.get(key)
                if earlier is not None:
                    # A process in two lists (CUDA-OpenGL interop) holds one set of memory; each
                    # list reports the same process's usage, so it is kept once, not added.
                    used = [u for u in (earlier.used_memory_bytes, process.used_memory_bytes)
                            if u is not None]
                    process = GpuProcess(process.pid, max(used) if used else None,
                                         earlier.kinds | process.kinds, process.gpu_instance_id)
                merged[key] = process
        return list(merged.values()) if answered else None

    def compute_processes(self, gpu: int) -> list[GpuProcess] | None:
        """The compute and MPS compute processes of processes() (graphics-only ones left out)."""
        found = self.processes(gpu)
        if found is None:
            return None
        return [process for process in found if process.kinds & {"compute", "mps"}]

    def _process_list(self, gpu: int, kind: str, function: str) -> list | None:
        """One list, through the entry point that answered before, else v3, v2, then the
        unversioned one; an entry point found missing is not asked again."""
        key = (gpu, kind)
        if key in self._process_unsupported:
            return None
        decided = self._process_entry.get(key)
        candidates = ((decided,) if decided else
                      tuple(function + suffix for suffix in PROCESS_ENTRY_POINTS
                            if (gpu, function + suffix) not in self._process_missing))
        for name in candidates:
            status, listed, error = self._attempt_named(gpu, name)
            if status == OK:
                with self._state_lock:
                    self._process_entry[key] = name
                return listed or []
            if status == FAILED:
                if error == "NVMLError_NoPermission":
                    # The parent of MIG instances lists them to root only (nvml.h); the agent's
                    # privileges do not change while it runs, so it is not asked again.
                    with self._state_lock:
                        self._process_unsupported.add(key)
                return None  # otherwise transient: ask again next time
            if error in MISSING_FUNCTION_ERRORS:
                with self._state_lock:
                    self._process_missing.add((gpu, name))
                continue
            # NOT_SUPPORTED: the GPU has no such list; an older entry point would not help.
            with self._state_lock:
                self._process_unsupported.add(key)
            return None
        if not decided:
            with self._state_lock:
                self._process_unsupported.add(key)  # every entry point is missing
            self._log_once(f"process-list:{kind}", "no NVML entry point for the %s process list "
                           "answered on GPU %d (%s); its processes are not listed", kind, gpu,
                           ", ".join(function + suffix for suffix in PROCESS_ENTRY_POINTS))
        return None

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


class PcieThroughputReader:
    """One GPU's nvmlDeviceGetPcieThroughput pair for its PCIe sampler thread, called lean.

    The full path (Nvml.pcie_throughput_bytes_per_second) runs ~70 µs of Python per call on the
    bench host (issue 33): the init check, the call's key, source.call, the error handling and
    the answer count, 160 calls a second on 8 GPUs at 10 samples a second. A sampler's gate is a
    LiveSource whose calls are not recorded (only each tick's summary is: pcie_traffic.py), so
    none of that is needed while calls succeed: the function, the handle and the two counter
    constants are resolved once, after a full read that answered, and a sample is then two
    foreign calls. Any exception leaves the lean path: the same sample is read again through the
    full path, which sorts the error as for every NVML call (unsupported or failed: None and
    logged once; GPU lost: GpuLostError), and the reader stays on the full path until a read
    answers both directions again, then resolves anew (a reset GPU has a new handle)."""

    def __init__(self, nvml: Nvml, gpu: int) -> None:
        self._nvml = nvml
        self._gpu = gpu
        self._lean: tuple[Callable[..., int], Any, int, int] | None = None
        self.fallbacks = 0  # samples the lean path handed to the full one (tests read it)

    @property
    def lean(self) -> bool:
        return self._lean is not None

    def read_pair(self) -> tuple[int | None, int | None]:
        """(host_to_device, device_to_host) bytes/s over a 20 ms window each, as
        Nvml.pcie_throughput_bytes_per_second answers them."""
        lean = self._lean
        if lean is not None:
            function, handle, rx, tx = lean
            try:
                return function(handle, rx) * 1024, function(handle, tx) * 1024
            except Exception:
                self._lean = None
                self.fallbacks += 1
        pair = self._nvml.pcie_throughput_bytes_per_second(self._gpu)
        if None not in pair:
            self._lean = self._nvml.pcie_throughput_function(self._gpu)
        return pair
