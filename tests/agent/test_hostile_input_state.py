"""Hostile state files (issue 11, items 11 and 16): a stored benchmark run nested 100,000 deep,
too large, not UTF-8 or holding numbers no run has, read by the bench collector, by `hybridmon
budget` and by the store; and property tests that the state-file readers raise nothing but
ReportError on any text."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmon.agent.commands import budget
from hybridmon.agent.bench.runner import BenchRunner
from hybridmon.exporters import bench_report
from hybridmon.exporters.bench_report import ReportError
from hybridmon.exporters.bench_runs import MAX_STORED_RUN_BYTES, load_latest, parse_stored_run
from hybridmon.exporters.sources import LiveSource
from hybridmon.exporters.bench import BenchCollector
from tests.support.agent_helpers import REPO
from tests.support.bench_helpers import fake_binary, stored_run_text
from tests.support.paths import FIXTURE_HOST
from tests.support.fake_nvml import FakeNvml, default_gpus

NESTED = "[" * 100_000 + "]" * 100_000
SECOND_GPU = "0000:ca:00.0"


@pytest.fixture(scope="module")
def benchmarked_state(tmp_path_factory) -> Path:
    """A state directory after a benchmark of GPU 0 (0000:17:00.0) with the stand-in binary."""
    directory = tmp_path_factory.mktemp("benchmarked")
    nvml = FakeNvml()
    gpus = default_gpus()
    for gpu in gpus:
        gpu.processes, gpu.utilization_percent = [], 0
    nvml.configure(gpus=gpus)
    BenchRunner(fake_binary(directory), directory / "state", nvml_module=nvml,
                sysfs=str(FIXTURE_HOST / "sys")).run_gpu(0)
    return directory / "state"


@pytest.fixture
def state(benchmarked_state, tmp_path) -> Path:
    """A copy of benchmarked_state for one test to spoil."""
    return Path(shutil.copytree(benchmarked_state, tmp_path / "state"))


def good_run(state: Path) -> dict:
    return json.loads((state / "bench" / "latest" / "0000:17:00.0.json").read_text())


HOSTILE_FILES = {
    "nested": NESTED.encode(),
    "nested inside a valid run": None,  # built from the good run below
    "not UTF-8": b'{"format": 1, "gpu": {"name": "\xff"}}',
    "too large": b" " * (MAX_STORED_RUN_BYTES + 1),
    "finished_at 1e308": None,
    "link width 10**400": None,
}


def hostile_file(name: str, state: Path) -> bytes:
    """The file named in HOSTILE_FILES, as GPU 1's latest run."""
    data = HOSTILE_FILES[name]
    if data is not None:
        return data
    run = good_run(state)
    run["gpu"]["pci_bus_id"] = SECOND_GPU
    if name == "nested inside a valid run":
        run["placements"][0]["report"]["device"]["name"] = json.loads("[" * 500 + "]" * 500)
    elif name == "finished_at 1e308":
        run["finished_at"] = 1e308
    else:  # float(10**400) overflows where the link capacity is computed
        run["link"]["width"] = 10**400
    return json.dumps(run).encode()


@pytest.mark.slow
@pytest.mark.parametrize("name", HOSTILE_FILES)
def test_a_hostile_stored_run_costs_only_its_own_gpu_series(state, name, caplog):
    """The old collector let RecursionError (nested) and OverflowError (width) out of collect(), so
    every GPU's bench series went absent; it exported finished_at 1e308 as a timestamp; its store
    let UnicodeDecodeError out of load_latest. Too large and nested 500 deep are refused now."""
    bad = state / "bench" / "latest" / f"{SECOND_GPU}.json"
    bad.write_bytes(hostile_file(name, state))
    samples = BenchCollector(LiveSource(), state).collect()
    assert samples.find("hybridmon_bench_timestamp_seconds", gpu="0")
    assert not samples.find("hybridmon_bench_timestamp_seconds", gpu="1")
    assert any(f"ignoring benchmark result {bad}" in m for m in caplog.messages)
    runs, problems = load_latest(state)
    assert [run.gpu_index for run in runs] == [0]
    assert len(problems) == 1 and problems[0].startswith(f"{bad}: ")


def budget_cli(state: Path) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDMON_")}
    environment.update(PYTHONPATH=str(REPO), HYBRIDMON_STATE_DIR=str(state))
    return subprocess.run([sys.executable, "-m", "hybridmon.agent.cli", "budget", "--model", "llama-3-8b",
                           "--context", "12000"], capture_output=True, text=True, env=environment,
                          timeout=60, cwd=REPO)


@pytest.mark.slow
def test_budget_reports_a_corrupt_stored_result_with_its_path_not_as_unmeasured(state):
    """The old `budget` crashed with a RecursionError traceback on a nested file, and called a
    merely broken one "run `hybridmon bench`" as if nothing had been measured."""
    bad = state / "bench" / "latest" / "0000:17:00.0.json"
    bad.write_text(NESTED)
    nested = budget_cli(state)
    bad.write_text('{"format": 1, "gpu"')
    cut_off = budget_cli(state)
    for result, why in ((nested, "JSON nested deeper than 64 levels"), (cut_off, "stored run is not JSON")):
        assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
        assert f"stored benchmark result corrupt or unreadable: {bad}: " in result.stderr
        assert why in result.stderr and "or pass --bandwidth" in result.stderr
    with pytest.raises(budget.StoredResultError, match="corrupt or unreadable"):
        budget.measured_bandwidth(state)


def test_a_nested_hugging_face_config_json_is_a_budget_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(NESTED)
    with pytest.raises(budget.BudgetError, match="nested deeper than 64 levels; expected a Hugging Face config.json"):
        budget.load_config_json(path)


# --- properties: any text ------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20)


@st.composite
def mutated_runs(draw) -> str:
    """A valid stored run with one value anywhere in it replaced by arbitrary JSON."""
    run = json.loads(STORED_RUN_TEXT)
    node, path = run, []
    while isinstance(node, (dict, list)) and node and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
        path.append(key)
        node = node[key]
    replacement = draw(json_values | st.sampled_from(
        [1e308, -1e308, 10**30, 2**53 + 1, -2, "", [], {}, json.loads("[" * 80 + "]" * 80)]))
    if not path:
        return json.dumps(replacement)
    parent = run
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = replacement
    return json.dumps(run)


STORED_RUN_TEXT = stored_run_text()


def test_the_property_test_seed_is_a_valid_stored_run():
    assert parse_stored_run(STORED_RUN_TEXT).reports["local"].results


def collect_one(tmp_path_factory, text: str):
    state = tmp_path_factory.mktemp("state")
    latest = state / "bench" / "latest"
    latest.mkdir(parents=True)
    (latest / "0000:17:00.0.json").write_text(text)
    return BenchCollector(LiveSource(), state).collect(), load_latest(state)


@settings(max_examples=100, deadline=None)
@given(st.one_of(mutated_runs(), json_values.map(json.dumps), st.text(max_size=200),
                 st.integers(0, 3000).map(lambda depth: "{\"a\":" * depth + "1" + "}" * depth)))
def test_state_file_readers_raise_only_report_error_and_export_only_finite_values(tmp_path_factory, text):
    for parse in (bench_report.parse_report, bench_report.parse_error, parse_stored_run):
        try:
            parse(text)
        except ReportError:
            pass
    bench_report.parse_progress(text)
    samples, (runs, problems) = collect_one(tmp_path_factory, text)
    assert len(runs) + len(problems) == 1
    for sample in samples:
        assert sample.value is None or (sample.value == sample.value and abs(sample.value) < float("inf"))
