"""Rules on what `hybridmon bench` measured: the link capacity starvation divides by, and the
GpuPcieBandwidthLow alert when a measurement is far below the link's theoretical rate."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the schema is built from the families, which import these rules
    from hybridmon.agent.alerts.catalogue import Thresholds

from hybridmon.rules import pcie
from hybridmon.rules.model import Alert, Group
from hybridmon.rules.promql import by_generation, query
from hybridmon.rules.templates import humanize_percentage

MEASURED = "hybridmon_gpu_pcie_measured_capacity_bytes_per_second"
GENERATIONS = range(1, 7)


def floor_shares(t: Thresholds) -> dict[int, tuple[str, str]]:
    b = t.pcie_bandwidth_low
    why = {4: "Azure's 24 GB/s on x16", 5: "Azure's 52 GB/s on x16"}
    return {g: (repr(b.floor_share(g)), why.get(g, "no published floor")) for g in GENERATIONS}


def bandwidth_low(t: Thresholds) -> Alert:
    b = t.pcie_bandwidth_low
    shares = by_generation("hybridmon_gpu_pcie_link_max_generation", floor_shares(t), " " * 4)
    return Alert(
        "GpuPcieBandwidthLow",
        "# the slower direction of the measured capacity, as a share of the best link...\n"
        f"min without (direction) ({MEASURED})\n"
        f"  / {pcie.MAX_CAPACITY}\n"
        "# ...below the floor for that link's generation\n"
        f"<\n(\n{shares}\n)",
        0, "warning",
        "GPU <gpu> on <instance>: measured PCIe bandwidth <value|humanizePercentage> of its link",
        "The latest hybridmon bench run on GPU <gpu> (<uuid>) moved pinned, NUMA-local copies at "
        "<measured|humanize>B/s in its slower direction: <value|humanizePercentage> of the "
        "<best|humanize>B/s its best link carries (thresholds: "
        f"{humanize_percentage(b.floor_share_gen4)} on Gen4, {humanize_percentage(b.floor_share_gen5)} "
        f"on Gen5, {humanize_percentage(b.floor_share_other)} otherwise, after Azure's GPU health "
        "checks). Every offloaded KV block and weight reload is that much slower. Check the link "
        "while copying (nvidia-smi -q -d PCIE), the NUMA placement and the PCIe topology, then run "
        "hybridmon bench again on an idle GPU.",
        queries={
            "measured": query("min without (direction) ({})", MEASURED, "gpu"),
            "best": query("{}", pcie.MAX_CAPACITY, "gpu"),
        },
    )


def groups(t: Thresholds) -> list[Group]:
    return [Group("hybridmon-bench", (bandwidth_low(t),))]
