import math

import pytest

from hybridmon.agent.alerts.host_config import Detector
from tests.support.detector_history import (GIB, MIB, T0, THRESHOLDS, Trace, alertnames,
                                          host_memory_rows, numa_rows, only, process_rows)


def detector():
    return Detector(THRESHOLDS.host_config)


def judge(nodes=2, memlock=math.inf, **memory):
    trace = Trace()
    settings = dict(swappiness=10, dirty_ratio=15, numa_balancing=0, thp_enabled="madvise")
    settings.update(memory)
    now = trace.run(T0, T0 + 5, host_memory=lambda t: host_memory_rows(**settings),
                    numa=lambda t: numa_rows(nodes),
                    process=lambda t: process_rows("4242", "vllm", memlock_limit=memlock))
    return detector().evaluate(trace.history, now)


def test_a_tuned_host_is_silent():
    assert judge() == []


def test_an_untuned_host_gives_every_risk_once():
    findings = judge(swappiness=60, dirty_ratio=20, numa_balancing=1, thp_enabled="always",
                     memlock=8 * MIB)
    assert alertnames(findings) == ["HostDirtyRatioHigh", "HostNumaBalancingEnabled",
                                    "HostSwappinessHigh", "HostTransparentHugepageAlways",
                                    "InferenceProcessMemlockLow"]
    assert {f.severity for f in findings} == {"info"}
    swappiness = only(findings, "HostSwappinessHigh")
    assert (swappiness.value, swappiness.threshold, swappiness.labels) == (60, 10, {})
    assert "vm.swappiness=60" in swappiness.summary and "vm.swappiness is 60" in swappiness.description
    dirty = only(findings, "HostDirtyRatioHigh")
    assert (dirty.value, dirty.threshold) == (20, 15)
    memlock = only(findings, "InferenceProcessMemlockLow")
    assert memlock.labels == {"pid": "4242", "process_name": "vllm"}
    assert memlock.value == 8 * MIB and memlock.threshold == GIB
    assert "may lock only 8MiB" in memlock.summary and "/proc/4242/limits" in memlock.description


def test_swappiness_matters_only_with_swap():
    assert judge(swappiness=60, swap_total=0, memory_available=40 * GIB) == []


def test_numa_balancing_only_on_multi_node_hosts_and_in_balancing_modes():
    assert judge(nodes=1, numa_balancing=1) == []
    assert judge(numa_balancing=2) == []          # memory tiering only
    (finding,) = judge(numa_balancing=3)
    assert finding.alertname == "HostNumaBalancingEnabled" and finding.details["numa_nodes"] == 2


def test_no_swap_and_little_available_memory():
    (finding,) = judge(swap_total=0, memory_available=4 * GIB, memory_total=64 * GIB)
    assert finding.alertname == "HostNoSwapLowHeadroom"
    assert finding.value == pytest.approx(4 / 64) and finding.threshold == 0.10
    assert "(4GiB of 64GiB, 1 min average" in finding.description
    assert judge(swap_total=0, memory_available=16 * GIB) == []
    assert judge(swap_total=8 * GIB, memory_available=4 * GIB) == []


def test_memlock_unlimited_or_large_is_fine():
    assert judge(memlock=math.inf) == []
    assert judge(memlock=2 * GIB) == []
    assert alertnames(judge(memlock=GIB - 1)) == ["InferenceProcessMemlockLow"]
