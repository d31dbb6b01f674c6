"""InferenceProcessNumaMisplaced: a GPU process that runs (reason=cpus) or keeps its resident memory
(reason=memory) away from its GPU's NUMA node (incident 1's NUMA note: cross-socket transfers undo
the gain of pinning cores). Judged on where the process IS, not on the CPUs it MAY use: an unpinned
process on a 2-socket host may use every CPU, half of them remote, and is where the kernel put it,
which with first-touch allocation is mostly local (issue 14). Only hosts with two or more NUMA
nodes are judged. Runbook: InferenceProcessNumaMisplaced.md.

- cpus: the share of its CPU time over the last 2 min (its threads' CPU time, on the node of the
  CPU each last ran on: exporters/numa.py) that ran off the GPU's node is above
  1 - cpu_time_on_gpu_node_of_even_spread / (NUMA nodes with CPUs). An unpinned process's threads
  spread over every node (the scheduler balances load without regard to the GPU), so it runs
  about 1/nodes of its time on the GPU's node; the alert wants it to run there less than half of
  that (2 nodes: more than 75 % off the node; 4 nodes: 87.5 %), which a process bound away from
  the node does (100 %) and the scheduler's wandering does not.
- memory: the share of its resident pages off the GPU's node (1 min average) is more than
  share_off_gpu_node: most of its memory, strictly.

The GPU's node is the one nearest it: its PCI device's sysfs numa_node, through its PCI address
(never NVML's NumaNodeId, GPU memory's own node on Grace); the rules read it,
and the per-process off-node shares, from the process group's recordings (rules/process.py).
"""
from __future__ import annotations

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import common, windows
from hybridmon.agent.detectors.base import DetectorBase, Finding, HistoryReader
from hybridmon.exporters.gpu import GPU_INFO, NUMA_NODE, PROCESS_MEMORY_USED
from hybridmon.exporters.numa import (NODE_CPUS, NODE_MEMORY_TOTAL, PROCESS_ALLOWED_CPUS_ON_NODE,
                                      PROCESS_CPU_SECONDS_ON_NODE, PROCESS_NUMA_RESIDENT)
from hybridmon.exporters.pcie import DEVICE_NUMA_NODE
from hybridmon.exporters.process import ALLOWED_CPUS
from hybridmon.rules import groups
from hybridmon.rules import process as recorded
from hybridmon.rules.host import NUMA_NODES
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import duration, number, query
from hybridmon.rules.templates import humanize_percentage

INPUTS = (NUMA_NODE, DEVICE_NUMA_NODE, GPU_INFO, PROCESS_MEMORY_USED, ALLOWED_CPUS, NODE_CPUS,
          PROCESS_CPU_SECONDS_ON_NODE, PROCESS_NUMA_RESIDENT, NODE_MEMORY_TOTAL)
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
    cpus = ("max without (uuid, node) (\n"
            f"  {recorded.CPUS_OFF_NODE}\n"
            f"  > on (job, instance) group_left ()\n"
            f"  (1 - {number(n.cpu_time_on_gpu_node_of_even_spread)} / {recorded.CPU_NODES})\n"
            + gate + ")")
    memory = (f"max without (uuid, node) (\n  {recorded.MEMORY_OFF_NODE} > {number(n.share_off_gpu_node)}\n"
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
            "<node>, the node of GPU <gpu> that it uses; it may run on <cpus|humanize> CPUs "
            "(threshold <limit|humanizePercentage> off the node: it runs there less than "
            f"{even} of the time an unpinned process, spread evenly over the host's NUMA nodes with "
            "CPUs, would). " + fix,
            labels={"reason": "cpus"},
            queries={"node": node, "cpus": query("{}", ALLOWED_CPUS.name, "pid"),
                     "cores": query(f"sum without (node) (rate({{}}[{CPU_WINDOW}]))",
                                    PROCESS_CPU_SECONDS_ON_NODE.name, "pid"),
                     "limit": query(f"1 - {number(n.cpu_time_on_gpu_node_of_even_spread)} / "
                                    "count without (node) ({} > 0)", NODE_CPUS.name)},
        ),
        Alert(
            "InferenceProcessNumaMisplaced",
            memory,
            n.for_seconds, "warning",
            "<process_name> (pid <pid>) on <instance>: <value|humanizePercentage> of its memory is "
            "off GPU <gpu>'s NUMA node <node>",
            "<value|humanizePercentage> of the <mapped|humanize1024>B of memory watched process "
            "<process_name> (pid <pid>) has mapped sits outside NUMA node <node>, the node of GPU "
            f"<gpu> that it uses (1 min average; threshold: more than {threshold}). " + fix,
            labels={"reason": "memory"},
            queries={"node": node, "mapped": query(
                "sum without (node) ({})", PROCESS_NUMA_RESIDENT.name, "pid")},
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
    the process's CPU time over the last CPU_WINDOW (reason=cpus; PromQL's rate() of its per-node
    CPU seconds) or of its resident pages averaged over the last minute (reason=memory) that is NOT
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
            for (pid, process_name), by_node in sorted(self._per_node(history, now, reason).items(),
                                                       key=lambda item: common.process_order(item[0])):
                total = sum(by_node.values())
                if total <= 0:   # an idle process ran nowhere: nothing to judge
                    continue
                for gpu in sorted(gpus_of.get(pid, ())):
                    node = gpu_nodes.get(gpu)
                    if node is None:
                        continue
                    off = sum(value for other, value in by_node.items() if other != node) / total
                    if off > limit:
                        findings.append(self._finding(history, now, pid, process_name, gpu, node, reason,
                                                      off, limit, by_node, total))
        return findings

    @staticmethod
    def _per_node(history: HistoryReader, now: float, reason: str) -> dict[tuple[str, str], dict[str, float]]:
        """(pid, process_name) -> node -> CPU seconds per second (cpus) or resident bytes (memory)."""
        per_process: dict[tuple[str, str], dict[str, float]] = {}
        spec = PROCESS_CPU_SECONDS_ON_NODE if reason == "cpus" else PROCESS_NUMA_RESIDENT
        for series in history.series(spec.name):
            value = (windows.rate(series, now, recorded.CPU_TIME_WINDOW_SECONDS) if reason == "cpus"
                     else windows.avg_over_time(series, now))
            if value is not None:
                key = (series.labels["pid"], series.labels["process_name"])
                per_process.setdefault(key, {})[series.labels["node"]] = value
        return per_process

    def _finding(self, history, now, pid, process_name, gpu, node, reason, off, limit, by_node,
                 total) -> Finding:
        details: dict[str, float | str] = {"gpu_numa_node": node, "uuid": gpu[1]}
        for n, value in by_node.items():
            details[f"node{n}_{'bytes' if reason == 'memory' else 'cpu_cores'}"] = value
        # the figures the rule's queries fetch
        if reason == "cpus":
            allowed = [windows.latest(series, now) for series in history.series(ALLOWED_CPUS.name, pid=pid)]
            values = {"node": node, "cores": total, "limit": limit,
                      "cpus": next((value for value in allowed if value is not None), None)}
            for series in history.series(PROCESS_ALLOWED_CPUS_ON_NODE.name, pid=pid):
                value = windows.latest(series, now)
                if value is not None:
                    details[f"node{series.labels['node']}_allowed_cpus"] = value
        else:
            values = {"node": node, "mapped": total}
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
