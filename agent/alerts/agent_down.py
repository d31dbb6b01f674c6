"""HybridmonAgentDown: Prometheus cannot scrape a hybridmon agent, or scrapes none at all, so every
alert hybridmon raises for those hosts is silent. Runbook: HybridmonAgentDown.md.

A rule-only family: an agent cannot report its own death, so there is no in-agent detector
(family.py: `detector=None`). Both rules read `up`, which Prometheus itself writes for every
scrape (1: the scrape succeeded, 0: it failed; "Jobs and instances", Prometheus documentation),
of the jobs matching `job_regex`: `hybridmon` in deploy/prometheus/prometheus.yml, and the
Service's name, `hybridmon`, for the ServiceMonitor in deploy/kubernetes (the Prometheus Operator
names the job after the Service unless the ServiceMonitor sets jobLabel).
"""
from __future__ import annotations

from hybridmon.agent.alerts.family import AlertFamily, Section
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import duration
from hybridmon.rules.promtool_cases import BEFORE_SAMPLES, Test, firing, not_yet

ALERTNAME = "HybridmonAgentDown"
# Prometheus's own series: no hybridmon MetricSpec declares it.
UP = "up"


class Settings(Section):
    # Defaults: a thresholds file copied before this alert existed still loads.
    for_seconds: float = 300.0
    job_regex: str = "hybridmon.*"


def alerts(s: Settings) -> tuple[Alert, ...]:
    wait = duration(s.for_seconds)
    selector = f'{UP}{{job=~"{s.job_regex}"}}'
    unreachable = Alert(
        ALERTNAME, f"{selector} == 0", s.for_seconds, "warning",
        "hybridmon agent <instance> is down: Prometheus cannot scrape it",
        f"Prometheus has failed to scrape the hybridmon agent at <instance> (job <job>) for {wait} "
        f"or more (threshold: {wait}). Every hybridmon alert for that host is silent meanwhile, "
        "the agent's own pushes to Alertmanager included, and its dashboard panels are empty. "
        "The agent cannot report its own death: this rule is the only door. Prometheus's "
        "targets page says why the scrape fails (connection refused, timeout, HTTP error).",
        labels={"reason": "unreachable"},
    )
    no_targets = Alert(
        ALERTNAME, f"absent({selector})", s.for_seconds, "warning",
        "Prometheus scrapes no hybridmon agent",
        f"Prometheus has had no target in a job matching {s.job_regex} for {wait} or more "
        f"(threshold: {wait}): no hybridmon agent is scraped, so no hybridmon alert can fire "
        "anywhere. Usually the scrape configuration or the ServiceMonitor is not loaded by this "
        "Prometheus, or the agents run on no node.",
        labels={"reason": "no_targets"},
    )
    return unreachable, no_targets


def cases(t, catalog) -> list[Test]:
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


FAMILY = AlertFamily(
    section="agent_down",
    settings=Settings,
    inputs=(),
    alertnames=(ALERTNAME,),
    group="hybridmon-agent",
    detector=None,
    alerts=lambda t: alerts(t.agent_down),
    cases=cases,
    collectors=(),
    lookback_seconds=lambda settings: 0.0,
)
