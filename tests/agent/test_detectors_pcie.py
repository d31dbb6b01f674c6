import pytest

from hybridmon.agent.alerts import pcie_bandwidth_low, pcie_starvation
from hybridmon.agent.alerts import pcie_link_degraded
from hybridmon.pcie_rates import theoretical_capacity
from hybridmon.agent.alerts import gpu_lost, pcie_errors
from tests.support.detector_history import (assert_says_its_rules_words, T0, THRESHOLDS, Trace,
                                            bench_rows, gpu_rows, only, pcie_rows)

GEN4_X16 = 16 * 1969.2e6
GPU0 = {"gpu": "0", "uuid": "GPU-0000"}


def starvation():
    return pcie_starvation.Detector(THRESHOLDS.pcie_starvation)


def test_capacity_and_replay_bound_tables():
    assert theoretical_capacity(4, 16) == pytest.approx(31.5e9, rel=1e-3)
    assert theoretical_capacity(6, 16) == 16 * 7563e6
    assert theoretical_capacity(7, 16) is None
    assert pcie_errors.link_replay_bound(1e-12, 4, 16) == 16
    assert pcie_errors.link_replay_bound(1e-12, 5, 16) == 31
    assert pcie_errors.link_replay_bound(1e-12, 1, 1) == 1
    assert pcie_errors.link_replay_bound(1e-12, 7, 16) is None


# --- GpuPcieStarvation ---------------------------------------------------------------------

def test_starvation_fires_when_the_link_is_full_and_the_gpu_waits():
    trace = Trace()
    now = trace.run(T0, T0 + 120, gpu=lambda t: gpu_rows(utilization=0.2, h2d=28e9, d2h=2e9))
    (finding,) = starvation().evaluate(trace.history, now)
    assert finding.alertname == "GpuPcieStarvation" and finding.severity == "warning"
    assert finding.labels == GPU0
    assert finding.value == pytest.approx(28e9 / GEN4_X16) and finding.threshold == 0.85
    assert finding.details["traffic_bytes_per_second"] == pytest.approx(28e9)
    assert finding.details["threshold_bytes_per_second"] == pytest.approx(0.85 * GEN4_X16)
    assert finding.for_seconds == 120
    assert finding.details["direction"] == "host_to_device"
    assert finding.details["capacity_source"] == "theoretical"
    assert finding.summary.startswith("GPU 0 on ") and "link 88.87% full, GPU 20% busy" in finding.summary
    assert "moved 28GB/s over PCIe" in finding.description and "Gen4 x16 link" in finding.description
    assert "utilization was 20% (threshold: at most 50%)" in finding.description


def test_starvation_silent_near_but_below_capacity():
    trace = Trace()
    # a busy, healthy offload host: 25 GB/s of 31.5 (79 %) with the GPU mostly idle
    now = trace.run(T0, T0 + 120, gpu=lambda t: gpu_rows(utilization=0.3, h2d=25e9, d2h=25e9))
    assert starvation().evaluate(trace.history, now) == []


def test_starvation_silent_while_the_gpu_keeps_working():
    trace = Trace()
    now = trace.run(T0, T0 + 120, gpu=lambda t: gpu_rows(utilization=0.9, h2d=29e9))
    assert starvation().evaluate(trace.history, now) == []


def test_starvation_uses_the_measured_capacity_when_there_is_one():
    gpu = lambda t: gpu_rows(utilization=0.1, h2d=24e9, d2h=2e9)
    trace = Trace()
    now = trace.run(T0, T0 + 120, gpu=gpu)
    assert starvation().evaluate(trace.history, now) == []
    measured = Trace()
    now = measured.run(T0, T0 + 120, gpu=gpu, bench=lambda t: bench_rows(h2d=26e9, d2h=25e9))
    (finding,) = starvation().evaluate(measured.history, now)
    assert finding.value == pytest.approx(24 / 26)
    assert finding.details["threshold_bytes_per_second"] == pytest.approx(0.85 * 26e9)
    assert finding.details["capacity_source"] == "measured"
    assert "capacity up to 26GB/s: what hybridmon bench measured" in finding.description


def test_starvation_judges_each_direction_against_its_own_capacity():
    # 20 GB/s device->host is 95 % of a measured 21 GB/s, while 22 GB/s host->device is 73 % of 30.
    trace = Trace()
    now = trace.run(T0, T0 + 120, gpu=lambda t: gpu_rows(utilization=0.1, h2d=22e9, d2h=20e9),
                    bench=lambda t: bench_rows(h2d=30e9, d2h=21e9))
    (finding,) = starvation().evaluate(trace.history, now)
    assert finding.details["direction"] == "device_to_host"
    assert finding.value == pytest.approx(20 / 21)


def test_bandwidth_low_fires_on_a_measurement_far_below_the_link():
    detector = pcie_bandwidth_low.Detector(THRESHOLDS.pcie_bandwidth_low)
    trace = Trace()
    # Gen4 x16: the floor is 76 % of 31.5 GB/s = 23.9 GB/s; host->device measured 13.6 GB/s.
    now = trace.run(T0, T0 + 10, gpu=lambda t: gpu_rows(generation=3, width=16),
                    bench=lambda t: bench_rows(h2d=13.6e9, d2h=26.4e9))
    (finding,) = detector.evaluate(trace.history, now)
    assert finding.alertname == "GpuPcieBandwidthLow" and finding.labels == GPU0
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


def test_starvation_judges_the_minute_average_not_one_burst():
    trace = Trace()
    # pinned for 20 s of the last minute only
    now = trace.run(T0, T0 + 120, gpu=lambda t: gpu_rows(
        utilization=0.1, h2d=30e9 if t > T0 + 100 else 5e9))
    assert starvation().evaluate(trace.history, now) == []


def test_starvation_of_a_gpu_that_appeared_mid_window():
    trace = Trace()
    now = trace.run(T0, T0 + 120, gpu=lambda t: gpu_rows(utilization=0.9, h2d=1e9) + (
        gpu_rows("1", "GPU-1111", utilization=0.05, h2d=1e9, d2h=30e9, pci_bus_id="0000:ca:00.0")
        if t >= T0 + 90 else []))
    (finding,) = starvation().evaluate(trace.history, now)
    assert finding.labels == {"gpu": "1", "uuid": "GPU-1111"}
    assert finding.details["traffic_bytes_per_second"] == pytest.approx(30e9)
    assert finding.details["direction"] == "device_to_host"


def test_starvation_silent_when_the_series_stopped():
    trace = Trace()
    last = trace.run(T0, T0 + 120, gpu=lambda t: gpu_rows(utilization=0.1, h2d=30e9))
    # the GPU collector has had nothing for over a minute (a gap): absent, not starving
    trace.run(last + 1, last + 70, gpu=lambda t: [])
    assert starvation().evaluate(trace.history, last + 70) == []
    assert len(starvation().evaluate(trace.history, last + 30)) == 1


# --- GpuPcieLinkDegraded -------------------------------------------------------------------

def degraded():
    return pcie_link_degraded.Detector(THRESHOLDS.pcie_link_degraded)


def test_link_degraded_fires_under_load():
    trace = Trace()
    now = trace.run(T0, T0 + 60, gpu=lambda t: gpu_rows(utilization=0.8, generation=3, width=8))
    (finding,) = degraded().evaluate(trace.history, now)
    assert finding.labels == GPU0 and finding.for_seconds == 300
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


# --- GpuPcieReplayErrors -------------------------------------------------------------------

def errors():
    return pcie_errors.Detector(THRESHOLDS.pcie_errors)


def test_replays_above_the_dcgm_bound_fire():
    trace = Trace()
    now = trace.run(T0, T0 + 600, gpu=lambda t: gpu_rows(replays=(t - T0) * 20 / 60))
    (finding,) = [f for f in errors().evaluate(trace.history, now)
                  if f.alertname == "GpuPcieReplayErrors"]
    assert finding.labels == GPU0
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


# --- PcieAerErrors ---------------------------------------------------------------------------

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


# --- GpuLost ---------------------------------------------------------------------------------

def lost():
    return gpu_lost.Detector(THRESHOLDS.gpu_lost)


def test_gpu_lost_by_nvml_and_by_the_bus():
    trace = Trace()
    now = trace.run(T0, T0 + 30,
                    gpu=lambda t: gpu_rows(up=0 if t >= T0 + 20 else 1) + gpu_rows(
                        "1", "GPU-1111", pci_bus_id="0000:ca:00.0"),
                    pcie=lambda t: pcie_rows() + pcie_rows(
                        "0000:ca:00.0", present=0 if t >= T0 + 25 else 1))
    findings = lost().evaluate(trace.history, now)
    nvml = only(findings, "GpuLost", gpu="0")
    assert nvml.labels == GPU0 and nvml.severity == "critical" and nvml.for_seconds == 0
    assert nvml.details == {"pci_bus_id": "0000:17:00.0"}
    bus = only(findings, "GpuLost", pci_bus_id="0000:ca:00.0")
    assert bus.labels == {"pci_bus_id": "0000:ca:00.0"} and bus.details["gpu"] == "1"
    assert len(findings) == 2
    assert lost().evaluate(trace.history, T0 + 19) == []


def test_gpu_lost_silent_when_every_gpu_is_up():
    trace = Trace()
    now = trace.run(T0, T0 + 30, gpu=lambda t: gpu_rows(), pcie=lambda t: pcie_rows())
    assert lost().evaluate(trace.history, now) == []
