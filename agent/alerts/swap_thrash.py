"""The `swap_thrash` alert family (ADAPTER: to be moved into this module, see family.py)."""
from __future__ import annotations

from hybridmon.agent.alerts.family import AlertFamily
from hybridmon.agent.detectors.base import SwapThrash as Settings
from hybridmon.agent.detectors.swap import SwapThrashDetector
from hybridmon.rules import cases_host, host

FAMILY = AlertFamily(
    section="swap_thrash",
    settings=Settings,
    alertnames=('HostSwapThrash',),
    group="hybridmon-host-memory",
    detector=SwapThrashDetector,
    alerts=lambda t: tuple(host.swap_thrash(t)),
    cases=lambda t, catalog: [cases_host.thrash_with_faults(t, catalog), cases_host.thrash_with_pressure(t, catalog), cases_host.no_thrash(t, catalog)],
    collectors=(),
    lookback_seconds=lambda settings: 0.0,
)
