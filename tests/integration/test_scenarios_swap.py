"""The issue-28 swap scenarios (tests/support/scenarios/swap_library.py) and the older swap_thrash
tell their stories in the trace: zswap traffic read back through the real collectors, the
faulting processes named (watched or not) only while the host swaps in, and the finding the
detector draws from them. test_detection.py checks which alerts fire and when; this checks who
is named and who is not, and what the scan costs."""
from __future__ import annotations

import gzip
import json

import pytest

from hybridmon.agent.alerts.catalogue import load_thresholds
from hybridmon.agent.alerts.swap_thrash import Detector
from hybridmon.exporters.faulting_processes import MAJOR_FAULT_RATE
from hybridmon.exporters.host_memory import SWAP_IN_BYTES, ZSWAP_IN_BYTES, ZSWAP_OUT_BYTES
from tests.support.scenario_traces import one, rate
from tests.support.scenarios import START_TIME
from tests.support.scenarios.library import VLLM
from tests.support.scenarios.swap_library import BATCH, BATCH_NAME

THRESHOLDS = load_thresholds()


def findings_at(history, t: float):
    """The detector's findings at t, the trace's last tick: the names come from the faulting
    processes' last scan, which is the trace's last one."""
    return Detector(THRESHOLDS.swap_thrash).evaluate(history, START_TIME + t)


def process_reads(path) -> dict[str, int]:
    """Per collector run time: how many /proc/<pid>/stat files faulting_processes read."""
    reads = {}
    with gzip.open(path, "rt") as lines:
        for line in lines:
            record = json.loads(line)
            if record.get("kind") == "reading" and record["collector"] == "faulting_processes":
                reads[record["time"] - START_TIME] = sum(
                    1 for kind, key, _, _ in record["readings"] if kind == "text" and key.endswith("/stat"))
    return reads


def test_zswap_thrash_is_counted_and_its_batch_job_named(scenarios):
    history = scenarios.replayed("zswap_thrash").history
    assert rate(one(history, ZSWAP_IN_BYTES.name), 180, 240) == pytest.approx(30e6, rel=0.05)
    assert rate(one(history, ZSWAP_OUT_BYTES.name), 180, 240) == pytest.approx(30.6e6, rel=0.05)
    assert rate(one(history, SWAP_IN_BYTES.name), 180, 240) < 0.5e6  # what the device alone shows
    (host,) = findings_at(history, 360)
    assert host.labels == {} and host.severity == "warning"
    assert host.details["top_faulting_pid"] == str(BATCH)
    assert host.details["top_faulting_process_name"] == BATCH_NAME
    assert host.details["top_faulting_major_faults_per_second"] == pytest.approx(7400, rel=0.05)
    assert f"watched or not: {BATCH_NAME} (pid {BATCH}, 7." in host.description
    # vLLM's VmSwap grew by 512 MiB, but it took no major fault: never named, never critical
    assert f"(pid {VLLM}," not in host.description
    assert "unknown" not in host.description


def test_the_scan_runs_only_while_the_host_swaps_in(scenarios):
    reads = process_reads(scenarios.summary("zswap_thrash").path)
    assert reads and all(count == 0 for t, count in reads.items() if t < 60)   # before onset: nothing
    assert all(count >= 4 for t, count in reads.items() if t >= 70)           # every process, from then
    quiet = process_reads(scenarios.summary("healthy_zswap_light").path)
    assert quiet and set(quiet.values()) == {0}                                # a quiet host pays nothing
    history = scenarios.replayed("healthy_zswap_light").history
    assert rate(one(history, ZSWAP_IN_BYTES.name), 60, 300) == pytest.approx(150e3, rel=0.05)
    assert history.series(MAJOR_FAULT_RATE.name) == []
    assert findings_at(history, 300) == []


def test_swap_thrash_names_vllm_as_it_faults(scenarios):
    """The older scenario, through the device: the scan names vLLM (~150 faults/s), the only
    process of the fixture host that faults; its per-process critical is unchanged."""
    findings = findings_at(scenarios.replayed("swap_thrash").history, 600)
    host = next(f for f in findings if not f.labels)
    assert host.details["top_faulting_pid"] == str(VLLM)
    assert host.details["top_faulting_major_faults_per_second"] == pytest.approx(150, rel=0.1)
    assert [f.labels["pid"] for f in findings if f.labels] == [str(VLLM)]
