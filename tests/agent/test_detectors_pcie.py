import pytest

from hybridmon.agent.alerts import pcie_bandwidth_low, pcie_starvation
from hybridmon.agent.alerts import pcie_link_degraded
from hybridmon.exporters import bench, gpu
from hybridmon.pcie_rates import (LinkCapacity, achievable_capacity, bidirectional_capacity, effective_capacity,
                                  theoretical_capacity)
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
# A saturated Gen4 x16 link shows 0.82 of its theoretical rate (nvbandwidth's copy engines:
# 25.5-26.3 of 31.5 GB/s); what the detector divides by is pcie_rates' achievable capacity.

GEN4_ACHIEVABLE = achievable_capacity(4, 16)
GEN4_BOTH_WAYS = bidirectional_capacity(4, 16)


def test_achievable_capacity_is_below_what_a_saturated_copy_engine_shows():
    assert GEN4_ACHIEVABLE == pytest.approx(0.81 * GEN4_X16) and GEN4_ACHIEVABLE <= 0.82 * GEN4_X16
    assert GEN4_BOTH_WAYS == pytest.approx(2 * 0.58 * GEN4_X16)
    assert achievable_capacity(1, 16) == pytest.approx(0.76 * 16 * 250e6)
    assert achievable_capacity(7, 16) is None and bidirectional_capacity(4, 0) is None
    assert effective_capacity(26e9, 4, 16) == LinkCapacity(26e9, "measured")
    assert effective_capacity(None, 4, 16) == LinkCapacity(GEN4_ACHIEVABLE, "achievable", "Gen4 x16")
    assert effective_capacity(None, 4, 16).described == "achievable on Gen4 x16"
    assert effective_capacity(26e9, 4, 16).described == "measured"
    share = THRESHOLDS.pcie_starvation.traffic_share_of_capacity
    # copy-engine saturation fires; 0.70 of the theoretical rate, one direction alone, does not
    assert 0.82 * GEN4_X16 / GEN4_ACHIEVABLE >= share > 0.70 * GEN4_X16 / GEN4_ACHIEVABLE


def test_starvation_fires_when_the_link_is_full_and_the_gpu_waits():
    trace = Trace()
    h2d = 0.82 * GEN4_X16   # 25.8 GB/s: a saturated copy engine
    now = trace.run(T0, T0 + 120, gpu=lambda t: gpu_rows(utilization=0.2, h2d=h2d, d2h=2e9))
    (finding,) = starvation().evaluate(trace.history, now)
    assert finding.alertname == "GpuPcieStarvation" and finding.severity == "warning"
    assert finding.labels == GPU0
    assert finding.value == pytest.approx(h2d / GEN4_ACHIEVABLE) and finding.threshold == 0.9
    assert finding.details["traffic_bytes_per_second"] == pytest.approx(h2d)
    assert finding.details["threshold_bytes_per_second"] == pytest.approx(0.9 * GEN4_ACHIEVABLE)
    assert finding.for_seconds == 120
    assert finding.details["direction"] == "host_to_device"
    assert finding.details["capacity_source"] == "achievable"
    assert finding.summary.startswith("GPU 0 on ") and "link 101.2% full, GPU 20% busy" in finding.summary
    assert "moved 25.84GB/s host to device and 2GB/s device to host" in finding.description
    assert "up to 25.52GB/s each way" in finding.description and "Gen4 x16" in finding.description
    assert "36.55GB/s both ways at once" in finding.description
    assert "utilization was 20% (threshold: at most 50%)" in finding.description
    assert_says_its_rules_words(finding)


def test_starvation_silent_clearly_below_what_the_link_carries():
    trace = Trace()
    # a busy, healthy offload host: 0.70 of 31.5 GB/s one way (86 % of what copies achieve),
    # little the other way, the GPU mostly idle
    now = trace.run(T0, T0 + 120, gpu=lambda t: gpu_rows(utilization=0.3, h2d=0.70 * GEN4_X16, d2h=2e9))
    assert starvation().evaluate(trace.history, now) == []


def test_starvation_silent_while_the_gpu_keeps_working():
    trace = Trace()
    now = trace.run(T0, T0 + 120, gpu=lambda t: gpu_rows(utilization=0.9, h2d=29e9))
    assert starvation().evaluate(trace.history, now) == []


def test_starvation_fires_when_both_directions_fill_the_link_together():
    # 0.60 of the theoretical rate each way: neither direction near its own 0.81, but together
    # past the 2 x 0.58 nvbandwidth's bidirectional copies reach
    trace = Trace()
    each = 0.60 * GEN4_X16
    now = trace.run(T0, T0 + 120, gpu=lambda t: gpu_rows(utilization=0.1, h2d=each, d2h=each))
    (finding,) = starvation().evaluate(trace.history, now)
    assert finding.details["direction"] == "both"
    assert finding.value == pytest.approx(2 * each / GEN4_BOTH_WAYS)
    assert finding.details["capacity_bytes_per_second"] == pytest.approx(GEN4_BOTH_WAYS)
    assert finding.details["capacity_source"] == "bidirectional factor"
    assert finding.details["host_to_device_share_of_capacity"] == pytest.approx(each / GEN4_ACHIEVABLE)
    lighter = Trace()
    now = lighter.run(T0, T0 + 120, gpu=lambda t: gpu_rows(utilization=0.1, h2d=0.45 * GEN4_X16,
                                                          d2h=0.45 * GEN4_X16))
    assert starvation().evaluate(lighter.history, now) == []


def test_starvation_judges_a_link_back_at_gen1_by_the_gen4_it_carried_the_minute_with():
    # a minute of copies at 0.6 of Gen4 x16, then the link drops to Gen1 x16 at idle (power saving):
    # 10 s later the minute's average (0.5 of Gen4) is 4 times what Gen1 carries, yet the link was
    # never full
    trace = Trace()
    trace.run(T0, T0 + 59, gpu=lambda t: gpu_rows(utilization=0.3, h2d=1e8, d2h=1e8))
    trace.run(T0 + 60, T0 + 120, gpu=lambda t: gpu_rows(utilization=0.3, h2d=0.6 * GEN4_X16, d2h=1e8))
    now = trace.run(T0 + 121, T0 + 130, gpu=lambda t: gpu_rows(utilization=0.3, h2d=1e6, d2h=1e6, generation=1))
    assert starvation().evaluate(trace.history, now) == []


def test_starvation_silent_on_bursts_below_capacity_with_the_link_idling_between():
    # 10 s on, 10 s off at a saturated copy engine's 0.82 of Gen4 x16 (average 0.41), the link at
    # Gen1 whenever it idles: judged now (Gen1) it is 3 times full, judged by its best (Gen4) half
    trace = Trace()

    def bursty(t: float):
        on = int(t - T0) % 20 < 10
        return gpu_rows(utilization=0.3, h2d=0.82 * GEN4_X16 if on else 1e6, d2h=1e6, generation=4 if on else 1)

    now = trace.run(T0, T0 + 135, gpu=bursty)   # the last 6 ticks idle, at Gen1
    assert starvation().evaluate(trace.history, now) == []


def test_starvation_judges_a_link_running_gen1_under_traffic_against_gen1():
    # below its maximum under load is GpuPcieLinkDegraded's business; the link it delivered with,
    # Gen1 x16, is full
    trace = Trace()
    gen1 = theoretical_capacity(1, 16)
    now = trace.run(T0, T0 + 120, gpu=lambda t: gpu_rows(utilization=0.1, h2d=0.82 * gen1, d2h=1e6, generation=1))
    (finding,) = starvation().evaluate(trace.history, now)
    assert finding.value == pytest.approx(0.82 * gen1 / achievable_capacity(1, 16))
    assert finding.details["link_generation"] == 1


@pytest.mark.parametrize("counter", [gpu.PCIE_BYTES, gpu.PCIE_SAMPLED_BYTES])
def test_starvation_reads_a_bytes_counter_before_the_gauge(counter):
    """The 20 ms gauge reads 0.3 of the link, the counter 0.82: the counter is read, as the rule
    reads it. PCIE_BYTES is NVML's exact count; PCIE_SAMPLED_BYTES the sampler's estimate on GPUs
    without one, which a 15 s scrape keeps whole where it keeps one gauge tick in fifteen."""
    trace = Trace()
    h2d, d2h = 0.82 * GEN4_X16, 2e9

    def counted(t: float):
        return gpu_rows(utilization=0.1, h2d=0.3 * GEN4_X16, d2h=d2h) + [
            (counter, h2d * (t - T0), "0", "GPU-0000", "host_to_device"),
            (counter, d2h * (t - T0), "0", "GPU-0000", "device_to_host")]

    now = trace.run(T0, T0 + 120, gpu=counted)
    (finding,) = starvation().evaluate(trace.history, now)
    assert finding.details["traffic_bytes_per_second"] == pytest.approx(h2d)
    assert finding.value == pytest.approx(h2d / GEN4_ACHIEVABLE)
    gauge_only = Trace()
    now = gauge_only.run(T0, T0 + 120, gpu=lambda t: gpu_rows(utilization=0.1, h2d=0.3 * GEN4_X16, d2h=d2h))
    assert starvation().evaluate(gauge_only.history, now) == []


def measured_both_ways(h2d: float | None, d2h: float | None) -> list:
    """A benchmark run's rows (exporters/bench.py): 26 GB/s one direction at a time, and what each
    direction carried while the other copied too (None: the run has no figure that way)."""
    return bench_rows(h2d=26e9, d2h=26e9) + [
        (bench.MEASURED_BIDIRECTIONAL_CAPACITY, value, "0", "GPU-0000", direction)
        for direction, value in (("host_to_device", h2d), ("device_to_host", d2h)) if value is not None]


def test_starvation_judges_both_directions_against_the_measured_bidirectional_capacity():
    # 13 GB/s each way on a Gen4 x16 link whose bench carried only 14 GB/s each way while both
    # copied (nvbandwidth issue #15 saw 11-16 on some hosts): 93 % of the measured 28 GB/s, though
    # only 71 % of the factor's 36.55 GB/s (2 x 0.58 x 31.5)
    load = lambda t: gpu_rows(utilization=0.1, h2d=13e9, d2h=13e9)
    trace = Trace()
    now = trace.run(T0, T0 + 120, gpu=load, bench=lambda t: measured_both_ways(14e9, 14e9))
    (finding,) = starvation().evaluate(trace.history, now)
    assert finding.details["direction"] == "both"
    assert finding.value == pytest.approx(26 / 28)
    assert finding.details["capacity_bytes_per_second"] == pytest.approx(28e9)
    assert finding.details["capacity_source"] == "measured"
    assert "28GB/s both ways at once" in finding.description
    assert_says_its_rules_words(finding)
    # without the bidirectional figure, or with only one direction's (half a sum), the factor counts
    for h2d, d2h in ((None, None), (14e9, None)):
        factor = Trace()
        now = factor.run(T0, T0 + 120, gpu=load, bench=lambda t: measured_both_ways(h2d, d2h))
        assert starvation().evaluate(factor.history, now) == [], (h2d, d2h)
    assert 26e9 / GEN4_BOTH_WAYS < THRESHOLDS.pcie_starvation.traffic_share_of_capacity


def test_starvation_uses_the_measured_capacity_when_there_is_one():
    gpu_load = lambda t: gpu_rows(utilization=0.1, h2d=21e9, d2h=2e9)
    trace = Trace()
    now = trace.run(T0, T0 + 120, gpu=gpu_load)
    assert starvation().evaluate(trace.history, now) == []   # 82 % of what Gen4 x16 achieves
    measured = Trace()
    now = measured.run(T0, T0 + 120, gpu=gpu_load, bench=lambda t: bench_rows(h2d=22e9, d2h=25e9))
    (finding,) = starvation().evaluate(measured.history, now)
    assert finding.value == pytest.approx(21 / 22)
    assert finding.details["threshold_bytes_per_second"] == pytest.approx(0.9 * 22e9)
    assert finding.details["capacity_source"] == "measured"
    assert "up to 25GB/s each way and 36.55GB/s both ways at once (what hybridmon bench measured" \
        in finding.description


def test_starvation_judges_each_direction_against_its_own_capacity():
    # 20 GB/s device->host is 95 % of a measured 21 GB/s, while 6 GB/s host->device is 23 % of 26.
    trace = Trace()
    now = trace.run(T0, T0 + 120, gpu=lambda t: gpu_rows(utilization=0.1, h2d=6e9, d2h=20e9),
                    bench=lambda t: bench_rows(h2d=26e9, d2h=21e9))
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
        utilization=0.1, h2d=26e9 if t > T0 + 100 else 5e9))
    assert starvation().evaluate(trace.history, now) == []


def test_starvation_of_a_gpu_that_appeared_mid_window():
    trace = Trace()
    now = trace.run(T0, T0 + 120, gpu=lambda t: gpu_rows(utilization=0.9, h2d=1e9) + (
        gpu_rows("1", "GPU-1111", utilization=0.05, h2d=1e9, d2h=26e9, pci_bus_id="0000:ca:00.0")
        if t >= T0 + 90 else []))
    (finding,) = starvation().evaluate(trace.history, now)
    assert finding.labels == {"gpu": "1", "uuid": "GPU-1111"}
    assert finding.details["traffic_bytes_per_second"] == pytest.approx(26e9)
    assert finding.details["direction"] == "device_to_host"


def test_starvation_silent_when_the_series_stopped():
    trace = Trace()
    last = trace.run(T0, T0 + 120, gpu=lambda t: gpu_rows(utilization=0.1, h2d=26e9))
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


def gpu_rows_as_exported(up: bool, gpu_index: str = "0", uuid: str = "GPU-0000",
                         pci_bus_id: str = "0000:17:00.0"):
    """A GPU's rows as exporters/gpu.py writes them: a lost GPU reports GPU_UP 0 and nothing else,
    its gpu_info (the only series naming its PCI address) stops with the loss."""
    if up:
        return gpu_rows(gpu_index, uuid, pci_bus_id=pci_bus_id)
    return [(gpu.GPU_UP, 0, gpu_index, uuid)]


def test_gpu_lost_one_gpu_in_both_views_is_one_finding_with_both_identities():
    """GPU 1 falls off the bus: NVML loses it at +20 s, its PCI function leaves sysfs at +25 s.
    Before issue 14 these were two findings ({gpu, uuid} and {pci_bus_id}), two pages."""
    trace = Trace()
    now = trace.run(T0, T0 + 30,
                    gpu=lambda t: gpu_rows() + gpu_rows_as_exported(
                        t < T0 + 20, "1", "GPU-1111", pci_bus_id="0000:ca:00.0"),
                    pcie=lambda t: pcie_rows() + pcie_rows(
                        "0000:ca:00.0", present=0 if t >= T0 + 25 else 1))
    findings = lost().evaluate(trace.history, now)
    assert [f.labels for f in findings] == [{"gpu": "1", "uuid": "GPU-1111", "pci_bus_id": "0000:ca:00.0"}]
    assert findings[0].severity == "critical" and findings[0].for_seconds == 0
    assert "GPU 1 on " in findings[0].summary and "PCI address 0000:ca:00.0." in findings[0].description
    # NVML's view alone, before the function left the bus, already names the address
    assert [f.labels for f in lost().evaluate(trace.history, T0 + 22)] == [findings[0].labels]
    assert lost().evaluate(trace.history, T0 + 19) == []


def test_gpu_lost_by_nvml_and_by_the_bus_on_different_gpus():
    """NVML loses GPU 0 (its function stays on the bus); GPU 1's function leaves the bus while NVML
    still answers: two GPUs, two findings, each named with the other half of its identity."""
    trace = Trace()
    now = trace.run(T0, T0 + 30,
                    gpu=lambda t: gpu_rows_as_exported(t < T0 + 20) + gpu_rows(
                        "1", "GPU-1111", pci_bus_id="0000:ca:00.0"),
                    pcie=lambda t: pcie_rows() + pcie_rows(
                        "0000:ca:00.0", present=0 if t >= T0 + 25 else 1))
    findings = lost().evaluate(trace.history, now)
    assert sorted(tuple(sorted(f.labels.items())) for f in findings) == [
        (("gpu", "0"), ("pci_bus_id", "0000:17:00.0"), ("uuid", "GPU-0000")),
        (("gpu", "1"), ("pci_bus_id", "0000:ca:00.0"), ("uuid", "GPU-1111")),
    ]


def test_gpu_lost_identity_older_than_the_lookback_is_not_used():
    """The rule reads gpu_info over the last hour (last_over_time); the detector the same span, so
    an hour after the loss both doors fall back to the two unnamed views together."""
    trace = Trace(retention_seconds=3 * 3600, interval_seconds=60)
    lookback = gpu_lost.IDENTITY_LOOKBACK_SECONDS
    now = trace.run(T0, T0 + lookback + 600, step=60,
                    gpu=lambda t: gpu_rows_as_exported(t < T0 + 300, "1", "GPU-1111", "0000:ca:00.0"),
                    pcie=lambda t: pcie_rows("0000:ca:00.0", present=0 if t >= T0 + 300 else 1))
    named = {"gpu": "1", "uuid": "GPU-1111", "pci_bus_id": "0000:ca:00.0"}
    assert [f.labels for f in lost().evaluate(trace.history, T0 + 300 + lookback - 120)] == [named]
    assert sorted(tuple(sorted(f.labels.items())) for f in lost().evaluate(trace.history, now)) == [
        (("gpu", "1"), ("uuid", "GPU-1111")), (("pci_bus_id", "0000:ca:00.0"),)]


def test_gpu_lost_silent_when_every_gpu_is_up():
    trace = Trace()
    now = trace.run(T0, T0 + 30, gpu=lambda t: gpu_rows(), pcie=lambda t: pcie_rows())
    assert lost().evaluate(trace.history, now) == []
