"""PCIe and GPU rules: starvation, a downtrained link, replays, AER errors, a lost GPU, VRAM headroom.

Gauges are compared as their 1 min average (avg_over_time), counters as 1 min rates, as in the
agent's detectors. Link generation and width are states, not measurements: they are read as they
are now, like the agent reads the latest sample.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the schema is built from the families, which import these rules
    from hybridmon.agent.alerts.catalogue import Thresholds

from textwrap import dedent

from hybridmon.rules.model import Alert, Group, Recording
from hybridmon.rules.promql import (LANE_BYTES_PER_SECOND, LANE_LINE_RATE_BITS_PER_SECOND, by_generation,
                          SLOPE_NOTE, data_spans, duration, number, query, robust_slope)
from hybridmon.rules.templates import humanize, humanize_percentage

CAPACITY_THEORETICAL = "gpu:hybridmon_gpu_pcie_link_capacity_bytes_per_second:theoretical"
MAX_CAPACITY = "gpu:hybridmon_gpu_pcie_link_max_capacity_bytes_per_second:theoretical"
# The capacity the starvation alert divides by, per direction: what `hybridmon bench` measured on
# this host where it has run, else the theoretical rate of the current link.
CAPACITY = "gpu:hybridmon_gpu_pcie_capacity_bytes_per_second:effective"
MEASURED_CAPACITY = "hybridmon_gpu_pcie_measured_capacity_bytes_per_second"
THROUGHPUT = "gpu:hybridmon_gpu_pcie_throughput_bytes_per_second:avg1m"
UTILIZATION = "gpu:hybridmon_gpu_utilization_ratio:avg1m"
REPLAY_BOUND = "gpu:hybridmon_gpu_pcie_replays_per_minute:dcgm_bound"
MEMORY_USED = "gpu:hybridmon_gpu_memory_used_bytes:avg1m"


def replay_rate_record(t: Thresholds) -> str:
    return f"gpu:hybridmon_gpu_pcie_replays:rate{duration(t.pcie_errors.window_seconds)}"


def capacity_expr(generation: str, width: str) -> str:
    return (f"({width} > 0)\n*\n(\n"
            f"{by_generation(generation, LANE_BYTES_PER_SECOND, '    ')}\n)")


def recordings(t: Thresholds) -> tuple[Recording, ...]:
    window = duration(t.pcie_errors.window_seconds)
    line_rates = by_generation("hybridmon_gpu_pcie_link_generation", LANE_LINE_RATE_BITS_PER_SECOND,
                               " " * 8)
    bound = (f"ceil(\n    {t.pcie_errors.bit_error_rate!r} * 60 * hybridmon_gpu_pcie_link_width_lanes\n"
             f"  *\n    (\n{line_rates}\n    )\n)")
    return (
        Recording(CAPACITY_THEORETICAL,
                  "# bytes/s per direction: per-lane rate of the current generation x current width\n"
                  + capacity_expr("hybridmon_gpu_pcie_link_generation",
                                  "hybridmon_gpu_pcie_link_width_lanes")),
        Recording(MAX_CAPACITY, capacity_expr("hybridmon_gpu_pcie_link_max_generation",
                                              "hybridmon_gpu_pcie_link_max_width_lanes")),
        Recording(CAPACITY,
                  "# bytes/s per direction: measured by `hybridmon bench`, else theoretical\n"
                  f"{MEASURED_CAPACITY}\n"
                  + "".join(f'or\nlabel_replace({CAPACITY_THEORETICAL}, "direction", "{direction}", "", "")\n'
                            for direction in ("host_to_device", "device_to_host")).rstrip("\n")),
        Recording(THROUGHPUT, "avg_over_time(hybridmon_gpu_pcie_throughput_bytes_per_second[1m])"),
        Recording(UTILIZATION, "avg_over_time(hybridmon_gpu_utilization_ratio[1m])"),
        Recording(replay_rate_record(t), f"rate(hybridmon_gpu_pcie_replays_total[{window}])"),
        Recording(REPLAY_BOUND,
                  "# DCGM's PCIe health watch: ceil(bit error rate x line rate x 60 x lanes) per minute\n"
                  + bound),
    )


def memory_recordings(t: Thresholds) -> tuple[Recording, ...]:
    return (
        Recording(MEMORY_USED, "avg_over_time(hybridmon_gpu_memory_used_bytes[1m])"),
        Recording(memory_slope_record(t), SLOPE_NOTE + robust_slope(
            "hybridmon_gpu_memory_used_bytes", t.gpu_memory_headroom.trend_window_seconds)),
    )


def _gpu(template: str, metric: str) -> tuple[str, tuple[str, ...]]:
    return query(template, metric, "gpu")


def starvation(t: Thresholds) -> Alert:
    s = t.pcie_starvation
    return Alert(
        "GpuPcieStarvation",
        dedent(f"""\
            # the share of its capacity in the direction nearest to it...
            max without (direction) ({THROUGHPUT} / {CAPACITY})
              >= {number(s.traffic_share_of_capacity)}
            # ...while the GPU's own work stalls
            and
            {UTILIZATION} <= {number(s.gpu_utilization_at_most)}"""),
        s.for_seconds, "warning",
        "GPU <gpu> on <instance> is starved by PCIe: link <value|humanizePercentage> full, "
        "GPU <util|humanizePercentage> busy",
        "GPU <gpu> (<uuid>) moved <traffic|humanize>B/s over PCIe in its busier direction "
        "(1 min average); the direction nearest its capacity ran at <value|humanizePercentage> of "
        "it (capacity up to <capacity|humanize>B/s: what hybridmon bench measured on this host, "
        "else the theoretical rate of the current generation and width; threshold "
        f"{humanize_percentage(s.traffic_share_of_capacity)}), while its utilization was "
        f"<util|humanizePercentage> (threshold: at most {humanize_percentage(s.gpu_utilization_at_most)}). "
        "The GPU waits on host-device copies: offloaded KV cache or weights cross the bus faster "
        "than it can carry them, and tokens/s collapse. First find the process driving the "
        "traffic (nvidia-smi dmon -s t, nvidia-smi pmon) and shrink what it moves per token.",
        queries={
            "traffic": _gpu("max without (direction) ({})", THROUGHPUT),
            "capacity": _gpu("max without (direction) ({})", CAPACITY),
            "util": _gpu("{}", UTILIZATION),
        },
    )


def link_degraded(t: Thresholds) -> Alert:
    d = t.pcie_link_degraded
    return Alert(
        "GpuPcieLinkDegraded",
        dedent(f"""\
            # the share of its full capacity the link runs at...
            {CAPACITY_THEORETICAL}
              / {MAX_CAPACITY}
            # ...when the generation or the width is below the maximum...
            and
            (
                hybridmon_gpu_pcie_link_generation < hybridmon_gpu_pcie_link_max_generation
              or
                hybridmon_gpu_pcie_link_width_lanes < hybridmon_gpu_pcie_link_max_width_lanes
            )
            # ...while the GPU is busy (links slow down at idle on purpose)
            and
            {UTILIZATION} >= {number(d.busy_utilization_at_least)}"""),
        d.for_seconds, "warning",
        "GPU <gpu> on <instance>: PCIe link at Gen<gen> x<width> of Gen<max_gen> x<max_width> "
        "while busy",
        "GPU <gpu> (<uuid>) runs its PCIe link at Gen<gen> x<width>, below the Gen<max_gen> "
        "x<max_width> it and its slot support, so the link carries <value|humanizePercentage> of "
        "its full capacity. The GPU is <util|humanizePercentage> busy (threshold: the link is "
        f"judged only at or above {humanize_percentage(d.busy_utilization_at_least)} utilization, "
        "because links drop speed at idle to save power). A link that stays downtrained under load points at a "
        "poorly seated card or riser, a BIOS lane or speed setting, or signal errors: compare "
        "LnkSta with LnkCap (lspci -vvv) and look at the replay and AER counters.",
        queries={
            "gen": _gpu("{}", "hybridmon_gpu_pcie_link_generation"),
            "width": _gpu("{}", "hybridmon_gpu_pcie_link_width_lanes"),
            "max_gen": _gpu("{}", "hybridmon_gpu_pcie_link_max_generation"),
            "max_width": _gpu("{}", "hybridmon_gpu_pcie_link_max_width_lanes"),
            "util": _gpu("{}", UTILIZATION),
        },
    )


def replay_errors(t: Thresholds) -> Alert:
    e = t.pcie_errors
    window = duration(e.window_seconds)
    return Alert(
        "GpuPcieReplayErrors",
        f"{replay_rate_record(t)} * 60 > {REPLAY_BOUND}",
        0, "warning",
        "GPU <gpu> on <instance>: <value|humanize> PCIe replays per minute, above DCGM's bound of "
        "<bound|humanize>",
        f"GPU <gpu> (<uuid>) resent <value|humanize> PCIe packets per minute over the last {window}. "
        "DCGM's health watch allows ceil(bit error rate x line rate x 60 x lanes) per minute; at a "
        f"bit error rate of {e.bit_error_rate!r} that threshold is <bound|humanize> per minute on "
        "its current Gen<gen> x<width> link. Each replay is a corrupted packet sent again: a marginal slot, "
        "riser or card that costs bandwidth now and often ends in a downtrained link or a GPU "
        "lost from the bus. Check the AER counters and the kernel log for the same device.",
        queries={
            "bound": _gpu("{}", REPLAY_BOUND),
            "gen": _gpu("{}", "hybridmon_gpu_pcie_link_generation"),
            "width": _gpu("{}", "hybridmon_gpu_pcie_link_width_lanes"),
        },
    )


def aer_errors(t: Thresholds) -> list[Alert]:
    e = t.pcie_errors
    window = duration(e.window_seconds)
    rename = '"aer_severity", "$1", "severity", "(.*)"'
    alerts = []
    if e.aer_uncorrectable_any:
        alerts.append(Alert(
            "PcieAerErrors",
            dedent(f"""\
                label_replace(
                  increase(hybridmon_pcie_aer_errors_total{{severity=~"nonfatal|fatal"}}[{window}]) > 0,
                  {rename}
                )"""),
            0, "critical",
            "PCIe device <pci_bus_id> on <instance>: <value|humanize> new <aer_severity> AER errors",
            f"The PCIe function <pci_bus_id> reported <value|humanize> uncorrectable "
            f"(<aer_severity>) AER errors in the last {window} (threshold: any). Uncorrectable "
            "errors lose or corrupt transactions: the driver may reset the GPU, in-flight requests "
            "fail, and a fatal error can take the device off the bus. Read the kernel log for this "
            "device's AER and Xid messages, drain the host, and reseat or replace the riser or card.",
        ))
    alerts.append(Alert(
        "PcieAerErrors",
        dedent(f"""\
            label_replace(
              rate(hybridmon_pcie_aer_errors_total{{severity="correctable"}}[{window}]) * 3600
                > {number(e.aer_correctable_per_hour)},
              {rename}
            )"""),
        0, "warning",
        "PCIe device <pci_bus_id> on <instance>: <value|humanize> correctable AER errors per hour",
        f"The PCIe function <pci_bus_id> reported correctable AER errors at <value|humanize> per "
        f"hour over the last {window} (threshold {humanize(e.aer_correctable_per_hour)} per hour). "
        "The link corrects them by retrying, but a steady stream means a marginal link that loses "
        "bandwidth and often goes on to downtrain or to raise uncorrectable errors. Check the "
        "link's state (lspci -vvv) and the kernel log, and plan to reseat the card or riser.",
    ))
    return alerts


def gpu_lost(t: Thresholds) -> Alert:
    wait = t.gpu_lost.for_seconds
    when = "at once" if wait == 0 else f"after {duration(wait)}"
    return Alert(
        "GpuLost",
        "# NVML reports the GPU lost (labels gpu, uuid)...\n"
        "hybridmon_gpu_up == 0\n"
        "# ...or its PCI function has left the bus (label pci_bus_id)\n"
        "or\n"
        "hybridmon_pcie_device_present == 0",
        wait, "critical",
        "<if gpu>GPU <gpu> on <instance> is lost: NVML reports it gone"
        "<else>GPU PCI function <pci_bus_id> on <instance> has left the PCI bus<end>",
        "<if gpu>NVML reports GPU <gpu> (<uuid>) lost (hybridmon_gpu_up <value>): it fell off the "
        "bus or stopped answering.<else>The NVIDIA PCI function <pci_bus_id> was on the bus earlier "
        "and is gone from sysfs now (hybridmon_pcie_device_present <value>): the GPU fell off the "
        f"bus or was removed.<end> Threshold: any loss, alerting {when}. Every process using it "
        "has failed or will, and it does not come back without a GPU reset or a reboot. Drain the "
        "host, read the kernel log for Xid 79, AER and pciehp messages, then reset the GPU "
        "(nvidia-smi -r) or reboot; if it happens again, reseat or replace the riser or card.",
    )


def memory_slope_record(t: Thresholds) -> str:
    return f"gpu:hybridmon_gpu_memory_used_bytes:slope{duration(t.gpu_memory_headroom.trend_window_seconds)}"


def memory_headroom(t: Thresholds) -> list[Alert]:
    h = t.gpu_memory_headroom
    trend = duration(h.trend_window_seconds)
    slope = memory_slope_record(t)
    spans = data_spans("hybridmon_gpu_memory_used_bytes", h.trend_window_seconds, h.trend_window_seconds / 2)
    return [
        Alert(
            "GpuMemoryHeadroomLow",
            f"{MEMORY_USED} / hybridmon_gpu_memory_total_bytes >= {number(h.used_share)}",
            h.for_seconds, "warning",
            "GPU <gpu> on <instance>: <value|humanizePercentage> of its memory in use",
            "GPU <gpu> (<uuid>) has <used|humanize1024>B of its <total|humanize1024>B in use "
            "(<value|humanizePercentage>, 1 min average; threshold "
            f"{humanize_percentage(h.used_share)}, where offloading should start). The next long "
            "context or larger batch does not fit: the server preempts requests, fails "
            "allocations or dies out of memory. Offload the older KV cache to host memory in "
            "tiers, use smaller KV pages, or lower the context and batch limits.",
            labels={"reason": "used"},
            queries={"used": _gpu("{}", MEMORY_USED),
                     "total": _gpu("{}", "hybridmon_gpu_memory_total_bytes")},
        ),
        Alert(
            "GpuMemoryHeadroomLow",
            dedent(f"""\
                # seconds until full at the current slope...
                (hybridmon_gpu_memory_total_bytes - {MEMORY_USED})
                  / ({slope} > 0)
                  <= {number(h.forecast_horizon_seconds)}
                # ...measured over at least half the trend window
                and
                {spans}"""),
            h.for_seconds, "warning",
            "GPU <gpu> on <instance>: memory full in <value|humanizeDuration> at the current trend",
            "GPU <gpu> (<uuid>) memory use rises by <per_hour|humanize1024>B per hour "
            f"(median of the local slopes over {trend}); with <free|humanize1024>B left it is full in "
            f"<value|humanizeDuration> (threshold {duration(h.forecast_horizon_seconds)}). When it "
            "fills, requests are preempted or fail. Find the process that grows "
            "(nvidia-smi --query-compute-apps=pid,used_memory --format=csv) and whether it grows "
            "with its load or without it.",
            labels={"reason": "forecast"},
            queries={"per_hour": _gpu("{} * 3600", slope),
                     "free": _gpu(f"{{}} - {MEMORY_USED}", "hybridmon_gpu_memory_total_bytes")},
        ),
    ]


def groups(t: Thresholds) -> list[Group]:
    return [
        Group("hybridmon-pcie", (*recordings(t), starvation(t), link_degraded(t), replay_errors(t),
                                 *aer_errors(t), gpu_lost(t))),
        Group("hybridmon-gpu-memory", (*memory_recordings(t), *memory_headroom(t))),
    ]
