"""Watched inference processes: memory that grows without load (its inference server's load where
one is tied to it, else its CPU), and NUMA placement off the GPU.

Slopes are rules.promql.robust_slope (the median of local least-squares slopes), the PromQL
stand-in for the agent's Theil-Sen slope: both agree on steady growth and ignore a single jump.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the schema is built from the families, which import these rules
    from hybridmon.agent.alerts.catalogue import Thresholds

from dataclasses import dataclass

from hybridmon.rules.host import NUMA_NODES
from hybridmon.rules.model import Alert, Group, Recording
from hybridmon.rules.promql import (SLOPE_NOTE, as_process_name, data_spans, duration, indent, number, query,
                          robust_slope)
from hybridmon.rules.templates import humanize_percentage

CPU = "process:hybridmon_process_cpu_seconds:rate1m"
FAULTS = "process:hybridmon_process_faults:rate1m"
# Faults per CPU second, as the detector judges them: a fault rate that rises only because the
# load rises is not a trend (the healthy growth-with-load scenario).
FAULTS_PER_CPU = "process:hybridmon_process_faults_per_cpu_second:ratio1m"
GPU_MEMORY = "process:hybridmon_gpu_process_memory_used_bytes:sum"
# The load of the inference servers tied to a process (label pid), summed over its servers: where
# there is one, it is the load memory growth is judged against, as the detector does.
SERVER_TOKENS = "process:hybridmon_inference_generated_tokens:rate1m"
SERVER_RUNNING = "process:hybridmon_inference_requests_running:avg1m"
GPU_NODE = "gpu:hybridmon_gpu_numa_node:nvml_or_sysfs"
CPUS_OFF_NODE = "process:hybridmon_process_allowed_cpus_off_gpu_node:ratio"
MEMORY_OFF_NODE = "process:hybridmon_process_numa_resident_bytes_off_gpu_node:ratio"
PROCESS_ON_GPU_NODE = (
    # value 1 per (process, GPU it holds memory on), labelled with the GPU's NUMA node
    f'    count_values without () ("node", {GPU_NODE})\n'
    "  * on (job, instance, gpu, uuid) group_right (node)\n"
    "    max without (process_name) (hybridmon_gpu_process_memory_used_bytes * 0 + 1)"
)


@dataclass(frozen=True)
class Resource:
    label: str          # the alert's resource label
    what: str           # for the description
    current: str        # the process's amount now: labels job, instance, pid, name (process_name)
    raw: str            # the raw gauge, for the data-span check
    limit: str          # what it exhausts, for the description
    headroom: str       # PromQL: the total it can grow into minus `current`, labels as `current`

    def slope(self, window: str) -> str:
        return f"process:{self.raw}:slope{window}"

    def exhaustion(self) -> str:
        return f"process:{self.raw}:exhaustion_seconds"


def resources() -> tuple[Resource, ...]:
    def host(label: str, what: str, metric: str) -> Resource:
        return Resource(label, what, metric, metric, "the host's MemTotal",
                        f"hybridmon_memory_total_bytes - on (job, instance) group_right () {metric}")
    return (
        Resource("gpu_memory", "GPU memory (NVML, summed over its GPUs)", GPU_MEMORY,
                 "hybridmon_gpu_process_memory_used_bytes", "the memory total of its GPUs",
                 "sum without (gpu, uuid) (\n"
                 "    hybridmon_gpu_memory_total_bytes\n"
                 "  * on (job, instance, gpu, uuid) group_right ()\n"
                 "    (hybridmon_gpu_process_memory_used_bytes * 0 + 1)\n"
                 ")\n"
                 f"- {GPU_MEMORY}"),
        host("resident", "resident host memory (VmRSS)", "hybridmon_process_resident_bytes"),
        host("locked", "locked host memory (VmLck)", "hybridmon_process_locked_bytes"),
    )


SHORT = {"gpu_memory": "GPU memory", "resident": "resident memory", "locked": "locked memory"}


def load_slope(window: str) -> str:
    return f"process:hybridmon_process_cpu_seconds:slope{window}_rate1m"


def fault_slope(window: str) -> str:
    return f"process:hybridmon_process_faults_per_cpu_second:slope{window}_ratio1m"


def server_slopes(window: str) -> tuple[str, str]:
    return (f"process:hybridmon_inference_generated_tokens:slope{window}_rate1m",
            f"process:hybridmon_inference_requests_running:slope{window}_avg1m")


def recordings(t: Thresholds) -> tuple[Recording, ...]:
    seconds = t.memory_growth.window_seconds
    window = duration(seconds)
    rules = [
        Recording(CPU, "rate(hybridmon_process_cpu_seconds_total[1m])"),
        Recording(load_slope(window), robust_slope(CPU, seconds)),
        Recording(FAULTS, "rate(hybridmon_process_minor_faults_total[1m])"
                          " + rate(hybridmon_process_major_faults_total[1m])"),
        Recording(FAULTS_PER_CPU, f"{FAULTS} / ({CPU} > 0)"),
        Recording(fault_slope(window), robust_slope(FAULTS_PER_CPU, seconds)),
        Recording(GPU_MEMORY, "sum without (gpu, uuid) (hybridmon_gpu_process_memory_used_bytes)"),
        Recording(SERVER_TOKENS, 'sum by (job, instance, pid) (rate(hybridmon_inference_generated_tokens_total{pid!=""}[1m]))'),
        Recording(server_slopes(window)[0], robust_slope(SERVER_TOKENS, seconds)),
        Recording(SERVER_RUNNING, 'sum by (job, instance, pid) (avg_over_time(hybridmon_inference_requests_running{pid!=""}[1m]))'),
        Recording(server_slopes(window)[1], robust_slope(SERVER_RUNNING, seconds)),
    ]
    for resource in resources():
        rules.append(Recording(resource.slope(window), SLOPE_NOTE + robust_slope(resource.current, seconds)))
        rules.append(Recording(
            resource.exhaustion(),
            f"(\n{indent(resource.headroom, 2)}\n)\n/ ({resource.slope(window)} > 0)"))
    rules += [
        Recording(GPU_NODE,
                  "# the GPU's NUMA node from NVML, else from sysfs through the GPU's PCI address\n"
                  "hybridmon_gpu_numa_node\n"
                  "or\n"
                  "max without (name, pci_bus_id, driver_version) (\n"
                  "    hybridmon_gpu_info\n"
                  "  * on (job, instance, pci_bus_id) group_left ()\n"
                  "    hybridmon_pcie_device_numa_node\n"
                  ")"),
        Recording(CPUS_OFF_NODE, _off_node_share(
            "hybridmon_process_allowed_cpus_on_node", "hybridmon_process_allowed_cpus")),
        Recording(MEMORY_OFF_NODE, _off_node_share(
            "avg_over_time(hybridmon_process_numa_resident_bytes[1m])",
            "sum without (node) (avg_over_time(hybridmon_process_numa_resident_bytes[1m]))")),
    ]
    return tuple(rules)


def _off_node_share(on_node: str, total: str) -> str:
    return (
        "# per process and GPU it uses: the share that is NOT on the GPU's NUMA node\n"
        "1 - (\n"
        f"    {on_node}\n"
        "  * on (job, instance, pid, node) group_right (name)\n"
        "    (\n"
        f"{indent(PROCESS_ON_GPU_NODE, 4)}\n"
        "    )\n"
        "  / on (job, instance, pid) group_left ()\n"
        f"    {total}\n"
        ")"
    )


def memory_growth(t: Thresholds) -> list[Alert]:
    g = t.memory_growth
    window = duration(g.window_seconds)
    load, faults = load_slope(window), fault_slope(window)
    tokens_slope, running_slope = server_slopes(window)
    flat = number(g.load_flat_per_hour_share)
    alerts = []
    for resource in resources():
        slope = resource.slope(window)
        expr = (
            "# bytes/s, at least the share of the current amount per hour\n"
            f"{slope} >= {resource.current} * {number(g.growth_per_hour_share)} / 3600\n"
            f"and {slope} > 0\n"
            "# with data reaching back at least min_window_seconds\n"
            "and on (job, instance, pid)\n"
            f"{data_spans(resource.raw, g.window_seconds, g.min_window_seconds)}\n"
            "# while the load stays flat: its inference server's tokens/s and running requests...\n"
            "and on (job, instance, pid)\n"
            "(\n"
            f"    {tokens_slope} * 3600 <= {SERVER_TOKENS} * {flat}\n"
            f"    unless on (job, instance, pid) {running_slope} * 3600 > {SERVER_RUNNING} * {flat}\n"
            "  or\n"
            "    # ...or, with no server tied to the process, its CPU load...\n"
            f"    {load} * 3600 <= {CPU} * {flat}\n"
            f"    unless on (job, instance, pid) {SERVER_TOKENS}\n"
            "  or\n"
            "    # ...or the page faults per CPU second grow\n"
            f"    {faults} * 3600 >= avg_over_time({FAULTS_PER_CPU}[{window}]) * {number(g.growth_per_hour_share)}\n"
            f"    and {faults} > 0\n"
            ")"
        )
        if resource.label != "gpu_memory":
            expr = as_process_name(expr)
        alerts.append(Alert(
            "InferenceProcessMemoryGrowth", expr, 0, "warning",
            f"<process_name> (pid <pid>) on <instance>: {SHORT[resource.label]} grows "
            "<value|humanize1024>B/s without more load",
            f"The {resource.what} of watched process <process_name> (pid <pid>) grew at "
            "<value|humanize1024>B/s (<per_hour|humanize1024>B per hour, median of the local "
            f"slopes over {window}; threshold {humanize_percentage(g.growth_per_hour_share)} of the current "
            "<current|humanize1024>B per hour) while its load stayed flat (within "
            f"{humanize_percentage(g.load_flat_per_hour_share)} per hour: its inference server's "
            "generation tokens/s and running requests where a server is tied to it, else its CPU "
            "time) or its page faults per CPU second "
            f"kept rising. At this rate it reaches {resource.limit} in <exhaustion|humanizeDuration>. "
            "Memory that grows without more work is being held, not reused: a leak, a cache "
            "without a bound, or references kept to KV blocks that were offloaded or freed. From "
            "outside the process this shows the growth, not its cause; the runbook says where to "
            "look.",
            labels={"resource": resource.label},
            queries={
                "per_hour": query("{} * 3600", slope, "pid"),
                "current": query("{}", resource.current, "pid"),
                "exhaustion": query("{}", resource.exhaustion(), "pid"),
            },
        ))
    return alerts


def numa_misplaced(t: Thresholds) -> list[Alert]:
    n = t.numa_misplacement
    threshold = humanize_percentage(n.share_off_gpu_node)
    cpus, memory = (f"{record} >= {number(n.share_off_gpu_node)}\n"
                    f"and on (job, instance)\n{NUMA_NODES} >= 2" for record in (CPUS_OFF_NODE, MEMORY_OFF_NODE))
    node = query("{}", GPU_NODE, "gpu")
    fix = ("Every host-device copy of offloaded KV cache or weights then crosses the socket "
           "interconnect and is staged in far memory, which costs bandwidth and latency. Bind the "
           "server to the GPU's node: numactl --cpunodebind=<node> --membind=<node>, and restart it.")
    return [
        Alert(
            "InferenceProcessNumaMisplaced",
            as_process_name(cpus, "uuid", "node"),
            n.for_seconds, "warning",
            "<process_name> (pid <pid>) on <instance>: <value|humanizePercentage> of its CPUs are "
            "off GPU <gpu>'s NUMA node",
            "<value|humanizePercentage> of the <cpus|humanize> CPUs watched process <process_name> "
            "(pid <pid>) may run on are outside NUMA node <node>, the node of GPU <gpu> that it "
            f"uses (threshold {threshold}). " + fix,
            labels={"reason": "cpus"},
            queries={"node": node, "cpus": query("{}", "hybridmon_process_allowed_cpus", "pid")},
        ),
        Alert(
            "InferenceProcessNumaMisplaced",
            as_process_name(memory, "uuid", "node"),
            n.for_seconds, "warning",
            "<process_name> (pid <pid>) on <instance>: <value|humanizePercentage> of its memory is "
            "off GPU <gpu>'s NUMA node",
            "<value|humanizePercentage> of the <mapped|humanize1024>B of memory watched process "
            "<process_name> (pid <pid>) has mapped sits outside NUMA node <node>, the node of GPU "
            f"<gpu> that it uses (1 min average; threshold {threshold}). " + fix,
            labels={"reason": "memory"},
            queries={"node": node, "mapped": query(
                "sum without (node) ({})", "hybridmon_process_numa_resident_bytes", "pid")},
        ),
    ]


def groups(t: Thresholds) -> list[Group]:
    return [Group("hybridmon-process", (*recordings(t), *memory_growth(t), *numa_misplaced(t)))]
