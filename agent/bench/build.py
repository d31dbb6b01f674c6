"""Compile the offload benchmark (`offload_bench.cu`) on first use, into a cache keyed by its source.

The binary lands in `<cache>/<sha256 of the source>/offload_bench`, where `<cache>` is the
`cache_dir` argument, else `$XDG_CACHE_HOME/hybridmon/bench`, else `~/.cache/hybridmon/bench`.
It is a fat binary: SASS for every `sm_N` (N >= 75) that `nvcc --list-gpu-code` reports, plus PTX
for the newest `compute_N` of `nvcc --list-gpu-arch`, so GPUs newer than the toolkit JIT the PTX.
The CUDA runtime, libstdc++ and libgcc are linked statically: the binary needs only glibc and the
driver's libcuda, so it can be built on one host and run on another with the driver but no toolkit
(see `locate_binary` and docs/offload-bench.md).

`python -m hybridmon.agent.bench.build [--cache-dir DIR]` builds and prints the binary's path.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SOURCE = Path(__file__).with_name("offload_bench.cu")
BINARY_NAME = "offload_bench"
BUILD_INFO_NAME = "build.json"
MIN_SM = 75
NVCC_TIMEOUT_S = 900
BINARY_ENV = "HYBRIDMON_BENCH_BINARY"

# Exit statuses of the binary (kept in step with the constants at the top of offload_bench.cu).
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_NO_DEVICE = 3
EXIT_CUDA_ERROR = 4
EXIT_VERIFY_FAILED = 5
EXIT_HOST_ERROR = 6
EXIT_DRIVER_TOO_OLD = 7  # cudaErrorInsufficientDriver with a driver loaded: older than the runtime


class BenchBuildError(RuntimeError):
    """Base class: the benchmark binary cannot be produced or used."""


class NvccNotFound(BenchBuildError):
    """No nvcc on PATH nor in $CUDA_HOME/bin."""


class BuildFailed(BenchBuildError):
    """nvcc ran and failed (or could not list its GPU targets); the message carries its stderr tail."""


class BinaryMismatch(BenchBuildError):
    """A prebuilt binary was given but was built from a different source than this package ships."""


def source_hash(source: Path = SOURCE) -> str:
    """SHA-256 hex digest of the benchmark source: the cache key and the binary's identity."""
    return hashlib.sha256(source.read_bytes()).hexdigest()


def find_nvcc(env: dict[str, str] | None = None) -> Path:
    """The nvcc on PATH, else `$CUDA_HOME/bin/nvcc`; raises NvccNotFound."""
    env = os.environ if env is None else env
    found = shutil.which("nvcc", path=env.get("PATH", ""))
    if found:
        return Path(found)
    cuda_home = env.get("CUDA_HOME")
    if cuda_home:
        candidate = Path(cuda_home) / "bin" / "nvcc"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise NvccNotFound(
        "no nvcc on PATH or in $CUDA_HOME/bin: install the CUDA toolkit (12.x or newer), or set "
        "CUDA_HOME to it; on a host with only the driver, build the benchmark on another host with "
        f"`python -m hybridmon.agent.bench.build` and point ${BINARY_ENV} at the copied binary "
        "(docs/offload-bench.md)"
    )


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Directory holding one subdirectory per source hash."""
    if cache_dir is not None:
        return Path(cache_dir)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "hybridmon" / "bench"


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _run_nvcc(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise BuildFailed(f"{' '.join(args[:2])} ... timed out after {timeout:.0f} s") from exc
    except OSError as exc:
        raise BuildFailed(f"cannot run {args[0]}: {exc}") from exc


def gencode_flags(nvcc: Path) -> list[str]:
    """`-gencode` flags: SASS for each real `sm_N` >= 75 this nvcc supports, PTX for the newest."""
    listed = {}
    for option in ("--list-gpu-code", "--list-gpu-arch"):
        proc = _run_nvcc([str(nvcc), option], timeout=60)
        if proc.returncode != 0:
            raise BuildFailed(f"{nvcc} {option} failed (exit {proc.returncode}):\n{_tail(proc.stderr)}")
        listed[option] = proc.stdout
    # Plain numeric targets only: the arch-specific "a"/"f" variants are not forward compatible.
    sms = sorted({int(n) for n in re.findall(r"\bsm_(\d+)\b", listed["--list-gpu-code"])})
    computes = sorted({int(n) for n in re.findall(r"\bcompute_(\d+)\b", listed["--list-gpu-arch"])})
    sms = [n for n in sms if n >= MIN_SM and n in computes]
    if not sms:
        raise BuildFailed(f"{nvcc} supports no GPU target sm_{MIN_SM} or newer")
    flags = []
    for n in sms:
        flags += ["-gencode", f"arch=compute_{n},code=sm_{n}"]
    newest = max(computes)
    flags += ["-gencode", f"arch=compute_{newest},code=compute_{newest}"]
    return flags


def _usable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def build(cache_dir: str | os.PathLike[str] | None = None, nvcc: Path | None = None) -> Path:
    """Path of the compiled benchmark, compiling it first when the cache has none for this source.

    Raises NvccNotFound when no nvcc can be found and BuildFailed (with nvcc's stderr tail) when
    compilation fails. The binary appears atomically: nvcc writes into a temporary directory beside
    the target, which is then renamed into place, so concurrent builders never see a partial file.
    """
    digest = source_hash()
    target_dir = cache_root(cache_dir) / digest
    target = target_dir / BINARY_NAME
    if _usable(target):
        return target

    nvcc = nvcc or find_nvcc()
    target_dir.mkdir(parents=True, exist_ok=True)
    flags = gencode_flags(nvcc)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=target_dir) as tmp:
        out = Path(tmp) / BINARY_NAME
        args = [
            str(nvcc), "-std=c++17", "-O2", "--threads", "0",
            f"-DHYBRIDMON_BENCH_SOURCE_SHA256={digest}",
            "-Xcompiler", "-static-libstdc++,-static-libgcc",
            *flags, "-o", str(out), str(SOURCE),
        ]  # fmt: skip
        started = time.monotonic()
        proc = _run_nvcc(args, timeout=NVCC_TIMEOUT_S)
        elapsed = time.monotonic() - started
        if proc.returncode != 0 or not _usable(out):
            raise BuildFailed(
                f"nvcc failed (exit {proc.returncode}) building {SOURCE.name}:\n"
                f"{_tail(proc.stderr or proc.stdout)}"
            )
        version = _run_nvcc([str(nvcc), "--version"], timeout=60).stdout.strip().splitlines()
        info = {
            "source_sha256": digest,
            "nvcc": str(nvcc),
            "nvcc_version": version[-1] if version else "",
            "args": args[1:-3],
            "build_seconds": round(elapsed, 3),
        }
        (Path(tmp) / BUILD_INFO_NAME).write_text(json.dumps(info, indent=2) + "\n")
        os.replace(Path(tmp) / BUILD_INFO_NAME, target_dir / BUILD_INFO_NAME)
        os.replace(out, target)  # last: the binary's presence means the build is complete
    return target


def binary_source_hash(binary: Path) -> str:
    """The source hash a built binary reports with `--version`; raises BenchBuildError."""
    try:
        proc = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=30, check=False
        )
        return str(json.loads(proc.stdout)["source_sha256"])
    except (OSError, subprocess.TimeoutExpired, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise BenchBuildError(f"{binary} is not a runnable offload benchmark: {exc}") from exc


def locate_binary(
    binary: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """The benchmark binary to run: `binary`, else `$HYBRIDMON_BENCH_BINARY`, else `build()`.

    A prebuilt binary (for hosts with the driver but no toolkit) must report the same source hash
    as the `offload_bench.cu` in this package, else BinaryMismatch: results from another version
    of the benchmark would be silently mixed with this one's schema.
    """
    chosen = binary if binary is not None else os.environ.get(BINARY_ENV)
    if not chosen:
        return build(cache_dir)
    path = Path(chosen)
    if not _usable(path):
        raise BenchBuildError(f"{path} is not an executable file")
    expected, got = source_hash(), binary_source_hash(path)
    if got != expected:
        raise BinaryMismatch(
            f"{path} was built from offload_bench.cu {got[:12]}, this package ships {expected[:12]}: "
            "rebuild it with `python -m hybridmon.agent.bench.build` from this version of hybridmon"
        )
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hybridmon.agent.bench.build", description="Build the offload benchmark and print its path."
    )
    parser.add_argument("--cache-dir", help="cache root (default: $XDG_CACHE_HOME/hybridmon/bench)")
    args = parser.parse_args(argv)
    try:
        print(build(args.cache_dir))
    except BenchBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
