"""What every alert family must bring, checked in seconds, before the slow tests would demand it.

A family is its module in agent/alerts/ (family.py), its `[section]` in thresholds.toml, one
runbook per alert and its test module, tests/alerts/test_<section>.py; nothing else names it.
Each test here says what is missing in the words a newcomer needs: the file to write and where.
The slow tests that rely on each part: tests/integration/test_detection.py (its scenario and
`for`), tests/rules/test_rules.py (its promtool cases run by promtool), tests/rules/test_runbooks.py.
"""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from hybridmon.agent.alerts import catalogue
from hybridmon.agent.alerts.catalogue import FAMILIES, Thresholds, all_alertnames
from hybridmon.agent.detectors.base import DetectorBase
from hybridmon.rules.groups import GROUPS
from tests.support.scenarios.library import SCENARIOS

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "agent" / "alerts"
THRESHOLDS_TOML = (ALERTS / "thresholds.toml").read_text()
THRESHOLDS = catalogue.load_thresholds()
IDS = {"ids": lambda family: family.section}


def test_the_catalogue_finds_every_module_of_the_package_and_nothing_else():
    modules = {path.stem for path in ALERTS.glob("*.py")} | {path.parent.name for path in ALERTS.glob("*/__init__.py")}
    assert modules - catalogue.NOT_FAMILIES - {"__init__"} == {family.section for family in FAMILIES}


def test_a_module_without_a_family_is_refused_with_what_to_do(tmp_path, monkeypatch):
    package = tmp_path / "families"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "helper.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(catalogue, "PACKAGE", "families")
    with pytest.raises(catalogue.CatalogueError, match="families.helper defines no FAMILY"):
        catalogue.discover()


def test_every_alert_is_raised_by_one_family_and_has_one_runbook():
    names = [name for family in FAMILIES for name in family.alertnames]
    assert len(names) == len(set(names)), "two families raise the same alertname"
    runbooks = {path.stem for path in (REPO / "runbooks").glob("*.md")} - {"README"}
    assert set(all_alertnames()) - runbooks == set(), "write runbooks/<AlertName>.md for each alert"
    assert runbooks - set(all_alertnames()) == set(), "a runbook whose alert no family raises"


@pytest.mark.parametrize("family", FAMILIES, **IDS)
def test_a_family_is_one_module_named_like_its_section(family):
    module = importlib.import_module(f"hybridmon.agent.alerts.{family.section}")
    assert module.FAMILY is family
    assert family.settings.__module__ == module.__name__, "its settings model lives in its module"
    assert family.group in GROUPS
    rules = family.alerts(THRESHOLDS)
    assert {rule.alert for rule in rules} == set(family.alertnames), "alertnames are its rules' alerts"
    if family.detector is None:
        assert not hasattr(module, "Detector"), "a rule-only family has no detector"
        return
    detector = family.build_detector(getattr(THRESHOLDS, family.section))
    assert isinstance(detector, DetectorBase) and type(detector).__module__ == module.__name__
    assert detector.name == family.section and tuple(detector.alertnames) == family.alertnames
    assert 60.0 <= detector.lookback_seconds < float("inf"), "its family sets the span it reads"


@pytest.mark.parametrize("family", FAMILIES, **IDS)
def test_its_thresholds_section_is_in_the_shipped_file(family):
    assert re.search(rf"^\[{family.section}\]$", THRESHOLDS_TOML, re.M), (
        f"add [{family.section}] to agent/alerts/thresholds.toml, each key with where its value comes from")
    assert family.section in Thresholds.model_fields


@pytest.mark.parametrize("family", FAMILIES, **IDS)
def test_it_names_its_scenario_or_says_why_it_has_none(family):
    assert (family.scenario is None) != (family.no_scenario is None), (
        f"{family.section}: give scenario=\"<a name in tests/support/scenarios>\" or no_scenario=\"why not\"")
    if family.scenario is not None:
        scenario = SCENARIOS.get(family.scenario)
        assert scenario is not None, f"{family.section}: no scenario named {family.scenario!r}"
        assert any(name in family.alertnames for name, _ in scenario.expected), (
            f"scenario {family.scenario} expects none of {family.alertnames}")
    else:
        assert len(family.no_scenario.split()) >= 5, "say why in a sentence"


@pytest.mark.parametrize("family", FAMILIES, **IDS)
def test_its_test_module_holds_promtool_cases_for_every_rule(family):
    path = REPO / "tests" / "alerts" / f"test_{family.section}.py"
    assert path.is_file(), f"write {path.relative_to(REPO)}: its detector's tests and promtool_cases(t, catalog)"
    defined = {node.name for node in ast.parse(path.read_text()).body if isinstance(node, ast.FunctionDef)}
    assert "promtool_cases" in defined, f"{path.relative_to(REPO)} defines no promtool_cases(t, catalog)"
    generated = REPO / "rules" / "tests" / f"generated_{family.section}.yml"
    assert generated.is_file(), "run python -m tests.rules.generate"


def test_no_family_imports_another():
    """A helper two families share lives in agent/detectors/ (or rules/ for PromQL), not in one
    of them: a family reads the floors below it, never a sibling."""
    offences = []
    for family in FAMILIES:
        module = importlib.import_module(f"hybridmon.agent.alerts.{family.section}")
        paths = [Path(module.__file__)]
        if paths[0].name == "__init__.py":
            paths = sorted(paths[0].parent.glob("*.py"))
        for path in paths:
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    target = node.module.split(".")
                    if target[:3] == ["hybridmon", "agent", "alerts"] and len(target) > 3 \
                            and target[3] not in (family.section, *catalogue.NOT_FAMILIES):
                        offences.append(f"{path.relative_to(REPO)} imports {node.module}")
    assert offences == []
