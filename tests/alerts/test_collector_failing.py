"""The tests of the collector_failing alert family (agent/alerts/collector_failing.py): its rule's promtool cases
(`promtool_cases`, written to rules/tests/generated_collector_failing.yml by `python -m tests.rules.generate`
and run by promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

from hybridmon.agent.alerts.collector_failing import ALERTNAME
from hybridmon.agent.self_metrics import COLLECTOR_ERRORS, COLLECTOR_SUCCESS

from tests.support.promtool_cases import BEFORE_SAMPLES, Test, firing, not_yet


def promtool_cases(t, catalog) -> list[Test]:
    """gpu fails every run (one a second) from the onset and fires; process fails every other
    sample (never for the whole `for`) and pcie never fails: both silent."""
    wait = t.collector_failing.for_seconds
    rule = catalog.find(ALERTNAME)
    test = Test("collector failing: gpu failing from the onset fires; process flapping and pcie "
                "healthy stay silent", firing(wait) + 120, catalog)
    rest = test.samples - BEFORE_SAMPLES
    test.gauge(COLLECTOR_SUCCESS.name, 1, 0, collector="gpu")
    test.counter(COLLECTOR_ERRORS.name, 0, 1.0, collector="gpu")
    flapping = " ".join(["0", "1"] * rest)[:2 * rest - 1]
    test.add(COLLECTOR_SUCCESS.name, f"1x{BEFORE_SAMPLES - 1} {flapping}", collector="process")
    test.counter(COLLECTOR_ERRORS.name, 0, 0.5, collector="process")
    test.constant(COLLECTOR_SUCCESS.name, 1, collector="pcie")
    test.constant(COLLECTOR_ERRORS.name, 0, collector="pcie")
    test.expect(not_yet(wait), rule.alert)
    test.expect(firing(wait), rule.alert, test.alert(rule, {"collector": "gpu"}, value=wait * 1.0))
    return [test]
