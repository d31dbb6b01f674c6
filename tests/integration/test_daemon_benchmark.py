"""benchmarks/daemon_long_run.py, the daemon's cost of record, runs its --quick path on both driver
paths (shortened further here: seconds, not minutes) and writes the figures issue 33 asks for."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("pcie_path, sampler_threads", [("counters", 0), ("samplers", 2)])
def test_quick_run_measures_the_daemon_on_each_driver_path(tmp_path, pcie_path, sampler_threads):
    out = tmp_path / "run.json"
    command = [sys.executable, "benchmarks/daemon_long_run.py", "--quick", "--minutes", "0.1",
               "--warmup-seconds", "2", "--history-minutes", "1", "--gpus", "2", "--processes", "2",
               "--pcie-path", pcie_path, "--json-out", str(out)]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["pcie_path"] == pcie_path
    assert result["pcie_sampler_threads"] == sampler_threads  # the fake driver really differs
    assert 0 < result["cpu_percent_of_core"] < 100
    assert result["rss_bytes"] > 20 * 2**20
    assert result["history_minutes_filled"] == 1 and result["warmup_seconds"] == 2
    assert len(result["load_average"]["at_start"]) == 3
    assert result["command"].endswith(f"--json-out {out}")
    assert result["machine"]["cpus"] >= 1
    assert "CPU % core" in run.stdout  # the table


def test_nvml_stub_runs_the_real_binding_over_the_stub_library(tmp_path):
    """--nvml stub: the daemon's environment loads nvidia-ml-py (not the fake) over the stub built
    for the benchmark's own 8-GPU host, each throughput call blocking 20 ms; the daemon's
    configuration takes HYBRIDMON_STUB_NVML_LAYOUT for the library's, not for a setting; the
    counters path is taken too (the stub's counters advance). No daemon is started here: the
    figures are docs/performance.md's."""
    from benchmarks import daemon_long_run
    from benchmarks.agent_bench_curve import build_sized_host
    from hybridmon.agent.config import load_config
    from tests.support.stub_nvml import build

    host = build_sized_host(tmp_path / "host", 8, 16)
    try:
        env = daemon_long_run.stub_nvml_environment(Path(host.layout), tmp_path)
    except build.StubUnavailable as error:
        pytest.fail(f"the stub cannot be built here: {error}")
    assert env["HYBRIDMON_GPU__NVML_MODULE"] == "pynvml"
    assert (Path(env["LD_LIBRARY_PATH"]) / build.LIBRARY_NAME).is_file()
    assert (Path(env["PYTHONPATH"].split(":")[0]) / "pynvml.py").is_file()
    layout = Path(env["HYBRIDMON_STUB_NVML_LAYOUT"]).read_text().splitlines()
    assert layout.count("gpu") == 8 and f"pcie_window_us {build.PCIE_WINDOW_US}" in layout
    assert load_config(environ=env).gpu.nvml_module == "pynvml"
    assert daemon_long_run.parse_arguments(["--nvml", "stub", "--pcie-path", "counters"]).nvml == "stub"
