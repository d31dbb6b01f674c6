"""The tests of the host_config alert family (agent/alerts/host_config.py): its detector, on
histories written sample by sample, and its rule's promtool cases (`promtool_cases`, written
to rules/tests/generated_host_config.yml by `python -m tests.rules.generate` and run by
promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

import math

import pytest

from hybridmon.agent.alerts.host_config import Detector
from hybridmon.exporters.host_memory import (
    MEMORY_AVAILABLE,
    MEMORY_TOTAL,
    SWAP_TOTAL,
    SYSCTL_VALUE,
    TRANSPARENT_HUGEPAGE_MODE,
)
from hybridmon.exporters.numa import NODE_MEMORY_TOTAL
from hybridmon.exporters.process import MEMLOCK_LIMIT
from tests.support.detector_history import (
    MIB,
    T0,
    THRESHOLDS,
    Trace,
    alertnames,
    host_memory_rows,
    numa_rows,
    only,
    process_rows,
)
from tests.support.promtool_cases import GIB, HOST, Test, above, firing, not_yet
from tests.support.promtool_inputs import HOST2, HOST3, LLAMA, VLLM


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


# --- its rule's promtool cases ------------------------------------------------------------------


def promtool_cases(t, catalog) -> list[Test]:
    """gpu-host-1 drifts into every risky setting at the onset; gpu-host-2 and -3 show the guards."""
    c = t.host_config
    test = Test("host configuration: gpu-host-1 changes to risky settings at the onset; gpu-host-2 "
                "(no swap, one NUMA node) and gpu-host-3 (no swap, memory running out) show the "
                "conditions that keep each alert silent or raise it", firing(0) + 120, catalog)
    swappiness, dirty_ratio = c.max_swappiness_with_swap + 50, c.max_dirty_ratio + 5
    memlock = c.min_memlock_bytes / 128
    low = c.min_available_share_without_swap / 2
    ample = max(0.5, above(c.min_available_share_without_swap))
    total = 64 * GIB
    sysctl, thp = SYSCTL_VALUE.name, TRANSPARENT_HUGEPAGE_MODE.name
    # gpu-host-1: swap configured, two NUMA nodes; settings change after the onset
    test.gauge(sysctl, c.max_swappiness_with_swap, swappiness, sysctl="vm.swappiness")
    test.gauge(sysctl, c.max_dirty_ratio, dirty_ratio, sysctl="vm.dirty_ratio")
    test.gauge(sysctl, 0, 1, sysctl="kernel.numa_balancing")
    test.gauge(thp, 1, None, setting="enabled", mode="madvise")
    test.gauge(thp, None, 1, setting="enabled", mode="always")
    test.constant(SWAP_TOTAL.name, 8 * GIB)
    test.constant(MEMORY_TOTAL.name, total)
    test.constant(MEMORY_AVAILABLE.name, low * total)
    for node in ("0", "1"):
        test.constant(NODE_MEMORY_TOTAL.name, total / 2, node=node)
    test.gauge(MEMLOCK_LIMIT.name, None, memlock, **VLLM)
    test.constant(MEMLOCK_LIMIT.name, float("inf"), **LLAMA)
    # gpu-host-2: high swappiness but no swap, balancing on but one node, plenty available
    test.constant(sysctl, swappiness, HOST2, sysctl="vm.swappiness")
    test.constant(sysctl, c.max_dirty_ratio, HOST2, sysctl="vm.dirty_ratio")
    test.constant(sysctl, 1, HOST2, sysctl="kernel.numa_balancing")
    test.constant(thp, 1, HOST2, setting="enabled", mode="madvise")
    test.constant(SWAP_TOTAL.name, 0, HOST2)
    test.constant(MEMORY_TOTAL.name, total, HOST2)
    test.constant(MEMORY_AVAILABLE.name, ample * total, HOST2)
    test.constant(NODE_MEMORY_TOTAL.name, total, HOST2, node="0")
    # gpu-host-3: no swap, available memory falls below the share at the onset
    test.constant(SWAP_TOTAL.name, 0, HOST3)
    test.constant(MEMORY_TOTAL.name, total, HOST3)
    test.gauge(MEMORY_AVAILABLE.name, ample * total, low * total, HOST3)

    at = firing(0)
    for alertname, entity, instance, values in (
        ("HostSwappinessHigh", {}, HOST, {"value": swappiness, "swap": 8 * GIB}),
        ("HostDirtyRatioHigh", {}, HOST, {"value": dirty_ratio}),
        ("HostTransparentHugepageAlways", {}, HOST, {"value": 1}),
        ("HostNumaBalancingEnabled", {}, HOST, {"value": 1, "nodes": 2}),
        ("HostNoSwapLowHeadroom", {}, HOST3, {"value": low, "available": low * total, "total": total}),
        ("InferenceProcessMemlockLow", VLLM, HOST, {"value": memlock}),
    ):
        rule = catalog.find(alertname)
        test.expect(not_yet(0), alertname)
        test.expect(at, alertname, test.alert(rule, entity, instance, **values))
    return [test]
