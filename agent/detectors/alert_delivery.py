"""HybridmonAlertDeliveryFailing: the agent's own pushes to an Alertmanager keep failing.

Unlike the other detectors this one reads no host history: it asks the Alertmanager pusher
(agent/alertmanager.py) which Alertmanagers its latest push failed to reach. Without a pusher (no
alerting.alertmanager_urls, `hybridmon check`, record mode) it finds nothing. Its finding cannot
reach the broken Alertmanager itself; it shows on /api/v1/findings, the status page and /metrics,
and reaches every other Alertmanager. The Prometheus rule of the same name reads
hybridmon_alertmanager_consecutive_failures.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from hybridmon.agent.detectors import common
from hybridmon.agent.detectors.base import AlertDelivery, Finding
from hybridmon.agent.findings import iso_time
from hybridmon.agent.history import History

if TYPE_CHECKING:
    from hybridmon.agent.alertmanager import DeliveryFailure

ALERTNAME = "HybridmonAlertDeliveryFailing"


class AlertDeliveryDetector:
    """Per Alertmanager (host:port), warning: pushes have failed without a success in between;
    fires once that has lasted for_seconds."""

    name = "alert_delivery"
    alertnames = (ALERTNAME,)
    min_history_seconds = 0.0

    def __init__(self, config: AlertDelivery) -> None:
        self.config = config
        self._failing: Callable[[], list[DeliveryFailure]] | None = None

    def watch(self, failing: Callable[[], list[DeliveryFailure]]) -> None:
        """Judge the deliveries `failing()` reports (AlertmanagerPusher.failing)."""
        self._failing = failing

    def evaluate(self, _history: History, now: float) -> list[Finding]:
        if self._failing is None:
            return []
        return [self._finding(failure, now) for failure in self._failing()]

    def _finding(self, failure: DeliveryFailure, now: float) -> Finding:
        name, wait = failure.alertmanager, common.human_duration(self.config.for_seconds)
        since = iso_time(failure.failing_since)
        return Finding(
            alertname=ALERTNAME,
            severity="warning",
            labels={"alertmanager": name},
            value=float(failure.consecutive_failures),
            threshold=1.0,
            unit="",
            for_seconds=self.config.for_seconds,
            summary=f"Alerts are not reaching Alertmanager {name} since {since}: {failure.reason}",
            description=(
                f"Every push of this agent's alerts to the Alertmanager at {name} has failed since "
                f"{since} ({failure.consecutive_failures} in a row; threshold: failing for {wait}); "
                f"the last: {failure.error}. Findings raised meanwhile page nobody through that "
                f"Alertmanager. The agent keeps retrying with backoff; its /healthz and "
                f"hybridmon_alertmanager_failures_total count the failures by reason."),
            details={"reason": failure.reason, "failing_since": since},
        )
