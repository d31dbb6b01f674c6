"""The wheel that `pip install .` builds must hold every module and data file the agent loads."""
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_wheel_contains_every_agent_and_exporter_module(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(REPO)],
        check=True, capture_output=True,
    )
    (wheel,) = tmp_path.glob("hybridmon-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        str(path.relative_to(REPO))
        for package in ("agent", "exporters")
        for path in (REPO / package).rglob("*")
        if path.suffix in (".py", ".toml") and "__pycache__" not in path.parts
    }
    assert expected - names == set()
    assert any(name.endswith("entry_points.txt") for name in names)
