"""HybridmonAlertDeliveryFailing: the agent's own pushes to an Alertmanager keep failing, so the
findings it raises page nobody through that Alertmanager. Runbook: HybridmonAlertDeliveryFailing.md.

Unlike the other detectors this one reads no host history: it asks the Alertmanager pusher
(agent/publish/alertmanager.py) which Alertmanagers its latest push failed to reach. Without a pusher (no
alerting.alertmanager_urls, `hybridmon check`, record mode) it finds nothing. Its finding cannot
reach the broken Alertmanager itself; it shows on /api/v1/findings, the status page and /metrics,
and reaches every other Alertmanager. The Prometheus rule reads the pusher's consecutive-failures
gauge, the same record.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from hybridmon.agent.self_metrics import ALERTMANAGER_CONSECUTIVE_FAILURES, ALERTMANAGER_FAILURES
from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors.base import DetectorBase, Finding, HistoryReader, RunningAgent
from hybridmon.agent.publish.findings import iso_time
from hybridmon.rules import groups
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import duration

if TYPE_CHECKING:
    from hybridmon.agent.publish.alertmanager import DeliveryFailure

ALERTNAME = "HybridmonAlertDeliveryFailing"
INPUTS = (ALERTMANAGER_CONSECUTIVE_FAILURES,)


class Settings(Section):
    for_seconds: float


def alert(s: Settings) -> Alert:
    wait = duration(s.for_seconds)
    return Alert(
        ALERTNAME,
        f"{ALERTMANAGER_CONSECUTIVE_FAILURES.name} > 0",
        s.for_seconds, "warning",
        "Alerts from <instance> are not reaching Alertmanager <alertmanager>",
        f"Every push of the agent's findings on <instance> to the Alertmanager at <alertmanager> has "
        f"failed for {wait} or more (threshold: {wait}), <value> in a row: findings it raises page "
        "nobody through that Alertmanager. The agent keeps retrying with backoff. The reasons are "
        f"counted in {ALERTMANAGER_FAILURES.name} (refused, timeout, protocol, http_5xx...); the agent's /healthz "
        "shows the last error.",
    )


class Detector(DetectorBase):
    """Per Alertmanager (host:port), warning: pushes have failed without a success in between;
    fires once that has lasted for_seconds."""

    name = "alert_delivery"
    alertnames = (ALERTNAME,)
    judges_the_agent = True

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.alert = alert(config)
        self._failing: Callable[[], list[DeliveryFailure]] | None = None

    def attach(self, agent: RunningAgent) -> None:
        """Called once by the agent (daemon.Agent): judge its pusher, when it has one."""
        if agent.pusher is not None:
            self.watch(agent.pusher.failing)

    def watch(self, failing: Callable[[], list[DeliveryFailure]]) -> None:
        """Judge the deliveries `failing()` reports (AlertmanagerPusher.failing)."""
        self._failing = failing

    def evaluate(self, _history: HistoryReader, now: float) -> list[Finding]:
        if self._failing is None:
            return []
        return [self._finding(failure) for failure in self._failing()]

    def _finding(self, failure: DeliveryFailure) -> Finding:
        return finding(self.alert, {"alertmanager": failure.alertmanager},
                       float(failure.consecutive_failures), 1.0,
                       details={"reason": failure.reason, "failing_since": iso_time(failure.failing_since),
                                "last_error": failure.error})


FAMILY = AlertFamily(
    section="alert_delivery",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group=groups.AGENT,
    detector=Detector,
    alerts=lambda t: (alert(t.alert_delivery),),
    collectors=(),
    lookback_seconds=lambda settings: 0.0,
    no_scenario=("it judges the agent's own pushes to Alertmanager, not the host, and a replay "
                 "pushes to none"),
)
