"""What `pip install .` installs: one import package, `hybridmon`, holding every module and data file
the agent loads, and a `hybridmon` command that runs from a fresh virtual environment.

The install is real but quick: no index and no dependencies are fetched (--no-deps); the new
environment sees the test interpreter's installed dependencies through a .pth file, which adds
those directories to sys.path without running their own .pth files, so an editable install of
this checkout there stays inactive and every hybridmon module comes from the wheel.
"""
from __future__ import annotations

import os
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
PACKAGE_DIRS: dict[str, str] = SETUPTOOLS["package-dir"]  # import package -> repository folder
TOP_LEVEL_FOLDERS = ("agent", "exporters", "rules", "dashboards", "runbooks")
# Data the agent reads at run time, as the wheel holds it.
DATA_FILES = {
    "hybridmon/agent/alerts/thresholds.toml": REPO / "agent/alerts/thresholds.toml",
    "hybridmon/agent/bench/offload_bench.cu": REPO / "agent/bench/offload_bench.cu",
    "hybridmon/rules/hybridmon.rules.yml": REPO / "rules/hybridmon.rules.yml",
    **{f"hybridmon/dashboards/json/{path.name}": path for path in sorted((REPO / "dashboards/json").glob("*.json"))},
    **{f"hybridmon/runbooks/{path.name}": path for path in sorted((REPO / "runbooks").glob("*.md"))},
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(REPO)],
        check=True, capture_output=True, timeout=300,
    )
    (built,) = out.glob("hybridmon-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel installed; returns its bin directory."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    dependencies = [*site.getsitepackages(), site.getusersitepackages()]
    (Path(purelib) / "test-dependencies.pth").write_text("".join(f"{path}\n" for path in dependencies))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, capture_output=True, timeout=300)
    return venv / "bin"


def run_outside_checkout(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run from a directory that is not the checkout, so nothing is imported from it."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_wheel_holds_one_package_with_every_module(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        "/".join([*package.split("."), *path.relative_to(REPO / folder).parts])
        for package, folder in PACKAGE_DIRS.items()
        for path in (REPO / folder).rglob("*.py") if "__pycache__" not in path.parts
    }
    assert expected - names == set()
    top_level = {name.split("/")[0] for name in names if not name.startswith("hybridmon-")}
    assert top_level == {"hybridmon"}
    dist_info = next(name for name in names if name.endswith(".dist-info/top_level.txt"))
    assert zipfile.ZipFile(wheel).read(dist_info).decode().split() == ["hybridmon"]


def test_wheel_carries_the_data_the_agent_reads(wheel):
    assert any(name.startswith("hybridmon/runbooks/") for name in DATA_FILES)
    archive = zipfile.ZipFile(wheel)
    missing = sorted(set(DATA_FILES) - set(archive.namelist()))
    assert missing == []
    changed = [name for name, source in DATA_FILES.items() if archive.read(name) != source.read_bytes()]
    assert changed == []


def test_installed_package_imports_from_site_packages_only(installed, tmp_path):
    python = installed / "python"
    result = run_outside_checkout(
        [str(python), "-c", "import sysconfig, hybridmon, hybridmon.agent.cli, hybridmon.agent.alerts.catalogue; "
                            "print(sysconfig.get_paths()['purelib']); print(hybridmon.__file__); "
                            "print(hybridmon.agent.cli.__file__)"], tmp_path)
    assert result.returncode == 0, result.stderr
    purelib, package_file, cli_file = result.stdout.split()
    assert Path(package_file).is_relative_to(purelib) and Path(cli_file).is_relative_to(purelib)
    entries = {path.name for path in Path(purelib).iterdir()}
    assert entries & set(TOP_LEVEL_FOLDERS) == set()
    assert "hybridmon" in entries


@pytest.mark.parametrize("arguments", [["--help"], ["check", "--help"], ["bench", "--help"]])
def test_installed_command_runs(installed, tmp_path, arguments):
    result = run_outside_checkout([str(installed / "hybridmon"), *arguments], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: hybridmon")


# The generated files an operator wants, written by the installed command from the wheel's package
# data, with the generators' own dependencies (test extras) made unimportable: issue 16.
WITHOUT_GENERATOR_DEPENDENCIES = (
    "import sys; sys.modules.update(yaml=None, grafana_foundation_sdk=None); "
    "from hybridmon.agent.cli import main; sys.exit(main(sys.argv[1:]))"
)


def test_installed_command_writes_rules_dashboards_and_runbooks(installed, tmp_path):
    def hybridmon(*arguments: str) -> subprocess.CompletedProcess:
        return run_outside_checkout([str(installed / "python"), "-c", WITHOUT_GENERATOR_DEPENDENCIES, *arguments],
                                    tmp_path)

    rules = hybridmon("rules")
    assert rules.returncode == 0, rules.stderr
    assert rules.stdout == (REPO / "rules/hybridmon.rules.yml").read_text()
    for kind, folder, suffix in (("dashboards", REPO / "dashboards/json", ".json"), ("runbooks", REPO / "runbooks", ".md")):
        written = hybridmon(kind, "--output", str(tmp_path / kind))
        assert written.returncode == 0, written.stderr
        expected = sorted(path.name for path in folder.glob(f"*{suffix}"))
        assert sorted(path.name for path in (tmp_path / kind).iterdir()) == expected
        assert written.stderr.splitlines() == [f"wrote {tmp_path / kind / name}" for name in expected]
        assert all((tmp_path / kind / name).read_bytes() == (folder / name).read_bytes() for name in expected)
    refused = hybridmon("dashboards", "--output", "/proc/version/x")
    assert refused.returncode == 74 and refused.stderr.startswith("hybridmon: "), refused.stderr
