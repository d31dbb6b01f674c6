"""What each watched process costs on /metrics (issue 33 part 4), counted on the agent's own output.

The scaled host (8 GPUs, two NUMA nodes: benchmarks/series_per_host.py, which counts a host's
series for docs/performance.md) with N and N + K watched processes, every collector run until the
per-process NUMA collector has read each process once: the series the K more add, divided by K,
are what one more watched process costs. The K added are CPU-side processes (no GPU context), as
the sized host builds them; its first 16 hold memory on its GPUs, 2 on each, and cost besides
their NUMA placement (2 series a node, process_numa) and one hybridmon_gpu_process_memory_used_bytes
per GPU.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.series_per_host import series_by_metric
from hybridmon.agent.alerts.catalogue import FAMILIES
from hybridmon.exporters import numa, process

REPO = Path(__file__).resolve().parents[2]
GPUS, N, K = 8, 16, 4     # the sized host's first 16 processes are on its GPUs
NUMA_NODES = 2            # the fixture host's
PROCESS_BUDGET = 12       # [process] detail_series off: issue 33's series a watched process
NUMA_SERIES_PER_NODE = 2  # CPU time and resident memory on each node, InferenceProcessNumaMisplaced's
PLACEMENT = (numa.PROCESS_CPU_SECONDS_ON_NODE.name, numa.PROCESS_NUMA_RESIDENT.name)


def per_added_process(tmp_path: Path, detail_series: bool) -> dict[str, float]:
    before, _ = series_by_metric(tmp_path / "n", GPUS, N, detail_series)
    after, _ = series_by_metric(tmp_path / "n+k", GPUS, N + K, detail_series)
    return {name: (after[name] - before[name]) / K for name in after if after[name] != before[name]}


def test_a_watched_process_costs_at_most_12_series_process_numa_included(tmp_path):
    added = per_added_process(tmp_path, detail_series=False)
    assert sum(added.values()) <= PROCESS_BUDGET, added
    assert not [name for name in added if name in PLACEMENT], added  # on no GPU: no placement to judge
    assert sum(added.values()) == 11, added   # docs/performance.md says so


def test_a_process_on_gpus_adds_its_placement_2_series_a_numa_node(tmp_path):
    series, _ = series_by_metric(tmp_path, GPUS, N)
    assert sum(series[name] for name in PLACEMENT) == N * NUMA_SERIES_PER_NODE * NUMA_NODES, series


def test_detail_series_adds_only_the_series_nothing_reads(tmp_path):
    added = per_added_process(tmp_path, detail_series=True)
    default = per_added_process(tmp_path / "default", detail_series=False)
    # the fixture's processes are in no cgroup with a memory limit: no cgroup_memory_limit here,
    # and the added processes are on no GPU: no process_numa detail either
    assert {name: added[name] - default.get(name, 0) for name in added if added[name] != default.get(name)} == {
        process.THREADS.name: 1}


DETAIL = (*process.DETAIL_SPECS, numa.PROCESS_ALLOWED_CPUS_ON_NODE, numa.PROCESS_NUMA_MAPS_READ)


@pytest.mark.parametrize("spec", DETAIL, ids=lambda spec: spec.name)
def test_no_alert_dashboard_or_status_page_reads_a_detail_series(spec):
    assert not [family.section for family in FAMILIES if spec in family.inputs]
    for shipped in [*(REPO / "dashboards/json").glob("*.json"), *(REPO / "rules").glob("*.yml")]:
        assert spec.name not in shipped.read_text(), shipped
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
