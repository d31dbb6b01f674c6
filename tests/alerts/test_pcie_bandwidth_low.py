"""The tests of the pcie_bandwidth_low alert family (agent/alerts/pcie_bandwidth_low.py): its detector, on
histories written sample by sample, and its rule's promtool cases (`promtool_cases`, written
to rules/tests/generated_pcie_bandwidth_low.yml by `python -m tests.rules.generate` and run by
promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

import pytest

from hybridmon.agent.alerts import pcie_bandwidth_low
from tests.support.detector_history import (
    GEN4_X16,
    HISTORY_GPU0,
    T0,
    THRESHOLDS,
    Trace,
    assert_says_its_rules_words,
    bench_rows,
    gpu_rows,
)
from tests.support.promtool_cases import GPU0, GPU1, GPU2, GPU3, Test
from tests.support.promtool_inputs import capacity, link, measured


def test_bandwidth_low_fires_on_a_measurement_far_below_the_link():
    detector = pcie_bandwidth_low.Detector(THRESHOLDS.pcie_bandwidth_low)
    trace = Trace()
    # Gen4 x16: the floor is 76 % of 31.5 GB/s = 23.9 GB/s; host->device measured 13.6 GB/s.
    now = trace.run(T0, T0 + 10, gpu=lambda t: gpu_rows(generation=3, width=16),
                    bench=lambda t: bench_rows(h2d=13.6e9, d2h=26.4e9))
    (finding,) = detector.evaluate(trace.history, now)
    assert finding.alertname == "GpuPcieBandwidthLow" and finding.labels == HISTORY_GPU0
    assert_says_its_rules_words(finding)
    assert finding.value == pytest.approx(13.6e9 / GEN4_X16)
    assert finding.threshold == 0.76 and finding.for_seconds == 0
    assert finding.details["direction"] == "host_to_device"
    assert finding.details["floor_bytes_per_second"] == pytest.approx(0.76 * GEN4_X16)
    assert "measured 13.6GB/s over PCIe, 43.16% of its Gen4 x16 link" in finding.summary
    assert "of the 31.51GB/s its best link, Gen4 x16, carries" in finding.description
    assert finding.details["measured_at"] == T0 - 3600


def test_bandwidth_low_silent_on_a_healthy_measurement_or_without_one():
    detector = pcie_bandwidth_low.Detector(THRESHOLDS.pcie_bandwidth_low)
    healthy = Trace()
    now = healthy.run(T0, T0 + 10, gpu=lambda t: gpu_rows(), bench=lambda t: bench_rows(h2d=24.5e9))
    assert detector.evaluate(healthy.history, now) == []
    unmeasured = Trace()
    now = unmeasured.run(T0, T0 + 10, gpu=lambda t: gpu_rows())
    assert detector.evaluate(unmeasured.history, now) == []
    # Gen5 x16 has the higher floor: 50 GB/s is 79 % of 63 GB/s, below 82.5 %.
    gen5 = Trace()
    now = gen5.run(T0, T0 + 10, gpu=lambda t: gpu_rows(generation=5, max_generation=5),
                   bench=lambda t: bench_rows(h2d=50e9, d2h=53e9))
    (finding,) = detector.evaluate(gen5.history, now)
    assert finding.threshold == 0.825 and finding.value == pytest.approx(50e9 / (16 * 3938.5e6))


# --- its rule's promtool cases ------------------------------------------------------------------


def promtool_cases(t, catalog) -> list[Test]:
    b = t.pcie_bandwidth_low
    rule = catalog.find("GpuPcieBandwidthLow")
    gen4, gen5 = capacity(4, 16), capacity(5, 16)
    test = Test("measured bandwidth: GPU 0 (Gen4 x16) at half its link and GPU 2 (Gen5 x16) just "
                "under its floor fire; GPU 1 healthy and GPU 3 never measured stay silent",
                240, catalog)
    slow, gen5_low = b.floor_share_gen4 / 2 * gen4, (b.floor_share_gen5 - 0.02) * gen5
    healthy4, healthy5 = (b.floor_share_gen4 + 0.02) * gen4, min(b.floor_share_gen5 + 0.05, 1) * gen5
    for gpu, max_generation in ((GPU0, 4), (GPU1, 4), (GPU2, 5), (GPU3, 4)):
        link(test, gpu, 1, 16, max_generation)  # idle: links downshift, the max is what counts
    measured(test, GPU0, slow, healthy4)
    measured(test, GPU1, healthy4, healthy4)
    measured(test, GPU2, healthy5, gen5_low)
    test.expect(120, rule.alert,
                test.alert(rule, GPU0, value=slow / gen4, measured=slow, best=gen4, max_gen=4, max_width=16),
                test.alert(rule, GPU2, value=gen5_low / gen5, measured=gen5_low, best=gen5, max_gen=5,
                           max_width=16))
    return [test]
