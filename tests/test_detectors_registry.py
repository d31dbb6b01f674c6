from hybridmon.agent.alerts.catalogue import Thresholds
from hybridmon.agent.detectors.engine import Engine
from hybridmon.agent.alerts.catalogue import all_alertnames, all_detectors
from tests.test_detectors_support import (GIB, T0, THRESHOLDS, Trace, gpu_rows, host_memory_rows,
                                          numa_rows, pcie_rows, pressure_rows, process_numa_rows,
                                          process_rows)

ALERTS = {  # the brief's alert table
    "GpuPcieStarvation", "GpuPcieLinkDegraded", "GpuPcieReplayErrors", "PcieAerErrors", "GpuLost",
    "GpuPcieBandwidthLow",
    "HostSwapThrash", "InferenceProcessMemoryGrowth", "InferenceProcessNumaMisplaced",
    "GpuMemoryHeadroomLow", "HostSwappinessHigh", "HostDirtyRatioHigh",
    "HostTransparentHugepageAlways", "HostNumaBalancingEnabled", "HostNoSwapLowHeadroom",
    "InferenceProcessMemlockLow",
    # issue 6: the inference servers' own view
    "InferenceThroughputDecay", "InferenceKvOffloadPressure", "InferenceServerScrapeFailing",
    # issue 11: the agent's own alert delivery
    "HybridmonAlertDeliveryFailing",
}


def test_one_detector_per_thresholds_section_and_every_alert_once():
    detectors = all_detectors(THRESHOLDS)
    assert [d.name for d in detectors] == list(Thresholds.model_fields)
    names = [name for d in detectors for name in d.alertnames]
    assert len(names) == len(set(names))
    assert set(all_alertnames()) == ALERTS


def test_a_healthy_busy_host_gives_no_findings_from_any_detector():
    trace = Trace()

    def process(t):
        s = t - T0
        return process_rows("4242", "vllm", resident=12 * GIB, cpu_seconds=3 * s,
                            minor_faults=900 * s, memlock_limit=float("inf"))

    def process_numa(t):
        return process_numa_rows("4242", "vllm", cpus={"0": 16, "1": 0},
                                 resident={"0": 11 * GIB, "1": GIB})

    engine = Engine(all_detectors(THRESHOLDS), trace.history)
    t = T0
    while t <= T0 + 2400:
        trace.commit("gpu", t, gpu_rows(utilization=0.85, h2d=22e9, d2h=6e9, used=18 * GIB,
                                        numa_node=0, replays=(t - T0) / 60,
                                        processes={"4242": ("vllm", 17 * GIB)}))
        trace.commit("host_memory", t, host_memory_rows(
            swappiness=10, dirty_ratio=15, swap_in=0, swap_out=0, major_faults=2 * (t - T0)))
        trace.commit("pressure", t, pressure_rows(0.001 * (t - T0)))
        trace.commit("process", t, process(t))
        trace.commit("process_numa", t, process_numa(t))
        trace.commit("numa", t, numa_rows(2))
        trace.commit("pcie", t, pcie_rows(numa_node=0, aer={"correctable": 3, "fatal": 0}))
        engine.evaluate(t)
        assert engine.pending() == [] and engine.firing() == [], t
        t += 10
    assert all(count == 0 for count in engine.detector_errors.values())
