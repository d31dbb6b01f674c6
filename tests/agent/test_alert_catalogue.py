"""The alert catalogue (agent/alerts/catalogue.py) is the one list of alerts: every other list is
derived from it. What each family must bring is checked in tests/structure/test_families.py."""
from pathlib import Path

import pytest
import yaml

from hybridmon.agent.alerts import catalogue
from hybridmon.agent.alerts.catalogue import FAMILIES, Thresholds, all_alertnames, all_detectors
from hybridmon.agent.detectors.engine import Engine
from hybridmon.agent.self_metrics import SELF_METRICS
from hybridmon.exporters.registry import COLLECTORS
from hybridmon.rules.templates import markers
from tests.support.detector_history import (GIB, T0, THRESHOLDS, Trace, gpu_rows, host_memory_rows,
                                          numa_rows, pcie_rows, pressure_rows, process_numa_rows,
                                          process_rows)

REPO = Path(__file__).resolve().parents[2]
ALERT_RULES = [rule for group in yaml.safe_load((REPO / "rules" / "hybridmon.rules.yml").read_text())["groups"]
               for rule in group["rules"] if "alert" in rule]


def test_one_detector_per_thresholds_section_and_every_alert_once():
    detectors = all_detectors(THRESHOLDS)
    assert list(Thresholds.model_fields) == [f.section for f in FAMILIES]
    assert [d.name for d in detectors] == [f.section for f in FAMILIES if f.detector is not None]
    # rule-only families: trouble the agent cannot see from inside (its own death)
    rule_only = [name for f in FAMILIES if f.detector is None for name in f.alertnames]
    assert rule_only == ["HybridmonAgentDown"]
    names = [name for d in detectors for name in d.alertnames] + rule_only
    assert sorted(names) == all_alertnames()


def test_the_rule_file_holds_the_catalogues_rules_in_its_order():
    generated = [(rule.alert, rule.severity) for group in catalogue.rule_groups(THRESHOLDS)
                 for rule in group.alerts()]
    assert [(rule["alert"], rule["labels"]["severity"]) for rule in ALERT_RULES] == generated


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.section)
def test_every_rule_has_promtool_cases_that_fire_it(family):
    cases = yaml.safe_load((REPO / "rules" / "tests" / f"generated_{family.section}.yml").read_text())
    expected = {(alert["exp_labels"]["alertname"] if "alertname" in alert["exp_labels"] else test_case["alertname"],
                 alert["exp_labels"]["severity"])
                for test in cases["tests"] for test_case in test.get("alert_rule_test", [])
                for alert in test_case["exp_alerts"]}
    for rule in family.alerts(THRESHOLDS):
        assert (rule.alert, rule.severity) in expected, f"{rule.alert} {rule.severity}: no firing case"


def test_every_text_marker_is_a_label_the_value_or_a_query():
    for family in FAMILIES:
        for rule in family.alerts(THRESHOLDS):
            used = markers(rule.summary) | markers(rule.description)
            assert set(rule.queries) <= used, rule.alert


def test_a_healthy_busy_host_gives_no_findings_from_any_detector():
    trace = Trace()

    def process(t):
        s = t - T0
        return process_rows("4242", "vllm", resident=12 * GIB, cpu_seconds=3 * s,
                            minor_faults=900 * s, memlock_limit=float("inf"))

    def process_numa(t):
        return process_numa_rows("4242", "vllm", cpus={"0": 16, "1": 0},
                                 resident={"0": 11 * GIB, "1": GIB})

    engine = Engine(all_detectors(THRESHOLDS), trace.history)
    t = T0
    while t <= T0 + 2400:
        trace.commit("gpu", t, gpu_rows(utilization=0.85, h2d=22e9, d2h=6e9, used=18 * GIB,
                                        numa_node=0, replays=(t - T0) / 60,
                                        processes={"4242": ("vllm", 17 * GIB)}))
        trace.commit("host_memory", t, host_memory_rows(
            swappiness=10, dirty_ratio=15, swap_in=0, swap_out=0, major_faults=2 * (t - T0)))
        trace.commit("pressure", t, pressure_rows(0.001 * (t - T0)))
        trace.commit("process", t, process(t))
        trace.commit("process_numa", t, process_numa(t))
        trace.commit("numa", t, numa_rows(2))
        trace.commit("pcie", t, pcie_rows(numa_node=0, aer={"correctable": 3, "fatal": 0}))
        engine.evaluate(t)
        assert engine.pending() == [] and engine.firing() == [], t
        t += 10
    assert all(count == 0 for count in engine.detector_errors.values())


def test_every_input_is_a_series_the_agent_exports_and_the_judged_collectors_export_some():
    """A family names its inputs by MetricSpec; each is exported by a registered collector or is
    one of the agent's own metrics, so a renamed or dropped series breaks here, not silently."""
    by_collector = {registration.name: {spec.name for spec in registration.collector.metric_specs}
                    for registration in COLLECTORS}
    own = {spec.name for spec in SELF_METRICS}
    for family in FAMILIES:
        # a rule-only family may read only Prometheus's own series (agent_down: `up`)
        assert family.inputs or family.detector is None, family.section
        sources = {name for name, names in by_collector.items()
                   for spec in family.inputs if spec.name in names}
        for spec in family.inputs:
            assert spec.name in own or any(spec.name in names for names in by_collector.values()), (
                family.section, spec.name)
        assert set(family.collectors) <= sources, (family.section, family.collectors, sources)


def test_a_thresholds_file_from_before_a_new_family_still_loads(tmp_path):
    """thresholds.toml invites copying it; a copy made before collector_failing existed must load
    (the new family's keys have defaults) or the agent would not start after an upgrade."""
    shipped = (REPO / "agent" / "alerts" / "thresholds.toml").read_text()
    older = tmp_path / "thresholds.toml"
    older.write_text(shipped.split("\n[collector_failing]")[0] + "\n")
    assert "[collector_failing]" not in older.read_text()
    assert catalogue.load_thresholds(older).collector_failing.for_seconds == 300
    assert catalogue.load_thresholds(older) == THRESHOLDS


def test_a_text_is_filled_again_only_when_a_figure_it_shows_changes(monkeypatch):
    """render() remembers a filled text by the figures the text shows: a figure it does not show
    (the current amount, in a summary that shows the value alone) changes nothing and is not
    filled again; an absent figure is told apart from one that is None ("unknown")."""
    from hybridmon.agent.alerts import family

    filled = []
    real = family.expected_text
    monkeypatch.setattr(family, "expected_text", lambda text, values: filled.append(text) or real(text, values))
    text = "<pid> grows <value|humanize1024>B per hour"
    first = family.render(text, {"pid": "1", "value": 1024.0, "current": 1.0})
    assert family.render(text, {"pid": "1", "value": 1024.0, "current": 2.0}) == first == "1 grows 1kiB per hour"
    assert len(filled) == 1
    assert family.render(text, {"pid": "1", "value": 2048.0, "current": 2.0}) == "1 grows 2kiB per hour"
    shown_or_not = "<if load>load <load><else>no load<end>"
    assert family.render(shown_or_not, {"load": None}) == "no load"
    with pytest.raises(KeyError):
        family.render("<load|humanize> now", {})
    assert family.render("<load|humanize> now", {"load": None}) == "unknown now"
