"""The tests of the gpu_lost alert family (agent/alerts/gpu_lost.py): its detector, on
histories written sample by sample, and its rule's promtool cases (`promtool_cases`, written
to rules/tests/generated_gpu_lost.yml by `python -m tests.rules.generate` and run by
promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from hybridmon.agent.alerts import gpu_lost
from hybridmon.exporters.gpu import DOWN_BLIPS, DOWN_READINGS, GPU_INFO, GPU_UP
from hybridmon.exporters.pcie import DEVICE_PRESENT
from tests.support.detector_history import T0, THRESHOLDS, Trace, gpu_rows, pcie_rows
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


def lost(**settings):
    return gpu_lost.Detector(THRESHOLDS.gpu_lost.model_copy(update=settings))


class ExportedGpu:
    """A GPU's rows as exporters/gpu.py writes them, tick by tick: a down GPU reports GPU_UP 0 and
    its two down series only, its gpu_info (the only series naming its PCI address) stops with
    the loss; DOWN_READINGS counts the collections in a row it has been down (GpuCollector.
    _count_down), DOWN_BLIPS the runs of one that ended."""

    def __init__(self, gpu_index: str = "0", uuid: str = "GPU-0000", pci_bus_id: str = "0000:17:00.0"):
        self.gpu_index, self.uuid, self.pci_bus_id = gpu_index, uuid, pci_bus_id
        self.streak = self.blips = 0

    def rows(self, up: bool):
        if up:
            self.blips += self.streak == 1
            self.streak = 0
        else:
            self.streak += 1
        labels = (self.gpu_index, self.uuid)
        down = [(DOWN_READINGS, self.streak, *labels), (DOWN_BLIPS, self.blips, *labels)]
        if up:
            return gpu_rows(self.gpu_index, self.uuid, pci_bus_id=self.pci_bus_id) + down
        return [(GPU_UP, 0, *labels)] + down


def test_gpu_lost_one_gpu_in_both_views_is_one_finding_with_both_identities():
    """GPU 1 falls off the bus: NVML loses it at +20 s, its PCI function leaves sysfs at +25 s.
    Before issue 14 these were two findings ({gpu, uuid} and {pci_bus_id}), two pages."""
    trace = Trace()
    gpu1 = ExportedGpu("1", "GPU-1111", pci_bus_id="0000:ca:00.0")
    now = trace.run(T0, T0 + 30,
                    gpu=lambda t: gpu_rows() + gpu1.rows(t < T0 + 20),
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
    gpu0 = ExportedGpu()
    now = trace.run(T0, T0 + 30,
                    gpu=lambda t: gpu0.rows(t < T0 + 20) + gpu_rows(
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
    gpu1 = ExportedGpu("1", "GPU-1111", "0000:ca:00.0")
    now = trace.run(T0, T0 + lookback + 600, step=60,
                    gpu=lambda t: gpu1.rows(t < T0 + 300),
                    pcie=lambda t: pcie_rows("0000:ca:00.0", present=0 if t >= T0 + 300 else 1))
    named = {"gpu": "1", "uuid": "GPU-1111", "pci_bus_id": "0000:ca:00.0"}
    assert [f.labels for f in lost().evaluate(trace.history, T0 + 300 + lookback - 120)] == [named]
    assert sorted(tuple(sorted(f.labels.items())) for f in lost().evaluate(trace.history, now)) == [
        (("gpu", "1"), ("uuid", "GPU-1111")), (("pci_bus_id", "0000:ca:00.0"),)]


def test_gpu_lost_one_lost_reading_that_does_not_hold_is_not_a_loss():
    """Issue 28 class 5: NVML answers GPU_IS_LOST for GPU 1 at one collection (T0 + 10) and
    answers again at the next, its link and function never move. A GPU really lost stays lost
    until a reset (nvml.h), so one reading is not a loss: no finding at the blip, none after; the
    collector counts it in DOWN_BLIPS. With confirm_readings = 1 (the old rule) the same reading
    fires: the confirmation is what keeps it quiet."""
    trace = Trace()
    gpu1 = ExportedGpu("1", "GPU-1111", pci_bus_id="0000:ca:00.0")
    now = trace.run(T0, T0 + 20, gpu=lambda t: gpu_rows() + gpu1.rows(t != T0 + 10),
                    pcie=lambda t: pcie_rows() + pcie_rows("0000:ca:00.0"))
    for at in (T0 + 10, T0 + 11, now):
        assert lost().evaluate(trace.history, at) == [], at
    assert [f.labels for f in lost(confirm_readings=1).evaluate(trace.history, T0 + 10)] == [
        {"gpu": "1", "uuid": "GPU-1111", "pci_bus_id": "0000:ca:00.0"}]
    assert gpu1.blips == 1
    detector = lost()
    detector.evaluate(trace.history, T0 + 10)   # the status page still names the down GPU
    assert detector.figures[("1", "GPU-1111")]["pci_bus_id"] == "0000:ca:00.0"


def test_gpu_lost_pages_at_the_second_reading():
    """Lost from T0 + 10 and still lost at T0 + 11: confirmed at the second collection."""
    trace = Trace()
    gpu1 = ExportedGpu("1", "GPU-1111", pci_bus_id="0000:ca:00.0")
    trace.run(T0, T0 + 20, gpu=lambda t: gpu_rows() + gpu1.rows(t < T0 + 10),
              pcie=lambda t: pcie_rows() + pcie_rows("0000:ca:00.0"))
    assert lost().evaluate(trace.history, T0 + 10) == []
    findings = lost().evaluate(trace.history, T0 + 11)
    assert [f.labels for f in findings] == [{"gpu": "1", "uuid": "GPU-1111", "pci_bus_id": "0000:ca:00.0"}]
    assert findings[0].severity == "critical"
    assert "NVML reports it lost or silent at 2 collections in a row" in findings[0].description
    assert gpu1.blips == 0


def test_gpu_lost_a_first_reading_with_its_function_gone_from_the_bus_pages_at_once():
    """The kernel removing the PCI function confirms the loss without a second NVML reading: one
    finding, named with both identities, at the first lost reading."""
    trace = Trace()
    gpu1 = ExportedGpu("1", "GPU-1111", pci_bus_id="0000:ca:00.0")
    now = trace.run(T0, T0 + 10, gpu=lambda t: gpu_rows() + gpu1.rows(t < T0 + 10),
                    pcie=lambda t: pcie_rows() + pcie_rows("0000:ca:00.0", present=0 if t >= T0 + 10 else 1))
    assert gpu1.streak == 1
    assert [f.labels for f in lost().evaluate(trace.history, now)] == [
        {"gpu": "1", "uuid": "GPU-1111", "pci_bus_id": "0000:ca:00.0"}]


def test_gpu_lost_without_the_down_count_is_not_confirmed():
    """GPU_UP 0 with no DOWN_READINGS (a history without the series): the rule's `and` finds
    nothing to confirm it, and the detector does the same."""
    trace = Trace()
    now = trace.run(T0, T0 + 10, gpu=lambda t: gpu_rows() + [(GPU_UP, 0, "1", "GPU-1111")])
    assert lost().evaluate(trace.history, now) == []


def test_gpu_lost_confirm_readings_below_one_is_refused():
    with pytest.raises(ValidationError, match="confirm_readings"):
        gpu_lost.Settings(for_seconds=0, confirm_readings=0)


def test_gpu_lost_silent_when_every_gpu_is_up():
    trace = Trace()
    now = trace.run(T0, T0 + 30, gpu=lambda t: gpu_rows(), pcie=lambda t: pcie_rows())
    assert lost().evaluate(trace.history, now) == []


# --- its rule's promtool cases ------------------------------------------------------------------


def down_readings(test: Test, lost_from: int | None, blip_at: int | None = None) -> list[float]:
    """DOWN_READINGS at each 15 s scrape, as the agent's 1 s collections count them: a GPU lost
    from `lost_from` (seconds) has been down for (t - lost_from + 1) collections at the scrape
    at t; one down at the single collection `blip_at` shows 1 at that scrape and 0 after."""
    values = []
    for index in range(test.samples):
        t = index * test.interval
        if lost_from is not None and t >= lost_from:
            values.append(t - lost_from + 1)
        else:
            values.append(1 if t == blip_at else 0)
    return values


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
    both.constant(DOWN_READINGS.name, 0, **GPU0)
    both.gauge(GPU_UP.name, 1, 0, **GPU1)
    # lost at the agent's collection 1 s after ONSET: 15 collections down at the next scrape
    both.values(DOWN_READINGS.name, down_readings(both, ONSET + 1), **GPU1)
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
    unknown.values(DOWN_READINGS.name, down_readings(unknown, ONSET + 1), **GPU2)
    unknown.gauge(DEVICE_PRESENT.name, 1, 0, pci_bus_id=BUS0)
    unknown.expect(firing(wait), rule.alert, unknown.alert(rule, GPU2, value=0),
                   unknown.alert(rule, {"pci_bus_id": BUS0}, value=0))

    # One collection of GPU_IS_LOST on GPU 1, scraped (at a rule evaluation: the worst case), and
    # answering again at the next collection; its function stays on the bus. GPU 2 is lost for
    # good from the onset: the same evaluation reads both down, only GPU 2 confirmed.
    blip_at = firing(wait)
    blip = Test("GPU lost: one lost reading on GPU 1 that does not hold does not page; GPU 2 "
                "lost for good does", blip_at + 120, catalog)
    blip.values(GPU_UP.name, [0 if i * blip.interval == blip_at else 1 for i in range(blip.samples)], **GPU1)
    blip.values(DOWN_READINGS.name, down_readings(blip, None, blip_at=blip_at), **GPU1)
    blip.gauge(GPU_UP.name, 1, 0, **GPU2)
    blip.values(DOWN_READINGS.name, down_readings(blip, ONSET + 1), **GPU2)
    blip.constant(DEVICE_PRESENT.name, 1, pci_bus_id=BUS1)
    blip.expect(blip_at, rule.alert, blip.alert(rule, GPU2, value=0))
    blip.expect(blip_at + 60, rule.alert, blip.alert(rule, GPU2, value=0))
    return [both, bus_only, unknown, blip]
