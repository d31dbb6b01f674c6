"""The host overview: why is this hybrid GPU/CPU inference host slow?

Top to bottom: what the agent and Prometheus find wrong now (with runbook links), per inference
server the tokens/s, latency and KV cache pressure its users feel (dashboards/inference.py), each
GPU's PCIe traffic against what its link carries, link state and errors, GPU memory, host memory
pressure (swap, major faults, PSI), where the watched processes sit against their GPUs' NUMA
nodes, and the last benchmark of the links.
"""
from __future__ import annotations

from grafana_foundation_sdk.models import dashboard as model

from hybridmon.agent.alerts.catalogue import Thresholds
from hybridmon.agent.self_metrics import FINDING_ACTIVE, FINDING_THRESHOLD, FINDING_VALUE
from hybridmon.dashboards import gpu_panels, inference
from hybridmon.dashboards.common import (assemble, graph, link, new_dashboard, override_links,
                                         override_threshold, override_unit, query, runbook_links, selector,
                                         single_stat, value_table)
from hybridmon.exporters import bench, numa, pressure, process
from hybridmon.exporters.host_memory import (MAJOR_PAGE_FAULTS, MEMORY_AVAILABLE, MEMORY_TOTAL, SWAP_FREE,
                                             SWAP_IN_BYTES, SWAP_OUT_BYTES, SWAP_TOTAL)
from hybridmon.rules.pcie import MEASURED_CAPACITY
from hybridmon.rules.process import CPUS_OFF_NODE, MEMORY_OFF_NODE

UID = "hybridmon-host"
GPU_DRILL_DOWN = "/d/hybridmon-gpu?var-datasource=${datasource}&var-instance=${instance}&${gpu:queryparam}"
PINNED_LOCAL_EFFICIENCY = selector(bench.EFFICIENCY.name, 'memory="pinned"', 'placement="local"')


def _host(metric: str, *matchers: str) -> str:
    return selector(metric, *matchers, gpu=False)


def _rate(metric: str, *matchers: str) -> str:
    return f"rate({_host(metric, *matchers)}[$__rate_interval])"


def findings(runbooks: str):
    """The agent's own findings, with value and threshold, each alertname linking to its runbook."""
    agent = value_table(
        "Active findings (agent)", "short",
        f"Findings the agent's detectors raise now ({FINDING_ACTIVE.name}), with the measured value "
        "and the threshold it crossed, in the threshold's unit. Click an alert name for its runbook.",
        {"A": (_host(FINDING_ACTIVE.name), None), "B": (_host(FINDING_VALUE.name), "value"),
         "C": (_host(FINDING_THRESHOLD.name), "threshold")}, width=12, height=8)
    alerts = value_table(
        "Alerts from Prometheus rules", "short",
        "ALERTS for this agent from rules/hybridmon.rules.yml, pending and firing. Click an alert "
        "name for its runbook.",
        {"A": ('ALERTS{instance="$instance"}', None)}, width=12, height=8)
    runbook = [link("Runbook: ${__value.raw}", f"{runbooks}/${{__value.raw}}")]
    return [override_links(panel, "alertname", runbook) for panel in (agent, alerts)]


def host_memory(t: Thresholds, runbooks: str):
    swap = t.swap_thrash
    swap_panel = override_threshold(graph(
        "Swap in and out", "Bps",
        "Memory read back from swap and written to it (/proc/vmstat). Lines: swap_in_bytes_per_second "
        "and swap_out_bytes_per_second of [swap_thrash]; both at once, with major faults and memory "
        "pressure, is thrashing.",
        query(_rate(SWAP_IN_BYTES.name), "swap in", "A"),
        query(_rate(SWAP_OUT_BYTES.name), "swap out", "B"),
        threshold=swap.swap_in_bytes_per_second, links=runbook_links(runbooks, "HostSwapThrash")),
        "B", swap.swap_out_bytes_per_second)
    return [
        swap_panel,
        graph("Major page faults per second", "short",
              "Faults that waited for disk or swap (/proc/vmstat pgmajfault). The line is "
              "major_faults_per_second of [swap_thrash].",
              query(_rate(MAJOR_PAGE_FAULTS.name), "major faults"),
              threshold=swap.major_faults_per_second, links=runbook_links(runbooks, "HostSwapThrash")),
        graph("Pressure stall (PSI)", "percentunit",
              "Share of wall time tasks stalled on memory or I/O (/proc/pressure). The line is "
              "memory_pressure_some_ratio of [swap_thrash], for memory some.",
              query(_rate(pressure.STALLED_SECONDS.name, 'resource=~"memory|io"'),
                    "{{resource}} {{scope}}"),
              threshold=swap.memory_pressure_some_ratio, links=runbook_links(runbooks, "HostSwapThrash")),
        graph("Host memory and swap", "bytes",
              "MemAvailable against MemTotal, and swap free against swap total (/proc/meminfo).",
              query(_host(MEMORY_AVAILABLE.name), "available", "A"),
              query(_host(MEMORY_TOTAL.name), "total", "B"),
              query(_host(SWAP_FREE.name), "swap free", "C"),
              query(_host(SWAP_TOTAL.name), "swap total", "D"),
              links=runbook_links(runbooks, "HostNoSwapLowHeadroom")),
        graph("Watched processes: memory in swap", "bytes",
              "VmSwap of each watched process. The line is process_swap_bytes of [swap_thrash].",
              query(_host(process.SWAP.name), "{{process_name}} ({{pid}})"),
              threshold=swap.process_swap_bytes, links=runbook_links(runbooks, "HostSwapThrash")),
        graph("Watched processes: major faults per second", "short",
              "Major faults of each watched process (/proc/<pid>/stat). The line is "
              "process_major_faults_per_second of [swap_thrash].",
              query(_rate(process.MAJOR_FAULTS.name), "{{process_name}} ({{pid}})"),
              threshold=swap.process_major_faults_per_second, links=runbook_links(runbooks, "HostSwapThrash")),
    ]


def numa_placement(t: Thresholds, runbooks: str):
    shares = {"A": (CPUS_OFF_NODE, "CPU time (2 min)"), "B": (MEMORY_OFF_NODE, "resident memory")}
    placement = value_table(
        "Watched processes vs their GPUs' NUMA nodes", "percentunit",
        "For each watched process and each GPU it holds memory on: the GPU's NUMA node (node), and "
        "the share of the CPU time its threads ran (last 2 min) and of its resident memory on other "
        "nodes.",
        {ref: (selector(record), f"{what} off the GPU's node") for ref, (record, what) in shares.items()},
        labels={"gpu_node": "GPU's NUMA node"}, width=12, height=8,
        links=runbook_links(runbooks, "InferenceProcessNumaMisplaced"))
    # Where each process runs (its CPU time), not where it may (its allowed CPUs, a [process]
    # detail_series series), against the nodes of its GPUs: what InferenceProcessNumaMisplaced
    # judges, in bytes and cores (its per-node figures are [process] detail_series series too).
    by_node = value_table(
        "Watched processes off their GPUs' NUMA nodes", "bytes",
        "For each watched process that holds GPU memory and each NUMA node of its GPUs (gpu_node): "
        "its resident memory on other nodes (numa_maps) and the CPU cores it used on other nodes' "
        "CPUs (a process on no GPU has no placement to judge, and none is read).",
        {"A": (_host(numa.PROCESS_RESIDENT_OFF_GPU_NODE.name), "resident memory off the node"),
         "B": (_rate(numa.PROCESS_CPU_SECONDS_OFF_GPU_NODE.name), "CPU cores used off the node")},
        labels={"gpu_node": "GPU's NUMA node"}, width=12, height=8)
    return [
        placement,
        override_unit(by_node, "CPU cores used off the node", "short"),
        graph("Watched processes: share off their GPU's NUMA node", "percentunit",
              "Share of each watched process's CPU time (last 2 min) and resident memory on other "
              "NUMA nodes than the GPU it uses (recording rules). The line is share_off_gpu_node of "
              "[numa_misplacement], the memory threshold; CPU time fires above 1 - "
              "cpu_time_on_gpu_node_of_even_spread / (nodes with CPUs): 75 % on 2 nodes.",
              *(query(selector(record), f"{{{{process_name}}}} ({{{{pid}}}}) on GPU {{{{gpu}}}}: {what}", ref)
                for ref, (record, what) in shares.items()),
              threshold=t.numa_misplacement.share_off_gpu_node, width=24,
              links=runbook_links(runbooks, "InferenceProcessNumaMisplaced")).max(1),
    ]


def last_benchmark():
    return [
        single_stat("Measured PCIe capacity (last benchmark)", "Bps",
                    "Pinned, local, largest copies of the last `hybridmon bench` run per direction, "
                    "and the theoretical rate of the link the run saw.",
                    query(selector(MEASURED_CAPACITY), "GPU {{gpu}} {{direction}}", "A"),
                    query(selector(bench.LINK_CAPACITY.name),
                          "GPU {{gpu}} link, theoretical", "B"),
                    width=10),
        single_stat("Benchmark efficiency, pinned local copies", "percentunit",
                    "Best measured / theoretical rate over the transfer sizes of the last run.",
                    query(f"max without (transfer_bytes) ({PINNED_LOCAL_EFFICIENCY})", "GPU {{gpu}} {{direction}}"),
                    width=8),
        single_stat("Time since the last benchmark", "s", "When each GPU's last `hybridmon bench` run finished.",
                    query(f"time() - {selector(bench.TIMESTAMP.name)}", "GPU {{gpu}}"), width=6),
    ]


def build(t: Thresholds, runbooks: str) -> model.Dashboard:
    dashboard = new_dashboard(
        "hybridmon: host overview", UID,
        "Why a hybrid GPU/CPU inference host is slow: PCIe, GPU and host memory, NUMA placement and "
        "active findings, beside what the inference servers' users feel.", gpu_multi=True,
        links=[link("Runbooks", runbooks), link("GPU drill-down", GPU_DRILL_DOWN)], inference=True)
    return assemble(dashboard, [
        ("Findings", [*findings(runbooks)]),
        ("Inference servers compared: tiered KV cache", inference.tier_comparison(runbooks)),
        (inference.ROW, [*inference.load_and_latency(runbooks), *inference.kv_cache(t, runbooks),
                         *inference.kv_tiers(runbooks)]),
        ("Inference scrapes", inference.scrapes(runbooks)),
        ("PCIe per GPU", [gpu_panels.traffic_vs_capacity(t, runbooks, "PCIe traffic vs capacity: GPU $gpu")
                          .repeat("gpu").repeat_direction("h").max_per_row(2),
                          gpu_panels.traffic_share(t, runbooks), gpu_panels.utilization(t, runbooks)]),
        ("PCIe link state and errors", [gpu_panels.gpu_up(runbooks), gpu_panels.link_now(runbooks, width=18),
                                        gpu_panels.replays(runbooks), gpu_panels.aer_errors(t, runbooks)]),
        ("GPU memory", [gpu_panels.memory_share(t, runbooks), gpu_panels.process_memory(runbooks)]),
        ("Host memory", host_memory(t, runbooks)),
        ("NUMA placement", numa_placement(t, runbooks)),
        ("Last benchmark", last_benchmark()),
    ])
