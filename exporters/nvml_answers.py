"""NVML's answers as plain data: what pynvml's ctypes structs become before a trace records them,
and the values the agent reads out of them (processes, PCIe byte counters, NVLink-C2C links, bus ids).

Kept apart from exporters/nvml.py, the call path, so each reads in one sitting; nvml.py re-exports
every name here for its callers.
"""
from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass, field
from typing import Any

from hybridmon.exporters.base import ParseError

# What NVML (and pynvml on Linux) reports for "this process's GPU memory is not known".
NVML_VALUE_NOT_AVAILABLE = 2**64 - 1

_PCI_BUS_ID = re.compile(r"([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])")
NVML_DEVICE_MIG_ENABLE = 1  # nvml.h; nvmlDeviceGetMigMode's current mode
NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId/computeInstanceId without MIG (nvml.h nvmlProcessInfo_v2_t)
@dataclass(frozen=True, slots=True)
class PcieByteCount:
    """The GPU's cumulative PCIe byte counters at one moment (nvmlDeviceGetFieldValues).

    host_to_device_bytes: RX_BYTES, what the GPU received; device_to_host_bytes: TX_BYTES.
    timestamp_seconds: NVML's CPU timestamp of the values (microseconds since 1970 / 1e6).
    width_bits: where the counters wrap (nvml.h: "Value can be wrapped"), 2**width_bits."""

    host_to_device_bytes: int
    device_to_host_bytes: int
    timestamp_seconds: float
    width_bits: int


@dataclass(frozen=True, slots=True)
class C2cLink:
    """One NVLink-C2C link of a GPU: up (None: not answered), its maximum in bytes/s (None: not
    answered; NVML states it "for active links")."""

    link: int
    up: bool | None
    max_bytes_per_second: int | None


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """One process on one GPU (or one MIG instance of it) as NVML lists it.

    pid: in the namespace NVML sees (the host's; a containerised agent without the host's pid
    namespace cannot find it in its /proc). used_memory_bytes: None when NVML cannot tell.
    kinds: the lists it is in, "compute", "graphics" and/or "mps". gpu_instance_id: the MIG GPU
    instance, None without MIG."""

    pid: int
    used_memory_bytes: int | None
    kinds: frozenset[str] = field(default=frozenset({"compute"}))
    gpu_instance_id: int | None = None


def normalize_pci_bus_id(bus_id: str) -> str:
    """NVML's "00000000:17:00.0" as sysfs writes it: "0000:17:00.0" (lowercase, 4+ hex domain)."""
    match = _PCI_BUS_ID.fullmatch(bus_id.strip())
    if match is None:
        raise ParseError(f"not a PCI bus id: {bus_id[:40]!r}")
    domain, bus, device, function = (int(part, 16) for part in match.groups())
    if device > 0x1F:
        raise ParseError(f"PCI device number out of range in {bus_id!r}")
    return f"{domain:04x}:{bus:02x}:{device:02x}.{function:x}"


# nvmlDeviceGetFieldValues field ids (nvml.h 12.9.79: "PCIe transmit/receive bytes. Value can be
# wrapped."). Defined here because pynvml only names them from nvidia-ml-py 12.555 on; the ids are
# part of NVML's ABI, and an older driver answers them NOT_SUPPORTED per field.
NVML_FI_DEV_PCIE_COUNT_TX_BYTES = 197
NVML_FI_DEV_PCIE_COUNT_RX_BYTES = 198
# NVLink-C2C fields (nvml.h 12.9.79: link count; status "0=INACTIVE 1=ACTIVE"; "C2C Link Speed in
# MBps for active links"); pynvml names them from nvidia-ml-py 12.550 on.
NVML_FI_DEV_C2C_LINK_COUNT = 170
NVML_FI_DEV_C2C_LINK_GET_STATUS = 171
NVML_FI_DEV_C2C_LINK_GET_MAX_BW = 172
# GPM metrics (nvml.h 12.9.79 nvmlGpmMetricId_t, all "in MiB/sec"): PCIe "from this GPU" (TX) and
# "to this GPU" (RX); C2C total transmit and receive.
NVML_GPM_METRIC_PCIE_TX_PER_SEC = 20
NVML_GPM_METRIC_PCIE_RX_PER_SEC = 21
NVML_GPM_METRIC_C2C_TOTAL_TX_PER_SEC = 100
NVML_GPM_METRIC_C2C_TOTAL_RX_PER_SEC = 101
NVML_SUCCESS = 0
# nvmlValueType_t -> (the nvmlValue_t member that holds it, its width in bits on this platform).
FIELD_VALUE_MEMBERS = {
    0: ("dVal", 64), 1: ("uiVal", 32), 2: ("ulVal", 8 * ctypes.sizeof(ctypes.c_ulong)),
    3: ("ullVal", 64), 4: ("sllVal", 64), 5: ("siVal", 32), 6: ("usVal", 16),
}


def field_value_plain(value: Any) -> dict:
    """One nvmlFieldValue_t as JSON data. Only the union member its valueType names is kept: nvml.h
    says value "is only valid if nvmlReturn == NVML_SUCCESS", and the other members are the same
    bytes read as other types (a counter read as a double is noise, at worst NaN)."""
    plain = {name: int(getattr(value, name))
             for name in ("fieldId", "scopeId", "timestamp", "latencyUsec", "valueType",
                          "nvmlReturn")}
    member = FIELD_VALUE_MEMBERS.get(plain["valueType"])
    plain["value"] = (getattr(value.value, member[0])
                      if member is not None and plain["nvmlReturn"] == NVML_SUCCESS else None)
    return plain


def to_plain(value: Any) -> Any:
    """An NVML answer as JSON data: structs become dicts of their _fields_, bytes become str."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, ctypes.Structure) and hasattr(value, "fieldId") and hasattr(value, "valueType"):
        return field_value_plain(value)
    if isinstance(value, (ctypes.Structure, ctypes.Union)):
        return {field[0]: to_plain(getattr(value, field[0])) for field in value._fields_}
    if isinstance(value, (ctypes.Array, list, tuple)):
        return [to_plain(item) for item in value]
    if hasattr(value, "__dict__"):  # pynvml's nvmlFriendlyObject (process lists)
        return {key: to_plain(item) for key, item in vars(value).items() if not key.startswith("_")}
    raise TypeError(f"cannot record an NVML answer of type {type(value).__name__}")


def gpu_process(entry: dict, kind: str) -> GpuProcess:
    """pynvml's process object (plain data) as a GpuProcess of one list."""
    used = entry.get("usedGpuMemory")
    known = used not in (None, NVML_VALUE_NOT_AVAILABLE)
    instance = entry.get("gpuInstanceId")
    return GpuProcess(int(entry["pid"]), int(used) if known else None, frozenset({kind}),
                      None if instance in (None, NO_INSTANCE) else int(instance))
