"""The offload benchmark compiles with the nvcc present (CI has one), is cached by source hash,
and on a host without a usable CUDA device exits with its documented status and JSON error.

Only the absence of any nvcc skips the build tests; a broken build fails them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hybridmon.agent.bench import build as bench_build
from hybridmon.agent.bench.build import (
    EXIT_NO_DEVICE,
    EXIT_USAGE,
    BenchBuildError,
    BinaryMismatch,
    BuildFailed,
    NvccNotFound,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def bench_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bench-cache")


@pytest.fixture(scope="session")
def built(bench_cache) -> Path:
    """The benchmark, built once per session into an isolated cache; skip only without any nvcc."""
    try:
        bench_build.find_nvcc()
    except NvccNotFound:
        # CI's machines have nvcc: there a missing toolkit is a lost install step, not a skip.
        if os.environ.get("CI") == "true":
            pytest.fail("nvcc must be present in CI to build the offload benchmark")
        pytest.skip("no nvcc on PATH or in $CUDA_HOME/bin")
    return bench_build.build(cache_dir=bench_cache)  # BuildFailed here fails the tests


def run_binary(binary: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # An empty CUDA_VISIBLE_DEVICES hides every GPU, so "no device" holds on GPU hosts too.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=60, env=env)


def fake_nvcc(directory: Path, compile_script: str = 'touch "$out"; chmod +x "$out"') -> Path:
    """A stand-in nvcc that lists CUDA 13.0's targets and runs `compile_script` to 'compile'."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "nvcc"
    script.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        "  --list-gpu-code) echo sm_70; echo sm_75; echo sm_80; echo sm_90; echo sm_90a;"
        " echo sm_100; echo sm_121; exit 0;;\n"
        "  --list-gpu-arch) echo compute_70; echo compute_75; echo compute_80; echo compute_90;"
        " echo compute_90a; echo compute_100; echo compute_121; exit 0;;\n"
        "  --version) echo 'Cuda compilation tools, release 13.0, fake'; exit 0;;\n"
        "esac\n"
        'out=""; prev=""; for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done\n'
        f"{compile_script}\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return script


@pytest.mark.slow
def test_build_produces_an_executable_in_the_hash_keyed_cache(built, bench_cache):
    digest = bench_build.source_hash()
    assert built == bench_cache / digest / "offload_bench"
    assert os.access(built, os.X_OK)
    info = json.loads((built.parent / "build.json").read_text())
    assert info["source_sha256"] == digest
    assert "arch=compute_75,code=sm_75" in info["args"]
    ptx = [a for a in info["args"] if re.fullmatch(r"arch=compute_(\d+),code=compute_\1", a)]
    assert len(ptx) == 1, info["args"]  # PTX for the newest architecture only
    assert not [p for p in built.parent.iterdir() if p.name.startswith(".build-")], "temp dir left"


@pytest.mark.slow
def test_second_build_reuses_the_cache_without_running_nvcc(built, bench_cache, monkeypatch):
    before = built.stat()

    def no_nvcc(*args, **kwargs):
        raise AssertionError(f"nvcc ran again: {args}")

    monkeypatch.setattr(bench_build, "_run_nvcc", no_nvcc)
    monkeypatch.setattr(bench_build, "find_nvcc", no_nvcc)
    assert bench_build.build(cache_dir=bench_cache) == built
    after = built.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


@pytest.mark.slow
def test_binary_without_a_device_exits_with_the_documented_status_and_json_error(built):
    proc = run_binary(built)
    assert proc.returncode == EXIT_NO_DEVICE == 3, proc.stderr
    report = json.loads(proc.stdout)
    assert report["error"] == "no CUDA device"
    assert report["detail"]  # cudaGetErrorName: cudaGetErrorString, e.g. cudaErrorNoDevice


@pytest.mark.slow
def test_binary_names_a_driver_older_than_its_runtime(built, tmp_path):
    """Against a libcuda.so.1 reporting CUDA 12.4 (tests/support/stub_cuda), the runtime says
    cudaErrorInsufficientDriver; the binary names both versions with exit 7, not "no CUDA device".
    Without any driver (this host) the same error stays exit 3 (the test above)."""
    stub = tmp_path / "libcuda.so.1"
    subprocess.run(["cc", "-shared", "-fPIC", "-Wall", "-Werror", "-o", str(stub),
                    str(REPO / "tests/support/stub_cuda/libcuda_stub.c")], check=True)
    proc = subprocess.run([str(built)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "LD_LIBRARY_PATH": str(tmp_path)})
    assert proc.returncode == bench_build.EXIT_DRIVER_TOO_OLD == 7, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["error"] == "CUDA driver too old"
    message = (r"the CUDA runtime 1\d\.\d this binary was built with needs a newer driver than the "
               r"installed one, which supports CUDA up to 12\.4: update the NVIDIA driver, or build the "
               r"benchmark with a CUDA toolkit no newer than 12\.4 \(cudaErrorInsufficientDriver\)")
    assert re.fullmatch(message, report["detail"]), report["detail"]
    # The fixture the runner's tests use was captured this way (CUDA 13.0): still what it prints.
    captured = json.loads((REPO / "tests/fixtures/bench/error-driver-too-old.json").read_text())
    assert re.fullmatch(message, captured["detail"]) and captured["error"] == report["error"]


@pytest.mark.slow
def test_binary_reports_its_source_hash_and_rejects_bad_options_as_json(built):
    version = run_binary(built, "--version")
    assert version.returncode == 0
    assert json.loads(version.stdout)["source_sha256"] == bench_build.source_hash()
    for args in (["--bogus"], ["--sizes", "2097152,7"], ["--repeat", "0"], ["--numa-node", "x"]):
        proc = run_binary(built, *args)
        assert proc.returncode == EXIT_USAGE, args
        assert json.loads(proc.stdout)["error"] == "usage"


@pytest.mark.slow
def test_locate_binary_accepts_a_prebuilt_binary_of_the_same_source(built, monkeypatch, tmp_path):
    monkeypatch.setenv(bench_build.BINARY_ENV, str(built))
    assert bench_build.locate_binary(cache_dir=tmp_path / "unused") == built
    assert not (tmp_path / "unused").exists()


@pytest.mark.slow
def test_locate_binary_rejects_a_binary_of_another_source(tmp_path):
    other = tmp_path / "offload_bench"
    other.write_text('#!/bin/sh\necho \'{"version": 1, "source_sha256": "0000"}\'\n')
    other.chmod(0o755)
    with pytest.raises(BinaryMismatch, match="rebuild it"):
        bench_build.locate_binary(other)
    not_a_bench = tmp_path / "true"
    not_a_bench.write_text("#!/bin/sh\nexit 0\n")
    not_a_bench.chmod(0o755)
    with pytest.raises(BenchBuildError, match="not a runnable offload benchmark"):
        bench_build.locate_binary(not_a_bench)


def test_nvcc_not_found_without_path_or_cuda_home(monkeypatch, tmp_path):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    with pytest.raises(NvccNotFound, match=r"no nvcc on PATH or in \$CUDA_HOME/bin: install the CUDA toolkit"):
        bench_build.build(cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_nvcc_found_in_cuda_home(monkeypatch, tmp_path):
    nvcc = fake_nvcc(tmp_path / "cuda" / "bin")
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    assert bench_build.find_nvcc() == nvcc


@pytest.mark.slow
def test_gencode_flags_cover_sm75_and_newer_plus_ptx_for_the_newest(tmp_path):
    flags = bench_build.gencode_flags(fake_nvcc(tmp_path))
    targets = flags[1::2]
    assert flags[0::2] == ["-gencode"] * len(targets)
    assert targets == [
        "arch=compute_75,code=sm_75",
        "arch=compute_80,code=sm_80",
        "arch=compute_90,code=sm_90",
        "arch=compute_100,code=sm_100",
        "arch=compute_121,code=sm_121",
        "arch=compute_121,code=compute_121",
    ]


@pytest.mark.slow
def test_build_failure_carries_nvcc_stderr_and_leaves_no_binary(tmp_path):
    nvcc = fake_nvcc(tmp_path / "bin", "echo 'offload_bench.cu(1): error: broken on purpose' >&2; exit 2")
    with pytest.raises(BuildFailed, match="broken on purpose"):
        bench_build.build(cache_dir=tmp_path / "cache", nvcc=nvcc)
    leftovers = [p.name for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert leftovers == []


def test_cache_root_respects_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert bench_build.cache_root() == tmp_path / "hybridmon" / "bench"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert bench_build.cache_root() == Path.home() / ".cache" / "hybridmon" / "bench"
    assert bench_build.cache_root(tmp_path / "x") == tmp_path / "x"


def test_source_is_shipped_as_package_data():
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "*.cu" in config["tool"]["setuptools"]["package-data"]["hybridmon.agent.bench"]
    assert bench_build.SOURCE.is_file()


def cuobjdump() -> str | None:
    """cuobjdump from the toolkit, else from the nvidia-cuda-cuobjdump wheel (nvidia/cu13/bin)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    for base in map(Path, sys.path):
        candidate = base / "nvidia" / "cu13" / "bin" / "cuobjdump"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


@pytest.mark.slow
def test_the_binary_carries_sass_for_every_listed_arch_and_ptx_for_the_newest(built):
    """What the container image ships (deploy/container/Dockerfile builds it the same way): a GPU
    of any listed architecture runs its SASS, a newer one JITs the PTX."""
    tool = cuobjdump()
    if tool is None:
        reason = "no cuobjdump (CUDA toolkit, or the test extras' nvidia-cuda-cuobjdump wheel)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason + ": the test command installs it")
        pytest.skip(reason)
    info = json.loads((built.parent / "build.json").read_text())
    wanted = {int(n) for n in re.findall(r"code=sm_(\d+)", " ".join(info["args"]))}
    (ptx_arch,) = {int(n) for n in re.findall(r"code=compute_(\d+)", " ".join(info["args"]))}
    elves = subprocess.run([tool, "--list-elf", str(built)], capture_output=True, text=True, check=True).stdout
    ptx = subprocess.run([tool, "--list-ptx", str(built)], capture_output=True, text=True, check=True).stdout
    assert {int(n) for n in re.findall(r"\.sm_(\d+)\.cubin", elves)} == wanted
    assert min(wanted) == bench_build.MIN_SM
    assert re.findall(r"\.sm_(\d+)\.ptx", ptx) == [str(ptx_arch)] and ptx_arch == max(wanted)


@pytest.mark.slow
def test_hybridmon_bench_turns_no_device_into_a_clear_message_and_exit_3(built, tmp_path):
    """The real binary through the whole command, NVML (the fake) listing a GPU that CUDA cannot
    reach. `hybridmon bench` clears CUDA_VISIBLE_DEVICES on purpose (device order), so on a host
    with a GPU this would measure it instead."""
    if Path("/dev/nvidiactl").exists():
        pytest.skip("a GPU host: `hybridmon bench` would run for real (docs/offload-bench.md)")
    env = {**os.environ, "HYBRIDMON_STATE_DIR": str(tmp_path / "state"), "PYTHONPATH": str(REPO),
           "HYBRIDMON_GPU__NVML_MODULE": "tests.support.fake_nvml"}
    proc = subprocess.run([sys.executable, "-m", "hybridmon.agent.cli", "bench", "--gpu", "0", "--force",
                           "--binary", str(built)],
                          capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert proc.returncode == EXIT_NO_DEVICE, proc.stderr
    assert "hybridmon: no CUDA device: cuda" in proc.stderr
    assert "the benchmark needs an NVIDIA GPU with a working driver" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "state").exists()  # nothing half-measured is stored
