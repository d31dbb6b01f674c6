"""The tests of the swap_thrash alert family (agent/alerts/swap_thrash.py): its detector, on
histories written sample by sample, and its rule's promtool cases (`promtool_cases`, written
to rules/tests/generated_swap_thrash.yml by `python -m tests.rules.generate` and run by
promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

import pytest

from hybridmon.agent.alerts.swap_thrash import Detector
from hybridmon.exporters.process import MAJOR_FAULTS as PROCESS_MAJOR_FAULTS
from hybridmon.exporters.process import SWAP as PROCESS_SWAP
from tests.support.detector_history import (
    GIB,
    T0,
    THRESHOLDS,
    Trace,
    host_memory_rows,
    only,
    pressure_rows,
    process_rows,
)
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


def detector():
    return Detector(THRESHOLDS.swap_thrash)


def thrashing_host(t, *, swap_in=2 * MIB, swap_out=3 * MIB, major=100.0, psi=0.2):
    s = t - T0
    return host_memory_rows(swap_in=swap_in * s, swap_out=swap_out * s, major_faults=major * s,
                            swappiness=60, dirty_ratio=20)


def test_thrash_with_a_swapping_inference_process_is_critical():
    trace = Trace()
    now = trace.run(
        T0, T0 + 180,
        host_memory=thrashing_host,
        pressure=lambda t: pressure_rows(0.2 * (t - T0)),
        process=lambda t: process_rows("4242", "vllm", swap=100 * MIB + MIB * (t - T0),
                                       major_faults=20 * (t - T0))
        + process_rows("77", "sshd", swap=2 * MIB))
    findings = detector().evaluate(trace.history, now)
    assert len(findings) == 2
    (host,) = [f for f in findings if not f.labels]
    assert host.severity == "warning" and host.for_seconds == 120
    assert host.value == pytest.approx(2 * MIB) and host.threshold == MIB
    assert host.details["swap_out_bytes_per_second"] == pytest.approx(3 * MIB)
    assert host.details["major_faults_per_second"] == pytest.approx(100)
    assert host.details["memory_pressure_some_ratio"] == pytest.approx(0.2)
    assert host.details["vm_swappiness"] == 60 and host.details["vm_dirty_ratio"] == 20
    # the process with most in swap: VmSwap averaged over the last minute (t = 120..180)
    assert host.details["pid"] == "4242"
    assert host.details["process_swap_bytes"] == pytest.approx(250 * MIB)
    assert "vm.swappiness=60" in host.description and "vm.dirty_ratio=20" in host.description
    # the rule's text, filled by the detector: the largest VmSwap of a watched process
    assert "with the most in swap holds 250MiB" in host.description

    process = only(findings, "HostSwapThrash", pid="4242")
    assert process.severity == "critical"
    assert process.labels == {"pid": "4242", "process_name": "vllm"}
    assert process.value == pytest.approx(250 * MIB) and process.threshold == 64 * MIB
    assert process.details["vm_swappiness"] == 60
    assert process.details["process_major_faults_per_second"] == pytest.approx(20)
    assert "vllm (pid 4242)" in process.summary and "VmSwap" in process.description


def test_swap_configured_but_unused_is_silent():
    trace = Trace()
    now = trace.run(T0, T0 + 180,
                    host_memory=lambda t: host_memory_rows(major_faults=3 * (t - T0)),
                    pressure=lambda t: pressure_rows(0.001 * (t - T0)),
                    process=lambda t: process_rows("4242", "vllm"))
    assert detector().evaluate(trace.history, now) == []


def test_one_way_swap_traffic_or_no_stall_is_silent():
    for host in (lambda t: thrashing_host(t, swap_in=0),            # only paging out
                 lambda t: thrashing_host(t, swap_out=0.5 * MIB),   # out below 1 MiB/s
                 lambda t: thrashing_host(t, major=10)):            # no major faults, no PSI
        trace = Trace()
        now = trace.run(T0, T0 + 180, host_memory=host,
                        pressure=lambda t: pressure_rows(0.01 * (t - T0)))
        assert detector().evaluate(trace.history, now) == []


def test_memory_pressure_stands_in_for_major_faults():
    trace = Trace()
    now = trace.run(T0, T0 + 180, host_memory=lambda t: thrashing_host(t, major=10),
                    pressure=lambda t: pressure_rows(0.15 * (t - T0)))
    (finding,) = detector().evaluate(trace.history, now)
    assert finding.labels == {} and finding.details["memory_pressure_some_ratio"] == pytest.approx(0.15)


def test_a_process_with_old_pages_in_swap_is_not_critical():
    trace = Trace()
    # 1 GiB in swap but not growing and no major faults: swapped out long ago, not hit now
    now = trace.run(T0, T0 + 180, host_memory=thrashing_host,
                    pressure=lambda t: pressure_rows(0.2 * (t - T0)),
                    process=lambda t: process_rows("4242", "vllm", swap=GIB))
    (finding,) = detector().evaluate(trace.history, now)
    assert finding.severity == "warning" and finding.details["process_swap_bytes"] == GIB


def test_a_major_faulting_process_is_critical_without_swap_growth():
    trace = Trace()
    now = trace.run(T0, T0 + 180, host_memory=thrashing_host,
                    pressure=lambda t: pressure_rows(0.2 * (t - T0)),
                    process=lambda t: process_rows("4242", "vllm", major_faults=15 * (t - T0)))
    process = only(detector().evaluate(trace.history, now), "HostSwapThrash", pid="4242")
    assert process.value == pytest.approx(15) and process.threshold == 10
    assert process.unit == "faults/s"
    # the value judged is the fault rate, but the text quotes the VmSwap, as the rule's $value does
    assert "0B in swap" in process.summary and "takes 15 major page faults/s" in process.description


def test_host_counter_reset_does_not_fake_thrash():
    trace = Trace()
    # the counters restart from 0 (e.g. a replayed trace from another boot) at t = 150
    now = trace.run(T0, T0 + 180,
                    host_memory=lambda t: host_memory_rows(
                        swap_in=5 * GIB if t < T0 + 150 else 0, swap_out=5 * GIB if t < T0 + 150
                        else 0, major_faults=1e6 if t < T0 + 150 else 0),
                    pressure=lambda t: pressure_rows(0.01 * (t - T0)))
    assert detector().evaluate(trace.history, now) == []


def test_a_restarted_process_under_a_new_pid_is_judged_on_its_own():
    trace = Trace()
    now = trace.run(T0, T0 + 180, host_memory=thrashing_host,
                    pressure=lambda t: pressure_rows(0.2 * (t - T0)),
                    process=lambda t: process_rows("4242", "vllm", swap=GIB + MIB * (t - T0))
                    if t < T0 + 100 else process_rows("5000", "vllm", major_faults=30 * (t - T0)))
    findings = detector().evaluate(trace.history, now)
    assert [f.labels.get("pid") for f in findings if f.severity == "critical"] == ["5000"]


# --- its rule's promtool cases ------------------------------------------------------------------


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
