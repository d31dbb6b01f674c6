"""The tests of the pcie_link_degraded alert family (agent/alerts/pcie_link_degraded.py): its detector, on
histories written sample by sample, and its rule's promtool cases (`promtool_cases`, written
to rules/tests/generated_pcie_link_degraded.yml by `python -m tests.rules.generate` and run by
promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

import pytest

from hybridmon.agent.alerts import pcie_link_degraded
from hybridmon.exporters.gpu import UTILIZATION
from tests.support.detector_history import (
    GEN4_X16,
    HISTORY_GPU0,
    T0,
    THRESHOLDS,
    Trace,
    gpu_rows,
)
from tests.support.promtool_cases import (
    GPU0,
    GPU1,
    GPU2,
    GPU3,
    Test,
    above,
    firing,
    not_yet,
)
from tests.support.promtool_inputs import capacity, link


def degraded():
    return pcie_link_degraded.Detector(THRESHOLDS.pcie_link_degraded)


def test_link_degraded_fires_under_load():
    trace = Trace()
    now = trace.run(T0, T0 + 60, gpu=lambda t: gpu_rows(utilization=0.8, generation=3, width=8))
    (finding,) = degraded().evaluate(trace.history, now)
    assert finding.labels == HISTORY_GPU0 and finding.for_seconds == 300
    assert finding.value == pytest.approx(8 * 984.6e6 / GEN4_X16) and finding.threshold == 1
    assert finding.details["capacity_bytes_per_second"] == pytest.approx(8 * 984.6e6)
    assert "PCIe link at Gen3 x8 of Gen4 x16" in finding.summary
    assert finding.details["link_width_lanes"] == 8


def test_link_degraded_silent_on_an_idle_downshifted_gpu():
    trace = Trace()
    now = trace.run(T0, T0 + 120, gpu=lambda t: gpu_rows(utilization=0.0, generation=1, h2d=0,
                                                          d2h=0))
    assert degraded().evaluate(trace.history, now) == []


def test_link_degraded_needs_the_busy_threshold():
    trace = Trace()
    now = trace.run(T0, T0 + 60, gpu=lambda t: gpu_rows(utilization=0.29, width=8))
    assert degraded().evaluate(trace.history, now) == []
    trace = Trace()
    now = trace.run(T0, T0 + 60, gpu=lambda t: gpu_rows(utilization=0.30, width=8))
    assert len(degraded().evaluate(trace.history, now)) == 1


def test_link_degraded_silent_at_full_speed_and_without_link_figures():
    trace = Trace()
    now = trace.run(T0, T0 + 60, gpu=lambda t: gpu_rows(utilization=1.0))
    assert degraded().evaluate(trace.history, now) == []
    trace = Trace()
    now = trace.run(T0, T0 + 60, gpu=lambda t: gpu_rows(utilization=1.0, width=8, max_width=None))
    assert degraded().evaluate(trace.history, now) == []


# --- its rule's promtool cases ------------------------------------------------------------------


def promtool_cases(t, catalog) -> list[Test]:
    d = t.pcie_link_degraded
    rule = catalog.find("GpuPcieLinkDegraded")
    busy = above(d.busy_utilization_at_least)
    test = Test("PCIe link degraded under load: GPU 0 drops to Gen3, GPU 2 to x8; GPU 1 idles "
                "at Gen1 and GPU 3 runs Gen1 at idle, Gen4 when busy: both silent",
                firing(d.for_seconds) + 120, catalog)
    link(test, GPU0, (4, 3), 16)
    link(test, GPU1, 1, 16)
    link(test, GPU2, 4, (16, 8))
    link(test, GPU3, (1, 4), 16)
    for gpu, before, after in ((GPU0, busy, busy), (GPU1, 0, 0), (GPU2, busy, busy), (GPU3, 0, busy)):
        test.gauge(UTILIZATION.name, before, after, **gpu)
    test.expect(not_yet(d.for_seconds), rule.alert)
    test.expect(firing(d.for_seconds), rule.alert,
                test.alert(rule, GPU0, value=capacity(3, 16) / capacity(4, 16), gen=3, width=16,
                           max_gen=4, max_width=16, util=busy),
                test.alert(rule, GPU2, value=capacity(4, 8) / capacity(4, 16), gen=4, width=8,
                           max_gen=4, max_width=16, util=busy))
    return [test]
