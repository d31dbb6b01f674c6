"""The tests of the gpu_lost alert family (agent/alerts/gpu_lost.py): its rule's promtool cases
(`promtool_cases`, written to rules/tests/generated_gpu_lost.yml by `python -m tests.rules.generate`
and run by promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

from hybridmon.exporters.gpu import GPU_INFO, GPU_UP
from hybridmon.exporters.pcie import DEVICE_PRESENT

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
