"""Writing benchmark runs into the agent's state directory (the format and the reading side are
exporters/bench_runs.py, which the bench collector and `hybridmon budget` read with).

A run is written to a temporary file in the same directory, fsynced and renamed into place, so a
reader sees the old run or the new one, never half of one; only the newest RUNS_KEPT_PER_GPU runs
of a GPU are kept in the run history. A run of one MIG instance (record["mig"] set) goes to the
history only, as `<time>-<bus id>-mig.json`: the latest run is what the agent exports as the
GPU's link capacity, and a slice's copy engines are not that.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path

from hybridmon.exporters.bench_report import ReportError
from hybridmon.exporters.bench_runs import bench_dir, latest_dir, parse_stored_run

RUNS_KEPT_PER_GPU = 50
_SAFE_BUS_ID = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a crash
    finally:
        os.close(directory)


def save_run(state_dir: str | os.PathLike[str], record: dict) -> Path:
    """Store a run (a dict in the stored-run format) as the GPU's latest and in the run history.

    The record is validated first: what cannot be read back is never stored."""
    text = json.dumps(record, indent=1, sort_keys=True) + "\n"
    parse_stored_run(text)
    bus_id = str(record["gpu"]["pci_bus_id"])
    if not _SAFE_BUS_ID.fullmatch(bus_id):
        raise ReportError(f"refusing to store a run under PCI bus id {bus_id!r}")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(record["finished_at"]))
    runs = bench_dir(state_dir) / "runs"
    suffix = "-mig" if record.get("mig") else ""
    history = runs / f"{stamp}-{bus_id}{suffix}.json"
    _write_atomically(history, text)
    _prune(runs, f"{bus_id}{suffix}")
    if suffix:
        return history
    latest = latest_dir(state_dir) / f"{bus_id}.json"
    _write_atomically(latest, text)
    return latest


def _prune(runs: Path, name: str) -> None:
    mine = sorted(path for path in runs.glob(f"*-{name}.json"))
    for old in mine[:-RUNS_KEPT_PER_GPU]:
        old.unlink(missing_ok=True)

