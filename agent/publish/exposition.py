"""Prometheus exposition of the latest samples and of the agent's own health.

The samples are rendered per collector and each collector's text is cached until that collector
commits again; that render formats only the values, each series' text before its value being
cached too (agent/publish/exposition_lines.py). The render happens at the commit, in the
committing collector's thread, for the formats scrapers have asked for (prepare): a scrape then
joins cached parts and renders only what changes at every scrape, the agent's own health metrics
(a custom collector on the agent's own registry), with process_* read by the commits too, at most
one sampling interval before the scrape (issue 33: under CPU contention every millisecond of
Python a scrape runs, and every syscall that lets go of the GIL, is stretched by GIL hand-offs
and the scheduler).

Two formats, from the same families: the Prometheus text format (the default) and OpenMetrics 1.0
(prometheus_client.openmetrics.exposition), served when the scraper's Accept header negotiates it
(choose_format). Compression: gzip when the Accept-Encoding header allows it (accepts_gzip). Each
collector's part is compressed once per commit too, into deflate blocks of its own that end on a
byte boundary (a sync flush, as pigz joins its blocks); a gzipped scrape compresses only the
per-scrape tail and joins the rest (issue 33: compressing the 8-GPU host's 200 KB at every scrape
cost 2.1 ms, two thirds of the scrape).
"""
from __future__ import annotations

import logging
import math
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Iterable

from prometheus_client import CONTENT_TYPE_LATEST, ProcessCollector, generate_latest
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

log = logging.getLogger(__name__)


# The formats /metrics serves, and their Content-Type.
TEXT = "text"
OPENMETRICS = "openmetrics"
CONTENT_TYPES = {TEXT: CONTENT_TYPE_LATEST, OPENMETRICS: openmetrics.CONTENT_TYPE_LATEST}
# OpenMetrics ends an exposition with one "# EOF" line (OpenMetrics 1.0, "Overall Structure");
# prometheus_client writes one per registry rendered, and /metrics joins several.
OPENMETRICS_EOF = b"# EOF\n"
# Level 6: the 8-GPU host's 200 KB become 20 KB; level 1 saves 1.4 ms of a 2.1 ms compression but
# writes 16 % more, and each part is compressed once per commit, not per scrape.
GZIP_LEVEL = 6
# The per-scrape tail (health, findings, process_*: ~17 KB on the 8-GPU host) is compressed at
# every scrape: level 1 takes 0.17 ms against level 6's 0.29 and writes 4.7 KB against 4.3.
TAIL_GZIP_LEVEL = 1
# A gzip member's header (RFC 1952, 2.3): deflate, no flags, no modification time (as
# gzip.compress(mtime=0)), no extra flags, OS "unknown". Its trailer: CRC-32 and length mod 2^32.
GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
_GZIP_TRAILER = struct.Struct("<II")
# A commit prepares the scrape of a format (and encoding) scraped at least this often: the gap
# between its last two scrapes and the time since the last one both at most this. Each collector
# commits at every one of its runs (the GPU collector every second), so preparing for a scraper
# that comes every 15 s would render and compress 15 times for one scrape; Prometheus at 1 s (the
# issue-33 case) or 2 s is prepared for.
PREPARE_WHILE_SCRAPED_EVERY_SECONDS = 2.5
# process_* is read from /proc/self by a commit when its last reading is this old, and by a scrape
# only when it is older than one sampling interval: each of its ~9 syscalls lets go of the GIL,
# and a scrape that must take it back from a busy thread (the detectors' evaluation, 129 ms of
# CPU every 10 s) waits a switch interval each time.
PROCESS_REFRESH_SECONDS = 0.5


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


@dataclass
class _Part:
    """One collector's samples as rendered in one format."""

    samples: Samples  # the object rendered: a commit stores a new one
    text: bytes
    deflated: bytes | None = None  # `text` as deflate blocks of their own (_deflate_part), once asked for


class Exposition:
    """Renders /metrics; each collector's part is re-rendered only after that collector commits."""

    def __init__(self, history: History, sampler: Sampler, mode: str, hung_seconds: float | None = None) -> None:
        """`hung_seconds`: a collector whose run has lasted this long has its samples withheld
        (collector_failing's hung_seconds): the last readings of a source that blocks are not
        live, and served as such they hide the outage (issue 30). None: never withheld."""
        self._history = history
        self._sampler = sampler
        self.hung_seconds = hung_seconds
        # (format, collector's place in health_registry) -> (its version or _fingerprint, text)
        self._registry_cache: dict[tuple[str, int], tuple[object, bytes]] = {}
        # The agent's own metrics first, rendered like the samples (values re-formatted only),
        # then what else registers here (the detectors' findings, Alertmanager delivery).
        self._health = AgentHealthCollector(sampler, mode)
        self.health_registry = HealthCollectors()
        # process_* of the agent itself (resident memory, CPU seconds, open fds, start time), as
        # every Prometheus exporter publishes them (issue 32): prometheus_client's own collector over
        # /proc/self, the agent's entry whatever procfs its collectors read (a host's /host/proc).
        # Apart from health_registry, whose render is kept while its samples stay the same: these
        # change all the time (read at most one sampling interval before a scrape).
        self._own_process = ProcessCollector(registry=None)
        self._own_process_text: dict[str, tuple[float, bytes]] = {}  # format -> (read at, text)
        # The commit generation: a join that races a commit is tagged with the older generation,
        # so it is never served after that commit.
        self._generation = 0
        # Per format: ((commit generation, collectors withheld), samples text, when joined)
        self._cached_by_format: dict[str, tuple[tuple, bytes, float]] = {}
        # Per format: ((commit generation, collectors withheld), (deflated, CRC-32, length of the
        # text), when joined)
        self._deflated_by_format: dict[str, tuple[tuple, tuple[bytes, int, int], float]] = {}
        # (format, collector) -> its latest part.
        self._parts: dict[tuple[str, str], _Part] = {}
        # (format, collector) -> its families' HELP/TYPE lines and its series' text before the value.
        self._lines: dict[tuple[str, str], LineCache] = {}
        # Collector threads render at their commits and scrapes on the event loop: one renders a
        # part (and its line cache) at a time. The health part has a lock of its own: a scrape
        # never waits for a commit's render.
        self._render_lock = threading.Lock()
        self._health_lock = threading.Lock()
        # Held while a health_registry collector's part is rendered: a scrape that finds it held
        # (an evaluation's thread rendering the new findings) serves the part's last text.
        self._registry_lock = threading.Lock()
        # (format, gzipped) -> (the gap between its last two scrapes, the last one), monotonic seconds
        self._scraped: dict[tuple[str, bool], tuple[float, float]] = {}
        # Commits preparing their parts right now, each in its own thread (invalidate).
        self._preparing = 0
        self._preparing_lock = threading.Lock()
        sampler.on_commit.append(self.invalidate)

    def invalidate(self, _at: float | None = None) -> None:
        """A collector committed (called in its thread): the samples change, and what scrapers
        have asked for is rendered now, in this thread rather than in the next scrape."""
        with self._preparing_lock:
            self._preparing += 1
        try:
            self._generation += 1
            self.prepare()
        finally:
            with self._preparing_lock:
                self._preparing -= 1

    def prepare(self) -> None:
        """Render (and compress) every collector's changed part in the formats scraped often
        (PREPARE_WHILE_SCRAPED_EVERY_SECONDS), and health_registry's changed parts: called after
        each commit and after each evaluation of the detectors (agent/daemon.py), in their thread."""
        try:
            self._prepare()
        except Exception:  # the scrape renders it again and answers for it; the caller goes on
            log.debug("preparing /metrics failed", exc_info=True)

    def _prepare(self) -> None:
        withheld, now = self.withheld(), self._sampler.monotonic()
        for (exposition_format, gzipped), (gap, last) in list(self._scraped.items()):
            if max(gap, now - last) <= PREPARE_WHILE_SCRAPED_EVERY_SECONDS:
                self._current_parts(exposition_format, withheld, deflated=gzipped)
                self._registry_text(exposition_format, serve_last_while_rendered=False)
                self._process_text(exposition_format, PROCESS_REFRESH_SECONDS)

    def _process_text(self, exposition_format: str, max_age_seconds: float) -> bytes:
        """process_* rendered, read again if the last reading is older than `max_age_seconds`."""
        now = self._sampler.monotonic()
        known = self._own_process_text.get(exposition_format)
        if known is None or now - known[0] > max_age_seconds:
            known = (now, _render(_Collected(list(self._own_process.collect())), exposition_format))
            self._own_process_text[exposition_format] = known
        return known[1]

    def _current_parts(self, exposition_format: str, withheld: frozenset[str], deflated: bool) -> list[_Part]:
        """Each collector's latest part in `exposition_format`, by collector name, withheld ones left out."""
        parts = []
        for collector, (_at, samples) in sorted(self._history.latest().items()):
            if collector in withheld:
                continue
            key = (exposition_format, collector)
            part = self._parts.get(key)
            if part is None or part.samples is not samples:
                with self._render_lock:
                    part = self._parts.get(key)
                    if part is None or part.samples is not samples:
                        part = _Part(samples, self._line_cache(exposition_format, collector).render(samples))
                        self._parts[key] = part
            if deflated and part.deflated is None:
                # Outside the lock (zlib lets go of the GIL meanwhile); two threads racing here
                # compute the same bytes.
                part.deflated = _deflate_part(part.text)
            parts.append(part)
        return parts

    def samples_text(self, exposition_format: str = TEXT, last_while_prepared: bool = False) -> bytes:
        """Every collector's latest samples; in OpenMetrics without the closing "# EOF".
        `last_while_prepared`: see _last_while_prepared."""
        def joined(parts: list) -> bytes:
            return b"".join(part.text for part in parts)
        return self._joined_parts(self._cached_by_format, exposition_format, False, joined, last_while_prepared)

    def _samples_deflated(self, exposition_format: str, last_while_prepared: bool = False) -> tuple[bytes, int, int]:
        """samples_text as deflate blocks ending on a byte boundary, with its CRC-32 and length."""
        def joined(parts: list) -> tuple[bytes, int, int]:
            crc, length = 0, 0
            for part in parts:
                crc, length = zlib.crc32(part.text, crc), length + len(part.text)
            return b"".join(part.deflated for part in parts), crc, length
        return self._joined_parts(self._deflated_by_format, exposition_format, True, joined, last_while_prepared)

    def _joined_parts(self, cache: dict, exposition_format: str, deflated: bool, join, last_while_prepared: bool):
        """The collectors' current parts joined by `join`, kept in `cache` until a commit or a change
        of the collectors withheld; while a commit prepares its part, the last join where allowed."""
        withheld = self.withheld()
        generation = (self._generation, withheld)
        cached = cache.get(exposition_format)
        if cached is None or cached[0] != generation:
            if last_while_prepared and self._last_while_prepared(cached, withheld):
                return cached[1]  # type: ignore[index]
            value = join(self._current_parts(exposition_format, withheld, deflated=deflated))
            cached = cache[exposition_format] = (generation, value, self._sampler.monotonic())
        return cached[1]

    def _last_while_prepared(self, cached: tuple | None, withheld: frozenset[str]) -> bool:
        """Whether a scrape of a format scraped often serves its last joined samples while a commit
        is rendering and compressing its part in its own thread (issue 33): taking that part
        itself, the scrape waited for the render lock and compressed the part again (at 256
        watched processes the process collector's part is ~300 KB, its render and deflate ~10 ms).
        What it serves is the body of the scrape before, at most PREPARE_WHILE_SCRAPED_EVERY_SECONDS
        old, as a scrape that came just before the commit would have; never when the collectors
        withheld have changed since."""
        return (cached is not None and self._preparing > 0 and cached[0][1] == withheld
                and self._sampler.monotonic() - cached[2] <= PREPARE_WHILE_SCRAPED_EVERY_SECONDS)

    def withheld(self) -> frozenset[str]:
        """The collectors whose samples are withheld now: hung for hung_seconds or more."""
        return frozenset() if self.hung_seconds is None else frozenset(self._sampler.hung(self.hung_seconds))

    def _registry_text(self, exposition_format: str, serve_last_while_rendered: bool = True) -> bytes:
        """health_registry rendered, each collector's part on its own: the text of its last render
        again while its version() (or, without one, every family and sample) is the same.

        The findings change at an evaluation only (every 15 s by default), and the evaluation's
        thread renders them then (prepare). Neither collecting them to compare nor rendering them
        belongs in a scrape: at 258 findings (256 watched processes each firing the old
        InferenceProcessMemlockLow), their 774 series (108 KB) cost 3-5 ms a scrape to collect and
        compare and 20-60 ms to render, the slowest 1-3 % of scrapes (issue 33). With `serve_last_while_rendered`, a part that another
        thread is rendering right now is served as last rendered: what the scrape would have
        served a few milliseconds earlier."""
        texts = []
        for place, collector in enumerate(self.health_registry.collectors()):
            version = getattr(collector, "version", None)
            cache_key = (exposition_format, place)
            known = self._registry_cache.get(cache_key)
            if version is None:  # compared by its samples: cheap for the few series of such a part
                collected = list(collector.collect())
                key = _fingerprint(collected)
                if known is None or known[0] != key:
                    known = self._registry_cache[cache_key] = (key, _render(_Collected(collected), exposition_format))
                texts.append(known[1])
                continue
            if known is None or known[0] != version():
                if not self._registry_lock.acquire(blocking=known is None or not serve_last_while_rendered):
                    texts.append(known[1])  # type: ignore[index]
                    continue
                try:
                    known = self._registry_cache.get(cache_key)
                    # The version read before collecting: a change meanwhile renders again next time.
                    key = version()
                    if known is None or known[0] != key:
                        text = _render(_Collected(list(collector.collect())), exposition_format)
                        known = self._registry_cache[cache_key] = (key, text)
                finally:
                    self._registry_lock.release()
            texts.append(known[1])
        return b"".join(texts)

    def _line_cache(self, exposition_format: str, collector: str) -> LineCache:
        lines = self._lines.get((exposition_format, collector))
        if lines is None:
            lines = self._lines[(exposition_format, collector)] = LineCache(
                lambda registry: _render(registry, exposition_format))
        return lines

    def _per_scrape_text(self, exposition_format: str) -> bytes:
        """What follows the samples, rendered at every scrape: health, findings, and process_*
        (read at most one sampling interval before)."""
        with self._health_lock:
            health = self._line_cache(exposition_format, _HEALTH).render(self._health.samples(), sort=False)
        body = (health + self._registry_text(exposition_format)
                + self._process_text(exposition_format, self._sampler.interval_seconds))
        return body + OPENMETRICS_EOF if exposition_format == OPENMETRICS else body

    def render(self, exposition_format: str = TEXT, gzipped: bool = False) -> bytes:
        """The whole /metrics body in `exposition_format` (TEXT or OPENMETRICS), gzipped (one gzip
        member: any gzip reader takes it) or not."""
        now, variant = self._sampler.monotonic(), (exposition_format, gzipped)
        last = self._scraped.get(variant, (math.inf, -math.inf))[1]
        self._scraped[variant] = (now - last, now)
        prepared = now - last <= PREPARE_WHILE_SCRAPED_EVERY_SECONDS  # the commits render it
        if not gzipped:
            return self.samples_text(exposition_format, prepared) + self._per_scrape_text(exposition_format)
        deflated, crc, length = self._samples_deflated(exposition_format, prepared)
        tail = self._per_scrape_text(exposition_format)
        compressor = zlib.compressobj(TAIL_GZIP_LEVEL, zlib.DEFLATED, -zlib.MAX_WBITS)
        return b"".join((GZIP_HEADER, deflated, compressor.compress(tail), compressor.flush(),
                         _GZIP_TRAILER.pack(zlib.crc32(tail, crc), (length + len(tail)) & 0xFFFFFFFF)))


def _deflate_part(text: bytes) -> bytes:
    """`text` as raw deflate blocks, none of them final, ending on a byte boundary (a sync flush):
    such runs concatenate into one deflate stream, each one referring only to its own text."""
    compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, -zlib.MAX_WBITS)
    return compressor.compress(text) + compressor.flush(zlib.Z_SYNC_FLUSH)


class HealthCollectors:
    """What registers beside the agent's own metrics (the detectors' findings, Alertmanager
    delivery), in registration order. Not a prometheus_client CollectorRegistry: the exposition
    renders and keeps each collector's part on its own, and a collector with a `version()` (a
    value that changes whenever what its collect() yields may) is not collected at all while its
    version stays the same."""

    def __init__(self) -> None:
        self._collectors: list = []

    def register(self, collector) -> None:
        self._collectors.append(collector)

    def collectors(self) -> tuple:
        return tuple(self._collectors)


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
