"""The tests of the pcie_starvation alert family (agent/alerts/pcie_starvation.py): its detector, on
histories written sample by sample, and its rule's promtool cases (`promtool_cases`, written
to rules/tests/generated_pcie_starvation.yml by `python -m tests.rules.generate` and run by
promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

import pytest

from hybridmon.agent.alerts import pcie_starvation
from hybridmon.agent.alerts.pcie_starvation import DEVICE_TO_HOST, HOST_TO_DEVICE
from hybridmon.exporters import bench
from hybridmon.exporters import gpu as gpu_metrics
from hybridmon.exporters.gpu import (
    PCIE_BYTES,
    PCIE_SAMPLED_BYTES,
    PCIE_THROUGHPUT,
    UTILIZATION,
)
from hybridmon.pcie_rates import (
    achievable_capacity,
    bidirectional_capacity,
    c2c_capacity,
    theoretical_capacity,
)
from hybridmon.rules import pcie as recorded
from hybridmon.rules.model import Alert
from tests.support.detector_history import (
    GEN4_X16,
    HISTORY_GPU0,
    T0,
    THRESHOLDS,
    Trace,
    assert_says_its_rules_words,
    bench_rows,
    c2c_bench_rows,
    c2c_rows,
    gpu_rows,
)
from tests.support.promtool_cases import (
    GPU0,
    GPU1,
    GPU2,
    GPU3,
    ONSET,
    Test,
    above,
    firing,
    not_yet,
)
from tests.support.promtool_inputs import (
    achievable,
    bidirectional,
    bursts,
    capacity,
    link,
    measured,
    measured_bidirectional,
)


def starvation():
    return pcie_starvation.Detector(THRESHOLDS.pcie_starvation)

GEN4_ACHIEVABLE = achievable_capacity(4, 16)

GEN4_BOTH_WAYS = bidirectional_capacity(4, 16)


def measured_both_ways(h2d: float | None, d2h: float | None) -> list:
    """A benchmark run's rows (exporters/bench.py): 26 GB/s one direction at a time, and what each
    direction carried while the other copied too (None: the run has no figure that way)."""
    return bench_rows(h2d=26e9, d2h=26e9) + [
        (bench.MEASURED_BIDIRECTIONAL_CAPACITY, value, "0", "GPU-0000", direction)
        for direction, value in (("host_to_device", h2d), ("device_to_host", d2h)) if value is not None]


def test_starvation_fires_when_the_link_is_full_and_the_gpu_waits():
    trace = Trace()
    h2d = 0.82 * GEN4_X16   # 25.8 GB/s: a saturated copy engine
    now = trace.run(T0, T0 + 120, gpu=lambda t: gpu_rows(utilization=0.2, h2d=h2d, d2h=2e9))
    (finding,) = starvation().evaluate(trace.history, now)
    assert finding.alertname == "GpuPcieStarvation" and finding.severity == "warning"
    assert finding.labels == HISTORY_GPU0
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


@pytest.mark.parametrize("counter", [gpu_metrics.PCIE_BYTES, gpu_metrics.PCIE_SAMPLED_BYTES])
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


# --- NVLink-C2C (GH200, GB200; issue 29) -------------------------------------------------------
# A GH200 as the gpu collector shows it (simulated inputs, not a measurement): C2C on, its Hopper's
# PCIe link Gen5 x16, and one C2C link up at 450 GB/s, GH200's C2C rate per direction. How NVML
# splits that rate over links (field 172 per link) only a GH200 can show: the judgement sums the up
# links, so one link of 450 GB/s or several adding up to it judge alike.
GH200_C2C = 450e9
C2C_H2D = c2c_capacity(None, HOST_TO_DEVICE, GH200_C2C).bytes_per_second     # 346.5 GB/s
C2C_D2H = c2c_capacity(None, DEVICE_TO_HOST, GH200_C2C).bytes_per_second     # 301.5 GB/s
GEN5_X16 = theoretical_capacity(5, 16)


def gh200(*, utilization: float, c2c_h2d: float | None, c2c_d2h: float | None = 2e9, pcie_h2d: float = 5e7,
          enabled: float | None = 1, links: dict | None = None) -> list:
    """One tick of a GH200 whose offload crosses C2C: its PCIe link near idle (50 MB/s: the driver's
    own traffic) unless told otherwise."""
    return (gpu_rows(utilization=utilization, h2d=pcie_h2d, d2h=5e7, generation=5, max_generation=5)
            + c2c_rows(enabled=enabled, links={"0": (1, GH200_C2C)} if links is None else links,
                       h2d=c2c_h2d, d2h=c2c_d2h))


def test_c2c_starvation_fires_when_c2c_carries_kv_near_its_capacity_while_the_gpu_idles():
    trace = Trace()
    h2d = 0.95 * C2C_H2D    # 329 GB/s of KV loads: nvbandwidth's GH200 copies reach 346
    now = trace.run(T0, T0 + 120, gpu=lambda t: gh200(utilization=0.2, c2c_h2d=h2d))
    (finding,) = starvation().evaluate(trace.history, now)
    assert finding.alertname == "GpuC2cStarvation" and finding.severity == "warning"
    assert finding.labels == HISTORY_GPU0
    assert finding.value == pytest.approx(0.95) and finding.threshold == 0.9
    assert finding.details["link"] == "c2c" and finding.details["direction"] == "host_to_device"
    assert finding.details["capacity_bytes_per_second"] == pytest.approx(0.77 * GH200_C2C)
    assert finding.details["capacity_source"] == "achievable"
    assert finding.details["up_links_max_bytes_per_second"] == pytest.approx(GH200_C2C)
    assert "starved by NVLink-C2C: link 95% full, GPU 20% busy" in finding.summary
    assert "moved 329.2GB/s host to device and 2GB/s device to host over C2C" in finding.description
    assert "up to 346.5GB/s host to device and 301.5GB/s device to host" in finding.description
    assert "the 450GB/s NVML states for its up links" in finding.description
    assert_says_its_rules_words(finding)


def test_a_c2c_gpus_near_idle_pcie_link_is_never_judged_as_its_offload_path():
    # the same GPU with its PCIe link near zero claims nothing of PCIe; and even PCIe traffic past
    # what Gen5 x16 carries is not starvation of a GPU whose offload crosses C2C
    for pcie_h2d in (5e7, 0.85 * GEN5_X16):
        trace = Trace()
        now = trace.run(T0, T0 + 120, gpu=lambda t: gh200(utilization=0.2, c2c_h2d=0.95 * C2C_H2D, pcie_h2d=pcie_h2d))
        assert [f.alertname for f in starvation().evaluate(trace.history, now)] == ["GpuC2cStarvation"], pcie_h2d
    quiet = Trace()
    now = quiet.run(T0, T0 + 120, gpu=lambda t: gh200(utilization=0.2, c2c_h2d=0.5 * C2C_H2D, pcie_h2d=0.85 * GEN5_X16))
    assert starvation().evaluate(quiet.history, now) == []


def test_c2c_on_without_readable_traffic_says_so_once_and_judges_nothing():
    for pcie_h2d in (5e7, 0.85 * GEN5_X16):
        trace = Trace()
        now = trace.run(T0, T0 + 120, gpu=lambda t: gh200(utilization=0.2, c2c_h2d=None, c2c_d2h=None,
                                                          pcie_h2d=pcie_h2d))
        (finding,) = starvation().evaluate(trace.history, now)
        assert finding.alertname == "GpuC2cTrafficUnreadable" and finding.severity == "info"
        assert finding.labels == HISTORY_GPU0
        assert finding.summary.endswith("C2C traffic unreadable, offload not judged")
        assert "offload is not judged on this GPU" in finding.description
        assert_says_its_rules_words(finding)


def test_c2c_off_or_unanswered_leaves_the_gpu_to_the_pcie_judgement():
    # C2C mode 0 (a C2C-capable GPU with the link off) or no answer at all: copies cross PCIe
    for enabled in (0, None):
        trace = Trace()
        now = trace.run(T0, T0 + 120, gpu=lambda t: gh200(utilization=0.2, c2c_h2d=None, c2c_d2h=None,
                                                          pcie_h2d=0.85 * GEN5_X16, enabled=enabled))
        (finding,) = starvation().evaluate(trace.history, now)
        assert finding.alertname == "GpuPcieStarvation", enabled


def test_c2c_starvation_judges_each_direction_against_its_own_share():
    # 280 GB/s device to host: 93 % of the 301.5 copies reach that way, though only 81 % of the
    # 346.5 host to device; 200 GB/s host to device alongside is 58 %
    trace = Trace()
    now = trace.run(T0, T0 + 120, gpu=lambda t: gh200(utilization=0.1, c2c_h2d=200e9, c2c_d2h=280e9))
    (finding,) = starvation().evaluate(trace.history, now)
    assert finding.details["direction"] == "device_to_host"
    assert finding.value == pytest.approx(280e9 / C2C_D2H)


def test_c2c_starvation_uses_what_the_bench_measured_over_c2c():
    # 290 GB/s host to device: 84 % of the 346.5 the share gives, 97 % of the 300 this host's bench
    # measured over C2C
    load = lambda t: gh200(utilization=0.1, c2c_h2d=290e9)
    trace = Trace()
    now = trace.run(T0, T0 + 120, gpu=load)
    assert starvation().evaluate(trace.history, now) == []
    measured = Trace()
    now = measured.run(T0, T0 + 120, gpu=load, bench=lambda t: c2c_bench_rows(h2d=300e9, d2h=260e9))
    (finding,) = starvation().evaluate(measured.history, now)
    assert finding.value == pytest.approx(290 / 300)
    assert finding.details["capacity_source"] == "measured"
    assert_says_its_rules_words(finding)


def test_c2c_capacity_counts_only_the_links_that_are_up():
    # two links of 225 GB/s, one down: 160 GB/s is 92 % of 0.77 x 225, 46 % of 0.77 x 450
    load = 160e9
    for links, fires in (({"0": (1, 225e9), "1": (0, 225e9)}, True), ({"0": (1, 225e9), "1": (1, 225e9)}, False)):
        trace = Trace()
        now = trace.run(T0, T0 + 120, gpu=lambda t: gh200(utilization=0.1, c2c_h2d=load, links=links))
        found = starvation().evaluate(trace.history, now)
        assert [f.alertname for f in found] == (["GpuC2cStarvation"] if fires else []), links
    # no link up: no capacity, nothing judged (and nothing claimed of PCIe)
    none_up = Trace()
    now = none_up.run(T0, T0 + 120, gpu=lambda t: gh200(utilization=0.1, c2c_h2d=load, links={"0": (0, 450e9)}))
    assert starvation().evaluate(none_up.history, now) == []


# --- its rule's promtool cases ------------------------------------------------------------------


def expected(test: Test, rule: Alert, gpu: dict, value: float, h2d: float, d2h: float, capacity: float,
             generation: int, util: float, both: float | None = None) -> dict:
    """The alert of one GPU on a x16 link judged on `generation`, its annotations filled; `both`
    defaults to the bidirectional factor's capacity of that link."""
    return test.alert(rule, gpu, value=value, to_gpu=h2d, from_gpu=d2h, capacity=capacity,
                      both=bidirectional(generation, 16) if both is None else both, util=util,
                      gen=generation, width=16)


def copy_engine_saturation(t, catalog) -> Test:
    """What a saturated Gen4 x16 link shows: copy engines at 0.82 of the theoretical rate (26 of
    31.5 GB/s, nvbandwidth), 1 % past what the link achievably carries. GPU 0 starves at it; GPU 3
    too, its 20 ms throughput samples reading 0.3 (landing between copies) where its byte counter
    says 0.82. GPU 1, busy at the same traffic, and GPU 2 at 0.70 (or less, to stay under a
    lower threshold), clearly below what the link carries, stay silent."""
    s = t.pcie_starvation
    rule = catalog.find("GpuPcieStarvation")
    full, link_carries = capacity(4, 16), achievable(4, 16)
    starved, busy = s.gpu_utilization_at_most / 2, s.gpu_utilization_at_most + 0.25
    below = min(0.70, 0.9 * s.traffic_share_of_capacity * link_carries / full)
    test = Test("PCIe starvation: copy-engine saturation at 0.82 of the theoretical rate fires, "
                "counted by the byte counter where the samples miss it; a busy GPU and 0.70 of the "
                "rate stay silent", firing(s.for_seconds) + 120, catalog)
    for gpu, traffic, utilization in ((GPU0, 0.82, starved), (GPU1, 0.82, busy), (GPU2, below, starved),
                                      (GPU3, 0.30, starved)):
        link(test, gpu, 4, 16)
        test.gauge(PCIE_THROUGHPUT.name, 0.2 * full, traffic * full, direction=HOST_TO_DEVICE, **gpu)
        test.constant(PCIE_THROUGHPUT.name, 0.05 * full, direction=DEVICE_TO_HOST, **gpu)
        test.gauge(UTILIZATION.name, busy, utilization, **gpu)
    test.counter(PCIE_BYTES.name, 0.2 * full, 0.82 * full, direction=HOST_TO_DEVICE, **GPU3)
    test.counter(PCIE_BYTES.name, 0.05 * full, 0.05 * full, direction=DEVICE_TO_HOST, **GPU3)
    test.expect(not_yet(s.for_seconds), rule.alert)
    test.expect(firing(s.for_seconds), rule.alert, *(
        expected(test, rule, gpu, 0.82 * full / link_carries, 0.82 * full, 0.05 * full, link_carries, 4, starved)
        for gpu in (GPU0, GPU3)))
    return test


def bidirectional_saturation(t, catalog) -> Test:
    """Both directions at 0.60 of the theoretical rate at once (nvbandwidth's bidirectional copies
    reach 0.58 each way on Gen4 x16): neither is near its own capacity, together they fill the
    link. GPU 1 at 0.45 each way (or less, to stay under a lower threshold) stays silent."""
    s = t.pcie_starvation
    rule = catalog.find("GpuPcieStarvation")
    full, idle = capacity(4, 16), s.gpu_utilization_at_most / 2
    lighter = min(0.45, 0.9 * s.traffic_share_of_capacity * bidirectional(4, 16) / 2 / full)
    test = Test("PCIe starvation: both directions at 0.60 of the theoretical rate fill the link; "
                "0.45 each way does not", firing(s.for_seconds) + 120, catalog)
    for gpu, traffic in ((GPU0, 0.60), (GPU1, lighter)):
        link(test, gpu, 4, 16)
        for direction in recorded.DIRECTIONS:
            test.gauge(PCIE_THROUGHPUT.name, 0.1 * full, traffic * full, direction=direction, **gpu)
        test.constant(UTILIZATION.name, idle, **gpu)
    test.expect(not_yet(s.for_seconds), rule.alert)
    test.expect(firing(s.for_seconds), rule.alert, expected(
        test, rule, GPU0, 1.2 * full / bidirectional(4, 16), 0.6 * full, 0.6 * full, achievable(4, 16), 4, idle))
    return test


def bursty_link_at_idle_speed(t, catalog) -> Test:
    """GPU 0, a healthy bursty host: 30 s of copies at 0.82 of its Gen4 x16 rate every minute,
    the link back at Gen1 (power saving) between them, so every evaluation sees Gen1 now and half
    a minute of Gen4 traffic in its average. Judged against the best link of that minute, Gen4,
    it is far from full; against the Gen1 it shows now, 2.6 times over. GPU 1's link runs at Gen1
    under traffic: it is judged against Gen1 (that it is below its maximum is
    GpuPcieLinkDegraded's business) and fires."""
    s = t.pcie_starvation
    rule = catalog.find("GpuPcieStarvation")
    gen1, idle = capacity(1, 16), s.gpu_utilization_at_most / 2
    test = Test("PCIe starvation: a link back at Gen1 between bursts is judged against the Gen4 it "
                "carried them with; a link at Gen1 under traffic against Gen1",
                firing(s.for_seconds) + 120, catalog)
    link(test, GPU0, bursts(test, 60, 30, 4, 1), 16)
    test.values(PCIE_THROUGHPUT.name, bursts(test, 60, 30, 0.82 * capacity(4, 16), 0.001 * gen1),
                direction=HOST_TO_DEVICE, **GPU0)
    link(test, GPU1, 1, 16)
    test.gauge(PCIE_THROUGHPUT.name, 0.05 * gen1, 0.82 * gen1, direction=HOST_TO_DEVICE, **GPU1)
    for gpu in (GPU0, GPU1):
        test.constant(PCIE_THROUGHPUT.name, 0.001 * gen1, direction=DEVICE_TO_HOST, **gpu)
        test.constant(UTILIZATION.name, idle, **gpu)
    at_idle_speed = firing(s.for_seconds)
    test.expect_samples(at_idle_speed, recorded.CAPACITY,
                        *(({**GPU0, "direction": d}, achievable(4, 16)) for d in recorded.DIRECTIONS),
                        *(({**GPU1, "direction": d}, achievable(1, 16)) for d in recorded.DIRECTIONS))
    test.expect(not_yet(s.for_seconds), rule.alert)
    test.expect(at_idle_speed, rule.alert, expected(
        test, rule, GPU1, 0.82 * gen1 / achievable(1, 16), 0.82 * gen1, 0.001 * gen1, achievable(1, 16), 1, idle))
    return test


def starved_against_measured_capacity(t, catalog) -> Test:
    """GPU 0 measured 70 % of the theoretical rate (a slow host): traffic just past the share of
    that fires, and is under the share of what an unmeasured Gen4 x16 achieves (GPU 2, never
    measured, stays silent with the same traffic). GPU 1 is judged per direction: device->host
    past the share of its smaller measured capacity, host->device well under its own."""
    s = t.pcie_starvation
    rule = catalog.find("GpuPcieStarvation")
    idle, full = s.gpu_utilization_at_most / 2, capacity(4, 16)
    share = min(s.traffic_share_of_capacity + 0.02, 0.99)
    gpu0 = (0.7 * full, 0.7 * full)
    gpu1 = (0.85 * full, 0.7 * full)
    traffic = {"0": (share * gpu0[0], 0.01 * full), "1": (0.2 * full, share * gpu1[1]),
               "2": (share * gpu0[0], 0.01 * full)}
    test = Test("PCIe starvation judged against what hybridmon bench measured, per direction; "
                "GPU 2 without a measurement falls back to what its link achieves",
                firing(s.for_seconds) + 120, catalog)
    for gpu in (GPU0, GPU1, GPU2):
        link(test, gpu, 4, 16)
        h2d, d2h = traffic[gpu["gpu"]]
        test.gauge(PCIE_THROUGHPUT.name, 0.01 * full, h2d, direction=HOST_TO_DEVICE, **gpu)
        test.gauge(PCIE_THROUGHPUT.name, 0.01 * full, d2h, direction=DEVICE_TO_HOST, **gpu)
        test.constant(UTILIZATION.name, idle, **gpu)
    measured(test, GPU0, *gpu0)
    measured(test, GPU1, *gpu1)
    test.expect_samples(60, recorded.CAPACITY,
                        ({**GPU0, "direction": HOST_TO_DEVICE}, gpu0[0]),
                        ({**GPU0, "direction": DEVICE_TO_HOST}, gpu0[1]),
                        ({**GPU1, "direction": HOST_TO_DEVICE}, gpu1[0]),
                        ({**GPU1, "direction": DEVICE_TO_HOST}, gpu1[1]),
                        ({**GPU2, "direction": HOST_TO_DEVICE}, achievable(4, 16)),
                        ({**GPU2, "direction": DEVICE_TO_HOST}, achievable(4, 16)))
    test.expect(not_yet(s.for_seconds), rule.alert)
    test.expect(firing(s.for_seconds), rule.alert,
                expected(test, rule, GPU0, share, *traffic["0"], gpu0[0], 4, idle),
                expected(test, rule, GPU1, share, *traffic["1"], gpu1[0], 4, idle))
    return test


def sampled_bytes_where_scrapes_catch_gaps(t, catalog) -> Test:
    """GPU 0 has no PCIe byte counters: the agent's sampled-bytes counter, built from ~600 samples a
    minute, rises at 0.82 of the theoretical rate (a saturated copy engine), while the throughput
    gauge, of which a 15 s scrape keeps one tick in fifteen, happened to catch every other scrape in
    a gap between copies: its minute average reads about half that. The counter's rate is what
    counts, and it fires. GPU 1, the same gauge and no counter (an agent from before the sampled
    counter), is judged on the gauge and stays silent. Hand-written inputs, not a measurement."""
    s = t.pcie_starvation
    rule = catalog.find("GpuPcieStarvation")
    full, link_carries, idle = capacity(4, 16), achievable(4, 16), s.gpu_utilization_at_most / 2
    test = Test("PCIe starvation: without byte counters, the sampled-bytes counter's rate counts, "
                "not the scraped gauge that caught the gaps between copies",
                firing(s.for_seconds) + 120, catalog)
    scraped = [0.05 * full if index * test.interval <= ONSET else (0.82 if index % 2 else 0.02) * full
               for index in range(test.samples)]
    for gpu in (GPU0, GPU1):
        link(test, gpu, 4, 16)
        test.values(PCIE_THROUGHPUT.name, scraped, direction=HOST_TO_DEVICE, **gpu)
        test.constant(PCIE_THROUGHPUT.name, 0.05 * full, direction=DEVICE_TO_HOST, **gpu)
        test.constant(UTILIZATION.name, idle, **gpu)
    test.counter(PCIE_SAMPLED_BYTES.name, 0.05 * full, 0.82 * full, direction=HOST_TO_DEVICE, **GPU0)
    test.counter(PCIE_SAMPLED_BYTES.name, 0.05 * full, 0.05 * full, direction=DEVICE_TO_HOST, **GPU0)
    test.expect(not_yet(s.for_seconds), rule.alert)
    test.expect(firing(s.for_seconds), rule.alert, expected(
        test, rule, GPU0, 0.82 * full / link_carries, 0.82 * full, 0.05 * full, link_carries, 4, idle))
    return test


def starved_against_measured_bidirectional_capacity(t, catalog) -> Test:
    """GPU 0's bench measured 0.45 of the theoretical rate each way while both directions copied
    (nvbandwidth issue #15 saw 11-16 of 31.5 GB/s on some hosts), below the bidirectional factor's
    0.58: both directions at just past the share of that sum fire, though against the factor's
    figure the same traffic is well under it (GPU 1, no bidirectional measurement, stays silent;
    so does GPU 2, whose run measured only one direction: half a sum is no capacity). One direction
    at a time all three measured 0.80, far above either direction's traffic."""
    s = t.pcie_starvation
    rule = catalog.find("GpuPcieStarvation")
    full, idle = capacity(4, 16), s.gpu_utilization_at_most / 2
    share = min(s.traffic_share_of_capacity + 0.02, 0.99)
    each_way = 0.45 * full
    traffic = share * each_way   # per direction; both together: share x the measured sum
    test = Test("PCIe starvation: both directions judged against the bidirectional capacity "
                "hybridmon bench measured, where it measured both ways, else the factor's",
                firing(s.for_seconds) + 120, catalog)
    for gpu in (GPU0, GPU1, GPU2):
        link(test, gpu, 4, 16)
        for direction in recorded.DIRECTIONS:
            test.gauge(PCIE_THROUGHPUT.name, 0.01 * full, traffic, direction=direction, **gpu)
        test.constant(UTILIZATION.name, idle, **gpu)
        measured(test, gpu, 0.8 * full, 0.8 * full)
    measured_bidirectional(test, GPU0, each_way, each_way)
    measured_bidirectional(test, GPU2, each_way, None)
    test.expect_samples(60, recorded.BIDIRECTIONAL_CAPACITY, (GPU0, 2 * each_way),
                        (GPU1, bidirectional(4, 16)), (GPU2, bidirectional(4, 16)))
    test.expect(not_yet(s.for_seconds), rule.alert)
    test.expect(firing(s.for_seconds), rule.alert, expected(
        test, rule, GPU0, 2 * traffic / (2 * each_way), traffic, traffic, 0.8 * full, 4, idle,
        both=2 * each_way))
    return test


def c2c_gpu(test: Test, gpu: dict, *, enabled: float | None, c2c_h2d: tuple | float | None,
            pcie_h2d: tuple | float, utilization: float) -> None:
    """A GH200's series (simulated, as in the detector tests above): C2C mode (None: absent until
    the onset, then on), one C2C link up at 450 GB/s, C2C throughput host to device (a (before,
    after) pair changes at the onset; None: GPM unreadable) with 2 GB/s the other way, and its PCIe
    link Gen5 x16 with `pcie_h2d` host to device and 50 MB/s back."""
    if enabled is None:
        test.gauge(gpu_metrics.C2C_MODE.name, None, 1, **gpu)
    else:
        test.constant(gpu_metrics.C2C_MODE.name, enabled, **gpu)
    test.constant(gpu_metrics.C2C_LINK_UP.name, 1, link="0", **gpu)
    test.constant(gpu_metrics.C2C_LINK_MAX_BANDWIDTH.name, GH200_C2C, link="0", **gpu)
    if c2c_h2d is not None:
        before, after = c2c_h2d if isinstance(c2c_h2d, tuple) else (c2c_h2d, c2c_h2d)
        test.gauge(gpu_metrics.C2C_THROUGHPUT.name, before, after, direction=HOST_TO_DEVICE, **gpu)
        test.constant(gpu_metrics.C2C_THROUGHPUT.name, 2e9, direction=DEVICE_TO_HOST, **gpu)
    link(test, gpu, 5, 16, max_generation=5)
    before, after = pcie_h2d if isinstance(pcie_h2d, tuple) else (pcie_h2d, pcie_h2d)
    test.gauge(PCIE_THROUGHPUT.name, before, after, direction=HOST_TO_DEVICE, **gpu)
    test.constant(PCIE_THROUGHPUT.name, 5e7, direction=DEVICE_TO_HOST, **gpu)
    test.constant(UTILIZATION.name, utilization, **gpu)


def offload_over_c2c(t, catalog) -> Test:
    """GH200s (issue 29). GPU 0: C2C carries KV at 0.95 of what copies reach host to device (0.77
    x 450 GB/s) while its PCIe link idles: GpuC2cStarvation, and nothing of PCIe. GPU 1: C2C at
    half, PCIe past what Gen5 x16 carries: silent, PCIe is not its offload path. GPU 2: C2C on from
    the onset without GPM throughput, PCIe full: GpuC2cTrafficUnreadable, no starvation either way.
    GPU 3: C2C mode off, PCIe full: GpuPcieStarvation judges it as any PCIe GPU."""
    s = t.pcie_starvation
    catalog_rules = {name: catalog.find(name) for name in pcie_starvation.Detector.alertnames}
    idle, full = s.gpu_utilization_at_most / 2, capacity(5, 16)
    c2c_share = min(0.95, above(s.traffic_share_of_capacity))
    test = Test("Starvation over NVLink-C2C: C2C judged against what C2C carries, a C2C GPU's PCIe "
                "never judged, unreadable C2C traffic said, C2C off judged on PCIe",
                firing(s.for_seconds) + 120, catalog)
    c2c_gpu(test, GPU0, enabled=1, c2c_h2d=(0.05 * C2C_H2D, c2c_share * C2C_H2D), pcie_h2d=5e7, utilization=idle)
    c2c_gpu(test, GPU1, enabled=1, c2c_h2d=0.5 * C2C_H2D, pcie_h2d=(0.2 * full, 0.85 * full), utilization=idle)
    c2c_gpu(test, GPU2, enabled=None, c2c_h2d=None, pcie_h2d=(0.2 * full, 0.85 * full), utilization=idle)
    c2c_gpu(test, GPU3, enabled=0, c2c_h2d=None, pcie_h2d=(0.2 * full, 0.85 * full), utilization=idle)
    test.expect_samples(firing(s.for_seconds), recorded.C2C_CAPACITY,
                        *(({**gpu, "direction": d}, c2c_capacity(None, d, GH200_C2C).bytes_per_second)
                          for gpu in (GPU0, GPU1, GPU2, GPU3) for d in recorded.DIRECTIONS))
    for name in catalog_rules:
        test.expect(not_yet(s.for_seconds), name)
    c2c_rule = catalog_rules["GpuC2cStarvation"]
    test.expect(firing(s.for_seconds), "GpuC2cStarvation", test.alert(
        c2c_rule, GPU0, value=c2c_share, to_gpu=c2c_share * C2C_H2D, from_gpu=2e9, to_gpu_capacity=C2C_H2D,
        from_gpu_capacity=C2C_D2H, links=GH200_C2C, util=idle))
    test.expect(firing(s.for_seconds), "GpuC2cTrafficUnreadable",
                test.alert(catalog_rules["GpuC2cTrafficUnreadable"], GPU2, value=1))
    test.expect(firing(s.for_seconds), "GpuPcieStarvation", expected(
        test, catalog_rules["GpuPcieStarvation"], GPU3, 0.85 * full / achievable(5, 16), 0.85 * full, 5e7,
        achievable(5, 16), 5, idle))
    return test


def promtool_cases(t, catalog) -> list[Test]:
    return [copy_engine_saturation(t, catalog), bidirectional_saturation(t, catalog),
            bursty_link_at_idle_speed(t, catalog), starved_against_measured_capacity(t, catalog),
            sampled_bytes_where_scrapes_catch_gaps(t, catalog),
            starved_against_measured_bidirectional_capacity(t, catalog), offload_over_c2c(t, catalog)]
