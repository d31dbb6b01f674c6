"""The tests of the swap_thrash alert family (agent/alerts/swap_thrash.py): its detector, on
histories written sample by sample, and its rule's promtool cases (`promtool_cases`, written
to rules/tests/generated_swap_thrash.yml by `python -m tests.rules.generate` and run by
promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

import pytest

from hybridmon.agent.alerts.swap_thrash import Detector
from hybridmon.exporters.faulting_processes import MAJOR_FAULT_RATE
from hybridmon.exporters.host_memory import ZSWAP_IN_BYTES, ZSWAP_OUT_BYTES
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

BATCH = {"pid": "7001", "process_name": "batch_job"}  # an unwatched process


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


def zswap_thrashing_host(t, *, device=0.4e6, zswap=30e6, major=7600.0):
    """The issue's host: pswpin/pswpout under 0.5 MB/s, zswpin/zswpout ~30 MB/s, ~7,600 major
    faults/s (30 MB/s of 4 KiB pages is 7,324 swap-ins/s, each a major fault in do_swap_page)."""
    s = t - T0
    return host_memory_rows(swap_in=device * s, swap_out=device * s, major_faults=major * s) + [
        (ZSWAP_IN_BYTES, zswap * s), (ZSWAP_OUT_BYTES, zswap * s)]


def scan(*processes):
    """The faulting_processes collector's rows: (pid, name, major faults/s) each."""
    return lambda t: [(MAJOR_FAULT_RATE, rate, pid, name) for pid, name, rate in processes]


def test_zswap_thrash_fires_and_names_the_unwatched_process():
    trace = Trace()
    now = trace.run(T0, T0 + 180, host_memory=zswap_thrashing_host,
                    pressure=lambda t: pressure_rows(0.3 * (t - T0)),
                    process=lambda t: process_rows("4242", "vllm", swap=GIB),
                    faulting_processes=scan(("7001", "batch_job", 7400.0), ("4242", "vllm", 12.0)))
    # vLLM: 1 GiB in swap that does not grow, no major fault in its own counters: not critical
    (host,) = detector().evaluate(trace.history, now)
    assert host.labels == {} and host.severity == "warning"
    assert host.value == pytest.approx(30.4e6)
    assert host.details["zswap_in_bytes_per_second"] == pytest.approx(30e6)
    assert host.details["top_faulting_pid"] == "7001"
    assert host.details["top_faulting_process_name"] == "batch_job"
    assert ("Processes taking the most major faults, watched or not: batch_job (pid 7001, 7.4k/s), "
            "vllm (pid 4242, 12/s).") in host.description
    assert "unknown" not in host.description


def test_zswap_thrash_without_device_traffic_was_missed_by_device_counters_alone():
    """Without zswap the same host's swap device traffic (0.4 MB/s) is below the threshold: the
    zswap counters are what make it fire."""
    trace = Trace()
    now = trace.run(T0, T0 + 180, host_memory=lambda t: zswap_thrashing_host(t, zswap=0.0),
                    pressure=lambda t: pressure_rows(0.3 * (t - T0)))
    assert detector().evaluate(trace.history, now) == []


def test_healthy_zswap_traffic_is_silent():
    trace = Trace()
    now = trace.run(T0, T0 + 180,
                    host_memory=lambda t: zswap_thrashing_host(t, device=0.0, zswap=200e3, major=60.0),
                    pressure=lambda t: pressure_rows(0.002 * (t - T0)))
    assert detector().evaluate(trace.history, now) == []


def test_a_watched_process_that_does_not_fault_is_not_blamed():
    """VmSwap above 64 MiB and growing, but no major fault: the kernel moves its cold pages out and
    it never reads them back. Not critical; the host names who does fault."""
    trace = Trace()
    now = trace.run(T0, T0 + 180, host_memory=zswap_thrashing_host,
                    pressure=lambda t: pressure_rows(0.3 * (t - T0)),
                    process=lambda t: process_rows("4242", "vllm", swap=100 * MIB + MIB * (t - T0)),
                    faulting_processes=scan(("7001", "batch_job", 7400.0)))
    findings = detector().evaluate(trace.history, now)
    assert [f.severity for f in findings] == ["warning"]
    assert "batch_job (pid 7001, 7.4k/s)" in findings[0].description


def test_no_scan_names_none_and_an_old_scan_is_not_current():
    trace = Trace()
    now = trace.run(T0, T0 + 180, host_memory=zswap_thrashing_host,
                    pressure=lambda t: pressure_rows(0.3 * (t - T0)))
    (host,) = detector().evaluate(trace.history, now)
    assert "watched or not: none." in host.description and "top_faulting_pid" not in host.details
    trace.commit("faulting_processes", now - 120, scan(("7001", "batch_job", 7400.0))(now))
    (host,) = detector().evaluate(trace.history, now)
    assert "watched or not: none." in host.description


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
    # the faulting_processes collector's scan, from the onset: llama-server, then an unwatched job
    test.gauge(MAJOR_FAULT_RATE.name, None, many, **LLAMA)
    test.gauge(MAJOR_FAULT_RATE.name, None, many / 2, **BATCH)
    # the 1 min average is the sample 30 s back: sample k after the onset is at ONSET + 15 s (k + 1)
    swapped = start + growth * ((at - 30 - ONSET) // STEP - 1)
    settings = {"swappiness": 60, "dirty_ratio": 20}
    host = {"swap_in": swap_in, "swap_out": swap_out}
    test.expect(not_yet(s.for_seconds), "HostSwapThrash")
    test.expect(at, "HostSwapThrash",
                test.alert(warning, {}, value=swap_in, swap_out=swap_out, major_faults=major,
                           pressure=pressure, most_swapped=swapped, **settings,
                           faulting=(("llama-server", "5151", many), ("batch_job", "7001", many / 2))),
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
        most_swapped=0, swappiness=60, dirty_ratio=20, faulting=()))
    return test


def zswap_thrash(t, catalog) -> Test:
    """The issue's host: the swap device almost idle, zswap carrying the thrash."""
    s = t.swap_thrash
    warning = catalog.find("HostSwapThrash", "warning")
    at = firing(s.for_seconds)
    test = Test("swap thrash through zswap: pswpin/pswpout at a quarter of the threshold, zswpin and "
                "zswpout far above it; the host warns and names the unwatched batch job that "
                "faults; python3 (pid 4242, no major faults) is not critical", at + 120, catalog)
    device, zswap = s.swap_in_bytes_per_second / 4, 30 * s.swap_in_bytes_per_second
    major, pressure = 150 * s.major_faults_per_second, above(s.memory_pressure_some_ratio)
    host_memory(test, device, device, major, pressure)
    test.counter(ZSWAP_IN_BYTES.name, 0, zswap)
    test.counter(ZSWAP_OUT_BYTES.name, 0, zswap)
    test.constant(PROCESS_SWAP.name, 0, **VLLM)
    test.constant(PROCESS_MAJOR_FAULTS.name, 0, **VLLM)
    rate = major * 0.95
    test.gauge(MAJOR_FAULT_RATE.name, None, rate, **BATCH)
    test.expect(not_yet(s.for_seconds), "HostSwapThrash")
    test.expect(at, "HostSwapThrash", test.alert(
        warning, {}, value=device + zswap, swap_out=device + zswap, major_faults=major, pressure=pressure,
        most_swapped=0, swappiness=60, dirty_ratio=20, faulting=(("batch_job", "7001", rate),)))
    return test


def no_thrash(t, catalog) -> Test:
    s = t.swap_thrash
    at = firing(s.for_seconds)
    test = Test("no swap thrash: swap configured but barely used on gpu-host-1 (zswap in and out at "
                "a fifth of the threshold); swap-out alone (no swap-in) under pressure on "
                "gpu-host-2", at + 120, catalog)
    host_memory(test, 0, 0, s.major_faults_per_second / 2, 0)
    test.counter(ZSWAP_IN_BYTES.name, 0, s.swap_in_bytes_per_second / 5)
    test.counter(ZSWAP_OUT_BYTES.name, 0, s.swap_out_bytes_per_second / 5)
    host_memory(test, 0, 2 * s.swap_out_bytes_per_second, 2 * s.major_faults_per_second,
                above(s.memory_pressure_some_ratio), HOST2)
    test.constant(PROCESS_SWAP.name, 0, **VLLM)
    test.constant(PROCESS_MAJOR_FAULTS.name, 0, **VLLM)
    test.expect(at, "HostSwapThrash")
    return test


def promtool_cases(t, catalog) -> list[Test]:
    return [thrash_with_faults(t, catalog), thrash_with_pressure(t, catalog), zswap_thrash(t, catalog),
            no_thrash(t, catalog)]
