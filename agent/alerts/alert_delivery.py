"""The `alert_delivery` alert family (ADAPTER: to be moved into this module, see family.py)."""
from __future__ import annotations

from hybridmon.agent.alerts.family import AlertFamily
from hybridmon.agent.detectors.base import AlertDelivery as Settings
from hybridmon.agent.detectors.alert_delivery import AlertDeliveryDetector
from hybridmon.rules import agent, cases_agent

FAMILY = AlertFamily(
    section="alert_delivery",
    settings=Settings,
    alertnames=('HybridmonAlertDeliveryFailing',),
    group="hybridmon-agent",
    detector=AlertDeliveryDetector,
    alerts=lambda t: (agent.alert_delivery_failing(t),),
    cases=lambda t, catalog: [cases_agent.alert_delivery_failing(t, catalog)],
    collectors=(),
    lookback_seconds=lambda settings: 0.0,
)
