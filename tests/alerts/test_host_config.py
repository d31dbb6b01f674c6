"""The tests of the host_config alert family (agent/alerts/host_config.py): its rule's promtool cases
(`promtool_cases`, written to rules/tests/generated_host_config.yml by `python -m tests.rules.generate`
and run by promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

from hybridmon.exporters.host_memory import (
    MEMORY_AVAILABLE,
    MEMORY_TOTAL,
    SWAP_TOTAL,
    SYSCTL_VALUE,
    TRANSPARENT_HUGEPAGE_MODE,
)
from hybridmon.exporters.numa import NODE_MEMORY_TOTAL
from hybridmon.exporters.process import MEMLOCK_LIMIT

from tests.support.promtool_cases import GIB, HOST, Test, above, firing, not_yet
from tests.support.promtool_inputs import HOST2, HOST3, LLAMA, VLLM


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
