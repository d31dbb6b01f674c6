"""What each watched process costs on /metrics (issue 33 part 4), counted on the agent's own output.

The scaled host (8 GPUs, two NUMA nodes: benchmarks/series_per_host.py, which counts a host's
series for docs/performance.md) with N and N + K watched processes, every collector run until the
per-process NUMA collector has read each process once: the series the K more add, divided by K,
are what one more watched process costs. The K added are CPU-side processes (no GPU context), as
the sized host builds them; its first 16 hold memory on its GPUs, 2 on each, and cost besides
their NUMA placement against their GPU's node (2 series a GPU node, process_numa) and the gpu
collector's hybridmon_gpu_process_memory_used_bytes, 1 a GPU (NVML lists it whether or not the
process is watched).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from benchmarks.series_per_host import expositions, series_by_metric, series_by_pid
from hybridmon.agent.alerts.catalogue import FAMILIES
from hybridmon.exporters import gpu, numa, process

REPO = Path(__file__).resolve().parents[2]
GPUS, N, K = 8, 16, 4     # the sized host's first 16 processes are on its GPUs
NUMA_NODES = 2            # the fixture host's
PROCESS_BUDGET = 12       # [process] detail_series off: issue 33's series a watched process
# CPU time and resident memory off each GPU node of the process, InferenceProcessNumaMisplaced's
PLACEMENT = (numa.PROCESS_CPU_SECONDS_OFF_GPU_NODE.name, numa.PROCESS_RESIDENT_OFF_GPU_NODE.name)


def per_added_process(tmp_path: Path, detail_series: bool) -> dict[str, float]:
    before, _ = series_by_metric(tmp_path / "n", GPUS, N, detail_series)
    after, _ = series_by_metric(tmp_path / "n+k", GPUS, N + K, detail_series)
    return {name: (after[name] - before[name]) / K for name in after if after[name] != before[name]}


def test_a_watched_process_costs_at_most_12_series_process_numa_included(tmp_path):
    added = per_added_process(tmp_path, detail_series=False)
    assert sum(added.values()) <= PROCESS_BUDGET, added
    assert not [name for name in added if name in PLACEMENT], added  # on no GPU: no placement to judge
    assert sum(added.values()) == 10, added   # docs/performance.md says so


def test_a_process_on_a_gpu_of_the_2_node_host_costs_12_series_process_numa_included(tmp_path):
    samples, _ = expositions(tmp_path, GPUS, N)
    by_pid = series_by_pid(samples)
    on_gpus = {pid for pid, series in by_pid.items() if series[gpu.PROCESS_MEMORY_USED.name]}
    assert len(on_gpus) == N, by_pid   # the sized host's first 16, 2 on each GPU
    for pid in on_gpus:
        series = by_pid[pid]
        # each is on one GPU, so against one node: its CPU time and resident memory off it
        assert [series[name] for name in PLACEMENT] == [1, 1], (pid, series)
        own = {name: count for name, count in series.items() if not name.startswith("hybridmon_gpu_")}
        assert sum(own.values()) <= PROCESS_BUDGET and sum(own.values()) == 12, (pid, own)
        # and the gpu collector's, 1 a GPU it is on, which NVML lists whether it is watched or not
        assert {name: count for name, count in series.items() if name not in own} == {
            gpu.PROCESS_MEMORY_USED.name: 1}, (pid, series)
    assert sum(by_pid[pid][name] for pid in by_pid for name in PLACEMENT) == 2 * N


def test_detail_series_adds_only_the_series_nothing_reads(tmp_path):
    added = per_added_process(tmp_path, detail_series=True)
    default = per_added_process(tmp_path / "default", detail_series=False)
    # the fixture's processes are in no cgroup with a memory limit: no cgroup_memory_limit here,
    # and the added processes are on no GPU: no process_numa detail either
    assert {name: added[name] - default.get(name, 0) for name in added if added[name] != default.get(name)} == {
        process.THREADS.name: 1, process.ALLOWED_CPUS.name: 1}


DETAIL = (*process.DETAIL_SPECS, numa.PROCESS_ALLOWED_CPUS_ON_NODE, numa.PROCESS_CPU_SECONDS_ON_NODE,
          numa.PROCESS_NUMA_RESIDENT, numa.PROCESS_NUMA_MAPS_READ)
# Named in an alert's text where exported, as context that the text leaves out without it (the
# NUMA alert's allowed CPUs: it judges where a process runs, not where it may).
CONTEXT_IN_TEXT = {process.ALLOWED_CPUS.name}


@pytest.mark.parametrize("spec", DETAIL, ids=lambda spec: spec.name)
def test_no_alert_dashboard_or_status_page_reads_a_detail_series(spec):
    assert not [family.section for family in FAMILIES if spec in family.inputs]
    for shipped in (REPO / "dashboards/json").glob("*.json"):
        assert spec.name not in shipped.read_text(), shipped
    for rule_file in (REPO / "rules").glob("*.yml"):
        for group in yaml.safe_load(rule_file.read_text())["groups"]:
            for rule in group["rules"]:
                assert spec.name not in rule["expr"], (rule_file, rule.get("alert") or rule.get("record"))
                text = " ".join(rule.get("annotations", {}).values())
                if spec.name in text:
                    assert spec.name in CONTEXT_IN_TEXT, (rule_file, rule.get("alert"))
                    # the clause that names it is left out when the query finds nothing
                    assert re.search(r"\{\{ if printf `" + re.escape(spec.name), text), rule.get("alert")
    for code in (REPO / "agent/status").rglob("*.py"):
        text = code.read_text()
        assert spec.name not in text and not re.search(rf"\b{re.escape(_constant(spec))}\b", text), code


def _constant(spec) -> str:
    """The name the exporter module gives the spec (THREADS, PROCESS_NUMA_MAPS_READ, ...)."""
    for module in (process, numa):
        for name, value in vars(module).items():
            if value is spec and name.isupper():
                return name
    raise LookupError(spec.name)
