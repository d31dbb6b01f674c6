"""Builds the stub libnvidia-ml.so.1 from nvml.h and installs real pynvml versions, both cached.

Everything lands under the user's cache directory ($XDG_CACHE_HOME, else ~/.cache) in hybridmon/:
- nvml-dev/<version>/nvml.h: the header, taken from the PyPI wheel nvidia-nvml-dev-cu12 (NVIDIA's
  own packaging of it). Downloaded here rather than listed in the test extras: the wheel is tagged
  for one platform (manylinux x86_64 / aarch64), so as a dependency it would tie `pip install
  .[test]` to those platforms and put an unused `nvidia` package in the venv, while the header
  itself is plain text that works anywhere; this way one pinned version is fetched once.
- stub-nvml/<key>/libnvidia-ml.so.1: `cc -shared -fPIC` of the stub's C sources, key = header
  version + hash of the sources and compiler flags, so a warm run finds it and an edit rebuilds it.
- nvidia-ml-py/<version>/: `pip install --target --no-deps nvidia-ml-py==<version>`.

`python -m tests.support.stub_nvml.build` prepares all of it (scripts/test runs it before pytest).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
# The stub's C sources (stub_nvml.c: entry points; stub_layout.c: its layout file; stub_abi.c: the
# header's struct layout for the ABI test) and their shared header.
SOURCES = (HERE / "stub_nvml.c", HERE / "stub_layout.c", HERE / "stub_abi.c")
STUB_HEADER = HERE / "stub_state.h"
LIBRARY_NAME = "libnvidia-ml.so.1"  # the name pynvml loads (pynvml._LoadNvmlLibrary, Linux)

NVML_DEV_DISTRIBUTION = "nvidia-nvml-dev-cu12"
NVML_DEV_VERSION = "12.9.79"  # nvml.h of CUDA 12.9 (NVML API version 12)
NVML_HEADER_IN_WHEEL = "nvidia/nvml_dev/include/nvml.h"

# The newest nvidia-ml-py tested; the oldest is the floor in pyproject.toml (oldest_allowed()).
NEWEST_NVIDIA_ML_PY = "13.615.71"
# Versions below the floor the tests run too, to show what the floor keeps out (read from the
# wheels' pynvml.py): 12.535.77's c_nvmlProcessInfo_t carries usedGpuCcProtectedMemory, 32 bytes
# where nvml.h's nvmlProcessInfo_t is 24; 12.535.161, the last 12.535, has no
# nvmlDeviceGetNumaNodeId and no *RunningProcesses_v2 wrappers.
STRUCT_STRIDE_BUG = "12.535.77"
LACKS_NUMA_NODE_ID = "12.535.161"

# Build variants: "current" is a recent driver; "old-driver" lacks the *RunningProcesses_v3 and
# nvmlDeviceGetMemoryInfo_v2 symbols, as drivers from before those entry points do.
VARIANTS: dict[str, tuple[str, ...]] = {
    "current": (),
    "old-driver": ("-DHYBRIDMON_STUB_NO_V3", "-DHYBRIDMON_STUB_NO_MEMORY_V2"),
}
COMPILE_FLAGS = ("-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", "-pthread")


class StubUnavailable(RuntimeError):
    """Something the stub needs (a C compiler, the header download) is missing; says what."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hybridmon"


def oldest_allowed() -> str:
    """The nvidia-ml-py floor that pyproject.toml declares (the `>=` of its dependency line)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for requirement in project["dependencies"]:
        match = re.fullmatch(r"nvidia-ml-py\s*>=\s*([0-9.]+)\s*(,.*)?", requirement.strip())
        if match:
            return match.group(1)
    raise StubUnavailable("pyproject.toml has no 'nvidia-ml-py>=X' dependency line")


def tested_versions() -> list[str]:
    """nvidia-ml-py versions the real-binding tests run: the oldest allowed and the newest known."""
    return list(dict.fromkeys([oldest_allowed(), NEWEST_NVIDIA_ML_PY]))


def _pip(*args: str) -> None:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise StubUnavailable(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")


def _publish(built: Path, final: Path) -> None:
    """Move a finished build into place; a concurrent builder that got there first wins."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(built, final)
    except OSError:
        if not final.exists():
            raise
        shutil.rmtree(built, ignore_errors=True) if built.is_dir() else built.unlink()


def nvml_header() -> Path:
    """nvml.h of NVML_DEV_VERSION, downloaded once (the wheel's x86_64 tag: the header is the same)."""
    header = cache_root() / "nvml-dev" / NVML_DEV_VERSION / "nvml.h"
    if header.is_file():
        return header
    header.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=header.parent) as scratch:
        _pip("download", "--no-deps", "--only-binary=:all:", "--platform", "manylinux2014_x86_64",
             "--python-version", "3", "-d", scratch, f"{NVML_DEV_DISTRIBUTION}=={NVML_DEV_VERSION}")
        wheels = list(Path(scratch).glob("*.whl"))
        if len(wheels) != 1:
            raise StubUnavailable(f"expected one {NVML_DEV_DISTRIBUTION} wheel, got {wheels}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            text = wheel.read(NVML_HEADER_IN_WHEEL)
        extracted = Path(scratch) / "nvml.h"
        extracted.write_bytes(text)
        _publish(extracted, header)
    return header


def compiler() -> str:
    """$CC, else cc or gcc on PATH; StubUnavailable when there is none."""
    wanted = os.environ.get("CC")
    found = shutil.which(wanted) if wanted else (shutil.which("cc") or shutil.which("gcc"))
    if not found:
        raise StubUnavailable(f"no C compiler ({wanted or 'cc'}) to build the stub libnvidia-ml: "
                              "install gcc and libc6-dev (scripts/test does so when run as root)")
    return found


def build_stub(variant: str = "current") -> Path:
    """The folder holding the stub's libnvidia-ml.so.1 for `variant` (one of VARIANTS)."""
    flags = VARIANTS[variant]
    header = nvml_header()
    digest = hashlib.sha256()
    sources = [path.read_text() for path in (*SOURCES, STUB_HEADER)]
    for part in (NVML_DEV_VERSION, *sources, *COMPILE_FLAGS, *flags):
        digest.update(part.encode() + b"\0")
    folder = cache_root() / "stub-nvml" / f"{NVML_DEV_VERSION}-{variant}-{digest.hexdigest()[:16]}"
    library = folder / LIBRARY_NAME
    if library.is_file():
        return folder
    cc = compiler()
    folder.mkdir(parents=True, exist_ok=True)
    # Built under a unique name in the same folder, then renamed: concurrent builders never see
    # a half-written library.
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".so", delete=False) as partial:
        built = Path(partial.name)
    result = subprocess.run([cc, *COMPILE_FLAGS, *flags, "-I", str(header.parent), "-o", str(built),
                             *map(str, SOURCES)], capture_output=True, text=True)
    if result.returncode != 0:
        built.unlink(missing_ok=True)
        raise StubUnavailable(f"building the stub libnvidia-ml failed:\n{result.stderr[-4000:]}")
    _publish(built, library)
    return folder


def pynvml_dir(version: str) -> Path:
    """A folder whose pynvml.py is nvidia-ml-py `version` (put it first on PYTHONPATH)."""
    target = cache_root() / "nvidia-ml-py" / version
    if (target / "pynvml.py").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{version}-"))
    scratch.chmod(0o755)  # mkdtemp's 0700 would hide it from other users sharing the cache
    try:
        _pip("install", "--no-deps", "--no-compile", "--target", str(scratch),
             f"nvidia-ml-py=={version}")
        _publish(scratch, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def write_layout(path: Path, layout: dict) -> None:
    """Write the stub's layout file (format: stub_nvml.c's header comment) from a dict:
    {"driver_version": str, "pcie_window_us": int, "fail": {function: code}, "gpus": [{key: value, "processes":
    [(kind, pid, used_bytes or None, name)], "fields": {id: value}, "fail": {function: code}}]}."""
    lines = [f"driver_version {layout.get('driver_version', '550.54.15')}"]
    if layout.get("pcie_window_us"):
        lines.append(f"pcie_window_us {int(layout['pcie_window_us'])}")
    lines += [f"fail {function} {code}" for function, code in layout.get("fail", {}).items()]
    for gpu in layout["gpus"]:
        lines.append("gpu")
        for key, value in gpu.items():
            if key == "processes":
                lines += [f"process {kind} {pid} {'na' if used is None else used} {name}"
                          for kind, pid, used, name in value]
            elif key == "fields":
                lines += [f"field {field} {count}" for field, count in value.items()]
            elif key == "fail":
                lines += [f"fail {function} {code}" for function, code in value.items()]
            elif key == "c2c_links":
                lines += [f"c2c_link {int(up)} {mbps}" for up, mbps in value]
            elif key == "gpm_metrics":
                lines += [f"gpm_metric {metric} {mib}" for metric, mib in value.items()]
            elif key == "cpu_affinity":
                lines.append("cpu_affinity " + " ".join(hex(word) for word in value))
            else:
                if "\n" in str(value):
                    raise ValueError(f"layout value for {key!r} spans lines: {value!r}")
                lines.append(f"{key} {value}")
    path.write_text("\n".join(lines) + "\n")


PCIE_WINDOW_US = 20_000
"""nvmlDeviceGetPcieThroughput's window (nvml.h: "querying a byte counter over a 20ms interval")."""
MAX_GPUS = 8  # stub_state.h STUB_MAX_GPUS
PCIE_COUNT_TX_BYTES, PCIE_COUNT_RX_BYTES = 197, 198  # nvml.h NVML_FI_DEV_PCIE_COUNT_TX/RX_BYTES


def layout_from_fake(fake_layout: dict, pcie_window_us: int = PCIE_WINDOW_US) -> dict:
    """The stub's layout (write_layout's dict) for the host a fake NVML layout describes
    (tests/support/fake_nvml.py FakeNvml.load_layout's JSON, e.g. the daemon benchmark's 8-GPU
    host), the throughput call blocking `pcie_window_us`. What the stub cannot do is said, not
    dropped silently: more than MAX_GPUS GPUs, or bursty traffic (the stub's
    values are static), each a ValueError; byte counters advance (pcie_counters_advance)."""
    gpus = fake_layout["gpus"]
    if len(gpus) > MAX_GPUS:
        raise ValueError(f"the stub holds at most {MAX_GPUS} GPUs (stub_state.h), the layout has {len(gpus)}")
    stub_gpus = []
    for gpu in gpus:
        if gpu.get("pcie_duty", 1.0) < 1:
            raise ValueError(f"GPU {gpu['uuid']}: the stub answers static PCIe values, not duty {gpu['pcie_duty']}")
        stub = {"name": gpu["name"], "uuid": gpu["uuid"], "bus_id": gpu["pci_bus_id"],
                "memory_total": gpu["memory_total_bytes"], "memory_reserved": gpu["memory_reserved_bytes"],
                "memory_used": gpu["memory_used_bytes"],
                "pcie_rx_kbps": gpu["pcie_rx_kilobytes_per_second"],
                "pcie_tx_kbps": gpu["pcie_tx_kilobytes_per_second"],
                "link_gen": gpu["link_generation"], "link_gen_max": gpu["max_link_generation"],
                "link_width": gpu["link_width_lanes"], "link_width_max": gpu["max_link_width_lanes"],
                "replays": gpu["pcie_replays"], "util_gpu": gpu["utilization_percent"],
                "processes": [(kind, process["pid"], process["used_gpu_memory_bytes"], process["name"] or "?")
                              for process in gpu.get("processes", [])
                              for kind in process.get("kinds", ("compute",))]}
        if gpu.get("numa_node") is not None:
            stub["numa_node"] = gpu["numa_node"]
        if gpu.get("pcie_byte_counters"):
            # R555+'s counters (NVML_FI_DEV_PCIE_COUNT_TX/RX_BYTES), advancing at the GPU's rates
            # from the fake's start value, as the fake's _pcie_count does.
            start = gpu.get("pcie_counter_start_bytes", 0)
            stub["fields"] = {PCIE_COUNT_TX_BYTES: start, PCIE_COUNT_RX_BYTES: start}
            stub["pcie_counters_advance"] = 1
        stub_gpus.append(stub)
    return {"driver_version": fake_layout.get("driver_version", "550.54.15"),
            "pcie_window_us": pcie_window_us, "gpus": stub_gpus}


def prepare() -> dict[str, object]:
    """Everything the real-binding tests use, built or downloaded now if not cached."""
    return {"header": nvml_header(),
            "stubs": {variant: build_stub(variant) for variant in VARIANTS},
            "nvidia-ml-py": {version: pynvml_dir(version) for version in
                             [*tested_versions(), STRUCT_STRIDE_BUG, LACKS_NUMA_NODE_ID]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    for name, value in prepare().items():
        print(f"{name}: {value}")


if __name__ == "__main__":
    main()
