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
from hybridmon.rules import groups
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import duration

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
        runbook_served_by_its_agent=False,  # the agent at <instance> is the one that does not answer
    )
    no_targets = Alert(
        ALERTNAME, f"absent({selector})", s.for_seconds, "warning",
        "Prometheus scrapes no hybridmon agent",
        f"Prometheus has had no target in a job matching {s.job_regex} for {wait} or more "
        f"(threshold: {wait}): no hybridmon agent is scraped, so no hybridmon alert can fire "
        "anywhere. Usually the scrape configuration or the ServiceMonitor is not loaded by this "
        "Prometheus, or the agents run on no node.",
        labels={"reason": "no_targets"},
        runbook_served_by_its_agent=False,
    )
    return unreachable, no_targets


FAMILY = AlertFamily(
    section="agent_down",
    settings=Settings,
    inputs=(),
    alertnames=(ALERTNAME,),
    group=groups.AGENT,
    detector=None,
    alerts=lambda t: alerts(t.agent_down),
    collectors=(),
    lookback_seconds=lambda settings: 0.0,
    no_scenario=("a Prometheus rule only: the agent's own death, which no replay of a host shows"),
)
