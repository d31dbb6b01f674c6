"""The status page served at GET /: what is wrong with this host and the signals behind it, for a
host without Grafana.

Server-rendered from what the agent already holds: the findings of its engine, then the latest
signals per GPU, watched process and host, and the last benchmark (agent/status/signals.py), and
per scraped inference server (agent/status/inference.py). The judging is the detectors' job: the
page lays out their findings first and flags only what is plainly broken (a lost GPU, a failing
collector, a failing scrape). HTML and its escaping: agent/status/template.py.
"""
from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING

from hybridmon import __version__
from hybridmon.agent.detectors.engine import FindingState
from hybridmon.agent.publish.findings import SEVERITY_ORDER, runbook_url
from hybridmon.agent.status.inference import inference_html
from hybridmon.agent.status.signals import Decided, LatestValues, bench_html, gpus_html, host_html, processes_html
from hybridmon.agent.status.trends import Trends
from hybridmon.agent.status.template import (
    Row, card, clock, clock_and_age, esc, key_values, link, page, paragraph, section,
)
from hybridmon.agent.warmup import summary as warming_summary, warming_up
from hybridmon.units import human_duration

if TYPE_CHECKING:
    from hybridmon.agent.daemon import Agent

SEVERITIES = ("critical", "warning", "info")


def render_status_page(agent: Agent) -> str:
    latest = LatestValues(agent.history)
    # A replay serves recorded time: ages are measured from its last sample, not from today.
    now = (latest.newest or time.time()) if agent.mode == "replay" else time.time()
    states = [s for s in agent.engine.states() if s.state in ("firing", "pending")]
    states.sort(key=lambda s: (SEVERITY_ORDER.get(s.finding.severity, 9), s.state != "firing",
                               s.finding.alertname, s.key[1]))
    banner_class, banner_text, banner_detail = banner(agent, states, latest, now)
    # The plots end at the newest sample, like the minute's rates: a replay's hour is recorded time.
    trends = Trends(agent.history, agent.engine, agent.thresholds, latest.newest)
    decided = Decided(agent.engine)
    sections = [
        section("Findings", findings_html(states, agent.runbook_base_url, now), "findings"),
        section("GPUs", gpus_html(latest, trends, decided), "gpus"),
        section("Watched processes", processes_html(agent.history, latest, trends), "processes"),
        section("Inference servers", inference_html(agent.history, latest, trends, decided), "inference"),
        section("Host memory", host_html(agent.history, latest, trends), "host"),
        section("Last benchmark", bench_html(latest, now), "bench"),
        section("Agent", agent_html(agent, latest, now), "agent"),
    ]
    title = f"hybridmon · {socket.gethostname()}"
    return page(title, banner_class, banner_text, banner_detail, sections)


def banner(agent: Agent, states: list[FindingState], latest: LatestValues,
           now: float) -> tuple[str, str, str]:
    firing = {severity: 0 for severity in SEVERITIES}
    for state in states:
        if state.state == "firing":
            firing[state.finding.severity] = firing.get(state.finding.severity, 0) + 1
    pending = sum(1 for s in states if s.state == "pending")
    detail = f"{pending} pending · samples at {clock_and_age(latest.newest, now)} · {agent.mode} mode"
    host = socket.gethostname()
    if not agent.config.detectors.enabled:
        return "off", f"{host}: detectors are off", detail
    if agent.engine.last_evaluated_at is None:
        return "off", f"{host}: not evaluated yet", detail
    worst = next((severity for severity in SEVERITIES if firing[severity]), None)
    # Silence from a detector that has not judged yet is not health (agent/warmup.py).
    warming = warming_up(agent.engine, agent.sampler.scheduled)
    if warming:
        detail = f"{warming_summary(warming)} · {detail}"
    if worst is None:
        if warming:
            seconds = max(w.seconds_left for w in warming)
            return ("warming", f"{host}: warming up ({seconds:.0f} s): {len(warming)} of "
                    f"{len(agent.engine.detectors)} detectors have not judged yet", detail)
        return "ok", f"{host}: no findings firing", detail
    counts = " · ".join(f"{firing[s]} {s}" for s in SEVERITIES if firing[s])
    return worst, f"{host}: {counts} firing", detail


def findings_html(states: list[FindingState], runbook_base_url: str, now: float) -> str:
    if not states:
        return paragraph("Nothing firing or pending.", "meta")
    parts = []
    for severity in SEVERITIES:
        mine = [s for s in states if s.finding.severity == severity]
        if mine:
            parts.append(f"<h3>{esc(severity.capitalize())} ({len(mine)})</h3>")
            parts.extend(finding_html(s, runbook_base_url, now) for s in mine)
    return "".join(parts)


def finding_html(state: FindingState, runbook_base_url: str, now: float) -> str:
    finding = state.finding
    entity = " · ".join(f"{name} {value}" for name, value in finding.labels.items()) or "host"
    if state.state == "firing":
        since = f"firing since {clock_and_age(state.firing_since, now)}"
    else:
        since = (f"pending since {clock_and_age(state.pending_since, now)}; fires after "
                 f"{human_duration(finding.for_seconds)}")
    url = runbook_url(runbook_base_url, finding.alertname)
    return (f'<article class="card finding {esc(finding.severity)} {esc(state.state)}">'
            f'<h3><span class="state">{esc(state.state)}</span>{link(url, finding.alertname)}</h3>'
            f"{paragraph(finding.summary)}{paragraph(entity, 'sub')}{paragraph(since, 'sub')}"
            f"<details><summary>Details and runbook</summary>{paragraph(finding.description)}"
            f'<p class="sub">Runbook: {link(url, url)}</p></details></article>')


def agent_html(agent: Agent, latest: LatestValues, now: float) -> str:
    engine = agent.engine
    rows: list[Row] = [("Mode", f"{agent.mode} · hybridmon {__version__}", False),
                       ("Latest samples", clock_and_age(latest.newest, now), False)]
    if not agent.config.detectors.enabled:
        rows.append(("Last evaluation", "detectors are off (detectors.enabled = false)", True))
    else:
        took = f", took {engine.last_duration_seconds * 1000:.0f} ms" if engine.last_duration_seconds is not None else ""
        rows.append(("Last evaluation", f"{clock_and_age(engine.last_evaluated_at, now)}{took}", False))
    for detector, errors in sorted(engine.detector_errors.items()):
        if errors:
            rows.append((f"Detector {detector}", f"failed in {errors} evaluations", True))
    failing = nothing_to_read = not_run = 0
    for item in agent.sampler.scheduled:
        name, state = item.collector.name, item.state
        if state.last_success is False:
            failing += 1
            when = clock(state.last_error_time) if state.last_error_time is not None else "unknown"
            rows.append((f"Collector {name}", f"failing: {state.last_error or 'failed'} (last at {when})", True))
        elif state.no_data_reason:
            nothing_to_read += 1
            rows.append((f"Collector {name}", f"nothing to read on this host: {state.no_data_reason}", False))
        elif state.runs == 0:
            not_run += 1
            rows.append((f"Collector {name}", "not run yet", False))
    # "9 running" beside collectors that found nothing to read counted them as working (issue 16).
    count = len(agent.sampler.scheduled)
    reading = count - failing - nothing_to_read - not_run
    summary = [f"{reading} of {count} reading"]
    if nothing_to_read:
        summary.append(f"{nothing_to_read} with nothing to read on this host")
    if not_run:
        summary.append(f"{not_run} not run yet")
    summary.append(f"{failing} failing" if failing else "none failing")
    rows.insert(2, ("Collectors", " · ".join(summary), failing > 0))
    return card("hybridmon", key_values(rows))
