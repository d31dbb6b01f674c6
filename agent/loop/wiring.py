"""Builds the enabled collectors, in the registry's order, each with the raw source it reads through.

What to build, with which settings and after whom is declared beside each collector (its
REGISTRATION, listed in exporters/registry.py); this only hands each factory what the agent owns.
"""
from __future__ import annotations

from typing import Callable

from hybridmon.agent.config import AgentConfig
from hybridmon.agent.loop.sampler import Scheduled
from hybridmon.exporters.base import Collector, CollectorContext
from hybridmon.exporters.registry import COLLECTORS
from hybridmon.exporters.sources import RawSource

SourceFactory = Callable[[str], RawSource]


def build_collectors(config: AgentConfig, source_for: SourceFactory, replay: bool = False) -> list[Scheduled]:
    """One Scheduled per enabled collector. In a replay NVML is not loaded: the trace answers."""
    state_dir = str(config.resolved_state_dir())
    built: dict[str, Collector] = {}
    scheduled = []
    for registration in COLLECTORS:
        configured = config.collector(registration.name)
        if not configured.enabled:
            continue
        source = source_for(registration.name)
        context = CollectorContext(
            source=source, settings=config.collector_settings(registration.name),
            procfs=config.paths.procfs, sysfs=config.paths.sysfs, state_dir=state_dir, replay=replay,
            earlier=dict(built),
        )
        collector = registration.factory(context)
        built[registration.name] = collector
        interval = max(configured.interval_seconds or registration.default_interval_seconds, config.interval_seconds)
        # First runs wait for the collectors they take their watch lists from (see Scheduled.after).
        after = tuple(name for name in registration.runs_after if name in built)
        scheduled.append(Scheduled(collector, interval, source, after=after))
    return scheduled
