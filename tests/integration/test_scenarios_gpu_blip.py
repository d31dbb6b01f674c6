"""Issue 28, class 5: the gpu_blip scenario (tests/support/scenarios/gpu_blip_library.py), one
collection of NVML_ERROR_GPU_IS_LOST on GPU1 that does not hold, read back through the real
collectors and judged by every detector at the blip and around it. That the whole replay stays
silent through both doors is test_detection.py's and test_rules_vs_detectors.py's silence tests
(gpu_blip-detectors, gpu_blip-rules), which evaluate at 60 s on their 10 s and 15 s grids; this
module shows that the blip is there to be seen at that evaluation and what each detector makes of
it, and that the old rule (confirm on the first reading) would have paged on it."""
from __future__ import annotations

from hybridmon.agent.alerts import gpu_lost
from hybridmon.agent.alerts.catalogue import all_detectors, load_thresholds
from hybridmon.exporters.gpu import DOWN_BLIPS, DOWN_READINGS, GPU_UP, MEMORY_USED, PCIE_THROUGHPUT
from hybridmon.exporters.pcie import DEVICE_PRESENT, LINK_SPEED, LINK_WIDTH, PcieCollector
from tests.support.scenario_traces import between, one, value_at
from tests.support.scenarios import START_TIME
from tests.support.scenarios.gpu_blip_library import BLIP_AT
from tests.support.scenarios.library import GPU1_ADDRESS

THRESHOLDS = load_thresholds()


def has_point_at(series, t: float) -> bool:
    return any(abs(time - START_TIME - t) < 1e-6 for time in series.times)


def test_the_blip_is_one_collection_down_and_nothing_else_moves(scenarios):
    history = scenarios.replayed("gpu_blip").history
    up, down, blips = (one(history, spec.name, gpu="1") for spec in (GPU_UP, DOWN_READINGS, DOWN_BLIPS))
    assert [value_at(up, t) for t in (BLIP_AT - 1, BLIP_AT, BLIP_AT + 1)] == [1, 0, 1]
    assert [value_at(down, t) for t in (BLIP_AT - 1, BLIP_AT, BLIP_AT + 1)] == [0, 1, 0]
    assert [value_at(blips, t) for t in (BLIP_AT, BLIP_AT + 1, 120)] == [0, 1, 1]
    # GPU1's other series vanish for that tick only, as exporters/gpu.py reports a down GPU
    memory = one(history, MEMORY_USED.name, gpu="1")
    assert [has_point_at(memory, t) for t in (BLIP_AT - 1, BLIP_AT, BLIP_AT + 1)] == [True, False, True]
    assert not any(has_point_at(s, BLIP_AT) for s in history.series(PCIE_THROUGHPUT.name, gpu="1"))
    # the bus never moved: the function stays, its link at Gen4 x16 (16 GT/s), in every reading of
    # the pcie collector (every 5 s) around the blip
    around = PcieCollector.default_interval_seconds
    for spec, value in ((DEVICE_PRESENT, 1), (LINK_WIDTH, 16), (LINK_SPEED, 16e9)):
        series = one(history, spec.name, pci_bus_id=GPU1_ADDRESS)
        assert set(between(series, BLIP_AT - around, BLIP_AT + around + 1)) == {value}, spec.name


def test_no_detector_finds_anything_around_the_blip(scenarios):
    """Every detector, on the trace's every-tick history, before, at and after the blip: no
    finding at all, pending ones included (a GPU's memory vanishing for a tick is no headroom,
    growth or starvation finding). The old confirmation (one reading) would page at the blip."""
    history = scenarios.replayed("gpu_blip").history
    for t in (BLIP_AT - 1, BLIP_AT, BLIP_AT + 1, BLIP_AT + 2, BLIP_AT + 15, 120):
        found = {d.name: d.evaluate(history, START_TIME + t) for d in all_detectors(THRESHOLDS)}
        assert {name: findings for name, findings in found.items() if findings} == {}, t
    old = gpu_lost.Detector(THRESHOLDS.gpu_lost.model_copy(update={"confirm_readings": 1}))
    paged = old.evaluate(history, START_TIME + BLIP_AT)
    assert [(f.labels["gpu"], f.severity) for f in paged] == [("1", "critical")]
    assert old.evaluate(history, START_TIME + BLIP_AT + 1) == []


def test_a_lost_gpu_still_pages_at_its_second_reading(scenarios):
    """gpu_lost (lost from 60 s, its function gone at 62 s) and gpu_lost_and_reset (lost from 60 s
    to 120 s, the function stays): each confirmed by the second reading, at 61 s."""
    detector = gpu_lost.Detector(THRESHOLDS.gpu_lost)
    for name in ("gpu_lost", "gpu_lost_and_reset"):
        history = scenarios.replayed(name).history
        assert detector.evaluate(history, START_TIME + 60) == [], name
        assert [f.labels["gpu"] for f in detector.evaluate(history, START_TIME + 61)] == ["1"], name
