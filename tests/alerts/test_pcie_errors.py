"""The tests of the pcie_errors alert family (agent/alerts/pcie_errors.py): its detector, on
histories written sample by sample, and its rule's promtool cases (`promtool_cases`, written
to rules/tests/generated_pcie_errors.yml by `python -m tests.rules.generate` and run by
promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

import pytest

from hybridmon.agent.alerts import pcie_errors
from hybridmon.exporters.gpu import PCIE_REPLAYS
from hybridmon.exporters.pcie import AER_ERRORS
from hybridmon.pcie_rates import replay_bound_per_minute
from tests.support.detector_history import (
    HISTORY_GPU0,
    T0,
    THRESHOLDS,
    Trace,
    gpu_rows,
    pcie_rows,
)
from tests.support.promtool_cases import (
    BUS0,
    BUS1,
    GPU0,
    GPU1,
    GPU2,
    ONSET,
    Test,
    firing,
    not_yet,
)
from tests.support.promtool_inputs import link


def errors():
    return pcie_errors.Detector(THRESHOLDS.pcie_errors)


def test_replays_above_the_dcgm_bound_fire():
    trace = Trace()
    now = trace.run(T0, T0 + 600, gpu=lambda t: gpu_rows(replays=(t - T0) * 20 / 60))
    (finding,) = [f for f in errors().evaluate(trace.history, now)
                  if f.alertname == "GpuPcieReplayErrors"]
    assert finding.labels == HISTORY_GPU0
    assert finding.value == pytest.approx(20.0)
    assert finding.threshold == 16
    assert "20 PCIe replays per minute, above DCGM's bound of 16 for its Gen4 x16 link" in finding.summary


def test_replays_below_the_bound_are_silent():
    trace = Trace()
    now = trace.run(T0, T0 + 600, gpu=lambda t: gpu_rows(replays=(t - T0) * 15 / 60))
    assert errors().evaluate(trace.history, now) == []
    trace = Trace()  # the same rate on a Gen5 x16 link, bound 31/min
    now = trace.run(T0, T0 + 600, gpu=lambda t: gpu_rows(replays=(t - T0) * 25 / 60,
                                                         generation=5, max_generation=5))
    assert errors().evaluate(trace.history, now) == []


def test_replay_counter_reset_is_not_a_storm_or_a_negative_rate():
    trace = Trace()
    # a driver reload resets the counter from 90,000 to 0 half-way through the window
    now = trace.run(T0, T0 + 600, gpu=lambda t: gpu_rows(
        replays=90_000 + (t - T0) / 60 if t < T0 + 450 else (t - T0 - 450) * 10 / 60))
    assert errors().evaluate(trace.history, now) == []
    trace = Trace()
    now = trace.run(T0, T0 + 600, gpu=lambda t: gpu_rows(
        replays=90_000 + (t - T0) * 20 / 60 if t < T0 + 450 else (t - T0 - 450) * 20 / 60))
    (finding,) = errors().evaluate(trace.history, now)
    # 150 s at 20/min before the reset (49 increments of 1/3), 150 s after it; the first point
    # after the reset counts from 0
    assert finding.value == pytest.approx(20.0, rel=0.01)


def test_replays_need_two_points_in_the_window():
    trace = Trace()
    trace.commit("gpu", T0, gpu_rows(replays=0))
    trace.commit("gpu", T0 + 400, gpu_rows(replays=5000))
    assert errors().evaluate(trace.history, T0 + 400) == []


def test_a_new_fatal_aer_error_is_critical():
    trace = Trace()
    now = trace.run(T0, T0 + 120, gpu=lambda t: gpu_rows(), pcie=lambda t: pcie_rows(
        aer={"correctable": 5, "nonfatal": 0, "fatal": 1 if t >= T0 + 100 else 0}))
    (finding,) = errors().evaluate(trace.history, now)
    assert finding.alertname == "PcieAerErrors" and finding.severity == "critical"
    assert finding.labels == {"pci_bus_id": "0000:17:00.0", "aer_severity": "fatal"}
    assert finding.value == 1 and finding.threshold == 0
    assert finding.details["gpu"] == "0"  # the rule's text cannot name the GPU behind a bus id
    assert "PCIe device 0000:17:00.0 on " in finding.summary and "1 new fatal AER errors" in finding.summary


def test_old_aer_counts_since_boot_are_silent():
    trace = Trace()
    now = trace.run(T0, T0 + 600, pcie=lambda t: pcie_rows(
        aer={"correctable": 500, "nonfatal": 3, "fatal": 1}))
    assert errors().evaluate(trace.history, now) == []


def test_correctable_aer_errors_warn_above_the_hourly_rate():
    trace = Trace()
    now = trace.run(T0, T0 + 600, pcie=lambda t: pcie_rows(
        aer={"correctable": (t - T0) * 2 / 60, "nonfatal": 0, "fatal": 0}))
    (finding,) = errors().evaluate(trace.history, now)
    assert finding.severity == "warning"
    assert finding.labels == {"pci_bus_id": "0000:17:00.0", "aer_severity": "correctable"}
    assert finding.value == pytest.approx(120.0) and finding.threshold == 60
    trace = Trace()
    now = trace.run(T0, T0 + 600, pcie=lambda t: pcie_rows(
        aer={"correctable": (t - T0) * 0.5 / 60}))
    assert errors().evaluate(trace.history, now) == []


# --- its rule's promtool cases ------------------------------------------------------------------


def replay_case(t, catalog) -> Test:
    e = t.pcie_errors
    rule = catalog.find("GpuPcieReplayErrors")
    gen4, gen5 = (replay_bound_per_minute(e.bit_error_rate, g, 16) for g in (4, 5))
    under_gen5 = gen5 - 1 if gen5 - 1 > gen4 else gen5 / 2  # too many for Gen4, fine for Gen5
    at = ONSET + int(e.window_seconds) + 60                  # the whole window after the onset
    test = Test("PCIe replays: GPU 0 (Gen4 x16) above its DCGM bound; GPU 1 (Gen5 x16) under its "
                "own bound; GPU 2's counter resets (driver reload) and stays silent", at + 120, catalog)
    link(test, GPU0, 4, 16)
    link(test, GPU1, 5, 16, 5)
    link(test, GPU2, 4, 16)
    test.counter(PCIE_REPLAYS.name, gen4 / 4 / 60, 2 * gen4 / 60, **GPU0)
    test.counter(PCIE_REPLAYS.name, under_gen5 / 60, under_gen5 / 60, **GPU1)
    per_step = gen4 / 2 / 60 * test.interval
    before = [1000 + per_step * i for i in range(9)]
    test.values(PCIE_REPLAYS.name,
                before + [per_step * i for i in range(test.samples - len(before))], **GPU2)
    test.expect(not_yet(0), rule.alert)
    test.expect(at, rule.alert, test.alert(rule, GPU0, value=2 * gen4, bound=gen4, gen=4, width=16))
    return test


def aer_uncorrectable_case(t, catalog) -> Test:
    rule = catalog.find("PcieAerErrors", "critical")
    test = Test("AER: one non-fatal error on 0000:17:00.0 is critical at once", ONSET + 360, catalog)
    test.gauge(AER_ERRORS.name, 0, 1, pci_bus_id=BUS0, severity="nonfatal")
    test.constant(AER_ERRORS.name, 0, pci_bus_id=BUS0, severity="fatal")
    test.constant(AER_ERRORS.name, 3, pci_bus_id=BUS1, severity="nonfatal")
    test.expect(not_yet(0), rule.alert)
    test.expect(firing(0), rule.alert, test.alert(rule, {"pci_bus_id": BUS0, "aer_severity": "nonfatal"},
                                                  value=1))
    return test


def aer_correctable_case(t, catalog) -> Test:
    e = t.pcie_errors
    rule = catalog.find("PcieAerErrors", "warning")
    per_hour = e.aer_correctable_per_hour
    at = ONSET + int(e.window_seconds) + 60
    test = Test("AER: a steady stream of correctable errors on 0000:ca:00.0 warns; half the "
                "rate on 0000:17:00.0 does not", at + 120, catalog)
    test.counter(AER_ERRORS.name, 0, 2 * per_hour / 3600, pci_bus_id=BUS1, severity="correctable")
    test.counter(AER_ERRORS.name, per_hour / 2 / 3600, per_hour / 2 / 3600,
                 pci_bus_id=BUS0, severity="correctable")
    test.expect(not_yet(0), rule.alert)
    test.expect(at, rule.alert, test.alert(rule, {"pci_bus_id": BUS1, "aer_severity": "correctable"},
                                           value=2 * per_hour))
    return test


def promtool_cases(t, catalog) -> list[Test]:
    return [replay_case(t, catalog),
            *([aer_uncorrectable_case(t, catalog)] if t.pcie_errors.aer_uncorrectable_any else []),
            aer_correctable_case(t, catalog)]
