"""promtool tests for the rules that read `hybridmon bench` measurements."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the schema is built from the families, which import these rules
    from hybridmon.agent.alerts.catalogue import Thresholds

from hybridmon.rules.cases_gpu import capacity, link
from hybridmon.rules.scenarios import GPU0, GPU1, GPU2, GPU3, Catalog, Test, firing, not_yet

MEASURED = "hybridmon_gpu_pcie_measured_capacity_bytes_per_second"


def measured(test: Test, gpu: dict, host_to_device: float, device_to_host: float) -> None:
    test.constant(MEASURED, host_to_device, direction="host_to_device", **gpu)
    test.constant(MEASURED, device_to_host, direction="device_to_host", **gpu)


def starvation_against_measured_capacity(t: Thresholds, catalog: Catalog) -> Test:
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
        test.gauge("hybridmon_gpu_pcie_throughput_bytes_per_second", 0.01 * full, h2d,
                   direction="host_to_device", **gpu)
        test.gauge("hybridmon_gpu_pcie_throughput_bytes_per_second", 0.01 * full, d2h,
                   direction="device_to_host", **gpu)
        test.constant("hybridmon_gpu_utilization_ratio", idle, **gpu)
    measured(test, GPU0, *gpu0)
    measured(test, GPU1, *gpu1)
    test.expect_samples(60, "gpu:hybridmon_gpu_pcie_capacity_bytes_per_second:effective",
                        ({**GPU0, "direction": "host_to_device"}, gpu0[0]),
                        ({**GPU0, "direction": "device_to_host"}, gpu0[1]),
                        ({**GPU1, "direction": "host_to_device"}, gpu1[0]),
                        ({**GPU1, "direction": "device_to_host"}, gpu1[1]),
                        ({**GPU2, "direction": "host_to_device"}, full),
                        ({**GPU2, "direction": "device_to_host"}, full))
    test.expect(not_yet(s.for_seconds), rule.alert)
    test.expect(firing(s.for_seconds), rule.alert,
                test.alert(rule, GPU0, value=share, traffic=traffic["0"][0], capacity=gpu0[0], util=idle),
                test.alert(rule, GPU1, value=share, traffic=max(traffic["1"]), capacity=gpu1[0],
                           util=idle))
    return test


def bandwidth_low(t: Thresholds, catalog: Catalog) -> Test:
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
                test.alert(rule, GPU0, value=slow / gen4, measured=slow, best=gen4),
                test.alert(rule, GPU2, value=gen5_low / gen5, measured=gen5_low, best=gen5))
    return test


def files(t: Thresholds, catalog: Catalog) -> dict[str, list[Test]]:
    return {"bench": [starvation_against_measured_capacity(t, catalog), bandwidth_low(t, catalog)]}
