"""promtool tests for the PCIe and GPU memory rules (see rules.scenarios for the timing)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the schema is built from the families, which import these rules
    from hybridmon.agent.alerts.catalogue import Thresholds

import math

from hybridmon.rules import pcie
from hybridmon.rules.promql import lane_bytes_per_second, replay_bound_per_minute
from hybridmon.rules.scenarios import (BUS0, BUS1, GIB, GPU0, GPU1, GPU2, GPU3, MIB, ONSET, Catalog, Test, above,
                             firing, not_yet, num)


def link(test: Test, gpu: dict, generation: float | tuple, width: float | tuple,
         max_generation: int = 4, max_width: int = 16) -> None:
    """Link state of one GPU; a (before, after) pair changes at the onset."""
    for metric, value in (("hybridmon_gpu_pcie_link_generation", generation),
                          ("hybridmon_gpu_pcie_link_width_lanes", width)):
        if isinstance(value, tuple):
            test.gauge(metric, *value, **gpu)
        else:
            test.constant(metric, value, **gpu)
    test.constant("hybridmon_gpu_pcie_link_max_generation", max_generation, **gpu)
    test.constant("hybridmon_gpu_pcie_link_max_width_lanes", max_width, **gpu)


def capacity(generation: int, width: int) -> float:
    return width * lane_bytes_per_second(generation)


def tables(t: Thresholds, catalog: Catalog) -> Test:
    test = Test("capacity and DCGM replay bound of every generation", 120, catalog)
    links = [(generation, 16) for generation in range(1, 7)] + [(3, 8), (4, 1)]
    gpus = []
    for index, (generation, width) in enumerate(links):
        gpu = {"gpu": str(index), "uuid": f"GPU-{index:08x}-0000-4000-8000-000000000000"}
        link(test, gpu, generation, width, 6, 16)
        gpus.append((gpu, generation, width))
    test.expect_samples(60, pcie.CAPACITY_THEORETICAL,
                        *((gpu, capacity(g, w)) for gpu, g, w in gpus))
    test.expect_samples(60, pcie.REPLAY_BOUND, *(
        (gpu, float(replay_bound_per_minute(t.pcie_errors.bit_error_rate, g, w))) for gpu, g, w in gpus))
    return test


def starvation(t: Thresholds, catalog: Catalog) -> Test:
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
        test.gauge("hybridmon_gpu_pcie_throughput_bytes_per_second", 0.2 * full, traffic * full,
                   direction="host_to_device", **gpu)
        test.constant("hybridmon_gpu_pcie_throughput_bytes_per_second", 0.05 * full,
                      direction="device_to_host", **gpu)
        test.gauge("hybridmon_gpu_utilization_ratio", busy, utilization, **gpu)
    test.expect(not_yet(s.for_seconds), rule.alert)
    test.expect(firing(s.for_seconds), rule.alert, test.alert(
        rule, GPU0, value=pinned, traffic=pinned * full, capacity=full, util=starved))
    return test


def link_degraded(t: Thresholds, catalog: Catalog) -> Test:
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
        test.gauge("hybridmon_gpu_utilization_ratio", before, after, **gpu)
    test.expect(not_yet(d.for_seconds), rule.alert)
    test.expect(firing(d.for_seconds), rule.alert,
                test.alert(rule, GPU0, value=capacity(3, 16) / capacity(4, 16), gen=3, width=16,
                           max_gen=4, max_width=16, util=busy),
                test.alert(rule, GPU2, value=capacity(4, 8) / capacity(4, 16), gen=4, width=8,
                           max_gen=4, max_width=16, util=busy))
    return test


def replay_errors(t: Thresholds, catalog: Catalog) -> Test:
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
    test.counter("hybridmon_gpu_pcie_replays_total", gen4 / 4 / 60, 2 * gen4 / 60, **GPU0)
    test.counter("hybridmon_gpu_pcie_replays_total", under_gen5 / 60, under_gen5 / 60, **GPU1)
    per_step = gen4 / 2 / 60 * test.interval
    before = [1000 + per_step * i for i in range(9)]
    test.values("hybridmon_gpu_pcie_replays_total",
                before + [per_step * i for i in range(test.samples - len(before))], **GPU2)
    test.expect(not_yet(0), rule.alert)
    test.expect(at, rule.alert, test.alert(rule, GPU0, value=2 * gen4, bound=gen4, gen=4, width=16))
    return test


def aer_uncorrectable(t: Thresholds, catalog: Catalog) -> Test:
    rule = catalog.find("PcieAerErrors", "critical")
    test = Test("AER: one non-fatal error on 0000:17:00.0 is critical at once", ONSET + 360, catalog)
    test.gauge("hybridmon_pcie_aer_errors_total", 0, 1, pci_bus_id=BUS0, severity="nonfatal")
    test.constant("hybridmon_pcie_aer_errors_total", 0, pci_bus_id=BUS0, severity="fatal")
    test.constant("hybridmon_pcie_aer_errors_total", 3, pci_bus_id=BUS1, severity="nonfatal")
    test.expect(not_yet(0), rule.alert)
    test.expect(firing(0), rule.alert, test.alert(rule, {"pci_bus_id": BUS0, "aer_severity": "nonfatal"},
                                                  value=1))
    return test


def aer_correctable(t: Thresholds, catalog: Catalog) -> Test:
    e = t.pcie_errors
    rule = catalog.find("PcieAerErrors", "warning")
    per_hour = e.aer_correctable_per_hour
    at = ONSET + int(e.window_seconds) + 60
    test = Test("AER: a steady stream of correctable errors on 0000:ca:00.0 warns; half the "
                "rate on 0000:17:00.0 does not", at + 120, catalog)
    test.counter("hybridmon_pcie_aer_errors_total", 0, 2 * per_hour / 3600, pci_bus_id=BUS1,
                 severity="correctable")
    test.counter("hybridmon_pcie_aer_errors_total", per_hour / 2 / 3600, per_hour / 2 / 3600,
                 pci_bus_id=BUS0, severity="correctable")
    test.expect(not_yet(0), rule.alert)
    test.expect(at, rule.alert, test.alert(rule, {"pci_bus_id": BUS1, "aer_severity": "correctable"},
                                           value=2 * per_hour))
    return test


def gpu_lost(t: Thresholds, catalog: Catalog) -> Test:
    wait = t.gpu_lost.for_seconds
    rule = catalog.find("GpuLost")
    test = Test("GPU lost: NVML loses GPU 1 and its PCI function leaves the bus; GPU 0 stays",
                firing(wait) + 120, catalog)
    test.constant("hybridmon_gpu_up", 1, **GPU0)
    test.gauge("hybridmon_gpu_up", 1, 0, **GPU1)
    test.constant("hybridmon_pcie_device_present", 1, pci_bus_id=BUS0)
    test.gauge("hybridmon_pcie_device_present", 1, 0, pci_bus_id=BUS1)
    test.expect(not_yet(wait), rule.alert)
    test.expect(firing(wait), rule.alert, test.alert(rule, GPU1, value=0),
                test.alert(rule, {"pci_bus_id": BUS1}, value=0))
    return test


def headroom_used(t: Thresholds, catalog: Catalog) -> Test:
    h = t.gpu_memory_headroom
    rule = catalog.find("GpuMemoryHeadroomLow", reason="used")
    total = 24 * GIB
    full = above(h.used_share)
    test = Test("GPU memory: GPU 0 fills past the offload trigger; GPU 1 stays just under it",
                firing(h.for_seconds) + 120, catalog)
    for gpu, after in ((GPU0, full), (GPU1, 0.9 * h.used_share)):
        test.constant("hybridmon_gpu_memory_total_bytes", total, **gpu)
        test.gauge("hybridmon_gpu_memory_used_bytes", 0.5 * total, after * total, **gpu)
    test.expect(not_yet(h.for_seconds), rule.alert)
    test.expect(firing(h.for_seconds), rule.alert,
                test.alert(rule, GPU0, value=full, used=full * total, total=total))
    return test


def headroom_forecast(t: Thresholds, catalog: Catalog) -> Test:
    """GPU 0 fills at a steady rate from t=0; the rule judges once half the trend window has data."""
    h = t.gpu_memory_headroom
    rule = catalog.find("GpuMemoryHeadroomLow", reason="forecast")
    total, start = 24 * GIB + MIB, 12 * GIB
    active = int(math.ceil(h.trend_window_seconds / 2 / 60) * 60)
    at = active + math.ceil(h.for_seconds / 60) * 60 + 60
    left_at_eval = h.forecast_horizon_seconds / 2 + 0.5   # never a whole second: int() is safe
    rate = (total - start) / (at - 30 + left_at_eval)     # the 1 min average lags by 30 s
    if (total - start) / rate - (active - 30) > h.forecast_horizon_seconds:
        raise ValueError("forecast test: for_seconds too long for forecast_horizon_seconds")
    test = Test("GPU memory forecast: GPU 0 fills within the horizon; GPU 1 rises too slowly, "
                "GPU 2 is flat, GPU 3 loads a model (one jump) just before the rule can judge",
                at + 120, catalog)
    for gpu in (GPU0, GPU1, GPU2, GPU3):
        test.constant("hybridmon_gpu_memory_total_bytes", total, **gpu)
    test.add("hybridmon_gpu_memory_used_bytes", f"{start}+{rate * test.interval!r}x{test.samples - 1}", **GPU0)
    slow = (total - start) / (4 * h.forecast_horizon_seconds) * test.interval
    test.add("hybridmon_gpu_memory_used_bytes", f"{start}+{slow!r}x{test.samples - 1}", **GPU1)
    test.constant("hybridmon_gpu_memory_used_bytes", 0.8 * total, **GPU2)
    jump = (active - 60) // test.interval   # samples before the jump
    test.add("hybridmon_gpu_memory_used_bytes",
             f"{num(0.1 * total)}x{jump - 1} {num(0.7 * total)}x{test.samples - jump - 1}", **GPU3)
    test.expect(active + int(h.for_seconds) - 60 if h.for_seconds >= 60 else active - 60, rule.alert)
    test.expect(at, rule.alert, test.alert(rule, GPU0, value=left_at_eval, per_hour=rate * 3600,
                                           free=rate * left_at_eval))
    return test


def files(t: Thresholds, catalog: Catalog) -> dict[str, list[Test]]:
    return {
        "pcie": [tables(t, catalog), starvation(t, catalog), link_degraded(t, catalog),
                 replay_errors(t, catalog), *([aer_uncorrectable(t, catalog)]
                                              if t.pcie_errors.aer_uncorrectable_any else []),
                 aer_correctable(t, catalog), gpu_lost(t, catalog)],
        "gpu_memory": [headroom_used(t, catalog), headroom_forecast(t, catalog)],
    }
