"""The tests of the sampling_lag alert family (agent/alerts/sampling_lag.py): its rule's promtool cases
(`promtool_cases`, written to rules/tests/generated_sampling_lag.yml by `python -m tests.rules.generate`
and run by promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

from hybridmon.agent.alerts.sampling_lag import ALERTNAME
from hybridmon.agent.self_metrics import LOOP_SCHEDULED, LOOP_TICKS

from tests.support.promtool_cases import ONSET, Test, not_yet


def promtool_cases(t, catalog) -> list[Test]:
    """Five agents, the loop at 1 s, all started with the test (young series: the healthy ones
    must not fire while rate() underestimates): one runs half its ticks from the onset and one
    stops (both fire); one runs 95 % (above the threshold), one all, and a replay runs none but
    schedules none either: all three silent. Checked once the whole window is after the onset, where a linear
    counter gives the exact share whatever the Prometheus version's window edges."""
    s = t.sampling_lag
    rule = catalog.find(ALERTNAME)
    at = ONSET + 60 * (int(s.window_seconds + s.for_seconds) // 60 + 1)
    test = Test("sampling loop: half the ticks and none fire; 95 %, every tick and a replay stay "
                "silent", at + 60, catalog)
    agents = {"lagging:9787": 0.5, "stopped:9787": 0.0, "busy:9787": 0.95, "healthy:9787": 1.0}
    for instance, share in agents.items():
        test.counter(LOOP_TICKS.name, 1.0, share, instance=instance)
        test.counter(LOOP_SCHEDULED.name, 1.0, 1.0, instance=instance)
    test.constant(LOOP_TICKS.name, 0, instance="replay:9787")
    test.expect(not_yet(s.for_seconds), rule.alert)
    test.expect(at, rule.alert, *(test.alert(rule, {}, instance=instance, value=agents[instance])
                                  for instance in ("lagging:9787", "stopped:9787")))
    return [test]
