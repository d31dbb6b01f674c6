"""Benchmark runs kept in the agent's state directory: their format, and reading them back.

    <state_dir>/bench/latest/<pci bus id>.json   the newest run per GPU: what the agent exports
    <state_dir>/bench/runs/<UTC time>-<pci bus id>.json   every run, the oldest pruned

Each file is one stored run (format below), written by agent/bench/store.py to a temporary file in
the same directory, fsynced and renamed into place, so a reader (the bench collector, `hybridmon
budget`) sees the old run or the new one, never half of one. The reports inside are the binary's own
output (bench_report.py), kept whole so a later hybridmon can re-read what was measured.

    {"format": 1, "finished_at": <unix time>, "hybridmon_version": "...",
     "gpu": {"index": 0, "uuid": "GPU-...", "name": "...", "pci_bus_id": "0000:17:00.0",
             "numa_node": 0},
     "link": {"generation": 4, "width": 16, "max_generation": 4, "max_width": 16} or null,
     "contended": null or "why the GPU counted as busy when the run was forced",
     "mig": null or "why this run measured one MIG instance, not the whole GPU",
     "path": "pcie" or "c2c" (optional, issue 29; absent: "pcie"),
     "placements": [{"placement": "local", "numa_node": 0, "notes": ["..."], "report": {...}}, ...],
     "failures": [{"placement": "remote", "error": "..."}]}

`notes` (optional) say where the runner could not place the buffers or the copying thread as
asked (e.g. the GPU's node is outside the container's cpuset.mems), so a figure measured unbound
says so. A run with `mig` set is stored in the run history only and never read as the GPU's
capacity (agent/bench/store.py, measured_capacity below). `path` is the link the copies crossed:
"c2c" where NVML said the GPU's NVLink-C2C link was on (GH200, GB200), whose figures are C2C's and
never the PCIe link's capacity; runs stored before issue 29 have none and read as "pcie".
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from hybridmon.exporters.bench_report import (BIDIRECTIONAL, LARGEST_INTEGER, QUEUED, CopyResult, Report,
                                              ReportError, parse_report)
from hybridmon.exporters.jsonsafe import loads_bounded

RECORD_FORMAT = 1
MAX_STORED_RUN_BYTES = 4 * 1024 * 1024
"""Largest stored run read: three placements' reports of about 20 KB each, with room to spare."""
LARGEST_LINK_FIELD = 64
"""PCIe generations and widths are small (Gen1-7, x1-x32); a larger one is no link."""
LATEST_FINISHED_AT = 1e10
"""finished_at is Unix seconds: a later one (year 2286) comes from no clock and breaks gmtime."""
PLACEMENTS = ("local", "remote", "unbound")
PCIE_PATH, C2C_PATH = "pcie", "c2c"
PATHS = (PCIE_PATH, C2C_PATH)


@dataclass(frozen=True)
class Link:
    generation: int
    width: int
    max_generation: int | None
    max_width: int | None


@dataclass(frozen=True)
class StoredRun:
    finished_at: float
    gpu_index: int
    uuid: str
    name: str
    pci_bus_id: str
    gpu_numa_node: int | None
    link: Link | None
    contended: str | None
    reports: dict[str, Report]  # placement -> report
    failures: tuple[tuple[str, str], ...]
    notes: dict[str, tuple[str, ...]] | None = None  # placement -> the runner's placement notes
    mig: str | None = None  # set: one MIG instance was measured, not the GPU's link capacity
    path: str = PCIE_PATH   # the link the copies crossed: PCIE_PATH or C2C_PATH


def bench_dir(state_dir: str | os.PathLike[str]) -> Path:
    return Path(state_dir) / "bench"


def latest_dir(state_dir: str | os.PathLike[str]) -> Path:
    return bench_dir(state_dir) / "latest"


def _optional_int(obj: dict, name: str, largest: int = LARGEST_INTEGER) -> int | None:
    value = obj.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ReportError(f"stored run: {name!r} is {str(value)[:80]}, not an integer")
    if value is not None and not -1 <= value <= largest:
        raise ReportError(f"stored run: {name!r} is out of range (-1 to {largest})")
    return value


def parse_stored_run(text: str) -> StoredRun:
    """A stored run, checked as strictly as the binary's report; raises ReportError."""
    try:
        obj = loads_bounded(text, MAX_STORED_RUN_BYTES)
    except ValueError as error:
        raise ReportError(f"stored run is not JSON: {error}") from None
    if not isinstance(obj, dict) or obj.get("format") != RECORD_FORMAT:
        raise ReportError(f"not a stored benchmark run of format {RECORD_FORMAT}")
    gpu, link = obj.get("gpu"), obj.get("link")
    if not isinstance(gpu, dict) or not isinstance(obj.get("placements"), list):
        raise ReportError("stored run lacks 'gpu' or 'placements'")
    finished_at = obj.get("finished_at")
    if isinstance(finished_at, bool) or not isinstance(finished_at, (int, float)):
        raise ReportError("stored run lacks 'finished_at'")
    if not 0 <= finished_at <= LATEST_FINISHED_AT:  # also false for NaN
        raise ReportError(f"stored run: 'finished_at' {finished_at!r} is not a Unix time")
    contended = obj.get("contended")
    if contended is not None and not isinstance(contended, str):
        raise ReportError("stored run: 'contended' is neither null nor a reason")
    mig = obj.get("mig")
    if mig is not None and not isinstance(mig, str):
        raise ReportError("stored run: 'mig' is neither null nor a reason")
    path = obj.get("path", PCIE_PATH)
    if path not in PATHS:
        raise ReportError(f"stored run: 'path' {str(path)[:40]!r} is neither {' nor '.join(PATHS)}")
    reports, notes = {}, {}
    for entry in obj["placements"]:
        placement = entry.get("placement") if isinstance(entry, dict) else None
        if placement not in PLACEMENTS:
            raise ReportError(f"stored run: unknown placement {placement!r}")
        reports[placement] = parse_report(json.dumps(entry.get("report")))
        listed = entry.get("notes") or []
        if not isinstance(listed, list) or not all(isinstance(note, str) for note in listed):
            raise ReportError(f"stored run: 'notes' of placement {placement} is not a list of text")
        notes[placement] = tuple(note[:2000] for note in listed)
    parsed_link = None
    if isinstance(link, dict):
        generation, width = (_optional_int(link, name, LARGEST_LINK_FIELD)
                             for name in ("generation", "width"))
        if generation and width:
            parsed_link = Link(generation, width, _optional_int(link, "max_generation", LARGEST_LINK_FIELD),
                               _optional_int(link, "max_width", LARGEST_LINK_FIELD))
    listed_failures = obj.get("failures")
    if listed_failures is not None and not isinstance(listed_failures, list):
        raise ReportError("stored run: 'failures' is neither null nor a list")
    failures = tuple((str(item.get("placement"))[:200], str(item.get("error"))[:2000])
                     for item in listed_failures or () if isinstance(item, dict))
    index = _optional_int(gpu, "index")
    return StoredRun(
        finished_at=float(finished_at), gpu_index=-1 if index is None else index,
        uuid=str(gpu.get("uuid") or ""), name=str(gpu.get("name") or ""),
        pci_bus_id=str(gpu.get("pci_bus_id") or ""), gpu_numa_node=_optional_int(gpu, "numa_node"),
        link=parsed_link, contended=contended or None, reports=reports,
        failures=failures, notes=notes, mig=mig or None, path=path)


def load_latest(state_dir: str | os.PathLike[str]) -> tuple[list[StoredRun], list[str]]:
    """Every GPU's latest run, and one message per file that could not be read."""
    runs, problems = [], []
    directory = latest_dir(state_dir)
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return [], []
    except OSError as error:
        return [], [f"{directory}: {error.strerror}"]
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        path = directory / name
        try:
            runs.append(parse_stored_run(read_stored_text(path)))
        except (OSError, ReportError) as error:
            problems.append(f"{path}: {error}")
    return runs, problems


def read_stored_text(path: Path) -> str:
    """A stored run's text, reading at most one byte more than MAX_STORED_RUN_BYTES (so a huge
    file is refused without being read whole); ReportError when it is too large or not UTF-8."""
    with open(path, "rb") as handle:
        data = handle.read(MAX_STORED_RUN_BYTES + 1)
    if len(data) > MAX_STORED_RUN_BYTES:
        raise ReportError(f"stored run is over {MAX_STORED_RUN_BYTES:,} bytes: not one hybridmon wrote")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ReportError(f"stored run is not UTF-8 ({error.reason} at byte {error.start})") from None


def preferred_placement(run: StoredRun) -> str | None:
    """The placement that stands for the host: NUMA-local buffers, else unbound ones."""
    return next((name for name in ("local", "unbound") if name in run.reports), None)


def stands_for_the_link(result: CopyResult) -> bool:
    """Whether a result can size the link: pinned copies timed without their issue cost (queued:
    the bytes the wire carries once the copy engine has work, which is what the traffic counters
    count) and, for a bidirectional figure, measured under interference from start to end (a
    version-3 check; before it the slower stream ran its tail alone). A copy loop's figure at a KV
    block size is what a server's loop gets, not what the link carries: the difference is the
    per-copy issue cost, paid on the host and in the copy engine, not on the wire."""
    if result.memory != "pinned" or result.issue != QUEUED:
        return False
    return result.direction not in BIDIRECTIONAL or result.interfered_throughout is True


def _largest_pinned(run: StoredRun, directions: dict[str, str]) -> dict[str, tuple[float, int]]:
    """directions maps a result's direction to the key returned; the largest copy of each that
    stands for the link, with the preferred placement. Nothing for a MIG instance's run: one
    slice's copy engines are not the link's capacity."""
    placement = preferred_placement(run)
    if placement is None or run.mig:
        return {}
    best: dict[str, tuple[float, int]] = {}
    for result in run.reports[placement].results:
        key = directions.get(result.direction)
        if key is None or not stands_for_the_link(result):
            continue
        known = best.get(key)
        if known is None or result.transfer_bytes > known[1]:
            best[key] = (result.median_bytes_per_second, result.transfer_bytes)
    return best


def measured_capacity(run: StoredRun) -> dict[str, tuple[float, int]]:
    """direction (host_to_device, device_to_host) -> (median bytes/s, transfer bytes) of the largest
    pinned copy in ONE direction at a time (nvbandwidth's host_to_device_memcpy_ce and
    device_to_host_memcpy_ce), with the preferred placement: what the link delivers to a
    well-placed server."""
    return _largest_pinned(run, {"host_to_device": "host_to_device", "device_to_host": "device_to_host"})


def bidirectional_capacity(run: StoredRun) -> dict[str, tuple[float, int]]:
    """direction (host_to_device, device_to_host) -> (median bytes/s, transfer bytes) of that
    direction while the opposite direction copies twice the bytes (nvbandwidth's
    host_to_device_bidirectional_memcpy_ce / device_to_host_bidirectional_memcpy_ce), where the
    interference held to the end; {} for a version-1 run (its figure was a sum) and a version-2
    run (its slower stream ran its tail alone: +32 % on a link doing 12.5 GB/s one way under load
    and 24 the other, issue 29)."""
    return _largest_pinned(run, {name: name.removesuffix("_bidirectional") for name in BIDIRECTIONAL})
