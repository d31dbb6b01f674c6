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
from hybridmon.agent.detectors.base import Finding
from hybridmon.agent.publish.findings import iso_time
from hybridmon.agent.loop.history import History
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import duration
from hybridmon.rules.promtool_cases import BEFORE_SAMPLES, ONSET, STEP, Test, firing, not_yet

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


class Detector:
    """Per Alertmanager (host:port), warning: pushes have failed without a success in between;
    fires once that has lasted for_seconds."""

    name = "alert_delivery"
    alertnames = (ALERTNAME,)
    min_history_seconds = 0.0

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.alert = alert(config)
        self._failing: Callable[[], list[DeliveryFailure]] | None = None

    def attach(self, agent) -> None:
        """Called once by the agent (daemon.Agent): judge its pusher, when it has one."""
        if agent.pusher is not None:
            self.watch(agent.pusher.failing)

    def watch(self, failing: Callable[[], list[DeliveryFailure]]) -> None:
        """Judge the deliveries `failing()` reports (AlertmanagerPusher.failing)."""
        self._failing = failing

    def evaluate(self, _history: History, now: float) -> list[Finding]:
        if self._failing is None:
            return []
        return [self._finding(failure) for failure in self._failing()]

    def _finding(self, failure: DeliveryFailure) -> Finding:
        return finding(self.alert, {"alertmanager": failure.alertmanager},
                       float(failure.consecutive_failures), 1.0,
                       details={"reason": failure.reason, "failing_since": iso_time(failure.failing_since),
                                "last_error": failure.error})


def cases(t, catalog) -> list[Test]:
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


FAMILY = AlertFamily(
    section="alert_delivery",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group="hybridmon-agent",
    detector=Detector,
    alerts=lambda t: (alert(t.alert_delivery),),
    cases=cases,
    collectors=(),
    lookback_seconds=lambda settings: 0.0,
)
