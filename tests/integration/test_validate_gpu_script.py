"""scripts/validate-gpu on a host without a GPU: it must say so at once and exit non-zero, never
start the agent, the benchmark or a build. Its GPU path has not run on hardware here
(docs/performance.md)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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

