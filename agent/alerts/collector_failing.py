"""HybridmonCollectorFailing: one of the agent's collectors has failed every run for a while, so
its series are absent and every alert that reads them is blind (absent, never zero: nothing fires).
Runbook: HybridmonCollectorFailing.md.

Like alert_delivery, the in-agent door reads the agent's own state rather than the host's history:
the sampler's record of each collector's last run (agent/sampler.py), the record that
hybridmon_collector_success exports for the Prometheus rule. A source absent on this host (no GPU,
no inference server) is a success with no data, never a failure, so a host without a GPU does not
fire.
"""
from __future__ import annotations

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors.base import Finding
from hybridmon.agent.exposition import COLLECTOR_ERRORS, COLLECTOR_SUCCESS
from hybridmon.agent.history import History
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import duration
from hybridmon.rules.scenarios import BEFORE_SAMPLES, Test, firing, not_yet

ALERTNAME = "HybridmonCollectorFailing"
INPUTS = (COLLECTOR_SUCCESS,)


class Settings(Section):
    for_seconds: float


def alert(s: Settings) -> Alert:
    wait = duration(s.for_seconds)
    return Alert(
        ALERTNAME,
        f"{COLLECTOR_SUCCESS.name} == 0",
        s.for_seconds, "warning",
        "Collector <collector> on <instance> keeps failing",
        f"Every run of the agent's <collector> collector on <instance> has failed for {wait} or more "
        f"(threshold: {wait}). Its series are absent while it fails, and absent is never zero: the "
        "alerts and panels that read them stay silent and empty however the host behaves. The "
        "agent log names the error (once a minute while it repeats), /healthz shows the last one and "
        f"{COLLECTOR_ERRORS.name} counts the failed runs; the runbook lists the usual causes per "
        "collector.",
    )


class Detector:
    """Per collector, warning: its last run failed (a source absent on this host is no failure);
    fires once every run has failed for for_seconds, as the engine keeps it pending meanwhile."""

    name = "collector_failing"
    alertnames = (ALERTNAME,)
    min_history_seconds = 0.0

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.alert = alert(config)
        self._scheduled: list = []

    def attach(self, agent) -> None:
        """Called once by the agent (daemon.Agent): judge its sampler's collectors."""
        self._scheduled = list(agent.sampler.scheduled)

    def evaluate(self, _history: History, now: float) -> list[Finding]:
        return [finding(self.alert, {"collector": item.collector.name}, 0.0, 1.0,
                        details={"last_error": item.state.last_error or "", "errors": item.state.errors,
                                 "runs": item.state.runs})
                for item in self._scheduled if item.state.last_success is False]


def cases(t, catalog) -> list[Test]:
    """gpu fails every run from the onset and fires; process fails every other run (never for the
    whole `for`) and pcie never fails: both silent."""
    wait = t.collector_failing.for_seconds
    rule = catalog.find(ALERTNAME)
    test = Test("collector failing: gpu failing from the onset fires; process flapping and pcie "
                "healthy stay silent", firing(wait) + 120, catalog)
    rest = test.samples - BEFORE_SAMPLES
    test.gauge(COLLECTOR_SUCCESS.name, 1, 0, collector="gpu")
    test.add(COLLECTOR_SUCCESS.name, f"1x{BEFORE_SAMPLES - 1} " + " ".join(["0", "1"] * (rest // 2 + 1))[:2 * rest - 1],
             collector="process")
    test.constant(COLLECTOR_SUCCESS.name, 1, collector="pcie")
    test.expect(not_yet(wait), rule.alert)
    test.expect(firing(wait), rule.alert, test.alert(rule, {"collector": "gpu"}, value=0))
    return [test]


FAMILY = AlertFamily(
    section="collector_failing",
    settings=Settings,
    alertnames=Detector.alertnames,
    group="hybridmon-agent",
    detector=Detector,
    alerts=lambda t: (alert(t.collector_failing),),
    cases=cases,
    collectors=(),
    lookback_seconds=lambda settings: 0.0,
)
