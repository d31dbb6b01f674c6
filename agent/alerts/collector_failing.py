"""HybridmonCollectorFailing: one of the agent's collectors has failed every run for a while, so
its series are absent and every alert that reads them is blind (absent, never zero: nothing fires).
Runbook: HybridmonCollectorFailing.md.

Like alert_delivery, the in-agent door reads the agent's own state rather than the host's history:
the sampler's record of each collector's last run (agent/loop/sampler.py), the record that
hybridmon_collector_success exports for the Prometheus rule. A source absent on this host (no GPU,
no inference server) is a success with no data, never a failure, so a host without a GPU does not
fire.

HybridmonCollectorHung: a run that has not returned for hung_seconds (NVML blocking on a wedged
driver, a hung NFS read under /proc): its last samples are withheld from /metrics from then on
(agent/publish/exposition.py), so they go stale in Prometheus rather than stand as live, /healthz
says "degraded" and names it, and `hybridmon check` counts it (issue 30: a wedged NVML kept
gpu_up at 1 and the last memory figures exported, and nothing said so). Runbook:
HybridmonCollectorHung.md.
"""
from __future__ import annotations

from collections import deque
from textwrap import dedent

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors.base import DetectorBase, Finding, HistoryReader, RunningAgent
from hybridmon.agent.self_metrics import COLLECTOR_ERRORS, COLLECTOR_RUNNING, COLLECTOR_SUCCESS
from hybridmon.rules import groups
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import duration

ALERTNAME = "HybridmonCollectorFailing"
HUNG_ALERTNAME = "HybridmonCollectorHung"
INPUTS = (COLLECTOR_SUCCESS, COLLECTOR_ERRORS, COLLECTOR_RUNNING)


class Settings(Section):
    # A default, unlike the older families: thresholds files copied before this alert existed
    # (as thresholds.toml invites) still load, and get the shipped value.
    for_seconds: float = 300.0
    hung_seconds: float = 60.0


def alert(s: Settings) -> Alert:
    wait = duration(s.for_seconds)
    return Alert(
        ALERTNAME,
        dedent(f"""\
            # the failed runs over the last `for`...
            increase({COLLECTOR_ERRORS.name}[{wait}])
            # ...of a collector whose last run failed (no data on this host is a success)
            and on (job, instance, collector)
            {COLLECTOR_SUCCESS.name} == 0"""),
        s.for_seconds, "warning",
        "Collector <collector> on <instance> keeps failing: <value|humanize> failed runs in "
        f"the last {wait}",
        f"Every run of the agent's <collector> collector on <instance> has failed for {wait} or more "
        f"(threshold: {wait}; <value|humanize> failed runs in that time). Its series are absent while it fails, and absent is never zero: the "
        "alerts and panels that read them stay silent and empty however the host behaves. The "
        "agent log names the error (once a minute while it repeats), /healthz shows the last one and "
        f"{COLLECTOR_ERRORS.name} counts the failed runs; the runbook lists the usual causes per "
        "collector.",
    )


def hung_alert(s: Settings) -> Alert:
    return Alert(
        HUNG_ALERTNAME,
        f"{COLLECTOR_RUNNING.name} >= {s.hung_seconds:g}",
        0, "warning",
        "Collector <collector> on <instance> is hung: its run has not returned for <value|humanizeDuration>",
        "The agent's <collector> collector on <instance> started a run <value|humanizeDuration> ago that "
        f"has not returned (threshold: {duration(s.hung_seconds)}): its source blocks (NVML on a "
        "wedged driver or a GPU that fell off the bus, a hung file system under /proc or /sys, an "
        "endpoint that accepts and never answers within its own deadline). Its last samples are "
        "withheld from /metrics while it hangs, so its series go stale rather than stand as live, "
        "and the alerts that read them are blind; /healthz says degraded and names it. A restart "
        "of the agent does not unblock a wedged driver; the runbook says what does.",
    )


class Detector(DetectorBase):
    """Per collector, warning: its last run failed (a source absent on this host is no failure);
    fires once every run has failed for for_seconds, as the engine keeps it pending meanwhile. Its
    value is the failed runs over the last for_seconds, as the rule's increase() counts them."""

    name = "collector_failing"
    alertnames = (ALERTNAME, HUNG_ALERTNAME)
    judges_the_agent = True

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.alert = alert(config)
        self.hung_alert = hung_alert(config)
        self._scheduled: list = []
        self._sampler = None
        # (time, errors so far) per collector at each evaluation, for the failed runs in the window
        self._errors_seen: dict[str, deque[tuple[float, int]]] = {}

    def attach(self, agent: RunningAgent) -> None:
        """Called once by the agent (daemon.Agent): judge its sampler's collectors."""
        self._scheduled = list(agent.sampler.scheduled)
        self._sampler = agent.sampler

    def evaluate(self, _history: HistoryReader, now: float) -> list[Finding]:
        findings = []
        for item in self._scheduled:
            name, state = item.collector.name, item.state
            seen = self._errors_seen.setdefault(name, deque())
            seen.append((now, state.errors))
            while len(seen) > 1 and seen[1][0] <= now - self.config.for_seconds:
                seen.popleft()
            if state.last_success is False:
                failed_runs = float(state.errors - seen[0][1]) or 1.0  # the failure seen first counts
                findings.append(finding(
                    self.alert, {"collector": name}, failed_runs, 1.0, unit="runs",
                    details={"last_error": state.last_error or "", "errors": state.errors, "runs": state.runs}))
        if self._sampler is not None:
            for name, running in sorted(self._sampler.hung(self.config.hung_seconds).items()):
                findings.append(finding(self.hung_alert, {"collector": name}, running, self.config.hung_seconds,
                                        unit="s", details={"running_seconds": running}))
        return findings


FAMILY = AlertFamily(
    section="collector_failing",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group=groups.AGENT,
    detector=Detector,
    alerts=lambda t: (alert(t.collector_failing), hung_alert(t.collector_failing)),
    collectors=(),
    lookback_seconds=lambda settings: 0.0,
    no_scenario=("it judges the agent's own collectors, which a replay runs on good readings"),
)
