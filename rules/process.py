"""The recording rules of the process group: CPU, faults, each process's load from its inference
server, memory slopes and exhaustion, NUMA placement. The alerts that read them are
agent/alerts/memory_growth.py and numa_misplacement.py.

Slopes are rules.promql.robust_slope (the median of local least-squares slopes), the PromQL
stand-in for the agent's Theil-Sen slope: both agree on steady growth and ignore a single jump.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the schema is built from the families, which import these rules
    from hybridmon.agent.alerts.catalogue import Thresholds

from dataclasses import dataclass

from hybridmon.exporters import gpu as gpu_metrics
from hybridmon.exporters import host_memory, numa, pcie
from hybridmon.exporters import process as process_metrics
from hybridmon.exporters.inference_names import BY_FIELD
from hybridmon.rules.model import Recording
from hybridmon.rules.promql import (SLOPE_NOTE, duration, indent, rate_name, robust_slope)

CPU = f"process:{rate_name(process_metrics.CPU_SECONDS.name)}:rate1m"
FAULTS = "process:hybridmon_process_faults:rate1m"
# Faults per CPU second, as the detector judges them: a fault rate that rises only because the
# load rises is not a trend (the healthy growth-with-load scenario).
FAULTS_PER_CPU = "process:hybridmon_process_faults_per_cpu_second:ratio1m"
GPU_MEMORY = f"process:{gpu_metrics.PROCESS_MEMORY_USED.name}:sum"
# The load of the inference servers tied to a process (label pid), summed over its servers: where
# there is one, it is the load memory growth is judged against, as the detector does.
SERVER_TOKENS = f"process:{rate_name(BY_FIELD['generated_tokens'].name)}:rate1m"
SERVER_RUNNING = f"process:{BY_FIELD['requests_running'].name}:avg1m"
GPU_NODE = "gpu:hybridmon_gpu_nearest_numa_node:sysfs"
CPUS_OFF_NODE = f"process:{process_metrics.ALLOWED_CPUS.name}_off_gpu_node:ratio"
MEMORY_OFF_NODE = f"process:{numa.PROCESS_NUMA_RESIDENT.name}_off_gpu_node:ratio"
PROCESS_ON_GPU_NODE = (
    # value 1 per (process, GPU it holds memory on), labelled with the GPU's NUMA node
    f'    count_values without () ("node", {GPU_NODE})\n'
    "  * on (job, instance, gpu, uuid) group_right (node)\n"
    f"    max without (process_name) ({gpu_metrics.PROCESS_MEMORY_USED.name} * 0 + 1)"
)


@dataclass(frozen=True)
class Resource:
    label: str          # the alert's resource label
    what: str           # for the description
    current: str        # the process's amount now: labels job, instance, pid, process_name
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
                        f"{host_memory.MEMORY_TOTAL.name} - on (job, instance) group_right () {metric}")
    process_gpu_memory = gpu_metrics.PROCESS_MEMORY_USED.name
    return (
        Resource("gpu_memory", "GPU memory (NVML, summed over its GPUs)", GPU_MEMORY,
                 process_gpu_memory, "the memory total of its GPUs",
                 "sum without (gpu, uuid) (\n"
                 f"    {gpu_metrics.MEMORY_TOTAL.name}\n"
                 "  * on (job, instance, gpu, uuid) group_right ()\n"
                 f"    ({process_gpu_memory} * 0 + 1)\n"
                 ")\n"
                 f"- {GPU_MEMORY}"),
        host("resident", "resident host memory (VmRSS)", process_metrics.RESIDENT.name),
        host("locked", "locked host memory (VmLck)", process_metrics.LOCKED.name),
    )


def load_slope(window: str) -> str:
    return f"process:{rate_name(process_metrics.CPU_SECONDS.name)}:slope{window}_rate1m"


def fault_slope(window: str) -> str:
    return f"process:hybridmon_process_faults_per_cpu_second:slope{window}_ratio1m"


def server_slopes(window: str) -> tuple[str, str]:
    return (f"process:{rate_name(BY_FIELD['generated_tokens'].name)}:slope{window}_rate1m",
            f"process:{BY_FIELD['requests_running'].name}:slope{window}_avg1m")


def recordings(t: Thresholds) -> tuple[Recording, ...]:
    seconds = t.memory_growth.window_seconds
    window = duration(seconds)
    rules = [
        Recording(CPU, f"rate({process_metrics.CPU_SECONDS.name}[1m])"),
        Recording(load_slope(window), robust_slope(CPU, seconds)),
        Recording(FAULTS, f"rate({process_metrics.MINOR_FAULTS.name}[1m])"
                          f" + rate({process_metrics.MAJOR_FAULTS.name}[1m])"),
        Recording(FAULTS_PER_CPU, f"{FAULTS} / ({CPU} > 0)"),
        Recording(fault_slope(window), robust_slope(FAULTS_PER_CPU, seconds)),
        Recording(GPU_MEMORY, f"sum without (gpu, uuid) ({gpu_metrics.PROCESS_MEMORY_USED.name})"),
        Recording(SERVER_TOKENS, "sum by (job, instance, pid) "
                                 f'(rate({BY_FIELD["generated_tokens"].name}{{pid!=""}}[1m]))'),
        Recording(server_slopes(window)[0], robust_slope(SERVER_TOKENS, seconds)),
        Recording(SERVER_RUNNING, "sum by (job, instance, pid) "
                                  f'(avg_over_time({BY_FIELD["requests_running"].name}{{pid!=""}}[1m]))'),
        Recording(server_slopes(window)[1], robust_slope(SERVER_RUNNING, seconds)),
    ]
    for resource in resources():
        rules.append(Recording(resource.slope(window), SLOPE_NOTE + robust_slope(resource.current, seconds)))
        rules.append(Recording(
            resource.exhaustion(),
            f"(\n{indent(resource.headroom, 2)}\n)\n/ ({resource.slope(window)} > 0)"))
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
            numa.PROCESS_ALLOWED_CPUS_ON_NODE.name, process_metrics.ALLOWED_CPUS.name)),
        Recording(MEMORY_OFF_NODE, _off_node_share(
            f"avg_over_time({numa.PROCESS_NUMA_RESIDENT.name}[1m])",
            f"sum without (node) (avg_over_time({numa.PROCESS_NUMA_RESIDENT.name}[1m]))")),
    ]
    return tuple(rules)


def _off_node_share(on_node: str, total: str) -> str:
    return (
        "# per process and GPU it uses: the share that is NOT on the GPU's NUMA node\n"
        "1 - (\n"
        f"    {on_node}\n"
        "  * on (job, instance, pid, node) group_right (process_name)\n"
        "    (\n"
        f"{indent(PROCESS_ON_GPU_NODE, 4)}\n"
        "    )\n"
        "  / on (job, instance, pid) group_left ()\n"
        f"    {total}\n"
        ")"
    )


