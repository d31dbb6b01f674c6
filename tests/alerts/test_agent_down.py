"""The tests of the agent_down alert family (agent/alerts/agent_down.py): its rule's promtool cases
(`promtool_cases`, written to rules/tests/generated_agent_down.yml by `python -m tests.rules.generate`
and run by promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

from hybridmon.agent.alerts.agent_down import ALERTNAME, UP
from tests.support.promtool_cases import BEFORE_SAMPLES, Test, firing, not_yet


def promtool_cases(t, catalog) -> list[Test]:
    """down:9787 fails every scrape from the onset and fires; flapping:9787 fails every other
    scrape (never for the whole `for`) and healthy:9787 never fails: both silent. A second test
    has no hybridmon target at all: the no-targets rule fires."""
    s = t.agent_down
    unreachable = catalog.find(ALERTNAME, reason="unreachable")
    no_targets = catalog.find(ALERTNAME, reason="no_targets")
    at = firing(s.for_seconds)
    test = Test("agent down: an agent failing every scrape fires; one failing every other scrape "
                "and a healthy one stay silent", at + 60, catalog)
    test.gauge(UP, 1, 0, instance="down:9787")
    rest = test.samples - BEFORE_SAMPLES
    test.add(UP, f"1x{BEFORE_SAMPLES - 1} " + " ".join(["0", "1"] * rest)[:2 * rest - 1],
             instance="flapping:9787")
    test.constant(UP, 1, instance="healthy:9787")
    test.expect(not_yet(s.for_seconds), ALERTNAME)
    test.expect(at, ALERTNAME, test.alert(unreachable, {}, instance="down:9787", value=0))

    # absent() keeps no label of a regex matcher: the alert names no job and no instance.
    gone = Test("agent down: the only hybridmon target vanishes from discovery at the onset; the "
                "no-targets rule fires", at + 60, catalog)
    gone.gauge(UP, 1, None)                                      # stale from the onset
    gone.constant(UP, 1, instance="gpu-host-1:9100", job="node")  # another job's target: no help
    gone.expect(not_yet(s.for_seconds), ALERTNAME)
    expected = gone.alert(no_targets, {}, instance="", value=1)
    expected["exp_labels"] = {"severity": "warning", "reason": "no_targets"}
    gone.expect(at, ALERTNAME, expected)
    return [test, gone]
