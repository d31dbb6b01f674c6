"""What the offload benchmark binary prints, read strictly: its report, its error object and its
progress lines (schema: docs/offload-bench.md).

The parsers raise only ReportError, whose message says what was wrong, so a binary from another
version or a truncated output never turns into a bandwidth figure.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from hybridmon.exporters.jsonsafe import loads_bounded

SCHEMA_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
"""Older versions are still read so stored runs keep their figures. Version 1 (before issue 13)
summed both directions of its bidirectional test: read under a direction name that says so.
Version 2 timed both directions' streams over equal bytes, so the slower one ran its tail alone
and read high (issue 29): its per-stream figures are read and shown, never used as capacity."""
_PER_STREAM = {"h2d": "host_to_device", "d2h": "device_to_host",
               "h2d_bidirectional": "host_to_device_bidirectional",
               "d2h_bidirectional": "device_to_host_bidirectional"}
DIRECTIONS = {
    # version 3: the measured direction's bytes over its own time while the opposite direction
    # copies at least twice the bytes (nvbandwidth's *_bidirectional_memcpy_ce)
    3: _PER_STREAM,
    # version 2: each stream's bytes over its own time, both streams copying the same bytes
    2: _PER_STREAM,
    # version 1: both directions' bytes over the slower stream's time
    1: {"h2d": "host_to_device", "d2h": "device_to_host", "bidirectional": "bidirectional_summed"},
}
BIDIRECTIONAL = frozenset({"host_to_device_bidirectional", "device_to_host_bidirectional"})
SUMMED = "bidirectional_summed"
PROGRESS_DIRECTIONS = {**_PER_STREAM, "bidirectional": "bidirectional"}
MEMORY_KINDS = ("pinned", "pageable")
QUEUED, LOOP = "queued", "loop"
ISSUES = (QUEUED, LOOP)
"""How the copies reached the GPU: all enqueued behind a spin kernel before the clock starts
(nvbandwidth's timing, the copies alone) or issued by the host while the GPU ran them (a server's
copy loop, the per-copy issue cost included). Before version 3 pinned copies were queued and
pageable ones a loop."""
GIGA = 1e9
MAX_REPORT_BYTES = 1024 * 1024
"""Largest report read: the binary prints about 20 KB (a result per size, direction and memory)."""
MAX_PROGRESS_LINE_BYTES = 4096
LARGEST_INTEGER = 2**53
"""Integers beyond this (exact as a float) are in no report; 10**5000 would even fail str()."""


class ReportError(ValueError):
    """The benchmark's output is not what its schema promises."""


@dataclass(frozen=True)
class CopyResult:
    """One (direction, memory kind, transfer size): bandwidths in bytes per second."""

    direction: str  # a value of DIRECTIONS: one direction alone, or one stream of a bidirectional test
    memory: str
    issue: str  # QUEUED or LOOP
    transfer_bytes: int
    samples: int
    median_bytes_per_second: float
    min_bytes_per_second: float
    max_bytes_per_second: float
    host_numa_node: int | None
    interfered_throughout: bool | None = None
    """A bidirectional result of version 3: whether the opposite direction was still copying when
    the measured one ended in every sample (else part of it ran alone and reads high). None for
    one direction alone, and for older versions, which did not check."""


@dataclass(frozen=True)
class Report:
    device_index: int
    device_name: str
    pci_bus_id: str
    device_numa_node: int | None
    free_memory_bytes: int
    numa_node: int | None  # node the host buffers were bound to; None: not bound
    numa_note: str | None  # why the memory was not bound (version 2); None when bound or unknown
    cpu_affinity: dict | None  # {"bound", "cpus", "note"} (version 2); None in version 1
    elapsed_seconds: float
    time_limit_reached: bool
    results: tuple[CopyResult, ...]
    skipped: tuple[tuple[int, str], ...]
    raw: dict


@dataclass(frozen=True)
class BinaryError:
    """The error object the binary prints with a non-zero exit status."""

    error: str
    detail: str


@dataclass(frozen=True)
class Progress:
    step: int
    steps: int
    direction: str
    memory: str
    transfer_bytes: int
    issue: str = ""  # version 3 names it; "" before


def _field(obj: dict, name: str, kinds: type | tuple[type, ...], where: str):
    if name not in obj:
        raise ReportError(f"{where}: missing {name!r}")
    value = obj[name]
    # bool is an int in Python; a JSON true where a number belongs is still wrong.
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise ReportError(f"{where}: {name!r} is {value!r}, not a number")
    if not isinstance(value, kinds):
        raise ReportError(f"{where}: {name!r} is {str(value)[:80]}, not {_kind_names(kinds)}")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > LARGEST_INTEGER:
        raise ReportError(f"{where}: {name!r} is out of range")
    return value


def _kind_names(kinds) -> str:
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join("null" if kind is type(None) else kind.__name__ for kind in kinds)


def _node(obj: dict, name: str, where: str) -> int | None:
    return _field(obj, name, (int, type(None)), where)


def _finite(obj: dict, name: str, where: str) -> float:
    """A number that stays finite as a float (JSON allows 1e999 and 10**400; neither is a figure)."""
    value = _field(obj, name, (int, float), where)
    try:
        as_float = float(value)
    except OverflowError:
        as_float = math.inf
    if not math.isfinite(as_float):
        raise ReportError(f"{where}: {name!r} is not a finite number")
    return as_float


def _load_object(text: str, what: str, max_bytes: int = MAX_REPORT_BYTES) -> dict:
    try:
        obj = loads_bounded(text, max_bytes)
    except ValueError as error:
        raise ReportError(f"{what} is not JSON ({error}): {text[:200]!r}") from None
    if not isinstance(obj, dict):
        raise ReportError(f"{what} is not a JSON object: {text[:200]!r}")
    return obj


def parse_report(text: str) -> Report:
    """The report printed with exit status 0."""
    obj = _load_object(text, "benchmark report")
    version = _field(obj, "version", int, "report")
    if version not in READABLE_VERSIONS:
        raise ReportError(f"report schema version {version}, this hybridmon reads "
                          f"{' and '.join(map(str, READABLE_VERSIONS))}")
    directions = DIRECTIONS[version]
    device = _field(obj, "device", dict, "report")
    results = []
    for position, item in enumerate(_field(obj, "results", list, "report")):
        where = f"results[{position}]"
        if not isinstance(item, dict):
            raise ReportError(f"{where} is not an object")
        direction = _field(item, "direction", str, where)
        memory = _field(item, "memory", str, where)
        if direction not in directions or memory not in MEMORY_KINDS:
            raise ReportError(f"{where}: unknown direction/memory {direction!r}/{memory!r}")
        if _field(item, "verified", bool, where) is not True:
            raise ReportError(f"{where}: copy not verified")
        issue, interfered_throughout = _issue_and_interference(item, version, directions[direction], where)
        bandwidths = [_finite(item, name, where) for name in ("median_gbps", "min_gbps", "max_gbps")]
        median, low, high = bandwidths
        if not (0 < low <= median <= high and math.isfinite(high * GIGA)):
            raise ReportError(f"{where}: bandwidths out of order or not positive: {bandwidths}")
        results.append(CopyResult(
            direction=directions[direction], memory=memory, issue=issue,
            transfer_bytes=_positive(item, "bytes", where),
            samples=_positive(item, "repeat", where),
            median_bytes_per_second=median * GIGA, min_bytes_per_second=low * GIGA,
            max_bytes_per_second=high * GIGA, host_numa_node=_node(item, "host_numa_node", where),
            interfered_throughout=interfered_throughout))
    skipped = []
    for position, item in enumerate(_field(obj, "skipped", list, "report")):
        where = f"skipped[{position}]"
        if not isinstance(item, dict):
            raise ReportError(f"{where} is not an object")
        skipped.append((_positive(item, "bytes", where), _field(item, "reason", str, where)))
    return Report(
        device_index=_field(device, "index", int, "device"),
        device_name=_field(device, "name", str, "device"),
        pci_bus_id=_field(device, "pci_bus_id", str, "device"),
        device_numa_node=_node(device, "numa_node", "device"),
        free_memory_bytes=_field(device, "free_memory_bytes", int, "device"),
        numa_node=_node(obj, "numa_node", "report"),
        numa_note=_optional_text(obj, "numa_note", "report"),
        cpu_affinity=_cpu_affinity(obj) if version >= 2 else None,
        elapsed_seconds=_finite(obj, "elapsed_seconds", "report"),
        time_limit_reached=_field(obj, "time_limit_reached", bool, "report"),
        results=tuple(results), skipped=tuple(skipped), raw=obj)


def _issue_and_interference(item: dict, version: int, direction: str, where: str) -> tuple[str, bool | None]:
    """(issue, interfered_throughout) of one result. Version 3 names both; before it, pinned copies
    were queued, pageable ones a loop, and nobody checked the interference."""
    memory = item["memory"]
    if version < 3:
        return (QUEUED if memory == "pinned" else LOOP), None
    issue = _field(item, "issue", str, where)
    if issue not in ISSUES or (memory == "pageable" and issue != LOOP):
        raise ReportError(f"{where}: unknown issue {issue!r} for {memory} memory")
    if direction not in BIDIRECTIONAL:
        return issue, None
    _positive(item, "interfering_copies_per_sample", where)
    return issue, _field(item, "interfered_throughout", bool, where)


def _optional_text(obj: dict, name: str, where: str) -> str | None:
    value = obj.get(name)
    if value is not None and not isinstance(value, str):
        raise ReportError(f"{where}: {name!r} is neither null nor text")
    return value


def _cpu_affinity(obj: dict) -> dict:
    """{"bound": bool, "cpus": "0-15", "note": str or None}: where the copying thread ran."""
    affinity = _field(obj, "cpu_affinity", dict, "report")
    return {"bound": _field(affinity, "bound", bool, "cpu_affinity"),
            "cpus": _field(affinity, "cpus", str, "cpu_affinity"),
            "note": _optional_text(affinity, "note", "cpu_affinity")}


def _positive(obj: dict, name: str, where: str) -> int:
    value = _field(obj, name, int, where)
    if value <= 0:
        raise ReportError(f"{where}: {name!r} must be positive, got {value}")
    return value


def parse_error(text: str) -> BinaryError:
    """The error object printed with a non-zero exit status."""
    obj = _load_object(text, "benchmark error output")
    return BinaryError(error=_field(obj, "error", str, "error object"),
                       detail=str(obj.get("detail", "")))


def parse_progress(line: str) -> Progress | None:
    """One stderr line; None for anything that is not a progress line (e.g. a driver warning)."""
    try:
        item = loads_bounded(line, MAX_PROGRESS_LINE_BYTES)["progress"]
        return Progress(step=int(item["step"]), steps=int(item["steps"]),
                        direction=PROGRESS_DIRECTIONS.get(item["direction"], str(item["direction"])),
                        memory=str(item["memory"]), transfer_bytes=int(item["bytes"]),
                        issue=str(item.get("issue", "")))
    except (ValueError, KeyError, TypeError, OverflowError):
        return None
