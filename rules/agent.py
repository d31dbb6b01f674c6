"""Rules on the agent itself: HybridmonAlertDeliveryFailing when its own pushes to an
Alertmanager keep failing (agent/alertmanager.py, agent/detectors/alert_delivery.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the schema is built from the families, which import these rules
    from hybridmon.agent.alerts.catalogue import Thresholds

from hybridmon.rules.model import Alert, Group
from hybridmon.rules.promql import duration

CONSECUTIVE_FAILURES = "hybridmon_alertmanager_consecutive_failures"


def alert_delivery_failing(t: Thresholds) -> Alert:
    wait = duration(t.alert_delivery.for_seconds)
    return Alert(
        "HybridmonAlertDeliveryFailing",
        f"{CONSECUTIVE_FAILURES} > 0",
        t.alert_delivery.for_seconds, "warning",
        "Alerts from <instance> are not reaching Alertmanager <alertmanager>",
        f"Every push of the agent's findings on <instance> to the Alertmanager at <alertmanager> has "
        f"failed for {wait} or more (threshold: {wait}), <value> in a row: findings it raises page "
        "nobody through that Alertmanager. The reasons are counted in "
        "hybridmon_alertmanager_failures_total (refused, timeout, protocol, http_5xx...); the "
        "agent's /healthz shows the last error.",
    )


def groups(t: Thresholds) -> list[Group]:
    return [Group("hybridmon-agent", (alert_delivery_failing(t),))]
