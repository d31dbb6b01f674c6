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
