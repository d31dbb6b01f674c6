"""`hybridmon check`: a one-shot health check of this host, with an exit code.

It samples for a short window, then asks every detector that can judge such a window whether its
condition holds at the end. `for` durations are not waited out: a check reports what it saw.
Detectors that need more history than the window, or a GPU this host does not have, are listed as
skipped with the reason. A check that could not read what every Linux host has (memory, NUMA nodes,
processes, pressure) says so with exit 3 instead of calling the host healthy.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import TextIO

from hybridmon import __version__
from hybridmon.agent.alerts import catalogue
from hybridmon.agent.alerts.family import finding as new_finding
from hybridmon.agent.config import AgentConfig
from hybridmon.agent.daemon import Agent
from hybridmon.agent.detectors.base import Finding
from hybridmon.agent.detectors.engine import EvaluationView
from hybridmon.agent.publish.findings import SEVERITY_ORDER, iso_time
from hybridmon.agent.commands.progress import LiveLine
from hybridmon.agent.api.runbooks import runbooks_directory
from hybridmon.exporters.base import Samples
from hybridmon.exporters.registry import COLLECTORS

EXIT_HEALTHY, EXIT_WARNING, EXIT_CRITICAL, EXIT_COULD_NOT_RUN = 0, 1, 2, 3
# After the window, how long the collectors still running get to finish: a run longer than the
# window plus this has a source that blocks (NVML on a wedged driver: issue 30, where `check
# --duration 2` printed after ~12 s and never exited). Every source answers in well under it.
HUNG_GRACE_SECONDS = 3.0
# Detectors that average over a minute judge a shorter window on the points it has.
AVERAGING_SECONDS = 60.0
# What every Linux host can be read by (each registration says why it is essential); without any
# one of them a check cannot vouch for the host, so a failure, nothing found to read, or no run at
# all is exit 3, naming the collector.
ESSENTIAL_COLLECTORS = tuple(sorted(registration.name for registration in COLLECTORS if registration.essential))
# Absences that are a kernel setting, not a broken read (PSI off by default on RHEL 8).
MAY_HAVE_NO_DATA = frozenset(registration.name for registration in COLLECTORS if registration.may_have_no_data)
# A collector succeeds on part of its files; these series show the part a check cannot do without
# was read: collector -> ((series name, file under procfs), ...).
ESSENTIAL_SERIES = {
    registration.name: tuple((spec.name, file) for spec, file in registration.essential_series)
    for registration in COLLECTORS if registration.essential_series
}


@dataclass(frozen=True)
class Skipped:
    detector: str
    reason: str


@dataclass(frozen=True)
class CheckResult:
    findings: list[Finding]
    skipped: list[Skipped]
    collector_failures: dict[str, str]
    duration_seconds: float
    # Essential collectors that failed, found nothing or did not run: the check cannot vouch for the host.
    could_not_read: dict[str, str]
    # Collectors whose run had not returned when the check ended (their threads are abandoned).
    hung: tuple[str, ...] = ()

    def exit_code(self, strict: bool = False) -> int:
        if self.could_not_read:
            return EXIT_COULD_NOT_RUN
        severities = {f.severity for f in self.findings}
        if "critical" in severities:
            return EXIT_CRITICAL
        if "warning" in severities or (strict and "info" in severities):
            return EXIT_WARNING
        return EXIT_HEALTHY


def run_check(config: AgentConfig, duration_seconds: float, progress: LiveLine | None = None) -> CheckResult:
    agent = Agent(config.model_copy(update={"detectors": config.detectors.model_copy(update={"enabled": False})}))
    started = time.monotonic()
    hung: tuple[str, ...] = ()
    try:
        agent.start()
        _wait(started, duration_seconds, progress)
        hung = tuple(agent.sampler.stop(HUNG_GRACE_SECONDS))
        # A collector that waits for another's first run (process_numa after process after gpu)
        # may not have had its turn in a short or loaded window: give it one now, in order.
        for item in agent.sampler.scheduled:
            if item.state.runs == 0:
                agent.sampler.run_collector(item)
        now = time.time()
        states = {item.collector.name: item.state for item in agent.sampler.scheduled}
        failures = {name: s.last_error or "failed" for name, s in states.items() if s.last_success is False}
        could_not_read = _essential_unread(config, states, failures, agent.history.latest())

        def missing_source(detector: str) -> str | None:
            # The collectors the family judges: when one found no source on this host (no GPU, no
            # benchmark run, no inference server), the detector is skipped with its reason.
            for collector in catalogue.family(detector).collectors:
                state = states.get(collector)
                if state is None:
                    return f"the {collector} collector is disabled"
                if state.no_data_reason:
                    return state.no_data_reason
                if collector in failures:
                    return f"the {collector} collector failed: {failures[collector]}"
            return None

        view = EvaluationView(agent.history)
        findings, skipped = [], []
        for detector in agent.engine.detectors:
            if detector.judges_the_agent:
                # It judges the running agent (alert delivery, collectors failing for minutes); a
                # check reports its own collector failures and exits 3 on the essential ones.
                continue
            needs = detector.min_history_seconds
            missing = missing_source(detector.name)
            if missing:
                skipped.append(Skipped(detector.name, missing))
            elif needs > max(duration_seconds, AVERAGING_SECONDS):
                skipped.append(Skipped(detector.name, f"needs {needs / 60:g} min of history; run the agent to judge it"))
            else:
                findings.extend(detector.evaluate(view, now))
        findings += _hung_findings(agent, hung)
        findings.sort(key=lambda f: (SEVERITY_ORDER.get(f.severity, 9), f.alertname, sorted(f.labels.items())))
        return CheckResult(findings, skipped, failures, time.monotonic() - started, could_not_read, hung)
    finally:
        agent.stop(timeout=0.0 if hung else 5.0)


def _hung_findings(agent: Agent, hung: tuple[str, ...]) -> list[Finding]:
    """A HybridmonCollectorHung finding for each collector still running when the check ended,
    however long it had run: the check cannot wait the alert's minute, and a source that blocks
    past the window and its grace blocks the check's report too."""
    detector = next(d for d in agent.engine.detectors if d.name == "collector_failing")
    running = agent.sampler.hung(0.0)
    return [new_finding(detector.hung_alert, {"collector": name}, running.get(name, 0.0),
                    detector.config.hung_seconds, unit="s", details={"running_seconds": running.get(name, 0.0)})
            for name in hung]


def _wait(started: float, duration_seconds: float, progress: LiveLine | None) -> None:
    """Sleep out the sampling window, showing how much of it is left on a terminal."""
    if progress is None or not progress.interactive:
        time.sleep(duration_seconds)
        return
    while (elapsed := time.monotonic() - started) < duration_seconds:
        progress.show(f"hybridmon check: sampling this host, {elapsed:.0f} of {duration_seconds:g} s")
        time.sleep(min(0.5, duration_seconds - elapsed))
    progress.show("hybridmon check: judging")  # the caller clears the line before printing


def _essential_unread(config: AgentConfig, states: dict, failures: dict[str, str], latest: dict) -> dict[str, str]:
    """The essential collectors the check could not read, with the reason (see ESSENTIAL_COLLECTORS).
    A collector the configuration turns off is the operator's choice, not a failure to read."""
    problems = {}
    for name in ESSENTIAL_COLLECTORS:
        state = states.get(name)
        if state is None:
            continue
        if name in failures:
            problems[name] = f"failed: {failures[name]}"
        elif state.runs == 0:
            problems[name] = "never ran"
        elif state.no_data_reason and name not in MAY_HAVE_NO_DATA:
            problems[name] = state.no_data_reason
        else:
            samples = latest.get(name, (None, Samples()))[1]
            unread = [os.path.join(config.paths.procfs, file) for series, file in ESSENTIAL_SERIES.get(name, ())
                      if not samples.find(series)]
            if unread:
                problems[name] = f"read nothing from {' nor '.join(unread)}"
    return problems


def runbook_path(alertname: str) -> str:
    return str(runbooks_directory() / f"{alertname}.md")


def render_table(result: CheckResult, out: TextIO) -> None:
    rows = [("SEVERITY", "FINDING", "ENTITY", "VALUE", "THRESHOLD")]
    for finding in result.findings:
        entity = ",".join(f"{k}={v}" for k, v in sorted(finding.labels.items())) or "host"
        rows.append((finding.severity, finding.alertname, entity, _number(finding.value, finding.unit), _number(finding.threshold, finding.unit)))
    if result.findings:
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        for row in rows:
            out.write("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() + "\n")
        out.write("\n")
        for finding in result.findings:
            out.write(f"{finding.alertname}: {finding.summary}\n  runbook: {runbook_path(finding.alertname)}\n")
    elif result.could_not_read:
        out.write("No findings, but not healthy either: the check could not read this host.\n")
    elif result.skipped:
        # A skipped detector never judged: its silence is not health (issue 14, item 9).
        out.write("No findings from the detectors that judged this window; the ones skipped below "
                  "did not look, so this says nothing about them.\n")
    else:
        out.write("No findings: nothing wrong was seen in this window.\n")
    by_reason: dict[str, list[str]] = {}
    for skipped in result.skipped:
        by_reason.setdefault(skipped.reason, []).append(skipped.detector)
    for reason, detectors in by_reason.items():
        out.write(f"skipped {', '.join(detectors)}: {reason}\n")
    for collector, error in sorted(result.collector_failures.items()):
        out.write(f"collector {collector} failed: {error}\n")
    for collector, reason in sorted(result.could_not_read.items()):
        if collector not in result.collector_failures:
            out.write(f"collector {collector} could not read the host: {reason}\n")


def render_json(result: CheckResult, strict: bool) -> str:
    # when, where and by which version: reports collected from many hosts are told apart (issue 32)
    return json.dumps({
        "checked_at": iso_time(time.time()),
        "host": socket.gethostname(),
        "version": __version__,
        "exit_code": result.exit_code(strict),
        "duration_seconds": round(result.duration_seconds, 3),
        "findings": [
            {"alertname": f.alertname, "severity": f.severity, "labels": f.labels, "value": f.value,
             "threshold": f.threshold, "unit": f.unit, "summary": f.summary,
             "description": f.description, "runbook": runbook_path(f.alertname), "details": f.details}
            for f in result.findings
        ],
        "skipped": [{"detector": s.detector, "reason": s.reason} for s in result.skipped],
        "collector_failures": result.collector_failures,
        "could_not_read": result.could_not_read,
        "reason": could_not_read_line(result.could_not_read) if result.could_not_read else None,
    }, indent=2)


def could_not_read_line(problems: dict[str, str]) -> str:
    return ("hybridmon check could not read this host, so it cannot call it healthy: "
            + "; ".join(f"{name}: {reason}" for name, reason in sorted(problems.items())))


def _number(value: float, unit: str) -> str:
    if value == float("inf"):
        return "unlimited"
    if unit == "ratio":
        return f"{value:.0%}"
    if unit in ("bytes", "B", "bytes/s", "B/s"):
        per_second = "/s" if unit.endswith("/s") else ""
        for scale, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(value) >= scale:
                return f"{value / scale:.1f} {suffix}{per_second}"
        return f"{value:g} B{per_second}"
    return f"{value:.3g} {unit}".rstrip()


def main(config: AgentConfig, duration_seconds: float, as_json: bool, strict: bool) -> int:
    progress = LiveLine(sys.stderr)
    try:
        with progress.apart_from_logs():
            result = run_check(config, duration_seconds, progress)
    except Exception as error:  # a check that cannot run says so with its own exit code
        reason = f"hybridmon check could not run: {error}"
        print(reason, file=sys.stderr)
        if as_json:  # a JSON reader gets a document whatever happened
            print(json.dumps({"checked_at": iso_time(time.time()), "host": socket.gethostname(),
                              "version": __version__, "exit_code": EXIT_COULD_NOT_RUN, "reason": reason, "findings": [],
                              "skipped": [], "collector_failures": {}, "could_not_read": {}}, indent=2))
        return EXIT_COULD_NOT_RUN
    if result.could_not_read:
        print(could_not_read_line(result.could_not_read), file=sys.stderr)
    if as_json:
        print(render_json(result, strict))
    else:
        render_table(result, sys.stdout)
    code = result.exit_code(strict)
    if result.hung:
        # Python waits for every thread at exit, and one blocked in NVML never returns
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


