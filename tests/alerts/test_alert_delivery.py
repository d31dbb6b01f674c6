"""The tests of the alert_delivery alert family (agent/alerts/alert_delivery.py): its rule's promtool cases
(`promtool_cases`, written to rules/tests/generated_alert_delivery.yml by `python -m tests.rules.generate`
and run by promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

from hybridmon.agent.alerts.alert_delivery import ALERTNAME
from hybridmon.agent.self_metrics import ALERTMANAGER_CONSECUTIVE_FAILURES
from tests.support.promtool_cases import (
    BEFORE_SAMPLES,
    ONSET,
    STEP,
    Test,
    firing,
    not_yet,
)


def promtool_cases(t, catalog) -> list[Test]:
    """am-1 fails every push from the onset (one more each 30 s); am-2 fails once and recovers,
    am-3 never fails: only am-1 fires."""
    wait = t.alert_delivery.for_seconds
    rule = catalog.find(ALERTNAME)
    test = Test("alert delivery: one Alertmanager failing from the onset fires; one failing a single "
                "push and one healthy stay silent", firing(wait) + 120, catalog)
    rest = test.samples - BEFORE_SAMPLES
    # One more failure per sample after the onset: the push loop retries with backoff.
    test.add(ALERTMANAGER_CONSECUTIVE_FAILURES.name, f"0x{BEFORE_SAMPLES - 1} 1+1x{rest - 1}", alertmanager="am-1:9093")
    test.add(ALERTMANAGER_CONSECUTIVE_FAILURES.name, f"0x{BEFORE_SAMPLES - 1} 1 0x{rest - 2}", alertmanager="am-2:9093")
    test.constant(ALERTMANAGER_CONSECUTIVE_FAILURES.name, 0, alertmanager="am-3:9093")
    at = firing(wait)
    test.expect(not_yet(wait), rule.alert)
    test.expect(at, rule.alert,
                test.alert(rule, {"alertmanager": "am-1:9093"}, value=(at - ONSET) // STEP))
    return [test]
