"""Inference server processes: memory, page faults, CPU time and identity, from /proc/<pid>.

Which processes: the configured pids, those whose comm or command line matches the configuration,
and those the GPU collector sees holding GPU memory. ProcessCollector.watched() hands that list to
numa.ProcessNumaCollector, which says on which NUMA nodes each one's CPUs and pages are.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, TypeVar

from agent.sources import RawSource
from exporters.base import LogOnce, MetricSpec, ParseError, Samples
from exporters.numa import parse_cpu_list

logger = logging.getLogger(__name__)
T = TypeVar("T")

_PROCESS = ("pid", "name")
RESIDENT = MetricSpec("hybridmon_process_resident_bytes",
                      "Resident memory in bytes (VmRSS of /proc/<pid>/status).", "gauge", _PROCESS)
SWAP = MetricSpec("hybridmon_process_swap_bytes",
                  "Memory swapped out in bytes (VmSwap of /proc/<pid>/status).", "gauge", _PROCESS)
LOCKED = MetricSpec("hybridmon_process_locked_bytes",
                    "mlock()ed memory in bytes (VmLck of /proc/<pid>/status).", "gauge", _PROCESS)
PINNED = MetricSpec("hybridmon_process_pinned_bytes",
                    "Memory pinned for device DMA in bytes, e.g. CUDA pinned host buffers (VmPin of "
                    "/proc/<pid>/status).", "gauge", _PROCESS)
THREADS = MetricSpec("hybridmon_process_threads",
                     "Threads of the process (Threads of /proc/<pid>/status).", "gauge", _PROCESS)
ALLOWED_CPUS = MetricSpec("hybridmon_process_allowed_cpus",
                          "CPUs the process may run on (count of Cpus_allowed_list of "
                          "/proc/<pid>/status).", "gauge", _PROCESS)
MINOR_FAULTS = MetricSpec("hybridmon_process_minor_faults_total",
                          "Page faults served without I/O (minflt, field 10 of /proc/<pid>/stat).",
                          "counter", _PROCESS)
MAJOR_FAULTS = MetricSpec("hybridmon_process_major_faults_total",
                          "Page faults that waited for disk or swap (majflt, field 12 of "
                          "/proc/<pid>/stat).", "counter", _PROCESS)
CPU_SECONDS = MetricSpec("hybridmon_process_cpu_seconds_total",
                         "CPU time in user and kernel mode in seconds (utime+stime, fields 14-15 of "
                         "/proc/<pid>/stat, over SC_CLK_TCK).", "counter", _PROCESS)
START_TIME = MetricSpec("hybridmon_process_start_time_seconds",
                        "Start time in seconds since the Unix epoch (starttime, field 22 of "
                        "/proc/<pid>/stat, over SC_CLK_TCK, plus btime of /proc/stat).", "gauge", _PROCESS)
INFO = MetricSpec("hybridmon_process_info",
                  "Always 1: the command line (/proc/<pid>/cmdline, first 200 characters) and why "
                  "the process is watched: config (pids, names, cmdline_patterns) or gpu (holds GPU "
                  "memory).", "gauge", ("pid", "name", "cmdline", "watch_reason"))
CMDLINE_LABEL_LIMIT = 200
_STAT_FIELDS_AFTER_COMM = 20  # state (field 3) .. starttime (field 22)
_GONE_ERRNOS = (errno.ENOENT, errno.ESRCH)
_STATUS_BYTES = {"VmRSS": "resident_bytes", "VmSwap": "swap_bytes", "VmLck": "locked_bytes",
                 "VmPin": "pinned_bytes"}


@dataclass(frozen=True)
class ProcessStat:
    """The fields of /proc/<pid>/stat used here; times in clock ticks."""

    pid: int
    comm: str
    minor_faults: int
    major_faults: int
    user_ticks: int
    system_ticks: int
    start_ticks: int


@dataclass(frozen=True)
class ProcessStatus:
    """The fields of /proc/<pid>/status used here; None where the kernel left one out (zombies,
    kernel threads, old kernels)."""

    resident_bytes: int | None = None
    swap_bytes: int | None = None
    locked_bytes: int | None = None
    pinned_bytes: int | None = None
    threads: int | None = None
    allowed_cpus: frozenset[int] | None = None


def parse_proc_stat(text: str) -> ProcessStat:
    """/proc/<pid>/stat. comm may hold spaces and ')', so it ends at the last ')'."""
    open_paren, close_paren = text.find("("), text.rfind(")")
    if open_paren < 0 or close_paren < open_paren:
        raise ParseError(f"no (comm) in /proc/<pid>/stat text {text[:80]!r}")
    rest = text[close_paren + 1:].split()
    if len(rest) < _STAT_FIELDS_AFTER_COMM:
        raise ParseError(f"/proc/<pid>/stat has {len(rest)} fields after comm, expected 20 or more")
    try:
        numbers = [int(field) for field in [text[:open_paren]] + rest[7:13] + rest[19:20]]
    except ValueError:
        raise ParseError(f"non-numeric field in /proc/<pid>/stat text {text[:80]!r}") from None
    pid, minflt, _cminflt, majflt, _cmajflt, utime, stime, starttime = numbers
    return ProcessStat(pid, text[open_paren + 1:close_paren], minflt, majflt, utime, stime, starttime)


def parse_proc_status(text: str) -> ProcessStatus:
    """/proc/<pid>/status: "Key:\\tvalue" lines; memory sizes are in kB."""
    fields = {}
    for line in text.splitlines():
        key, colon, value = line.partition(":")
        if colon:
            fields[key] = value.strip()
    if "Name" not in fields:
        raise ParseError("no Name: line, not a /proc/<pid>/status file")
    values: dict[str, object] = {}
    try:
        for key, attribute in _STATUS_BYTES.items():
            if key in fields:
                number, _, unit = fields[key].partition(" ")
                if unit != "kB":
                    raise ParseError(f"{key} of /proc/<pid>/status is {fields[key]!r}, not kB")
                values[attribute] = int(number) * 1024
        if "Threads" in fields:
            values["threads"] = int(fields["Threads"])
    except ValueError:
        raise ParseError("non-numeric size or count in /proc/<pid>/status") from None
    if "Cpus_allowed_list" in fields:
        values["allowed_cpus"] = parse_cpu_list(fields["Cpus_allowed_list"])
    return ProcessStatus(**values)


def parse_boot_time(text: str) -> int:
    """btime of /proc/stat: the boot time in seconds since the Unix epoch."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "btime":
            try:
                return int(value.strip())
            except ValueError:
                raise ParseError(f"bad btime line {line!r} in /proc/stat") from None
    raise ParseError("no btime line in /proc/stat")


def format_cmdline(raw: str) -> str:
    """/proc/<pid>/cmdline (arguments ending in NUL) as one space-separated line."""
    return raw.replace("\0", " ").strip()


class ProcessGone(Exception):
    """The process exited while it was being read."""


def read_process_file(source: RawSource, procfs: str, pid: int, name: str, log_once: LogOnce) -> str | None:
    """One /proc/<pid> file: its text, None when it cannot be read (logged once), ProcessGone when
    the process has exited."""
    path = os.path.join(procfs, str(pid), name)
    try:
        return source.read_text(path)
    except OSError as error:
        if error.errno in _GONE_ERRNOS:
            logger.debug("process %s exited while reading %s", pid, path)
            raise ProcessGone(pid) from None
        if error.errno in (errno.EACCES, errno.EPERM):
            log_once(f"denied:{pid}", "cannot read %s (%s): reading another user's process needs root "
                     "or CAP_SYS_PTRACE; its series from that file are left out", path, error.strerror)
        else:
            log_once(f"error:{path}", "cannot read %s: %s; its series are left out", path, error)
        return None


def parse_or_log(parse: Callable[[str], T], text: str | None, what: str, log_once: LogOnce) -> T | None:
    """parse(text), or None when there is no text or it does not parse (logged once)."""
    if text is None:
        return None
    try:
        return parse(text)
    except ParseError as error:
        log_once(f"parse:{what}", "cannot parse %s: %s; its series are left out", what, error)
        return None


class ProcessCollector:
    """Memory, page faults, CPU time and identity of the watched processes."""

    name = "process"
    default_interval_seconds = 1.0
    metric_specs = (RESIDENT, SWAP, LOCKED, PINNED, THREADS, ALLOWED_CPUS, MINOR_FAULTS, MAJOR_FAULTS,
                    CPU_SECONDS, START_TIME, INFO)

    def __init__(self, source: RawSource, procfs: str = "/proc", pids: Iterable[int] = (),
                 names: Iterable[str] = (), cmdline_patterns: Iterable[str] = (),
                 gpu_processes: Callable[[], Mapping[int, str]] = lambda: {},
                 discovery_interval_seconds: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 clock_ticks_per_second: int | None = None) -> None:
        self._source = source
        self._procfs = procfs
        self._pids = tuple(int(pid) for pid in pids)
        self._names = frozenset(names)
        self._patterns = []
        for pattern in cmdline_patterns:
            try:
                self._patterns.append(re.compile(pattern))
            except re.error as error:
                raise ValueError(
                    f"cmdline pattern {pattern!r} is not a valid regular expression: {error}") from None
        self._gpu_processes = gpu_processes
        self._discovery_interval = discovery_interval_seconds
        self._clock = clock
        self._ticks_per_second = clock_ticks_per_second
        self._boot_time: int | None = None
        self._boot_time_read = False
        self._last_scan: float | None = None
        self._discovered: dict[int, int | None] = {}  # pid -> start ticks, to notice a reused pid
        self._current: dict[int, str] = {}
        self._log_once = LogOnce(logger)

    def watched(self) -> dict[int, str]:
        """pid -> name of the processes read on the last collection."""
        return dict(self._current)

    def collect(self) -> Samples:
        # The clock goes through the source so that a replay scans on the same ticks as the recording.
        now = self._source.call("process.clock", self._clock)
        if (self._names or self._patterns) and (
                self._last_scan is None or now - self._last_scan >= self._discovery_interval):
            self._scan()
            self._last_scan = now
        watch = {pid: "config" for pid in (*self._pids, *self._discovered)}
        for pid in self._gpu_pids():
            watch.setdefault(pid, "gpu")  # config wins: it is stable, GPU holders come and go
        ticks = self._clock_ticks()
        boot_time = self._read_boot_time()
        samples, current = Samples(), {}
        for pid, reason in sorted(watch.items()):
            try:  # all three before any sample, so that an exiting process leaves no partial series
                stat_text = read_process_file(self._source, self._procfs, pid, "stat", self._log_once)
                status_text = read_process_file(self._source, self._procfs, pid, "status", self._log_once)
                cmdline_text = read_process_file(self._source, self._procfs, pid, "cmdline", self._log_once)
            except ProcessGone:
                self._discovered.pop(pid, None)
                continue
            stat = parse_or_log(parse_proc_stat, stat_text, f"/proc/{pid}/stat", self._log_once)
            if stat is None:
                continue  # without stat there is no name to label the rest with
            if pid in self._discovered and pid not in self._pids:
                if self._discovered[pid] not in (None, stat.start_ticks):
                    del self._discovered[pid]  # the pid now belongs to another process
                    continue
                self._discovered[pid] = stat.start_ticks
            current[pid] = stat.comm
            status = parse_or_log(parse_proc_status, status_text, f"/proc/{pid}/status", self._log_once)
            self._add(samples, pid, stat, status or ProcessStatus(), ticks, boot_time)
            if cmdline_text is not None:
                cmdline = format_cmdline(cmdline_text)[:CMDLINE_LABEL_LIMIT]
                samples.add(INFO, 1, pid, stat.comm, cmdline, reason)
        self._current = current
        return samples

    def _add(self, samples: Samples, pid: int, stat: ProcessStat, status: ProcessStatus, ticks: int,
             boot_time: int | None) -> None:
        labels = (pid, stat.comm)
        samples.add(RESIDENT, status.resident_bytes, *labels)
        samples.add(SWAP, status.swap_bytes, *labels)
        samples.add(LOCKED, status.locked_bytes, *labels)
        samples.add(PINNED, status.pinned_bytes, *labels)
        samples.add(THREADS, status.threads, *labels)
        samples.add(ALLOWED_CPUS, None if status.allowed_cpus is None else len(status.allowed_cpus), *labels)
        samples.add(MINOR_FAULTS, stat.minor_faults, *labels)
        samples.add(MAJOR_FAULTS, stat.major_faults, *labels)
        samples.add(CPU_SECONDS, (stat.user_ticks + stat.system_ticks) / ticks, *labels)
        samples.add(START_TIME, None if boot_time is None else boot_time + stat.start_ticks / ticks, *labels)

    def _scan(self) -> None:
        try:
            entries = self._source.list_dir(self._procfs)
        except OSError as error:
            self._log_once("scan", "cannot list %s: %s; no process is found by name or command line",
                           self._procfs, error)
            return
        found = {}
        for pid in (int(entry) for entry in entries if entry.isascii() and entry.isdigit()):
            if self._matches(pid):
                found[pid] = self._discovered.get(pid)
        self._discovered = found

    def _matches(self, pid: int) -> bool:
        base = os.path.join(self._procfs, str(pid))
        try:  # processes come and go during a scan, and with hidepid some cannot be read: skip those
            if self._names and self._source.read_text(os.path.join(base, "comm")).rstrip("\n") in self._names:
                return True
            if self._patterns:
                cmdline = format_cmdline(self._source.read_text(os.path.join(base, "cmdline")))
                return any(pattern.search(cmdline) for pattern in self._patterns)
        except OSError:
            pass
        return False

    def _gpu_pids(self) -> list[int]:
        try:
            return [int(pid) for pid in self._gpu_processes()]
        except Exception as error:  # the GPU collector's failure must not stop this one
            self._log_once("gpu", "cannot get the processes holding GPU memory: %s", error)
            return []

    def _clock_ticks(self) -> int:
        if self._ticks_per_second is None:
            self._ticks_per_second = int(self._source.call("os.sysconf(SC_CLK_TCK)",
                                                           lambda: os.sysconf("SC_CLK_TCK")))
        return self._ticks_per_second

    def _read_boot_time(self) -> int | None:
        if not self._boot_time_read:
            self._boot_time_read = True
            path = os.path.join(self._procfs, "stat")
            try:
                self._boot_time = parse_boot_time(self._source.read_text(path))
            except (OSError, ParseError) as error:
                self._log_once("btime", "cannot get btime from %s: %s; process start times are left out",
                               path, error)
        return self._boot_time

    def close(self) -> None:
        pass
