"""promtool tests for swap thrash and the host configuration rules (see rules.scenarios)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the schema is built from the families, which import these rules
    from hybridmon.agent.alerts.catalogue import Thresholds

from hybridmon.rules.scenarios import (BEFORE_SAMPLES, GIB, HOST, MIB, ONSET, STEP, Catalog, Test, above,
                             firing, not_yet)

HOST2 = "gpu-host-2:9787"
HOST3 = "gpu-host-3:9787"
VLLM = {"pid": "4242", "name": "python3"}
LLAMA = {"pid": "5151", "name": "llama-server"}
SGLANG = {"pid": "6161", "name": "sglang"}


def process_label(process: dict[str, str]) -> dict[str, str]:
    return {"pid": process["pid"], "process_name": process["name"]}


def host_memory(test: Test, swap_in: float, swap_out: float, major_faults: float, pressure: float,
                instance: str = HOST) -> None:
    """Host swap traffic (bytes/s), major faults/s and PSI memory "some" share after the onset."""
    test.counter("hybridmon_swap_in_bytes_total", 0, swap_in, instance)
    test.counter("hybridmon_swap_out_bytes_total", 0, swap_out, instance)
    test.counter("hybridmon_memory_major_page_faults_total", 1, major_faults, instance)
    test.counter("hybridmon_pressure_stalled_seconds_total", 0, pressure, instance,
                 resource="memory", scope="some")
    test.constant("hybridmon_pressure_stalled_seconds_total", 0, instance, resource="memory", scope="full")
    test.constant("hybridmon_swap_total_bytes", 8 * GIB, instance)
    test.constant("hybridmon_sysctl_value", 60, instance, sysctl="vm.swappiness")
    test.constant("hybridmon_sysctl_value", 20, instance, sysctl="vm.dirty_ratio")


def thrash_with_faults(t: Thresholds, catalog: Catalog) -> Test:
    s = t.swap_thrash
    warning, critical = catalog.find("HostSwapThrash", "warning"), catalog.find("HostSwapThrash", "critical")
    at = firing(s.for_seconds)
    test = Test("swap thrash with major faults: the host warns; python3 (pid 4242, swap growing) "
                "and llama-server (pid 5151, major-faulting) are critical; sglang (pid 6161, "
                "swap held but not growing, few faults) is not named", at + 120, catalog)
    swap_in, swap_out = 2 * s.swap_in_bytes_per_second, 2 * s.swap_out_bytes_per_second
    major, pressure = 2 * s.major_faults_per_second, s.memory_pressure_some_ratio / 2
    host_memory(test, swap_in, swap_out, major, pressure)
    start, growth = 2 * s.process_swap_bytes, MIB     # VmSwap after the onset, bytes per sample
    rest = test.samples - BEFORE_SAMPLES
    few, many = s.process_major_faults_per_second / 2, 2 * s.process_major_faults_per_second
    test.add("hybridmon_process_swap_bytes", f"0x{BEFORE_SAMPLES - 1} {start}+{growth}x{rest - 1}", **VLLM)
    test.counter("hybridmon_process_major_faults_total", 0, few, **VLLM)
    test.constant("hybridmon_process_swap_bytes", 0, **LLAMA)
    test.counter("hybridmon_process_major_faults_total", 0, many, **LLAMA)
    test.gauge("hybridmon_process_swap_bytes", 0, start, **SGLANG)
    test.counter("hybridmon_process_major_faults_total", 0, few, **SGLANG)
    # the 1 min average is the sample 30 s back: sample k after the onset is at ONSET + 15 s (k + 1)
    swapped = start + growth * ((at - 30 - ONSET) // STEP - 1)
    settings = {"swappiness": 60, "dirty_ratio": 20}
    test.expect(not_yet(s.for_seconds), "HostSwapThrash")
    test.expect(at, "HostSwapThrash",
                test.alert(warning, {}, value=swap_in, swap_out=swap_out, major_faults=major,
                           pressure=pressure, **settings),
                test.alert(critical, process_label(VLLM), value=swapped, major_faults=few, **settings),
                test.alert(critical, process_label(LLAMA), value=0, major_faults=many, **settings))
    return test


def thrash_with_pressure(t: Thresholds, catalog: Catalog) -> Test:
    s = t.swap_thrash
    warning = catalog.find("HostSwapThrash", "warning")
    at = firing(s.for_seconds)
    test = Test("swap thrash with memory pressure and few major faults: the host warns; no "
                "watched process swaps, so nothing is critical", at + 120, catalog)
    swap_in, swap_out = 2 * s.swap_in_bytes_per_second, 2 * s.swap_out_bytes_per_second
    major, pressure = s.major_faults_per_second / 2, above(s.memory_pressure_some_ratio)
    host_memory(test, swap_in, swap_out, major, pressure)
    test.constant("hybridmon_process_swap_bytes", 0, **VLLM)
    test.constant("hybridmon_process_major_faults_total", 0, **VLLM)
    test.expect(not_yet(s.for_seconds), "HostSwapThrash")
    test.expect(at, "HostSwapThrash", test.alert(
        warning, {}, value=swap_in, swap_out=swap_out, major_faults=major, pressure=pressure,
        swappiness=60, dirty_ratio=20))
    return test


def no_thrash(t: Thresholds, catalog: Catalog) -> Test:
    s = t.swap_thrash
    at = firing(s.for_seconds)
    test = Test("no swap thrash: swap configured but unused on gpu-host-1; swap-out alone (no "
                "swap-in) under pressure on gpu-host-2", at + 120, catalog)
    host_memory(test, 0, 0, s.major_faults_per_second / 2, 0)
    host_memory(test, 0, 2 * s.swap_out_bytes_per_second, 2 * s.major_faults_per_second,
                above(s.memory_pressure_some_ratio), HOST2)
    test.constant("hybridmon_process_swap_bytes", 0, **VLLM)
    test.constant("hybridmon_process_major_faults_total", 0, **VLLM)
    test.expect(at, "HostSwapThrash")
    return test


def host_config(t: Thresholds, catalog: Catalog) -> Test:
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
    # gpu-host-1: swap configured, two NUMA nodes; settings change after the onset
    test.gauge("hybridmon_sysctl_value", c.max_swappiness_with_swap, swappiness, sysctl="vm.swappiness")
    test.gauge("hybridmon_sysctl_value", c.max_dirty_ratio, dirty_ratio, sysctl="vm.dirty_ratio")
    test.gauge("hybridmon_sysctl_value", 0, 1, sysctl="kernel.numa_balancing")
    test.gauge("hybridmon_transparent_hugepage_mode", 1, None, setting="enabled", mode="madvise")
    test.gauge("hybridmon_transparent_hugepage_mode", None, 1, setting="enabled", mode="always")
    test.constant("hybridmon_swap_total_bytes", 8 * GIB)
    test.constant("hybridmon_memory_total_bytes", total)
    test.constant("hybridmon_memory_available_bytes", low * total)
    for node in ("0", "1"):
        test.constant("hybridmon_numa_node_memory_total_bytes", total / 2, node=node)
    test.gauge("hybridmon_process_memlock_limit_bytes", None, memlock, **VLLM)
    test.constant("hybridmon_process_memlock_limit_bytes", float("inf"), **LLAMA)
    # gpu-host-2: high swappiness but no swap, balancing on but one node, plenty available
    test.constant("hybridmon_sysctl_value", swappiness, HOST2, sysctl="vm.swappiness")
    test.constant("hybridmon_sysctl_value", c.max_dirty_ratio, HOST2, sysctl="vm.dirty_ratio")
    test.constant("hybridmon_sysctl_value", 1, HOST2, sysctl="kernel.numa_balancing")
    test.constant("hybridmon_transparent_hugepage_mode", 1, HOST2, setting="enabled", mode="madvise")
    test.constant("hybridmon_swap_total_bytes", 0, HOST2)
    test.constant("hybridmon_memory_total_bytes", total, HOST2)
    test.constant("hybridmon_memory_available_bytes", ample * total, HOST2)
    test.constant("hybridmon_numa_node_memory_total_bytes", total, HOST2, node="0")
    # gpu-host-3: no swap, available memory falls below the share at the onset
    test.constant("hybridmon_swap_total_bytes", 0, HOST3)
    test.constant("hybridmon_memory_total_bytes", total, HOST3)
    test.gauge("hybridmon_memory_available_bytes", ample * total, low * total, HOST3)

    at = firing(0)
    for alertname, entity, instance, values in (
        ("HostSwappinessHigh", {}, HOST, {"value": swappiness, "swap": 8 * GIB}),
        ("HostDirtyRatioHigh", {}, HOST, {"value": dirty_ratio}),
        ("HostTransparentHugepageAlways", {}, HOST, {"value": 1}),
        ("HostNumaBalancingEnabled", {}, HOST, {"value": 1, "nodes": 2}),
        ("HostNoSwapLowHeadroom", {}, HOST3, {"value": low}),
        ("InferenceProcessMemlockLow", process_label(VLLM), HOST, {"value": memlock}),
    ):
        rule = catalog.find(alertname)
        test.expect(not_yet(0), alertname)
        test.expect(at, alertname, test.alert(rule, entity, instance, **values))
    return test


def files(t: Thresholds, catalog: Catalog) -> dict[str, list[Test]]:
    return {
        "host_memory": [thrash_with_faults(t, catalog), thrash_with_pressure(t, catalog),
                        no_thrash(t, catalog)],
        "host_config": [host_config(t, catalog)],
    }
