"""Prometheus exposition of the latest samples and of the agent's own health.

Both are custom collectors on the agent's own registry. The rendered text is cached until the next
commit, so a scrape between two ticks costs a lock and a memory copy.
"""
from __future__ import annotations

import time
from typing import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agent import __version__
from agent.history import History
from agent.sampler import Sampler


class LatestSamplesCollector:
    """Yields every collector's most recent samples, families sorted by name for stable output."""

    def __init__(self, history: History) -> None:
        self._history = history

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for _collector, (_at, samples) in sorted(self._history.latest().items()):
            for sample in samples:
                spec = sample.spec
                family = families.get(spec.name)
                if family is None:
                    kind = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
                    family = families[spec.name] = kind(spec.name, spec.documentation, labels=spec.label_names)
                family.add_metric(sample.label_values, sample.value)
        for name in sorted(families):
            family = families[name]
            family.samples.sort(key=lambda s: tuple(s.labels.values()))
            yield family


class AgentHealthCollector:
    """hybridmon's own metrics: per collector outcome and timing, loop lag, history size."""

    def __init__(self, sampler: Sampler, mode: str, monotonic=time.monotonic) -> None:
        self._sampler = sampler
        self._mode = mode
        self._monotonic = monotonic

    def collect(self) -> Iterable[Metric]:
        success = GaugeMetricFamily(
            "hybridmon_collector_success", "1 if the collector's last run succeeded (a source absent on this host counts as success).", labels=["collector"])
        no_data = GaugeMetricFamily(
            "hybridmon_collector_no_data", "1 if the collector's source does not exist on this host; the agent log says why.", labels=["collector"])
        duration = GaugeMetricFamily(
            "hybridmon_collector_duration_seconds", "Wall time of the collector's last run, in seconds.", labels=["collector"])
        running = GaugeMetricFamily(
            "hybridmon_collector_running_seconds", "How long the collector's current run has taken so far; 0 when idle. A growing value means a hung source.", labels=["collector"])
        last_error = GaugeMetricFamily(
            "hybridmon_collector_last_error_timestamp_seconds", "Unix time of the collector's last failure; absent if it never failed.", labels=["collector"])
        errors = CounterMetricFamily(
            "hybridmon_collector_errors", "Failed runs of the collector since the agent started.", labels=["collector"])
        runs = CounterMetricFamily(
            "hybridmon_collector_runs", "Runs of the collector since the agent started.", labels=["collector"])
        now = self._monotonic()
        for item in self._sampler.scheduled:
            name, state = item.collector.name, item.state
            if state.last_success is not None:
                success.add_metric([name], 1.0 if state.last_success else 0.0)
                no_data.add_metric([name], 1.0 if state.no_data_reason else 0.0)
            if state.last_duration_seconds is not None:
                duration.add_metric([name], state.last_duration_seconds)
            started = state.running_since
            running.add_metric([name], 0.0 if started is None else max(0.0, now - started))
            if state.last_error_time is not None:
                last_error.add_metric([name], state.last_error_time)
            errors.add_metric([name], state.errors)
            runs.add_metric([name], state.runs)
        yield from (success, no_data, duration, running, last_error, errors, runs)
        loop = self._sampler.loop
        yield GaugeMetricFamily("hybridmon_loop_lag_seconds", "How late the sampling loop's last tick started, in seconds.", value=loop.last_lag_seconds)
        yield GaugeMetricFamily("hybridmon_loop_max_lag_seconds", "The largest tick lag since the agent started, in seconds.", value=loop.max_lag_seconds)
        yield CounterMetricFamily("hybridmon_loop_ticks", "Ticks of the sampling loop since the agent started.", value=loop.ticks)
        yield GaugeMetricFamily("hybridmon_history_series", "Series held in the in-memory history.", value=self._sampler.history.series_count())
        info = GaugeMetricFamily("hybridmon_build_info", "hybridmon's version and mode (live, record or replay); always 1.", labels=["version", "mode"])
        info.add_metric([__version__, self._mode], 1.0)
        yield info


class Exposition:
    """Renders /metrics; the samples part is re-rendered only after a commit."""

    def __init__(self, history: History, sampler: Sampler, mode: str) -> None:
        self.samples_registry = CollectorRegistry(auto_describe=False)
        self.samples_registry.register(LatestSamplesCollector(history))
        self.health_registry = CollectorRegistry(auto_describe=False)
        self.health_registry.register(AgentHealthCollector(sampler, mode))
        # (commit generation, text): a render that races a commit is tagged with the older
        # generation, so it is never served after that commit.
        self._generation = 0
        self._cached: tuple[int, bytes] = (-1, b"")
        sampler.on_commit.append(self.invalidate)

    def invalidate(self) -> None:
        self._generation += 1

    def samples_text(self) -> bytes:
        generation = self._generation
        cached_generation, text = self._cached
        if cached_generation != generation:
            text = generate_latest(self.samples_registry)
            self._cached = (generation, text)
        return text

    def render(self) -> bytes:
        return self.samples_text() + generate_latest(self.health_registry)
