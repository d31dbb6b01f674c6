"""The tests of the swap_thrash alert family (agent/alerts/swap_thrash.py): its rule's promtool cases
(`promtool_cases`, written to rules/tests/generated_swap_thrash.yml by `python -m tests.rules.generate`
and run by promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

from hybridmon.exporters.process import MAJOR_FAULTS as PROCESS_MAJOR_FAULTS
from hybridmon.exporters.process import SWAP as PROCESS_SWAP

from tests.support.promtool_cases import (
    BEFORE_SAMPLES,
    MIB,
    ONSET,
    STEP,
    Test,
    above,
    firing,
    not_yet,
)
from tests.support.promtool_inputs import HOST2, LLAMA, SGLANG, VLLM, host_memory


def thrash_with_faults(t, catalog) -> Test:
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
    test.add(PROCESS_SWAP.name, f"0x{BEFORE_SAMPLES - 1} {start}+{growth}x{rest - 1}", **VLLM)
    test.counter(PROCESS_MAJOR_FAULTS.name, 0, few, **VLLM)
    test.constant(PROCESS_SWAP.name, 0, **LLAMA)
    test.counter(PROCESS_MAJOR_FAULTS.name, 0, many, **LLAMA)
    test.gauge(PROCESS_SWAP.name, 0, start, **SGLANG)
    test.counter(PROCESS_MAJOR_FAULTS.name, 0, few, **SGLANG)
    # the 1 min average is the sample 30 s back: sample k after the onset is at ONSET + 15 s (k + 1)
    swapped = start + growth * ((at - 30 - ONSET) // STEP - 1)
    settings = {"swappiness": 60, "dirty_ratio": 20}
    host = {"swap_in": swap_in, "swap_out": swap_out}
    test.expect(not_yet(s.for_seconds), "HostSwapThrash")
    test.expect(at, "HostSwapThrash",
                test.alert(warning, {}, value=swap_in, swap_out=swap_out, major_faults=major,
                           pressure=pressure, most_swapped=swapped, **settings),
                test.alert(critical, VLLM, value=swapped, major_faults=few, **host,
                           **settings),
                test.alert(critical, LLAMA, value=0, major_faults=many, **host,
                           **settings))
    return test


def thrash_with_pressure(t, catalog) -> Test:
    s = t.swap_thrash
    warning = catalog.find("HostSwapThrash", "warning")
    at = firing(s.for_seconds)
    test = Test("swap thrash with memory pressure and few major faults: the host warns; no "
                "watched process swaps, so nothing is critical", at + 120, catalog)
    swap_in, swap_out = 2 * s.swap_in_bytes_per_second, 2 * s.swap_out_bytes_per_second
    major, pressure = s.major_faults_per_second / 2, above(s.memory_pressure_some_ratio)
    host_memory(test, swap_in, swap_out, major, pressure)
    test.constant(PROCESS_SWAP.name, 0, **VLLM)
    test.constant(PROCESS_MAJOR_FAULTS.name, 0, **VLLM)
    test.expect(not_yet(s.for_seconds), "HostSwapThrash")
    test.expect(at, "HostSwapThrash", test.alert(
        warning, {}, value=swap_in, swap_out=swap_out, major_faults=major, pressure=pressure,
        most_swapped=0, swappiness=60, dirty_ratio=20))
    return test


def no_thrash(t, catalog) -> Test:
    s = t.swap_thrash
    at = firing(s.for_seconds)
    test = Test("no swap thrash: swap configured but unused on gpu-host-1; swap-out alone (no "
                "swap-in) under pressure on gpu-host-2", at + 120, catalog)
    host_memory(test, 0, 0, s.major_faults_per_second / 2, 0)
    host_memory(test, 0, 2 * s.swap_out_bytes_per_second, 2 * s.major_faults_per_second,
                above(s.memory_pressure_some_ratio), HOST2)
    test.constant(PROCESS_SWAP.name, 0, **VLLM)
    test.constant(PROCESS_MAJOR_FAULTS.name, 0, **VLLM)
    test.expect(at, "HostSwapThrash")
    return test


def promtool_cases(t, catalog) -> list[Test]:
    return [thrash_with_faults(t, catalog), thrash_with_pressure(t, catalog), no_thrash(t, catalog)]
