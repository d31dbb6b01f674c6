"""scripts/validate-gpu: on a host without a GPU it must say so at once and exit 3, never start the
agent, the benchmark or a build; its verdict (agent/bench/validation.py and the script's reference
method) is driven here with canned figures and a modelled link. Its GPU path has not run on
hardware here (docs/performance.md)."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridmon.agent.bench.validation import (EXIT_FAILED, EXIT_PASSED, Check, PcieSampling, bench_checks, exit_status,
                                              inner_mean, nvml_checks, report)
from tests.support.agent_helpers import REPO

SCRIPT = REPO / "scripts" / "validate-gpu"


def test_without_a_gpu_it_exits_3_quickly_with_the_reason(tmp_path):
    if Path("/dev/nvidia0").exists() or Path("/proc/driver/nvidia/gpus").exists():
        pytest.skip("a GPU host: the script would validate it for real")
    assert os.access(SCRIPT, os.X_OK)
    marker = tmp_path / "nvcc-ran"
    (tmp_path / "nvcc").write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    (tmp_path / "nvcc").chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "PYTHONPATH": str(REPO),
           "HYBRIDMON_GPU__NVML_MODULE": "pynvml"}
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.startswith("validate-gpu: no NVIDIA GPU on this host: NVIDIA driver not found")
    assert proc.stdout == "" and not marker.exists()



# --- the verdict (agent/bench/validation.py), driven with canned figures ------------------------

def load_script():
    """scripts/validate-gpu as a module (it has no .py suffix); its main() is not run."""
    loader = importlib.machinery.SourceFileLoader("validate_gpu", str(SCRIPT))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("validate_gpu", loader))
    loader.exec_module(module)
    return module


def test_a_figure_passes_within_5_percent_of_its_reference_and_fails_beyond():
    assert Check("h2d", 26.0 * 1.049, 26.0).passed and Check("h2d", 26.0 * 0.951, 26.0).passed
    assert not Check("h2d", 26.0 * 1.051, 26.0).passed and not Check("h2d", 26.0 * 0.949, 26.0).passed
    assert Check("h2d", 25.0, 26.0).line() == "PASS  h2d: 25.00 against 26.00 GB/s (-3.8%, tolerance 5%)"
    assert Check("h2d", None, 26.0).line() == "FAIL  h2d: no measured figure"


def test_the_bench_against_the_reference_fails_a_figure_off_by_more_than_5_percent_or_missing():
    reference = {"h2d": 26.0, "d2h": 26.2, "h2d_bidirectional": 12.5, "d2h_bidirectional": 24.0}
    bench = {"h2d": 25.9, "d2h": 26.4, "h2d_bidirectional": 16.5, "d2h_bidirectional": 24.1}
    checks = bench_checks(bench, reference, "PyTorch", 268435456)
    assert [check.passed for check in checks] == [True, True, False, True]
    assert checks[2].line() == ("FAIL  bench h2d_bidirectional vs PyTorch (268,435,456 B): 16.50 against "
                                "12.50 GB/s (+32.0%, tolerance 5%)")
    assert exit_status(checks) == EXIT_FAILED == 1
    assert exit_status(checks[:2] + checks[3:]) == EXIT_PASSED == 0
    # Without a reference library nothing was compared: every bench check fails, saying why.
    unchecked = bench_checks(bench, None, "", 268435456)
    assert not any(check.passed for check in unchecked) and exit_status(unchecked) == 1
    assert "neither PyTorch nor CuPy imports" in unchecked[0].line()
    assert exit_status([]) == 1 and report([]).endswith("verdict: FAIL (0 of 0 checks)")


def test_the_agents_pcie_readings_are_judged_against_the_bytes_moved_each_way():
    moved, seconds = 78 * 512 * 2**20, 3.0  # 13.6 GB/s
    rate = moved / seconds
    counted = PcieSampling("host_to_device", moved, seconds, counter_bytes=int(moved * 1.02),
                           throughput=(0.2 * rate, rate * 0.99, rate * 1.01, rate, 0.4 * rate))
    checks = nvml_checks([counted])
    assert [(check.name, check.passed) for check in checks] == [
        ("agent PCIe byte counter, host_to_device", True), ("agent PCIe throughput gauge, host_to_device", True)]
    # The edge readings (NVML's 20 ms windows half idle) are left out of the mean: with them it fails.
    assert inner_mean(counted.throughput) == pytest.approx(rate)
    assert not Check("all readings", sum(counted.throughput) / 5, rate).passed
    # No usable counters on the GPU: only the gauge, which the agent then uses, is judged.
    uncounted = PcieSampling("device_to_host", moved, seconds, None, (rate * 0.9,) * 5)
    (gauge,) = nvml_checks([uncounted])
    assert not gauge.passed and gauge.difference == pytest.approx(-0.10)
    # A counter that counts the copy twice (or misses half) fails like any other figure.
    doubled = PcieSampling("device_to_host", moved, seconds, 2 * moved, (rate,) * 5)
    assert [check.passed for check in nvml_checks([doubled])] == [False, True]
    assert "verdict: FAIL (2 of 5 checks)" in report(nvml_checks([counted, doubled]) + [gauge])


class ModelLink:
    """Copies over a modelled Gen4 x16 link (figures from issue 29, not measured): each direction
    alone at 25 GB/s; both at once, host->device 12.5 and device->host 24. Streams start together
    in the order given; `timed` returns each stream's seconds, as the script's CUDA copies do."""

    ALONE, TOGETHER = 25e9, {"h2d": 12.5e9, "d2h": 24e9}

    def buffers(self, size: int):
        return size, size

    def timed(self, pairs):
        remaining = {direction: host * copies for direction, host, _device, copies in pairs}
        now, finished = 0.0, {}
        while remaining:
            rates = ({direction: self.TOGETHER[direction] for direction in remaining} if len(remaining) == 2
                     else {direction: self.ALONE for direction in remaining})
            step = min(left / rates[direction] for direction, left in remaining.items())
            now += step
            for direction in list(remaining):
                remaining[direction] -= rates[direction] * step
                if remaining[direction] <= 1e-3:
                    finished[direction] = now
                    del remaining[direction]
        return finished


def test_the_reference_measures_each_direction_under_twice_the_bytes_the_other_way(monkeypatch):
    """nvbandwidth's method reads what each direction gets under load (12.5 and 24 GB/s); equal
    bytes both ways, the method the bench and this script had before issue 29, read host->device
    about 32 % high (the slower stream ran its tail alone), and the verdict catches a bench doing so."""
    script = load_script()
    figures = script.reference_figures(ModelLink(), 256 * 2**20)
    assert figures == {"h2d": pytest.approx(25.0), "d2h": pytest.approx(25.0),
                       "h2d_bidirectional": pytest.approx(12.5), "d2h_bidirectional": pytest.approx(24.0)}
    monkeypatch.setattr(script, "INTERFERENCE_FACTOR", 1)
    equal_bytes = script.reference_figures(ModelLink(), 256 * 2**20)
    assert equal_bytes["h2d_bidirectional"] == pytest.approx(16.44, abs=0.01)  # +31.5 %
    assert equal_bytes["d2h_bidirectional"] == pytest.approx(24.0)  # the faster one is loaded throughout
    (h2d_both,) = [check for check in bench_checks(equal_bytes, figures, "model", 256 * 2**20)
                   if "h2d_bidirectional" in check.name]
    assert not h2d_both.passed and h2d_both.difference == pytest.approx(0.315, abs=0.001)


def test_the_bench_figures_compared_are_its_largest_pinned_queued_copies():
    report_v3 = json.loads((REPO / "tests/fixtures/bench/report-gen4-local.json").read_text())
    record = {"placements": [{"placement": "local", "report": report_v3}]}
    largest, figures = load_script().bench_figures(record)
    assert largest == 268435456
    assert figures == {"h2d": 26.208, "d2h": 26.402, "h2d_bidirectional": 20.932, "d2h_bidirectional": 21.185}
