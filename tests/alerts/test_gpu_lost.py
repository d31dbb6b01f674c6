"""The tests of the gpu_lost alert family (agent/alerts/gpu_lost.py): its detector, on
histories written sample by sample, and its rule's promtool cases (`promtool_cases`, written
to rules/tests/generated_gpu_lost.yml by `python -m tests.rules.generate` and run by
promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

from hybridmon.agent.alerts import gpu_lost
from hybridmon.exporters.gpu import GPU_INFO, GPU_UP
from hybridmon.exporters.pcie import DEVICE_PRESENT
from tests.support.detector_history import T0, THRESHOLDS, Trace, gpu_rows, pcie_rows
from tests.support.promtool_cases import (
    BUS0,
    BUS1,
    GPU0,
    GPU1,
    GPU2,
    Test,
    firing,
    not_yet,
)


def lost():
    return gpu_lost.Detector(THRESHOLDS.gpu_lost)


def gpu_rows_as_exported(up: bool, gpu_index: str = "0", uuid: str = "GPU-0000",
                         pci_bus_id: str = "0000:17:00.0"):
    """A GPU's rows as exporters/gpu.py writes them: a lost GPU reports GPU_UP 0 and nothing else,
    its gpu_info (the only series naming its PCI address) stops with the loss."""
    if up:
        return gpu_rows(gpu_index, uuid, pci_bus_id=pci_bus_id)
    return [(GPU_UP, 0, gpu_index, uuid)]


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


# --- its rule's promtool cases ------------------------------------------------------------------


def promtool_cases(t, catalog) -> list[Test]:
    wait = t.gpu_lost.for_seconds
    rule = catalog.find("GpuLost")
    both = Test("GPU lost: NVML loses GPU 1 and its PCI function leaves the bus: one alert with "
                "both identities; GPU 0 stays", firing(wait) + 120, catalog)
    for gpu, bus in ((GPU0, BUS0), (GPU1, BUS1)):
        # gpu_info stops with the loss (exporters/gpu.py reports only GPU_UP for a lost GPU)
        both.gauge(GPU_INFO.name, 1, 1 if gpu is GPU0 else None, **gpu, name="NVIDIA H100 80GB HBM3",
                   pci_bus_id=bus, driver_version="550.54.15")
    both.constant(GPU_UP.name, 1, **GPU0)
    both.gauge(GPU_UP.name, 1, 0, **GPU1)
    both.constant(DEVICE_PRESENT.name, 1, pci_bus_id=BUS0)
    both.gauge(DEVICE_PRESENT.name, 1, 0, pci_bus_id=BUS1)
    both.expect(not_yet(wait), rule.alert)
    both.expect(firing(wait), rule.alert, both.alert(rule, {**GPU1, "pci_bus_id": BUS1}, value=0))

    bus_only = Test("GPU lost: a PCI function leaves the bus before NVML notices: named with its GPU",
                    firing(wait) + 120, catalog)
    bus_only.gauge(GPU_INFO.name, 1, None, **GPU1, name="NVIDIA H100 80GB HBM3", pci_bus_id=BUS1,
                   driver_version="550.54.15")
    bus_only.gauge(DEVICE_PRESENT.name, 1, 0, pci_bus_id=BUS1)
    bus_only.expect(firing(wait), rule.alert, bus_only.alert(rule, {**GPU1, "pci_bus_id": BUS1}, value=0))

    unknown = Test("GPU lost: no identity from before the loss (agent started after it): two views",
                   firing(wait) + 120, catalog)
    unknown.gauge(GPU_UP.name, 1, 0, **GPU2)
    unknown.gauge(DEVICE_PRESENT.name, 1, 0, pci_bus_id=BUS0)
    unknown.expect(firing(wait), rule.alert, unknown.alert(rule, GPU2, value=0),
                   unknown.alert(rule, {"pci_bus_id": BUS0}, value=0))
    return [both, bus_only, unknown]
