"""NUMA nodes and the NUMA placement of the watched inference processes.

An inference server whose threads run on one node while its offloaded weights or KV blocks sit on
another pays a remote access on every touch. NumaCollector reports each node (/sys/devices/system/
node); ProcessNumaCollector reports, per process watched by process.py that holds memory on a GPU and
per NUMA node of those GPUs, how much of its CPU time (its threads' /proc/<pid>/task/<tid>/stat)
and how many of its resident bytes (/proc/<pid>/numa_maps) are OFF that node: 2 series a process
and GPU node whatever the host's node count, reading a bounded share of those files each run. With
[process] detail_series, also each process's CPU time, resident bytes and allowed CPUs on every
node.
"""
from __future__ import annotations

import bisect
import errno
import logging
import math
import os
import re
import time
from typing import Callable, Mapping, Sequence

from hybridmon.exporters.sources import RawSource
from hybridmon.exporters.base import (CollectorContext, CollectorError, CollectorRegistration, LogOnce, MetricSpec,
                                      NoDataError, ParseError, Samples, parse_logged, read_parsed)
from hybridmon.exporters.pcie import parse_numa_node
from hybridmon.exporters.procfs import ProcessGone, parse_cpu_list, parse_proc_status, read_process_file

logger = logging.getLogger(__name__)

_NODE = ("node",)
_PROCESS_ON_NODE = ("pid", "process_name", "node")
_PROCESS_OFF_GPU_NODE = ("pid", "process_name", "gpu_node")
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
                                          "may not run on. Only with [process] detail_series = true.",
                                          "gauge", _PROCESS_ON_NODE)
PROCESS_NUMA_RESIDENT = MetricSpec("hybridmon_process_numa_resident_bytes",
                                   "Bytes of the process's mapped pages that sit on the NUMA node "
                                   "(N<node>= page counts of /proc/<pid>/numa_maps times each mapping's "
                                   "kernelpagesize_kB), as last read: each process's numa_maps at most "
                                   "once a minute. Only with [process] detail_series = true.", "gauge",
                                   _PROCESS_ON_NODE)
PROCESS_CPU_SECONDS_ON_NODE = MetricSpec(
    "hybridmon_process_cpu_seconds_on_node_total",
    "CPU seconds the process's threads ran on the NUMA node, counted from when the agent first saw "
    "the process hold GPU memory: at each reading, each thread's utime + stime (fields 14-15 of "
    "/proc/<pid>/task/<tid>/stat, over SC_CLK_TCK) gained since the previous reading is counted on "
    "the node of the CPU it last ran on (field 39, processor). Where the process actually runs, "
    "not where it may. Only with [process] detail_series = true.", "counter", _PROCESS_ON_NODE)
PROCESS_CPU_SECONDS_OFF_GPU_NODE = MetricSpec(
    "hybridmon_process_cpu_seconds_off_gpu_node_total",
    "CPU seconds the process ran on CPUs outside gpu_node, the NUMA node of a GPU it holds memory "
    "on (that GPU's PCI device's sysfs numa_node), counted from when the agent first saw the "
    "process hold GPU memory: at each reading (every 30 s), the process's utime + stime gained "
    "since the previous one (fields 14-15 of /proc/<pid>/stat, over SC_CLK_TCK) times the share "
    "of its threads' newly counted CPU time that ran off the node (/proc/<pid>/task/<tid>/stat, "
    "the node of the CPU each last ran on; the last share known when none of its threads was "
    "read). Its rate over that of hybridmon_process_cpu_seconds_total is the share of its CPU time "
    "off the node.", "counter", _PROCESS_OFF_GPU_NODE)
PROCESS_RESIDENT_OFF_GPU_NODE = MetricSpec(
    "hybridmon_process_resident_off_gpu_node_bytes",
    "Bytes of the process's mapped pages that sit outside gpu_node, the NUMA node of a GPU it holds "
    "memory on (that GPU's PCI device's sysfs numa_node): the N<node>= page counts of "
    "/proc/<pid>/numa_maps of the other nodes times each mapping's kernelpagesize_kB, as last "
    "read (each process's numa_maps at most once a minute). Over hybridmon_process_resident_bytes "
    "(VmRSS, the same pages counted by the kernel) it is the share of its memory off the node.",
    "gauge", _PROCESS_OFF_GPU_NODE)
PROCESS_NUMA_MAPS_READ = MetricSpec("hybridmon_process_numa_maps_read_seconds",
                                    "Seconds the last collection spent reading and parsing "
                                    "/proc/<pid>/numa_maps: the kernel walks the process's page tables, "
                                    "so this grows with its mapped memory. Only with [process] "
                                    "detail_series = true.", "gauge", ("pid", "process_name"))

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
    # Every 5 s: a node's memory and its allocation counters move with the host's load, and what
    # reads them judges minutes (the NUMA alerts' 300 s `for`) or counts the nodes (issue 33).
    default_interval_seconds = 5.0
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


# What one run of ProcessNumaCollector may read, so that its cost stays flat however many processes
# are watched (issue 33: reading every thread's stat and every numa_maps took 257-653 ms of wall
# time a run at 256 processes). numa_maps makes the kernel walk the process's page tables (26-105 ms
# for a 2-8 GiB server, see ProcessNumaCollector) and placement moves slowly (first touch fixes a
# page's node; only NUMA balancing or a migration moves it), so each process's is read at most once
# a minute, and at most 8 a run: at the 30 s interval, the 16 processes of a typical host each
# minute, and 256 processes every 16 minutes. With both bounds, 256 watched processes (1,272
# threads) cost 11.4 ms of CPU a run (median; at most 19.3), against 83.5-109.3 ms reading
# everything (benchmarks/process_numa_cost.py, 2-vCPU VM at load 11-12; small processes: a big
# server's numa_maps adds its page-table walk, at most 8 of them a run).
NUMA_MAPS_MIN_AGE_SECONDS = 60.0
NUMA_MAPS_READS_PER_RUN = 8
# Thread stats read per run, over all processes together (34 us each, see ProcessNumaCollector:
# about 17 ms), at most 128 of them from one process so that a server of hundreds of threads does
# not starve the others; the processes are taken in turn from where the last run stopped, and in
# each the threads that ran since their last reading first (they carry its CPU time: vLLM's busy
# threads are a few among pools of idle ones), then the others in turn. An unread thread's CPU time
# is not lost: it is counted at its next reading. 16 servers of 100 threads: each busy thread is
# read every run, each idle one at least every 4 (2 minutes, InferenceProcessNumaMisplaced's window).
THREAD_READS_PER_RUN = 512
THREAD_READS_PER_PROCESS = 128


class _Placement:
    """What ProcessNumaCollector knows of one watched process between runs."""

    def __init__(self, process_name: str, nodes: list[int]) -> None:
        self.process_name = process_name
        # tid -> CPU ticks at its last reading; None for a thread listed when the process was first
        # seen and not read since, whose first reading is only its baseline.
        self.thread_ticks: dict[int, int | None] = {}
        self.busy: set[int] = set()               # threads that ran between their last two readings
        self.next_tid = 0                         # the idle threads from this tid on are read next
        self.cpu_seconds = {node: 0.0 for node in nodes}
        self.counted_now: dict[int, float] = {}   # node -> thread CPU seconds counted this run
        self.listed = False                       # its threads listed once: the baseline is set
        self.gpu_nodes: set[int] = set()          # the NUMA nodes of the GPUs it holds memory on
        self.process_ticks: int | None = None     # its utime + stime at the previous reading
        # node -> share of its threads' CPU time there, from the last run that counted any
        self.node_shares: dict[int, float] | None = None
        self.cpu_seconds_off: dict[int, float] = {}   # gpu node -> CPU seconds counted off it
        self.resident: dict[int, int] | None = None   # node -> bytes at the last numa_maps read
        self.numa_maps_read_at: float | None = None   # collector clock
        self.numa_maps_seconds = 0.0


class ProcessNumaCollector:
    """Per process of `watched`: on which NUMA nodes its CPUs and its pages are. The agent hands
    it the watched processes that hold GPU memory (on_gpus).

    Exported against the nodes of the GPUs each process holds memory on (`gpu_buses`: pid -> the
    PCI bus ids of its GPUs, the gpu collector's; each bus's node is its sysfs numa_node, as the
    pcie collector reads it): per such node, its CPU seconds and resident bytes off it, which is
    all InferenceProcessNumaMisplaced judges. The CPU seconds are the process's own utime + stime
    (/proc/<pid>/stat, read for every process every run) split by where its threads' newly
    counted time ran: the threads are sampled, the total is not, so the rate of the pair's counter
    follows hybridmon_process_cpu_seconds_total's without the jumps of threads read every few runs.

    Bounded per run whatever the number of processes (THREAD_READS_PER_RUN, NUMA_MAPS_READS_PER_RUN):
    each run reads some threads and some numa_maps, in turn, and exports every process's figures
    as last read. On a host with one NUMA node everything is on node 0 and nothing is read.
    detail_series ([process] detail_series): also the CPU time, resident bytes and allowed CPUs
    on every node and the numa_maps read time, which no alert, dashboard or status page reads.
    """

    name = "process_numa"
    # Reading numa_maps makes the kernel walk the process's page tables: 26-36 ms for 2 GiB touched
    # in 4 KiB pages over 5,000 mappings, 105 ms for 8 GiB over 20,000 (benchmarks/numa_maps_cost.py,
    # 2-vCPU Xeon VM), so a few hundred ms of a core for a 30 GB server: not every second.
    default_interval_seconds = 30.0
    # A thread's stat costs 34 us to read: 6.8 ms for 200 threads (this 2-vCPU VM, loaded; a Python
    # process's own threads), far less than numa_maps.
    metric_specs = (PROCESS_CPU_SECONDS_OFF_GPU_NODE, PROCESS_RESIDENT_OFF_GPU_NODE,
                    PROCESS_ALLOWED_CPUS_ON_NODE, PROCESS_CPU_SECONDS_ON_NODE, PROCESS_NUMA_RESIDENT,
                    PROCESS_NUMA_MAPS_READ)

    def __init__(self, source: RawSource, procfs: str = "/proc", sysfs: str = "/sys",
                 watched: Callable[[], Mapping[int, str]] = lambda: {},
                 gpu_buses: Callable[[], Mapping[int, Sequence[str]]] = lambda: {},
                 timer: Callable[[], float] = time.perf_counter,
                 clock: Callable[[], float] = time.monotonic,
                 clock_ticks_per_second: int | None = None, detail_series: bool = False) -> None:
        self._source = source
        self._procfs = procfs
        self._sysfs = sysfs
        self._watched = watched
        self._gpu_buses = gpu_buses
        self._timer = timer
        self._clock = clock
        self._detail_series = detail_series
        self._nodes: list[int] | None = None
        self._log_once = LogOnce(logger)
        self._ticks_per_second = clock_ticks_per_second
        self._placements: dict[int, _Placement] = {}
        self._next_pid = 0  # the threads of this pid and those above it are read first next run

    def collect(self) -> Samples:
        if self._nodes is None:
            self._nodes = read_online_nodes(self._source, self._sysfs)
        samples = Samples()
        if len(self._nodes) < 2:
            return samples  # one node: every CPU and page is on it, there is no placement to tell
        node_cpus = {node: read_node_cpus(self._source, self._sysfs, node, self._log_once)
                     for node in self._nodes}
        # The clock goes through the source so that a replay reads numa_maps on the recorded runs.
        now = self._source.call("process_numa.clock", self._clock)
        watched = self._watched()
        self._placements = {pid: known for pid, known in self._placements.items()
                            if pid in watched and known.process_name == watched[pid]}
        for pid, process_name in watched.items():
            self._placements.setdefault(pid, _Placement(process_name, self._nodes))
        self._find_gpu_nodes()
        for placement in self._placements.values():
            placement.counted_now = {}
        self._read_threads(sorted(watched), node_cpus)
        gone = self._read_numa_maps_due(now)
        for pid, process_name in sorted(watched.items()):
            if pid in gone or not self._count_off_gpu_nodes(pid, self._placements[pid]):
                self._placements.pop(pid, None)
            else:
                self._add(samples, pid, self._placements[pid], node_cpus)
        return samples

    def _find_gpu_nodes(self) -> None:
        """Each watched process's GPU nodes, from the PCI bus ids of its GPUs. A process the gpu
        collector did not list this time (a GPU late or gone for a moment) keeps the nodes it had,
        as it stays watched (on_gpus). A GPU whose device has no node (-1) or whose numa_node
        cannot be read gives none: its processes are not judged against it."""
        buses = self._gpu_buses()
        node_of_bus: dict[str, int | None] = {}
        for pid, placement in self._placements.items():
            if not buses.get(pid):
                continue
            for bus_id in buses[pid]:
                if bus_id not in node_of_bus:
                    path = os.path.join(self._sysfs, "bus", "pci", "devices", bus_id, "numa_node")
                    node_of_bus[bus_id] = read_parsed(self._source, path, parse_numa_node, self._log_once)
            placement.gpu_nodes = {node for bus_id in buses[pid] if (node := node_of_bus[bus_id]) is not None}

    def _count_off_gpu_nodes(self, pid: int, placement: _Placement) -> bool:
        """Adds the process's CPU time since its previous reading (/proc/<pid>/stat) to its CPU
        seconds off each GPU node, split as its threads' time counted this run was (else as the
        last split known; before any is known, its CPU time is not counted); False when it has
        exited."""
        if not placement.gpu_nodes:
            return True   # no GPU node known to count against: nothing to read
        try:
            text = read_process_file(self._source, self._procfs, pid, "stat", self._log_once)
        except ProcessGone:
            return False
        read = None if text is None else parse_logged(parse_task_stat, text, self._path(pid, "stat"), self._log_once)
        if read is None:
            return True
        ticks, before = read[0], placement.process_ticks
        placement.process_ticks = ticks
        counted = sum(placement.counted_now.values())
        if counted > 0:
            placement.node_shares = {node: seconds / counted for node, seconds in placement.counted_now.items()}
        for node in placement.gpu_nodes:
            placement.cpu_seconds_off.setdefault(node, 0.0)
        if before is None or ticks <= before or placement.node_shares is None:
            return True
        gained = (ticks - before) / self._clock_ticks()
        for node in placement.cpu_seconds_off:
            placement.cpu_seconds_off[node] += gained * (1 - placement.node_shares.get(node, 0.0))
        return True

    def _add(self, samples: Samples, pid: int, placement: _Placement,
             node_cpus: Mapping[int, frozenset[int] | None]) -> None:
        name = placement.process_name
        # Absent, not 0, while its threads cannot be listed: where it runs is then unknown. What it
        # ran before a run first counted its threads' time is not counted (the baseline).
        if placement.listed and placement.process_ticks is not None:
            for node in sorted(placement.gpu_nodes):
                samples.add(PROCESS_CPU_SECONDS_OFF_GPU_NODE, placement.cpu_seconds_off[node], pid, name, node)
        if placement.resident is not None:
            for node in sorted(placement.gpu_nodes):
                off = sum(size for other, size in placement.resident.items() if other != node)
                samples.add(PROCESS_RESIDENT_OFF_GPU_NODE, off, pid, name, node)
        if not self._detail_series:
            return
        allowed = self._allowed_cpus(pid)
        for node, cpus in node_cpus.items():
            on_node = None if allowed is None or cpus is None else len(allowed & cpus)
            samples.add(PROCESS_ALLOWED_CPUS_ON_NODE, on_node, pid, name, node)
        if placement.listed:
            for node, seconds in sorted(placement.cpu_seconds.items()):
                samples.add(PROCESS_CPU_SECONDS_ON_NODE, seconds, pid, name, node)
        if placement.resident is not None:
            for node in sorted(set(self._nodes or ()) | set(placement.resident)):
                samples.add(PROCESS_NUMA_RESIDENT, placement.resident.get(node, 0), pid, name, node)
            samples.add(PROCESS_NUMA_MAPS_READ, placement.numa_maps_seconds, pid, name)

    def _allowed_cpus(self, pid: int) -> frozenset[int] | None:
        try:
            text = read_process_file(self._source, self._procfs, pid, "status", self._log_once)
        except ProcessGone:
            return None
        status = parse_logged(parse_proc_status, text, self._path(pid, "status"), self._log_once)
        return None if status is None else status.allowed_cpus

    def _read_threads(self, pids: list[int], node_cpus: Mapping[int, frozenset[int] | None]) -> None:
        """Reads up to THREAD_READS_PER_RUN threads, the processes taken in turn from where the
        last run stopped."""
        node_of = {cpu: node for node, cpus in node_cpus.items() for cpu in (cpus or ())}
        budget = THREAD_READS_PER_RUN
        first = bisect.bisect_left(pids, self._next_pid)
        for pid in pids[first:] + pids[:first]:
            budget -= self._read_some_threads(pid, self._placements[pid], budget, node_of)
            if budget <= 0:
                self._next_pid = pid + 1
                return

    def _read_some_threads(self, pid: int, placement: _Placement, budget: int, node_of: Mapping[int, int]) -> int:
        """Reads some of the process's threads (at most THREAD_READS_PER_PROCESS and `budget`) and
        counts their CPU time; how many it read. The threads that ran since their previous reading
        first, as they carry the CPU time (a server's few busy threads among its pools of idle
        ones), then the others in turn. Each thread's ticks since its last reading go to the node
        of the CPU it is on now: over many readings the shares converge on where the time was
        spent. The threads listed at the process's first reading only set their baseline at their
        first read; one born later counts all its ticks; one that exited loses the ticks since its
        last reading."""
        tids = self._list_threads(pid)
        if tids is None:
            return 0
        if not placement.listed:
            placement.thread_ticks = dict.fromkeys(tids)
            placement.listed = True
        placement.thread_ticks = {tid: placement.thread_ticks.get(tid, 0) for tid in tids}
        placement.busy &= placement.thread_ticks.keys()
        take = min(len(tids), THREAD_READS_PER_PROCESS, budget)
        start = bisect.bisect_left(tids, placement.next_tid)
        in_turn = [tid for tid in tids[start:] + tids[:start] if tid not in placement.busy]
        chosen = (sorted(placement.busy) + in_turn)[:take]
        turned = chosen[len(placement.busy):]
        if turned:
            placement.next_tid = turned[-1] + 1
        ticks_per_second = self._clock_ticks()
        for tid in chosen:
            read = self._read_thread(pid, tid)
            if read is None:
                continue
            ticks, cpu = read
            before = placement.thread_ticks[tid]
            placement.thread_ticks[tid] = ticks
            if before is None or ticks <= before:
                placement.busy.discard(tid)
                continue
            placement.busy.add(tid)
            node = node_of.get(cpu)
            if node is not None:
                seconds = (ticks - before) / ticks_per_second
                placement.cpu_seconds[node] = placement.cpu_seconds.get(node, 0.0) + seconds
                placement.counted_now[node] = placement.counted_now.get(node, 0.0) + seconds
        return len(chosen)

    def _list_threads(self, pid: int) -> list[int] | None:
        """The process's thread ids, sorted; None when its task directory cannot be read (logged
        once). A process that exited leaves the watch list at the process collector's next run."""
        directory = self._path(pid, "task")
        try:
            entries = self._source.list_dir(directory)
        except OSError as error:
            self._log_once(f"error:{directory}", "cannot list %s: %s; where its threads run is left "
                           "out", directory, error)
            return None
        return sorted(int(entry) for entry in entries if entry.isdigit())

    def _read_thread(self, pid: int, tid: int) -> tuple[int, int] | None:
        """(CPU ticks used, CPU last run on) of one thread; None when it exited since the listing
        or its stat is unreadable (logged once)."""
        path = os.path.join(self._path(pid, "task"), str(tid), "stat")
        try:
            text = self._source.read_text(path)
        except OSError as error:
            if error.errno not in (errno.ENOENT, errno.ESRCH):
                self._log_once(f"error:{path}", "cannot read %s: %s", path, error)
            return None
        return parse_logged(parse_task_stat, text, path, self._log_once)

    def _read_numa_maps_due(self, now: float) -> set[int]:
        """Reads the numa_maps of up to NUMA_MAPS_READS_PER_RUN processes not read for
        NUMA_MAPS_MIN_AGE_SECONDS, those never read first, then the longest unread; the pids
        found gone."""
        due = sorted((placement.numa_maps_read_at if placement.numa_maps_read_at is not None else -math.inf, pid)
                     for pid, placement in self._placements.items()
                     if placement.numa_maps_read_at is None or now - placement.numa_maps_read_at >= NUMA_MAPS_MIN_AGE_SECONDS)
        gone = set()
        for _, pid in due[:NUMA_MAPS_READS_PER_RUN]:
            placement = self._placements[pid]
            try:  # the timer goes through the source so that a replay reports the recorded cost
                started = self._source.call("process_numa.timer", self._timer)
                text = self._read_numa_maps(pid)
                per_node = parse_logged(parse_numa_maps, text, self._path(pid, "numa_maps"), self._log_once)
                elapsed = self._source.call("process_numa.timer", self._timer) - started
            except ProcessGone:
                gone.add(pid)
                continue
            placement.numa_maps_read_at = now  # unreadable too: tried again in a minute, not every run
            placement.resident = per_node
            placement.numa_maps_seconds = elapsed
        return gone

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
    # Its optional series are turned on with the process collector's, by [process] detail_series.
    detail_series = bool(getattr(context.earlier.get("process"), "detail_series", False))
    return ProcessNumaCollector(context.source, procfs=context.procfs, sysfs=context.sysfs,
                                watched=on_gpus(context.watched_processes(), context.gpu_processes()),
                                gpu_buses=context.gpu_buses_of_processes(), detail_series=detail_series)


def on_gpus(watched: Callable[[], Mapping[int, str]],
            gpu_processes: Callable[[], Mapping[int, str]]) -> Callable[[], dict[int, str]]:
    """The watched processes that hold memory on a GPU (NVML lists them), named as the process
    collector names them. Placement is judged against the GPU's node (InferenceProcessNumaMisplaced
    reads nothing else), so a process on no GPU, such as vLLM's API server, is neither read nor
    exported: 2 series a NUMA node saved on each (issue 33's budget of 12 a process). No process
    while the gpu collector is disabled: without NVML's per-process memory none can be judged.
    Once listed, a process stays while it is watched under the same name: a GPU that drops off
    the bus for a moment takes its processes off NVML's list, and dropping them would restart
    their CPU time counters (and lose the time they ran meanwhile)."""
    placed: set[tuple[int, str]] = set()

    def placed_now() -> dict[int, str]:
        holders, now = gpu_processes(), watched()
        placed.intersection_update(now.items())
        placed.update((pid, name) for pid, name in now.items() if pid in holders)
        return dict(sorted(placed))
    return placed_now


# Essential: /sys/devices/system/node is on every server (the kernels have CONFIG_NUMA; a one-socket
# host has node0).
REGISTRATION = CollectorRegistration(
    NumaCollector, lambda context: NumaCollector(context.source, sysfs=context.sysfs), essential=True)
# It reads the process collector's watch list, so it runs after it.
PROCESS_NUMA_REGISTRATION = CollectorRegistration(ProcessNumaCollector, _process_numa_collector,
                                                  runs_after=("process",))
