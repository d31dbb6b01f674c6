"""GpuMemoryHeadroomLow: a GPU whose memory is nearly full (reason=used), or will be within the
horizon at its current growth (reason=forecast). A full GPU cannot grow the KV cache: this is the
point to offload. Runbook: GpuMemoryHeadroomLow.md.

The forecast must come before the fact and end with the growth (issue 14, item 4). Its slope is the
slower of two, both computed alike by the rule and the detector:

- the trend: the median of local least-squares slopes, each over a sixth of `trend_window_seconds`,
  one a minute (rules.promql.robust_slope), so one jump such as a model load does not count;
- the latest of those local slopes, at the evaluation time itself, so the forecast resolves within
  a sixth of the window once growth stops, instead of lingering while the window's median still
  remembers it.

Both are read on the rule's subquery grid: the steps of `[w:1m]` are the multiples of 60 s within
[now - w, now] (Prometheus 2.x closes both ends; 3.x leaves the start open, one step of eleven
fewer), each `deriv(x[l])` over the samples in [step - l, step].
"""
from __future__ import annotations

import math
import statistics
from textwrap import dedent
from typing import Sequence

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import common, windows
from hybridmon.agent.detectors.base import DetectorBase, Finding, HistoryReader
from hybridmon.agent.loop.history import SeriesHistory
from hybridmon.exporters.gpu import MEMORY_TOTAL, MEMORY_USED
from hybridmon.rules import groups
from hybridmon.rules import pcie as recorded  # its MEMORY_USED: the group's 1 min average of ours
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import data_spans, duration, gpu_query, number, selector
from hybridmon.rules.templates import humanize_percentage

INPUTS = (MEMORY_USED, MEMORY_TOTAL)
SUBQUERY_STEP_SECONDS = 60.0  # robust_slope's `[w:1m]`: one local slope a minute


class Settings(Section):
    used_share: float
    for_seconds: float
    forecast_horizon_seconds: float
    trend_window_seconds: float
    forecast_for_seconds: float


def slope_record(h: Settings) -> str:
    """The group's shared recording of the used memory's slope over this section's trend window."""
    return recorded.memory_slope_record(h.trend_window_seconds)


def recent_slope_record(h: Settings) -> str:
    """The group's shared recording of the used memory's slope over the window's last sixth."""
    return recorded.memory_recent_slope_record(h.trend_window_seconds)


def used_alert(h: Settings) -> Alert:
    return Alert(
        "GpuMemoryHeadroomLow",
        f"{recorded.MEMORY_USED} / {MEMORY_TOTAL.name} >= {number(h.used_share)}",
        h.for_seconds, "warning",
        "GPU <gpu> on <instance>: <value|humanizePercentage> of its memory in use "
        "(<used|humanize1024>B of <total|humanize1024>B)",
        "GPU <gpu> (<uuid>) has <used|humanize1024>B of its <total|humanize1024>B in use "
        "(<value|humanizePercentage>, 1 min average; threshold "
        f"{humanize_percentage(h.used_share)}, where offloading should start). The next long "
        "context or larger batch does not fit: the server preempts requests, cuts contexts, fails "
        "allocations (CUDA out of memory) or dies. See who holds it (nvidia-smi "
        "--query-compute-apps=pid,used_memory --format=csv), then offload the older KV cache to "
        "host memory in tiers (quantized offload costs accuracy, weight offload costs latency), "
        "use smaller KV pages, or lower the context and batch limits.",
        labels={"reason": "used"},
        queries={"used": gpu_query("{}", recorded.MEMORY_USED),
                 "total": gpu_query("{}", MEMORY_TOTAL.name)},
    )


def slower_slope(trend: str, recent: str) -> str:
    """PromQL for the smaller of two vectors with the same labels: `a` where a < b, else `b`."""
    return f"({trend} < {recent} or {recent})"


def forecast_alert(h: Settings) -> Alert:
    trend = duration(h.trend_window_seconds)
    local = duration(recorded.local_slope_seconds(h.trend_window_seconds))
    slope = slower_slope(slope_record(h), recent_slope_record(h))
    trend_selector, names = selector(slope_record(h), "gpu")
    recent_selector, _ = selector(recent_slope_record(h), "gpu")
    spans = data_spans(MEMORY_USED.name, h.trend_window_seconds, h.trend_window_seconds / 2)
    return Alert(
        "GpuMemoryHeadroomLow",
        dedent(f"""\
            # seconds until full at the slower of the window's median slope and the latest
            # slope (growth must go on now)...
            ({MEMORY_TOTAL.name} - {recorded.MEMORY_USED})
              / ({slope} > 0)
              <= {number(h.forecast_horizon_seconds)}
            # ...measured over at least half the trend window
            and
            {spans}"""),
        h.forecast_for_seconds, "warning",
        "GPU <gpu> on <instance>: memory full in <value|humanizeDuration> at the current trend "
        "(growing <per_hour|humanize1024>B per hour)",
        "GPU <gpu> (<uuid>) memory use rises by <per_hour|humanize1024>B per hour (the slower of "
        f"the median of its {local} slopes over {trend}, so one jump such as a model load does not "
        f"count, and its slope over the last {local}, so this ends when the growth does); with "
        "<free|humanize1024>B left it is full in "
        f"<value|humanizeDuration> (threshold {duration(h.forecast_horizon_seconds)}). When it "
        "fills, requests are preempted or fail. Find the process that grows "
        "(nvidia-smi --query-compute-apps=pid,used_memory --format=csv) and whether it grows "
        "with its load or without it.",
        labels={"reason": "forecast"},
        # slower_slope names the recent slope twice: three selectors, each filled with the labels
        queries={"per_hour": (f"{slower_slope(trend_selector, recent_selector)} * 3600", names * 3),
                 "free": gpu_query(f"{{}} - {recorded.MEMORY_USED}", MEMORY_TOTAL.name)},
    )


def alerts(h: Settings) -> list[Alert]:
    return [used_alert(h), forecast_alert(h)]


def least_squares_slope(times: Sequence[float], values: Sequence[float]) -> float | None:
    """PromQL's deriv(): the slope of the least-squares line through the points, per second;
    None with fewer than two points at distinct times."""
    if len(times) < 2:
        return None
    mean_time = sum(times) / len(times)
    mean_value = sum(values) / len(values)
    spread = sum((t - mean_time) ** 2 for t in times)
    if spread == 0:
        return None
    return sum((t - mean_time) * (v - mean_value) for t, v in zip(times, values)) / spread


def subquery_steps(now: float, window_seconds: float, step: float = SUBQUERY_STEP_SECONDS) -> list[float]:
    """The evaluation times of a `[window:step]` subquery at `now`: the multiples of `step`
    within [now - window, now] (Prometheus aligns subquery steps to absolute time)."""
    first = math.ceil((now - window_seconds) / step) * step
    return [first + k * step for k in range(int((now - first) // step) + 1)]


def trend_slope(series: SeriesHistory, now: float, window_seconds: float) -> float | None:
    """robust_slope(x, window) as Prometheus computes it: the median of deriv(x[window/6]) at each
    step of the `[window:1m]` subquery that has two points; None when none has."""
    local = recorded.local_slope_seconds(window_seconds)
    slopes = [slope for at in subquery_steps(now, window_seconds)
              if (slope := least_squares_slope(*windows.window(series, at, local))) is not None]
    return statistics.median(slopes) if slopes else None


def recent_slope(series: SeriesHistory, now: float, window_seconds: float) -> float | None:
    """deriv(x[window/6]) at `now`: the growth going on at the end of the window."""
    return least_squares_slope(*windows.window(series, now, recorded.local_slope_seconds(window_seconds)))


class Detector(DetectorBase):
    """GpuMemoryHeadroomLow per GPU: reason=used when used/total (avg 1m each) >= used_share for
    for_seconds; reason=forecast when the slower of the trend slope and the recent slope (module
    docstring) is positive and reaches total within forecast_horizon_seconds, with at least half
    of trend_window_seconds of data, for forecast_for_seconds."""

    name = "gpu_memory_headroom"
    alertnames = ("GpuMemoryHeadroomLow",)

    def __init__(self, config: Settings) -> None:
        self.config = config
        # The 'used' half judges a minute; the forecast half checks its own span of data, so a
        # short `hybridmon check` still reports a full GPU.
        self.min_history_seconds = windows.AVERAGE_SECONDS
        self.used = used_alert(config)
        self.forecast = forecast_alert(config)

    def evaluate(self, history: HistoryReader, now: float) -> list[Finding]:
        config = self.config
        totals = common.gpu_averages(history, MEMORY_TOTAL.name, now)
        used_series = windows.by_labels(history.series(MEMORY_USED.name), *common.GPU_LABELS)
        findings = []
        for key, series in sorted(used_series.items()):
            used = windows.avg_over_time(series, now)
            total = totals.get(key)
            if used is None or not total:
                continue
            share = used / total
            base = {"used_bytes": used, "total_bytes": total, "used_share": share}
            if share >= config.used_share:
                findings.append(finding(self.used, common.gpu_entity(key), share, config.used_share,
                                        unit="ratio", values={"used": used, "total": total},
                                        details=base))
            forecast = self.forecast_finding(key, series, now, used, total, base)
            if forecast is not None:
                findings.append(forecast)
        return findings

    def forecast_finding(self, key, series: SeriesHistory, now: float, used: float, total: float,
                         base: dict) -> Finding | None:
        window = self.config.trend_window_seconds
        times, _ = windows.window(series, now, window)
        if len(times) < 2 or times[-1] - times[0] < window / 2:
            return None
        trend, recent = trend_slope(series, now, window), recent_slope(series, now, window)
        if trend is None or recent is None or min(trend, recent) <= 0:
            return None
        slope = min(trend, recent)
        full_in = windows.seconds_until(used, slope, total)
        if full_in > self.config.forecast_horizon_seconds:
            return None
        details = dict(base, slope_bytes_per_second=slope, trend_slope_bytes_per_second=trend,
                       recent_slope_bytes_per_second=recent, forecast_seconds_to_full=full_in)
        return finding(self.forecast, common.gpu_entity(key), full_in,
                       self.config.forecast_horizon_seconds, unit="s",
                       values={"per_hour": slope * 3600, "free": total - used}, details=details)


FAMILY = AlertFamily(
    section="gpu_memory_headroom",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group=groups.GPU_MEMORY,
    detector=Detector,
    alerts=lambda t: tuple(alerts(t.gpu_memory_headroom)),
    collectors=("gpu",),
    lookback_seconds=lambda settings: settings.trend_window_seconds,
    scenario="gpu_memory_headroom",
)
