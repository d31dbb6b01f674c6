"""Prometheus exposition of the latest samples and of the agent's own health.

The samples are rendered per collector and each collector's text is cached until that collector
commits again, so a scrape between two ticks costs a lock and a memory copy, and one after a commit
renders only what that commit changed (the GPU collector's samples every second, not the
benchmark's, which change every 30 s); that render formats only the values, each series' text
before its value being cached too (agent/publish/exposition_lines.py). The agent's own health metrics are a
custom collector on the agent's own registry, rendered by prometheus_client on every scrape.

Two formats, from the same families: the Prometheus text format (the default) and OpenMetrics 1.0
(prometheus_client.openmetrics.exposition), served when the scraper's Accept header negotiates it
(choose_format). Compression: gzip when the Accept-Encoding header allows it (accepts_gzip).
"""
from __future__ import annotations

import time
from typing import Iterable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from hybridmon import __version__
from hybridmon.agent.publish.alertmanager import ALERTMANAGER_METRICS
from hybridmon.agent.publish.exposition_lines import LineCache
from hybridmon.agent.loop.history import History
from hybridmon.agent.loop.sampler import Sampler
from hybridmon.exporters.base import MetricSpec, Samples


# The formats /metrics serves, and their Content-Type.
TEXT = "text"
OPENMETRICS = "openmetrics"
CONTENT_TYPES = {TEXT: CONTENT_TYPE_LATEST, OPENMETRICS: openmetrics.CONTENT_TYPE_LATEST}
# OpenMetrics ends an exposition with one "# EOF" line (OpenMetrics 1.0, "Overall Structure");
# prometheus_client writes one per registry rendered, and /metrics joins several.
OPENMETRICS_EOF = b"# EOF\n"


def families(samples: Samples, sort: bool) -> Iterator[Metric]:
    """Prometheus metric families from samples; sorted by name and labels when `sort`."""
    by_name: dict[str, Metric] = {}
    for sample in samples:
        spec = sample.spec
        family = by_name.get(spec.name)
        if family is None:
            kind = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
            family = by_name[spec.name] = kind(spec.name, spec.documentation, labels=spec.label_names)
        family.add_metric(sample.label_values, sample.value)
    names = sorted(by_name) if sort else list(by_name)
    for name in names:
        family = by_name[name]
        if sort:
            family.samples.sort(key=lambda s: tuple(s.labels.values()))
        yield family


def _spec(name: str, kind: str, documentation: str, *labels: str) -> MetricSpec:
    return MetricSpec(name, documentation, kind, labels)


# hybridmon's own metrics, defined once for the exposition and for docs/metrics.md.
COLLECTOR_SUCCESS = _spec("hybridmon_collector_success", "gauge", "1 if the collector's last run succeeded (a source absent on this host counts as success).", "collector")
COLLECTOR_NO_DATA = _spec("hybridmon_collector_no_data", "gauge", "1 if the collector's source does not exist on this host; the agent log says why, once.", "collector")
COLLECTOR_DURATION = _spec("hybridmon_collector_duration_seconds", "gauge", "Wall time of the collector's last run, in seconds.", "collector")
COLLECTOR_RUNNING = _spec("hybridmon_collector_running_seconds", "gauge", "How long the collector's current run has taken so far, in seconds; 0 when idle. A growing value means a hung source (e.g. NVML after a GPU fell off the bus).", "collector")
COLLECTOR_LAST_ERROR = _spec("hybridmon_collector_last_error_timestamp_seconds", "gauge", "Unix time of the collector's last failure; absent if it never failed.", "collector")
COLLECTOR_ERRORS = _spec("hybridmon_collector_errors_total", "counter", "Failed runs of the collector since the agent started.", "collector")
COLLECTOR_RUNS = _spec("hybridmon_collector_runs_total", "counter", "Runs of the collector since the agent started.", "collector")
LOOP_LAG = _spec("hybridmon_loop_lag_seconds", "gauge", "How late the sampling loop's last tick started, in seconds.")
LOOP_MAX_LAG = _spec("hybridmon_loop_max_lag_seconds", "gauge", "The largest tick lag since the agent started, in seconds.")
LOOP_TICKS = _spec("hybridmon_loop_ticks_total", "counter", "Ticks of the sampling loop since the agent started.")
LOOP_SKIPPED = _spec("hybridmon_loop_skipped_ticks_total", "counter", "Ticks skipped because the loop fell a whole interval behind (an overloaded host).")
LOOP_SCHEDULED = _spec("hybridmon_loop_scheduled_ticks_total", "counter", "Ticks the loop's interval has scheduled since the loop started (seconds since then / interval_seconds, read at scrape time); absent in a replay and before the loop starts. rate(hybridmon_loop_ticks_total) / rate(this) is the share of its ticks the loop ran.")
HISTORY_SERIES = _spec("hybridmon_history_series", "gauge", "Series held in the in-memory history.")
BUILD_INFO = _spec("hybridmon_build_info", "gauge", "hybridmon's version and mode (live, record or replay); always 1.", "version", "mode")

SELF_METRICS = (
    COLLECTOR_SUCCESS, COLLECTOR_NO_DATA, COLLECTOR_DURATION, COLLECTOR_RUNNING, COLLECTOR_LAST_ERROR,
    COLLECTOR_ERRORS, COLLECTOR_RUNS, LOOP_LAG, LOOP_MAX_LAG, LOOP_TICKS, LOOP_SKIPPED, LOOP_SCHEDULED, HISTORY_SERIES,
    BUILD_INFO, *ALERTMANAGER_METRICS,
)


class AgentHealthCollector:
    """hybridmon's own metrics: per collector outcome and timing, loop lag, history size."""

    def __init__(self, sampler: Sampler, mode: str, monotonic=time.monotonic) -> None:
        self._sampler = sampler
        self._mode = mode
        self._monotonic = monotonic

    def collect(self) -> Iterable[Metric]:
        return families(self.samples(), sort=False)

    def samples(self) -> Samples:
        samples = Samples()
        now = self._monotonic()
        for item in self._sampler.scheduled:
            name, state = item.collector.name, item.state
            if state.last_success is not None:
                samples.add(COLLECTOR_SUCCESS, 1.0 if state.last_success else 0.0, name)
                samples.add(COLLECTOR_NO_DATA, 1.0 if state.no_data_reason else 0.0, name)
            samples.add(COLLECTOR_DURATION, state.last_duration_seconds, name)
            started = state.running_since
            samples.add(COLLECTOR_RUNNING, 0.0 if started is None else max(0.0, now - started), name)
            samples.add(COLLECTOR_LAST_ERROR, state.last_error_time, name)
            samples.add(COLLECTOR_ERRORS, state.errors, name)
            samples.add(COLLECTOR_RUNS, state.runs, name)
        loop = self._sampler.loop
        samples.add(LOOP_LAG, loop.last_lag_seconds)
        samples.add(LOOP_MAX_LAG, loop.max_lag_seconds)
        samples.add(LOOP_TICKS, loop.ticks)
        samples.add(LOOP_SKIPPED, loop.skipped_ticks)
        if loop.started_at is not None:  # a replay's loop never runs: nothing to judge it by
            # A counter growing with time whether or not the loop ticks: divided by it, the ticks'
            # rate is a share that Prometheus's extrapolation does not bias on a young series.
            elapsed = self._sampler.monotonic() - loop.started_at
            samples.add(LOOP_SCHEDULED, max(0.0, elapsed) / self._sampler.interval_seconds)
        samples.add(HISTORY_SERIES, self._sampler.history.series_count())
        samples.add(BUILD_INFO, 1.0, __version__, self._mode)
        return samples


_HEALTH = " health"  # the health part's key among the collectors' line caches (no collector's name)


class Exposition:
    """Renders /metrics; each collector's part is re-rendered only after that collector commits."""

    def __init__(self, history: History, sampler: Sampler, mode: str) -> None:
        self._history = history
        self._registry_cache: dict[str, tuple[tuple, bytes]] = {}  # format -> (_fingerprint, text)
        # The agent's own metrics first, rendered like the samples (values re-formatted only),
        # then what else registers here (the detectors' findings, Alertmanager delivery).
        self._health = AgentHealthCollector(sampler, mode)
        self.health_registry = CollectorRegistry(auto_describe=False)
        # (commit generation, text): a render that races a commit is tagged with the older
        # generation, so it is never served after that commit.
        self._generation = 0
        self._cached: tuple[int, bytes] = (-1, b"")
        # Per format (TEXT, OPENMETRICS):
        self._cached_by_format: dict[str, tuple[int, bytes]] = {}
        # (format, collector) -> (the Samples object rendered, its text); a commit stores a new object.
        self._parts: dict[tuple[str, str], tuple[Samples, bytes]] = {}
        # (format, collector) -> its families' HELP/TYPE lines and its series' text before the value.
        self._lines: dict[tuple[str, str], LineCache] = {}
        sampler.on_commit.append(self.invalidate)

    def invalidate(self, _at: float | None = None) -> None:
        self._generation += 1

    def samples_text(self, exposition_format: str = TEXT) -> bytes:
        """Every collector's latest samples; in OpenMetrics without the closing "# EOF"."""
        generation = self._generation
        cached_generation, text = self._cached_by_format.get(exposition_format, (-1, b""))
        if cached_generation != generation:
            parts = []
            for collector, (_at, samples) in sorted(self._history.latest().items()):
                known = self._parts.get((exposition_format, collector))
                if known is None or known[0] is not samples:
                    rendered = self._line_cache(exposition_format, collector).render(samples)
                    known = self._parts[(exposition_format, collector)] = (samples, rendered)
                parts.append(known[1])
            text = b"".join(parts)
            self._cached_by_format[exposition_format] = (generation, text)
        return text

    def _registry_text(self, exposition_format: str) -> bytes:
        """health_registry rendered; the text of the last render again while every family and
        sample is the same (findings change at an evaluation, every 10 s, not at each scrape;
        rendering ~100 finding series with their many labels cost ~1.5 ms a scrape)."""
        collected = list(self.health_registry.collect())
        key = _fingerprint(collected)
        known = self._registry_cache.get(exposition_format)
        if known is not None and known[0] == key:
            return known[1]
        text = _render(_Collected(collected), exposition_format)
        self._registry_cache[exposition_format] = (key, text)
        return text

    def _line_cache(self, exposition_format: str, collector: str) -> LineCache:
        lines = self._lines.get((exposition_format, collector))
        if lines is None:
            lines = self._lines[(exposition_format, collector)] = LineCache(
                lambda registry: _render(registry, exposition_format))
        return lines

    def render(self, exposition_format: str = TEXT) -> bytes:
        """The whole /metrics body in `exposition_format` (TEXT or OPENMETRICS)."""
        body = (self.samples_text(exposition_format)
                + self._line_cache(exposition_format, _HEALTH).render(self._health.samples(), sort=False)
                + self._registry_text(exposition_format))
        return body + OPENMETRICS_EOF if exposition_format == OPENMETRICS else body


class _Collected:
    """Families already collected, as a registry-like object for generate_latest."""

    def __init__(self, collected: list[Metric]) -> None:
        self._collected = collected

    def collect(self) -> list[Metric]:
        return self._collected


def _fingerprint(collected: list[Metric]) -> tuple:
    """Everything of the families that either format writes: equal fingerprints, equal text.
    Values by repr: -0.0 == 0.0, but the two are written differently."""
    return tuple((family.name, family.type, family.documentation, family.unit,
                  tuple((sample.name, tuple(sample.labels.items()), repr(sample.value), sample.timestamp,
                         sample.exemplar, sample.native_histogram) for sample in family.samples))
                 for family in collected)


def _render(registry, exposition_format: str) -> bytes:
    if exposition_format == TEXT:
        return generate_latest(registry)
    rendered = openmetrics.generate_latest(registry)
    assert rendered.endswith(OPENMETRICS_EOF), rendered[-20:]
    return rendered[:-len(OPENMETRICS_EOF)]


# --- content negotiation (RFC 9110 section 12: Accept, Accept-Encoding, q-values) ------------------
# A header is bounded by the server's request size limit (h11: 16 KiB for the whole head), but a
# list of thousands of tiny items is still work per scrape: only the first ones are read.
MAX_NEGOTIATED_ITEMS = 32


def _weighted(header: str | None) -> list[tuple[str, float]]:
    """"a;q=0.5, b" -> [("a", 0.5), ("b", 1.0)], names lower-cased, parameters other than q dropped.

    An item whose q is not a number in [0, 1] is skipped (RFC 9110: qvalue = 0-1 with up to three
    decimals): a malformed header negotiates as if that item were absent, it never fails a scrape.
    """
    items = []
    for item in (header or "").split(",", MAX_NEGOTIATED_ITEMS)[:MAX_NEGOTIATED_ITEMS]:
        name, *parameters = item.split(";")
        name = name.strip().lower()
        if not name:
            continue
        weight = 1.0
        for parameter in parameters:
            key, _, value = parameter.partition("=")
            if key.strip().lower() == "q":
                try:
                    weight = float(value.strip())
                except ValueError:
                    weight = -1.0
        if 0.0 <= weight <= 1.0:
            items.append((name, weight))
    return items


def choose_format(accept: str | None) -> str:
    """OPENMETRICS when Accept weighs application/openmetrics-text above the text format (which
    text/plain, text/* or */* stand for), else TEXT, the default. Prometheus 2.x sends
    "application/openmetrics-text;version=1.0.0,...;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"."""
    openmetrics_weight = text_weight = 0.0
    for name, weight in _weighted(accept):
        if name == "application/openmetrics-text":
            openmetrics_weight = max(openmetrics_weight, weight)
        elif name in ("text/plain", "text/*", "*/*"):
            text_weight = max(text_weight, weight)
    return OPENMETRICS if openmetrics_weight > 0 and openmetrics_weight > text_weight else TEXT


def accepts_gzip(accept_encoding: str | None) -> bool:
    """gzip allowed by Accept-Encoding: named (or "*") with q > 0; "gzip;q=0" refuses it even
    beside "*". No header, or an empty one, means identity only (RFC 9110 12.5.3)."""
    named = wildcard = None
    for name, weight in _weighted(accept_encoding):
        if name in ("gzip", "x-gzip"):
            named = weight if named is None else max(named, weight)
        elif name == "*":
            wildcard = weight
    weight = named if named is not None else wildcard
    return weight is not None and weight > 0
