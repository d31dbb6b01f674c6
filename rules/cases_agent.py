"""promtool tests for the rules on the agent itself."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the schema is built from the families, which import these rules
    from hybridmon.agent.alerts.catalogue import Thresholds

from hybridmon.rules.scenarios import BEFORE_SAMPLES, ONSET, STEP, Catalog, Test, firing, not_yet

FAILURES = "hybridmon_alertmanager_consecutive_failures"


def alert_delivery_failing(t: Thresholds, catalog: Catalog) -> Test:
    """am-1 fails every push from the onset (one more each 30 s); am-2 fails once and recovers,
    am-3 never fails: only am-1 fires."""
    wait = t.alert_delivery.for_seconds
    rule = catalog.find("HybridmonAlertDeliveryFailing")
    test = Test("alert delivery: one Alertmanager failing from the onset fires; one failing a single "
                "push and one healthy stay silent", firing(wait) + 120, catalog)
    rest = test.samples - BEFORE_SAMPLES
    # One more failure per sample after the onset: the push loop retries with backoff.
    test.add(FAILURES, f"0x{BEFORE_SAMPLES - 1} 1+1x{rest - 1}", alertmanager="am-1:9093")
    test.add(FAILURES, f"0x{BEFORE_SAMPLES - 1} 1 0x{rest - 2}", alertmanager="am-2:9093")
    test.constant(FAILURES, 0, alertmanager="am-3:9093")
    at = firing(wait)
    test.expect(not_yet(wait), rule.alert)
    test.expect(at, rule.alert,
                test.alert(rule, {"alertmanager": "am-1:9093"}, value=(at - ONSET) // STEP))
    return test


def files(t: Thresholds, catalog: Catalog) -> dict[str, list[Test]]:
    return {"agent": [alert_delivery_failing(t, catalog)]}
