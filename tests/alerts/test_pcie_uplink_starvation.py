"""The tests of the pcie_uplink_starvation alert family (agent/alerts/pcie_uplink_starvation.py): its
detector, on histories written sample by sample, and its rule's promtool cases (`promtool_cases`,
written to rules/tests/ by `python -m tests.rules.generate` and run by promtool in
tests/rules/test_rules.py).

The host of every case: GPUs 0 and 1 behind one PCIe switch whose upstream port 0000:01:00.0 reaches
root port 0000:00:01.0 over one Gen4 x16 link (as tests/fixtures/host-switch), GPU 2 on a root port
of its own. Copy engines pinned on a Gen4 x16 link move 0.82 of its theoretical rate (nvbandwidth:
26 of 31.5 GB/s), so two GPUs behind one x16 uplink together move at most that: each about half of
what its own link carries."""
from __future__ import annotations

import pytest

from hybridmon.agent.alerts import pcie_starvation, pcie_uplink_starvation
from hybridmon.agent.alerts.pcie_uplink_starvation import DEVICE_TO_HOST, HOST_TO_DEVICE
from hybridmon.exporters.gpu import GPU_INFO, PCIE_THROUGHPUT, UTILIZATION
from hybridmon.exporters.pcie_topology import UPLINK_GENERATION, UPLINK_INFO, UPLINK_WIDTH
from hybridmon.pcie_rates import achievable_capacity, bidirectional_capacity
from hybridmon.rules import pcie as recorded
from hybridmon.rules.model import Alert
from tests.support.detector_history import GEN4_X16, T0, THRESHOLDS, Trace, assert_says_its_rules_words, gpu_rows
from tests.support.promtool_cases import GPU0, GPU1, GPU2, GPU3, Test, firing, not_yet
from tests.support.promtool_inputs import achievable, bidirectional, capacity, link

ROOT_PORT, SWITCH_UP = "0000:00:01.0", "0000:01:00.0"
BUS = {"0": "0000:03:00.0", "1": "0000:04:00.0", "2": "0000:41:00.0", "3": "0000:42:00.0"}
GEN4_ACHIEVABLE = achievable_capacity(4, 16)


def uplink_starvation():
    return pcie_uplink_starvation.Detector(THRESHOLDS.pcie_uplink_starvation)


def behind_switch(generation: float = 4, width: float = 16, gpus=("0", "1")):
    """The pcie collector's topology rows: `gpus` behind the switch's uplink."""
    rows = [(UPLINK_INFO, 1, BUS[gpu], SWITCH_UP, ROOT_PORT) for gpu in gpus]
    return rows + [(UPLINK_GENERATION, generation, SWITCH_UP), (UPLINK_WIDTH, width, SWITCH_UP)]


def three_gpus(h2d: tuple[float, float, float], d2h: float = 5e8, utilization=(0.2, 0.2, 0.9)):
    """GPUs 0 and 1 behind the switch, GPU 2 alone; host->device bytes/s of each."""
    def rows(t: float):
        found = []
        for index, (traffic, busy) in enumerate(zip(h2d, utilization)):
            gpu = str(index)
            found += gpu_rows(gpu, f"GPU-{gpu * 4}", utilization=busy, h2d=traffic, d2h=d2h, pci_bus_id=BUS[gpu])
        return found
    return rows


def test_fires_when_two_gpus_each_half_way_on_their_own_links_fill_their_shared_uplink():
    trace = Trace()
    # 0.45 and 0.37 of the theoretical rate (0.56 and 0.46 of what each link carries: no
    # GpuPcieStarvation), 0.82 together; GPU 2 alone at the same 0.82, busy
    now = trace.run(T0, T0 + 120, gpu=three_gpus((0.45 * GEN4_X16, 0.37 * GEN4_X16, 0.82 * GEN4_X16)),
                    pcie=lambda t: behind_switch())
    (finding,) = uplink_starvation().evaluate(trace.history, now)
    assert finding.alertname == "PcieUplinkStarvation" and finding.severity == "warning"
    assert finding.labels == {"uplink": SWITCH_UP}
    assert finding.value == pytest.approx(0.82 * GEN4_X16 / GEN4_ACHIEVABLE)
    details = finding.details
    assert details["direction"] == HOST_TO_DEVICE and details["root_port"] == ROOT_PORT
    assert details["link"] == "Gen4 x16" and details["gpus"] == "0, 1" and details["stalled_gpus"] == "0, 1"
    assert details["traffic_bytes_per_second"] == pytest.approx(0.82 * GEN4_X16)
    assert details["gpu_0_part_of_traffic"] == pytest.approx((0.45 * GEN4_X16 + 5e8) / (0.82 * GEN4_X16 + 1e9))
    assert "uplink 0000:01:00.0 on " in finding.summary and "101.2% full with the traffic of the 2 GPUs" \
        in finding.summary
    assert "share one Gen4 x16 link" in finding.description
    assert "of that traffic: GPU 0 (54.7%), GPU 1 (45.3%)." in finding.description
    assert "This is the shared uplink, not a GPU's own link" in finding.description
    assert_says_its_rules_words(finding)
    # the two causes apart: no GPU's own link is full
    assert pcie_starvation.Detector(THRESHOLDS.pcie_starvation).evaluate(trace.history, now) == []


def test_silent_while_the_gpus_together_stay_clearly_below_what_the_uplink_carries():
    trace = Trace()
    now = trace.run(T0, T0 + 120, gpu=three_gpus((0.30 * GEN4_X16, 0.30 * GEN4_X16, 0.82 * GEN4_X16)),
                    pcie=lambda t: behind_switch())
    assert uplink_starvation().evaluate(trace.history, now) == []
    # its figures for the status page are there all the same
    load = uplink_starvation()
    load.evaluate(trace.history, now)
    (figures,) = load.figures.values()
    assert figures.link == "Gen4 x16" and [gpu for gpu, _ in figures.gpus] == ["0", "1"]
    assert figures.share == pytest.approx(0.60 * GEN4_X16 / GEN4_ACHIEVABLE)


def test_silent_while_every_gpu_behind_the_uplink_keeps_working():
    trace = Trace()
    now = trace.run(T0, T0 + 120, gpu=three_gpus((0.45 * GEN4_X16, 0.37 * GEN4_X16, 0.1 * GEN4_X16),
                                                  utilization=(0.9, 0.6, 0.1)),
                    pcie=lambda t: behind_switch())
    assert uplink_starvation().evaluate(trace.history, now) == []


def test_fires_when_both_directions_together_fill_the_uplink():
    # 0.3 of the theoretical rate each way on each GPU: 0.6 each way through the uplink (0.74 of
    # what one direction carries), 1.2 both ways: past the 2 x 0.58 bidirectional copies reach
    trace = Trace()
    each = 0.3 * GEN4_X16
    now = trace.run(T0, T0 + 120, gpu=three_gpus((each, each, 0.0), d2h=each), pcie=lambda t: behind_switch())
    (finding,) = uplink_starvation().evaluate(trace.history, now)
    assert finding.details["direction"] == "both"
    assert finding.value == pytest.approx(4 * each / bidirectional_capacity(4, 16))
    assert finding.details["capacity_bytes_per_second"] == pytest.approx(bidirectional_capacity(4, 16))
    assert_says_its_rules_words(finding)


def test_an_uplink_trained_to_x8_fills_at_half_the_traffic():
    trace = Trace()
    each = 0.21 * GEN4_X16          # 0.42 of x16 together: 0.84 of x8's theoretical rate
    now = trace.run(T0, T0 + 120, gpu=three_gpus((each, each, 0.0), d2h=1e6), pcie=lambda t: behind_switch(width=8))
    (finding,) = uplink_starvation().evaluate(trace.history, now)
    assert finding.value == pytest.approx(2 * each / achievable_capacity(4, 8))
    assert "share one Gen4 x8 link" in finding.description


def test_a_gpu_on_its_own_root_port_is_never_judged_as_an_uplink():
    trace = Trace()
    # the pcie collector names no shared uplink (GPU 2 alone; 0 and 1 on root ports of their own)
    now = trace.run(T0, T0 + 120, gpu=three_gpus((0.82 * GEN4_X16,) * 3, utilization=(0.1, 0.1, 0.1)),
                    pcie=lambda t: [])
    assert uplink_starvation().evaluate(trace.history, now) == []


# --- its rule's promtool cases ------------------------------------------------------------------

def topology(test: Test, gpus: dict[str, dict], uplink: str, generation: int = 4, width: int = 16) -> None:
    """The GPUs' gpu_info (by PCI address) and the pcie collector's topology for `uplink`."""
    for bus, gpu in gpus.items():
        test.constant(GPU_INFO.name, 1, name="NVIDIA A100 80GB PCIe", pci_bus_id=bus, driver_version="550.54", **gpu)
        test.constant(UPLINK_INFO.name, 1, pci_bus_id=bus, uplink=uplink, root_port=ROOT_PORT)
    test.constant(UPLINK_GENERATION.name, generation, uplink=uplink)
    test.constant(UPLINK_WIDTH.name, width, uplink=uplink)


def uplink_saturation(t, catalog) -> Test:
    """GPUs 0 and 1 behind switch port 0000:01:00.0 move 0.45 and 0.37 of the Gen4 x16 theoretical
    rate host to device (each about half of what its own link carries), 0.82 together: a pinned x16
    link, past what the uplink carries. GPU 1 is busy, GPU 0 waits: it fires, naming both. GPUs 2
    and 3 behind another switch's port 0000:81:00.0, idle, move 0.30 each (or less, to stay under a
    lower threshold): silent."""
    s = t.pcie_uplink_starvation
    rule = catalog.find("PcieUplinkStarvation")
    full, idle, busy = capacity(4, 16), s.gpu_utilization_at_most / 2, s.gpu_utilization_at_most + 0.25
    below = min(0.30, 0.45 * s.traffic_share_of_capacity * achievable(4, 16) / full)
    other_switch = "0000:81:00.0"
    test = Test("PCIe uplink starvation: two GPUs each half way on their own links fill the x16 uplink "
                "they share; two others behind another switch at 0.30 each do not",
                firing(s.for_seconds) + 120, catalog)
    topology(test, {BUS["0"]: GPU0, BUS["1"]: GPU1}, SWITCH_UP)
    topology(test, {"0000:82:00.0": GPU2, "0000:83:00.0": GPU3}, other_switch)
    d2h = 0.05 * full
    for gpu, traffic, utilization in ((GPU0, 0.45, idle), (GPU1, 0.37, busy), (GPU2, below, idle),
                                      (GPU3, below, idle)):
        link(test, gpu, 4, 16)
        test.gauge(PCIE_THROUGHPUT.name, 0.1 * full, traffic * full, direction=HOST_TO_DEVICE, **gpu)
        test.constant(PCIE_THROUGHPUT.name, d2h, direction=DEVICE_TO_HOST, **gpu)
        test.constant(UTILIZATION.name, utilization, **gpu)
    total = (0.82 + 0.1) * full
    test.expect_samples(firing(s.for_seconds), recorded.UPLINK_TRAFFIC,
                        ({"uplink": SWITCH_UP, "direction": HOST_TO_DEVICE}, 0.82 * full),
                        ({"uplink": SWITCH_UP, "direction": DEVICE_TO_HOST}, 2 * d2h),
                        ({"uplink": other_switch, "direction": HOST_TO_DEVICE}, 2 * below * full),
                        ({"uplink": other_switch, "direction": DEVICE_TO_HOST}, 2 * d2h))
    test.expect(not_yet(s.for_seconds), rule.alert)
    test.expect(firing(s.for_seconds), rule.alert, test.alert(
        rule, {"uplink": SWITCH_UP}, value=0.82 * full / achievable(4, 16), to_gpu=0.82 * full,
        from_gpu=2 * d2h, capacity=achievable(4, 16), both=bidirectional(4, 16), gen=4, width=16, gpus=2,
        shares=[("0", (0.45 * full + d2h) / total), ("1", (0.37 * full + d2h) / total)]))
    return test


def uplink_full_both_ways(t, catalog) -> Test:
    """GPUs 0 and 1 behind the switch at 0.30 of the theoretical rate each way: 0.60 each way
    through the uplink (0.74 of what one direction carries), 1.20 both ways, past what
    bidirectional copies reach on Gen4 x16 (2 x 0.58). Both idle: it fires on both together."""
    s = t.pcie_uplink_starvation
    rule = catalog.find("PcieUplinkStarvation")
    full, idle = capacity(4, 16), s.gpu_utilization_at_most / 2
    test = Test("PCIe uplink starvation: both directions together fill the shared uplink",
                firing(s.for_seconds) + 120, catalog)
    topology(test, {BUS["0"]: GPU0, BUS["1"]: GPU1}, SWITCH_UP)
    for gpu, share in ((GPU0, 0.32), (GPU1, 0.28)):
        link(test, gpu, 4, 16)
        for direction in recorded.DIRECTIONS:
            test.gauge(PCIE_THROUGHPUT.name, 0.05 * full, share * full, direction=direction, **gpu)
        test.constant(UTILIZATION.name, idle, **gpu)
    test.expect(not_yet(s.for_seconds), rule.alert)
    test.expect(firing(s.for_seconds), rule.alert, test.alert(
        rule, {"uplink": SWITCH_UP}, value=1.2 * full / bidirectional(4, 16), to_gpu=0.6 * full,
        from_gpu=0.6 * full, capacity=achievable(4, 16), both=bidirectional(4, 16), gen=4, width=16, gpus=2,
        shares=[("0", 0.32 / 0.6), ("1", 0.28 / 0.6)]))
    return test


def promtool_cases(t, catalog) -> list[Test]:
    return [uplink_saturation(t, catalog), uplink_full_both_ways(t, catalog)]


def test_the_rule_names_the_uplink_and_its_gpus_by_the_words_the_detector_uses():
    rule = pcie_uplink_starvation.alert(THRESHOLDS.pcie_uplink_starvation)
    assert isinstance(rule, Alert) and rule.for_seconds == THRESHOLDS.pcie_uplink_starvation.for_seconds
    assert recorded.UPLINK_TRAFFIC_SHARE in rule.expr and recorded.GPU_UPLINK in rule.expr
