"""Who faults while the host swaps in: every process's major page faults, read only then.

When memory comes back from swap (pswpin + zswpin, the host_memory collector's last reading) at
or above `swap_in_bytes_per_second`, each collection lists /proc and reads /proc/<pid>/stat
(field 12, majflt: faults that waited for a page from disk or swap, summed over the process's
threads) of every process, watched or not, and exports the major-fault rate of the `top` busiest
at or above `min_major_faults_per_second` over the time since the previous scan. While swap-in is
below that line it reads nothing at all: a quiet host pays one comparison a collection.

A collector of its own, not a part of process.py or host_memory.py: its source is every
/proc/<pid>/stat rather than a watch list's files or the host-wide /proc/vmstat, it is paid for
only while the host swaps in, and its series are a capped, changing set of processes.
/proc/<pid>/stat is readable by every user (fs/proc/base.c: mode 0444), so no privilege is needed.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable

from pydantic import Field

from hybridmon.exporters.base import (CollectorContext, CollectorRegistration, CollectorSettings, LogOnce, MetricSpec,
                                      ParseError, Samples)
from hybridmon.exporters.process import parse_proc_stat
from hybridmon.exporters.sources import RawSource, ReplayedCallError

logger = logging.getLogger(__name__)

MAJOR_FAULT_RATE = MetricSpec(
    "hybridmon_faulting_process_major_faults_per_second",
    "Major page faults per second of a process, watched or not, over the time since the previous "
    "scan (majflt, field 12 of /proc/<pid>/stat). Exported only while the host swaps in (pswpin + "
    "zswpin in /proc/vmstat) at or above faulting_processes.swap_in_bytes_per_second, for the "
    "`top` processes at or above min_major_faults_per_second; absent otherwise.",
    "gauge",
    ("pid", "process_name"),
)

# The defaults. The gate is HostSwapThrash's swap-in line ([swap_thrash] swap_in_bytes_per_second,
# 1 MiB/s: 256 pages/s of 4 KiB), so the scan runs whenever that alert could fire; the floor is
# its per-process one ([swap_thrash] process_major_faults_per_second, 10/s), so a process named
# here is one that alert would call faulting. Five names fit an alert's text.
SWAP_IN_GATE_BYTES_PER_SECOND = 1048576.0
MIN_MAJOR_FAULTS_PER_SECOND = 10.0
TOP_PROCESSES = 5


class FaultingProcessesCollector:
    """Major-fault rates of the processes that fault most, scanned only while the host swaps in.

    swap_in_bytes: bytes read back from swap since boot (pswpin + zswpin), None when unknown; the
    agent passes the host_memory collector's last reading, recorded through this collector's source.
    """

    name = "faulting_processes"
    default_interval_seconds = 5.0
    metric_specs = (MAJOR_FAULT_RATE,)

    def __init__(self, source: RawSource, swap_in_bytes: Callable[[], int | None], procfs: str = "/proc",
                 swap_in_bytes_per_second: float = SWAP_IN_GATE_BYTES_PER_SECOND,
                 min_major_faults_per_second: float = MIN_MAJOR_FAULTS_PER_SECOND, top: int = TOP_PROCESSES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if top < 1:
            raise ValueError(f"top must be at least 1, not {top}")
        if swap_in_bytes_per_second <= 0 or min_major_faults_per_second <= 0:
            raise ValueError("swap_in_bytes_per_second and min_major_faults_per_second must be above 0 "
                             "(at 0 every quiet host would be scanned, every idle process named)")
        self._source = source
        self._swap_in_bytes = swap_in_bytes
        self._procfs = procfs
        self._gate = swap_in_bytes_per_second
        self._floor = min_major_faults_per_second
        self._top = top
        self._clock = clock
        self._log_once = LogOnce(logger)
        self._last_swap_in: tuple[float, int] | None = None  # (when, bytes) at the last collection
        # The previous scan: when, and pid -> (start ticks, majflt, comm); None while the gate is down,
        # so that a new episode's first scan is a baseline, not a rate over the quiet time between.
        self._last_scan: tuple[float, dict[int, tuple[int, int, str]]] | None = None

    def collect(self) -> Samples:
        samples = Samples()
        # The clock goes through the source so that a replay computes the same rates.
        now = self._source.call("faulting_processes.clock", self._clock)
        swapped_in = self._swap_in_bytes()
        previous, self._last_swap_in = self._last_swap_in, (
            None if swapped_in is None else (now, swapped_in))
        if swapped_in is None or previous is None or now <= previous[0] or swapped_in < previous[1]:
            self._last_scan = None  # no rate yet, or the counter went back (a reboot under a replay)
            return samples
        if (swapped_in - previous[1]) / (now - previous[0]) < self._gate:
            self._last_scan = None
            return samples
        faults = self._scan()
        last, self._last_scan = self._last_scan, (now, faults)
        if last is None or now <= last[0]:
            return samples
        elapsed = now - last[0]
        rates = []
        for pid, (start_ticks, major, _) in faults.items():
            before = last[1].get(pid)
            if before is None or before[0] != start_ticks or major < before[1]:
                continue  # new since the last scan, or the pid now belongs to another process
            rate = (major - before[1]) / elapsed
            if rate >= self._floor:
                rates.append((rate, pid))
        rates.sort(key=lambda pair: (-pair[0], pair[1]))
        for rate, pid in rates[:self._top]:
            samples.add(MAJOR_FAULT_RATE, rate, pid, faults[pid][2])
        return samples

    def _scan(self) -> dict[int, tuple[int, int, str]]:
        """pid -> (start ticks, majflt, comm) of every process whose stat could be read."""
        try:
            entries = self._source.list_dir(self._procfs)
        except (OSError, ReplayedCallError) as error:
            self._log_once("list", "cannot list %s: %s; no faulting process is named", self._procfs, error)
            return {}
        faults = {}
        for entry in entries:
            if not entry.isdigit():
                continue
            path = os.path.join(self._procfs, entry, "stat")
            try:
                stat = parse_proc_stat(self._source.read_text(path))
            except OSError:
                continue  # exited during the scan
            except ParseError as error:
                self._log_once(f"parse:{entry}", "cannot parse %s: %s; that process is left out", path, error)
                continue
            faults[stat.pid] = (stat.start_ticks, stat.major_faults, stat.comm)
        return faults

    def close(self) -> None:
        pass


class FaultingProcessesSettings(CollectorSettings):
    """[faulting_processes]: when the scan runs and which processes it names."""

    swap_in_bytes_per_second: float = Field(
        default=SWAP_IN_GATE_BYTES_PER_SECOND, gt=0,
        description="scan every process's major faults only while the host reads back at least this "
        "much from swap and zswap together (HostSwapThrash's swap-in threshold)")
    min_major_faults_per_second: float = Field(
        default=MIN_MAJOR_FAULTS_PER_SECOND, gt=0,
        description="name only processes faulting at least this fast (HostSwapThrash's per-process floor)")
    top: int = Field(default=TOP_PROCESSES, ge=1, le=50, description="name at most this many, busiest first")


def _faulting_processes_collector(context: CollectorContext) -> FaultingProcessesCollector:
    settings: FaultingProcessesSettings = context.settings
    host_memory = context.earlier.get("host_memory")
    if host_memory is None:
        logger.warning("the host_memory collector is disabled: faulting_processes cannot tell when the "
                       "host swaps in and scans nothing")
        read = lambda: None  # noqa: E731
    else:
        read = host_memory.swap_in_bytes
    return FaultingProcessesCollector(
        context.source,
        # Through this collector's own source, so that a replay sees what the recording saw.
        lambda: context.source.call("agent.host_swap_in_bytes", read),
        procfs=context.procfs,
        swap_in_bytes_per_second=settings.swap_in_bytes_per_second,
        min_major_faults_per_second=settings.min_major_faults_per_second,
        top=settings.top,
    )


# Not essential: it names processes only while the host swaps in; host_memory reads the signal.
REGISTRATION = CollectorRegistration(FaultingProcessesCollector, _faulting_processes_collector,
                                     settings=FaultingProcessesSettings, runs_after=("host_memory",))
