"""Which detectors have not judged yet: never "healthy" before looking.

The agent evaluates its detectors right after the first collector commits (daemon._maybe_evaluate),
before slower collectors (host settings, processes, inference servers) have reported once, and
long before detectors that compare windows (min_history_seconds: a 1 min average, a 30 min trend)
have the history they need. Their silence then means "not looked yet", not "nothing wrong", so the
status page, GET /api/v1/findings and the findings' consumers say "warming up" for them until:

- the engine's history span (last evaluation minus first) covers the detector's min_history_seconds,
- and every collector that writes one of its inputs (its family's MetricSpecs, agent/alerts) had
  committed samples by the last evaluation. A collector that failed or found nothing to read on
  this host is not waited for: that is reported as such (status page, /healthz, CollectorFailing),
  and waiting for it would say "warming up" forever.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hybridmon.agent.alerts import catalogue
from hybridmon.agent.detectors.engine import Engine


@dataclass(frozen=True)
class WarmingUp:
    detector: str
    seconds_left: float               # history still needed: min_history_seconds minus the span so far
    waiting_for: tuple[str, ...]      # collectors feeding it that have not committed once

    def to_json(self) -> dict:
        return {"detector": self.detector, "seconds_left": round(self.seconds_left, 1),
                "waiting_for": list(self.waiting_for)}


def input_collectors(detector: str, scheduled: Iterable) -> tuple[str, ...]:
    """The scheduled collectors that write any of the detector's family's inputs; none for a
    detector outside the catalogue (it declares no inputs)."""
    try:
        inputs = {spec.name for spec in catalogue.family(detector).inputs}
    except KeyError:
        return ()
    return tuple(item.collector.name for item in scheduled
                 if inputs & {spec.name for spec in getattr(item.collector, "metric_specs", ())})


def warming_up(engine: Engine, scheduled: Iterable) -> list[WarmingUp]:
    """The detectors that have not judged with their minimum data as of the engine's last
    evaluation (every detector before the first). `scheduled`: the sampler's Scheduled items."""
    scheduled = list(scheduled)
    first, last = engine.first_evaluated_at, engine.last_evaluated_at
    span = 0.0 if first is None or last is None else last - first
    seen = engine.collectors_seen if last is not None else frozenset()
    unable = {item.collector.name for item in scheduled
              if item.state.last_success is False or item.state.no_data_reason}
    found = []
    for detector in engine.detectors:
        needs = detector.min_history_seconds
        left = max(0.0, needs - span)
        waiting = tuple(name for name in input_collectors(detector.name, scheduled)
                        if name not in seen and name not in unable)
        if last is None or left > 0 or waiting:
            found.append(WarmingUp(detector.name, needs if last is None else left, waiting))
    return found


def summary(warming: list[WarmingUp]) -> str:
    """One line for a page or a check: "warming up (N s): a, b wait for history; c waits for the
    host collector"."""
    seconds = max((w.seconds_left for w in warming), default=0.0)
    by_history = [w.detector for w in warming if w.seconds_left > 0]
    by_collector: dict[str, list[str]] = {}
    for w in warming:
        for name in w.waiting_for:
            by_collector.setdefault(name, []).append(w.detector)
    parts = []
    if by_history:
        parts.append(f"{', '.join(by_history)} need more history")
    for name, detectors in sorted(by_collector.items()):
        parts.append(f"{', '.join(detectors)} wait for the {name} collector's first report")
    return f"warming up ({seconds:.0f} s): " + "; ".join(parts)
