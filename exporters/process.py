"""Inference server processes: memory, page faults, CPU time and identity, from /proc/<pid>.

Which processes: the configured pids, those whose comm or command line matches the configuration,
and those the GPU collector sees holding GPU memory. ProcessCollector.watched() hands that list to
numa.ProcessNumaCollector, which says on which NUMA nodes each one's CPUs and pages are.

Identity comes from the command line, but the line itself is exported only when asked for
(export_cmdline), redacted: the endpoints are unauthenticated (see process_cmdline.py).
"""
from __future__ import annotations

import logging
import math
import os
import re
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from hybridmon.exporters.sources import RawSource, ReplayedCallError, TraceMissError
from pydantic import Field, field_validator

from hybridmon.exporters.base import (MIN_DISCOVERY_SECONDS, CollectorContext, CollectorRegistration,
                                      CollectorSettings, LogOnce, MetricSpec, ParseError, Samples, parse_logged)
from hybridmon.exporters.cgroup_memory import (CGROUP_MEMORY_HEADROOM, CGROUP_MEMORY_LIMIT, CgroupMemoryBound,
                                               CgroupMount, memory_bound, oom_kill_files, parse_memory_mounts,
                                               parse_oom_kill, parse_process_cgroups, rebase)
from hybridmon.exporters.host_memory import parse_vmstat
from hybridmon.exporters.pid_namespace import PidView, advice, pid_view
from hybridmon.exporters.process_cmdline import ProcessIdentity, cmdline_label, identity_of
from hybridmon.exporters.procfs import (ProcessGone, ProcessStatus, parse_proc_status, read_process_file,
                                       read_process_path)

logger = logging.getLogger(__name__)

# process_name is the comm of /proc/<pid>/stat: the label name the GPU collector's per-process
# series and every process alert use too, so that rules join and alert on them without renaming.
_PROCESS = ("pid", "process_name")
RESIDENT = MetricSpec("hybridmon_process_resident_bytes",
                      "Resident memory in bytes (VmRSS of /proc/<pid>/status).", "gauge", _PROCESS)
SWAP = MetricSpec("hybridmon_process_swap_bytes",
                  "Memory swapped out in bytes (VmSwap of /proc/<pid>/status).", "gauge", _PROCESS)
LOCKED = MetricSpec("hybridmon_process_locked_bytes",
                    "mlock()ed memory in bytes (VmLck of /proc/<pid>/status).", "gauge", _PROCESS)
PINNED = MetricSpec("hybridmon_process_pinned_bytes",
                    "Memory the kernel pinned for DMA on the process's behalf, in bytes (VmPin of "
                    "/proc/<pid>/status, mm->pinned_vm): RDMA memory registrations (ib_umem), "
                    "io_uring fixed buffers and VFIO/iommufd DMA mappings (VFIO's older type1 "
                    "backend counts in VmLck instead). CUDA pinned host memory (cudaHostAlloc, "
                    "cudaHostRegister) is generally counted in neither VmPin nor VmLck.",
                    "gauge", _PROCESS)
THREADS = MetricSpec("hybridmon_process_threads",
                     "Threads of the process (Threads of /proc/<pid>/status); only with [process] "
                     "detail_series = true.", "gauge", _PROCESS)
ALLOWED_CPUS = MetricSpec("hybridmon_process_allowed_cpus",
                          "CPUs the process may run on (count of Cpus_allowed_list of "
                          "/proc/<pid>/status); only with [process] detail_series = true.", "gauge",
                          _PROCESS)
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
MEMLOCK_LIMIT = MetricSpec("hybridmon_process_memlock_limit_bytes",
                           "Soft limit on memory the process may lock, in bytes (Max locked memory of "
                           "/proc/<pid>/limits, RLIMIT_MEMLOCK); +Inf when unlimited. It bounds mlock "
                           "(VmLck) and RDMA or io_uring pinning (VmPin), not CUDA pinned memory "
                           "(cudaHostAlloc, cudaHostRegister).",
                           "gauge", _PROCESS)
INFO = MetricSpec("hybridmon_process_info",
                  "Always 1: what the process is, from its command line (/proc/<pid>/cmdline) and "
                  "never the line itself: executable (basename of argv[0]), server (inference "
                  "server family: vllm, sglang, llamacpp, tgi, ollama; empty when unknown), model "
                  "(the served model name, else the weights: a path by its last component, a URL "
                  "without user-info or query), all three empty when the command line cannot be "
                  "read; why the process is watched: config (pids, names, cmdline_patterns) or gpu "
                  "(holds GPU memory); and root_pid, the watched process at the root of this one's "
                  "tree of watched processes, found by following the parent pid (field 4 of "
                  "/proc/<pid>/stat) while the parent is watched too, the process itself when its "
                  "parent is not watched. The processes of one inference server share root_pid "
                  "(vLLM's engine core and workers under its API server, SGLang's scheduler under "
                  "launch_server, TGI's router and shards under its launcher, Ollama's runner under "
                  "ollama serve), so each is judged with the load of the server that listens in its "
                  "tree.",
                  "gauge", ("pid", "process_name", "executable", "server", "model", "watch_reason", "root_pid"))
CMDLINE_INFO = MetricSpec("hybridmon_process_cmdline_info",
                          "Always 1, only with process.export_cmdline = true: the command line "
                          "(/proc/<pid>/cmdline) with secrets replaced by <redacted> (values of "
                          "options and env-style assignments named like key, token, secret, pass, "
                          "pwd, auth, credential or cookie; of -p and -k; URL user-info; bearer "
                          "tokens; hf_, sk-, ghp_, AKIA... token shapes), cut to 200 characters.",
                          "gauge", ("pid", "process_name", "cmdline"))
WEIGHTS_OFFLOAD = MetricSpec(
    "hybridmon_process_weights_offload_bytes",
    "Bytes of model weights per GPU that the process's command line keeps in host memory, which "
    "the GPU reads over the bus in every forward pass: vLLM's and SGLang's --cpu-offload-gb N "
    "(GiB per GPU). Absent without the option or at 0. The evidence InferenceWeightsCrossingBus "
    "needs before it names weights as the cause of host-to-device traffic.", "gauge", _PROCESS)
# What stays of a process once it is gone, so that its exit can be counted: the identity a
# restarted server keeps (comm, and the server family and model of its command line, as in INFO).
_IDENTITY = ("process_name", "server", "model")
EXITS = MetricSpec("hybridmon_process_exits_total",
                   "Watched processes of this identity (process_name: comm; server and model: from "
                   "the command line, as in hybridmon_process_info) that exited: the pid gone from "
                   "/proc, left a zombie (state Z or X in /proc/<pid>/stat), or now another process "
                   "(a later starttime). 0 from the first time the identity is watched, so that the "
                   "first exit is an increase; forgotten an hour after the last of its processes "
                   "is gone.", "counter", _IDENTITY)
OOM_KILLED = MetricSpec("hybridmon_process_oom_killed_total",
                        "Of hybridmon_process_exits_total, the exits the kernel OOM killer caused: "
                        "the oom_kill count of the process's own memory cgroup (v2 memory.events, "
                        "v1 memory.oom_control) rose between its last reading (every discovery "
                        "interval) and the exit, by at least as many as the watched processes of that "
                        "cgroup that exited with it; where that cannot be read, the host's oom_kill "
                        "(/proc/vmstat) rose since the collector's last run by at least as many as "
                        "the watched processes that exited meanwhile. Fewer kills than exits: which "
                        "process was killed cannot be told, and none is counted.",
                        "counter", _IDENTITY)
# proc(5): Z zombie (exited, not yet reaped by its parent), X dead.
_EXITED_STATES = frozenset("ZX")
# An identity none of whose processes is watched any more is kept this long after the last was,
# so that a crash loop's exits are counted across its restarts, then forgotten.
IDENTITY_KEPT_SECONDS = 3600.0
_PID_ENTRY = re.compile(r"[0-9]{1,10}")
_STAT_FIELDS_AFTER_COMM = 20  # state (field 3) .. starttime (field 22)


@dataclass(frozen=True)
class ProcessStat:
    """The fields of /proc/<pid>/stat used here; times in clock ticks."""

    pid: int
    comm: str
    parent_pid: int
    minor_faults: int
    major_faults: int
    user_ticks: int
    system_ticks: int
    start_ticks: int
    state: str = "R"  # field 3: R, S, D, Z (zombie), X (dead)...


@dataclass(frozen=True)
class _Seen:
    """A watched process as the last collection saw it: enough to count its exit."""

    start_ticks: int
    identity: tuple[str, str, str]      # process_name, server, model


@dataclass
class _Exits:
    exits: int = 0
    oom_killed: int = 0
    last_watched: float = 0.0           # collector clock


def parse_proc_stat(text: str) -> ProcessStat:
    """/proc/<pid>/stat. comm may hold spaces and ')', so it ends at the last ')'."""
    open_paren, close_paren = text.find("("), text.rfind(")")
    if open_paren < 0 or close_paren < open_paren:
        raise ParseError(f"no (comm) in /proc/<pid>/stat text {text[:80]!r}")
    rest = text[close_paren + 1:].split()
    if len(rest) < _STAT_FIELDS_AFTER_COMM:
        raise ParseError(f"/proc/<pid>/stat has {len(rest)} fields after comm, expected 20 or more")
    try:
        numbers = [int(field) for field in [text[:open_paren]] + rest[1:2] + rest[7:13] + rest[19:20]]
    except ValueError:
        raise ParseError(f"non-numeric field in /proc/<pid>/stat text {text[:80]!r}") from None
    pid, ppid, minflt, _cminflt, majflt, _cmajflt, utime, stime, starttime = numbers
    return ProcessStat(pid, text[open_paren + 1:close_paren], ppid, minflt, majflt, utime, stime,
                       starttime, rest[0])


def tree_roots(parents: Mapping[int, int]) -> dict[int, int]:
    """pid -> the root of its tree among `parents` (pid -> parent pid of the watched processes):
    the farthest ancestor reached by parent links that stay inside the watched set. A loop (a
    garbled or racing read) ends at the first pid seen twice, so every walk terminates."""
    roots = {}
    for pid in parents:
        seen, at = {pid}, pid
        while parents[at] in parents and parents[at] not in seen:
            at = parents[at]
            seen.add(at)
        roots[pid] = at
    return roots


def parse_boot_time(text: str) -> int:
    """btime of /proc/stat: the boot time in seconds since the Unix epoch."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "btime":
            try:
                return int(value.strip())
            except ValueError:
                raise ParseError(f"bad btime line {line[:80]!r} in /proc/stat") from None
    raise ParseError("no btime line in /proc/stat")


def parse_memlock_limit(text: str) -> float:
    """Soft 'Max locked memory' of /proc/<pid>/limits in bytes; inf for 'unlimited'."""
    for line in text.splitlines():
        if line.startswith("Max locked memory"):
            fields = line[len("Max locked memory"):].split()
            if fields and fields[0] == "unlimited":
                return math.inf
            if fields and re.fullmatch(r"\d{1,20}", fields[0]):
                return float(fields[0])
            raise ParseError(f"unreadable Max locked memory line: {line[:80]!r}")
    raise ParseError("no 'Max locked memory' line in limits")


def format_cmdline(raw: str) -> str:
    """/proc/<pid>/cmdline (arguments ending in NUL) as one space-separated line."""
    return raw.replace("\0", " ").strip()


@dataclass(frozen=True)
class _SlowFiles:
    """What a process's cmdline and limits said when read (`read_at`, the collector's clock)."""

    start_ticks: int  # of the process read: a reused pid is another process
    read_at: float
    cmdline_text: str | None
    memlock_limit: float | None
    identity: ProcessIdentity | None


# Per-process series that no alert (detector or rule), shipped dashboard or status page reads: only
# with [process] detail_series, so that a fleet pays for each watched process only the series its
# alerts need (issue 33: 23 series a process at fleet scale was the agent's largest cardinality).
# The allowed CPUs are context only: InferenceProcessNumaMisplaced judges where a process runs, not
# where it may, and names them in its text when they are there.
DETAIL_SPECS = (THREADS, ALLOWED_CPUS, CGROUP_MEMORY_LIMIT)


class ProcessCollector:
    """Memory, page faults, CPU time and identity of the watched processes.

    export_cmdline: also export each one's redacted command line (hybridmon_process_cmdline_info).
    detail_series: also the series of DETAIL_SPECS (and process_numa's optional ones, which read
    this attribute).
    """

    name = "process"
    default_interval_seconds = 1.0
    metric_specs = (RESIDENT, SWAP, LOCKED, PINNED, THREADS, ALLOWED_CPUS, MINOR_FAULTS, MAJOR_FAULTS,
                    CPU_SECONDS, START_TIME, MEMLOCK_LIMIT, CGROUP_MEMORY_LIMIT, CGROUP_MEMORY_HEADROOM,
                    INFO, CMDLINE_INFO, WEIGHTS_OFFLOAD, EXITS, OOM_KILLED)

    def __init__(self, source: RawSource, procfs: str = "/proc", sysfs: str = "/sys", pids: Iterable[int] = (),
                 names: Iterable[str] = (), cmdline_patterns: Iterable[str] = (),
                 gpu_processes: Callable[[], Mapping[int, str]] = lambda: {},
                 discovery_interval_seconds: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 clock_ticks_per_second: int | None = None, export_cmdline: bool = False,
                 detail_series: bool = False) -> None:
        self._source = source
        self.detail_series = detail_series
        self._procfs = procfs
        self._sysfs = sysfs
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
        self._export_cmdline = export_cmdline
        self._boot_time: int | None = None
        self._boot_time_read = False
        self._last_scan: float | None = None
        self._discovered: dict[int, int | None] = {}  # pid -> start ticks, to notice a reused pid
        self._current: dict[int, str] = {}
        self._log_once = LogOnce(logger)
        self._pid_view: PidView | None = None  # decided at the first GPU process; fixed for the run
        self._cgroup_mounts: list[CgroupMount] | None = None
        # pid -> (when read, its bound): limits change rarely and the forecast they bound spans
        # hours, so each pid's cgroup files are read once per discovery interval, not every tick.
        self._cgroup_bounds: dict[int, tuple[float, CgroupMemoryBound | None]] = {}
        self._slow: dict[int, _SlowFiles] = {}  # pid -> its cmdline and limits, see _slow_files
        self._stat_paths: dict[int, tuple[str, str]] = {}  # pid -> its stat and status paths, read every run
        self._seen: dict[int, _Seen] = {}     # the processes of the last collection
        self._exits: dict[tuple[str, str, str], _Exits] = {}  # by identity
        # pid -> (its cgroup's OOM kill file, the count read with its cgroup bound)
        self._oom_counts: dict[int, tuple[str, int]] = {}
        self._host_oom_kills: int | None = None  # /proc/vmstat oom_kill at the last collection

    def watched(self) -> dict[int, str]:
        """pid -> process_name (comm) of the processes read on the last collection."""
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
        samples, current, parents = Samples(), {}, {}
        described: dict[int, tuple[str, tuple[str, str, str]]] = {}  # pid -> watch reason, identity
        seen: dict[int, _Seen] = {}
        gone: set[int] = set()
        for pid, reason in sorted(watch.items()):
            paths = self._stat_paths.get(pid)
            if paths is None:
                paths = self._stat_paths[pid] = (self._path(pid, "stat"), self._path(pid, "status"))
            stat_path, status_path = paths
            try:  # every file before any sample, so that an exiting process leaves no partial series
                stat_text = read_process_path(self._source, stat_path, pid, self._log_once)
                status_text = read_process_path(self._source, status_path, pid, self._log_once)
                stat = parse_logged(parse_proc_stat, stat_text, stat_path, self._log_once)
                if stat is None:
                    continue  # without stat there is no name to label the rest with
                if stat.state in _EXITED_STATES:
                    raise ProcessGone(pid)  # a zombie has exited; its parent has yet to reap it
                slow = self._slow_files(pid, stat.start_ticks, now)
            except ProcessGone:
                self._discovered.pop(pid, None)
                gone.add(pid)
                continue
            if pid in self._discovered and pid not in self._pids:
                if self._discovered[pid] not in (None, stat.start_ticks):
                    del self._discovered[pid]  # the pid now belongs to another process
                    gone.add(pid)               # and the one watched has exited
                    continue
                self._discovered[pid] = stat.start_ticks
            cmdline_text = slow.cmdline_text
            current[pid] = stat.comm
            seen[pid] = _Seen(stat.start_ticks, (stat.comm, slow.identity.server, slow.identity.model)
                              if slow.identity is not None else (stat.comm, "", ""))
            parents[pid] = stat.parent_pid
            status = parse_logged(parse_proc_status, status_text, status_path, self._log_once)
            bound = self._cgroup_bound(pid, now)
            identity = slow.identity if cmdline_text is not None else None
            self._add(samples, pid, stat, status or ProcessStatus(), ticks, boot_time, slow.memlock_limit, bound,
                      None if identity is None else identity.weights_offload_bytes)
            described[pid] = reason, ("", "", "")
            if identity is not None:
                described[pid] = reason, (identity.executable, identity.server, identity.model)
                if self._export_cmdline:
                    samples.add(CMDLINE_INFO, 1, pid, stat.comm, cmdline_label(cmdline_text))
        # root_pid is a label of INFO, not a series of its own (issue 33's budget): a process's
        # root changes only when a watched parent exits or its parent starts or stops being
        # watched, rare events that would replace a series of either kind.
        for pid, root in sorted(tree_roots(parents).items()):
            reason, (executable, server, model) = described[pid]
            samples.add(INFO, 1, pid, current[pid], executable, server, model, reason, root)
        self._count_exits(seen, gone, now)
        for identity, counted in sorted(self._exits.items()):
            samples.add(EXITS, counted.exits, *identity)
            samples.add(OOM_KILLED, counted.oom_killed, *identity)
        self._current = current
        self._cgroup_bounds = {pid: read for pid, read in self._cgroup_bounds.items() if pid in current}
        self._slow = {pid: read for pid, read in self._slow.items() if pid in current}
        self._stat_paths = {pid: paths for pid, paths in self._stat_paths.items() if pid in current}
        self._oom_counts = {pid: read for pid, read in self._oom_counts.items() if pid in current}
        return samples

    def _count_exits(self, seen: dict[int, _Seen], gone: set[int], now: float) -> None:
        """Count the exits of the processes the last collection saw and this one does not (or
        sees as another process), and which of them the OOM killer caused (see OOM_KILLED)."""
        exited = []
        for pid, before in self._seen.items():
            if pid in seen:
                if seen[pid].start_ticks != before.start_ticks:
                    exited.append((pid, before))  # the pid was reused: the one seen has exited
            elif pid in gone or self._has_exited(pid, before.start_ticks):
                exited.append((pid, before))
        host_kills = self._read_host_oom_kills() if (seen or self._seen) else None
        kills_since = (None if host_kills is None or self._host_oom_kills is None
                       else max(0, host_kills - self._host_oom_kills))
        self._host_oom_kills = host_kills
        for pid, process in seen.items():
            self._exits.setdefault(process.identity, _Exits()).last_watched = now
        self._seen = seen
        if exited:
            for pid, process in exited:
                self._exits.setdefault(process.identity, _Exits(last_watched=now)).exits += 1
            self._attribute_oom_kills(exited, kills_since)
        self._exits = {identity: counted for identity, counted in self._exits.items()
                       if now - counted.last_watched <= IDENTITY_KEPT_SECONDS}

    def _attribute_oom_kills(self, exited: list[tuple[int, _Seen]], host_kills: int | None) -> None:
        """OOM_KILLED += 1 for each exit the OOM killer caused: its cgroup's count tells where it
        can be read; the rest are judged together by the host's count, once the kills the cgroups
        account for are taken off."""
        by_file: dict[str, list[tuple[int, _Seen, int]]] = {}
        undecided = []
        for pid, process in exited:
            rise = self._cgroup_oom_rise(pid)
            if rise is None:
                undecided.append(process)
            else:
                by_file.setdefault(self._oom_counts[pid][0], []).append((pid, process, rise))
        accounted = 0
        for processes in by_file.values():
            kills = max(rise for _, _, rise in processes)
            if kills >= len(processes):
                accounted += len(processes)
                for _, process, _ in processes:
                    self._exits[process.identity].oom_killed += 1
        if undecided and host_kills is not None and host_kills - accounted >= len(undecided):
            for process in undecided:
                self._exits[process.identity].oom_killed += 1

    def _cgroup_oom_rise(self, pid: int) -> int | None:
        """OOM kills its cgroup counted since its last reading; None where it cannot be read (no
        readable cgroup, or the cgroup went with the process)."""
        known = self._oom_counts.get(pid)
        if known is None:
            return None
        try:
            return max(0, parse_oom_kill(self._source.read_text(known[0])) - known[1])
        except (OSError, ParseError):
            return None

    def _has_exited(self, pid: int, start_ticks: int) -> bool:
        """A pid no longer watched (NVML no longer lists it, its stat unreadable): exited, or alive
        and no longer holding GPU memory? Its stat says."""
        try:
            text = read_process_file(self._source, self._procfs, pid, "stat", self._log_once)
        except ProcessGone:
            return True
        stat = None if text is None else parse_logged(parse_proc_stat, text, self._path(pid, "stat"),
                                                      self._log_once)
        return stat is not None and (stat.start_ticks != start_ticks or stat.state in _EXITED_STATES)

    def _read_host_oom_kills(self) -> int | None:
        """oom_kill of /proc/vmstat, recorded as the number alone (a trace keeps vmstat once, from
        host_memory); None when unreadable, or replaying a trace recorded before it was read."""
        path = os.path.join(self._procfs, "vmstat")
        try:
            return int(self._source.call("process.oom_kills",
                                         lambda: parse_vmstat(self._source.read_text(path)).get("oom_kill")))
        except (OSError, ParseError, ReplayedCallError, TraceMissError, TypeError, ValueError) as error:
            self._log_once("oom_kills", "cannot read oom_kill from %s: %s; an exit is counted as an "
                           "OOM kill only where its cgroup's count says so", path, error)
            return None

    def _slow_files(self, pid: int, start_ticks: int, now: float) -> "_SlowFiles":
        """cmdline and limits of one process, read again once per discovery interval and whenever
        the pid belongs to a new process: both are set when it starts and seldom change after
        (setproctitle, prlimit), so reading them on every tick was a third of this collector's
        reads. ProcessGone when the process exits meanwhile."""
        known = self._slow.get(pid)
        if known is not None and known.start_ticks == start_ticks and now - known.read_at < self._discovery_interval:
            return known
        cmdline_text = read_process_file(self._source, self._procfs, pid, "cmdline", self._log_once)
        read = _SlowFiles(start_ticks, now, cmdline_text, self._memlock_limit(pid),
                          None if cmdline_text is None else self._identity(pid, cmdline_text))
        self._slow[pid] = read
        return read

    def _identity(self, pid: int, cmdline_text: str) -> ProcessIdentity | None:
        """identity_of(), which reads what any local user may write on a command line: should a
        line still defeat a parser, only that process loses its identity series (issue 30: one
        malformed --model URL made every tick fail and took every process's series with it)."""
        try:
            return identity_of(cmdline_text)
        except Exception as error:  # noqa: BLE001 - a parser's bug must not blind the collector
            self._log_once(f"identity:{pid}", "cannot read the command line of pid %s (%s: %s); its "
                           "executable, server and model are left out", pid, type(error).__name__, error)
            return None

    def _cgroup_bound(self, pid: int, now: float) -> CgroupMemoryBound | None:
        """Optional like the memlock limit: unreadable cgroup files leave the series out."""
        if pid in self._cgroup_bounds and now - self._cgroup_bounds[pid][0] < self._discovery_interval:
            return self._cgroup_bounds[pid][1]
        bound = None
        mounts = self._memory_cgroup_mounts()
        if mounts:
            try:
                cgroups = parse_process_cgroups(self._source.read_text(self._path(pid, "cgroup")))
                self._read_oom_count(pid, mounts, cgroups)
                bound = memory_bound(self._source, mounts, cgroups)
            except (OSError, ParseError, ValueError) as error:
                self._log_once(f"cgroup:{pid}", "cannot read the memory cgroup of pid %s: %s; its "
                               "cgroup limit is left out and MemAvailable alone bounds it", pid, error)
        self._cgroup_bounds[pid] = (now, bound)
        return bound

    def _read_oom_count(self, pid: int, mounts: list[CgroupMount], cgroups: dict[int, str]) -> None:
        """The OOM kills its cgroup has counted so far, the baseline its exit is judged against.
        The root cgroup has no such file, nor a v2 tree without the memory controller."""
        for path in oom_kill_files(mounts, cgroups):
            try:
                self._oom_counts[pid] = (path, parse_oom_kill(self._source.read_text(path)))
                return
            except FileNotFoundError:
                continue
            except (OSError, ParseError) as error:
                self._log_once(f"oom:{path}", "cannot read the OOM kills of %s: %s; an exit of pid "
                               "%s is judged by the host's count", path, error, pid)
                break
        self._oom_counts.pop(pid, None)

    def _memory_cgroup_mounts(self) -> list[CgroupMount]:
        if self._cgroup_mounts is None:
            path = os.path.join(self._procfs, "self", "mountinfo")
            try:
                mounts = parse_memory_mounts(self._source.read_text(path))
            except FileNotFoundError:
                # Only a procfs tree made for a test lacks it; a live /proc always has it.
                logger.debug("no %s: cgroup memory limits are left out", path)
                mounts = []
            except OSError as error:
                self._log_once("mountinfo", "cannot read %s: %s; cgroup memory limits are left out",
                               path, error)
                mounts = []
            self._cgroup_mounts = [CgroupMount(m.version, rebase(m.mount_point, self._sysfs), m.root)
                                   for m in mounts]
        return self._cgroup_mounts

    def _memlock_limit(self, pid: int) -> float | None:
        """Optional: a limit we cannot read leaves its series out, the process's others stay."""
        path = self._path(pid, "limits")
        try:
            text = self._source.read_text(path)
        except OSError:
            return None
        return parse_logged(parse_memlock_limit, text, path, self._log_once)

    def _path(self, pid: int, name: str) -> str:
        return os.path.join(self._procfs, str(pid), name)

    def _add(self, samples: Samples, pid: int, stat: ProcessStat, status: ProcessStatus, ticks: int,
             boot_time: int | None, memlock_limit: float | None, bound: CgroupMemoryBound | None,
             weights_offload_bytes: float | None) -> None:
        """One process's series from /proc/<pid>, in one add_many: at 256 processes, one add()
        a series was a fifth of this collector's CPU."""
        samples.add_many((
            (RESIDENT, status.resident_bytes),
            (SWAP, status.swap_bytes),
            (LOCKED, status.locked_bytes),
            (PINNED, status.pinned_bytes),
            (THREADS, status.threads if self.detail_series else None),
            (ALLOWED_CPUS, None if status.allowed_cpus is None or not self.detail_series
             else len(status.allowed_cpus)),
            (MINOR_FAULTS, stat.minor_faults),
            (MAJOR_FAULTS, stat.major_faults),
            (CPU_SECONDS, (stat.user_ticks + stat.system_ticks) / ticks),
            (START_TIME, None if boot_time is None else boot_time + stat.start_ticks / ticks),
            (MEMLOCK_LIMIT, memlock_limit),
            (CGROUP_MEMORY_LIMIT, bound.limit_bytes if bound is not None and self.detail_series else None),
            (CGROUP_MEMORY_HEADROOM, None if bound is None else bound.headroom_bytes),
            (WEIGHTS_OFFLOAD, weights_offload_bytes),
        ), pid, stat.comm)

    def _scan(self) -> None:
        # One reading for the whole scan: a trace keeps the matches, not every process's command line.
        try:
            matches = self._source.call("process.discovery", self._find_matches)
        except (OSError, ReplayedCallError) as error:
            self._log_once("scan", "cannot list %s: %s; no new process is found by name or command "
                           "line until it can be, and those found before stay watched", self._procfs, error)
            return
        self._discovered = {int(pid): self._discovered.get(int(pid)) for pid in matches}

    def _find_matches(self) -> dict[str, str]:
        """{pid: "name" or "cmdline", whichever matched} of the processes under procfs."""
        matches = {}
        for entry in self._source.list_dir(self._procfs):
            if _PID_ENTRY.fullmatch(entry):
                how = self._match(entry)
                if how is not None:
                    matches[entry] = how
        return matches

    def _match(self, pid: str) -> str | None:
        base = os.path.join(self._procfs, pid)
        try:  # processes come and go during a scan, and with hidepid some cannot be read: skip those
            if self._names and self._source.read_text(os.path.join(base, "comm")).rstrip("\n") in self._names:
                return "name"
            if self._patterns:
                cmdline = format_cmdline(self._source.read_text(os.path.join(base, "cmdline")))
                if any(pattern.search(cmdline) for pattern in self._patterns):
                    return "cmdline"
        except OSError:
            pass
        return None

    def _gpu_pids(self) -> list[int]:
        try:
            pids = [int(pid) for pid in self._gpu_processes()]
        except Exception as error:  # the GPU collector's failure must not stop this one
            self._log_once("gpu", "cannot get the processes holding GPU memory: %s", error)
            return []
        if pids and self._pid_view is None:
            self._pid_view = pid_view(self._source, self._procfs)
        said = advice(self._pid_view, self._procfs) if pids and self._pid_view else None
        if said:
            self._log_once("pid-namespace", "%s", said)
            return []
        return pids

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


# Command lines of the inference servers we look for when nothing else is configured.
# Servers that are executables of their own (llama-server, TGI's launcher and router, ollama) are
# matched on the command's first word only, so a compiler building llama-server (`c++ -o
# bin/llama-server`, `.../llama-server.dir/server.cpp.o`), `tail -f /var/log/llama-server.log` or
# `journalctl -u text-generation-launcher` is not watched as a server: on a host that builds
# llama.cpp, each compiler process became a watched process whose history stayed for 2 h
# (measured: RSS +24 MB a minute during a build). Python servers are matched on their module.
DEFAULT_CMDLINE_PATTERNS = (
    r"vllm\.entrypoints|\bvllm serve\b",
    r"^(\S*/)?llama-server(\s|$)",
    r"sglang\.launch_server",
    r"^(\S*/)?text-generation-(launcher|router)(\s|$)",
    r"^(\S*/)?ollama (serve|runner)\b",
    # LMCache's standalone (multiprocess) server: `lmcache server` (console script of lmcache 0.5.6,
    # lmcache/cli/commands/server.py) or `python -m lmcache.v1.multiprocess.server|http_server`.
    r"(^|/)lmcache server\b|lmcache\.v1\.multiprocess\.(http_)?server",
)


class ProcessSettings(CollectorSettings):
    """[process]: which processes to watch besides those holding GPU memory, and what to export."""

    pids: tuple[int, ...] = ()
    names: tuple[str, ...] = ()
    cmdline_patterns: tuple[str, ...] = DEFAULT_CMDLINE_PATTERNS
    auto_detect_gpu_processes: bool = True
    discovery_interval_seconds: float = Field(default=10.0, ge=MIN_DISCOVERY_SECONDS, le=3600)
    export_cmdline: bool = Field(
        default=False, description="also export each watched process's command line, secrets "
        "redacted, on /metrics and the status page (both unauthenticated); off: executable, server "
        "family and model only"
    )
    detail_series: bool = Field(
        default=False, description="also the per-process series that no alert, dashboard or "
        "status page reads: the thread count, the allowed CPUs and the cgroup memory limit, and "
        "from the process_numa collector the CPU time, resident memory and allowed CPUs on each "
        "NUMA node and the numa_maps read time; off: 10 series a watched process (1 more under a "
        "cgroup memory limit, 1 more with weights offloaded by its command line); one that holds "
        "GPU memory on a host with two or more NUMA nodes adds 2 per NUMA node of its GPUs (its "
        "CPU time and resident memory off that node), and the gpu collector exports 1 per GPU it "
        "is on (docs/performance.md)"
    )

    @field_validator("cmdline_patterns")
    @classmethod
    def _patterns_compile(cls, patterns: tuple[str, ...]) -> tuple[str, ...]:
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(f"{pattern!r} is not a regular expression: {error}") from None
        return patterns


def _process_collector(context: CollectorContext) -> ProcessCollector:
    settings: ProcessSettings = context.settings
    collector = ProcessCollector(
        context.source,
        procfs=context.procfs,
        sysfs=context.sysfs,
        pids=settings.pids,
        names=settings.names,
        cmdline_patterns=settings.cmdline_patterns,
        gpu_processes=context.gpu_processes() if settings.auto_detect_gpu_processes else dict,
        discovery_interval_seconds=settings.discovery_interval_seconds,
        export_cmdline=settings.export_cmdline,
        detail_series=settings.detail_series,
    )
    # The GPU collector labels its per-process series with each pid's comm: the one read here
    # from /proc/<pid>/stat every tick serves it too, instead of a /proc/<pid>/comm read.
    share = getattr(context.earlier.get("gpu"), "share_process_names", None)
    if share is not None:
        share(collector.watched)
    return collector


# Essential: /proc/<pid> of the inference processes is on every Linux host. It takes the GPU
# collector's compute processes as part of its watch list, so it runs after it.
REGISTRATION = CollectorRegistration(ProcessCollector, _process_collector, settings=ProcessSettings,
                                     runs_after=("gpu",), essential=True)
