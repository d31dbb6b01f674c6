"""InferenceProcessNumaMisplaced: a GPU process whose allowed CPUs (reason=cpus) or resident memory
(reason=memory) sit mostly on another NUMA node than its GPU's (incident 1's NUMA note:
cross-socket transfers undo the gain of pinning cores). Only hosts with two or more NUMA nodes are
judged. Runbook: InferenceProcessNumaMisplaced.md.

The GPU's node is the one nearest it: its PCI device's sysfs numa_node, through its PCI address
(never NVML's NumaNodeId, GPU memory's own node on Grace); the rules read it,
and the per-process off-node shares, from the process group's recordings (rules/process.py).
"""
from __future__ import annotations

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import common, windows
from hybridmon.agent.detectors.base import Finding
from hybridmon.agent.history import History
from hybridmon.exporters.gpu import GPU_INFO, NUMA_NODE, PROCESS_MEMORY_USED
from hybridmon.exporters.numa import NODE_MEMORY_TOTAL, PROCESS_ALLOWED_CPUS_ON_NODE, PROCESS_NUMA_RESIDENT
from hybridmon.exporters.pcie import DEVICE_NUMA_NODE
from hybridmon.exporters.process import ALLOWED_CPUS
from hybridmon.rules import process as recorded
from hybridmon.rules.case_inputs import HOST2, LLAMA, VLLM, on_gpu
from hybridmon.rules.host import NUMA_NODES
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import number, query
from hybridmon.rules.promtool_cases import BUS0, BUS1, GIB, GPU0, GPU1, HOST, Catalog, Test, above, firing, not_yet
from hybridmon.rules.templates import humanize_percentage

INPUTS = (NUMA_NODE, DEVICE_NUMA_NODE, GPU_INFO, PROCESS_MEMORY_USED, ALLOWED_CPUS,
          PROCESS_ALLOWED_CPUS_ON_NODE, PROCESS_NUMA_RESIDENT, NODE_MEMORY_TOTAL)
# reason label -> the per-node series the share is taken of
PER_NODE = {"cpus": PROCESS_ALLOWED_CPUS_ON_NODE, "memory": PROCESS_NUMA_RESIDENT}


class Settings(Section):
    share_off_gpu_node: float
    for_seconds: float


def alerts(n: Settings) -> list[Alert]:
    threshold = humanize_percentage(n.share_off_gpu_node)
    # The recordings keep the GPU's uuid and node; the alert names the process and the GPU.
    cpus, memory = (f"max without (uuid, node) (\n"
                    f"  {record} >= {number(n.share_off_gpu_node)}\n"
                    f"  and on (job, instance)\n"
                    f"  {NUMA_NODES} >= 2\n"
                    ")"
                    for record in (recorded.CPUS_OFF_NODE, recorded.MEMORY_OFF_NODE))
    node = query("{}", recorded.GPU_NODE, "gpu")
    fix = ("Every host-device copy of offloaded KV cache or weights then crosses the socket "
           "interconnect and is staged in far memory, which costs bandwidth and latency. First: "
           "numactl --hardware, grep Cpus_allowed_list /proc/<pid>/status and numastat -p <pid>. "
           "Then bind the server to the GPU's node: numactl --cpunodebind=<node> --membind=<node> "
           "(or taskset with the node's CPUs from numactl --hardware), and restart it.")
    return [
        Alert(
            "InferenceProcessNumaMisplaced",
            cpus,
            n.for_seconds, "warning",
            "<process_name> (pid <pid>) on <instance>: <value|humanizePercentage> of its CPUs are "
            "off GPU <gpu>'s NUMA node <node>",
            "<value|humanizePercentage> of the <cpus|humanize> CPUs watched process <process_name> "
            "(pid <pid>) may run on are outside NUMA node <node>, the node of GPU <gpu> that it "
            f"uses (threshold {threshold}). " + fix,
            labels={"reason": "cpus"},
            queries={"node": node, "cpus": query("{}", ALLOWED_CPUS.name, "pid")},
        ),
        Alert(
            "InferenceProcessNumaMisplaced",
            memory,
            n.for_seconds, "warning",
            "<process_name> (pid <pid>) on <instance>: <value|humanizePercentage> of its memory is "
            "off GPU <gpu>'s NUMA node <node>",
            "<value|humanizePercentage> of the <mapped|humanize1024>B of memory watched process "
            "<process_name> (pid <pid>) has mapped sits outside NUMA node <node>, the node of GPU "
            f"<gpu> that it uses (1 min average; threshold {threshold}). " + fix,
            labels={"reason": "memory"},
            queries={"node": node, "mapped": query(
                "sum without (node) ({})", PROCESS_NUMA_RESIDENT.name, "pid")},
        ),
    ]


def gpu_numa_nodes(history: History, now: float) -> dict[tuple[str, ...], str]:
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


class Detector:
    """InferenceProcessNumaMisplaced, only on hosts with at least two NUMA nodes: for every process
    using a GPU (NVML's per-process memory) and every such GPU whose node is known, the share of
    the process's allowed CPUs (reason=cpus) or of its resident pages (reason=memory) that is NOT
    on the GPU's node, from per-node values averaged over the last minute, is at least
    share_off_gpu_node."""

    name = "numa_misplacement"
    alertnames = ("InferenceProcessNumaMisplaced",)
    min_history_seconds = windows.AVERAGE_SECONDS

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.alerts = {rule.labels["reason"]: rule for rule in alerts(config)}

    def evaluate(self, history: History, now: float) -> list[Finding]:
        if common.numa_node_count(history, now) < 2:
            return []
        gpu_nodes = gpu_numa_nodes(history, now)
        gpus_of: dict[str, set[tuple[str, str]]] = {}
        for series in history.series(PROCESS_MEMORY_USED.name):
            if windows.latest(series, now) is not None:
                gpus_of.setdefault(series.labels["pid"], set()).add(
                    (series.labels["gpu"], series.labels["uuid"]))
        findings = []
        for reason, spec in PER_NODE.items():
            per_process: dict[tuple[str, str], dict[str, float]] = {}
            for series in history.series(spec.name):
                value = windows.avg_over_time(series, now)
                if value is not None:
                    key = (series.labels["pid"], series.labels["process_name"])
                    per_process.setdefault(key, {})[series.labels["node"]] = value
            for (pid, process_name), by_node in sorted(per_process.items(),
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
                        findings.append(self._finding(pid, process_name, gpu, node, reason, off, by_node,
                                                      total))
        return findings

    def _finding(self, pid, process_name, gpu, node, reason, off, by_node, total) -> Finding:
        details: dict[str, float | str] = {"gpu_numa_node": node, "uuid": gpu[1]}
        for n, value in by_node.items():
            details[f"node{n}_{'bytes' if reason == 'memory' else 'cpus'}"] = value
        # the figures the rule's queries fetch: the GPU's node and the process's CPUs or memory
        values = {"node": node, "cpus" if reason == "cpus" else "mapped": total}
        labels = {"pid": pid, "process_name": process_name, "gpu": gpu[0]}
        return finding(self.alerts[reason], labels, off, self.config.share_off_gpu_node, unit="ratio",
                       values=values, details=details)


def _misplaced_cpus_and_memory(t, catalog: Catalog) -> Test:
    n = t.numa_misplacement
    cpus_rule = catalog.find("InferenceProcessNumaMisplaced", reason="cpus")
    memory_rule = catalog.find("InferenceProcessNumaMisplaced", reason="memory")
    at = firing(n.for_seconds)
    off, fine = above(n.share_off_gpu_node), n.share_off_gpu_node / 2
    mapped = 12 * GIB
    test = Test("NUMA: python3 (pid 4242) on GPU 0 (node 0 per sysfs) is moved to node 1's CPUs; "
                "llama-server (pid 5151) on GPU 1 (node 1 per sysfs, NVML silent) gets its memory "
                "on node 0; NVML's GPU-memory node 4 (Grace-like) is ignored; gpu-host-2 has one NUMA node and stays silent", at + 120, catalog)
    for instance, nodes in ((HOST, ("0", "1")), (HOST2, ("0",))):
        for node in nodes:
            test.constant(NODE_MEMORY_TOTAL.name, 64 * GIB, instance, node=node)
        test.constant(NUMA_NODE.name, 4, instance, **GPU0)
        for gpu, bus in ((GPU0, BUS0), (GPU1, BUS1)):
            test.constant(GPU_INFO.name, 1, instance, **gpu, name="NVIDIA L40S", pci_bus_id=bus,
                          driver_version="550.54.15")
        # NVML names GPU 0's memory node 4 on purpose: only sysfs's nearest node counts
        test.constant(DEVICE_NUMA_NODE.name, 0, instance, pci_bus_id=BUS0)
        test.constant(DEVICE_NUMA_NODE.name, 1, instance, pci_bus_id=BUS1)
        on_gpu(test, GPU0, VLLM, 20 * GIB, instance)
        on_gpu(test, GPU1, LLAMA, 8 * GIB, instance)
        # python3: 16 CPUs, all on node 0 until the onset, all on node 1 after; memory stays put
        test.constant(ALLOWED_CPUS.name, 16, instance, **VLLM)
        test.gauge(PROCESS_ALLOWED_CPUS_ON_NODE.name, 16, 0, instance, **VLLM, node="0")
        test.gauge(PROCESS_ALLOWED_CPUS_ON_NODE.name, 0, 16, instance, **VLLM, node="1")
        test.constant(PROCESS_NUMA_RESIDENT.name, (1 - fine) * mapped, instance, **VLLM, node="0")
        test.constant(PROCESS_NUMA_RESIDENT.name, fine * mapped, instance, **VLLM, node="1")
        # llama-server: CPUs on node 1 throughout; memory moves to node 0 at the onset
        test.constant(ALLOWED_CPUS.name, 8, instance, **LLAMA)
        test.constant(PROCESS_ALLOWED_CPUS_ON_NODE.name, 0, instance, **LLAMA, node="0")
        test.constant(PROCESS_ALLOWED_CPUS_ON_NODE.name, 8, instance, **LLAMA, node="1")
        test.gauge(PROCESS_NUMA_RESIDENT.name, fine * mapped, off * mapped, instance,
                   **LLAMA, node="0")
        test.gauge(PROCESS_NUMA_RESIDENT.name, (1 - fine) * mapped, (1 - off) * mapped,
                   instance, **LLAMA, node="1")
    test.expect_samples(60, recorded.GPU_NODE, (GPU0, 0), (GPU1, 1),
                        ({**GPU0, "instance": HOST2}, 0), ({**GPU1, "instance": HOST2}, 1))
    test.expect(not_yet(n.for_seconds), "InferenceProcessNumaMisplaced")
    test.expect(at, "InferenceProcessNumaMisplaced",
                test.alert(cpus_rule, {**VLLM, "gpu": "0"}, value=1, cpus=16, node=0),
                test.alert(memory_rule, {**LLAMA, "gpu": "1"},
                           value=1 - (1 - off) * mapped / mapped, mapped=mapped, node=1))
    return test


def cases(t, catalog: Catalog) -> list[Test]:
    return [_misplaced_cpus_and_memory(t, catalog)]


FAMILY = AlertFamily(
    section="numa_misplacement",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group="hybridmon-process",
    detector=Detector,
    alerts=lambda t: tuple(alerts(t.numa_misplacement)),
    cases=cases,
    collectors=("gpu",),
    lookback_seconds=lambda settings: 0.0,
)
