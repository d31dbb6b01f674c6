"""A synthetic host: a private copy of the 2-node fixture tree whose files follow a mutable state.

A scenario changes the state (rates, gauges, sysctls, links, processes, GPUs) as simulated time
passes; `advance(dt)` integrates every counter over the step and `write()` renders the state into the
procfs/sysfs files the collectors read and into the fake NVML the GPU collector calls. The readings
the real collectors then make are consistent by construction:

- counters only grow (rates are checked to be >= 0) and are whole numbers in the files;
- swap traffic is pages (`pswpin`, `pswpout`) of this machine's page size, so the exported bytes are
  exactly the bytes the scenario asked for; SwapFree follows the net swap traffic;
- a process's VmRSS is RssAnon + RssFile, its numa_maps pages add up to them, and memory it swaps
  out leaves RssAnon;
- a process has one /proc/<pid>/task/<tid>/stat per thread (Threads: of its status); its busiest
  threads carry its CPU time, their utime + stime add up to no more than the process's, and each
  shows the CPU it last ran on (field 39) among its allowed CPUs, on the nodes its
  `thread_node_shares` say (default: spread over its allowed CPUs' nodes, as the scheduler spreads
  an unpinned process);
- a GPU's used memory is its processes' memory plus a fixed context overhead, and its PCIe link is
  written the same to NVML and to sysfs (current_link_speed, current_link_width);
- a removed PCI function loses both its bus/pci/devices link and its device directory;
- a PCIe switch (`add_switch`) nests its root port, upstream and downstream ports as the kernel
  nests bridges, and a GPU added behind it (`add_gpu_behind`) sits below a downstream port, so
  the GPUs' resolved sysfs paths say which link they share;
- vLLM's /metrics (inference.py) follows its own load, served on loopback while a trace is made.

Only the files a scenario can change are rewritten, and only when their text changed.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from hybridmon.agent.config import AgentConfig
from hybridmon.pcie_rates import LANE_BYTES_PER_SECOND
from tests.support.scenarios.inference import ENDPOINT, InferenceServer
from tests.support.fake_nvml import FakeGpu, FakeNvml, FakeProcess, default_gpus

REPO = Path(__file__).resolve().parents[3]
FIXTURE_HOST = REPO / "tests" / "fixtures" / "host-2node"

KIB = 1024
MIB = 1024**2
GIB = 1024**3

# PCIe: what sysfs prints per generation, and bytes/s per lane per direction (docs: Gen3 8 GT/s x
# 128/130 / 8 bits, Gen6 64 GT/s x 242/256 / 8), the capacity the detectors use.
LINK_SPEED_TEXT = {1: "2.5 GT/s PCIe", 2: "5.0 GT/s PCIe", 3: "8.0 GT/s PCIe", 4: "16.0 GT/s PCIe",
                   5: "32.0 GT/s PCIe", 6: "64.0 GT/s PCIe"}
_SPEED_TO_GENERATION = {text.split()[0]: generation for generation, text in LINK_SPEED_TEXT.items()}

PSI_RESOURCES = ("memory", "io", "cpu")
# Threads of a process that carry its CPU time; the others sleep (their task stat never changes,
# so it is written once).
BUSY_THREADS = 8
PSI_WINDOWS_SECONDS = (10.0, 60.0, 300.0)
SYSCTL_FILES = {"vm.swappiness": "sys/vm/swappiness", "vm.dirty_ratio": "sys/vm/dirty_ratio",
                "vm.dirty_background_ratio": "sys/vm/dirty_background_ratio",
                "vm.overcommit_memory": "sys/vm/overcommit_memory",
                "kernel.numa_balancing": "sys/kernel/numa_balancing"}
THP_MODES = {"enabled": ("always", "madvise", "never"),
             "defrag": ("always", "defer", "defer+madvise", "madvise", "never")}

# The kernel's /proc/<pid>/limits rows (fs/proc/base.c lnames): name, unit, default soft and hard.
_LIMIT_ROWS = (
    ("Max cpu time", "seconds", None, None), ("Max file size", "bytes", None, None),
    ("Max data size", "bytes", None, None), ("Max stack size", "bytes", 8388608, None),
    ("Max core file size", "bytes", 0, None), ("Max resident set", "bytes", None, None),
    ("Max processes", "processes", 2062919, 2062919), ("Max open files", "files", 1048576, 1048576),
    ("Max locked memory", "bytes", 8388608, 8388608), ("Max address space", "bytes", None, None),
    ("Max file locks", "locks", None, None), ("Max pending signals", "signals", 2062919, 2062919),
    ("Max msgqueue size", "bytes", 819200, 819200), ("Max nice priority", "", 0, 0),
    ("Max realtime priority", "", 0, 0), ("Max realtime timeout", "us", None, None),
)


def link_capacity_bytes_per_second(generation: int, width: int) -> float:
    """Theoretical bytes/s per direction of a PCIe link (the detectors' capacity without a benchmark)."""
    return LANE_BYTES_PER_SECOND[generation] * width


def _number_line(line: str, value: int) -> str:
    """`line` with its last number replaced, right-aligned in the same columns (kernel %8lu style)."""
    match = re.fullmatch(r"(.*?)(\s+)([0-9]+)(\s*kB)?", line)
    if match is None:
        raise ValueError(f"no number at the end of {line!r}")
    head, spaces, number, unit = match.groups()
    width = len(spaces) + len(number)
    text = str(int(value))
    return f"{head}{' ' * max(1, width - len(text))}{text}{unit or ''}"


class _KeyedFile:
    """A `name value` file (vmstat, meminfo, numastat) that keeps its lines' order and layout."""

    def __init__(self, text: str, pattern: str) -> None:
        self.lines = text.splitlines()
        self.index: dict[str, int] = {}
        self.values: dict[str, float] = {}
        for number, line in enumerate(self.lines):
            match = re.match(pattern, line)
            if match:
                self.index[match.group(1)] = number
                self.values[match.group(1)] = float(match.group(2))
        self._original = dict(self.values)

    def render(self) -> str:
        lines = list(self.lines)
        for name, value in self.values.items():
            if value != self._original[name]:
                lines[self.index[name]] = _number_line(lines[self.index[name]], math.floor(value))
        return "\n".join(lines) + "\n"


@dataclass
class Counter:
    """A monotonic counter and the rate (per second) it grows at until changed."""

    value: float
    rate: float = 0.0

    def advance(self, dt: float, what: str) -> None:
        if self.rate < 0:
            raise ValueError(f"{what}: a counter's rate cannot be negative ({self.rate})")
        self.value += self.rate * dt


@dataclass
class Stall:
    """One PSI line: the stalled share of wall time now, its running averages and its total."""

    total_microseconds: float
    ratio: float = 0.0
    averages_percent: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])

    def advance(self, dt: float) -> None:
        self.total_microseconds += self.ratio * dt * 1e6
        for window, seconds in enumerate(PSI_WINDOWS_SECONDS):
            decay = math.exp(-dt / seconds)  # the kernel's exponentially decaying averages
            self.averages_percent[window] = (self.averages_percent[window] * decay
                                             + 100.0 * self.ratio * (1.0 - decay))

    def settle(self) -> None:
        """Averages as if the current ratio had held for a long time (the start of a scenario)."""
        self.averages_percent = [100.0 * self.ratio] * 3


@dataclass
class ProcessState:
    """One process as /proc/<pid>/{stat,status,numa_maps,limits} show it."""

    pid: int
    comm: str
    stat_fields: list[str]              # the fields after "(comm)", from the fixture
    status_lines: list[str]
    rss_anon_bytes: float
    rss_file_bytes: float
    swap_bytes: float
    locked_bytes: float
    pinned_bytes: float
    threads: int
    allowed_cpus: frozenset[int]
    memory_node_shares: dict[int, float]  # where its resident pages sit, shares adding up to 1
    cpu_seconds: float
    minor_faults: Counter
    major_faults: Counter
    cpu_rate: float = 0.0               # CPU seconds per second (cores busy)
    memlock_limit_bytes: int | None = 8388608  # soft = hard RLIMIT_MEMLOCK; None: unlimited
    peak_rss_bytes: float = 0.0
    binary_path: str = "/usr/bin/unknown"
    weights_path: str = "/models/weights.bin"  # the file mapping that holds most of RssFile
    loaded_placement: tuple | None = None  # memory and placement as the fixture's numa_maps shows them
    limits_text: str | None = None  # the fixture's /proc/<pid>/limits, whose memlock line is rewritten
    # Its threads: tid -> CPU seconds. The first BUSY_THREADS carry its CPU time (a server's
    # engine loop, tokenizer and copy threads); the rest are idle pool threads.
    thread_cpu_seconds: dict[int, float] = field(default_factory=dict)
    # Where its busy threads run: node -> share of them; None: over its allowed CPUs' nodes in
    # proportion to its allowed CPUs there (an unpinned process on 2 nodes: half on each).
    thread_node_shares: dict[int, float] | None = None

    @property
    def resident_bytes(self) -> float:
        return self.rss_anon_bytes + self.rss_file_bytes

    def busy_tids(self) -> list[int]:
        return list(self.thread_cpu_seconds)[:BUSY_THREADS]

    def set_thread_count(self, threads: int) -> None:
        """Threads: of its status, with a task/<tid> for each: tids are the pid and the numbers after
        it (the kernel gives a process's threads ids from the same space as pids)."""
        self.threads = threads
        spread = self.cpu_seconds / threads  # what the threads ran before: the sum is the process's
        self.thread_cpu_seconds = {self.pid + i: self.thread_cpu_seconds.get(self.pid + i, spread)
                                   for i in range(threads)}

    def swap_out(self, target_swap_bytes: float) -> None:
        """Move anonymous memory between RAM and swap so that VmSwap becomes the target."""
        moved = target_swap_bytes - self.swap_bytes
        self.swap_bytes = target_swap_bytes
        self.rss_anon_bytes = max(0.0, self.rss_anon_bytes - moved)


@dataclass
class PciDevice:
    """One PCI function's sysfs directory: its link files and AER counters."""

    address: str
    directory: Path
    link_generation: int | None
    link_width: int | None
    aer: dict[str, list[list]] | None   # file name -> [[counter name, count], ...], TOTAL_* last
    present: bool = True


@dataclass
class GpuState:
    """One GPU as NVML and its PCI function's sysfs directory both show it."""

    index: int
    address: str                        # sysfs form, 0000:17:00.0
    nvml: FakeGpu
    process_memory: dict[int, float]    # pid -> bytes of GPU memory
    context_overhead_bytes: float
    utilization: float                  # ratio 0-1
    host_to_device_bytes_per_second: float
    device_to_host_bytes_per_second: float
    replays: Counter
    lost: bool = False

    @property
    def link_generation(self) -> int:
        return self.nvml.link_generation

    @property
    def link_width(self) -> int:
        return self.nvml.link_width_lanes

    def set_link(self, generation: int, width: int) -> None:
        self.nvml.link_generation, self.nvml.link_width_lanes = generation, width

    @property
    def capacity_bytes_per_second(self) -> float:
        return link_capacity_bytes_per_second(self.link_generation, self.link_width)

    @property
    def memory_used_bytes(self) -> float:
        return self.context_overhead_bytes + sum(self.process_memory.values())

    def set_memory_used_share(self, share: float, pid: int) -> None:
        """Give `pid` the GPU memory that makes used/total equal `share`."""
        others = sum(v for p, v in self.process_memory.items() if p != pid)
        self.process_memory[pid] = share * self.nvml.memory_total_bytes - self.context_overhead_bytes - others


@dataclass
class NodeState:
    node: int
    meminfo: _KeyedFile
    numastat: _KeyedFile
    allocation_rates: dict[str, float] = field(default_factory=dict)  # numastat field -> pages/s


class SyntheticHost:
    """The fixture host, copied to `root`, with every value a scenario may change held as state."""

    def __init__(self, root: str | Path, seed: int = 0, page_size: int | None = None,
                 clock_ticks: int | None = None) -> None:
        self.root = Path(root)
        self.procfs = self.root / "proc"
        self.sysfs = self.root / "sys"
        self.rng = random.Random(seed)
        # The collectors convert with this machine's sysconf values (recorded in the trace), so the
        # files are written in the same units.
        self.page_size = page_size or os.sysconf("SC_PAGE_SIZE")
        self.clock_ticks = clock_ticks or os.sysconf("SC_CLK_TCK")
        self._root_text = str(self.root)
        self._written: dict[str, str] = {}  # relative path -> text last written there
        self._thread_lines: dict[str, tuple] = {}  # task stat path -> (ticks, cpu, threads) written
        self._thread_cpus: dict[int, tuple] = {}   # pid -> (placement, thread_cpus()) last computed
        self._threads_due = True
        self._load()
        # vLLM (pid 4242) serves /metrics at ENDPOINT; its noise comes from a generator of its own.
        self.inference = InferenceServer(seed + 1)
        self._inference_seed = seed + 2
        self.inference_endpoint = ENDPOINT
        # Further servers a scenario adds (add_inference_server), by the endpoint they answer at.
        self.other_inference: dict[str, InferenceServer] = {}

    def add_inference_server(self, endpoint: str) -> InferenceServer:
        """A second vLLM on this host answering at `endpoint` (a loopback URL); the agent is
        configured with it as well. No watched process listens on its port in the fixture's
        /proc, so the agent knows no pid for it (the label is empty, as for a server in a
        container)."""
        if endpoint == self.inference_endpoint or endpoint in self.other_inference:
            raise ValueError(f"an inference server already answers at {endpoint}")
        server = self.other_inference[endpoint] = InferenceServer(self._inference_seed + len(self.other_inference))
        return server

    def inference_servers(self) -> dict[str, InferenceServer]:
        """Every inference server of the host by its endpoint, vLLM pid 4242's first."""
        return {self.inference_endpoint: self.inference, **self.other_inference}

    @classmethod
    def from_fixture(cls, root: str | Path, fixture: str | Path = FIXTURE_HOST, **options) -> "SyntheticHost":
        """Copy the fixture tree (symlinks kept as symlinks) into the empty or new directory `root`."""
        root = Path(root)
        shutil.copytree(fixture, root, symlinks=True, dirs_exist_ok=True)
        return cls(root, **options)

    # --- loading the fixture's values ------------------------------------------------------
    def _read(self, relative: str | Path) -> str:
        return (self.root / relative).read_text()

    def _load(self) -> None:
        self.vmstat = _KeyedFile(self._read("proc/vmstat"), r"([a-z0-9_]+) ([0-9]+)$")
        self.vm_rates: dict[str, float] = {}
        self.meminfo = _KeyedFile(self._read("proc/meminfo"), r"([A-Za-z0-9_()]+):\s+([0-9]+)")
        self.sysctl = {name: int(self._read(Path("proc") / path).strip())
                       for name, path in SYSCTL_FILES.items()}
        self.thp = {setting: re.search(r"\[(\S+)\]", self._read(
            f"sys/kernel/mm/transparent_hugepage/{setting}")).group(1) for setting in THP_MODES}
        self.pressure: dict[tuple[str, str], Stall] = {}
        for resource in PSI_RESOURCES:
            for line in self._read(f"proc/pressure/{resource}").splitlines():
                scope, *pairs = line.split()
                fields = dict(pair.split("=") for pair in pairs)
                self.pressure[(resource, scope)] = Stall(
                    float(fields["total"]), averages_percent=[float(fields[k]) for k in ("avg10", "avg60", "avg300")])
        self.processes = {pid: self._load_process(pid) for pid in self._pids()}
        for process in self.processes.values():
            process.loaded_placement = _placement(process)
            process.set_thread_count(process.threads)
        self.nodes = {}
        node_root = self.sysfs / "devices/system/node"
        for entry in sorted(node_root.glob("node[0-9]*")):
            node = int(entry.name[4:])
            self.nodes[node] = NodeState(
                node, _KeyedFile((entry / "meminfo").read_text(), r"Node [0-9]+ ([A-Za-z0-9_()]+):\s+([0-9]+)"),
                _KeyedFile((entry / "numastat").read_text(), r"([a-z_]+) ([0-9]+)$"))
        self.node_cpus = {node: _cpu_list((node_root / f"node{node}" / "cpulist").read_text())
                          for node in self.nodes}
        self.pci = {address: self._load_pci(address)
                    for address in sorted(os.listdir(self.sysfs / "bus/pci/devices"))}
        self.gpus = []
        for index, nvml in enumerate(default_gpus()):
            domain, bus, rest = nvml.pci_bus_id.split(":")
            address = f"{int(domain, 16):04x}:{bus.lower()}:{rest.lower()}"
            device = self.pci[address]
            # The sysfs link is the truth the fixture gives; NVML reads the same link.
            nvml.link_generation, nvml.link_width_lanes = device.link_generation, device.link_width
            context = nvml.memory_used_bytes - sum(p.used_gpu_memory_bytes or 0 for p in nvml.processes)
            self.gpus.append(GpuState(
                index, address, nvml, {p.pid: float(p.used_gpu_memory_bytes or 0) for p in nvml.processes},
                float(context), nvml.utilization_percent / 100.0,
                nvml.pcie_rx_kilobytes_per_second * 1024.0, nvml.pcie_tx_kilobytes_per_second * 1024.0,
                Counter(float(nvml.pcie_replays))))

    def _pids(self) -> list[int]:
        return sorted(int(name) for name in os.listdir(self.procfs) if name.isdigit())

    def _load_process(self, pid: int) -> ProcessState:
        base = self.procfs / str(pid)
        stat = (base / "stat").read_text().strip()
        comm = stat[stat.find("(") + 1:stat.rfind(")")]
        fields = stat[stat.rfind(")") + 1:].split()
        status_lines = (base / "status").read_text().splitlines()
        status = {line.partition(":")[0]: line.partition(":")[2].strip() for line in status_lines}

        def kb(key: str) -> float:
            return float(status.get(key, "0 kB").split()[0]) * KIB

        limits = (base / "limits").read_text() if (base / "limits").exists() else None
        memlock = _memlock_limit(limits) if limits else 8388608
        resident: dict[int, int] = {}
        files: dict[str, int] = {}
        for line in (base / "numa_maps").read_text().splitlines():
            mapped = 0
            for node, pages in re.findall(r"\bN([0-9]+)=([0-9]+)", line):
                resident[int(node)] = resident.get(int(node), 0) + int(pages)
                mapped += int(pages)
            name = re.search(r"\bfile=(\S+)", line)
            if name:
                files[name.group(1)] = files.get(name.group(1), 0) + mapped
        names = list(files)
        total = sum(resident.values()) or 1
        return ProcessState(
            pid=pid, comm=comm, stat_fields=fields, status_lines=status_lines,
            rss_anon_bytes=kb("RssAnon"), rss_file_bytes=kb("RssFile"), swap_bytes=kb("VmSwap"),
            locked_bytes=kb("VmLck"), pinned_bytes=kb("VmPin"), threads=int(status.get("Threads", "1")),
            allowed_cpus=_cpu_list(status.get("Cpus_allowed_list", "0")),
            memory_node_shares={node: pages / total for node, pages in resident.items()},
            cpu_seconds=(int(fields[11]) + int(fields[12])) / self.clock_ticks,
            minor_faults=Counter(float(fields[7])), major_faults=Counter(float(fields[9])),
            peak_rss_bytes=kb("VmHWM"), memlock_limit_bytes=memlock, limits_text=limits,
            binary_path=names[0] if names else f"/usr/bin/{comm}",
            weights_path=max(names[1:], key=files.get) if len(names) > 1 else f"/models/{comm}.bin")

    def _load_pci(self, address: str) -> PciDevice:
        link = self.sysfs / "bus/pci/devices" / address
        directory = (link.parent / os.readlink(link)).resolve() if link.is_symlink() else link
        generation = width = None
        if (directory / "current_link_speed").exists():
            generation = _SPEED_TO_GENERATION[(directory / "current_link_speed").read_text().split()[0]]
            width = int((directory / "current_link_width").read_text())
        aer = None
        if (directory / "aer_dev_correctable").exists():
            aer = {}
            for name in ("aer_dev_correctable", "aer_dev_nonfatal", "aer_dev_fatal"):
                aer[name] = [[key, int(count)] for key, count in
                             (line.rsplit(None, 1) for line in (directory / name).read_text().splitlines() if line.strip())]
        return PciDevice(address, directory, generation, width, aer)

    # --- changing the state ----------------------------------------------------------------
    def gpu(self, index: int) -> GpuState:
        return self.gpus[index]

    def process(self, pid: int) -> ProcessState:
        return self.processes[pid]

    def jitter(self, value: float, relative: float) -> float:
        """`value` with deterministic uniform noise of +-relative (seeded per scenario)."""
        return value * (1.0 + self.rng.uniform(-relative, relative))

    def set_vm_rate(self, name: str, per_second: float) -> None:
        """Rate of a /proc/vmstat counter (events or pages per second)."""
        if name not in self.vmstat.values:
            raise KeyError(f"/proc/vmstat has no {name}")
        self.vm_rates[name] = per_second

    def set_swap_traffic(self, in_bytes_per_second: float, out_bytes_per_second: float) -> None:
        """Swap-in and swap-out in bytes/s, written as pswpin/pswpout pages of this host's page size."""
        self.set_vm_rate("pswpin", in_bytes_per_second / self.page_size)
        self.set_vm_rate("pswpout", out_bytes_per_second / self.page_size)

    def set_zswap_traffic(self, in_bytes_per_second: float, out_bytes_per_second: float) -> None:
        """Pages loaded from and stored into zswap's pool, in bytes/s, written as zswpin/zswpout
        pages of this host's page size (the fixture's kernel has CONFIG_ZSWAP: both fields, at 0).
        They are not swap-device traffic: pswpin/pswpout stay as set_swap_traffic left them."""
        self.set_vm_rate("zswpin", in_bytes_per_second / self.page_size)
        self.set_vm_rate("zswpout", out_bytes_per_second / self.page_size)

    def set_pressure(self, resource: str, some: float, full: float | None = None) -> None:
        """PSI stall shares (0-1) of a resource; cpu's system-wide full line stays at zero."""
        self.pressure[(resource, "some")].ratio = some
        if full is not None and resource != "cpu":
            self.pressure[(resource, "full")].ratio = full

    def settle_pressure(self) -> None:
        for stall in self.pressure.values():
            stall.settle()

    def set_meminfo(self, **sizes_bytes: float) -> None:
        """meminfo fields in bytes (MemAvailable=..., SwapFree=...); written in kB."""
        for name, value in sizes_bytes.items():
            if name not in self.meminfo.values:
                raise KeyError(f"/proc/meminfo has no {name}")
            self.meminfo.values[name] = value / KIB

    def meminfo_bytes(self, name: str) -> float:
        return self.meminfo.values[name] * KIB

    def set_swap_used(self, used_bytes: float) -> None:
        total = self.meminfo_bytes("SwapTotal")
        self.set_meminfo(SwapFree=min(total, max(0.0, total - used_bytes)))

    def set_thp(self, setting: str, mode: str) -> None:
        if mode not in THP_MODES[setting]:
            raise ValueError(f"transparent_hugepage/{setting} has no mode {mode!r}")
        self.thp[setting] = mode

    def set_cmdline(self, pid: int, *arguments: str) -> None:
        """Process `pid`'s /proc/<pid>/cmdline: arguments each ended by NUL, as the kernel shows
        them. The process collector reads it again when the pid is new or once per discovery
        interval, as it does on a real host."""
        self._put(f"proc/{pid}/cmdline", "".join(f"{argument}\0" for argument in arguments))

    def set_link(self, gpu: int, generation: int, width: int) -> None:
        """The GPU's current PCIe link, in NVML and in its function's sysfs files alike."""
        state = self.gpus[gpu]
        state.set_link(generation, width)
        device = self.pci[state.address]
        device.link_generation, device.link_width = generation, width

    def set_traffic_share(self, gpu: int, host_to_device: float, device_to_host: float) -> None:
        """PCIe traffic as shares of the current link's theoretical capacity."""
        state = self.gpus[gpu]
        state.host_to_device_bytes_per_second = host_to_device * state.capacity_bytes_per_second
        state.device_to_host_bytes_per_second = device_to_host * state.capacity_bytes_per_second

    def add_aer_errors(self, address: str, severity: str, counter: str, count: int = 1) -> None:
        """`count` more AER messages of a named error bit (and its TOTAL_ERR_* line)."""
        lines = self.pci[address].aer[f"aer_dev_{severity}"]
        if counter not in {line[0] for line in lines}:
            raise KeyError(f"aer_dev_{severity} has no {counter}")
        for line in lines:
            if line[0] == counter or line[0].startswith("TOTAL_ERR_"):
                line[1] += count

    def remove_pci_function(self, address: str) -> None:
        """The function falls off the bus: its bus/pci/devices entry and its directory go."""
        self.pci[address].present = False

    def lose_gpu(self, gpu: int) -> None:
        """NVML answers NVML_ERROR_GPU_IS_LOST for every call on this GPU from now on."""
        self.gpus[gpu].lost = True

    def set_process_placement(self, pid: int, nodes: Iterable[int], memory_node_shares: dict[int, float]) -> None:
        """Allowed CPUs: every CPU of `nodes`; resident pages split over nodes by the given shares."""
        process = self.processes[pid]
        process.allowed_cpus = frozenset().union(*(self.node_cpus[node] for node in nodes))
        total = sum(memory_node_shares.values())
        process.memory_node_shares = {node: share / total for node, share in memory_node_shares.items()}
        process.thread_node_shares = None  # its threads run where it may now

    def set_thread_placement(self, pid: int, node_shares: dict[int, float] | None) -> None:
        """Where the process's busy threads run: node -> share of them (each node must hold some of
        its allowed CPUs); None: spread over its allowed CPUs' nodes."""
        process = self.processes[pid]
        if node_shares is not None:
            for node in node_shares:
                if not process.allowed_cpus & self.node_cpus[node]:
                    raise ValueError(f"pid {pid} may not run on node {node}")
        process.thread_node_shares = node_shares

    # --- a bigger host: PCI functions and processes copied from the fixture's ----------------
    def add_pci_function_like(self, template: str, address: str, root_port: str, node: int) -> PciDevice:
        """A copy of PCI function `template`'s sysfs directory at `address`, behind a root port of its
        own (devices/pci<domain:bus>/<root_port>/<address>) on NUMA node `node`, linked from
        bus/pci/devices as the kernel links it."""
        domain_bus = "pci" + root_port[:7]  # "pci0000:26"
        target = self.sysfs / "devices" / domain_bus / root_port / address
        shutil.copytree(self.pci[template].directory, target)
        (target / "numa_node").write_text(f"{node}\n")
        os.symlink(os.path.join("..", "..", "..", "devices", domain_bus, root_port, address),
                   self.sysfs / "bus/pci/devices" / address)
        self.pci[address] = self._load_pci(address)
        return self.pci[address]

    # --- a PCIe switch: GPUs that share one link to the CPU (issue 29) -------------------------
    def add_switch(self, root_port: str, upstream_port: str, downstream_ports: Iterable[str], node: int,
                   generation: int = 4, width: int = 16) -> None:
        """A root port on a host bridge of its own and, below it, a PCIe switch: its upstream port
        and downstream ports, nested as the kernel nests bridges (devices/pci<domain:bus>/<root
        port>/<upstream port>/<downstream port>, Documentation/ABI/testing/sysfs-bus-pci), each
        linked from bus/pci/devices, every link at `generation` x `width`, on NUMA node `node`. Ids
        as in tests/fixtures/host-switch: an Intel root port, Broadcom PEX88000 switch ports."""
        root = self._add_bridge(self.sysfs / "devices" / ("pci" + root_port[:7]), root_port, "0x8086", "0x347a",
                                node, generation, width)
        upstream = self._add_bridge(root, upstream_port, "0x1000", "0xc030", node, generation, width)
        for port in downstream_ports:
            self._add_bridge(upstream, port, "0x1000", "0xc030", node, generation, width)

    def _add_bridge(self, parent: Path, address: str, vendor: str, device: str, node: int,
                    generation: int, width: int) -> Path:
        directory = parent / address
        directory.mkdir(parents=True)
        speed = LINK_SPEED_TEXT[generation]
        for name, text in (("vendor", vendor), ("device", device), ("class", "0x060400"),
                           ("current_link_speed", speed), ("current_link_width", width),
                           ("max_link_speed", speed), ("max_link_width", width), ("numa_node", node)):
            (directory / name).write_text(f"{text}\n")
        self._link_function(address, directory)
        return directory

    def _link_function(self, address: str, directory: Path) -> None:
        """bus/pci/devices/<address> -> the function's directory, relative as the kernel links it."""
        devices = self.sysfs / "bus/pci/devices"
        os.symlink(os.path.relpath(directory, devices), devices / address)
        self.pci[address] = self._load_pci(address)

    def add_gpu_behind(self, port: str, address: str, template: int, uuid: str) -> GpuState:
        """A GPU like GPU `template` (its sysfs function copied, its NVML model and link), at
        `address` below the bridge `port` (a switch's downstream port), with no processes yet;
        NVML lists it after the others."""
        model = self.gpus[template]
        directory = self.pci[port].directory / address
        shutil.copytree(self.pci[model.address].directory, directory)
        (directory / "numa_node").write_text((self.pci[port].directory / "numa_node").read_text())
        self._link_function(address, directory)
        domain, bus, rest = address.split(":")
        nvml = dataclasses.replace(model.nvml, uuid=uuid, pci_bus_id=f"0000{domain}:{bus.upper()}:{rest}",
                                   memory_used_bytes=2 * GIB, processes=[])
        gpu = GpuState(len(self.gpus), address, nvml, {}, float(nvml.memory_used_bytes), 0.0, 0.0, 0.0, Counter(0.0))
        self.gpus.append(gpu)
        return gpu

    def add_process_like(self, template: int, pid: int) -> ProcessState:
        """A copy of process `template` as `pid`: its /proc directory (fd/ socket links and all),
        with the pid in stat and status (Pid, Tgid and their namespace forms) from the next write()."""
        shutil.copytree(self.procfs / str(template), self.procfs / str(pid), symlinks=True)
        shutil.rmtree(self.procfs / str(pid) / "task", ignore_errors=True)  # the template's threads
        process = self._load_process(pid)
        process.set_thread_count(process.threads)
        process.status_lines = [_with_pid(line, template, pid) for line in process.status_lines]
        process.loaded_placement = _placement(process)
        self.processes[pid] = process
        return process

    def add_unwatched_process(self, pid: int, comm: str, cmdline: str) -> ProcessState:
        """A process no [process] setting watches (a batch job): a copy of pid 1's /proc directory
        as `pid`, a child of it, named `comm` in its stat, status and comm, with `cmdline` (words
        separated by spaces, written NUL-terminated as the kernel does)."""
        process = self.add_process_like(1, pid)
        process.comm = comm
        process.stat_fields[1] = "1"  # ppid: started by init
        process.status_lines = [f"Name:\t{comm}" if line.startswith("Name:")
                                else "PPid:\t1" if line.startswith("PPid:") else line
                                for line in process.status_lines]
        (self.procfs / str(pid) / "comm").write_text(f"{comm}\n")
        (self.procfs / str(pid) / "cmdline").write_text("".join(f"{word}\0" for word in cmdline.split()))
        return process

    def remove_process(self, pid: int) -> None:
        """The process is gone: its /proc directory with it."""
        del self.processes[pid]
        shutil.rmtree(self.procfs / str(pid))
        self._written = {path: text for path, text in self._written.items() if not path.startswith(f"proc/{pid}/")}
        self._thread_lines = {path: line for path, line in self._thread_lines.items()
                              if not path.startswith(f"proc/{pid}/")}

    def count_oom_kills(self, kills: int = 1) -> None:
        """The kernel OOM killer killed `kills` processes: oom_kill of /proc/vmstat rises (mm/oom_kill.c
        counts each kill, count_vm_event(OOM_KILL), before its victim exits)."""
        self.vmstat.values["oom_kill"] += kills

    def boot_time(self) -> int:
        """btime of the fixture's /proc/stat: seconds since the epoch when the host booted."""
        return int(re.search(r"^btime (\d+)$", self._read("proc/stat"), re.M).group(1))

    def restart_process(self, pid: int, new_pid: int, started_at: float) -> ProcessState:
        """A supervisor's restart of `pid` (already exited: killed or stopped) as `new_pid`, started
        at `started_at` (seconds since the epoch): the same command line, a new /proc/<new_pid>
        with its start time (field 22 of stat, clock ticks since boot), no CPU time or faults yet;
        the old /proc/<pid> goes, and so does its GPU memory (the new one has none until it loads)."""
        process = self.add_process_like(pid, new_pid)
        process.stat_fields[19] = str(math.floor((started_at - self.boot_time()) * self.clock_ticks))
        process.cpu_seconds = 0.0
        process.thread_cpu_seconds = {tid: 0.0 for tid in process.thread_cpu_seconds}
        process.minor_faults, process.major_faults = Counter(0.0), Counter(0.0)
        self.remove_process(pid)
        for gpu in self.gpus:
            gpu.process_memory.pop(pid, None)
        return process

    # --- time ------------------------------------------------------------------------------
    def advance(self, dt: float) -> None:
        """Let `dt` seconds pass at the current rates."""
        for name, rate in self.vm_rates.items():
            if rate < 0:
                raise ValueError(f"vmstat {name}: a counter's rate cannot be negative ({rate})")
            self.vmstat.values[name] += rate * dt
        swap_net = (self.vm_rates.get("pswpout", 0.0) - self.vm_rates.get("pswpin", 0.0)) * self.page_size * dt
        if swap_net:
            total = self.meminfo_bytes("SwapTotal")
            self.set_meminfo(SwapFree=min(total, max(0.0, self.meminfo_bytes("SwapFree") - swap_net)))
        for stall in self.pressure.values():
            stall.advance(dt)
        for process in self.processes.values():
            process.minor_faults.advance(dt, f"pid {process.pid} minflt")
            process.major_faults.advance(dt, f"pid {process.pid} majflt")
            if process.cpu_rate < 0:
                raise ValueError(f"pid {process.pid}: negative CPU rate")
            process.cpu_seconds += process.cpu_rate * dt
            busy = process.busy_tids()
            for tid in busy:
                process.thread_cpu_seconds[tid] += process.cpu_rate * dt / len(busy)
        for gpu in self.gpus:
            gpu.replays.advance(dt, f"GPU {gpu.index} replays")
        for node in self.nodes.values():
            for name, rate in node.allocation_rates.items():
                node.numastat.values[name] += rate * dt
        for server in self.inference_servers().values():
            server.advance(dt)

    # --- rendering -------------------------------------------------------------------------
    def _put(self, relative: str, text: str) -> None:
        if self._written.get(relative) != text:
            with open(os.path.join(self._root_text, relative), "w", encoding="utf-8") as handle:
                handle.write(text)
            self._written[relative] = text

    def write(self, nvml: FakeNvml | None = None, threads: bool = True) -> None:
        """Render the state into the tree, into `nvml` (the fake library the agent calls) and into
        the inference server's answer. threads=False leaves the processes' task/<tid>/stat files
        as they were: only process_numa reads them, every 30 s, and rewriting a busy thread's file
        on every tick cost as much as the rest of the tick (write_trace passes False on the ticks
        where process_numa does not run, so every reading is of the state at its tick)."""
        self._threads_due = threads
        self._write_memory()
        for resource in PSI_RESOURCES:
            lines = []
            for scope in ("some", "full"):
                stall = self.pressure.get((resource, scope))
                if stall is None:
                    continue
                a10, a60, a300 = stall.averages_percent
                lines.append(f"{scope} avg10={a10:.2f} avg60={a60:.2f} avg300={a300:.2f} "
                             f"total={math.floor(stall.total_microseconds)}")
            self._put(f"proc/pressure/{resource}", "\n".join(lines) + "\n")
        for process in self.processes.values():
            self._write_process(process)
        for node in self.nodes.values():
            self._put(f"sys/devices/system/node/node{node.node}/meminfo", node.meminfo.render())
            self._put(f"sys/devices/system/node/node{node.node}/numastat", node.numastat.render())
        for gpu in self.gpus:
            self._render_gpu(gpu)
        for device in self.pci.values():
            self._write_pci(device)
        for server in self.inference_servers().values():
            server.publish()
        if nvml is not None:
            nvml.configure(gpus=[gpu.nvml for gpu in self.gpus])
            nvml.lost = {gpu.index for gpu in self.gpus if gpu.lost}

    def _write_memory(self) -> None:
        free_kb = self.meminfo.values["MemFree"]
        self.vmstat.values["nr_free_pages"] = free_kb * KIB / self.page_size
        self._put("proc/vmstat", self.vmstat.render())
        self._put("proc/meminfo", self.meminfo.render())
        # The nodes' free memory adds up to the host's, split in proportion to node size.
        totals = {node: state.meminfo.values["MemTotal"] for node, state in self.nodes.items()}
        remaining = free_kb
        for number, (node, state) in enumerate(sorted(self.nodes.items())):
            share = free_kb * totals[node] / sum(totals.values())
            node_free = remaining if number == len(self.nodes) - 1 else math.floor(share)
            remaining -= node_free
            state.meminfo.values["MemFree"] = node_free
            if "MemUsed" in state.meminfo.values:
                state.meminfo.values["MemUsed"] = totals[node] - node_free
        for name, path in SYSCTL_FILES.items():
            self._put(f"proc/{path}", f"{self.sysctl[name]}\n")
        for setting, modes in THP_MODES.items():
            self._put(f"sys/kernel/mm/transparent_hugepage/{setting}",
                      " ".join(f"[{mode}]" if mode == self.thp[setting] else mode for mode in modes) + "\n")

    def _write_process(self, process: ProcessState) -> None:
        base = f"proc/{process.pid}"
        ticks = process.cpu_seconds * self.clock_ticks
        fields = list(process.stat_fields)
        fields[7] = str(math.floor(process.minor_faults.value))
        fields[9] = str(math.floor(process.major_faults.value))
        # utime and stime: 95 % of the CPU time in user mode.
        system = math.floor(ticks * 0.05)
        fields[11], fields[12] = str(math.floor(ticks) - system), str(system)
        fields[17] = str(process.threads)
        fields[21] = str(math.floor(process.resident_bytes / self.page_size))
        self._put(f"{base}/stat", f"{process.pid} ({process.comm}) {' '.join(fields)}\n")

        process.peak_rss_bytes = max(process.peak_rss_bytes, process.resident_bytes)
        anon_kb, file_kb = math.floor(process.rss_anon_bytes / KIB), math.floor(process.rss_file_bytes / KIB)
        anon_kb -= anon_kb % 4  # whole 4 KiB pages, so numa_maps can add up to them exactly
        file_kb -= file_kb % 4
        sizes = {"VmRSS": anon_kb + file_kb, "RssAnon": anon_kb, "RssFile": file_kb,
                 "VmSwap": process.swap_bytes / KIB, "VmLck": process.locked_bytes / KIB,
                 "VmPin": process.pinned_bytes / KIB, "VmHWM": max(process.peak_rss_bytes / KIB, anon_kb + file_kb)}
        cpus = process.allowed_cpus
        mask = sum(1 << cpu for cpu in cpus)
        cpu_count = sum(len(c) for c in self.node_cpus.values())
        lines = []
        for line in process.status_lines:
            key = line.partition(":")[0]
            if key in sizes:
                line = f"{key}:\t{math.floor(sizes[key]):8d} kB"
            elif key == "Threads":
                line = f"Threads:\t{process.threads}"
            elif key == "Cpus_allowed":
                line = f"Cpus_allowed:\t{mask:0{max(1, (cpu_count + 3) // 4)}x}"
            elif key == "Cpus_allowed_list":
                line = f"Cpus_allowed_list:\t{_format_cpu_list(cpus)}"
            lines.append(line)
        self._put(f"{base}/status", "\n".join(lines) + "\n")
        # The fixture's own numa_maps stays until the process's memory or placement changes.
        if _placement(process) != process.loaded_placement:
            self._put(f"{base}/numa_maps", self._numa_maps(process, anon_kb // 4, file_kb // 4))
        self._put(f"{base}/limits", _limits_text(process.memlock_limit_bytes, process.limits_text))
        if self._threads_due:
            self._write_threads(process)

    def thread_cpus(self, process: ProcessState) -> dict[int, int]:
        """tid -> the CPU it last ran on: busy threads over the nodes of `thread_node_shares`
        (largest remainder, in node order), each node's threads round-robin over its allowed CPUs;
        idle threads round-robin over every allowed CPU."""
        allowed = sorted(process.allowed_cpus)
        by_node = {node: sorted(process.allowed_cpus & cpus) for node, cpus in self.node_cpus.items()}
        shares = process.thread_node_shares or {
            node: len(cpus) / len(allowed) for node, cpus in by_node.items() if cpus}
        busy = process.busy_tids()
        wanted = {node: share * len(busy) for node, share in shares.items()}
        counts = {node: math.floor(value) for node, value in wanted.items()}
        for node in sorted(wanted, key=lambda n: (counts[n] - wanted[n], n))[:len(busy) - sum(counts.values())]:
            counts[node] += 1
        placed = [node for node in sorted(counts) for _ in range(counts[node])]
        cpus = {}
        for number, (tid, node) in enumerate(zip(busy, placed)):
            cpus[tid] = by_node[node][number % len(by_node[node])]
        for number, tid in enumerate(list(process.thread_cpu_seconds)[len(busy):]):
            cpus[tid] = allowed[number % len(allowed)]
        return cpus

    def _write_threads(self, process: ProcessState) -> None:
        """/proc/<pid>/task/<tid>/stat of each thread: the fixture's stat line of the process with
        the thread's own tid, utime and stime (95 % user, as the process's), processor (field 39)
        and the thread count. Its other fields (faults, sizes) stay the fixture's: nothing reads a
        thread's, and a line that does not change is not rewritten (56 of vLLM's 64 threads idle)."""
        task = self.procfs / str(process.pid) / "task"
        shares = process.thread_node_shares
        key = (process.allowed_cpus, tuple(sorted(shares.items())) if shares else None, process.threads)
        cached = self._thread_cpus.get(process.pid)
        if cached is None or cached[0] != key:
            cached = self._thread_cpus[process.pid] = (key, self.thread_cpus(process))
        for tid, cpu in cached[1].items():
            ticks = math.floor(process.thread_cpu_seconds[tid] * self.clock_ticks)
            relative = f"proc/{process.pid}/task/{tid}/stat"
            if self._thread_lines.get(relative) == (ticks, cpu, process.threads):
                continue
            self._thread_lines[relative] = (ticks, cpu, process.threads)
            system = math.floor(ticks * 0.05)
            fields = process.stat_fields
            if relative not in self._written:
                (task / str(tid)).mkdir(parents=True, exist_ok=True)
            # fields 3-13 | utime stime | 16-19 | num_threads | 21-38 | processor | 40-
            self._put(relative, f"{tid} ({process.comm}) {' '.join(fields[:11])} {ticks - system} {system} "
                                f"{' '.join(fields[13:17])} {process.threads} {' '.join(fields[18:36])} "
                                f"{cpu} {' '.join(fields[37:])}\n")

    def _numa_maps(self, process: ProcessState, anon_pages: int, file_pages: int) -> str:
        """Mappings shaped like the fixture's: binary, heap, one large anonymous region (model
        buffers, KV blocks), a file mapping (weights) and the stack; every page 4 KiB."""
        home = min(self.node_cpus, key=lambda node: -len(process.allowed_cpus & self.node_cpus[node]))
        binary_pages = min(915, file_pages)
        stack_pages = min(34, anon_pages)
        heap_pages = min(262144, max(0, anon_pages - stack_pages) // 8)
        big_pages = anon_pages - stack_pages - heap_pages
        weights_pages = file_pages - binary_pages
        shares = process.memory_node_shares

        def split(pages: int) -> str:
            nodes = sorted(shares)
            placed, parts = 0, []
            for number, node in enumerate(nodes):
                count = pages - placed if number == len(nodes) - 1 else round(pages * shares[node])
                placed += count
                if count:
                    parts.append(f"N{node}={count}")
            return " ".join(parts)

        lines = [f"55d0c0a00000 default file={process.binary_path} mapped={binary_pages} mapmax=3 N{home}={binary_pages} kernelpagesize_kB=4"
                 if binary_pages else "55d0c0a00000 default"]
        lines.append(f"55d0c2000000 default heap anon={heap_pages} dirty={heap_pages} {split(heap_pages)} kernelpagesize_kB=4"
                     if heap_pages else "55d0c2000000 default heap")
        lines.append(f"7f1d00000000 default anon={big_pages} dirty={big_pages} {split(big_pages)} kernelpagesize_kB=4"
                     if big_pages else "7f1d00000000 default")
        lines.append("7f22c0000000 default")
        lines.append(f"7f2300000000 default file={process.weights_path} mapped={weights_pages} mapmax=1 "
                     f"{split(weights_pages)} kernelpagesize_kB=4" if weights_pages else "7f2300000000 default")
        lines.append(f"7ffd4c000000 default stack anon={stack_pages} dirty={stack_pages} N{home}={stack_pages} kernelpagesize_kB=4"
                     if stack_pages else "7ffd4c000000 default stack")
        return "\n".join(lines) + "\n"

    def _render_gpu(self, gpu: GpuState) -> None:
        nvml = gpu.nvml
        names = {pid: self.processes[pid].comm if pid in self.processes else str(pid) for pid in gpu.process_memory}
        nvml.processes = [FakeProcess(pid, names[pid], math.floor(used)) for pid, used in sorted(gpu.process_memory.items())]
        nvml.memory_used_bytes = math.floor(gpu.memory_used_bytes)
        if nvml.memory_used_bytes + nvml.memory_reserved_bytes > nvml.memory_total_bytes:
            raise ValueError(f"GPU {gpu.index}: more memory used than installed")
        nvml.utilization_percent = max(0, min(100, round(gpu.utilization * 100)))
        capacity = gpu.capacity_bytes_per_second
        for attribute, value in (("pcie_rx_kilobytes_per_second", gpu.host_to_device_bytes_per_second),
                                 ("pcie_tx_kilobytes_per_second", gpu.device_to_host_bytes_per_second)):
            setattr(nvml, attribute, math.floor(max(0.0, min(value, capacity)) / 1024))
        nvml.pcie_replays = math.floor(gpu.replays.value)

    def _write_pci(self, device: PciDevice) -> None:
        link = self.sysfs / "bus/pci/devices" / device.address
        if not device.present:
            if link.is_symlink() or link.exists():
                link.unlink()
            if device.directory.exists():
                shutil.rmtree(device.directory)
                gone = str(device.directory.relative_to(self.root)) + "/"
                self._written = {p: t for p, t in self._written.items() if not p.startswith(gone)}
            return
        relative = str(device.directory.relative_to(self.root))
        if device.link_generation is not None:
            self._put(f"{relative}/current_link_speed", LINK_SPEED_TEXT[device.link_generation] + "\n")
            self._put(f"{relative}/current_link_width", f"{device.link_width}\n")
        if device.aer is not None:
            for name, lines in device.aer.items():
                self._put(f"{relative}/{name}", "".join(f"{key} {count}\n" for key, count in lines))

    # --- the agent's view ------------------------------------------------------------------
    def agent_config(self, interval_seconds: float = 1.0, history_seconds: float = 7200.0,
                     detectors: bool = False) -> AgentConfig:
        """The configuration an agent on this host runs with: its roots, the fake NVML, no udev
        (udev describes only the machine's own /sys), vLLM's endpoint (so no discovery). The
        detectors are off by default: recording needs none, and a replay takes its detector
        settings from the replaying agent."""
        settings = {
            "interval_seconds": interval_seconds,
            "history_seconds": history_seconds,
            "paths": {"procfs": str(self.procfs), "sysfs": str(self.sysfs)},
            "state_dir": str(self.root / "state"),  # no benchmark run unless a scenario stores one
            # One 20 ms window per tick, no sampler thread: ticks here run faster than real time,
            # and samples a thread took between two of them could predate the step's traffic.
            "gpu": {"nvml_module": "tests.support.fake_nvml", "pcie_samples_per_second": 0},
            "pcie": {"udev": False},
            "inference": {"endpoints": [{"url": url, "server": "vllm"} for url in self.inference_servers()]},
            # vLLM is asked every 10 s (30 s on the long scenarios' 10 s ticks), not every 5 s as
            # by default: reading a body costs ~3 ms, paid at generation and again by every replay.
            "collectors": {"inference": {"interval_seconds": max(10.0, 3 * interval_seconds)}},
        }
        if "detectors" in AgentConfig.model_fields:
            settings["detectors"] = {"enabled": detectors}
        return AgentConfig.model_validate(settings)


def _placement(process: ProcessState) -> tuple:
    return (math.floor(process.rss_anon_bytes / KIB) // 4, math.floor(process.rss_file_bytes / KIB) // 4,
            tuple(sorted(process.memory_node_shares.items())), tuple(sorted(process.allowed_cpus)))


def _with_pid(status_line: str, old: int, new: int) -> str:
    key, colon, value = status_line.partition(":")
    if colon and key in ("Tgid", "Pid", "NStgid", "NSpid") and value.strip() == str(old):
        return f"{key}:\t{new}"
    return status_line


def _cpu_list(text: str) -> frozenset[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def _format_cpu_list(cpus: Iterable[int]) -> str:
    ordered = sorted(cpus)
    ranges, start = [], None
    for position, cpu in enumerate(ordered):
        if start is None:
            start = cpu
        if position + 1 == len(ordered) or ordered[position + 1] != cpu + 1:
            ranges.append(f"{start}" if start == cpu else f"{start}-{cpu}")
            start = None
    return ",".join(ranges)


def _limit_row(name: str, unit: str, soft: int | None, hard: int | None) -> str:
    """One row as fs/proc/base.c proc_pid_limits prints it ("%-25s %-20s %-20s %-10s")."""
    soft_text = "unlimited" if soft is None else str(soft)
    hard_text = "unlimited" if hard is None else str(hard)
    return f"{name:<25} {soft_text:<20} {hard_text:<20} " + (f"{unit:<10}" if unit else "")


@functools.lru_cache(maxsize=16)
def _limits_text(memlock_bytes: int | None, template: str | None = None) -> str:
    """/proc/<pid>/limits with the given RLIMIT_MEMLOCK (soft = hard; None: unlimited): the
    template (the fixture's file) with its memlock row rewritten, or the kernel's defaults."""
    memlock = _limit_row("Max locked memory", "bytes", memlock_bytes, memlock_bytes)
    if template is not None:
        return "".join(memlock + "\n" if line.startswith("Max locked memory") else line + "\n"
                       for line in template.splitlines())
    lines = [f"{'Limit':<25} {'Soft Limit':<20} {'Hard Limit':<20} {'Units':<10}"]
    for name, unit, soft, hard in _LIMIT_ROWS:
        lines.append(memlock if name == "Max locked memory" else _limit_row(name, unit, soft, hard))
    return "\n".join(lines) + "\n"


def _memlock_limit(limits_text: str) -> int | None:
    for line in limits_text.splitlines():
        if line.startswith("Max locked memory"):
            soft = line[len("Max locked memory"):].split()[0]
            return None if soft == "unlimited" else int(soft)
    return 8388608
