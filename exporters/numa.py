"""NUMA nodes and the NUMA placement of the watched inference processes.

An inference server whose threads run on one node while its offloaded weights or KV blocks sit on
another pays a remote access on every touch. NumaCollector reports each node (/sys/devices/system/
node); ProcessNumaCollector reports, per process watched by process.py, how many of its allowed CPUs,
how much of its CPU time (its threads' /proc/<pid>/task/<tid>/stat) and how many of its pages
(/proc/<pid>/numa_maps) are on each node.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import time
from typing import Callable, Mapping

from hybridmon.exporters.sources import RawSource
from hybridmon.exporters.base import (CollectorContext, CollectorError, CollectorRegistration, LogOnce, MetricSpec,
                                      NoDataError, ParseError, Samples, parse_logged, read_parsed)
from hybridmon.exporters.procfs import ProcessGone, parse_cpu_list, parse_proc_status, read_process_file

logger = logging.getLogger(__name__)

_NODE = ("node",)
_PROCESS_ON_NODE = ("pid", "process_name", "node")
NODE_MEMORY_TOTAL = MetricSpec("hybridmon_numa_node_memory_total_bytes",
                               "Memory of the NUMA node in bytes (MemTotal of "
                               "/sys/devices/system/node/node<N>/meminfo).", "gauge", _NODE)
NODE_MEMORY_FREE = MetricSpec("hybridmon_numa_node_memory_free_bytes",
                              "Free memory of the NUMA node in bytes (MemFree of "
                              "/sys/devices/system/node/node<N>/meminfo).", "gauge", _NODE)
NODE_CPUS = MetricSpec("hybridmon_numa_node_cpus",
                       "Online CPUs of the NUMA node (count of /sys/devices/system/node/node<N>/cpulist).",
                       "gauge", _NODE)
NODE_ALLOCATIONS = MetricSpec("hybridmon_numa_node_allocations_total",
                              "Pages allocated with the given outcome, from /sys/devices/system/node/"
                              "node<N>/numastat: hit/miss = allocated here as intended / here though "
                              "another node was preferred; foreign = meant for this node but placed "
                              "elsewhere; local_node/other_node = for a process running on this / another "
                              "node; interleave_hit = interleave policy got this node.",
                              "counter", ("node", "outcome"))
PROCESS_ALLOWED_CPUS_ON_NODE = MetricSpec("hybridmon_process_allowed_cpus_on_node",
                                          "CPUs of the NUMA node the process may run on "
                                          "(Cpus_allowed_list of /proc/<pid>/status within "
                                          "/sys/devices/system/node/node<N>/cpulist); 0 on a node it "
                                          "may not run on.", "gauge", _PROCESS_ON_NODE)
PROCESS_NUMA_RESIDENT = MetricSpec("hybridmon_process_numa_resident_bytes",
                                   "Bytes of the process's mapped pages that sit on the NUMA node "
                                   "(N<node>= page counts of /proc/<pid>/numa_maps times each mapping's "
                                   "kernelpagesize_kB).", "gauge", _PROCESS_ON_NODE)
PROCESS_CPU_SECONDS_ON_NODE = MetricSpec(
    "hybridmon_process_cpu_seconds_on_node_total",
    "CPU seconds the process's threads ran on the NUMA node, counted from when the agent first saw "
    "the process: at each reading, each thread's utime + stime (fields 14-15 of "
    "/proc/<pid>/task/<tid>/stat, over SC_CLK_TCK) gained since the previous reading is counted on "
    "the node of the CPU it last ran on (field 39, processor). Where the process actually runs, "
    "not where it may.", "counter", _PROCESS_ON_NODE)
PROCESS_NUMA_MAPS_READ = MetricSpec("hybridmon_process_numa_maps_read_seconds",
                                    "Seconds the last collection spent reading and parsing "
                                    "/proc/<pid>/numa_maps: the kernel walks the process's page tables, "
                                    "so this grows with its mapped memory.", "gauge", ("pid", "process_name"))

# numastat field -> outcome label; the kernel's names carry a redundant numa_ prefix on some.
NUMASTAT_OUTCOMES = {
    "numa_hit": "hit",
    "numa_miss": "miss",
    "numa_foreign": "foreign",
    "interleave_hit": "interleave_hit",
    "local_node": "local_node",
    "other_node": "other_node",
}

# Digit runs are bounded ({1,20}: a u64 has 20 digits) so that int() never sees more than 4,300
# digits, which it refuses with a ValueError rather than a ParseError.
_NODE_MEMINFO_LINE = re.compile(r"Node ([0-9]{1,20}) ([^\s:]+):\s+([0-9]{1,20})(?: (kB))?")
_NUMASTAT_LINE = re.compile(r"([a-z_]+) ([0-9]{1,20})")
_NUMA_MAPS_ADDRESS = re.compile(r"[0-9a-f]+")
_NUMA_MAPS_NODE_PAGES = re.compile(r"N([0-9]{1,20})=([0-9]{1,20})")
_NUMA_MAPS_PAGE_SIZE = re.compile(r"kernelpagesize_kB=([0-9]{1,20})")


def parse_node_meminfo(text: str) -> dict[str, int]:
    """Fields of /sys/devices/system/node/node<N>/meminfo: kB values in bytes, counts as they are.

    Lines read "Node 0 MemTotal:       4286668 kB" or "Node 0 HugePages_Total:     0".
    """
    fields: dict[str, int] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        match = _NODE_MEMINFO_LINE.fullmatch(line.strip())
        if match is None:
            raise ParseError(f"unexpected node meminfo line {line[:80]!r}")
        _, key, value, unit = match.groups()
        fields[key] = int(value) * 1024 if unit else int(value)
    if not fields:
        raise ParseError("empty node meminfo")
    return fields


def parse_numastat(text: str) -> dict[str, int]:
    """Fields of /sys/devices/system/node/node<N>/numastat ("numa_hit 1147229"), in pages."""
    fields: dict[str, int] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        match = _NUMASTAT_LINE.fullmatch(line.strip())
        if match is None:
            raise ParseError(f"unexpected numastat line {line[:80]!r}")
        fields[match.group(1)] = int(match.group(2))
    if not fields:
        raise ParseError("empty numastat")
    return fields


def parse_numa_maps(text: str) -> dict[int, int]:
    """Resident bytes per node of one process, summed over the mappings in /proc/<pid>/numa_maps.

    Each line is "<address> <policy> [file=... | heap | stack | huge] [key=value ...]", where N<n>=<pages>
    counts the mapping's pages on node n in units of kernelpagesize_kB (4 KiB when absent). File
    names are octal-escaped by the kernel (space as \\040, '=' as \\075), so no token of a path can
    pass for a page count.
    """
    per_node: dict[int, int] = {}
    for line in text.splitlines():
        tokens = line.split()
        if not tokens:
            continue
        if len(tokens) < 2 or _NUMA_MAPS_ADDRESS.fullmatch(tokens[0]) is None:
            raise ParseError(f"unexpected numa_maps line {line[:80]!r}")
        page_bytes = 4096
        pages: list[tuple[int, int]] = []
        for token in tokens[2:]:
            if (match := _NUMA_MAPS_NODE_PAGES.fullmatch(token)) is not None:
                pages.append((int(match.group(1)), int(match.group(2))))
            elif (match := _NUMA_MAPS_PAGE_SIZE.fullmatch(token)) is not None:
                page_bytes = int(match.group(1)) * 1024
        for node, count in pages:
            per_node[node] = per_node.get(node, 0) + count * page_bytes
    return per_node


# /proc/<pid>/task/<tid>/stat (proc(5)): "<tid> (<comm>) <state> ...": after the ")" that ends
# comm, field 3 is the first; utime and stime are fields 14 and 15, processor field 39.
_TASK_UTIME, _TASK_STIME, _TASK_PROCESSOR = 14 - 3, 15 - 3, 39 - 3
_TASK_DIGITS = re.compile(r"[0-9]{1,20}")


def parse_task_stat(text: str) -> tuple[int, int]:
    """(CPU ticks used, CPU last run on) of one thread from /proc/<pid>/task/<tid>/stat."""
    close = text.rfind(")")  # comm may hold spaces and parentheses; it ends at the last ")"
    fields = text[close + 1:].split() if close >= 0 else []
    if len(fields) <= _TASK_PROCESSOR:
        raise ParseError(f"task stat has no processor field: {text[:80]!r}")
    values = [fields[i] for i in (_TASK_UTIME, _TASK_STIME, _TASK_PROCESSOR)]
    if not all(_TASK_DIGITS.fullmatch(value) for value in values):
        raise ParseError(f"task stat fields 14, 15, 39 are not counts: {values}")
    return int(values[0]) + int(values[1]), int(values[2])


def node_root(sysfs: str) -> str:
    return os.path.join(sysfs, "devices", "system", "node")


def read_online_nodes(source: RawSource, sysfs: str) -> list[int]:
    """The online NUMA nodes, from /sys/devices/system/node/online; NoDataError without NUMA,
    CollectorError when the file is there but unusable."""
    path = os.path.join(node_root(sysfs), "online")
    try:
        text = source.read_text(path)
    except FileNotFoundError:
        raise NoDataError(
            f"{path} does not exist: the kernel has no NUMA support (CONFIG_NUMA) or sysfs is not "
            "mounted there, so there are no NUMA nodes to report"
        ) from None
    except OSError as error:
        raise CollectorError(f"cannot read {path}: {error}") from None
    try:
        nodes = sorted(parse_cpu_list(text))
    except ParseError as error:
        raise CollectorError(f"{path} is not a node list: {error}") from None
    if not nodes:
        raise CollectorError(f"{path} lists no online NUMA node")
    return nodes


def read_node_cpus(source: RawSource, sysfs: str, node: int, log_once: LogOnce) -> frozenset[int] | None:
    """The CPUs of one node (node<N>/cpulist), or None with one log line when unreadable."""
    path = os.path.join(node_root(sysfs), f"node{node}", "cpulist")
    return read_parsed(source, path, parse_cpu_list, log_once)


class NumaCollector:
    """Memory, CPUs and allocation outcomes of each online NUMA node."""

    name = "numa"
    default_interval_seconds = 1.0
    metric_specs = (NODE_MEMORY_TOTAL, NODE_MEMORY_FREE, NODE_CPUS, NODE_ALLOCATIONS)

    def __init__(self, source: RawSource, sysfs: str = "/sys") -> None:
        self._source = source
        self._sysfs = sysfs
        self._nodes: list[int] | None = None
        self._log_once = LogOnce(logger)

    def collect(self) -> Samples:
        if self._nodes is None:
            self._nodes = read_online_nodes(self._source, self._sysfs)
        samples = Samples()
        for node in self._nodes:
            node_dir = os.path.join(node_root(self._sysfs), f"node{node}")
            meminfo = read_parsed(self._source, os.path.join(node_dir, "meminfo"), parse_node_meminfo,
                                  self._log_once)
            if meminfo is not None:
                samples.add(NODE_MEMORY_TOTAL, meminfo.get("MemTotal"), node)
                samples.add(NODE_MEMORY_FREE, meminfo.get("MemFree"), node)
            cpus = read_node_cpus(self._source, self._sysfs, node, self._log_once)
            samples.add(NODE_CPUS, None if cpus is None else len(cpus), node)
            numastat = read_parsed(self._source, os.path.join(node_dir, "numastat"), parse_numastat,
                                   self._log_once)
            if numastat is not None:
                for field, outcome in NUMASTAT_OUTCOMES.items():
                    samples.add(NODE_ALLOCATIONS, numastat.get(field), node, outcome)
        return samples

    def close(self) -> None:
        pass


class ProcessNumaCollector:
    """Per watched process: on which NUMA nodes its CPUs and its pages are."""

    name = "process_numa"
    # Reading numa_maps makes the kernel walk the process's page tables: 26-36 ms for 2 GiB touched
    # in 4 KiB pages over 5,000 mappings, 105 ms for 8 GiB over 20,000 (benchmarks/numa_maps_cost.py,
    # 2-vCPU Xeon VM), so a few hundred ms of a core for a 30 GB server: not every second.
    default_interval_seconds = 30.0
    # Each thread's stat is read at every collection too: 34 us a thread, 6.8 ms for 200 threads
    # (this 2-vCPU VM, loaded; a Python process's own threads), far less than numa_maps.
    metric_specs = (PROCESS_ALLOWED_CPUS_ON_NODE, PROCESS_CPU_SECONDS_ON_NODE, PROCESS_NUMA_RESIDENT,
                    PROCESS_NUMA_MAPS_READ)

    def __init__(self, source: RawSource, procfs: str = "/proc", sysfs: str = "/sys",
                 watched: Callable[[], Mapping[int, str]] = lambda: {},
                 timer: Callable[[], float] = time.perf_counter,
                 clock_ticks_per_second: int | None = None) -> None:
        self._source = source
        self._procfs = procfs
        self._sysfs = sysfs
        self._watched = watched
        self._timer = timer
        self._nodes: list[int] | None = None
        self._log_once = LogOnce(logger)
        self._ticks_per_second = clock_ticks_per_second
        # pid -> (process_name, {tid: CPU ticks at the last reading}, {node: CPU seconds counted})
        self._threads: dict[int, tuple[str, dict[int, int], dict[int, float]]] = {}

    def collect(self) -> Samples:
        if self._nodes is None:
            self._nodes = read_online_nodes(self._source, self._sysfs)
        node_cpus = {node: read_node_cpus(self._source, self._sysfs, node, self._log_once)
                     for node in self._nodes}
        samples = Samples()
        watched = self._watched()
        self._threads = {pid: state for pid, state in self._threads.items() if pid in watched}
        for pid, process_name in sorted(watched.items()):
            try:  # the timer goes through the source so that a replay reports the recorded cost
                status_text = read_process_file(self._source, self._procfs, pid, "status", self._log_once)
                tasks = self._read_tasks(pid)
                started = self._source.call("process_numa.timer", self._timer)
                maps_text = self._read_numa_maps(pid)
                per_node = parse_logged(parse_numa_maps, maps_text, self._path(pid, "numa_maps"),
                                        self._log_once)
                elapsed = self._source.call("process_numa.timer", self._timer) - started
            except ProcessGone:
                continue
            status = parse_logged(parse_proc_status, status_text, self._path(pid, "status"), self._log_once)
            allowed = None if status is None else status.allowed_cpus
            for node, cpus in node_cpus.items():
                on_node = None if allowed is None or cpus is None else len(allowed & cpus)
                samples.add(PROCESS_ALLOWED_CPUS_ON_NODE, on_node, pid, process_name, node)
            if tasks is not None:
                for node, seconds in sorted(self._count_cpu_time(pid, process_name, tasks, node_cpus).items()):
                    samples.add(PROCESS_CPU_SECONDS_ON_NODE, seconds, pid, process_name, node)
            if per_node is not None:
                for node in sorted(set(self._nodes) | set(per_node)):
                    samples.add(PROCESS_NUMA_RESIDENT, per_node.get(node, 0), pid, process_name, node)
                samples.add(PROCESS_NUMA_MAPS_READ, elapsed, pid, process_name)
        return samples

    def _read_tasks(self, pid: int) -> dict[int, tuple[int, int]] | None:
        """tid -> (CPU ticks used, CPU last run on) of each thread of the process; None when the
        task directory cannot be read (logged once). A process that exits meanwhile is caught by
        the numa_maps read that follows (ProcessGone); a thread that exits between the listing and
        its read is left out."""
        directory = self._path(pid, "task")
        try:
            entries = self._source.list_dir(directory)
        except OSError as error:
            self._log_once(f"error:{directory}", "cannot list %s: %s; where its threads run is left "
                           "out", directory, error)
            return None
        tasks = {}
        for entry in entries:
            if not entry.isdigit():
                continue
            path = os.path.join(directory, entry, "stat")
            try:
                text = self._source.read_text(path)
            except OSError as error:
                if error.errno not in (errno.ENOENT, errno.ESRCH):
                    self._log_once(f"error:{path}", "cannot read %s: %s", path, error)
                continue
            parsed = parse_logged(parse_task_stat, text, path, self._log_once)
            if parsed is not None:
                tasks[int(entry)] = parsed
        return tasks

    def _count_cpu_time(self, pid: int, process_name: str, tasks: dict[int, tuple[int, int]],
                        node_cpus: Mapping[int, frozenset[int] | None]) -> dict[int, float]:
        """The process's CPU seconds per node so far: each thread's ticks since the previous
        reading go to the node of the CPU it is on now. The first reading of a process (or of a
        pid that now names another process) only sets the baseline: every node starts at 0. A
        thread born since the previous reading counts all its ticks; one that exited since loses
        its last interval's. A thread that migrated meanwhile is counted on its new node: over
        many readings the shares converge on where the time was spent."""
        ticks_per_second = self._clock_ticks()
        node_of = {cpu: node for node, cpus in node_cpus.items() for cpu in (cpus or ())}
        known = self._threads.get(pid)
        if known is None or known[0] != process_name:
            counted = {node: 0.0 for node in node_cpus}
            self._threads[pid] = (process_name, {tid: ticks for tid, (ticks, _) in tasks.items()}, counted)
            return counted
        _, previous, counted = known
        for tid, (ticks, cpu) in tasks.items():
            gained = ticks - previous.get(tid, 0)
            node = node_of.get(cpu)
            if gained > 0 and node is not None:
                counted[node] = counted.get(node, 0.0) + gained / ticks_per_second
        self._threads[pid] = (process_name, {tid: ticks for tid, (ticks, _) in tasks.items()}, counted)
        return counted

    def _clock_ticks(self) -> int:
        if self._ticks_per_second is None:
            self._ticks_per_second = int(self._source.call("os.sysconf(SC_CLK_TCK)",
                                                           lambda: os.sysconf("SC_CLK_TCK")))
        return self._ticks_per_second

    def _read_numa_maps(self, pid: int) -> str | None:
        """/proc/<pid>/numa_maps, None when unreadable, ProcessGone when the process exited.

        Unlike the process's other files, numa_maps is gated by ptrace read access (proc_mem_open,
        PTRACE_MODE_READ): the agent needs CAP_SYS_PTRACE or the process's own uid. A denial is
        then the same for every process, so it is said once for all of them: the deployment
        without ptrace (deploy/kubernetes-variants/no-ptrace) runs so on purpose.
        """
        path = self._path(pid, "numa_maps")
        try:
            return self._source.read_text(path)
        except PermissionError as error:
            self._log_once("numa_maps denied", "NUMA placement of processes is left out "
                           "(%s absent): %s is not readable (%s). "
                           "numa_maps needs ptrace read access to the process: CAP_SYS_PTRACE, or the "
                           "agent running as the process's user. Expected where the agent runs "
                           "without it (deploy/kubernetes-variants/no-ptrace); said once for every "
                           "process", PROCESS_NUMA_RESIDENT.name, path, error.strerror)
            return None
        except OSError as error:
            if error.errno in (errno.ENOENT, errno.ESRCH):
                raise ProcessGone(pid) from None
            self._log_once(f"error:{path}", "cannot read %s: %s; its series are left out", path, error)
            return None

    def _path(self, pid: int, name: str) -> str:
        return os.path.join(self._procfs, str(pid), name)

    def close(self) -> None:
        pass


def _process_numa_collector(context: CollectorContext) -> ProcessNumaCollector:
    return ProcessNumaCollector(context.source, procfs=context.procfs, sysfs=context.sysfs,
                                watched=context.watched_processes())


# Essential: /sys/devices/system/node is on every server (the kernels have CONFIG_NUMA; a one-socket
# host has node0).
REGISTRATION = CollectorRegistration(
    NumaCollector, lambda context: NumaCollector(context.source, sysfs=context.sysfs), essential=True)
# It reads the process collector's watch list, so it runs after it.
PROCESS_NUMA_REGISTRATION = CollectorRegistration(ProcessNumaCollector, _process_numa_collector,
                                                  runs_after=("process",))
