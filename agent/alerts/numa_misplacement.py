"""InferenceProcessNumaMisplaced: a GPU process that runs (reason=cpus) or keeps its resident memory
(reason=memory) away from its GPU's NUMA node (incident 1's NUMA note: cross-socket transfers undo
the gain of pinning cores). Judged on where the process IS, not on the CPUs it MAY use: an unpinned
process on a 2-socket host may use every CPU, half of them remote, and is where the kernel put it,
which with first-touch allocation is mostly local (issue 14). Only hosts with two or more NUMA
nodes are judged. Runbook: InferenceProcessNumaMisplaced.md.

- cpus: the share of its CPU time over the last 2 min (/proc/<pid>/stat) that ran off the GPU's
  node (split as its threads' time was, on the node of the CPU each last ran on:
  exporters/numa.py) is above
  1 - cpu_time_on_gpu_node_of_even_spread / (NUMA nodes with CPUs). An unpinned process's threads
  spread over every node (the scheduler balances load without regard to the GPU), so it runs
  about 1/nodes of its time on the GPU's node; the alert wants it to run there less than half of
  that (2 nodes: more than 75 % off the node; 4 nodes: 87.5 %), which a process bound away from
  the node does (100 %) and the scheduler's wandering does not.
- memory: the share of its resident memory (VmRSS) off the GPU's node (its numa_maps pages on
  other nodes; 1 min averages) is more than share_off_gpu_node: most of its memory, strictly.

Both doors read process_numa's pair per process and GPU node (CPU seconds and resident bytes off
it, label gpu_node) over the process collector's whole (CPU seconds, VmRSS): 2 series a process
and GPU node whatever the host's node count (issue 33's budget of 12 a process). Its allowed CPUs
(a [process] detail_series series) are named in the text when exported, as context only.

The GPU's node is the one nearest it: its PCI device's sysfs numa_node, through its PCI address
(never NVML's NumaNodeId, GPU memory's own node on Grace); the rules read it,
and the per-process off-node shares, from the process group's recordings (rules/process.py).
"""
from __future__ import annotations

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import common, windows
from hybridmon.agent.detectors.base import DetectorBase, Finding, HistoryReader
from hybridmon.exporters.gpu import GPU_INFO, NUMA_NODE, PROCESS_MEMORY_USED
from hybridmon.exporters.numa import (NODE_CPUS, NODE_MEMORY_TOTAL, PROCESS_CPU_SECONDS_OFF_GPU_NODE,
                                      PROCESS_RESIDENT_OFF_GPU_NODE)
from hybridmon.exporters.pcie import DEVICE_NUMA_NODE
from hybridmon.exporters.process import ALLOWED_CPUS, CPU_SECONDS, RESIDENT
from hybridmon.rules import groups
from hybridmon.rules import process as recorded
from hybridmon.rules.host import NUMA_NODES
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import duration, number, query
from hybridmon.rules.templates import humanize_percentage

# ALLOWED_CPUS is context for the text only, and only with [process] detail_series: not an input.
INPUTS = (NUMA_NODE, DEVICE_NUMA_NODE, GPU_INFO, PROCESS_MEMORY_USED, NODE_CPUS, NODE_MEMORY_TOTAL,
          PROCESS_CPU_SECONDS_OFF_GPU_NODE, PROCESS_RESIDENT_OFF_GPU_NODE, CPU_SECONDS, RESIDENT)
CPU_WINDOW = duration(recorded.CPU_TIME_WINDOW_SECONDS)


class Settings(Section):
    share_off_gpu_node: float
    cpu_time_on_gpu_node_of_even_spread: float
    for_seconds: float


def cpu_limit(n: Settings, cpu_nodes: int) -> float:
    """The off-node share of CPU time above which reason=cpus fires on a host with `cpu_nodes`
    NUMA nodes that have CPUs."""
    return 1 - n.cpu_time_on_gpu_node_of_even_spread / cpu_nodes


def alerts(n: Settings) -> list[Alert]:
    threshold = humanize_percentage(n.share_off_gpu_node)
    even = humanize_percentage(n.cpu_time_on_gpu_node_of_even_spread)
    # The recordings keep the GPU's uuid and node; the alert names the process and the GPU.
    gate = f"  and on (job, instance)\n  {NUMA_NODES} >= 2\n"
    cpus = ("max without (uuid, gpu_node) (\n"
            f"  {recorded.CPUS_OFF_NODE}\n"
            f"  > on (job, instance) group_left ()\n"
            f"  (1 - {number(n.cpu_time_on_gpu_node_of_even_spread)} / {recorded.CPU_NODES})\n"
            + gate + ")")
    memory = (f"max without (uuid, gpu_node) (\n  {recorded.MEMORY_OFF_NODE} > {number(n.share_off_gpu_node)}\n"
              + gate + ")")
    node = query("{}", recorded.GPU_NODE, "gpu")
    fix = ("Every host-device copy of offloaded KV cache or weights then crosses the socket "
           "interconnect and is staged in far memory, which costs bandwidth and latency. First: "
           "numactl --hardware, grep Cpus_allowed_list /proc/<pid>/status, numastat -p <pid> and "
           "ps -L -o psr,pcpu -p <pid> (the CPU each thread runs on). "
           "Then bind the server to the GPU's node: numactl --cpunodebind=<node> --membind=<node> "
           "(or taskset with the node's CPUs from numactl --hardware), and restart it.")
    return [
        Alert(
            "InferenceProcessNumaMisplaced",
            cpus,
            n.for_seconds, "warning",
            "<process_name> (pid <pid>) on <instance>: <value|humanizePercentage> of its CPU time "
            "runs off GPU <gpu>'s NUMA node <node>",
            f"<value|humanizePercentage> of the CPU time watched process <process_name> (pid <pid>) "
            f"used over the last {CPU_WINDOW} (<cores|humanize> cores) ran on CPUs outside NUMA node "
            "<node>, the node of GPU <gpu> that it uses<if cpus>; it may run on <cpus|humanize> "
            "CPUs<else><end> "
            "(threshold <limit|humanizePercentage> off the node: it runs there less than "
            f"{even} of the time an unpinned process, spread evenly over the host's NUMA nodes with "
            "CPUs, would). " + fix,
            labels={"reason": "cpus"},
            queries={"node": node, "cpus": query("{}", ALLOWED_CPUS.name, "pid"),
                     "cores": query(f"rate({{}}[{CPU_WINDOW}])", CPU_SECONDS.name, "pid"),
                     "limit": query(f"1 - {number(n.cpu_time_on_gpu_node_of_even_spread)} / "
                                    "count without (node) ({} > 0)", NODE_CPUS.name)},
        ),
        Alert(
            "InferenceProcessNumaMisplaced",
            memory,
            n.for_seconds, "warning",
            "<process_name> (pid <pid>) on <instance>: <value|humanizePercentage> of its memory is "
            "off GPU <gpu>'s NUMA node <node>",
            "<value|humanizePercentage> of the <resident|humanize1024>B of resident memory of watched "
            "process <process_name> (pid <pid>) sits outside NUMA node <node>, the node of GPU "
            f"<gpu> that it uses (1 min average; threshold: more than {threshold}). " + fix,
            labels={"reason": "memory"},
            queries={"node": node, "resident": query("{}", RESIDENT.name, "pid")},
        ),
    ]


def gpu_numa_nodes(history: HistoryReader, now: float) -> dict[tuple[str, ...], str]:
    """(gpu, uuid) -> the NUMA node nearest the GPU: its PCI device's sysfs numa_node, found
    through gpu_info's pci_bus_id. GPUs whose device has none (-1, absent) are left out.

    NVML's nvmlDeviceGetNumaNodeId (NUMA_NODE) is never used here: nvml.h says it "only applies to
    platforms where the GPUs are NUMA nodes", where it is the GPU's own memory node (Grace Hopper:
    a CPU-less node), so every process's CPUs would be "off" it; on x86 it is NOT_SUPPORTED."""
    nodes: dict[tuple[str, ...], str] = {}
    by_bus = {}
    for series in history.series(DEVICE_NUMA_NODE.name):
        value = windows.latest(series, now)
        if value is not None:
            by_bus[series.labels["pci_bus_id"].lower()] = str(int(value))
    for bus_id, labels in common.gpus_by_bus_id(history).items():
        key = (labels.get("gpu", ""), labels.get("uuid", ""))
        if bus_id in by_bus:
            nodes[key] = by_bus[bus_id]
    return nodes


class Detector(DetectorBase):
    """InferenceProcessNumaMisplaced, only on hosts with at least two NUMA nodes: for every process
    using a GPU (NVML's per-process memory) and every such GPU whose node is known, the share of
    the process's CPU time over the last CPU_WINDOW (reason=cpus; PromQL's rate() of its CPU
    seconds off the GPU's node over that of its CPU seconds) or of its resident memory averaged
    over the last minute (reason=memory; its resident bytes off the node over VmRSS) that is NOT
    on the GPU's node, against cpu_limit() and share_off_gpu_node, both strictly."""

    name = "numa_misplacement"
    alertnames = ("InferenceProcessNumaMisplaced",)
    min_history_seconds = windows.AVERAGE_SECONDS

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.alerts = {rule.labels["reason"]: rule for rule in alerts(config)}

    def evaluate(self, history: HistoryReader, now: float) -> list[Finding]:
        if common.numa_node_count(history, now) < 2:
            return []
        cpu_nodes = sum(1 for series in history.series(NODE_CPUS.name)
                        if (windows.latest(series, now) or 0) > 0)
        limits = {"memory": self.config.share_off_gpu_node}
        if cpu_nodes:
            limits["cpus"] = cpu_limit(self.config, cpu_nodes)
        gpu_nodes = gpu_numa_nodes(history, now)
        gpus_of: dict[str, set[tuple[str, str]]] = {}
        for series in history.series(PROCESS_MEMORY_USED.name):
            if windows.latest(series, now) is not None:
                gpus_of.setdefault(series.labels["pid"], set()).add(
                    (series.labels["gpu"], series.labels["uuid"]))
        findings = []
        for reason, limit in limits.items():
            totals = self._totals(history, now, reason)
            for (pid, process_name), off_by_node in sorted(self._off_gpu_node(history, now, reason).items(),
                                                           key=lambda item: common.process_order(item[0])):
                total = totals.get((pid, process_name))
                if not total or total <= 0:   # an idle process ran nowhere: nothing to judge
                    continue
                for gpu in sorted(gpus_of.get(pid, ())):
                    node = gpu_nodes.get(gpu)
                    if node is None or node not in off_by_node:
                        continue
                    off = off_by_node[node] / total
                    if off > limit:
                        findings.append(self._finding(history, now, pid, process_name, gpu, node, reason,
                                                      off, limit, total))
        return findings

    @staticmethod
    def _reduce(series, now: float, reason: str) -> float | None:
        """CPU seconds per second over CPU_WINDOW (cpus) or the 1 min average (memory)."""
        if reason == "cpus":
            return windows.rate(series, now, recorded.CPU_TIME_WINDOW_SECONDS)
        return windows.avg_over_time(series, now)

    def _off_gpu_node(self, history: HistoryReader, now: float,
                      reason: str) -> dict[tuple[str, str], dict[str, float]]:
        """(pid, process_name) -> GPU node -> its CPU seconds per second (cpus) or resident bytes
        (memory) off that node."""
        spec = PROCESS_CPU_SECONDS_OFF_GPU_NODE if reason == "cpus" else PROCESS_RESIDENT_OFF_GPU_NODE
        per_process: dict[tuple[str, str], dict[str, float]] = {}
        for series in history.series(spec.name):
            value = self._reduce(series, now, reason)
            if value is not None:
                key = (series.labels["pid"], series.labels["process_name"])
                per_process.setdefault(key, {})[series.labels["gpu_node"]] = value
        return per_process

    def _totals(self, history: HistoryReader, now: float, reason: str) -> dict[tuple[str, str], float]:
        """(pid, process_name) -> its CPU seconds per second (cpus) or VmRSS (memory)."""
        spec = CPU_SECONDS if reason == "cpus" else RESIDENT
        totals = {}
        for series in history.series(spec.name):
            value = self._reduce(series, now, reason)
            if value is not None:
                totals[(series.labels["pid"], series.labels["process_name"])] = value
        return totals

    def _finding(self, history, now, pid, process_name, gpu, node, reason, off, limit, total) -> Finding:
        details: dict[str, float | str] = {"gpu_numa_node": node, "uuid": gpu[1]}
        # the figures the rule's queries fetch
        if reason == "cpus":
            allowed = [windows.latest(series, now) for series in history.series(ALLOWED_CPUS.name, pid=pid)]
            values = {"node": node, "cores": total, "limit": limit,
                      "cpus": next((value for value in allowed if value is not None), None)}
            details["cpu_cores_off_gpu_node"] = off * total
        else:
            resident = [windows.latest(series, now) for series in history.series(RESIDENT.name, pid=pid)]
            values = {"node": node, "resident": next((value for value in resident if value is not None), None)}
            details["bytes_off_gpu_node"] = off * total
        labels = {"pid": pid, "process_name": process_name, "gpu": gpu[0]}
        return finding(self.alerts[reason], labels, off, limit, unit="ratio", values=values, details=details)


FAMILY = AlertFamily(
    section="numa_misplacement",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group=groups.PROCESS,
    detector=Detector,
    alerts=lambda t: tuple(alerts(t.numa_misplacement)),
    collectors=("gpu",),
    lookback_seconds=lambda settings: 0.0,
    scenario="numa_misplacement",
)
