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
from typing import Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.core import Metric

from hybridmon import __version__
from hybridmon.agent.publish.exposition_lines import LineCache
from hybridmon.agent.self_metrics import (BUILD_INFO, COLLECTOR_DURATION, COLLECTOR_ERRORS, COLLECTOR_LAST_ERROR,
                                          COLLECTOR_NO_DATA, COLLECTOR_RUNNING, COLLECTOR_RUNS, COLLECTOR_SUCCESS,
                                          HISTORY_SERIES, LOOP_LAG, LOOP_MAX_LAG, LOOP_SCHEDULED, LOOP_SKIPPED,
                                          LOOP_TICKS, families)
from hybridmon.agent.loop.history import History
from hybridmon.agent.loop.sampler import Sampler
from hybridmon.exporters.base import Samples


# The formats /metrics serves, and their Content-Type.
TEXT = "text"
OPENMETRICS = "openmetrics"
CONTENT_TYPES = {TEXT: CONTENT_TYPE_LATEST, OPENMETRICS: openmetrics.CONTENT_TYPE_LATEST}
# OpenMetrics ends an exposition with one "# EOF" line (OpenMetrics 1.0, "Overall Structure");
# prometheus_client writes one per registry rendered, and /metrics joins several.
OPENMETRICS_EOF = b"# EOF\n"


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

    def __init__(self, history: History, sampler: Sampler, mode: str, hung_seconds: float | None = None) -> None:
        """`hung_seconds`: a collector whose run has lasted this long has its samples withheld
        (collector_failing's hung_seconds): the last readings of a source that blocks are not
        live, and served as such they hide the outage (issue 30). None: never withheld."""
        self._history = history
        self._sampler = sampler
        self.hung_seconds = hung_seconds
        self._registry_cache: dict[str, tuple[tuple, bytes]] = {}  # format -> (_fingerprint, text)
        # The agent's own metrics first, rendered like the samples (values re-formatted only),
        # then what else registers here (the detectors' findings, Alertmanager delivery).
        self._health = AgentHealthCollector(sampler, mode)
        self.health_registry = CollectorRegistry(auto_describe=False)
        # process_* of the agent itself (resident memory, CPU seconds, open fds, start time), as
        # every Prometheus exporter publishes them (issue 32): prometheus_client's own collector over
        # /proc/self, the agent's entry whatever procfs its collectors read (a host's /host/proc).
        # Apart from health_registry, whose render is kept while its samples stay the same: these
        # change at every scrape.
        self._own_process = ProcessCollector(registry=None)
        # (commit generation, text): a render that races a commit is tagged with the older
        # generation, so it is never served after that commit.
        self._generation = 0
        self._cached: tuple[int, bytes] = (-1, b"")
        # Per format (TEXT, OPENMETRICS): ((commit generation, collectors withheld), text)
        self._cached_by_format: dict[str, tuple[tuple, bytes]] = {}
        # (format, collector) -> (the Samples object rendered, its text); a commit stores a new object.
        self._parts: dict[tuple[str, str], tuple[Samples, bytes]] = {}
        # (format, collector) -> its families' HELP/TYPE lines and its series' text before the value.
        self._lines: dict[tuple[str, str], LineCache] = {}
        sampler.on_commit.append(self.invalidate)

    def invalidate(self, _at: float | None = None) -> None:
        self._generation += 1

    def samples_text(self, exposition_format: str = TEXT) -> bytes:
        """Every collector's latest samples; in OpenMetrics without the closing "# EOF"."""
        withheld = self.withheld()
        generation = (self._generation, withheld)
        cached_generation, text = self._cached_by_format.get(exposition_format, ((-1,), b""))
        if cached_generation != generation:
            parts = []
            for collector, (_at, samples) in sorted(self._history.latest().items()):
                if collector in withheld:
                    continue
                known = self._parts.get((exposition_format, collector))
                if known is None or known[0] is not samples:
                    rendered = self._line_cache(exposition_format, collector).render(samples)
                    known = self._parts[(exposition_format, collector)] = (samples, rendered)
                parts.append(known[1])
            text = b"".join(parts)
            self._cached_by_format[exposition_format] = (generation, text)
        return text

    def withheld(self) -> frozenset[str]:
        """The collectors whose samples are withheld now: hung for hung_seconds or more."""
        return frozenset() if self.hung_seconds is None else frozenset(self._sampler.hung(self.hung_seconds))

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
                + self._registry_text(exposition_format)
                + _render(_Collected(list(self._own_process.collect())), exposition_format))
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
