"""The `host_config` alert family (ADAPTER: to be moved into this module, see family.py)."""
from __future__ import annotations

from hybridmon.agent.alerts.family import AlertFamily
from hybridmon.agent.detectors.base import HostConfig as Settings
from hybridmon.agent.detectors.host_config import HostConfigDetector
from hybridmon.rules import cases_host, host

FAMILY = AlertFamily(
    section="host_config",
    settings=Settings,
    alertnames=HostConfigDetector.alertnames,
    group="hybridmon-host-config",
    detector=HostConfigDetector,
    alerts=lambda t: tuple(host.host_config(t)),
    cases=lambda t, catalog: [cases_host.host_config(t, catalog)],
    collectors=(),
    lookback_seconds=lambda settings: 0.0,
)
