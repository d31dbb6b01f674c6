"""GpuPcieStarvation: a GPU's PCIe link is full while the GPU itself idles, waiting on host-device
copies (offloaded KV cache or weights). "Full" is judged against what the link carries in
practice, not its theoretical rate, which no copy reaches: what `hybridmon bench` measured on this
host where it has run, else the theoretical rate x the share copy engines achieve at its generation
(pcie_rates.ACHIEVABLE_SHARE). Each direction is judged alone, and both together against what the
link carries both ways at once: the sum of what the bench measured each way while the other way
copied too, else the bidirectional share (pcie_rates.BIDIRECTIONAL_SHARE); under bidirectional load
neither direction gets near its own capacity. Traffic is the 1 min rate of NVML's cumulative PCIe
byte counters where the GPU has them, else the 1 min rate of the agent's sampled-bytes estimate
(all of its samples, 5 a second by default), else the 1 min average of the throughput gauge (with
a 15 s scrape, 4 values: far noisier, docs/nvml-cost.md); the link is sized by the best generation and
width it ran at over that same minute, because it drops to Gen1 within moments of going idle.
Runbook: GpuPcieStarvation.md.

On a GPU in NVLink-C2C mode (GH200, GB200; issue 29) host<->device copies cross C2C, not PCIe, and
its PCIe counters stay near zero whatever the offload does: GpuPcieStarvation leaves such a GPU
alone, and GpuC2cStarvation judges the 1 min average of its GPM C2C throughput, each direction
against what C2C carries that way (what `hybridmon bench` measured over C2C, else the up links'
maximum bandwidth x pcie_rates.C2C_ACHIEVABLE_SHARE), with the same thresholds. No both-ways
judgement there: no figure for C2C copies both ways at once is documented to size it by. Where C2C
is on but GPM cannot be read, GpuC2cTrafficUnreadable (info) says once that the GPU's offload is
not judged at all, rather than let two silent alerts read as a healthy link. Runbooks:
GpuC2cStarvation.md, GpuC2cTrafficUnreadable.md.
"""
from __future__ import annotations

from textwrap import dedent

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import common, windows
from hybridmon.agent.detectors.links import DirectionLoad
from hybridmon.agent.detectors.base import DetectorBase, Finding, HistoryReader
from hybridmon.exporters.bench import C2C_MEASURED_CAPACITY, MEASURED_BIDIRECTIONAL_CAPACITY, MEASURED_CAPACITY
from hybridmon.exporters.gpu import (C2C_LINK_MAX_BANDWIDTH, C2C_LINK_UP, C2C_MODE, C2C_THROUGHPUT, PCIE_BYTES,
                                     PCIE_LINK_GENERATION, PCIE_LINK_WIDTH, PCIE_SAMPLED_BYTES, PCIE_THROUGHPUT,
                                     UTILIZATION)
from hybridmon.pcie_rates import (C2C_ACHIEVABLE_SHARE_TEXT, LinkCapacity, bidirectional_capacity, c2c_capacity,
                                  effective_capacity)
from hybridmon.rules import groups
from hybridmon.rules import pcie as recorded
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import gpu_query, number, query
from hybridmon.rules.templates import humanize_duration, humanize_percentage

INPUTS = (PCIE_BYTES, PCIE_SAMPLED_BYTES, PCIE_THROUGHPUT, UTILIZATION, PCIE_LINK_GENERATION, PCIE_LINK_WIDTH,
          MEASURED_CAPACITY, MEASURED_BIDIRECTIONAL_CAPACITY, C2C_MODE, C2C_LINK_UP, C2C_LINK_MAX_BANDWIDTH,
          C2C_THROUGHPUT, C2C_MEASURED_CAPACITY)
GPU_KEY = "job, instance, gpu, uuid"
HOST_TO_DEVICE, DEVICE_TO_HOST = recorded.DIRECTIONS


class Settings(Section):
    traffic_share_of_capacity: float
    gpu_utilization_at_most: float
    for_seconds: float


def starved(s: Settings, shares: str, judged: str, crossing: str, c2c_mode: str) -> str:
    """PromQL: the fullest of `shares` (traffic over capacity, per direction) at or past the
    share, while the GPU's own work stalls, on the GPUs `c2c_mode` ("and": in NVLink-C2C mode,
    "unless": not) keeps. `judged` and `crossing` are the comments that say so."""
    comment = "\n".join(f"# {line}" for line in judged.splitlines())
    return (f"{comment}...\nmax without (direction) ({shares})\n  >= {number(s.traffic_share_of_capacity)}\n"
            f"# ...while the GPU's own work stalls...\nand\n"
            f"{recorded.UTILIZATION} <= {number(s.gpu_utilization_at_most)}\n"
            f"# ...on a GPU whose {crossing}\n{c2c_mode} on ({GPU_KEY})\n{recorded.C2C_ON}")


def stalled_while(s: Settings, link: str) -> str:
    """The verdict both starvation texts share: the share against its threshold, the utilization
    against its own, what the GPU waits on, and the start of the first step."""
    return (" ran at <value|humanizePercentage> of "
            f"that (threshold {humanize_percentage(s.traffic_share_of_capacity)}), while its utilization "
            f"was <util|humanizePercentage> (threshold: at most {humanize_percentage(s.gpu_utilization_at_most)}). "
            f"The GPU waits on host-device copies: offloaded KV cache or weights cross {link} faster "
            "than it can carry them, so tokens/s collapse and long contexts stall. First find the "
            "process driving the traffic ")


def alert(s: Settings) -> Alert:
    return Alert(
        "GpuPcieStarvation",
        starved(s, recorded.TRAFFIC_SHARE,
                "the fullest of: each direction against what the link carries that way, and both\n"
                "directions together against what it carries both ways at once",
                "copies cross PCIe: in NVLink-C2C mode they cross C2C (GpuC2cStarvation)", "unless"),
        s.for_seconds, "warning",
        "GPU <gpu> on <instance> is starved by PCIe: link <value|humanizePercentage> full, "
        "GPU <util|humanizePercentage> busy",
        "GPU <gpu> (<uuid>) moved <to_gpu|humanize>B/s host to device and <from_gpu|humanize>B/s device to "
        "host over PCIe (1 min average). What its link carries: up to <capacity|humanize>B/s each "
        "way and <both|humanize>B/s both ways at once (what hybridmon bench measured on this host, "
        "else what copies achieve on the best link it ran in the minute, Gen<gen> x<width>). The "
        "fuller of one direction alone and both together" + stalled_while(s, "the bus") +
        "(nvidia-smi dmon -s t, nvidia-smi pmon) and shrink what it "
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


def c2c_alert(s: Settings) -> Alert:
    h2d_share, d2h_share = (C2C_ACHIEVABLE_SHARE_TEXT[direction][0] for direction in recorded.DIRECTIONS)
    return Alert(
        "GpuC2cStarvation",
        starved(s, recorded.C2C_TRAFFIC_SHARE, "the fuller direction of NVLink-C2C against what C2C carries that way",
                "host<->device copies cross C2C", "and"),
        s.for_seconds, "warning",
        "GPU <gpu> on <instance> is starved by NVLink-C2C: link <value|humanizePercentage> full, "
        "GPU <util|humanizePercentage> busy",
        "GPU <gpu> (<uuid>) runs in NVLink-C2C mode, so its host-device copies cross C2C, not "
        "PCIe. It moved <to_gpu|humanize>B/s host to device and <from_gpu|humanize>B/s device to "
        "host over C2C (1 min average of NVML's GPM C2C throughput). What C2C carries: up to "
        "<to_gpu_capacity|humanize>B/s host to device and <from_gpu_capacity|humanize>B/s device "
        "to host (what hybridmon bench measured over C2C on this host, else the "
        "<links|humanize>B/s NVML states for its up links x the share copies achieve, "
        f"{h2d_share} host to device and {d2h_share} device to host as nvbandwidth measured on "
        "GH200). The fuller direction" + stalled_while(s, "C2C") +
        "(nvidia-smi pmon, the servers' offload counters) and shrink what it "
        "moves per token (keep the hot KV blocks in HBM, use smaller offload pages).",
        queries={
            "to_gpu": query("{}", recorded.C2C_TRAFFIC, "gpu", direction=HOST_TO_DEVICE),
            "from_gpu": query("{}", recorded.C2C_TRAFFIC, "gpu", direction=DEVICE_TO_HOST),
            "to_gpu_capacity": query("{}", recorded.C2C_CAPACITY, "gpu", direction=HOST_TO_DEVICE),
            "from_gpu_capacity": query("{}", recorded.C2C_CAPACITY, "gpu", direction=DEVICE_TO_HOST),
            "links": gpu_query("{}", recorded.C2C_UP_LINKS),
            "util": gpu_query("{}", recorded.UTILIZATION),
        },
    )


def c2c_unreadable_alert(s: Settings) -> Alert:
    return Alert(
        "GpuC2cTrafficUnreadable",
        dedent(f"""\
            # a GPU whose host<->device copies cross NVLink-C2C...
            {recorded.C2C_ON}
            # ...without a C2C traffic figure over the last minute
            unless on ({GPU_KEY})
            {recorded.C2C_TRAFFIC}"""),
        s.for_seconds, "info",
        "GPU <gpu> on <instance>: C2C traffic unreadable, offload not judged",
        "GPU <gpu> (<uuid>) runs in NVLink-C2C mode: its offloaded KV cache and weights cross "
        "C2C, not PCIe, and its PCIe counters stay near zero whatever the offload does. NVML "
        "has given no C2C traffic for it for "
        f"{humanize_duration(s.for_seconds)} (threshold: as long as starvation needs to fire): the GPM C2C "
        f"throughput, {C2C_THROUGHPUT.name}, is absent (GPM unsupported by this GPU or driver, or "
        "the gpu collector cannot read it). So offload is not judged on this GPU: GpuPcieStarvation "
        "leaves it alone and GpuC2cStarvation has nothing to judge. Check `nvidia-smi c2c -s` "
        "and the agent's log for the GPM reason, and use a driver whose NVML exposes the GPM "
        "C2C metrics; until then watch the servers' own offload counters.",
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
    generation x width of the minute); both ways: both_ways_capacity. GPUs in NVLink-C2C mode
    (C2C_MODE 1 now) are judged by _judge_c2c instead."""

    name = "pcie_starvation"
    alertnames = ("GpuPcieStarvation", "GpuC2cStarvation", "GpuC2cTrafficUnreadable")
    min_history_seconds = windows.AVERAGE_SECONDS

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.alert = alert(config)
        self.c2c_alert = c2c_alert(config)
        self.c2c_unreadable_alert = c2c_unreadable_alert(config)

    def evaluate(self, history: HistoryReader, now: float) -> list[Finding]:
        utilization = common.gpu_averages(history, UTILIZATION.name, now)
        generation = common.gpu_maxima(history, PCIE_LINK_GENERATION.name, now)
        width = common.gpu_maxima(history, PCIE_LINK_WIDTH.name, now)
        traffic = common.gpu_traffic(history, PCIE_BYTES.name, PCIE_SAMPLED_BYTES.name, PCIE_THROUGHPUT.name, now)
        measured_capacity = common.gpu_directions(history, MEASURED_CAPACITY.name, now)
        measured_both_ways = common.gpu_directions(history, MEASURED_BIDIRECTIONAL_CAPACITY.name, now)
        over_c2c = common.c2c_gpus(history, now)
        findings = self._judge_c2c(history, now, utilization, over_c2c)
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
            # In C2C mode the offload crosses C2C: its near-idle PCIe link says nothing of it.
            if busy is None or not shares or key in over_c2c:
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

    def _judge_c2c(self, history: HistoryReader, now: float, utilization: dict[tuple[str, ...], float],
                   over_c2c: set[tuple[str, ...]]) -> list[Finding]:
        """GpuC2cStarvation, and GpuC2cTrafficUnreadable where C2C traffic has no figure over
        the last minute, for the GPUs in NVLink-C2C mode."""
        c = self.config
        traffic = common.gpu_directions(history, C2C_THROUGHPUT.name, now, windows.avg_over_time)
        measured = common.gpu_directions(history, C2C_MEASURED_CAPACITY.name, now)
        up_links = common.c2c_up_links(history, now)
        findings = []
        for key in sorted(over_c2c):
            directions = traffic.get(key)
            if not directions:
                findings.append(finding(self.c2c_unreadable_alert, common.gpu_entity(key), 1.0, 1.0))
                continue
            capacities: dict[str, LinkCapacity] = {
                direction: found for direction in recorded.DIRECTIONS
                if (found := c2c_capacity(measured.get(key, {}).get(direction), direction, up_links.get(key)))}
            shares = {direction: value / capacities[direction].bytes_per_second
                      for direction, value in directions.items() if direction in capacities}
            busy = utilization.get(key)
            if busy is None or not shares:
                continue
            judged = max(shares, key=shares.__getitem__)
            if shares[judged] < c.traffic_share_of_capacity or busy > c.gpu_utilization_at_most:
                continue
            capacity = capacities[judged]
            details: dict[str, float | str] = {
                "link": "c2c", "direction": judged, "traffic_bytes_per_second": directions[judged],
                "threshold_bytes_per_second": c.traffic_share_of_capacity * capacity.bytes_per_second,
                "capacity_bytes_per_second": capacity.bytes_per_second, "capacity_source": capacity.source,
                "gpu_utilization_ratio": busy,
                **{f"{name}_bytes_per_second": value for name, value in directions.items()},
                **{f"{name}_share_of_capacity": value for name, value in shares.items()}}
            if key in up_links:
                details["up_links_max_bytes_per_second"] = up_links[key]
            findings.append(finding(
                self.c2c_alert, common.gpu_entity(key), shares[judged], c.traffic_share_of_capacity,
                unit="ratio",
                values={"to_gpu": directions.get(HOST_TO_DEVICE), "from_gpu": directions.get(DEVICE_TO_HOST),
                        **{f"{name}_capacity": (found.bytes_per_second if (found := capacities.get(direction)) else None)
                           for name, direction in (("to_gpu", HOST_TO_DEVICE), ("from_gpu", DEVICE_TO_HOST))},
                        "links": up_links.get(key), "util": busy},
                details=details))
        return findings


FAMILY = AlertFamily(
    section="pcie_starvation",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group=groups.PCIE,
    detector=Detector,
    alerts=lambda t: (alert(t.pcie_starvation), c2c_alert(t.pcie_starvation),
                      c2c_unreadable_alert(t.pcie_starvation)),
    collectors=("gpu",),
    lookback_seconds=lambda settings: settings.for_seconds,
    scenario="pcie_starvation",
)
