"""Runs hybridmon's NVML wrapper and GPU collector over whatever pynvml and libnvidia-ml this
process loads, and prints what they read as JSON on stdout.

tests/exporters/test_real_pynvml.py starts it in a subprocess with LD_LIBRARY_PATH at a stub
libnvidia-ml (build.py) and PYTHONPATH starting at one nvidia-ml-py version, so each run has its own
pynvml module and its own copy of the library. Every reading is caught separately: one that raises
shows up as {"error": ...} next to the others instead of ending the run.
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import sys
import time
from importlib import metadata
from typing import Any, Callable

# Per-GPU readings of hybridmon.exporters.nvml.Nvml, in the order the collector makes them.
NVML_READINGS = (
    "name", "uuid", "pci_bus_id", "memory_bytes", "pcie_throughput_bytes_per_second",
    "pcie_link_generation", "pcie_link_max_generation", "pcie_link_width_lanes",
    "pcie_link_max_width_lanes", "pcie_replay_count", "utilization_ratio", "numa_node",
    "compute_processes", "processes", "mig_enabled", "pcie_byte_counters",
    "c2c_mode_enabled", "c2c_links", "gpm_supported",
)
# GPM metrics the probe asks over two samples (PCIe RX/TX, C2C RX/TX; nvml.h nvmlGpmMetricId_t).
GPM_METRICS = (21, 20, 101, 100)
# The stub's entry points whose call counts the tests look at.
COUNTED_CALLS = tuple(
    f"nvmlDevice{function}"
    for kind in ("Compute", "Graphics", "MPSCompute")
    for function in (f"Get{kind}RunningProcesses", f"Get{kind}RunningProcesses_v2",
                     f"Get{kind}RunningProcesses_v3")
) + ("nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetNumaNodeId",
     "nvmlDeviceGetFieldValues", "nvmlDeviceGetMigMode")
# pynvml's ctypes class -> the nvml.h type it must match. The process struct the _v3 functions
# pass is c_nvmlProcessInfo_v3_t where it exists and c_nvmlProcessInfo_t before (12.535.x).
ABI_PAIRS = (
    (("c_nvmlProcessInfo_v3_t", "c_nvmlProcessInfo_t"), "nvmlProcessInfo_t"),
    (("c_nvmlProcessInfo_v2_t",), "nvmlProcessInfo_v2_t"),
    (("c_nvmlMemory_t",), "nvmlMemory_t"),
    (("c_nvmlMemory_v2_t",), "nvmlMemory_v2_t"),
    (("nvmlPciInfo_t",), "nvmlPciInfo_t"),
    (("c_nvmlUtilization_t",), "nvmlUtilization_t"),
    (("c_nvmlValue_t",), "nvmlValue_t"),
    (("c_nvmlFieldValue_t",), "nvmlFieldValue_t"),
    (("c_nvmlC2cModeInfo_v1_t",), "nvmlC2cModeInfo_v1_t"),
    (("c_nvmlGpmSupport_t",), "nvmlGpmSupport_t"),
    (("c_nvmlGpmMetric_t",), "nvmlGpmMetric_t"),
)


class _HeaderMember(ctypes.Structure):
    # struct hybridmon_stub_member in stub_nvml.c
    _fields_ = [("type", ctypes.c_char_p), ("member", ctypes.c_char_p),
                ("offset", ctypes.c_size_t), ("size", ctypes.c_size_t)]


def plain(value: Any) -> Any:
    """JSON data from what the wrapper returns (GpuProcess dataclasses, tuples, frozensets)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, (set, frozenset)):
        return sorted(plain(item) for item in value)
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, dict):
        return {str(key): plain(item) for key, item in value.items()}
    return value


def attempt(read: Callable[[], Any]) -> Any:
    try:
        return {"value": plain(read())}
    except Exception as error:  # reported, so the test names the reading that broke
        return {"error": f"{type(error).__name__}: {error}"}


def loaded_nvml_library() -> str | None:
    """Path of the libnvidia-ml.so.1 this process mapped (so a test knows it is the stub)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith("libnvidia-ml.so.1"):
                return line.split()[-1]
    return None


def read_wrapper() -> dict[str, Any]:
    from hybridmon.exporters.nvml import Nvml, PcieThroughputReader
    from hybridmon.exporters.sources import LiveSource

    nvml = Nvml(LiveSource(), "pynvml")
    result: dict[str, Any] = {
        "device_count": attempt(nvml.device_count),
        "driver_version": attempt(nvml.driver_version),
        "memory_info_version": attempt(nvml.memory_info_version),
        "gpus": [],
    }
    count = result["device_count"].get("value") or 0
    for gpu in range(count):
        readings = {}
        for reading in NVML_READINGS:
            method = getattr(nvml, reading, None)
            readings[reading] = ({"missing": f"Nvml has no {reading}()"} if method is None
                                 else attempt(lambda: method(gpu)))
        # The PCIe sampler's lean path: its first pair through the full path, the second lean.
        reader = PcieThroughputReader(nvml, gpu)
        readings["pcie_throughput_lean"] = attempt(lambda: [reader.read_pair(), reader.read_pair(), reader.lean])
        result["gpus"].append(readings)
    # GPM over two samples 0.15 s apart (nvml.h: "greater than 100ms"), and the PCIe byte counters
    # read until a GPU whose field values fail whole has them given up.
    first = [attempt(lambda: nvml.gpm_metrics(gpu, GPM_METRICS)) for gpu in range(count)]
    time.sleep(0.15)
    for gpu, readings in enumerate(result["gpus"]):
        readings["gpm_metrics"] = [first[gpu], attempt(lambda: nvml.gpm_metrics(gpu, GPM_METRICS))]
        for _ in range(2):
            attempt(lambda: nvml.pcie_byte_counters(gpu))
        readings["pcie_byte_counters_usable_after_3_reads"] = attempt(
            lambda: nvml.pcie_byte_counters_usable(gpu))
    pids = sorted({process["pid"] for readings in result["gpus"]
                   for process in (readings["compute_processes"].get("value") or [])})
    result["process_names"] = attempt(lambda: nvml.process_names(pids))
    nvml.close()
    return result


def read_pynvml_directly() -> dict[str, Any]:
    """pynvml's own answers, without hybridmon: what the binding unmarshals, wrong or right."""
    import pynvml

    pynvml.nvmlInit()
    try:
        answers = []
        for gpu in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
            answer = {}
            for function in ("nvmlDeviceGetComputeRunningProcesses",
                             "nvmlDeviceGetComputeRunningProcesses_v2"):
                if not hasattr(pynvml, function):
                    answer[function] = {"missing": f"pynvml has no {function}"}
                    continue
                answer[function] = attempt(lambda: [
                    [process.pid, process.usedGpuMemory]
                    for process in getattr(pynvml, function)(handle)])
            answer["nvmlDeviceGetCpuAffinity"] = attempt(
                lambda: list(pynvml.nvmlDeviceGetCpuAffinity(handle, 2)))
            answers.append(answer)
        return {"gpus": answers}
    finally:
        pynvml.nvmlShutdown()


def read_abi() -> dict[str, Any]:
    """nvml.h's layout (from the stub, compiled from it) beside pynvml's ctypes classes."""
    import pynvml

    library = ctypes.CDLL("libnvidia-ml.so.1")  # the copy pynvml loaded
    row_at = library.hybridmon_stub_header_member
    row_at.restype = ctypes.POINTER(_HeaderMember)
    row_at.argtypes = [ctypes.c_uint]
    header: dict[str, dict[str, list[int]]] = {}
    index = 0
    while row_at(index):
        row = row_at(index).contents
        header.setdefault(row.type.decode(), {})[row.member.decode()] = [row.offset, row.size]
        index += 1
    pairs = []
    for candidates, header_type in ABI_PAIRS:
        name = next((name for name in candidates if hasattr(pynvml, name)), None)
        entry: dict[str, Any] = {"header_type": header_type, "header": header.get(header_type),
                                 "pynvml_class": name}
        if name is not None:
            cls = getattr(pynvml, name)
            entry["pynvml"] = {"": [0, ctypes.sizeof(cls)]}
            for field in cls._fields_:
                descriptor = getattr(cls, field[0])
                entry["pynvml"][field[0]] = [descriptor.offset, descriptor.size]
        pairs.append(entry)
    library.hybridmon_stub_memory_v2_version.restype = ctypes.c_uint
    # nvmlGpmMetricsGet_t: the members before metrics[] (whose length differs, stub_abi.c).
    request = getattr(pynvml, "c_nvmlGpmMetricsGet_t", None)
    gpm_request = {"header": header.get("nvmlGpmMetricsGet_t"),
                   "pynvml": None if request is None else {
                       name: [getattr(request, name).offset, getattr(request, name).size]
                       for name in ("version", "numMetrics", "sample1", "sample2")}}
    return {"pairs": pairs, "gpm_request": gpm_request,
            "memory_v2_version": {"header": library.hybridmon_stub_memory_v2_version(),
                                  "pynvml": getattr(pynvml, "nvmlMemory_v2", None)}}


def read_collector() -> dict[str, Any]:
    from hybridmon.exporters.gpu import GpuCollector
    from hybridmon.exporters.sources import RecordingSource

    source = RecordingSource()
    collector = GpuCollector(source, "pynvml")
    try:
        samples = [[sample.spec.name, list(sample.label_values), sample.value]
                   for sample in collector.collect()]
    finally:
        collector.close()
    # A trace must hold plain JSON: real pynvml answers (ctypes structs, friendly objects) included.
    json.dumps(source.take_readings())
    return {"samples": samples}


def counted_calls() -> dict[str, int]:
    library = ctypes.CDLL("libnvidia-ml.so.1")
    library.hybridmon_stub_calls.restype = ctypes.c_ulong
    library.hybridmon_stub_calls.argtypes = [ctypes.c_char_p]
    return {name: library.hybridmon_stub_calls(name.encode()) for name in COUNTED_CALLS}


def main() -> None:
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(f"{record.levelname} {record.name}: {record.getMessage()}")

    logging.basicConfig(level=logging.DEBUG, handlers=[Keep()])
    import pynvml

    report: dict[str, Any] = {"pynvml_file": pynvml.__file__,
                              "pynvml_version": metadata.version("nvidia-ml-py")}
    report["wrapper"] = read_wrapper()
    report["library"] = loaded_nvml_library()
    report["calls_after_wrapper"] = counted_calls()
    report["direct"] = attempt(read_pynvml_directly)
    report["abi"] = attempt(read_abi)
    report["collector"] = attempt(read_collector)
    report["logs"] = messages
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
