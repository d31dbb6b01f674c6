"""GpuPcieStarvation: a GPU's PCIe link is full while the GPU itself idles, waiting on host-device
copies (offloaded KV cache or weights). "Full" is judged against what the link carries in
practice, not its theoretical rate, which no copy reaches: what `hybridmon bench` measured on this
host where it has run, else the theoretical rate x the share copy engines achieve at its generation
(pcie_rates.ACHIEVABLE_SHARE). Each direction is judged alone, and both together against what the
link carries both ways at once: the sum of what the bench measured each way while the other way
copied too, else the bidirectional share (pcie_rates.BIDIRECTIONAL_SHARE); under bidirectional load
neither direction gets near its own capacity. Traffic is the 1 min rate of NVML's cumulative PCIe
byte counters where the GPU has them, else the 1 min rate of the agent's sampled-bytes estimate
(all of its ~10 samples a second), else the 1 min average of the throughput gauge (with a 15 s
scrape, 4 values: far noisier, docs/nvml-cost.md); the link is sized by the best generation and
width it ran at over that same minute, because it drops to Gen1 within moments of going idle.
Runbook: GpuPcieStarvation.md.
"""
from __future__ import annotations

from textwrap import dedent

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import common, windows
from hybridmon.agent.detectors.links import DirectionLoad
from hybridmon.agent.detectors.base import DetectorBase, Finding, HistoryReader
from hybridmon.exporters.bench import MEASURED_BIDIRECTIONAL_CAPACITY, MEASURED_CAPACITY
from hybridmon.exporters.gpu import (PCIE_BYTES, PCIE_LINK_GENERATION, PCIE_LINK_WIDTH, PCIE_SAMPLED_BYTES,
                                     PCIE_THROUGHPUT, UTILIZATION)
from hybridmon.pcie_rates import bidirectional_capacity, effective_capacity
from hybridmon.rules import groups
from hybridmon.rules import pcie as recorded
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import gpu_query, number, query
from hybridmon.rules.templates import humanize_percentage

INPUTS = (PCIE_BYTES, PCIE_SAMPLED_BYTES, PCIE_THROUGHPUT, UTILIZATION, PCIE_LINK_GENERATION, PCIE_LINK_WIDTH,
          MEASURED_CAPACITY, MEASURED_BIDIRECTIONAL_CAPACITY)
HOST_TO_DEVICE, DEVICE_TO_HOST = recorded.DIRECTIONS


class Settings(Section):
    traffic_share_of_capacity: float
    gpu_utilization_at_most: float
    for_seconds: float


def alert(s: Settings) -> Alert:
    return Alert(
        "GpuPcieStarvation",
        dedent(f"""\
            # the fullest of: each direction against what the link carries that way, and both
            # directions together against what it carries both ways at once...
            max without (direction) ({recorded.TRAFFIC_SHARE})
              >= {number(s.traffic_share_of_capacity)}
            # ...while the GPU's own work stalls
            and
            {recorded.UTILIZATION} <= {number(s.gpu_utilization_at_most)}"""),
        s.for_seconds, "warning",
        "GPU <gpu> on <instance> is starved by PCIe: link <value|humanizePercentage> full, "
        "GPU <util|humanizePercentage> busy",
        "GPU <gpu> (<uuid>) moved <to_gpu|humanize>B/s host to device and <from_gpu|humanize>B/s device to "
        "host over PCIe (1 min average). What its link carries: up to <capacity|humanize>B/s each "
        "way and <both|humanize>B/s both ways at once (what hybridmon bench measured on this host, "
        "else what copies achieve on the best link it ran in the minute, Gen<gen> x<width>). The "
        "fuller of one direction alone and both together ran at <value|humanizePercentage> of "
        f"that (threshold {humanize_percentage(s.traffic_share_of_capacity)}), while its utilization "
        f"was <util|humanizePercentage> (threshold: at most {humanize_percentage(s.gpu_utilization_at_most)}). "
        "The GPU waits on host-device copies: offloaded KV cache or weights cross the bus faster "
        "than it can carry them, so tokens/s collapse and long contexts stall. First find the "
        "process driving the traffic (nvidia-smi dmon -s t, nvidia-smi pmon) and shrink what it "
        "moves per token (keep the hot KV blocks in VRAM, use smaller offload pages), and keep the "
        "server's cores and memory on the GPU's NUMA node.",
        queries={
            "to_gpu": query("{}", recorded.TRAFFIC, "gpu", direction=HOST_TO_DEVICE),
            "from_gpu": query("{}", recorded.TRAFFIC, "gpu", direction=DEVICE_TO_HOST),
            "capacity": gpu_query("max without (direction) ({})", recorded.CAPACITY),
            "both": gpu_query("{}", recorded.BIDIRECTIONAL_CAPACITY),
            "util": gpu_query("{}", recorded.UTILIZATION),
            "gen": gpu_query("max_over_time({}[1m])", PCIE_LINK_GENERATION.name),
            "width": gpu_query("max_over_time({}[1m])", PCIE_LINK_WIDTH.name),
        },
    )


def both_ways_capacity(measured: dict[str, float], generation: float | None,
                       lanes: float | None) -> tuple[float, str] | None:
    """(bytes/s, "measured" or "bidirectional factor") both directions of a link carry together:
    the sum of what `hybridmon bench` measured each way while the other way copied too, where it
    measured both ways (`measured`: direction -> bytes/s), else pcie_rates.bidirectional_capacity
    of the generation x width given; None when neither is known. As the rule's
    BIDIRECTIONAL_CAPACITY recording computes it."""
    each_way = [measured.get(direction, 0.0) for direction in recorded.DIRECTIONS]
    if all(value > 0 for value in each_way):  # half a sum would understate the link
        return sum(each_way), "measured"
    if generation is None or lanes is None:
        return None
    factor = bidirectional_capacity(generation, lanes)
    return (factor, "bidirectional factor") if factor else None


class Detector(DetectorBase):
    """The fullest of each direction's traffic over its capacity and both directions' sum over
    the link's bidirectional capacity at or above traffic_share_of_capacity, while GPU utilization
    (avg 1m) is at or below gpu_utilization_at_most. Traffic per direction: rate 1m of the PCIe
    byte counter, else rate 1m of the sampled-bytes estimate, else avg 1m of the throughput gauge.
    Capacity per direction: pcie_rates.effective_capacity (measured, else achievable on the best
    generation x width of the minute); both ways: both_ways_capacity."""

    name = "pcie_starvation"
    alertnames = ("GpuPcieStarvation",)
    min_history_seconds = windows.AVERAGE_SECONDS

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.alert = alert(config)

    def evaluate(self, history: HistoryReader, now: float) -> list[Finding]:
        utilization = common.gpu_averages(history, UTILIZATION.name, now)
        generation = common.gpu_maxima(history, PCIE_LINK_GENERATION.name, now)
        width = common.gpu_maxima(history, PCIE_LINK_WIDTH.name, now)
        traffic = common.gpu_traffic(history, PCIE_BYTES.name, PCIE_SAMPLED_BYTES.name, PCIE_THROUGHPUT.name, now)
        measured_capacity = common.gpu_directions(history, MEASURED_CAPACITY.name, now)
        measured_both_ways = common.gpu_directions(history, MEASURED_BIDIRECTIONAL_CAPACITY.name, now)
        findings = []
        loads: dict[tuple[str, ...], dict[str, DirectionLoad]] = {}   # its figures: every GPU with traffic
        link_shares: dict[tuple[str, ...], float] = {}
        for key, directions in sorted(traffic.items()):
            busy = utilization.get(key)
            gen, lanes, benchmarked = generation.get(key), width.get(key), measured_capacity.get(key, {})
            # Both directions, as the rule's capacity recording holds them (traffic or not).
            capacities = {direction: found for direction in recorded.DIRECTIONS
                          if (found := effective_capacity(benchmarked.get(direction), gen, lanes)) is not None}
            loads[key] = {direction: DirectionLoad(value, capacities.get(direction))
                          for direction, value in directions.items()}
            shares = {direction: value / capacities[direction].bytes_per_second
                      for direction, value in directions.items() if direction in capacities}
            both_found = both_ways_capacity(measured_both_ways.get(key, {}), gen, lanes)
            both = both_found[0] if both_found else None
            if both:
                shares[recorded.BOTH] = sum(directions.values()) / both
            if shares:
                link_shares[key] = max(shares.values())
            if busy is None or not shares:
                continue
            judged = max(shares, key=shares.__getitem__)
            share = shares[judged]
            if share < self.config.traffic_share_of_capacity or busy > self.config.gpu_utilization_at_most:
                continue
            judged_capacity = both if judged == recorded.BOTH else capacities[judged].bytes_per_second
            details: dict[str, float | str] = {
                "direction": judged,
                "traffic_bytes_per_second": (sum(directions.values()) if judged == recorded.BOTH
                                             else directions[judged]),
                "threshold_bytes_per_second": self.config.traffic_share_of_capacity * judged_capacity,
                "capacity_bytes_per_second": judged_capacity,
                "capacity_source": (both_found[1] if judged == recorded.BOTH and both_found
                                    else capacities[judged].source),
                "gpu_utilization_ratio": busy,
            }
            for name, value in directions.items():
                details[f"{name}_bytes_per_second"] = value
            for name, value in shares.items():
                details[f"{name}_share_of_capacity"] = value
            if gen is not None and lanes is not None:
                details["link_generation"] = gen
                details["link_width_lanes"] = lanes
            findings.append(finding(
                self.alert, common.gpu_entity(key), share, self.config.traffic_share_of_capacity,
                unit="ratio",
                values={"to_gpu": directions.get(HOST_TO_DEVICE), "from_gpu": directions.get(DEVICE_TO_HOST),
                        "capacity": max((found.bytes_per_second for found in capacities.values()), default=None),
                        "both": both, "util": busy, "gen": gen, "width": lanes},
                details=details))
        self.figures = loads
        # The fullest of each direction and both together, per GPU: the rule's max without
        # (direction) of TRAFFIC_SHARE, which server_crash reads as what preceded a crash.
        self.link_shares = link_shares
        return findings


FAMILY = AlertFamily(
    section="pcie_starvation",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group=groups.PCIE,
    detector=Detector,
    alerts=lambda t: (alert(t.pcie_starvation),),
    collectors=("gpu",),
    lookback_seconds=lambda settings: settings.for_seconds,
    scenario="pcie_starvation",
)
