"""The GPU drill-down: one GPU in depth. Its PCIe traffic against capacity, what the last benchmark
measured per transfer size and host memory kind, its link's state and errors, its memory and the
watched processes on it.
"""
from __future__ import annotations

from grafana_foundation_sdk.models import dashboard as model

from hybridmon.agent.alerts.catalogue import Thresholds
from hybridmon.dashboards import gpu_panels
from hybridmon.dashboards.common import (assemble, graph, link, new_dashboard, override_unit, query, runbook_links,
                                         selector, single_stat, value_table)
from hybridmon.exporters import bench, gpu, process
from hybridmon.rules.pcie import MEASURED_BIDIRECTIONAL_CAPACITY, MEASURED_CAPACITY
from hybridmon.rules.process import CPUS_OFF_NODE, MEMORY_OFF_NODE

UID = "hybridmon-gpu"
HOST_OVERVIEW = "/d/hybridmon-host?var-datasource=${datasource}&var-instance=${instance}"
BENCH_SERIES = {"A": (bench.BANDWIDTH.name, "median"),
                "B": (bench.EFFICIENCY.name, "share of theoretical")}
# The watched processes holding memory on the chosen GPU, value 1, keyed by pid (with process_name).
ON_THIS_GPU = f"(max without (gpu, uuid) ({selector(gpu.PROCESS_MEMORY_USED.name)}) * 0 + 1)"


def per_process(expr: str) -> str:
    """One value per process on this GPU: `expr` (keyed by pid) joined to the GPU's processes."""
    return (f"max by (pid, process_name) (\n  {expr}\n  * on (job, instance, pid) group_left (process_name)\n"
            f"  {ON_THIS_GPU}\n)")


def benchmark():
    results = value_table(
        "Last benchmark: bandwidth per transfer size and memory kind", "Bps",
        "Each copy the last `hybridmon bench` run made: direction, host memory kind (pinned or "
        "pageable), host buffer placement (local: the GPU's NUMA node) and transfer size; median "
        "bandwidth, and for the largest copies its share of the link's theoretical rate.",
        {ref: (selector(metric), name) for ref, (metric, name) in BENCH_SERIES.items()}, height=10)
    return [
        override_unit(results, "share of theoretical", "percentunit"),
        single_stat("Time since the last benchmark", "s", "When the last `hybridmon bench` run on this GPU finished.",
                    query(f"time() - {selector(bench.TIMESTAMP.name)}", "GPU {{gpu}}"), width=8),
        single_stat("Link capacity during the benchmark", "Bps",
                    "Theoretical per-direction rate of the link the run saw, and what it measured: "
                    "one direction at a time (what GpuPcieStarvation judges each direction against), "
                    "and each direction while the other copied too (their sum is what it judges "
                    "both directions together against). Without a run the alert uses what copies "
                    "achieve on the best link of the minute instead.",
                    query(selector(bench.LINK_CAPACITY.name), "theoretical", "A"),
                    query(selector(MEASURED_CAPACITY), "measured {{direction}}", "B"),
                    query(selector(MEASURED_BIDIRECTIONAL_CAPACITY), "measured {{direction}}, both ways at once",
                          "C"), width=16),
    ]


def processes(runbooks: str):
    columns = {"A": "GPU memory", "B": "resident memory", "C": "swapped out",
               "D": "CPU time off the GPU's node (2 min)", "E": "resident memory off the GPU's node"}
    # Only the processes the agent reads in /proc: a graphics client it does not watch, or a pid
    # from a container without the host's pids, would be a row with GPU memory and nothing else.
    watched = f"on (job, instance, pid) {selector(process.INFO.name, gpu=False)}"
    exprs = {"A": f"max by (pid, process_name) ({selector(gpu.PROCESS_MEMORY_USED.name)} and {watched})",
             "B": per_process(selector(process.RESIDENT.name, gpu=False)),
             "C": per_process(selector(process.SWAP.name, gpu=False)),
             "D": per_process(selector(CPUS_OFF_NODE)),
             "E": per_process(selector(MEMORY_OFF_NODE))}
    panel = value_table(
        "Watched processes on this GPU", "bytes",
        "Each watched process holding memory on the GPU: its GPU memory (NVML), resident and swapped-out host "
        "memory (/proc/<pid>/status) and the share of its CPU time and memory off the GPU's NUMA node.",
        {ref: (expr, columns[ref]) for ref, expr in exprs.items()}, height=8,
        links=runbook_links(runbooks, "InferenceProcessNumaMisplaced", "InferenceProcessMemoryGrowth"))
    for name in (columns["D"], columns["E"]):
        panel = override_unit(panel, name, "percentunit")
    return [panel]


def link_over_time(runbooks: str):
    metrics = {"A": (gpu.PCIE_LINK_GENERATION.name, "generation"),
               "B": (gpu.PCIE_LINK_MAX_GENERATION.name, "max generation"),
               "C": (gpu.PCIE_LINK_WIDTH.name, "lanes"),
               "D": (gpu.PCIE_LINK_MAX_WIDTH.name, "max lanes")}
    return graph("PCIe link generation and width over time", "short",
                 "Current and maximum generation and width (NVML); the link drops speed at idle on purpose.",
                 *(query(selector(metric), name, ref) for ref, (metric, name) in metrics.items()),
                 links=runbook_links(runbooks, "GpuPcieLinkDegraded"))


def build(t: Thresholds, runbooks: str) -> model.Dashboard:
    dashboard = new_dashboard(
        "hybridmon: GPU drill-down", UID,
        "One GPU in depth: PCIe traffic against capacity, benchmark results, link state and errors, "
        "memory and processes.", gpu_multi=False,
        links=[link("Runbooks", runbooks), link("Host overview", HOST_OVERVIEW)])
    return assemble(dashboard, [
        ("PCIe traffic", [gpu_panels.traffic_vs_capacity(t, runbooks, "PCIe traffic vs capacity"),
                          gpu_panels.traffic_share(t, runbooks), gpu_panels.utilization(t, runbooks),
                          gpu_panels.bus_account(runbooks), gpu_panels.uplink_traffic_vs_capacity(t, runbooks)]),
        ("Benchmark", benchmark()),
        ("PCIe link", [gpu_panels.gpu_up(runbooks), gpu_panels.link_now(runbooks, width=18),
                       gpu_panels.link_capacity_share(runbooks), link_over_time(runbooks)]),
        ("PCIe errors", [gpu_panels.replays(runbooks, width=9), gpu_panels.aer_errors(t, runbooks, width=9),
                         gpu_panels.errors_in_range(runbooks)]),
        ("Memory", [gpu_panels.memory_share(t, runbooks), gpu_panels.memory_bytes(runbooks),
                    gpu_panels.process_memory(runbooks, width=24)]),
        ("Processes", processes(runbooks)),
    ])
