"""GpuPcieStarvation: a GPU's PCIe link is full while the GPU itself idles, waiting on host-device
copies (offloaded KV cache or weights). Each direction is judged against its own capacity: what
`hybridmon bench` measured on this host where it has run, else the theoretical rate of the current
generation x width. Runbook: GpuPcieStarvation.md.
"""
from __future__ import annotations

from textwrap import dedent

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import common, windows
from hybridmon.agent.detectors.base import Finding
from hybridmon.agent.history import History
from hybridmon.exporters.bench import MEASURED_CAPACITY
from hybridmon.exporters.gpu import PCIE_LINK_GENERATION, PCIE_LINK_WIDTH, PCIE_THROUGHPUT, UTILIZATION
from hybridmon.pcie_rates import effective_capacity
from hybridmon.rules import pcie as recorded
from hybridmon.rules.case_inputs import capacity, link, measured
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import gpu_query, number
from hybridmon.rules.promtool_cases import GPU0, GPU1, GPU2, Test, above, firing, not_yet
from hybridmon.rules.templates import humanize_percentage

INPUTS = (PCIE_THROUGHPUT, UTILIZATION, PCIE_LINK_GENERATION, PCIE_LINK_WIDTH, MEASURED_CAPACITY)


class Settings(Section):
    traffic_share_of_capacity: float
    gpu_utilization_at_most: float
    for_seconds: float


def alert(s: Settings) -> Alert:
    return Alert(
        "GpuPcieStarvation",
        dedent(f"""\
            # the share of its capacity in the direction nearest to it...
            max without (direction) ({recorded.THROUGHPUT} / {recorded.CAPACITY})
              >= {number(s.traffic_share_of_capacity)}
            # ...while the GPU's own work stalls
            and
            {recorded.UTILIZATION} <= {number(s.gpu_utilization_at_most)}"""),
        s.for_seconds, "warning",
        "GPU <gpu> on <instance> is starved by PCIe: link <value|humanizePercentage> full, "
        "GPU <util|humanizePercentage> busy",
        "GPU <gpu> (<uuid>) moved <traffic|humanize>B/s over PCIe in its busier direction "
        "(1 min average); the direction nearest its capacity ran at <value|humanizePercentage> of "
        "it (capacity up to <capacity|humanize>B/s: what hybridmon bench measured on this host, "
        "else the theoretical rate of its current Gen<gen> x<width> link; threshold "
        f"{humanize_percentage(s.traffic_share_of_capacity)}), while its utilization was "
        f"<util|humanizePercentage> (threshold: at most {humanize_percentage(s.gpu_utilization_at_most)}). "
        "The GPU waits on host-device copies: offloaded KV cache or weights cross the bus faster "
        "than it can carry them, so tokens/s collapse and long contexts stall. First find the "
        "process driving the traffic (nvidia-smi dmon -s t, nvidia-smi pmon) and shrink what it "
        "moves per token (keep the hot KV blocks in VRAM, use smaller offload pages), and keep the "
        "server's cores and memory on the GPU's NUMA node.",
        queries={
            "traffic": gpu_query("max without (direction) ({})", recorded.THROUGHPUT),
            "capacity": gpu_query("max without (direction) ({})", recorded.CAPACITY),
            "util": gpu_query("{}", recorded.UTILIZATION),
            "gen": gpu_query("{}", PCIE_LINK_GENERATION.name),
            "width": gpu_query("{}", PCIE_LINK_WIDTH.name),
        },
    )


class Detector:
    """In the direction nearest its capacity, traffic (avg 1m) at or above
    traffic_share_of_capacity x capacity while GPU utilization (avg 1m) is at or below
    gpu_utilization_at_most; capacity per direction from pcie_rates.effective_capacity."""

    name = "pcie_starvation"
    alertnames = ("GpuPcieStarvation",)
    min_history_seconds = windows.AVERAGE_SECONDS

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.alert = alert(config)

    def evaluate(self, history: History, now: float) -> list[Finding]:
        utilization = common.gpu_averages(history, UTILIZATION.name, now)
        generation = common.gpu_latest(history, PCIE_LINK_GENERATION.name, now)
        width = common.gpu_latest(history, PCIE_LINK_WIDTH.name, now)
        traffic = common.gpu_directions(history, PCIE_THROUGHPUT.name, now, windows.avg_over_time)
        measured_capacity = common.gpu_directions(history, MEASURED_CAPACITY.name, now)
        findings = []
        for key, directions in sorted(traffic.items()):
            busy = utilization.get(key)
            gen, lanes, benchmarked = generation.get(key), width.get(key), measured_capacity.get(key, {})
            # Every direction the rule's capacity recording holds: those with traffic and those measured.
            capacities = {direction: found for direction in {*directions, *benchmarked}
                          if (found := effective_capacity(benchmarked.get(direction), gen, lanes)) is not None}
            shares = {direction: value / capacities[direction][0]
                      for direction, value in directions.items() if direction in capacities}
            if busy is None or not shares:
                continue
            direction = max(shares, key=shares.__getitem__)
            share = shares[direction]
            if share < self.config.traffic_share_of_capacity or busy > self.config.gpu_utilization_at_most:
                continue
            bytes_per_second, source = capacities[direction]
            details: dict[str, float | str] = {
                "direction": direction,
                "traffic_bytes_per_second": directions[direction],
                "threshold_bytes_per_second": self.config.traffic_share_of_capacity * bytes_per_second,
                "capacity_bytes_per_second": bytes_per_second,
                "capacity_source": source,
                "gpu_utilization_ratio": busy,
            }
            for name, value in directions.items():
                details[f"{name}_bytes_per_second"] = value
            if gen is not None and lanes is not None:
                details["link_generation"] = gen
                details["link_width_lanes"] = lanes
            findings.append(finding(
                self.alert, common.gpu_entity(key), share, self.config.traffic_share_of_capacity,
                unit="ratio",
                values={"traffic": max(directions.values()),
                        "capacity": max(found for found, _ in capacities.values()),
                        "util": busy, "gen": gen, "width": lanes},
                details=details))
        return findings


def starved_against_theoretical_capacity(t, catalog) -> Test:
    s = t.pcie_starvation
    rule = catalog.find("GpuPcieStarvation")
    full = capacity(4, 16)
    starved, busy = s.gpu_utilization_at_most / 2, above(s.gpu_utilization_at_most)
    pinned, near = above(s.traffic_share_of_capacity), s.traffic_share_of_capacity * 0.95
    test = Test("PCIe starvation: GPU 0 starves; GPU 1 busy near capacity and GPU 2 just under "
                "the share stay silent", firing(s.for_seconds) + 120, catalog)
    for gpu, (traffic, utilization) in ((GPU0, (pinned, starved)), (GPU1, (near, busy)),
                                        (GPU2, (near, starved))):
        link(test, gpu, 4, 16)
        test.gauge(PCIE_THROUGHPUT.name, 0.2 * full, traffic * full, direction="host_to_device", **gpu)
        test.constant(PCIE_THROUGHPUT.name, 0.05 * full, direction="device_to_host", **gpu)
        test.gauge(UTILIZATION.name, busy, utilization, **gpu)
    test.expect(not_yet(s.for_seconds), rule.alert)
    test.expect(firing(s.for_seconds), rule.alert, test.alert(
        rule, GPU0, value=pinned, traffic=pinned * full, capacity=full, util=starved, gen=4, width=16))
    return test


def starved_against_measured_capacity(t, catalog) -> Test:
    """GPU 0 measured 80 % of the theoretical rate: traffic just past the share of that fires, and
    is under the share of the theoretical rate (GPU 2, never measured, stays silent with the same
    traffic). GPU 1 is judged per direction: device->host past the share of its smaller measured
    capacity, host->device well under its own."""
    s = t.pcie_starvation
    rule = catalog.find("GpuPcieStarvation")
    idle, full = s.gpu_utilization_at_most / 2, capacity(4, 16)
    share = min(s.traffic_share_of_capacity + 0.02, 0.99)
    gpu0 = (0.8 * full, 0.8 * full)
    gpu1 = (full, 0.7 * full)
    traffic = {"0": (share * gpu0[0], 0.01 * full), "1": ((share - 0.1) * gpu1[0], share * gpu1[1]),
               "2": (share * gpu0[0], 0.01 * full)}
    test = Test("PCIe starvation judged against what hybridmon bench measured, per direction; "
                "GPU 2 without a measurement falls back to the theoretical rate",
                firing(s.for_seconds) + 120, catalog)
    for gpu in (GPU0, GPU1, GPU2):
        link(test, gpu, 4, 16)
        h2d, d2h = traffic[gpu["gpu"]]
        test.gauge(PCIE_THROUGHPUT.name, 0.01 * full, h2d, direction="host_to_device", **gpu)
        test.gauge(PCIE_THROUGHPUT.name, 0.01 * full, d2h, direction="device_to_host", **gpu)
        test.constant(UTILIZATION.name, idle, **gpu)
    measured(test, GPU0, *gpu0)
    measured(test, GPU1, *gpu1)
    test.expect_samples(60, recorded.CAPACITY,
                        ({**GPU0, "direction": "host_to_device"}, gpu0[0]),
                        ({**GPU0, "direction": "device_to_host"}, gpu0[1]),
                        ({**GPU1, "direction": "host_to_device"}, gpu1[0]),
                        ({**GPU1, "direction": "device_to_host"}, gpu1[1]),
                        ({**GPU2, "direction": "host_to_device"}, full),
                        ({**GPU2, "direction": "device_to_host"}, full))
    test.expect(not_yet(s.for_seconds), rule.alert)
    test.expect(firing(s.for_seconds), rule.alert,
                test.alert(rule, GPU0, value=share, traffic=traffic["0"][0], capacity=gpu0[0], util=idle,
                           gen=4, width=16),
                test.alert(rule, GPU1, value=share, traffic=max(traffic["1"]), capacity=gpu1[0],
                           util=idle, gen=4, width=16))
    return test


def cases(t, catalog) -> list[Test]:
    return [starved_against_theoretical_capacity(t, catalog), starved_against_measured_capacity(t, catalog)]


FAMILY = AlertFamily(
    section="pcie_starvation",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group="hybridmon-pcie",
    detector=Detector,
    alerts=lambda t: (alert(t.pcie_starvation),),
    cases=cases,
    collectors=("gpu",),
    lookback_seconds=lambda settings: settings.for_seconds,
)
