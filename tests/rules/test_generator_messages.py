"""Every generator says on stderr what it wrote or checked, one line per file (issue 16): a
silent success could not be told from a generator that did nothing."""
from __future__ import annotations

import subprocess
import sys

import pytest

from deploy.kubernetes import generate_prometheusrule
from docs import generate as docs_generate
from hybridmon.rules import generate as rules_generate
from tests.rules import generate as promtool_tests_generate
from tests.support.agent_helpers import REPO


def generators():
    from hybridmon.dashboards import generate as dashboards_generate  # grafana-foundation-sdk: Python >= 3.11

    return [rules_generate, dashboards_generate, generate_prometheusrule, promtool_tests_generate]


@pytest.mark.parametrize("index", [0, 1, 2, 3], ids=["rules", "dashboards", "prometheusrule", "promtool-tests"])
def test_a_generator_names_each_file_it_writes_then_checks(index, tmp_path, capsys):
    if index == 1 and sys.version_info < (3, 11):
        pytest.skip("grafana-foundation-sdk needs Python >= 3.11 (pyproject's floor is 3.10)")
    generator = generators()[index]
    assert generator.main(["--output-dir", str(tmp_path)]) == 0
    written = sorted(str(path) for path in tmp_path.rglob("*") if path.is_file())
    captured = capsys.readouterr()
    assert captured.out == ""
    assert sorted(captured.err.splitlines()) == [f"wrote {path}" for path in written]
    assert generator.main(["--check", "--output-dir", str(tmp_path)]) == 0
    assert sorted(capsys.readouterr().err.splitlines()) == [f"checked {path}: up to date" for path in written]
    changed = sorted(tmp_path.rglob("*.y*ml") if index != 1 else tmp_path.glob("*.json"))[0]
    changed.write_text(changed.read_text() + "\n")
    assert generator.main(["--check", "--output-dir", str(tmp_path)]) == 1
    assert f"checked {changed}: differs" in capsys.readouterr().err.splitlines()


@pytest.mark.slow
def test_the_docs_generator_names_each_file_it_checks():
    result = subprocess.run([sys.executable, "-m", "docs.generate", "--check"], capture_output=True, text=True,
                            cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(result.stderr.splitlines()) == sorted(f"checked {REPO / name}: up to date"
                                                        for name in docs_generate.render())
