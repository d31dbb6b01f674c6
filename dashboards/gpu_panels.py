"""Panels about one or more GPUs, used by the host overview (every GPU chosen) and the drill-down
(one GPU): PCIe traffic against capacity, link state, link errors and GPU memory.

Capacity comes from rules/ recording rules: the theoretical rate of the current generation x width,
and the one GpuPcieStarvation divides by: what `hybridmon bench` measured (pinned local copies of
the largest size), else what copies achieve on the best link of the minute (theoretical x the share
copy engines reach, hybridmon/pcie_rates.py). Traffic and its share of capacity are the rules'
recordings too, so a panel shows the numbers the alert compares.
"""
from __future__ import annotations

from grafana_foundation_sdk.models import dashboard as model

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.models import common

from hybridmon.agent.alerts.catalogue import Thresholds
from hybridmon.agent.self_metrics import BUS_BYTES
from hybridmon.dashboards.common import graph, query, runbook_links, selector, single_stat, value_table
from hybridmon.exporters import gpu, pcie
from hybridmon.rules import pcie as recorded
from hybridmon.rules.pcie import CAPACITY, CAPACITY_THEORETICAL, MAX_CAPACITY, MEASURED_CAPACITY, REPLAY_BOUND
from hybridmon.rules.promql import number

THROUGHPUT = gpu.PCIE_THROUGHPUT.name
# What GpuPcieStarvation compares: each direction over its capacity and both together over the
# bidirectional one (the recording's direction="both"); the fullest counts.
TRAFFIC_SHARE = f"max without (direction) ({selector(recorded.TRAFFIC_SHARE)})"
# The theoretical rate carries no direction (it is the same both ways); name it so legends read well.
THEORETICAL_BOTH_WAYS = (f'label_replace({selector(CAPACITY_THEORETICAL)}, '
                         '"direction", "each direction", "direction", "")')
# PCIe functions (sysfs) are keyed by PCI address; this gives them the GPU index of hybridmon_gpu_info.
GPU_BY_PCI_ADDRESS = f"max without (uuid, name, driver_version) ({selector(gpu.GPU_INFO.name)})"
DASHED = model.DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]})


def traffic_vs_capacity(t: Thresholds, runbooks: str, title: str, width: int = 24):
    share = t.pcie_starvation.traffic_share_of_capacity
    panel = graph(
        title, "Bps",
        "PCIe traffic per direction over the last minute as GpuPcieStarvation reads it (NVML's byte "
        "counters, else the agent's sampled-bytes estimate, else the throughput gauge) against what "
        "the link carries: the rate `hybridmon bench` measured for pinned local copies, and the "
        "theoretical rate of the current generation and width. The starvation level is "
        "traffic_share_of_capacity of the capacity the alert divides by: measured where present, "
        "else what copies achieve on the best link of the minute (not the theoretical rate, which "
        "no copy reaches).",
        query(selector(recorded.TRAFFIC), "traffic {{direction}}", "A"),
        query(selector(MEASURED_CAPACITY), "measured capacity {{direction}}", "B"),
        query(THEORETICAL_BOTH_WAYS, "theoretical capacity {{direction}}", "C"),
        query(f"{number(share)} * {selector(CAPACITY)}", "starvation level {{direction}}", "D"),
        width=width, links=runbook_links(runbooks, "GpuPcieStarvation"))
    for ref in "BCD":
        panel = panel.override_by_query(ref, [DASHED])
    return panel


def uplink_of_chosen_gpus(expr: str) -> str:
    """`expr` (a series per uplink) for the shared uplinks the chosen GPUs sit behind."""
    return (f"{expr}\nand on (job, instance, uplink)\n{selector(recorded.GPU_UPLINK)}")


def uplink_traffic_vs_capacity(t: Thresholds, runbooks: str, width: int = 24):
    """The PCIe link GPUs behind one switch share (issue 29): their summed traffic per direction
    against what it carries, as PcieUplinkStarvation reads them."""
    share = t.pcie_uplink_starvation.traffic_share_of_capacity
    achievable = selector(recorded.UPLINK_ACHIEVABLE, gpu=False)
    panel = graph(
        "Shared PCIe uplink: traffic of the GPUs behind it vs capacity", "Bps",
        "Where GPUs sit behind one PCIe switch, the one link from its upstream port to the CPU's "
        "root port carries all their host traffic: here each such uplink of the chosen GPUs, the "
        "sum of its GPUs' traffic per direction over the last minute (as GpuPcieStarvation reads "
        "each GPU's), against what copies achieve on its best generation and width of the minute "
        "(hybridmon/pcie_rates.py; no benchmark measures an uplink). The starvation level is "
        "traffic_share_of_capacity of [pcie_uplink_starvation]. Empty where every GPU has a link "
        "of its own to its root port.",
        query(uplink_of_chosen_gpus(selector(recorded.UPLINK_TRAFFIC, gpu=False)),
              "uplink {{uplink}} {{direction}}", "A"),
        query(uplink_of_chosen_gpus(achievable), "uplink {{uplink}} carries, each way", "B"),
        query(uplink_of_chosen_gpus(f"{number(share)} * {achievable}"), "uplink {{uplink}} starvation level", "C"),
        width=width, links=runbook_links(runbooks, "PcieUplinkStarvation"))
    for ref in "BC":
        panel = panel.override_by_query(ref, [DASHED])
    return panel


def bus_account(runbooks: str, width: int = 24):
    """Where the bus time goes: each direction's bytes stacked by cause, one stack per direction."""
    panel = graph(
        "Where the bus time goes", "Bps",
        "Each direction's PCIe bytes over the last minute, split by what the agent can attribute "
        f"them to (InferenceWeightsCrossingBus's account, {BUS_BYTES.name}): "
        "kv_offload, the KV bytes the servers on the GPU report moving (vLLM's offload connector, "
        "SGLang's HiCache, vLLM's HiSparse); weights, host-resident weights a server's command line "
        "configures (--cpu-offload-gb), at most what its forward passes read; unattributed, the "
        "rest. Unattributed is never called weights: LMCache's CPU tier, vLLM V0's swap space and "
        "connectors without byte counters move KV silently, and the status page lists which of "
        "them this GPU's servers show. Each stack adds up to the direction's traffic.",
        *(query(f"sum by (direction, cause) ({selector(BUS_BYTES.name, matcher)})", "{{direction}}: {{cause}}", ref)
          for ref, matcher in (("A", 'direction="host_to_device"'), ("B", 'direction="device_to_host"'))),
        width=width, links=runbook_links(runbooks, "InferenceWeightsCrossingBus"))
    for ref in "AB":
        panel = panel.override_by_query(ref, [model.DynamicConfigValue(
            id_val="custom.stacking",
            value=common_builders.StackingConfig().mode(common.StackingMode.NORMAL).group(ref).build())])
    return panel


def traffic_share(t: Thresholds, runbooks: str, width: int = 12):
    return graph(
        "PCIe traffic, share of capacity", "percentunit",
        "What GpuPcieStarvation compares (its recording rule): the fuller of each direction's "
        "traffic over its capacity and both directions together over what the link carries both "
        "ways at once. Capacity is what `hybridmon bench` measured, else what copies achieve on the "
        "best link of the minute. The line is traffic_share_of_capacity: at or above it while the "
        "GPU idles, the GPU waits on the link.",
        query(TRAFFIC_SHARE, "GPU {{gpu}}"),
        threshold=t.pcie_starvation.traffic_share_of_capacity, width=width,
        links=runbook_links(runbooks, "GpuPcieStarvation"))


def utilization(t: Thresholds, runbooks: str, width: int = 12):
    return graph(
        "GPU utilization", "percentunit",
        "Share of time a kernel ran (NVML). Lines: gpu_utilization_at_most of [pcie_starvation] "
        "(starved when the link is full and utilization is at or below it) and "
        "busy_utilization_at_least of [pcie_link_degraded] (links are judged only above it).",
        query(selector(gpu.UTILIZATION.name), "GPU {{gpu}}"),
        threshold=[t.pcie_link_degraded.busy_utilization_at_least, t.pcie_starvation.gpu_utilization_at_most],
        width=width, links=runbook_links(runbooks, "GpuPcieStarvation", "GpuPcieLinkDegraded")).max(1)


def link_now(runbooks: str, width: int = 12):
    names = {"A": "generation", "B": "max generation", "C": "lanes", "D": "max lanes"}
    metrics = (gpu.PCIE_LINK_GENERATION.name, gpu.PCIE_LINK_MAX_GENERATION.name,
               gpu.PCIE_LINK_WIDTH.name, gpu.PCIE_LINK_MAX_WIDTH.name)
    return value_table(
        "PCIe link now: generation and width vs maximum", "short",
        "Current and maximum PCIe generation and width (NVML). Links drop speed at idle on purpose; "
        "below the maximum while busy is a downtrained link.",
        {ref: (selector(metric), names[ref]) for ref, metric in zip(names, metrics)},
        width=width, height=6, links=runbook_links(runbooks, "GpuPcieLinkDegraded"))


def link_capacity_share(runbooks: str, width: int = 12):
    return graph(
        "PCIe link capacity, share of its maximum", "percentunit",
        "Theoretical rate at the current generation and width over the rate at the maximum ones: "
        "1 is a full link; less while the GPU is busy is a downtrained link.",
        query(f"{selector(CAPACITY_THEORETICAL)} / {selector(MAX_CAPACITY)}", "GPU {{gpu}}"),
        width=width, links=runbook_links(runbooks, "GpuPcieLinkDegraded")).max(1)


def replays(runbooks: str, width: int = 12):
    return graph(
        "PCIe replays per minute vs DCGM's bound", "short",
        "Packets the GPU resent (NVML replay counter) per minute, against DCGM's health-watch bound "
        "for the link (recording rule from bit_error_rate of [pcie_errors]).",
        query(f"rate({selector(gpu.PCIE_REPLAYS.name)}[$__rate_interval]) * 60",
              "GPU {{gpu}} replays per minute", "A"),
        query(selector(REPLAY_BOUND), "GPU {{gpu}} bound", "B"),
        width=width, links=runbook_links(runbooks, "GpuPcieReplayErrors")).override_by_query("B", [DASHED])


def aer_expr(window: str, per_hour: bool) -> str:
    counter = selector(pcie.AER_ERRORS.name, gpu=False)
    rate = f"rate({counter}[{window}]) * 3600" if per_hour else f"increase({counter}[{window}])"
    return f"{rate}\n* on (job, instance, pci_bus_id) group_left (gpu)\n{GPU_BY_PCI_ADDRESS}"


def aer_errors(t: Thresholds, runbooks: str, width: int = 12):
    return graph(
        "PCIe AER errors per hour", "short",
        "AER error messages the GPU's PCI function sent (sysfs), per hour, by severity. The line is "
        "aer_correctable_per_hour of [pcie_errors]; any nonfatal or fatal error alerts.",
        query(aer_expr("$__rate_interval", per_hour=True), "GPU {{gpu}} {{severity}}"),
        threshold=t.pcie_errors.aer_correctable_per_hour, width=width,
        links=runbook_links(runbooks, "PcieAerErrors"))


def errors_in_range(runbooks: str, width: int = 6):
    return single_stat(
        "PCIe errors in the time range", "short",
        "Replays and AER errors counted over the dashboard's time range.",
        query(f"increase({selector(gpu.PCIE_REPLAYS.name)}[$__range])", "GPU {{gpu}} replays", "A"),
        query(aer_expr("$__range", per_hour=False), "GPU {{gpu}} AER {{severity}}", "B"),
        width=width, height=6, links=runbook_links(runbooks, "GpuPcieReplayErrors", "PcieAerErrors"))


def memory_share(t: Thresholds, runbooks: str, width: int = 12):
    return graph(
        "GPU memory used, share of total", "percentunit",
        "Memory allocated on the GPU over its total (NVML). The line is used_share of "
        "[gpu_memory_headroom], where offloading should start.",
        query(f"{selector(gpu.MEMORY_USED.name)} / {selector(gpu.MEMORY_TOTAL.name)}",
              "GPU {{gpu}}"),
        threshold=t.gpu_memory_headroom.used_share, width=width,
        links=runbook_links(runbooks, "GpuMemoryHeadroomLow")).max(1)


def memory_bytes(runbooks: str, width: int = 12):
    return graph(
        "GPU memory", "bytes", "Used, reserved by the driver, and total memory of each GPU (NVML).",
        query(selector(gpu.MEMORY_USED.name), "GPU {{gpu}} used", "A"),
        query(selector(gpu.MEMORY_RESERVED.name), "GPU {{gpu}} reserved", "B"),
        query(selector(gpu.MEMORY_TOTAL.name), "GPU {{gpu}} total", "C"),
        width=width, links=runbook_links(runbooks, "GpuMemoryHeadroomLow")).override_by_query("C", [DASHED])


def process_memory(runbooks: str, width: int = 12):
    return graph(
        "GPU memory per process", "bytes",
        "GPU memory each compute process uses on each GPU (NVML); absent where NVML cannot tell.",
        query(selector(gpu.PROCESS_MEMORY_USED.name), "{{process_name}} ({{pid}}) on GPU {{gpu}}"),
        width=width, links=runbook_links(runbooks, "InferenceProcessMemoryGrowth", "GpuMemoryHeadroomLow"))


def gpu_up(runbooks: str, width: int = 6):
    up, lost = model.ValueMappingResult(text="up", color="green"), model.ValueMappingResult(text="lost", color="red")
    return single_stat(
        "GPUs up", "short", "1 while NVML answers for the GPU; 0 when it reports the GPU lost.",
        query(selector(gpu.GPU_UP.name), "GPU {{gpu}}"), width=width, height=6,
        links=runbook_links(runbooks, "GpuLost")).mappings([model.ValueMap(options={"1": up, "0": lost})])
