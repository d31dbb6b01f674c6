"""GpuPcieBandwidthLow: what `hybridmon bench` measured is far below what the GPU's best link
should carry. A judgement on a stored measurement, not on live traffic: the finding holds from the
moment the agent reads the run until a new run replaces it. Runs forced beside a busy GPU are not
judged (exporters/bench.py leaves their capacity out), nor GPUs whose maximum link NVML does not
report. Runbook: GpuPcieBandwidthLow.md.
"""
from __future__ import annotations

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import common
from hybridmon.agent.detectors.base import DetectorBase, Finding, HistoryReader
from hybridmon.exporters.bench import MEASURED_CAPACITY, TIMESTAMP
from hybridmon.exporters.gpu import PCIE_LINK_MAX_GENERATION, PCIE_LINK_MAX_WIDTH
from hybridmon.pcie_rates import link_name, theoretical_capacity
from hybridmon.rules import groups
from hybridmon.rules import pcie as recorded
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import by_generation, gpu_query
from hybridmon.rules.templates import humanize_percentage

INPUTS = (MEASURED_CAPACITY, TIMESTAMP, PCIE_LINK_MAX_GENERATION, PCIE_LINK_MAX_WIDTH)
GENERATIONS = range(1, 7)  # the rule spells out a floor for each generation NVML can report


class Settings(Section):
    floor_share_gen4: float
    floor_share_gen5: float
    floor_share_other: float

    def floor_share(self, generation: float) -> float:
        """The share of the theoretical rate below which a measurement counts as low."""
        return {4: self.floor_share_gen4, 5: self.floor_share_gen5}.get(
            int(round(generation)), self.floor_share_other)


def floor_shares(b: Settings) -> dict[int, tuple[str, str]]:
    """Per generation: (the floor as a PromQL literal, where it comes from)."""
    why = {4: "Azure's 24 GB/s on x16", 5: "Azure's 52 GB/s on x16"}
    return {g: (repr(b.floor_share(g)), why.get(g, "no published floor")) for g in GENERATIONS}


def alert(b: Settings) -> Alert:
    shares = by_generation(PCIE_LINK_MAX_GENERATION.name, floor_shares(b), " " * 4)
    return Alert(
        "GpuPcieBandwidthLow",
        "# the slower direction of the measured capacity, as a share of the best link...\n"
        f"min without (direction) ({MEASURED_CAPACITY.name})\n"
        f"  / {recorded.MAX_CAPACITY}\n"
        "# ...below the floor for that link's generation\n"
        f"<\n(\n{shares}\n)",
        0, "warning",
        "GPU <gpu> on <instance>: hybridmon bench measured <measured|humanize>B/s over PCIe, "
        "<value|humanizePercentage> of its Gen<max_gen> x<max_width> link",
        "The latest hybridmon bench run on GPU <gpu> (<uuid>) moved pinned, NUMA-local copies at "
        "<measured|humanize>B/s in its slower direction: <value|humanizePercentage> of the "
        "<best|humanize>B/s its best link, Gen<max_gen> x<max_width>, carries (thresholds: "
        f"{humanize_percentage(b.floor_share_gen4)} on Gen4, {humanize_percentage(b.floor_share_gen5)} "
        f"on Gen5, {humanize_percentage(b.floor_share_other)} otherwise, after Azure's GPU health "
        "checks, which fail a node below 24 GB/s on Gen4 x16 and 52 GB/s on Gen5 x16). Every "
        "offloaded KV block and weight reload is that much slower. Usual causes: a link trained "
        "down under load (slot, riser, seating), host memory on the wrong NUMA node, IOMMU or ACS "
        "settings, another device sharing the switch. Check the link while copying "
        "(nvidia-smi -q -d PCIE), the NUMA placement and the PCIe topology, then run hybridmon "
        "bench again on an idle GPU.",
        queries={
            "measured": gpu_query("min without (direction) ({})", MEASURED_CAPACITY.name),
            "best": gpu_query("{}", recorded.MAX_CAPACITY),
            "max_gen": gpu_query("{}", PCIE_LINK_MAX_GENERATION.name),
            "max_width": gpu_query("{}", PCIE_LINK_MAX_WIDTH.name),
        },
    )


class Detector(DetectorBase):
    """The slower direction of the measured capacity below floor_share(max generation) x the
    theoretical rate of max generation x max width."""

    name = "pcie_bandwidth_low"
    alertnames = ("GpuPcieBandwidthLow",)

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.alert = alert(config)

    def evaluate(self, history: HistoryReader, now: float) -> list[Finding]:
        max_generation = common.gpu_latest(history, PCIE_LINK_MAX_GENERATION.name, now)
        max_width = common.gpu_latest(history, PCIE_LINK_MAX_WIDTH.name, now)
        measured_at = common.gpu_latest(history, TIMESTAMP.name, now)
        measured_capacity = common.gpu_directions(history, MEASURED_CAPACITY.name, now)
        findings = []
        for key, directions in sorted(measured_capacity.items()):
            generation, lanes = max_generation.get(key), max_width.get(key)
            best = theoretical_capacity(generation, lanes) if generation and lanes else None
            if best is None:
                continue
            direction, slowest = min(directions.items(), key=lambda item: item[1])
            share, floor = slowest / best, self.config.floor_share(generation)
            if share >= floor:
                continue
            details: dict[str, float | str] = {
                "direction": direction, "measured_bytes_per_second": slowest,
                "floor_bytes_per_second": floor * best, "max_capacity_bytes_per_second": best,
                "link": link_name(generation, lanes)}
            for name, value in directions.items():
                details[f"{name}_bytes_per_second"] = value
            if measured_at.get(key) is not None:
                details["measured_at"] = measured_at[key]
            findings.append(finding(
                self.alert, common.gpu_entity(key), share, floor, unit="ratio",
                values={"measured": slowest, "best": best, "max_gen": generation, "max_width": lanes},
                details=details))
        return findings


FAMILY = AlertFamily(
    section="pcie_bandwidth_low",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group=groups.BENCH,
    detector=Detector,
    alerts=lambda t: (alert(t.pcie_bandwidth_low),),
    collectors=("gpu", "bench"),
    lookback_seconds=lambda settings: 0.0,
    no_scenario=("it judges what `hybridmon bench` stored, and the synthetic hosts run no benchmark; its "
                 "unit tests read stored reports"),
)
