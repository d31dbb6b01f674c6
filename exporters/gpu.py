"""NVIDIA GPUs through NVML: identity, memory, PCIe link and traffic, utilization, processes,
and the NVLink-C2C link of Grace Hopper/Blackwell GPUs.

All NVML access goes through exporters/nvml.py. GPUs are read concurrently, one task per GPU:
where a GPU lacks PCIe byte counters, nvmlDeviceGetPcieThroughput samples a 20 ms window per
direction and blocks meanwhile, so such a GPU's first tick costs ~40 ms and eight read one after
the other ~320 ms; later ticks take the samples a sampler thread took meanwhile
(exporters/pcie_traffic.py, docs/nvml-cost.md). GPUs whose last read waited on no window (byte
counters, GPM or samplers) are read one after the other in one task: nothing then waits long
enough for a task each to pay for itself (GpuCollector._unhurried). A collection waits for the
tasks at most read_budget_seconds, so a GPU whose NVML call hangs delays no other (_read_all).
"""
from __future__ import annotations

import logging
import os
import threading
import time
import queue
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from pydantic import Field

from hybridmon.exporters.sources import RawSource
from hybridmon.exporters.base import (CollectorContext, CollectorRegistration, CollectorSettings, LogOnce,
                                      MetricSpec, NoDataError, Samples)
from hybridmon.exporters.nvml import C2cLink, GpuLostError, GpuProcess, Nvml
from hybridmon.exporters.nvml_answers import (NVML_GPM_METRIC_C2C_TOTAL_RX_PER_SEC,
                                              NVML_GPM_METRIC_C2C_TOTAL_TX_PER_SEC,
                                              NVML_GPM_METRIC_PCIE_RX_PER_SEC,
                                              NVML_GPM_METRIC_PCIE_TX_PER_SEC)
from hybridmon.exporters.pcie_traffic import (DEFAULT_SAMPLES_PER_SECOND, DIRECTIONS, MIB,
                                              MAX_SAMPLES_PER_SECOND, PcieTraffic, TrafficReading)
from hybridmon.exporters.pid_namespace import PidView, pid_view
from hybridmon.exporters.sources import LiveSource, TraceMissError

log = logging.getLogger(__name__)

GPU = ("gpu", "uuid")

GPU_INFO = MetricSpec(
    "hybridmon_gpu_info",
    "Identity of each GPU, value 1: NVML index, UUID, product name (nvmlDeviceGetName), PCI "
    "address in sysfs form (nvmlDeviceGetPciInfo busId) and driver version "
    "(nvmlSystemGetDriverVersion).",
    "gauge", ("gpu", "uuid", "name", "pci_bus_id", "driver_version"))
GPU_UP = MetricSpec(
    "hybridmon_gpu_up",
    "1 when at least one NVML call on the GPU succeeded this collection; 0 when NVML reports it "
    "lost (NVML_ERROR_GPU_IS_LOST: fell off the bus, needs a reset or reboot) or none of its calls "
    "succeeded (e.g. the driver was unloaded while the agent ran). A GPU at 0 has no other "
    "series but the two hybridmon_gpu_down_* ones; one whose UUID NVML never gave has none at all.",
    "gauge", GPU)
DOWN_READINGS = MetricSpec(
    "hybridmon_gpu_down_consecutive_readings",
    "Collections in a row, this one included, at which the GPU was down (hybridmon_gpu_up 0: NVML "
    "answered NVML_ERROR_GPU_IS_LOST, or none of its calls succeeded); 0 while it is up. A GPU "
    "really lost stays lost until a reset (nvml.h, NVML_ERROR_GPU_IS_LOST), so 2 or more is a loss "
    "seen twice; 1 is a single reading, which Prometheus cannot tell from a loss between two "
    "scrapes without this count.",
    "gauge", GPU)
DOWN_BLIPS = MetricSpec(
    "hybridmon_gpu_down_blips_total",
    "Times since the agent started that the GPU was down at one collection only and up again at "
    "the next (a lost or unanswered reading that did not hold; GpuLost does not page for it).",
    "counter", GPU)
MEMORY_USED = MetricSpec(
    "hybridmon_gpu_memory_used_bytes",
    "GPU memory allocated by processes (bytes), nvmlDeviceGetMemoryInfo v2 `used`. On drivers "
    "without v2 the v1 value, which also counts driver-reserved memory.",
    "gauge", GPU)
MEMORY_TOTAL = MetricSpec(
    "hybridmon_gpu_memory_total_bytes",
    "GPU memory installed (bytes), nvmlDeviceGetMemoryInfo `total`.", "gauge", GPU)
MEMORY_RESERVED = MetricSpec(
    "hybridmon_gpu_memory_reserved_bytes",
    "GPU memory the driver and firmware reserve (bytes), nvmlDeviceGetMemoryInfo v2 `reserved`; "
    "absent on drivers without memory info v2.", "gauge", GPU)
PCIE_THROUGHPUT = MetricSpec(
    "hybridmon_gpu_pcie_throughput_bytes_per_second",
    "PCIe traffic (bytes/s) since the previous collection: the PCIe byte counters' increase "
    "over NVML's time between them where the GPU has them, else GPM's PCIe metrics between two "
    "samples (Hopper and later; MiB/s x 2^20), else the mean of the 20 ms "
    "nvmlDeviceGetPcieThroughput samples (KB/s x 1024) taken since; one 20 ms window on the "
    "first collection. direction host_to_device (RX) or device_to_host (TX).",
    "gauge", ("gpu", "uuid", "direction"))
PCIE_BYTES = MetricSpec(
    "hybridmon_gpu_pcie_bytes_total",
    "PCIe bytes the GPU received (direction host_to_device, NVML_FI_DEV_PCIE_COUNT_RX_BYTES) or "
    "sent (device_to_host, NVML_FI_DEV_PCIE_COUNT_TX_BYTES) since the driver loaded, read with "
    "nvmlDeviceGetFieldValues; a cumulative count, so rate() over any window is exact where "
    "the 20 ms throughput sample is not. Absent where the GPU or driver lacks the fields.",
    "counter", ("gpu", "uuid", "direction"))
PCIE_SAMPLED_BYTES = MetricSpec(
    "hybridmon_gpu_pcie_sampled_bytes_total",
    "Estimated PCIe bytes moved since the agent started, where the GPU lacks byte counters: the "
    "sum of each 20 ms nvmlDeviceGetPcieThroughput sample times the time it stands for (samples "
    "at random moments, pcie_samples_per_second a second near the starvation threshold, down to 1 "
    "a second far below it). rate() over 1 min has a standard "
    "error of at most burst rate x sqrt(d(1-d)/n), n samples in the window (docs/nvml-cost.md); "
    "absent where hybridmon_gpu_pcie_bytes_total is present.",
    "counter", ("gpu", "uuid", "direction"))
PCIE_LINK_GENERATION = MetricSpec(
    "hybridmon_gpu_pcie_link_generation",
    "PCIe generation the link runs at now, nvmlDeviceGetCurrPcieLinkGeneration (it drops at "
    "idle on power-saving GPUs).", "gauge", GPU)
PCIE_LINK_MAX_GENERATION = MetricSpec(
    "hybridmon_gpu_pcie_link_max_generation",
    "Highest PCIe generation the GPU and its slot support, nvmlDeviceGetMaxPcieLinkGeneration.",
    "gauge", GPU)
PCIE_LINK_WIDTH = MetricSpec(
    "hybridmon_gpu_pcie_link_width_lanes",
    "PCIe lanes the link runs at now, nvmlDeviceGetCurrPcieLinkWidth.", "gauge", GPU)
PCIE_LINK_MAX_WIDTH = MetricSpec(
    "hybridmon_gpu_pcie_link_max_width_lanes",
    "Widest PCIe link the GPU and its slot support (lanes), nvmlDeviceGetMaxPcieLinkWidth.",
    "gauge", GPU)
PCIE_REPLAYS = MetricSpec(
    "hybridmon_gpu_pcie_replays_total",
    "PCIe packets the GPU had to resend since the driver loaded, nvmlDeviceGetPcieReplayCounter; "
    "a rising count means a marginal link.", "counter", GPU)
UTILIZATION = MetricSpec(
    "hybridmon_gpu_utilization_ratio",
    "Share of the last sample period (1/6 s to 1 s) in which a kernel ran (0-1), "
    "nvmlDeviceGetUtilizationRates `gpu` percent / 100.", "gauge", GPU)
NUMA_NODE = MetricSpec(
    "hybridmon_gpu_numa_node",
    "The NUMA node that is the GPU's own memory, nvmlDeviceGetNumaNodeId: only on platforms where "
    "GPU memory is a NUMA node (Grace Hopper, Grace Blackwell; nvml.h: \"only applies to platforms "
    "where the GPUs are NUMA nodes\"), absent elsewhere (NOT_SUPPORTED on x86 PCIe hosts). Not the "
    "node nearest the GPU: that is hybridmon_pcie_device_numa_node of its PCI address.",
    "gauge", GPU)
MIG_MODE = MetricSpec(
    "hybridmon_gpu_mig_mode",
    "1 when MIG is enabled on the GPU, 0 when disabled (nvmlDeviceGetMigMode current mode); "
    "absent on GPUs without MIG. With MIG on, utilization is per instance and not exported; "
    "PCIe traffic and memory are the whole GPU's; per-process memory is read as root only.",
    "gauge", GPU)
PROCESS_MEMORY_USED = MetricSpec(
    "hybridmon_gpu_process_memory_used_bytes",
    "GPU memory a process uses on the GPU (bytes), usedGpuMemory from NVML's compute, graphics "
    "(OpenGL/Vulkan) and MPS compute process lists, a process in several lists counted once and "
    "summed over MIG instances; process_name the comm of /proc/<pid>/comm, as on every process "
    "series, else nvmlSystemGetProcessName (the pid when unknown); absent when NVML cannot tell "
    "(e.g. in some containers). With MIG on, the instances' processes come from the parent GPU's "
    "lists (each entry carries its gpuInstanceId), which NVML gives to root only: absent when the "
    "agent is not root.", "gauge",
    ("gpu", "uuid", "pid", "process_name"))

INSTANCE_PROCESS_MEMORY_USED = MetricSpec(
    "hybridmon_gpu_instance_process_memory_used_bytes",
    "GPU memory a process uses in one MIG GPU instance (bytes): usedGpuMemory of the parent GPU's "
    "process lists, whose entries carry the instance (gpuInstanceId, nvmlProcessInfo_v2_t); NVML "
    "gives them to root only, so absent when the agent is not root, and on GPUs without MIG. "
    "hybridmon_gpu_process_memory_used_bytes has the same processes summed per GPU.",
    "gauge", ("gpu", "uuid", "gpu_instance", "pid", "process_name"))

# NVLink-C2C (GH200, GB200: offloaded KV and weights cross C2C, not PCIe; issue 29). Defined here
# for the collector and the judgement alike; the collector emits them where NVML answers.
C2C_MODE = MetricSpec(
    "hybridmon_gpu_c2c_mode_enabled",
    "1 when the GPU's NVLink-C2C link to the CPU is enabled (nvmlDeviceGetC2cModeInfoV "
    "isC2cEnabled), 0 when not; absent where NVML does not answer (no C2C, older driver or "
    "binding). With C2C on, host<->device copies cross C2C and the PCIe counters stay near 0.",
    "gauge", GPU)
C2C_LINKS = MetricSpec(
    "hybridmon_gpu_c2c_link_count",
    "NVLink-C2C links of the GPU (nvmlDeviceGetFieldValues NVML_FI_DEV_C2C_LINK_COUNT, field 170).",
    "gauge", GPU)
C2C_LINK_UP = MetricSpec(
    "hybridmon_gpu_c2c_link_up",
    "1 when the NVLink-C2C link is up, 0 when down (NVML_FI_DEV_C2C_LINK_GET_STATUS, field 171, "
    "per link).",
    "gauge", ("gpu", "uuid", "link"))
C2C_LINK_MAX_BANDWIDTH = MetricSpec(
    "hybridmon_gpu_c2c_link_max_bytes_per_second",
    "The NVLink-C2C link's maximum bandwidth in bytes/s (NVML_FI_DEV_C2C_LINK_GET_MAX_BW, field "
    "172, per link), what NVML states, not what copies achieve.",
    "gauge", ("gpu", "uuid", "link"))
C2C_THROUGHPUT = MetricSpec(
    "hybridmon_gpu_c2c_throughput_bytes_per_second",
    "NVLink-C2C traffic in bytes/s between the collector's two latest GPM samples "
    "(NVML_GPM_METRIC_C2C_TOTAL_RX_PER_SEC: direction host_to_device, the GPU receives; "
    "_TX_PER_SEC: device_to_host; MiB/s x 2^20); absent where GPM cannot be read.",
    "gauge", ("gpu", "uuid", "direction"))

PCIE_TRAFFIC_METHOD = MetricSpec(
    "hybridmon_gpu_pcie_traffic_method",
    "How the GPU's PCIe traffic is read, value 1 on its one method: counters (the byte counters "
    "of nvmlDeviceGetFieldValues, exact), gpm (GPM PCIe metrics between two samples, Hopper and "
    "later, exact; where the counters are missing or keep failing) or sampled (20 ms "
    "nvmlDeviceGetPcieThroughput windows, with the error bound of docs/nvml-cost.md).",
    "gauge", ("gpu", "uuid", "method"))

METRIC_SPECS = (GPU_INFO, GPU_UP, DOWN_READINGS, DOWN_BLIPS, MEMORY_USED, MEMORY_TOTAL,
                MEMORY_RESERVED, PCIE_THROUGHPUT,
                PCIE_BYTES, PCIE_SAMPLED_BYTES, PCIE_TRAFFIC_METHOD, PCIE_LINK_GENERATION,
                PCIE_LINK_MAX_GENERATION, PCIE_LINK_WIDTH,
                PCIE_LINK_MAX_WIDTH, PCIE_REPLAYS, UTILIZATION, NUMA_NODE, MIG_MODE,
                PROCESS_MEMORY_USED, INSTANCE_PROCESS_MEMORY_USED, C2C_MODE, C2C_LINKS, C2C_LINK_UP, C2C_LINK_MAX_BANDWIDTH,
                C2C_THROUGHPUT)
# Asked together in one GPM sample pair a tick, whichever of PCIe and C2C needs it: a metric more in
# the same nvmlGpmMetricsGet costs nothing, a second sample pair would.
GPM_METRIC_IDS = (NVML_GPM_METRIC_PCIE_RX_PER_SEC, NVML_GPM_METRIC_PCIE_TX_PER_SEC,
                  NVML_GPM_METRIC_C2C_TOTAL_RX_PER_SEC, NVML_GPM_METRIC_C2C_TOTAL_TX_PER_SEC)
C2C_GPM_IDS = GPM_METRIC_IDS[2:]  # in DIRECTIONS order: RX (the GPU receives), TX


DEFAULT_READ_BUDGET_SECONDS = 0.8
"""How long a collection waits for the GPUs' reads, within the 1 s tick. A GPU's read is a dozen
non-blocking NVML calls (about a millisecond) plus, without counters, GPM or samples, two 20 ms
windows: 0.8 s is twenty times the slowest normal read, so a host loaded enough to starve the
agent's threads for a while (the test suite on 2 busy cores took over 0.5 s) is not read as a hung
GPU, and the collection still ends within its tick."""
SLOW_READS_EVERY = 5
"""A GPU's process lists (compute, graphics, MPS), its current link generation and width and its
replay counter are asked at its first read, every 5th after it (5 s at the default 1 s) and at any
read where the GPU's used memory is not what it was when they were last asked; the last answers
are given in between. Six of a read's nine NVML calls: what judges the link and the counter looks
at minutes (PcieLinkDegraded's 300 s `for`, PcieErrors' 5 min), and the lists change only when a
process starts, exits or allocates, each of which moves the used memory (NVML counts each
process's CUDA context and allocations in it), so the lists given add up against the memory read
with them: who holds the GPU is not a read behind a restart. A change that leaves the total
unchanged (one process freeing exactly what another allocates between two reads) waits for the
5th read. Memory, utilization and PCIe traffic, which the alerts pair second by second, are
read every time. Counted in reads, not seconds, so a replay asks on the recording's ticks (issue
33: the GPU read pool was a fifth of the daemon's CPU on the 8-GPU host)."""


@dataclass
class GpuReading:
    """One GPU in one tick; None fields are unsupported or failed this time."""

    index: int
    uuid: str | None
    lost: bool = False
    answered: bool = True  # at least one NVML call on it succeeded this tick
    late: bool = False  # its read ran past the budget this tick: no series (GpuCollector._read_all)
    values: dict[MetricSpec, Any] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)
    traffic: TrafficReading = field(default_factory=TrafficReading)
    processes: list[GpuProcess] = field(default_factory=list)
    c2c_links: list[C2cLink] = field(default_factory=list)
    c2c_bytes_per_second: tuple[float, float] | None = None  # DIRECTIONS order


@dataclass
class _SlowAnswers:
    """What one GPU answered at its last slow read (SLOW_READS_EVERY), and the reads since."""

    uuid: str
    memory_used: int | None   # the GPU's used memory read with them
    values: dict[MetricSpec, Any]
    processes: list[GpuProcess]
    reads_since: int = 0


class GpuCollector:
    name = "gpu"
    default_interval_seconds = 1.0
    metric_specs = METRIC_SPECS

    def __init__(self, source: RawSource, nvml_module: str | Any | None = "pynvml",
                 max_workers: int = 8, clock: Callable[[], float] = time.monotonic,
                 pcie_samples_per_second: float = 0.0, procfs: str | None = None,
                 read_budget_seconds: float = DEFAULT_READ_BUDGET_SECONDS) -> None:
        """pcie_samples_per_second: background samples of GPUs without PCIe byte counters (the
        agent's [gpu] setting defaults to 10); 0 reads one 20 ms window per tick instead.
        procfs: where each GPU process's comm is read, so that its process_name is the one the
        process collector gives the same pid; None labels with NVML's name only."""
        self._nvml = Nvml(source, nvml_module, clock=clock)
        self._source, self._procfs = source, procfs
        self._pid_view: PidView | None = None
        # The sampler threads' own gate on the same library: their samples are not recorded.
        sampler_nvml = (Nvml(LiveSource(), nvml_module, clock=clock)
                        if nvml_module is not None and pcie_samples_per_second > 0 else None)
        self._traffic = PcieTraffic(self._nvml, source, sampler_nvml, pcie_samples_per_second,
                                    replaying=nvml_module is None)
        self._replaying = nvml_module is None
        self._read_budget_seconds = read_budget_seconds
        self._reading_now: set[int] = set()  # GPUs whose read is in progress (guarded by _pool_lock)
        self._late_before: set[int] = set()  # GPUs late at the previous collection
        self._late_now: set[int] = set()
        self._max_workers = max(1, max_workers)
        self._pool: DaemonPool | None = None
        self._pool_lock = threading.Lock()
        self._log_once = LogOnce(log)
        self._processes: dict[int, str] = {}
        self._process_buses: dict[int, tuple[str, ...]] = {}
        self._names_read_elsewhere: Callable[[], Mapping[int, str]] | None = None
        # The GPUs whose next PCIe traffic read takes byte counters, GPM or a sampler's samples,
        # not a 20 ms window: none of them waits, so they are read one after the other in one task
        # (handing eight short reads to the pool one each cost more CPU than the reads: 0.8 ms a
        # tick of 2.5 on the 8-GPU host with the fake NVML, issue 17).
        self._unhurried: set[int] = set()
        # Per GPU index: collections in a row it has been down, and its down readings that did
        # not hold (down at one collection, up at the next).
        self._down_streak: dict[int, int] = {}
        self._down_blips: dict[int, int] = {}
        # Per GPU index: its slow answers (SLOW_READS_EVERY). One read of a GPU runs at a time.
        self._slow: dict[int, _SlowAnswers] = {}

    def share_process_names(self, read: Callable[[], Mapping[int, str]]) -> None:
        """`read` gives pid -> comm of the processes another collector read at its last run (the
        process collector, from the /proc/<pid>/stat it reads every tick for the same pids): a
        GPU process found there is not read again from /proc/<pid>/comm."""
        self._names_read_elsewhere = read

    def gpu_processes(self) -> dict[int, str]:
        """pid -> name of each process NVML listed (compute, graphics or MPS) on any GPU at the
        last successful collect()."""
        return dict(self._processes)

    def gpu_buses_of_processes(self) -> dict[int, tuple[str, ...]]:
        """pid -> the PCI bus ids (sysfs form, as on gpu_info) of the GPUs NVML listed it on at the
        last successful collect(): where its GPUs sit, for process_numa's placement against each
        GPU's NUMA node. GPUs late or without a bus id that tick are left out."""
        return dict(self._process_buses)

    def collect(self) -> Samples:
        nvml = self._nvml
        count = nvml.device_count()  # initialises NVML; NoDataError without a driver
        if count == 0:
            raise NoDataError("NVML found no NVIDIA GPU on this host: GPU metrics are absent")
        driver_version = nvml.driver_version() or ""
        # Decided here, before the concurrent reads, so probe order does not depend on threads.
        nvml.memory_info_version()
        self._late_now = set()
        readings = self._read_all(count)
        self._late_before = self._late_now
        # Names resolved here rather than per GPU thread: a pid on two GPUs is looked up once.
        names = self._process_names(p.pid for r in readings for p in r.processes)
        self._processes = names
        self._process_buses = _buses_by_process(readings)
        samples = Samples()
        for reading in readings:
            if reading.late:
                continue  # not a reading: no series, its down count unchanged
            self._count_down(reading)
            self._add(samples, reading, driver_version, names)
        return samples

    def _count_down(self, reading: GpuReading) -> None:
        """Update the GPU's run of down collections; a run of one that ends is a blip."""
        index, before = reading.index, self._down_streak.get(reading.index, 0)
        if reading.answered and not reading.lost:
            if before == 1:
                self._down_blips[index] = self._down_blips.get(index, 0) + 1
                log.warning("GPU %d was down for one collection only (NVML answered lost, or "
                            "nothing) and answers again: a reading that did not hold, not paged "
                            "as GpuLost; counted in %s", index, DOWN_BLIPS.name)
            self._down_streak[index] = 0
        else:
            self._down_streak[index] = before + 1

    def _process_names(self, pids: Iterable[int]) -> dict[int, str]:
        """pid -> the comm of /proc/<pid>/comm, the name every process series and alert carries;
        NVML's name (often the interpreter's path, e.g. /usr/bin/python3) where comm cannot be
        read: a pid gone, or NVML's host pids seen from a container's pid namespace (or a nested
        container's)."""
        names = self._nvml.process_names(pids)
        if self._procfs is None or not names:
            return names
        if self._pid_view is None:
            self._pid_view = pid_view(self._source, self._procfs)
        if self._pid_view in (PidView.CONTAINER, PidView.NESTED):
            return names   # NVML's host pids name other processes here, or none
        known = self._names_known_elsewhere()
        for pid in names:
            comm = known.get(pid)
            if comm is None:
                try:
                    comm = self._source.read_text(os.path.join(self._procfs, str(pid), "comm")).rstrip("\n")
                except (OSError, TraceMissError):  # gone, or a trace recorded before comm was read
                    continue
            if comm:
                names[pid] = comm
        return names

    def _names_known_elsewhere(self) -> dict[int, str]:
        """share_process_names' answer, through this collector's source so that a replay sees
        what the recording saw ({} from a trace recorded before the names were shared). At most
        a tick old: a process renamed since keeps its old name here for that tick."""
        read = self._names_read_elsewhere
        if read is None:
            return {}
        try:
            recorded = self._source.call("agent.watched_processes",
                                         lambda: {str(pid): name for pid, name in read().items()})
        except Exception as error:  # TraceMissError, or the other collector failing
            log.debug("no process names shared with the GPU collector: %s", error)
            return {}
        return {int(pid): name for pid, name in recorded.items()}

    def _read_all(self, count: int) -> list[GpuReading]:
        """Every GPU's reading, each GPU's read (or the batch of unhurried ones) a task of the pool,
        waited for at most read_budget_seconds: a GPU whose read is not done by then is late, and
        not read again until that read returns, so one GPU whose NVML call blocks leaves the
        others' readings on time. A late GPU has no series in that collection (a read slowed by a
        loaded host is not a GPU down); one whose read is still in progress at the next
        collection, over a tick later, is hung and reported down (nothing answered in it).

        Which GPUs were late is a reading of its own ("gpu.late"), so a replay leaves out the same
        GPUs without waiting: their calls made after the deadline are not in this collection's
        readings (a late read's calls finishing during a later collection are recorded there)."""
        if self._replaying:
            try:
                late = set(self._source.call("gpu.late", list))
            except TraceMissError:  # recorded before late GPUs were recorded: none were
                late = set()
            return [self._late_reading(index, late) if index in late else self._read_gpu(index)
                    for index in range(count)]
        groups = self._groups(count)
        finished: dict[int, GpuReading] = {}
        failures: list[BaseException] = []
        stop = threading.Event()
        pool = self._pool_for(count)
        tasks = [pool.submit(self._read_group, group, finished, failures, stop) for group in groups]
        deadline = time.monotonic() + self._read_budget_seconds
        for done in tasks:
            done.wait(max(0.0, deadline - time.monotonic()))
        stop.set()  # a batch still running stops after the GPU it is reading
        if failures:
            raise failures[0]  # not an NVML answer (the collector's own error): the run fails
        readings = dict(finished)
        late = sorted(set(range(count)) - readings.keys())
        self._source.call("gpu.late", lambda: late)
        for index in late:
            self._log_once(f"late:{index}", "GPU %d: its NVML reads took longer than %g s "
                           "(read budget): its series are absent from this collection, and it is "
                           "reported down while that read is still in progress at the next; the "
                           "other GPUs are read on time", index, self._read_budget_seconds)
            readings[index] = self._late_reading(index, late)
        ordered = [readings[index] for index in range(count)]
        # Read from counters, GPM or samples this tick (or counters that had no interval yet): the
        # next read likely is too, and none waits on a window, so they are read one after the
        # other in one task (issue 17: handing eight short reads to the pool cost more CPU than
        # the reads). A sampler that had no sample this tick (just started, or a tick shorter than
        # its slot) falls back to a window: those keep a task each.
        self._unhurried = {reading.index for reading in ordered if reading.answered and not reading.lost and (
            reading.traffic.method in ("counters", "gpm", "samples")
            or reading.traffic.counted_bytes is not None)}
        return ordered

    def _groups(self, count: int) -> list[list[int]]:
        """The tasks of this collection: one per GPU that may wait on a window, one for all the
        unhurried ones; a GPU whose earlier read is still in progress is in none."""
        with self._pool_lock:
            busy = set(self._reading_now)
        wanted = [index for index in range(count) if index not in busy]
        groups = [[index] for index in wanted if index not in self._unhurried]
        batch = [index for index in wanted if index in self._unhurried]
        return groups + ([batch] if batch else [])

    def _read_group(self, group: list[int], finished: dict[int, GpuReading],
                    failures: list[BaseException], stop: threading.Event) -> None:
        for index in group:
            if stop.is_set():
                return
            with self._pool_lock:
                self._reading_now.add(index)
            try:
                finished[index] = self._read_gpu(index)
            except Exception as error:
                failures.append(error)
                return
            finally:
                with self._pool_lock:
                    self._reading_now.discard(index)

    def _late_reading(self, index: int, late: Iterable[int]) -> GpuReading:
        """A late GPU's reading: late (no series) the first collection, down from the second in a
        row, under the UUID its read got (now or earlier), if any. `late`: this collection's late
        GPUs, kept to tell the next collection which were late before."""
        if self._replaying and self._nvml.known_uuid(index) is None:
            try:  # the late read's first call, the UUID, may have answered before the deadline
                self._nvml.uuid(index)
            except (TraceMissError, GpuLostError):
                pass
        hung = index in self._late_before
        self._late_now = set(late)
        return GpuReading(index, self._nvml.known_uuid(index), answered=False, late=not hung)

    def _pool_for(self, count: int) -> DaemonPool:
        with self._pool_lock:
            if self._pool is None:
                # One worker per GPU: a late GPU holds one and is not given another task.
                self._pool = DaemonPool(min(self._max_workers, count), "hybridmon-gpu")
            return self._pool

    def _read_gpu(self, index: int) -> GpuReading:
        nvml = self._nvml
        answers_before = nvml.answer_count(index)
        try:
            uuid = nvml.uuid(index)
            if uuid is None:
                self._log_once(f"uuid:{index}", "GPU %d: no UUID from NVML; skipping it until "
                               "it answers", index)
                return GpuReading(index, None)
            reading = GpuReading(index, uuid)
            reading.info = {"name": nvml.name(index) or "",
                            "pci_bus_id": nvml.pci_bus_id(index) or ""}
            memory = nvml.memory_bytes(index)
            if memory is not None:
                reading.values.update({MEMORY_USED: memory[0], MEMORY_TOTAL: memory[1],
                                       MEMORY_RESERVED: memory[2]})
            gpm = _OnceThisTick(lambda: nvml.gpm_metrics(index, GPM_METRIC_IDS))
            reading.traffic = self._traffic.read(index, gpm)
            self._read_c2c(reading, gpm)
            reading.values.update({
                PCIE_LINK_MAX_GENERATION: nvml.pcie_link_max_generation(index),
                PCIE_LINK_MAX_WIDTH: nvml.pcie_link_max_width_lanes(index),
                NUMA_NODE: nvml.numa_node(index),
            })
            mig = nvml.mig_enabled(index)
            if mig is not None:
                reading.values[MIG_MODE] = 1 if mig else 0
            if mig:
                # With MIG on the parent handle refuses utilization (nvml.h: NOT_SUPPORTED).
                self._log_once(f"mig:{index}", "GPU %d has MIG enabled: utilization is per "
                               "instance and not read; PCIe traffic and memory are the whole GPU's",
                               index)
            else:
                reading.values[UTILIZATION] = nvml.utilization_ratio(index)
            slow = self._slow_answers(index, uuid, bool(mig), None if memory is None else memory[0])
            # Cached identity still fills the reading when the driver has gone; only answers count.
            reading.answered = nvml.answer_count(index) > answers_before
            if not reading.answered:   # down: nothing it said before stands for now
                self._slow.pop(index, None)
                return reading
            reading.values.update(slow.values)
            reading.processes = slow.processes
            return reading
        except GpuLostError:
            self._slow.pop(index, None)
            return GpuReading(index, nvml.known_uuid(index) or "", lost=True)

    def _slow_answers(self, index: int, uuid: str, mig: bool, memory_used: int | None) -> _SlowAnswers:
        """The GPU's SLOW_READS_EVERY answers: asked again at its first read, every 5th after, when
        its used memory moved or is unknown, and when it has another UUID (replaced or reset)."""
        slow = self._slow.get(index)
        if (slow is None or slow.uuid != uuid or slow.reads_since >= SLOW_READS_EVERY
                or memory_used is None or memory_used != slow.memory_used):
            nvml = self._nvml
            values = {PCIE_LINK_GENERATION: nvml.pcie_link_generation(index),
                      PCIE_LINK_WIDTH: nvml.pcie_link_width_lanes(index),
                      PCIE_REPLAYS: nvml.pcie_replay_count(index)}
            listed = nvml.processes(index)
            if mig and listed is None:
                # With MIG on the parent handle lists the instances' processes, each with its
                # gpuInstanceId, only to a privileged caller (root; NO_PERMISSION otherwise).
                self._log_once(f"mig-processes:{index}", "GPU %d has MIG enabled and NVML "
                               "lists its instances' processes only to root: their GPU "
                               "memory is not exported; run the agent as root to see it", index)
            slow = self._slow[index] = _SlowAnswers(uuid, memory_used, values, listed or [])
        slow.reads_since += 1
        return slow

    def _read_c2c(self, reading: GpuReading, gpm: Callable[[], dict[int, float] | None]) -> None:
        """The NVLink-C2C mode, links and traffic, where NVML answers them (absent elsewhere)."""
        nvml, index = self._nvml, reading.index
        enabled = nvml.c2c_mode_enabled(index)
        if enabled is None:
            return
        reading.values[C2C_MODE] = 1 if enabled else 0
        if not enabled:
            return
        reading.c2c_links = nvml.c2c_links(index) or []
        if not nvml.gpm_supported(index):
            self._log_once(f"c2c-traffic:{index}", "GPU %d has NVLink-C2C enabled but no GPM "
                           "metrics (nvmlGpmQueryDeviceSupport): host<->device copies cross C2C, "
                           "not PCIe, and their traffic cannot be read; %s is absent", index,
                           C2C_THROUGHPUT.name)
            return
        metrics = gpm() or {}
        if all(metric in metrics for metric in C2C_GPM_IDS):
            reading.c2c_bytes_per_second = tuple(metrics[metric] * MIB for metric in C2C_GPM_IDS)

    def _add(self, samples: Samples, reading: GpuReading, driver_version: str,
             names: dict[int, str]) -> None:
        if reading.uuid is None:
            return
        gpu, uuid = str(reading.index), reading.uuid
        up = reading.answered and not reading.lost
        samples.add(GPU_UP, 1 if up else 0, gpu, uuid)
        samples.add(DOWN_READINGS, self._down_streak[reading.index], gpu, uuid)
        samples.add(DOWN_BLIPS, self._down_blips.get(reading.index, 0), gpu, uuid)
        if not up:
            return
        samples.add(GPU_INFO, 1, gpu, uuid, reading.info["name"], reading.info["pci_bus_id"],
                    driver_version)
        samples.add_many(reading.values.items(), gpu, uuid)
        traffic = reading.traffic
        for index, direction in enumerate(DIRECTIONS):
            samples.add(PCIE_THROUGHPUT, traffic.bytes_per_second[index], gpu, uuid, direction)
            if traffic.counted_bytes is not None:
                samples.add(PCIE_BYTES, traffic.counted_bytes[index], gpu, uuid, direction)
            if traffic.sampled_bytes is not None:
                samples.add(PCIE_SAMPLED_BYTES, traffic.sampled_bytes[index], gpu, uuid, direction)
        samples.add(PCIE_TRAFFIC_METHOD, 1, gpu, uuid, traffic.source)
        if reading.c2c_links:
            samples.add(C2C_LINKS, len(reading.c2c_links), gpu, uuid)
        for link in reading.c2c_links:
            if link.up is not None:
                samples.add(C2C_LINK_UP, 1 if link.up else 0, gpu, uuid, link.link)
            if link.max_bytes_per_second is not None:
                samples.add(C2C_LINK_MAX_BANDWIDTH, link.max_bytes_per_second, gpu, uuid, link.link)
        if reading.c2c_bytes_per_second is not None:
            for index, direction in enumerate(DIRECTIONS):
                samples.add(C2C_THROUGHPUT, reading.c2c_bytes_per_second[index], gpu, uuid,
                            direction)
        per_pid: dict[int, int] = {}
        for process in reading.processes:
            if process.used_memory_bytes is not None:
                # One pid can appear once per MIG instance; the series is per GPU.
                per_pid[process.pid] = per_pid.get(process.pid, 0) + process.used_memory_bytes
        for pid, used in sorted(per_pid.items()):
            samples.add(PROCESS_MEMORY_USED, used, gpu, uuid, pid, names.get(pid, str(pid)))
        # processes() keeps one entry per (pid, instance): each is its own series here. Only with
        # MIG on: nvml.h sets gpuInstanceId to 0xFFFFFFFF otherwise, but a driver writing 0 there
        # must not invent an instance.
        mig_on = reading.values.get(MIG_MODE) == 1
        for process in reading.processes if mig_on else ():
            if process.gpu_instance_id is not None and process.used_memory_bytes is not None:
                samples.add(INSTANCE_PROCESS_MEMORY_USED, process.used_memory_bytes, gpu, uuid,
                            process.gpu_instance_id, process.pid,
                            names.get(process.pid, str(process.pid)))

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
            hung = bool(self._reading_now)
        if pool is not None:
            # A late read may never return (NVML stuck on a lost GPU): closing must not wait on it.
            pool.shutdown(wait=not hung)
        self._traffic.close()
        self._nvml.close()


class DaemonPool:
    """A fixed pool of daemon threads running tasks in order. Not ThreadPoolExecutor: Python joins
    its threads at exit, so one stuck in an NVML call that never returns would keep the agent
    from exiting on SIGTERM."""

    def __init__(self, workers: int, name: str) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, daemon=True, name=f"{name}-{i}")
                         for i in range(workers)]
        self.shut_down = False
        for thread in self._threads:
            thread.start()

    def submit(self, task: Callable[..., Any], *args: Any) -> threading.Event:
        """Queue task(*args); the event is set when it has run (its errors are the task's to keep)."""
        done = threading.Event()
        self._tasks.put((task, args, done))
        return done

    def _work(self) -> None:
        while (item := self._tasks.get()) is not None:
            task, args, done = item
            try:
                task(*args)
            except Exception:  # a task keeps its own errors; this only keeps the worker alive
                log.exception("GPU read task failed")
            finally:
                done.set()

    def shutdown(self, wait: bool = True) -> None:
        self.shut_down = True
        for _ in self._threads:
            self._tasks.put(None)
        if wait:
            for thread in self._threads:
                thread.join()


class _OnceThisTick:
    """A reading made on first use and kept for the rest of one GPU's read (the GPM sample pair
    PCIe and C2C share: a second call would measure a near-empty interval)."""

    def __init__(self, read: Callable[[], Any]) -> None:
        self._read, self._done, self._value = read, False, None

    def __call__(self) -> Any:
        if not self._done:
            self._value, self._done = self._read(), True
        return self._value


class GpuSettings(CollectorSettings):
    """[gpu]: which NVML binding to load and how many GPUs to read at once."""

    nvml_module: str = Field(
        default="pynvml", description="Python module providing NVML; tests point it at a fake"
    )
    max_workers: int = Field(default=8, ge=1, le=64)
    read_budget_seconds: float = Field(
        default=DEFAULT_READ_BUDGET_SECONDS, gt=0, le=10,
        description="How long a collection waits for each GPU's NVML reads; a GPU not read by "
                    "then is reported down for that collection and the others are on time")
    pcie_samples_per_second: float = Field(
        default=DEFAULT_SAMPLES_PER_SECOND, ge=0, le=MAX_SAMPLES_PER_SECOND,
        description="PCIe throughput samples a second per GPU without PCIe byte counters while "
                    "its traffic is near the starvation threshold, down to 1 a second far below it "
                    "(each blocks a sampler thread 40 ms); 0: one 20 ms window per tick. Sets the "
                    "error bound of the traffic reading (docs/nvml-cost.md)")


def _buses_by_process(readings: Iterable[GpuReading]) -> dict[int, tuple[str, ...]]:
    buses: dict[int, set[str]] = {}
    for reading in readings:
        bus_id = reading.info.get("pci_bus_id")
        if bus_id and not reading.late:
            for process in reading.processes:
                buses.setdefault(process.pid, set()).add(bus_id)
    return {pid: tuple(sorted(found)) for pid, found in sorted(buses.items())}


def _gpu_collector(context: CollectorContext) -> GpuCollector:
    settings: GpuSettings = context.settings
    # In a replay NVML is not loaded: the trace answers.
    return GpuCollector(context.source, nvml_module=None if context.replay else settings.nvml_module,
                        max_workers=settings.max_workers,
                        pcie_samples_per_second=settings.pcie_samples_per_second,
                        procfs=context.procfs, read_budget_seconds=settings.read_budget_seconds)


REGISTRATION = CollectorRegistration(GpuCollector, _gpu_collector, settings=GpuSettings)
