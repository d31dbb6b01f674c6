"""GpuPcieLinkDegraded: a busy GPU's PCIe link runs below the generation or width it and its slot
support. Links drop speed at idle by design, so only a busy GPU is judged; a link that stays
downtrained under load points at the riser, slot, seating or BIOS. Runbook: GpuPcieLinkDegraded.md.
"""
from __future__ import annotations

from textwrap import dedent

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import common, windows
from hybridmon.agent.detectors.base import DetectorBase, Finding, HistoryReader
from hybridmon.exporters.gpu import (PCIE_LINK_GENERATION, PCIE_LINK_MAX_GENERATION, PCIE_LINK_MAX_WIDTH,
                                     PCIE_LINK_WIDTH, UTILIZATION)
from hybridmon.pcie_rates import theoretical_capacity
from hybridmon.rules import groups
from hybridmon.rules import pcie as recorded
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import gpu_query, number
from hybridmon.rules.templates import humanize_percentage

INPUTS = (UTILIZATION, PCIE_LINK_GENERATION, PCIE_LINK_WIDTH, PCIE_LINK_MAX_GENERATION, PCIE_LINK_MAX_WIDTH)


class Settings(Section):
    busy_utilization_at_least: float
    for_seconds: float


def alert(d: Settings) -> Alert:
    return Alert(
        "GpuPcieLinkDegraded",
        dedent(f"""\
            # the share of its full capacity the link runs at...
            {recorded.CAPACITY_THEORETICAL}
              / {recorded.MAX_CAPACITY}
            # ...when the generation or the width is below the maximum...
            and
            (
                {PCIE_LINK_GENERATION.name} < {PCIE_LINK_MAX_GENERATION.name}
              or
                {PCIE_LINK_WIDTH.name} < {PCIE_LINK_MAX_WIDTH.name}
            )
            # ...while the GPU is busy (links slow down at idle on purpose)
            and
            {recorded.UTILIZATION} >= {number(d.busy_utilization_at_least)}"""),
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
            "gen": gpu_query("{}", PCIE_LINK_GENERATION.name),
            "width": gpu_query("{}", PCIE_LINK_WIDTH.name),
            "max_gen": gpu_query("{}", PCIE_LINK_MAX_GENERATION.name),
            "max_width": gpu_query("{}", PCIE_LINK_MAX_WIDTH.name),
            "util": gpu_query("{}", recorded.UTILIZATION),
        },
    )


class Detector(DetectorBase):
    """Current generation < max generation or current width < max width (current values, not
    averages: a link state), while utilization (avg 1m) is at least busy_utilization_at_least."""

    name = "pcie_link_degraded"
    alertnames = ("GpuPcieLinkDegraded",)
    min_history_seconds = windows.AVERAGE_SECONDS

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.alert = alert(config)

    def evaluate(self, history: HistoryReader, now: float) -> list[Finding]:
        utilization = common.gpu_averages(history, UTILIZATION.name, now)
        generation = common.gpu_latest(history, PCIE_LINK_GENERATION.name, now)
        max_generation = common.gpu_latest(history, PCIE_LINK_MAX_GENERATION.name, now)
        width = common.gpu_latest(history, PCIE_LINK_WIDTH.name, now)
        max_width = common.gpu_latest(history, PCIE_LINK_MAX_WIDTH.name, now)
        findings = []
        for key, busy in sorted(utilization.items()):
            link_state = (generation.get(key), width.get(key), max_generation.get(key), max_width.get(key))
            if any(value is None for value in link_state) or busy < self.config.busy_utilization_at_least:
                continue
            gen, lanes, best_gen, best_lanes = link_state
            if gen >= best_gen and lanes >= best_lanes:
                continue
            current = theoretical_capacity(gen, lanes)
            best = theoretical_capacity(best_gen, best_lanes)
            if not current or not best:
                continue
            findings.append(finding(
                self.alert, common.gpu_entity(key), current / best, 1.0, unit="ratio",
                values={"gen": gen, "width": lanes, "max_gen": best_gen, "max_width": best_lanes,
                        "util": busy},
                details={"capacity_bytes_per_second": current, "max_capacity_bytes_per_second": best,
                         "link_generation": gen, "link_max_generation": best_gen,
                         "link_width_lanes": lanes, "link_max_width_lanes": best_lanes,
                         "gpu_utilization_ratio": busy}))
        return findings


FAMILY = AlertFamily(
    section="pcie_link_degraded",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group=groups.PCIE,
    detector=Detector,
    alerts=lambda t: (alert(t.pcie_link_degraded),),
    collectors=("gpu",),
    lookback_seconds=lambda settings: settings.for_seconds,
    scenario="pcie_link_degraded",
)
