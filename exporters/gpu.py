"""NVIDIA GPUs through NVML: identity, memory, PCIe link and traffic, utilization, processes.

All NVML access goes through exporters/nvml.py. GPUs are read concurrently, one task per GPU:
where a GPU lacks PCIe byte counters, nvmlDeviceGetPcieThroughput samples a 20 ms window per
direction and blocks meanwhile, so such a GPU's first tick costs ~40 ms and eight read one after
the other ~320 ms; later ticks take the samples a sampler thread took meanwhile
(exporters/pcie_traffic.py, docs/nvml-cost.md). Once no GPU's last read waited on a window (byte
counters or samplers), they are read one after the other: nothing then waits long enough for
the pool to pay for itself (GpuCollector._unhurried).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from pydantic import Field

from hybridmon.exporters.sources import RawSource
from hybridmon.exporters.base import (CollectorContext, CollectorRegistration, CollectorSettings, LogOnce,
                                      MetricSpec, NoDataError, Samples)
from hybridmon.exporters.nvml import GpuLostError, GpuProcess, Nvml
from hybridmon.exporters.pcie_traffic import (DEFAULT_SAMPLES_PER_SECOND, DIRECTIONS,
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
    "over NVML's time between them where the GPU has them, else the mean of the 20 ms "
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
    "at random moments, pcie_samples_per_second a second). rate() over 1 min has a standard "
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
    "absent on GPUs without MIG. With MIG on, utilization and per-process memory are per "
    "instance and not exported; PCIe traffic and memory are the whole GPU's.",
    "gauge", GPU)
PROCESS_MEMORY_USED = MetricSpec(
    "hybridmon_gpu_process_memory_used_bytes",
    "GPU memory a process uses on the GPU (bytes), usedGpuMemory from NVML's compute, graphics "
    "(OpenGL/Vulkan) and MPS compute process lists, a process in several lists counted once and "
    "summed over MIG instances; process_name the comm of /proc/<pid>/comm, as on every process "
    "series, else nvmlSystemGetProcessName (the pid when unknown); absent when NVML cannot tell (e.g. in some containers) and with MIG on.", "gauge",
    ("gpu", "uuid", "pid", "process_name"))

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

METRIC_SPECS = (GPU_INFO, GPU_UP, DOWN_READINGS, DOWN_BLIPS, MEMORY_USED, MEMORY_TOTAL,
                MEMORY_RESERVED, PCIE_THROUGHPUT,
                PCIE_BYTES, PCIE_SAMPLED_BYTES, PCIE_LINK_GENERATION, PCIE_LINK_MAX_GENERATION, PCIE_LINK_WIDTH,
                PCIE_LINK_MAX_WIDTH, PCIE_REPLAYS, UTILIZATION, NUMA_NODE, MIG_MODE,
                PROCESS_MEMORY_USED, C2C_MODE, C2C_LINKS, C2C_LINK_UP, C2C_LINK_MAX_BANDWIDTH, C2C_THROUGHPUT)


@dataclass
class GpuReading:
    """One GPU in one tick; None fields are unsupported or failed this time."""

    index: int
    uuid: str | None
    lost: bool = False
    answered: bool = True  # at least one NVML call on it succeeded this tick
    values: dict[MetricSpec, Any] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)
    traffic: TrafficReading = field(default_factory=TrafficReading)
    processes: list[GpuProcess] = field(default_factory=list)


class GpuCollector:
    name = "gpu"
    default_interval_seconds = 1.0
    metric_specs = METRIC_SPECS

    def __init__(self, source: RawSource, nvml_module: str | Any | None = "pynvml",
                 max_workers: int = 8, clock: Callable[[], float] = time.monotonic,
                 pcie_samples_per_second: float = 0.0, procfs: str | None = None) -> None:
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
        self._max_workers = max(1, max_workers)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._log_once = LogOnce(log)
        self._processes: dict[int, str] = {}
        self._names_read_elsewhere: Callable[[], Mapping[int, str]] | None = None
        # The GPUs whose next PCIe traffic read takes byte counters or a sampler's samples, not a
        # 20 ms window. When that is every GPU, none waits and they are read one after the other:
        # handing eight short reads to the pool cost more CPU than the reads (0.8 ms a tick of 2.5
        # on the 8-GPU host with the fake NVML, issue 17).
        self._unhurried: set[int] = set()
        # Per GPU index: collections in a row it has been down, and its down readings that did
        # not hold (down at one collection, up at the next).
        self._down_streak: dict[int, int] = {}
        self._down_blips: dict[int, int] = {}

    def share_process_names(self, read: Callable[[], Mapping[int, str]]) -> None:
        """`read` gives pid -> comm of the processes another collector read at its last run (the
        process collector, from the /proc/<pid>/stat it reads every tick for the same pids): a
        GPU process found there is not read again from /proc/<pid>/comm."""
        self._names_read_elsewhere = read

    def gpu_processes(self) -> dict[int, str]:
        """pid -> name of each process NVML listed (compute, graphics or MPS) on any GPU at the
        last successful collect()."""
        return dict(self._processes)

    def collect(self) -> Samples:
        nvml = self._nvml
        count = nvml.device_count()  # initialises NVML; NoDataError without a driver
        if count == 0:
            raise NoDataError("NVML found no NVIDIA GPU on this host: GPU metrics are absent")
        driver_version = nvml.driver_version() or ""
        # Decided here, before the concurrent reads, so probe order does not depend on threads.
        nvml.memory_info_version()
        readings = self._read_all(count)
        # Names resolved here rather than per GPU thread: a pid on two GPUs is looked up once.
        names = self._process_names(p.pid for r in readings for p in r.processes)
        self._processes = names
        samples = Samples()
        for reading in readings:
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
        read: a pid gone, or NVML's host pids seen from a container's pid namespace."""
        names = self._nvml.process_names(pids)
        if self._procfs is None or not names:
            return names
        if self._pid_view is None:
            self._pid_view = pid_view(self._source, self._procfs)
        if self._pid_view is PidView.CONTAINER:
            return names
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
        unhurried, self._unhurried = self._unhurried, set()
        if count == 1 or unhurried.issuperset(range(count)):
            readings = [self._read_gpu(index) for index in range(count)]
        else:
            readings = self._read_concurrently(count)
        # Read from counters or samples this tick (or counters that had no interval yet): the next
        # read likely is too. A sampler that had no sample this tick (just started, or a tick
        # shorter than its slot) falls back to a window: those stay on the pool.
        self._unhurried = {reading.index for reading in readings if not reading.lost and (
            reading.traffic.method in ("counters", "samples") or reading.traffic.counted_bytes is not None)}
        return readings

    def _read_concurrently(self, count: int) -> list[GpuReading]:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(min(self._max_workers, count),
                                                thread_name_prefix="hybridmon-gpu")
            pool = self._pool
        return list(pool.map(self._read_gpu, range(count)))

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
            reading.traffic = self._traffic.read(index)
            reading.values.update({
                PCIE_LINK_GENERATION: nvml.pcie_link_generation(index),
                PCIE_LINK_MAX_GENERATION: nvml.pcie_link_max_generation(index),
                PCIE_LINK_WIDTH: nvml.pcie_link_width_lanes(index),
                PCIE_LINK_MAX_WIDTH: nvml.pcie_link_max_width_lanes(index),
                PCIE_REPLAYS: nvml.pcie_replay_count(index),
                NUMA_NODE: nvml.numa_node(index),
            })
            mig = nvml.mig_enabled(index)
            if mig is not None:
                reading.values[MIG_MODE] = 1 if mig else 0
            if mig:
                # The parent handle refuses these with MIG on (nvml.h: utilization NOT_SUPPORTED,
                # processes NO_PERMISSION without privileges); asking would only log failures.
                self._log_once(f"mig:{index}", "GPU %d has MIG enabled: utilization and "
                               "per-process memory are per instance and not read by hybridmon; "
                               "PCIe traffic and memory are the whole GPU's", index)
            else:
                reading.values[UTILIZATION] = nvml.utilization_ratio(index)
                reading.processes = nvml.processes(index) or []
            # Cached identity still fills the reading when the driver has gone; only answers count.
            reading.answered = nvml.answer_count(index) > answers_before
            return reading
        except GpuLostError:
            return GpuReading(index, nvml.known_uuid(index) or "", lost=True)

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
        per_pid: dict[int, int] = {}
        for process in reading.processes:
            if process.used_memory_bytes is not None:
                # One pid can appear once per MIG instance; the series is per GPU.
                per_pid[process.pid] = per_pid.get(process.pid, 0) + process.used_memory_bytes
        for pid, used in sorted(per_pid.items()):
            samples.add(PROCESS_MEMORY_USED, used, gpu, uuid, pid, names.get(pid, str(pid)))

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self._traffic.close()
        self._nvml.close()


class GpuSettings(CollectorSettings):
    """[gpu]: which NVML binding to load and how many GPUs to read at once."""

    nvml_module: str = Field(
        default="pynvml", description="Python module providing NVML; tests point it at a fake"
    )
    max_workers: int = Field(default=8, ge=1, le=64)
    pcie_samples_per_second: float = Field(
        default=DEFAULT_SAMPLES_PER_SECOND, ge=0, le=MAX_SAMPLES_PER_SECOND,
        description="PCIe throughput samples a second per GPU without PCIe byte counters (each "
                    "blocks a sampler thread 40 ms); 0: one 20 ms window per tick. Sets the error "
                    "bound of the traffic reading (docs/nvml-cost.md)")


def _gpu_collector(context: CollectorContext) -> GpuCollector:
    settings: GpuSettings = context.settings
    # In a replay NVML is not loaded: the trace answers.
    return GpuCollector(context.source, nvml_module=None if context.replay else settings.nvml_module,
                        max_workers=settings.max_workers,
                        pcie_samples_per_second=settings.pcie_samples_per_second,
                        procfs=context.procfs)


REGISTRATION = CollectorRegistration(GpuCollector, _gpu_collector, settings=GpuSettings)
