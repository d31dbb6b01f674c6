"""GpuMemoryHeadroomLow: a GPU whose memory is nearly full (reason=used), or will be within the
horizon at its current trend (reason=forecast). A full GPU cannot grow the KV cache: this is the
point to offload. Runbook: GpuMemoryHeadroomLow.md.
"""
from __future__ import annotations

import math
from textwrap import dedent

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import common, windows
from hybridmon.agent.detectors.base import Finding
from hybridmon.agent.history import History
from hybridmon.exporters.gpu import MEMORY_TOTAL, MEMORY_USED
from hybridmon.rules import pcie as recorded  # its MEMORY_USED: the group's 1 min average of ours
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import data_spans, duration, gpu_query, number
from hybridmon.rules.promtool_cases import GIB, GPU0, GPU1, GPU2, GPU3, MIB, Test, above, firing, not_yet, num
from hybridmon.rules.templates import humanize_percentage

INPUTS = (MEMORY_USED, MEMORY_TOTAL)


class Settings(Section):
    used_share: float
    for_seconds: float
    forecast_horizon_seconds: float
    trend_window_seconds: float


def slope_record(h: Settings) -> str:
    """The group's shared recording of the used memory's slope over this section's trend window."""
    return recorded.memory_slope_record(h.trend_window_seconds)


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


def forecast_alert(h: Settings) -> Alert:
    trend = duration(h.trend_window_seconds)
    slope = slope_record(h)
    spans = data_spans(MEMORY_USED.name, h.trend_window_seconds, h.trend_window_seconds / 2)
    return Alert(
        "GpuMemoryHeadroomLow",
        dedent(f"""\
            # seconds until full at the current slope...
            ({MEMORY_TOTAL.name} - {recorded.MEMORY_USED})
              / ({slope} > 0)
              <= {number(h.forecast_horizon_seconds)}
            # ...measured over at least half the trend window
            and
            {spans}"""),
        h.for_seconds, "warning",
        "GPU <gpu> on <instance>: memory full in <value|humanizeDuration> at the current trend "
        "(growing <per_hour|humanize1024>B per hour)",
        "GPU <gpu> (<uuid>) memory use rises by <per_hour|humanize1024>B per hour "
        f"(a median of slopes over {trend}, so one jump such as a model load does not count); "
        "with <free|humanize1024>B left it is full in "
        f"<value|humanizeDuration> (threshold {duration(h.forecast_horizon_seconds)}). When it "
        "fills, requests are preempted or fail. Find the process that grows "
        "(nvidia-smi --query-compute-apps=pid,used_memory --format=csv) and whether it grows "
        "with its load or without it.",
        labels={"reason": "forecast"},
        queries={"per_hour": gpu_query("{} * 3600", slope),
                 "free": gpu_query(f"{{}} - {recorded.MEMORY_USED}", MEMORY_TOTAL.name)},
    )


def alerts(h: Settings) -> list[Alert]:
    return [used_alert(h), forecast_alert(h)]


class Detector:
    """GpuMemoryHeadroomLow per GPU: reason=used when used/total (avg 1m each) >= used_share;
    reason=forecast when the Theil-Sen slope of used memory over trend_window_seconds (with at
    least half that window of data) is positive and reaches total within
    forecast_horizon_seconds. Both must hold for for_seconds."""

    name = "gpu_memory_headroom"
    alertnames = ("GpuMemoryHeadroomLow",)

    def __init__(self, config: Settings) -> None:
        self.config = config
        # The 'used' half judges a minute; the forecast half checks its own span of data, so a
        # short `hybridmon check` still reports a full GPU.
        self.min_history_seconds = windows.AVERAGE_SECONDS
        self.used = used_alert(config)
        self.forecast = forecast_alert(config)

    def evaluate(self, history: History, now: float) -> list[Finding]:
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
            times, values = windows.window(series, now, config.trend_window_seconds)
            if len(times) < 2 or times[-1] - times[0] < config.trend_window_seconds / 2:
                continue
            slope = windows.theil_sen_slope(times, values, windows.LONG_TREND_POINTS)
            if slope is None or slope <= 0:
                continue
            full_in = windows.seconds_until(used, slope, total)
            if full_in > config.forecast_horizon_seconds:
                continue
            details = dict(base, slope_bytes_per_second=slope, forecast_seconds_to_full=full_in)
            findings.append(finding(self.forecast, common.gpu_entity(key), full_in,
                                    config.forecast_horizon_seconds, unit="s",
                                    values={"per_hour": slope * 3600, "free": total - used},
                                    details=details))
        return findings


def used_case(t, catalog) -> Test:
    h = t.gpu_memory_headroom
    rule = catalog.find("GpuMemoryHeadroomLow", reason="used")
    total = 24 * GIB
    full = above(h.used_share)
    test = Test("GPU memory: GPU 0 fills past the offload trigger; GPU 1 stays just under it",
                firing(h.for_seconds) + 120, catalog)
    for gpu, after in ((GPU0, full), (GPU1, 0.9 * h.used_share)):
        test.constant(MEMORY_TOTAL.name, total, **gpu)
        test.gauge(MEMORY_USED.name, 0.5 * total, after * total, **gpu)
    test.expect(not_yet(h.for_seconds), rule.alert)
    test.expect(firing(h.for_seconds), rule.alert,
                test.alert(rule, GPU0, value=full, used=full * total, total=total))
    return test


def forecast_case(t, catalog) -> Test:
    """GPU 0 fills at a steady rate from t=0; the rule judges once half the trend window has data."""
    h = t.gpu_memory_headroom
    rule = catalog.find("GpuMemoryHeadroomLow", reason="forecast")
    total, start = 24 * GIB + MIB, 12 * GIB
    active = int(math.ceil(h.trend_window_seconds / 2 / 60) * 60)
    at = active + math.ceil(h.for_seconds / 60) * 60 + 60
    left_at_eval = h.forecast_horizon_seconds / 2 + 0.5   # never a whole second: int() is safe
    rate = (total - start) / (at - 30 + left_at_eval)     # the 1 min average lags by 30 s
    if (total - start) / rate - (active - 30) > h.forecast_horizon_seconds:
        raise ValueError("forecast test: for_seconds too long for forecast_horizon_seconds")
    test = Test("GPU memory forecast: GPU 0 fills within the horizon; GPU 1 rises too slowly, "
                "GPU 2 is flat, GPU 3 loads a model (one jump) just before the rule can judge",
                at + 120, catalog)
    for gpu in (GPU0, GPU1, GPU2, GPU3):
        test.constant(MEMORY_TOTAL.name, total, **gpu)
    test.add(MEMORY_USED.name, f"{start}+{rate * test.interval!r}x{test.samples - 1}", **GPU0)
    slow = (total - start) / (4 * h.forecast_horizon_seconds) * test.interval
    test.add(MEMORY_USED.name, f"{start}+{slow!r}x{test.samples - 1}", **GPU1)
    test.constant(MEMORY_USED.name, 0.8 * total, **GPU2)
    jump = (active - 60) // test.interval   # samples before the jump
    test.add(MEMORY_USED.name,
             f"{num(0.1 * total)}x{jump - 1} {num(0.7 * total)}x{test.samples - jump - 1}", **GPU3)
    test.expect(active + int(h.for_seconds) - 60 if h.for_seconds >= 60 else active - 60, rule.alert)
    test.expect(at, rule.alert, test.alert(rule, GPU0, value=left_at_eval, per_hour=rate * 3600,
                                           free=rate * left_at_eval))
    return test


def cases(t, catalog) -> list[Test]:
    return [used_case(t, catalog), forecast_case(t, catalog)]


FAMILY = AlertFamily(
    section="gpu_memory_headroom",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group="hybridmon-gpu-memory",
    detector=Detector,
    alerts=lambda t: tuple(alerts(t.gpu_memory_headroom)),
    cases=cases,
    collectors=("gpu",),
    lookback_seconds=lambda settings: settings.trend_window_seconds,
)
