"""The recording rules of the process group: CPU, faults, each process's load from its inference
server, memory slopes and exhaustion, NUMA placement. The alerts that read them are
agent/alerts/memory_growth/__init__.py and numa_misplacement.py.

Slopes are rules.promql.robust_slope (the median of local least-squares slopes), the PromQL
stand-in for the agent's Theil-Sen slope: both agree on steady growth and ignore a single jump.
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridmon.exporters import gpu as gpu_metrics
from hybridmon.exporters import cgroup_memory, host_memory, numa, pcie
from hybridmon.exporters import process as process_metrics
from hybridmon.exporters.inference_names import BY_FIELD
from hybridmon.rules.model import Recording, Thresholds
from hybridmon.rules.promql import (SLOPE_NOTE, duration, indent, number, rate_name, robust_slope)

CPU = f"process:{rate_name(process_metrics.CPU_SECONDS.name)}:rate1m"
FAULTS = "process:hybridmon_process_faults:rate1m"
# Faults per unit of work, as the detector judges them: a fault rate that rises only because the
# load rises is not a trend (the healthy growth-with-load scenario). The work is the generation
# tokens/s of the servers tied to the process where there are any (vLLM V1's engine core keeps one
# core busy whatever the traffic: per CPU second its faults rise with the traffic, issue 28), else
# its CPU seconds per second.
FAULTS_PER_WORK = "process:hybridmon_process_faults_per_work:ratio1m"
GPU_MEMORY = f"process:{gpu_metrics.PROCESS_MEMORY_USED.name}:sum"
# Host memory the kernel will neither reclaim nor swap: mlock()ed (VmLck, mm->locked_vm) plus
# pinned for DMA (VmPin, mm->pinned_vm: RDMA registrations, io_uring fixed buffers). Separate
# counters since Linux 3.1, each checked on its own against RLIMIT_MEMLOCK (so the memlock alert,
# agent/alerts/host_config.py, judges the larger, not this sum); VmPin absent (older kernels)
# counts as 0, as in the detector. A page both mlock()ed and pinned counts twice (mlockall plus
# an RDMA registration of the same buffer): at most VmPin too much.
LOCKED_AND_PINNED_RAW = f"{process_metrics.LOCKED.name.removesuffix('_bytes')}_and_pinned_bytes"
LOCKED_AND_PINNED = f"process:{LOCKED_AND_PINNED_RAW}:sum"
# The load of the inference servers tied to a process (label pid), summed over its servers: where
# there is one, it is the load memory growth is judged against, as the detector does.
SERVER_TOKENS = f"process:{rate_name(BY_FIELD['generated_tokens'].name)}:rate1m"
SERVER_RUNNING = f"process:{BY_FIELD['requests_running'].name}:avg1m"
GPU_NODE = "gpu:hybridmon_gpu_nearest_numa_node:sysfs"
# Where the process's threads ran, not where they may: its CPU time off the GPU's node over
# CPU_TIME_WINDOW. process_numa reads every 30 s, so the window holds four readings and a rate
# survives a missed one.
CPU_TIME_WINDOW_SECONDS = 120.0
CPUS_OFF_NODE = (f"process:{rate_name(process_metrics.CPU_SECONDS.name)}_off_gpu_node"
                 f":ratio_rate{duration(CPU_TIME_WINDOW_SECONDS)}")
# The host's NUMA nodes that have CPUs: an unpinned process's threads spread over these.
CPU_NODES = f"count without (node) ({numa.NODE_CPUS.name} > 0)"
MEMORY_OFF_NODE = f"process:{process_metrics.RESIDENT.name.replace('_bytes', '')}_off_gpu_node:ratio"
PROCESS_ON_GPU_NODE = (
    # value 1 per (process, GPU it holds memory on), labelled with the GPU's NUMA node (gpu_node,
    # as process_numa labels a process's figures off that node)
    f'    count_values without () ("gpu_node", {GPU_NODE})\n'
    "  * on (job, instance, gpu, uuid) group_right (gpu_node)\n"
    f"    max without (process_name) ({gpu_metrics.PROCESS_MEMORY_USED.name} * 0 + 1)"
)


# A process's tree (root_pid of hybridmon_process_info): the pid of its root, the process itself
# when its parent is not watched. A server's listening pid and the processes holding its GPU memory
# (vLLM V1's engine core, tensor-parallel workers) meet at their root.
TREE = ("max without (process_name, executable, server, model, watch_reason) "
        f"({process_metrics.INFO.name})")


def by_root(per_pid: str) -> str:
    """`per_pid` (labels job, instance, pid, ...) with the root_pid label of its process tree; a
    pid the process collector does not watch (no tree info) drops out, as in the detectors."""
    return f"(\n  {per_pid}\n    * on (job, instance, pid) group_left (root_pid) {TREE}\n)"


@dataclass(frozen=True)
class Resource:
    label: str          # the alert's resource label
    what: str           # for the description
    current: str        # the process's amount now: labels job, instance, pid, process_name
    raw: str            # what its recordings are named after: the gauge, or what they sum
    limit: str          # what it exhausts, for the description
    headroom: str       # PromQL: the total it can grow into minus `current`, labels as `current`

    def slope(self, window: str) -> str:
        return f"process:{self.raw}:slope{window}"

    def recent_slope(self, recent: str) -> str:
        return f"process:{self.raw}:recent_slope{recent}"

    def exhaustion(self) -> str:
        return f"process:{self.raw}:exhaustion_seconds"

    def rise_noise(self, window: str) -> str:
        """Recording: rise_noise_z standard errors of its rise, bytes per hour (memory_rise_noise)."""
        return f"process:{self.raw}:rise_noise_per_hour{window}"

    def halves(self, window_seconds: float) -> HalfWindow:
        return HalfWindow(self.current, window_seconds, name=f"process:{self.raw}:")


def resources() -> tuple[Resource, ...]:
    # What bounds a process is not the total but what it can still take: MemAvailable on top of
    # its own resident memory (the kernel's estimate of what can be allocated without swapping,
    # /proc/meminfo), and on its GPUs the memory no one holds (nvmlDeviceGetMemoryInfo v2:
    # free = total - reserved - used; v1's used includes the reserved part). The headroom is
    # that bound less its own use: MemAvailable, or the free memory of its GPUs.
    # A cgroup limit (a container's, a systemd unit's MemoryMax) bounds the process before
    # MemAvailable does when it leaves less room: the headroom is the tighter of the two.
    def host(label: str, what: str, metric: str, raw: str) -> Resource:
        available = f"({host_memory.MEMORY_AVAILABLE.name} + on (job, instance) group_right () ({metric} * 0))"
        cgroup = f"({cgroup_memory.CGROUP_MEMORY_HEADROOM.name} + ({metric} * 0))"
        return Resource(label, what, metric, raw,
                        "the tighter of MemAvailable and its cgroup's memory limit, plus its own use",
                        f"({available} <= {cgroup}) or {cgroup} or {available}")
    process_gpu_memory = gpu_metrics.PROCESS_MEMORY_USED.name
    free = (f"{gpu_metrics.MEMORY_TOTAL.name} - {gpu_metrics.MEMORY_USED.name}"
            f" - ({gpu_metrics.MEMORY_RESERVED.name} or {gpu_metrics.MEMORY_TOTAL.name} * 0)")
    return (
        Resource("gpu_memory", "GPU memory (NVML, summed over its GPUs)", GPU_MEMORY,
                 process_gpu_memory, "the free memory of its GPUs plus its own use",
                 "sum without (gpu, uuid) (\n"
                 f"    ({free})\n"
                 "  * on (job, instance, gpu, uuid) group_right ()\n"
                 f"    ({process_gpu_memory} * 0 + 1)\n"
                 ")"),
        host("resident", "resident host memory (VmRSS)", process_metrics.RESIDENT.name,
             process_metrics.RESIDENT.name),
        host("locked", "locked and pinned host memory (VmLck + VmPin)", LOCKED_AND_PINNED,
             LOCKED_AND_PINNED_RAW),
    )


def load_slope(window: str) -> str:
    return f"process:{rate_name(process_metrics.CPU_SECONDS.name)}:slope{window}_rate1m"


def fault_slope(window: str) -> str:
    return f"process:hybridmon_process_faults_per_work:slope{window}_ratio1m"


def server_slopes(window: str) -> tuple[str, str]:
    return (f"process:{rate_name(BY_FIELD['generated_tokens'].name)}:slope{window}_rate1m",
            f"process:{BY_FIELD['requests_running'].name}:slope{window}_avg1m")


def load_rise(window: str, confident: bool = False) -> str:
    """Recording: how fast the process's load rises, as a share of its mean over the window per
    hour, never below 0 (labels job, instance, pid); `confident`: only the part beyond its noise
    (memory_growth's rise_noise_z standard errors)."""
    what = "confident_load_rise" if confident else "load_rise"
    return f"process:{process_metrics.CPU_SECONDS.name.rsplit('_cpu', 1)[0]}:{what}_per_hour_ratio{window}"


def tied_to_tree(per_listening_pid: str) -> str:
    """A server figure summed by the pid that listens (labels job, instance, pid), handed to every
    watched process of the same tree (root_pid of hybridmon_process_info: vLLM's engine core gets its
    API server's load); a listening pid without a tree keeps it alone, as before trees were read."""
    return (
        "sum by (job, instance, pid) (\n"
        f"    {TREE}\n"
        "  * on (job, instance, root_pid) group_left ()\n"
        "    sum by (job, instance, root_pid) (\n"
        f"        {per_listening_pid}\n"
        "      * on (job, instance, pid) group_left (root_pid)\n"
        f"        {TREE}\n"
        "    )\n"
        ")\n"
        f"or\n{per_listening_pid}"
    )


def half_window_rise(series: str, window_seconds: float, noise_z: float) -> str:
    """PromQL: how fast `series` (a per-minute rate or average) rose over the window, as a share of
    its mean per hour: the line through the means (of values and of times) of the window's newer
    and older halves. Means of up to 30 per-minute figures, not a slope of each: a trend of
    one-minute figures moved by ~1 %/h from noise alone in the simulated scenarios. Through the
    halves' mean times, it holds while the older half is still filling (a process up for 45 min).
    Less `noise_z` standard errors of the difference of the means (memory_growth's rise_noise_z).
    Reads the halves' figures recorded by half_window_recordings, each worked out once."""
    half = HalfWindow(series, window_seconds)
    rise_per_second = f"({half.newer} - {half.older})"
    if noise_z:
        rise_per_second = f"({half.newer} - {half.older} - {number(noise_z)} * sqrt({half.variance}))"
    return (f"{rise_per_second}"
            f" * 3600 / (({half.newer_time} - {half.older_time}) > 0)"
            f" / (({half.newer} + {half.older}) / 2 > 0)")


@dataclass(frozen=True)
class HalfWindow:
    """The names of the figures recorded for the halves of a window of one series: the means of
    its per-minute values and of their times in each half, and the variance of the difference of
    the means. Recorded once per evaluation, before the rules that read them in the same group:
    the load's rise reads each several times (tokens, running requests, CPU; raised and
    confident), and Prometheus works out a subquery again wherever it is written."""

    series: str
    window_seconds: float
    # what the recordings' names begin with (level:metric:operations, the operations joined): the
    # series' own name and "_" where it is a recording, "process:<metric>:" for a raw gauge
    name: str = ""

    @property
    def half(self) -> str:
        return duration(self.window_seconds / 2)

    def _name(self, figure: str) -> str:
        return f"{self.name or self.series + '_'}{figure}{self.half}"

    newer = property(lambda self: self._name("newer_mean"))
    older = property(lambda self: self._name("older_mean"))
    newer_time = property(lambda self: self._name("newer_time"))
    older_time = property(lambda self: self._name("older_time"))
    variance = property(lambda self: self._name("mean_difference_variance"))

    def recordings(self) -> list[Recording]:
        series, half = self.series, self.half
        # the variance of the difference of the halves' means, from the scatter of their
        # per-minute figures about the line (their variance less the line's part, slope^2 x the
        # variance of their times): a rise within noise_z standard errors of it is noise
        line = f"(({self.newer} - {self.older}) / ({self.newer_time} - {self.older_time}))"
        variance = " + ".join(
            f"clamp_min(stddev_over_time({series}[{half}:1m]{shift}) ^ 2"
            f" - {line} ^ 2 * stddev_over_time(timestamp({series})[{half}:1m]{shift}) ^ 2, 0)"
            f" / count_over_time({series}[{half}:1m]{shift})"
            for shift in ("", f" offset {half}"))
        return [Recording(self.newer, f"avg_over_time({series}[{half}:1m])"),
                Recording(self.older, f"avg_over_time({series}[{half}:1m] offset {half})"),
                Recording(self.newer_time, f"avg_over_time(timestamp({series})[{half}:1m])"),
                Recording(self.older_time, f"avg_over_time(timestamp({series})[{half}:1m] offset {half})"),
                Recording(self.variance, variance)]


def half_window_recordings(*windows_seconds: float) -> list[Recording]:
    return [recording for window in windows_seconds for series in (CPU, SERVER_TOKENS, SERVER_RUNNING)
            for recording in HalfWindow(settled(series), window).recordings()]


def settled(recorded: str) -> str:
    """The recording of `recorded` without its first minute: a 1 m rate over a series that has
    just appeared holds one or two samples, and from a scrape that repeats the last reading it
    reads low (0 from two equal samples), enough to fake a rise of 20 %/h in a half window."""
    return f"{recorded}_settled"


def _settled_recordings() -> list[Recording]:
    return [Recording(settled(name), f"{name} and ({name} offset 1m)")
            for name in (CPU, SERVER_TOKENS, SERVER_RUNNING)]


def _rise_chain(window_seconds: float, noise_z: float) -> str:
    """The load's rise over the halves of a window of `window_seconds` (see _load_rise), present
    once the older half has settled CPU figures."""
    cpu = f"max by (job, instance, pid) ({half_window_rise(settled(CPU), window_seconds, noise_z)})"
    half = duration(window_seconds / 2)
    tokens = half_window_rise(settled(SERVER_TOKENS), window_seconds, noise_z)
    running = half_window_rise(settled(SERVER_RUNNING), window_seconds, noise_z)
    return (
        "    # the servers tied to it: their tokens/s or running requests, whichever rose more\n"
        f"    ({tokens} >= {running})\n"
        f"  or {running}\n"
        f"  or {tokens}\n"
        "    # no server tied to it: its own CPU time\n"
        f"  or ({cpu} unless on (job, instance, pid) {SERVER_TOKENS})\n"
        "    # an idle server: nothing explains growth; judged once the older half has CPU figures\n"
        f"  or max by (job, instance, pid) (avg_over_time({settled(CPU)}[{half}] offset {half}) * 0)"
    )


def _load_rise(window_seconds: float, short_seconds: float, noise_z: float) -> str:
    """Where a server is tied to the process: the larger rise of its generation tokens/s and its
    running requests (memory follows the batch: at saturation the batch grows while tokens/s
    stay flat); else that of its own CPU time; 0 when the load falls or idles. Over the halves of
    the window once its older half holds settled CPU figures reaching back as far as the short
    window's half (min_window_seconds), else over the short window's halves; absent, and the
    process not judged, until its CPU figures reach into the short window's older half."""
    return (
        "clamp_min(\n"
        "  (\n"
        f"{_rise_chain(window_seconds, noise_z)}\n"
        "  )\n"
        f"  # the window's older half holds at least as many minutes as the short window's half\n"
        f"  and on (job, instance, pid) {_whole_window_filled(window_seconds, short_seconds)}\n"
        "  or\n"
        "  (\n"
        f"{_rise_chain(short_seconds, noise_z)}\n"
        "  ),\n"
        "  0\n"
        ")"
    )


def _whole_window_filled(window_seconds: float, short_seconds: float) -> str:
    """Present (labels job, instance, pid) once the window's older half holds settled CPU figures
    reaching back as far as the short window's half: from then on the load's rise, and a memory's
    noise, are judged over the halves of the whole window."""
    reach = duration((window_seconds + short_seconds) / 2)
    return (f"max by (job, instance, pid) (present_over_time({settled(CPU)}"
            f"[{duration(window_seconds - (window_seconds + short_seconds) / 2)}] offset {reach}))")


def memory_rise_noise(resource: Resource, window_seconds: float, short_seconds: float, noise_z: float) -> str:
    """noise_z standard errors of the rise of the resource's amount over the halves of the window
    the load's rise is judged over (_load_rise: the whole window once its older half is filled,
    else the short one), in bytes per hour: what the memory's own scatter about its line leaves
    unknown of its rise. Memory that follows a noisy load scatters with it."""
    def noise(seconds: float) -> str:
        half = resource.halves(seconds)
        return (f"{number(noise_z)} * sqrt({half.variance}) * 3600"
                f" / (({half.newer_time} - {half.older_time}) > 0)")
    return (f"(\n  {noise(window_seconds)}\n"
            f"  and on (job, instance, pid) {_whole_window_filled(window_seconds, short_seconds)}\n)\n"
            f"or\n{noise(short_seconds)}")


def recordings(t: Thresholds) -> tuple[Recording, ...]:
    seconds, recent_seconds = t.memory_growth.window_seconds, t.memory_growth.recent_seconds
    window = duration(seconds)
    rules = [
        Recording(CPU, f"rate({process_metrics.CPU_SECONDS.name}[1m])"),
        Recording(load_slope(window), robust_slope(CPU, seconds)),
        Recording(FAULTS, f"rate({process_metrics.MINOR_FAULTS.name}[1m])"
                          f" + rate({process_metrics.MAJOR_FAULTS.name}[1m])"),
        Recording(GPU_MEMORY, f"sum without (gpu, uuid) ({gpu_metrics.PROCESS_MEMORY_USED.name})"),
        Recording(LOCKED_AND_PINNED, f"{process_metrics.LOCKED.name}\n"
                                     f"+ ({process_metrics.PINNED.name} or {process_metrics.LOCKED.name} * 0)"),
        Recording(SERVER_TOKENS, tied_to_tree("sum by (job, instance, pid) "
                                              f'(rate({BY_FIELD["generated_tokens"].name}{{pid!=""}}[1m]))')),
        Recording(server_slopes(window)[0], robust_slope(SERVER_TOKENS, seconds)),
        Recording(FAULTS_PER_WORK,
                  f"{FAULTS} / on (job, instance, pid) group_left () ({SERVER_TOKENS} > 0)\n"
                  f"or ({FAULTS} / ({CPU} > 0) unless on (job, instance, pid) {SERVER_TOKENS})"),
        Recording(fault_slope(window), robust_slope(FAULTS_PER_WORK, seconds)),
        Recording(SERVER_RUNNING, tied_to_tree(
            "sum by (job, instance, pid) "
            f'(avg_over_time({BY_FIELD["requests_running"].name}{{pid!=""}}[1m]))')),
        Recording(server_slopes(window)[1], robust_slope(SERVER_RUNNING, seconds)),
        *_settled_recordings(),
        *half_window_recordings(seconds, t.memory_growth.min_window_seconds),
        Recording(load_rise(window), _load_rise(seconds, t.memory_growth.min_window_seconds, 0)),
        Recording(load_rise(window, confident=True),
                  _load_rise(seconds, t.memory_growth.min_window_seconds, t.memory_growth.rise_noise_z)),
    ]
    for resource in resources():
        rules.append(Recording(resource.slope(window), SLOPE_NOTE + robust_slope(resource.current, seconds)))
        for part in (recent_seconds, recent_seconds / 2):
            # bytes/s: the least-squares slope of the recent part (is it still growing?)
            rules.append(Recording(resource.recent_slope(duration(part)),
                                   f"deriv({resource.current}[{duration(part)}])"))
        rules.append(Recording(
            resource.exhaustion(),
            f"(\n{indent(resource.headroom, 2)}\n)\n/ ({resource.slope(window)} > 0)"))
        short = t.memory_growth.min_window_seconds
        rules += [recording for span in (seconds, short) for recording in resource.halves(span).recordings()]
        rules.append(Recording(resource.rise_noise(window),
                               memory_rise_noise(resource, seconds, short, t.memory_growth.rise_noise_z)))
    rules += [
        Recording(GPU_NODE,
                  "# the node nearest the GPU: its PCI device's sysfs numa_node, through its PCI address;\n"
                  "# never NVML's NumaNodeId, which is GPU memory's own node on Grace (nvml.h)\n"
                  "max without (name, pci_bus_id, driver_version) (\n"
                  f"    {gpu_metrics.GPU_INFO.name}\n"
                  "  * on (job, instance, pci_bus_id) group_left ()\n"
                  f"    {pcie.DEVICE_NUMA_NODE.name}\n"
                  ")"),
        Recording(CPUS_OFF_NODE, _off_node_share(
            f"rate({numa.PROCESS_CPU_SECONDS_OFF_GPU_NODE.name}[{duration(CPU_TIME_WINDOW_SECONDS)}])",
            f"rate({process_metrics.CPU_SECONDS.name}[{duration(CPU_TIME_WINDOW_SECONDS)}])")),
        Recording(MEMORY_OFF_NODE, _off_node_share(
            f"avg_over_time({numa.PROCESS_RESIDENT_OFF_GPU_NODE.name}[1m])",
            f"avg_over_time({process_metrics.RESIDENT.name}[1m])")),
    ]
    return tuple(rules)


def _off_node_share(off_gpu_node: str, total: str) -> str:
    """The process's figure off a GPU's node (process_numa's, labelled gpu_node) over its whole
    figure (the process collector's), per GPU it holds memory on; absent while the whole is 0."""
    return (
        "# per process and GPU it uses: the share that is NOT on the GPU's NUMA node\n"
        f"    {off_gpu_node}\n"
        "  / on (job, instance, pid, process_name) group_left ()\n"
        f"    ({total} > 0)\n"
        "  * on (job, instance, pid, gpu_node) group_right (process_name)\n"
        "    (\n"
        f"{indent(PROCESS_ON_GPU_NODE, 4)}\n"
        "    )"
    )


