"""PcieUplinkStarvation: the one PCIe link that several GPUs behind a switch share on their way to
the CPU is full with their sum, while a GPU behind it idles, waiting on host-device copies
(issue 29). Dense servers put two to four GPUs behind one switch whose uplink to the root port is
a single x16 link: four GPUs each at 40 % of their own link fill it, and GpuPcieStarvation, which
judges each GPU against its own link, sees nothing. The two are different causes: a GPU's own link
full is that GPU moving too much; a shared uplink full is the GPUs behind one switch moving too
much together, and moving one of them behind another root port fixes it.

Where the GPUs hang comes from sysfs (exporters/pcie_topology.py: hybridmon_pcie_uplink_info names
each GPU's shared uplink by the PCI address of the switch port below it). Traffic is each GPU's 1 min
rate as GpuPcieStarvation reads it (byte counter, else sampled bytes, else the gauge's average),
summed per uplink and direction. The uplink is sized like a GPU's link, by what copies achieve at
the best generation x width it ran at over the minute (pcie_rates.effective_capacity, no benchmark:
`hybridmon bench` measures one GPU at a time), each direction alone and both together
(pcie_rates.bidirectional_capacity). Runbook: PcieUplinkStarvation.md.
"""
from __future__ import annotations

from textwrap import dedent

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import common, windows
from hybridmon.agent.detectors.base import DetectorBase, Finding, HistoryReader
from hybridmon.agent.detectors.links import UplinkLoad
from hybridmon.exporters.gpu import GPU_INFO, PCIE_BYTES, PCIE_SAMPLED_BYTES, PCIE_THROUGHPUT, UTILIZATION
from hybridmon.exporters.pcie_topology import UPLINK_GENERATION, UPLINK_INFO, UPLINK_WIDTH
from hybridmon.pcie_rates import bidirectional_capacity, effective_capacity, link_name
from hybridmon.rules import groups
from hybridmon.rules import pcie as recorded
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import number, query
from hybridmon.rules.templates import humanize_percentage

INPUTS = (UPLINK_INFO, UPLINK_GENERATION, UPLINK_WIDTH, GPU_INFO, PCIE_BYTES, PCIE_SAMPLED_BYTES,
          PCIE_THROUGHPUT, UTILIZATION)
HOST_TO_DEVICE, DEVICE_TO_HOST = recorded.DIRECTIONS


class Settings(Section):
    traffic_share_of_capacity: float = 0.90
    gpu_utilization_at_most: float = 0.50
    for_seconds: float = 120


def uplink_query(template: str, metric: str, **fixed: str) -> tuple[str, tuple[str, ...]]:
    return query(template, metric, "uplink", **fixed)


def alert(s: Settings) -> Alert:
    return Alert(
        "PcieUplinkStarvation",
        dedent(f"""\
            # the fullest of: each direction of the GPUs' summed traffic against what the shared
            # uplink carries that way, and both directions together against what it carries both
            # ways at once...
            max without (direction) ({recorded.UPLINK_TRAFFIC_SHARE})
              >= {number(s.traffic_share_of_capacity)}
            # ...while at least one GPU behind it stalls
            and
            count without (gpu, uuid) (
              {recorded.UTILIZATION}
              * ignoring (uplink) group_left (uplink)
              {recorded.GPU_UPLINK}
              <= {number(s.gpu_utilization_at_most)}
            )"""),
        s.for_seconds, "warning",
        "PCIe switch uplink <uplink> on <instance> is <value|humanizePercentage> full with the "
        "traffic of the <gpus> GPUs behind it",
        "The <gpus> GPUs behind PCIe switch port <uplink> share one Gen<gen> x<width> link to the "
        "CPU's root port, and together moved <to_gpu|humanize>B/s host to device and "
        "<from_gpu|humanize>B/s device to host through it (1 min average); of that traffic: "
        "<shares|gpuShares>. What the uplink carries: up to <capacity|humanize>B/s each way and "
        "<both|humanize>B/s both ways at once (what copies achieve on Gen<gen> x<width>). The fuller "
        "of one direction alone and both together ran at <value|humanizePercentage> of that "
        f"(threshold {humanize_percentage(s.traffic_share_of_capacity)}), while at least one of "
        f"those GPUs was at most {humanize_percentage(s.gpu_utilization_at_most)} busy. This is the "
        "shared uplink, not a GPU's own link: each GPU may be well inside its own link "
        "(GpuPcieStarvation judges those one by one), but their sum fills the one link they share, "
        "so each gets less than its own link would carry and waits on its copies. Move one of the "
        "offloading servers to a GPU behind another root port (nvidia-smi topo -m, lspci -tv), "
        "stagger their loads, or shrink what each moves per token.",
        queries={
            "to_gpu": uplink_query("{}", recorded.UPLINK_TRAFFIC, direction=HOST_TO_DEVICE),
            "from_gpu": uplink_query("{}", recorded.UPLINK_TRAFFIC, direction=DEVICE_TO_HOST),
            "capacity": uplink_query("{}", recorded.UPLINK_ACHIEVABLE),
            "both": uplink_query("{}", recorded.UPLINK_BIDIRECTIONAL_ACHIEVABLE),
            "gen": uplink_query("max_over_time({}[1m])", UPLINK_GENERATION.name),
            "width": uplink_query("max_over_time({}[1m])", UPLINK_WIDTH.name),
            "gpus": uplink_query("count({})", recorded.GPU_UPLINK),
            "shares": uplink_query("sort_desc({})", recorded.UPLINK_TRAFFIC_PART),
        },
    )


def _latest_by(history: HistoryReader, metric: str, now: float, label: str, reduce=windows.latest) -> dict[str, float]:
    found = {}
    for series in history.series(metric):
        value = reduce(series, now)
        if value is not None:
            found[series.labels[label]] = value
    return found


def gpus_behind_uplinks(history: HistoryReader, now: float) -> dict[str, tuple[str, list[tuple[str, ...]]]]:
    """uplink -> (root port, the (gpu, uuid) of each GPU behind it), as the rule's GPU_UPLINK joins
    hybridmon_pcie_uplink_info with hybridmon_gpu_info by pci_bus_id, both as they are now."""
    gpu_of_bus = {}
    for series in history.series(GPU_INFO.name):
        if windows.latest(series, now) is not None:
            gpu_of_bus[series.labels.get("pci_bus_id", "")] = (series.labels["gpu"], series.labels["uuid"])
    behind: dict[str, tuple[str, list[tuple[str, ...]]]] = {}
    for series in history.series(UPLINK_INFO.name):
        gpu = gpu_of_bus.get(series.labels["pci_bus_id"])
        if gpu is not None and windows.latest(series, now) is not None:
            behind.setdefault(series.labels["uplink"], (series.labels["root_port"], []))[1].append(gpu)
    return behind


class Detector(DetectorBase):
    """Per shared uplink: the sum of its GPUs' traffic per direction over the uplink's achievable
    capacity, and both directions' sum over its bidirectional capacity; the fullest at or above
    traffic_share_of_capacity while a GPU behind it averages at most gpu_utilization_at_most
    (1 min). Traffic per GPU as GpuPcieStarvation reads it; capacity at the best generation x width
    of the uplink over the minute."""

    name = "pcie_uplink_starvation"
    alertnames = ("PcieUplinkStarvation",)
    min_history_seconds = windows.AVERAGE_SECONDS

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.alert = alert(config)

    def evaluate(self, history: HistoryReader, now: float) -> list[Finding]:
        behind = gpus_behind_uplinks(history, now)
        generation = _latest_by(history, UPLINK_GENERATION.name, now, "uplink", windows.max_over_time)
        width = _latest_by(history, UPLINK_WIDTH.name, now, "uplink", windows.max_over_time)
        traffic = common.gpu_traffic(history, PCIE_BYTES.name, PCIE_SAMPLED_BYTES.name, PCIE_THROUGHPUT.name, now)
        utilization = common.gpu_averages(history, UTILIZATION.name, now)
        findings, loads = [], {}
        for uplink, (root_port, gpus) in sorted(behind.items()):
            gen, lanes = generation.get(uplink), width.get(uplink)
            directions = {direction: sum(traffic[gpu][direction] for gpu in gpus
                                         if direction in traffic.get(gpu, {}))
                          for direction in recorded.DIRECTIONS
                          if any(direction in traffic.get(gpu, {}) for gpu in gpus)}
            each_way = effective_capacity(None, gen, lanes)
            both = bidirectional_capacity(gen, lanes) if gen is not None and lanes is not None else None
            shares = ({direction: value / each_way.bytes_per_second for direction, value in directions.items()}
                      if each_way else {})
            if both and directions:
                shares[recorded.BOTH] = sum(directions.values()) / both
            total = sum(directions.values())
            parts = sorted(((gpu, sum(traffic[gpu].values()) / total if total else None)
                            for gpu in gpus if traffic.get(gpu)),
                           key=lambda item: (-(item[1] or 0.0), item[0]))
            link = link_name(gen, lanes) if gen is not None and lanes is not None else None
            share = max(shares.values()) if shares else None
            loads[(uplink,)] = UplinkLoad(uplink, root_port, link,
                                          tuple((gpu[0], part) for gpu, part in parts), share)
            stalled = [gpu for gpu in gpus if utilization.get(gpu, 1.0) <= self.config.gpu_utilization_at_most]
            if share is None or share < self.config.traffic_share_of_capacity or not stalled:
                continue
            judged = max(shares, key=shares.__getitem__)
            judged_capacity = both if judged == recorded.BOTH else each_way.bytes_per_second  # type: ignore[union-attr]
            details: dict[str, float | str] = {
                "direction": judged,
                "traffic_bytes_per_second": total if judged == recorded.BOTH else directions[judged],
                "capacity_bytes_per_second": judged_capacity,
                "threshold_bytes_per_second": self.config.traffic_share_of_capacity * judged_capacity,
                "root_port": root_port,
                "link": link or "",
                "gpus": ", ".join(gpu[0] for gpu in sorted(gpus)),
                "stalled_gpus": ", ".join(gpu[0] for gpu in sorted(stalled)),
            }
            for name, value in shares.items():
                details[f"{name}_share_of_capacity"] = value
            for gpu, part in parts:
                if part is not None:
                    details[f"gpu_{gpu[0]}_part_of_traffic"] = part
            findings.append(finding(
                self.alert, {"uplink": uplink}, share, self.config.traffic_share_of_capacity, unit="ratio",
                values={"to_gpu": directions.get(HOST_TO_DEVICE), "from_gpu": directions.get(DEVICE_TO_HOST),
                        "capacity": each_way.bytes_per_second if each_way else None, "both": both,
                        "gen": gen, "width": lanes, "gpus": len(gpus),
                        "shares": [(gpu[0], part) for gpu, part in parts if part is not None]},
                details=details))
        # Per uplink (its address): what the status page shows beside each GPU behind it.
        self.figures = loads
        return findings


FAMILY = AlertFamily(
    section="pcie_uplink_starvation",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group=groups.PCIE,
    detector=Detector,
    alerts=lambda t: (alert(t.pcie_uplink_starvation),),
    collectors=("gpu", "pcie"),
    lookback_seconds=lambda settings: settings.for_seconds,
    scenario="pcie_uplink_starvation",
)
