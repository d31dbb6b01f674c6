"""The status page's last hour (agent/status/page.py): per GPU, watched process, host and inference
server, the series its plots draw (agent/status/plots.py), with the related alert's threshold and
the spans in which that alert fired.

Cheap: each metric is read once per page with History.bucketed (one pass over the hour's points,
BUCKETS numbers per series out), gauges as bucket means, counters as the mean rate between two
buckets' last points. Thresholds are the loaded thresholds file's (Agent.thresholds), alert names
the families' own, so a plot's line is the number the alert compares with. The firing spans come
from the engine's firing log (Engine.firing_intervals).
"""
from __future__ import annotations

import math
from typing import Callable

from hybridmon.agent.alerts import catalogue
from hybridmon.agent.detectors.engine import Engine
from hybridmon.agent.detectors.links import DirectionLoad
from hybridmon.agent.loop.history import BucketedSeries, History
from hybridmon.agent.status.plots import Line, Reference, Window, sparkline
from hybridmon.exporters import host_memory, pressure, process
from hybridmon.exporters import gpu as gpu_metrics
from hybridmon.exporters.base import MetricSpec
from hybridmon.exporters.inference_names import BY_FIELD
from hybridmon.units import human_bytes, human_rate, percent

SPAN_SECONDS = 3600.0
# 90 buckets of 40 s: finer than a phone's card is wide in pixels is wasted, and 40 s keeps a
# 1 min alert window visible as at least one bucket.
BUCKETS = 90

Labels = dict[str, str]


def per_second(value: float) -> str:
    return f"{value:,.1f}/s" if value < 100 else f"{value:,.0f}/s"


class Trends:
    """The hour before `now` of `history`, each metric read at most once."""

    def __init__(self, history: History, engine: Engine, thresholds, now: float | None) -> None:
        self.history, self.thresholds = history, thresholds
        self.end = now if now is not None else 0.0
        self.start = self.end - SPAN_SECONDS
        width = SPAN_SECONDS / BUCKETS
        self.times = [self.start + (i + 0.5) * width for i in range(BUCKETS)]
        self.intervals = engine.firing_intervals() if now is not None else []
        self._read: dict[str, list[BucketedSeries]] = {}
        # (metric, the label names asked by) -> {their values: the series}: the page asks once per
        # GPU, process and model, and a scan per ask made it quadratic (issue 30: 20,000 models)
        self._indexes: dict[tuple[str, tuple[str, ...]], dict[tuple, list[BucketedSeries]]] = {}

    def series(self, spec: MetricSpec, **labels: str) -> list[BucketedSeries]:
        found = self._read.get(spec.name)
        if found is None:
            found = self._read[spec.name] = (
                self.history.bucketed(spec.name, self.start, self.end, BUCKETS) if self.end else [])
        if not labels:
            return list(found)
        names = tuple(sorted(labels))
        index = self._indexes.get((spec.name, names))
        if index is None:
            index = self._indexes[(spec.name, names)] = {}
            for one in found:
                index.setdefault(tuple(one.labels.get(name) for name in names), []).append(one)
        return index.get(tuple(labels[name] for name in names), [])

    def gauge(self, spec: MetricSpec, **labels: str) -> list[float] | None:
        """Bucket means of the one series with `labels`, summed when several match (a process on
        two GPUs); None when none does."""
        found = self.series(spec, **labels)
        if not found:
            return None
        return [sum(v for v in column if v == v) if any(v == v for v in column) else math.nan
                for column in zip(*(s.means for s in found))]

    def rate(self, spec: MetricSpec, **labels: str) -> list[float] | None:
        """Per-second increase of the counters with `labels` (summed) between consecutive buckets'
        last points; NaN for the first bucket and across a counter reset."""
        found = self.series(spec, **labels)
        if not found:
            return None
        rates = [_rates(s) for s in found]
        return [sum(v for v in column if v == v) if any(v == v for v in column) else math.nan
                for column in zip(*rates)]

    def increase(self, spec: MetricSpec, **labels: str) -> tuple[float, float] | None:
        """(increase, seconds): how much the counters with `labels` grew over the hour, summed, from
        each series' first bucketed point to its last (a reset's drop not counted), and the longest
        span a series covered; None when no series has two points."""
        total, span, counted = 0.0, 0.0, False
        for series in self.series(spec, **labels):
            points = [(at, value) for at, value in zip(series.last_times, series.last_values) if value == value]
            if len(points) < 2:
                continue
            counted = True
            total += sum(b - a for (_, a), (_, b) in zip(points, points[1:]) if b >= a)
            span = max(span, points[-1][0] - points[0][0])
        return (total, span) if counted else None

    def windows(self, alertname: str, where: Callable[[Labels], bool]) -> dict[str, list[Window]]:
        """{alertname: the spans within the plotted hour in which it fired for the entity `where`
        accepts}; empty when it did not fire."""
        spans = [(interval.start, self.end if interval.end is None else interval.end)
                 for interval in self.intervals if interval.alertname == alertname and where(interval.labels)]
        spans = [(a, b) for a, b in spans if b >= self.start]
        return {alertname: spans} if spans else {}

    def plot(self, title: str, lines: list[tuple[str, list[float] | None]], show: Callable[[float], str],
             references: list[Reference] = (), windows: dict[str, list[Window]] | None = None) -> str:
        """A sparkline of `lines` (label, bucket values) over the hour; the legend names the alerts
        whose firing spans are shaded."""
        drawn = [Line(label, self.times, values) for label, values in lines if values is not None]
        windows = windows or {}
        return sparkline(title, self.start, self.end, drawn, show, references,
                         [span for spans in windows.values() for span in spans], " and ".join(sorted(windows)))


def _rates(series: BucketedSeries) -> list[float]:
    out, previous = [], None
    for at, value in zip(series.last_times, series.last_values):
        if value != value:
            out.append(math.nan)
            continue
        if previous is not None and at > previous[0] and value >= previous[1]:
            out.append((value - previous[1]) / (at - previous[0]))
        else:
            out.append(math.nan)
        previous = (at, value)
    return out


def matches(**wanted: str) -> Callable[[Labels], bool]:
    return lambda labels: all(labels.get(k) == v for k, v in wanted.items())


def alertname(section: str) -> str:
    """The alert the family of thresholds section `section` raises (its first, where it has several)."""
    return catalogue.family(section).alertnames[0]


def gpu_plots(trends: Trends, key: tuple[str, str], latest_get: Callable[[MetricSpec], float | None],
              host_to_device: DirectionLoad | None) -> str:
    """PCIe traffic both ways against the host->device capacity GpuPcieStarvation last judged it
    by and its share of it; VRAM used against total and GpuMemoryHeadroomLow's used_share of it."""
    gpu, uuid = key
    starvation, headroom = trends.thresholds.pcie_starvation, trends.thresholds.gpu_memory_headroom
    capacity = host_to_device.capacity if host_to_device is not None else None
    references = []
    if capacity is not None:
        references = [Reference(f"{capacity.described} capacity", capacity.bytes_per_second, "capacity"),
                      Reference(f"alert at {percent(starvation.traffic_share_of_capacity)}:",
                                starvation.traffic_share_of_capacity * capacity.bytes_per_second, "threshold")]
    traffic = trends.plot("PCIe traffic, last hour", [
        ("host → device", trends.gauge(gpu_metrics.PCIE_THROUGHPUT, gpu=gpu, uuid=uuid, direction="host_to_device")),
        ("device → host", trends.gauge(gpu_metrics.PCIE_THROUGHPUT, gpu=gpu, uuid=uuid, direction="device_to_host")),
    ], human_rate, references, trends.windows(alertname("pcie_starvation"), matches(gpu=gpu, uuid=uuid)))
    total = latest_get(gpu_metrics.MEMORY_TOTAL)
    references = [] if not total else [
        Reference("total", total, "capacity"),
        Reference(f"alert at {percent(headroom.used_share)}:", headroom.used_share * total, "threshold")]
    memory_alert = alertname("gpu_memory_headroom")
    memory = trends.plot("GPU memory used, last hour",
                         [("used", trends.gauge(gpu_metrics.MEMORY_USED, gpu=gpu, uuid=uuid))], human_bytes,
                         references, trends.windows(memory_alert, matches(gpu=gpu, uuid=uuid)))
    return traffic + memory


def process_plots(trends: Trends, pid: str, process_name: str) -> str:
    """Resident, swapped-out and GPU memory (all GPUs summed) against the swap a watched process may
    hold before HostSwapThrash turns critical; shaded where that or its memory growth fired."""
    thrash = trends.thresholds.swap_thrash
    swap_alert, growth_alert = alertname("swap_thrash"), alertname("memory_growth")
    windows = {**trends.windows(swap_alert, matches(pid=pid)), **trends.windows(growth_alert, matches(pid=pid))}
    return trends.plot("Memory, last hour", [
        ("resident", trends.gauge(process.RESIDENT, pid=pid, process_name=process_name)),
        ("swapped out", trends.gauge(process.SWAP, pid=pid, process_name=process_name)),
        ("on GPUs", trends.gauge(gpu_metrics.PROCESS_MEMORY_USED, pid=pid)),
    ], human_bytes, [Reference("critical while the host thrashes, from", thrash.process_swap_bytes, "threshold")], windows)


def host_plots(trends: Trends) -> str:
    """Swap in/out and major faults against HostSwapThrash's rates, PSI memory some against its
    share; shaded where the host-wide HostSwapThrash (no pid label) fired."""
    thrash = trends.thresholds.swap_thrash
    windows = trends.windows(alertname("swap_thrash"), lambda labels: "pid" not in labels)
    if thrash.swap_out_bytes_per_second == thrash.swap_in_bytes_per_second:
        swap_references = [Reference("alert when both ways reach", thrash.swap_in_bytes_per_second, "threshold")]
    else:
        swap_references = [Reference("alert at in", thrash.swap_in_bytes_per_second, "threshold"),
                           Reference("and out", thrash.swap_out_bytes_per_second, "threshold")]
    return "".join((
        trends.plot("Swap traffic, last hour", [("in", trends.rate(host_memory.SWAP_IN_BYTES)),
                                                ("out", trends.rate(host_memory.SWAP_OUT_BYTES))],
                    human_rate, swap_references, windows),
        trends.plot("Major page faults, last hour", [("major faults", trends.rate(host_memory.MAJOR_PAGE_FAULTS))],
                    per_second, [Reference("alert at", thrash.major_faults_per_second, "threshold")], windows),
        trends.plot("PSI memory stall, last hour", [("some", trends.rate(pressure.STALLED_SECONDS, resource="memory", scope="some")),
                                                    ("full", trends.rate(pressure.STALLED_SECONDS, resource="memory", scope="full"))],
                    percent, [Reference("alert at some", thrash.memory_pressure_some_ratio, "threshold")], windows),
    ))


def server_plots(trends: Trends, key: tuple[str, ...]) -> str:
    """Generated tokens/s (shaded where InferenceThroughputDecay fired) and KV cache usage against
    InferenceKvOffloadPressure's kv_cache_full share."""
    server, endpoint, model, pid = key
    labels = {"server": server, "endpoint": endpoint, "model": model, "pid": pid}
    decay, pressure_alert = alertname("throughput_decay"), alertname("kv_offload_pressure")
    entity = matches(server=server, endpoint=endpoint, model=model)
    kv = trends.thresholds.kv_offload_pressure
    return (trends.plot("Tokens/s generated, last hour",
                        [("generated", trends.rate(BY_FIELD["generated_tokens"], **labels))], per_second,
                        windows=trends.windows(decay, entity))
            + trends.plot("KV cache used, last hour",
                          [("used", trends.gauge(BY_FIELD["kv_cache_usage_ratio"], **labels))], percent,
                          [Reference("alert at", kv.kv_cache_usage_at_least, "threshold")],
                          trends.windows(pressure_alert, lambda found: entity(found) and found.get("reason") == "kv_cache_full")))

