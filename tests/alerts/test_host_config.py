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
from hybridmon.exporters.process import LOCKED, MEMLOCK_LIMIT, PINNED
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


def judge(nodes=2, memlock=math.inf, locked=0.0, pinned=0.0, **memory):
    trace = Trace()
    settings = dict(swappiness=10, dirty_ratio=15, numa_balancing=0, thp_enabled="madvise")
    settings.update(memory)
    now = trace.run(T0, T0 + 5, host_memory=lambda t: host_memory_rows(**settings),
                    numa=lambda t: numa_rows(nodes),
                    process=lambda t: process_rows("4242", "vllm", memlock_limit=memlock,
                                                   locked=locked, pinned=pinned))
    return detector().evaluate(trace.history, now)


def test_a_tuned_host_is_silent():
    assert judge() == []


def test_an_untuned_host_gives_every_risk_once():
    # llama.cpp --mlock under a 4 GiB LimitMEMLOCK: it locks tensor by tensor and stops at the first
    # refused mlock, within one tensor of the limit (agent/alerts/thresholds.toml [host_config])
    findings = judge(swappiness=60, dirty_ratio=20, numa_balancing=1, thp_enabled="always",
                     memlock=4 * GIB, locked=3.75 * GIB, pinned=0.0)
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
    assert (memlock.value, memlock.threshold, memlock.unit) == (3.75 / 4, 0.9, "ratio")
    assert memlock.details == {"locked_bytes": 3.75 * GIB, "pinned_bytes": 0.0, "memlock_limit_bytes": 4 * GIB}
    assert "has locked 93.75% of its memlock limit" in memlock.summary
    assert ("holds 3.75GiB mlock()ed (VmLck) and 0B pinned for DMA (VmPin) of a soft RLIMIT_MEMLOCK "
            "of 4GiB: 93.75% of it (threshold 90%; /proc/4242/status") in memlock.description
    assert "next mlock() or RDMA memory registration" in memlock.description
    assert "(cudaHostAlloc, cudaHostRegister" in memlock.description and "not charged" in memlock.description


def test_a_low_memlock_limit_on_a_process_that_locks_nothing_is_silent():
    """The default 8 MiB binds only mlock and RDMA registration: a server whose pinned buffers are
    CUDA's (cudaHostAlloc, cudaHostRegister: charged to neither VmLck nor VmPin) risks nothing."""
    assert judge(memlock=8 * MIB) == []
    assert judge(memlock=8 * MIB, locked=4 * MIB, pinned=4 * MIB) == []


def test_memlock_fires_near_the_limit_not_below_the_share():
    limit = 16 * GIB
    (finding,) = judge(memlock=limit, locked=0.9 * limit)
    assert finding.alertname == "InferenceProcessMemlockLow" and finding.value == pytest.approx(0.9)
    assert judge(memlock=limit, locked=0.89 * limit) == []
    (at_the_limit,) = judge(memlock=limit, locked=limit)   # the kernel allows locked == limit
    assert at_the_limit.value == 1.0


def test_pinned_memory_counts_on_its_own_and_never_added_to_the_locked():
    """ib_umem_get checks pinned_vm, do_mlock locked_vm, each alone against the limit."""
    limit = 2 * GIB
    (finding,) = judge(memlock=limit, pinned=0.95 * limit)
    assert finding.value == pytest.approx(0.95) and finding.details["pinned_bytes"] == 0.95 * limit
    assert "and 1.9GiB pinned for DMA (VmPin)" in finding.description
    assert judge(memlock=limit, locked=0.5 * limit, pinned=0.5 * limit) == []


def test_memlock_without_vmpin_judges_vmlck_alone():
    """VmPin is absent on kernels before 3.2: the text leaves it out."""
    (finding,) = judge(memlock=GIB, locked=0.95 * GIB, pinned=None)
    assert "pinned_bytes" not in finding.details and "VmPin" not in finding.description
    assert "holds 972.8MiB mlock()ed (VmLck) of a soft RLIMIT_MEMLOCK of 1GiB" in finding.description


def test_memlock_unlimited_or_passed_is_fine():
    # unlimited is +Inf: no share of it is ever reached
    assert judge(memlock=math.inf, locked=64 * GIB, pinned=64 * GIB) == []
    # past the limit the kernel let it through: the process holds CAP_IPC_LOCK (the fixture's
    # vLLM, 4 GiB of VmPin under the 8 MiB default)
    assert judge(memlock=8 * MIB, pinned=4 * GIB) == []
    assert judge(memlock=8 * MIB, locked=9 * MIB) == []


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


# --- its rule's promtool cases ------------------------------------------------------------------


def promtool_cases(t, catalog) -> list[Test]:
    """gpu-host-1 drifts into every risky setting at the onset; gpu-host-2 and -3 show the guards.

    The watched processes' locked memory: on gpu-host-1 vLLM's VmLck climbs near its limit at the
    onset (llama.cpp --mlock stopping under it; no VmPin series, as on a kernel before 3.2) while
    llama-server keeps the 8 MiB default and locks nothing (silent: the old rule fired on it); on
    gpu-host-2 vLLM's VmPin (an RDMA registration) climbs near its limit while llama-server locks
    64 GiB unlimited; on gpu-host-3 vLLM has VmPin far past its 8 MiB (CAP_IPC_LOCK) and
    llama-server half its limit in each counter (each is checked alone, never their sum)."""
    c = t.host_config
    test = Test("host configuration: gpu-host-1 changes to risky settings at the onset; gpu-host-2 "
                "(no swap, one NUMA node) and gpu-host-3 (no swap, memory running out) show the "
                "conditions that keep each alert silent or raise it", firing(0) + 120, catalog)
    swappiness, dirty_ratio = c.max_swappiness_with_swap + 50, c.max_dirty_ratio + 5
    share = c.locked_share_of_memlock_limit
    near = (1 + share) / 2   # between the share and the limit itself
    lock_limit, pin_limit = 4 * GIB, 2 * GIB
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
    test.constant(MEMLOCK_LIMIT.name, lock_limit, **VLLM)
    test.gauge(LOCKED.name, 0, near * lock_limit, **VLLM)
    test.constant(MEMLOCK_LIMIT.name, 8 * MIB, **LLAMA)
    test.constant(LOCKED.name, 0, **LLAMA)
    test.constant(PINNED.name, 0, **LLAMA)
    # gpu-host-2: high swappiness but no swap, balancing on but one node, plenty available
    test.constant(sysctl, swappiness, HOST2, sysctl="vm.swappiness")
    test.constant(sysctl, c.max_dirty_ratio, HOST2, sysctl="vm.dirty_ratio")
    test.constant(sysctl, 1, HOST2, sysctl="kernel.numa_balancing")
    test.constant(thp, 1, HOST2, setting="enabled", mode="madvise")
    test.constant(SWAP_TOTAL.name, 0, HOST2)
    test.constant(MEMORY_TOTAL.name, total, HOST2)
    test.constant(MEMORY_AVAILABLE.name, ample * total, HOST2)
    test.constant(NODE_MEMORY_TOTAL.name, total, HOST2, node="0")
    test.constant(MEMLOCK_LIMIT.name, pin_limit, HOST2, **VLLM)
    test.constant(LOCKED.name, 0, HOST2, **VLLM)
    test.gauge(PINNED.name, 0, near * pin_limit, HOST2, **VLLM)
    test.constant(MEMLOCK_LIMIT.name, float("inf"), HOST2, **LLAMA)
    test.constant(LOCKED.name, 64 * GIB, HOST2, **LLAMA)
    # gpu-host-3: no swap, available memory falls below the share at the onset
    test.constant(SWAP_TOTAL.name, 0, HOST3)
    test.constant(MEMORY_TOTAL.name, total, HOST3)
    test.gauge(MEMORY_AVAILABLE.name, ample * total, low * total, HOST3)
    test.constant(MEMLOCK_LIMIT.name, 8 * MIB, HOST3, **VLLM)
    test.constant(LOCKED.name, 0, HOST3, **VLLM)
    test.constant(PINNED.name, 4 * GIB, HOST3, **VLLM)
    test.constant(MEMLOCK_LIMIT.name, lock_limit, HOST3, **LLAMA)
    test.constant(LOCKED.name, lock_limit / 2, HOST3, **LLAMA)
    test.constant(PINNED.name, lock_limit / 2, HOST3, **LLAMA)

    at = firing(0)
    for alertname, entity, instance, values in (
        ("HostSwappinessHigh", {}, HOST, {"value": swappiness, "swap": 8 * GIB}),
        ("HostDirtyRatioHigh", {}, HOST, {"value": dirty_ratio}),
        ("HostTransparentHugepageAlways", {}, HOST, {"value": 1}),
        ("HostNumaBalancingEnabled", {}, HOST, {"value": 1, "nodes": 2}),
        ("HostNoSwapLowHeadroom", {}, HOST3, {"value": low, "available": low * total, "total": total}),
    ):
        rule = catalog.find(alertname)
        test.expect(not_yet(0), alertname)
        test.expect(at, alertname, test.alert(rule, entity, instance, **values))
    memlock = catalog.find("InferenceProcessMemlockLow")
    test.expect(not_yet(0), memlock.alert)
    test.expect(at, memlock.alert,
                test.alert(memlock, VLLM, HOST, value=near, locked=near * lock_limit, pinned=None,
                           limit=lock_limit),
                test.alert(memlock, VLLM, HOST2, value=near, locked=0, pinned=near * pin_limit,
                           limit=pin_limit))
    return [test]
