"""InferenceProcessNumaMisplaced: a GPU process whose CPUs or memory sit on another NUMA node than
its GPU (incident 1's NUMA note: cross-socket transfers undo the gain of pinning cores)."""
from __future__ import annotations

from hybridmon.agent.detectors import common, windows
from hybridmon.agent.detectors.base import Finding, NumaMisplacement
from hybridmon.agent.detectors.pcie_errors import gpus_by_bus_id
from hybridmon.agent.history import History

GPU_NUMA_NODE = "hybridmon_gpu_numa_node"
DEVICE_NUMA_NODE = "hybridmon_pcie_device_numa_node"
GPU_PROCESS_MEMORY = "hybridmon_gpu_process_memory_used_bytes"
ALLOWED_CPUS_ON_NODE = "hybridmon_process_allowed_cpus_on_node"
NUMA_RESIDENT = "hybridmon_process_numa_resident_bytes"
REASONS = {"cpus": (ALLOWED_CPUS_ON_NODE, "allowed CPUs", "are"),
           "memory": (NUMA_RESIDENT, "resident memory", "is")}


def gpu_numa_nodes(history: History, now: float) -> dict[tuple[str, ...], str]:
    """(gpu, uuid) -> NUMA node, from NVML, else from sysfs through gpu_info's pci_bus_id."""
    nodes = {key: str(int(value)) for key, value in
             common.gpu_latest(history, GPU_NUMA_NODE, now).items()}
    by_bus = {}
    for series in history.series(DEVICE_NUMA_NODE):
        value = windows.latest(series, now)
        if value is not None:
            by_bus[series.labels["pci_bus_id"].lower()] = str(int(value))
    for bus_id, labels in gpus_by_bus_id(history).items():
        key = (labels.get("gpu", ""), labels.get("uuid", ""))
        if key not in nodes and bus_id in by_bus:
            nodes[key] = by_bus[bus_id]
    return nodes


class NumaMisplacementDetector:
    """InferenceProcessNumaMisplaced, only on hosts with at least two NUMA nodes: for every process
    using a GPU (NVML's per-process memory) and every such GPU whose node is known, the share of
    the process's allowed CPUs (reason=cpus) or of its resident pages (reason=memory) that is NOT
    on the GPU's node, from per-node values averaged over the last minute, is at least
    share_off_gpu_node."""

    name = "numa_misplacement"
    alertnames = ("InferenceProcessNumaMisplaced",)
    min_history_seconds = windows.AVERAGE_SECONDS

    def __init__(self, config: NumaMisplacement) -> None:
        self.config = config

    def evaluate(self, history: History, now: float) -> list[Finding]:
        if common.numa_node_count(history, now) < 2:
            return []
        gpu_nodes = gpu_numa_nodes(history, now)
        gpus_of: dict[str, set[tuple[str, str]]] = {}
        for series in history.series(GPU_PROCESS_MEMORY):
            if windows.latest(series, now) is not None:
                gpus_of.setdefault(series.labels["pid"], set()).add(
                    (series.labels["gpu"], series.labels["uuid"]))
        findings = []
        for reason, (metric, *_) in REASONS.items():
            per_process: dict[tuple[str, str], dict[str, float]] = {}
            for series in history.series(metric):
                value = windows.avg_over_time(series, now)
                if value is not None:
                    key = (series.labels["pid"], series.labels["name"])
                    per_process.setdefault(key, {})[series.labels["node"]] = value
            for (pid, name), by_node in sorted(per_process.items(),
                                               key=lambda item: common.process_order(item[0])):
                total = sum(by_node.values())
                if total <= 0:
                    continue
                for gpu in sorted(gpus_of.get(pid, ())):
                    node = gpu_nodes.get(gpu)
                    if node is None:
                        continue
                    off = sum(value for other, value in by_node.items() if other != node) / total
                    if off >= self.config.share_off_gpu_node:
                        findings.append(self._finding(pid, name, gpu, node, reason, off, by_node))
        return findings

    def _finding(self, pid, name, gpu, node, reason, off, by_node) -> Finding:
        _, what, verb = REASONS[reason]
        layout = ", ".join(
            f"node {n}: {common.human_bytes(v) if reason == 'memory' else f'{v:.0f} CPUs'}"
            for n, v in sorted(by_node.items(), key=lambda item: (len(item[0]), item[0])))
        details: dict[str, float | str] = {"gpu_numa_node": node, "uuid": gpu[1]}
        for n, value in by_node.items():
            details[f"node{n}_{'bytes' if reason == 'memory' else 'cpus'}"] = value
        fix = (f"pin it to the GPU's node: `numactl --cpunodebind={node} --membind={node}` (or "
               f"taskset with the node's CPUs from `numactl --hardware`)")
        return Finding(
            alertname="InferenceProcessNumaMisplaced",
            severity="warning",
            labels={"pid": pid, "process_name": name, "gpu": gpu[0], "reason": reason},
            value=off,
            threshold=self.config.share_off_gpu_node,
            unit="ratio",
            for_seconds=self.config.for_seconds,
            summary=(f"{name} (pid {pid}) has {common.percent(off)} of its {what} off GPU "
                     f"{gpu[0]}'s NUMA node {node}"),
            description=(
                f"{name} (pid {pid}) uses GPU {gpu[0]}, attached to NUMA node {node}, but "
                f"{common.percent(off)} of its {what} {verb} on other nodes ({layout}; threshold "
                f"{common.percent(self.config.share_off_gpu_node)}). Host<->GPU copies from a "
                f"remote node cross the socket interconnect, costing bandwidth and latency on "
                f"every offloaded KV block. First: `numactl --hardware`, "
                f"`grep Cpus_allowed_list /proc/{pid}/status`, `numastat -p {pid}`; then {fix}."),
            details=details,
        )
