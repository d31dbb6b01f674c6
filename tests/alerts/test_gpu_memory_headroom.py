"""The tests of the gpu_memory_headroom alert family (agent/alerts/gpu_memory_headroom.py): its detector, on
histories written sample by sample, and its rule's promtool cases (`promtool_cases`, written
to rules/tests/generated_gpu_memory_headroom.yml by `python -m tests.rules.generate` and run by
promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

import math

import pytest

from hybridmon.agent.alerts import gpu_memory_headroom
from hybridmon.agent.detectors.engine import Engine
from hybridmon.exporters.gpu import MEMORY_TOTAL, MEMORY_USED
from hybridmon.rules import (
    pcie as recorded,  # its MEMORY_USED: the group's 1 min average of ours
)
from tests.support.detector_history import (
    T0,
    THRESHOLDS,
    Trace,
    assert_says_its_rules_words,
    gpu_rows,
)
from tests.support.promtool_cases import (
    GIB,
    GPU0,
    GPU1,
    GPU2,
    GPU3,
    MIB,
    Test,
    above,
    firing,
    not_yet,
    num,
)

HOUR = 3600.0

STEP = 10.0  # samples every 10 s keep an hour of trace quick to build


def headroom():
    return gpu_memory_headroom.Detector(THRESHOLDS.gpu_memory_headroom)


def replay_ramp(used_at, start: float, end: float, step: float = 1.0) -> dict[str, list[tuple[float, str]]]:
    """Every `step` from start to end, one GPU whose used memory is used_at(t) (of 48 GiB), through
    the engine: reason -> [(time, "firing" | "resolved")] as they happened."""
    trace = Trace()
    engine = Engine([headroom()], trace.history)
    changes: dict[str, list[tuple[float, str]]] = {}
    engine.on_change.append(lambda state, change: changes.setdefault(
        state.finding.labels["reason"], []).append((engine_time[0], change)))
    engine_time = [start]
    t = start
    while t <= end:
        trace.commit("gpu", t, gpu_rows(used=used_at(t), total=48 * GIB))
        engine_time[0] = t
        if round(t - start) % 10 == 0:   # the agent evaluates every 10 s
            engine.evaluate(t)
        t += step
    return changes


def test_vram_over_95_percent_is_low_headroom():
    trace = Trace()
    now = trace.run(T0, T0 + 120, gpu=lambda t: gpu_rows(used=23 * GIB, total=24 * GIB))
    (finding,) = headroom().evaluate(trace.history, now)
    assert finding.labels == {"gpu": "0", "uuid": "GPU-0000", "reason": "used"}
    assert finding.value == pytest.approx(23 / 24) and finding.threshold == 0.95
    assert finding.for_seconds == 300
    assert "95.83% of its memory in use (23GiB of 24GiB)" in finding.summary


def test_vram_with_room_and_no_trend_is_silent():
    trace = Trace()
    now = trace.run(T0, T0 + 1800, STEP, gpu=lambda t: gpu_rows(used=20 * GIB, total=24 * GIB))
    assert headroom().evaluate(trace.history, now) == []


def test_vram_forecast_full_within_the_horizon():
    trace = Trace()
    now = trace.run(T0, T0 + 1800, STEP, gpu=lambda t: gpu_rows(
        used=14 * GIB + 8 * GIB * (t - T0) / HOUR, total=24 * GIB))
    (finding,) = headroom().evaluate(trace.history, now)
    assert finding.labels["reason"] == "forecast"
    assert_says_its_rules_words(finding)
    used_now = 14 * GIB + 8 * GIB * 1770 / HOUR       # last-minute mean
    assert finding.value == pytest.approx((24 * GIB - used_now) / (8 * GIB / HOUR))
    assert finding.threshold == 3600 and finding.unit == "s"
    # slower growth: full in about 2.5 h, beyond the 1 h horizon
    trace = Trace()
    now = trace.run(T0, T0 + 1800, STEP, gpu=lambda t: gpu_rows(
        used=18 * GIB + 2 * GIB * (t - T0) / HOUR, total=24 * GIB))
    assert headroom().evaluate(trace.history, now) == []


def test_a_gpu_that_appeared_recently_has_no_forecast_yet():
    """Less than half the trend window of data: no forecast yet; with half of it, one."""
    window = THRESHOLDS.gpu_memory_headroom.trend_window_seconds
    trace = Trace()
    now = trace.run(T0, T0 + window / 2 - 2 * STEP, STEP, gpu=lambda t: gpu_rows(
        used=2 * GIB + 40 * GIB * (t - T0) / HOUR, total=24 * GIB))
    assert headroom().evaluate(trace.history, now) == []
    now = trace.run(now + STEP, T0 + window / 2, STEP, gpu=lambda t: gpu_rows(
        used=2 * GIB + 40 * GIB * (t - T0) / HOUR, total=24 * GIB))
    (finding,) = headroom().evaluate(trace.history, now)
    assert finding.labels["reason"] == "forecast"


def test_a_model_load_is_a_step_not_a_trend():
    # 1 GiB, then a model load to 20 GiB at T0 + 900, flat after. Least squares over the window
    # would forecast the GPU full for ten minutes, and the last 100 s slope is steep right after
    # the load; but only two of the window's eleven 100 s slopes see the jump, so their median
    # (the trend) stays 0 and the slower of the two slopes never grows.
    trace = Trace()
    engine = Engine([headroom()], trace.history)
    t = T0
    while t <= T0 + 3600:
        trace.commit("gpu", t, gpu_rows(used=GIB if t < T0 + 900 else 20 * GIB, total=24 * GIB))
        engine.evaluate(t)
        assert engine.pending() == [] and engine.firing() == [], t
        t += STEP


def test_vram_forecast_comes_before_the_used_finding_on_a_ramp_that_fills():
    """Issue 14, item 4: VRAM flat at 80 % for 30 min, then filling at 20 % of 48 GiB per 8 min
    (72 GiB/h; 95 % after 6 min, full after 8). The forecast must fire before `used` (95 % plus
    its for_seconds) and before the GPU is full. A 30 min trend fired it ~14 min in, after
    `used`, when the GPU had been full for minutes."""
    h = THRESHOLDS.gpu_memory_headroom
    onset, total = T0 + 1800, 48 * GIB
    filling = lambda t: total * min(1.0, max(0.8, 0.8 + 0.2 * (t - onset) / 480))
    changes = replay_ramp(filling, T0, onset + 900)
    forecast_at = changes["forecast"][0]
    used_at = changes["used"][0]
    assert forecast_at[1] == "firing" and used_at[1] == "firing"
    print(f"forecast {forecast_at[0] - onset:.0f} s after onset, used {used_at[0] - onset:.0f} s: "
          f"lead {used_at[0] - forecast_at[0]:.0f} s")
    assert forecast_at[0] < onset + 480 < used_at[0]
    # Growth stops when the GPU is full: the forecast resolves, `used` stays.
    assert changes["forecast"][-1][1] == "resolved"
    assert changes["forecast"][-1][0] - (onset + 480) <= h.trend_window_seconds / 6 + 20
    assert changes["used"] == [used_at]


def test_vram_forecast_resolves_once_growth_stops():
    """Issue 14, item 4: a ramp that would fill the GPU within the hour stops below full (70 % ->
    88 % of 48 GiB over 10 min). Nothing can know in advance that it stops, so the forecast fires
    while it grows; once it stops, the forecast resolves within the last 100 s slope's span (plus
    an evaluation), where the window's median alone kept it for minutes (30 min window: 15)."""
    h = THRESHOLDS.gpu_memory_headroom
    onset, stop, total = T0 + 1800, T0 + 2400, 48 * GIB
    ramp = lambda t: total * min(0.88, max(0.70, 0.70 + 0.18 * (t - onset) / 600))
    changes = replay_ramp(ramp, T0, stop + 900)
    assert "used" not in changes
    (fired, firing), (resolved, state) = changes["forecast"]
    assert (firing, state) == ("firing", "resolved")
    assert onset < fired < stop
    print(f"forecast fired {fired - onset:.0f} s after onset, resolved {resolved - stop:.0f} s after growth stopped")
    assert 0 < resolved - stop <= h.trend_window_seconds / 6 + 20


# --- its rule's promtool cases ------------------------------------------------------------------


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
    """GPU 0 fills at a steady rate from t=0: the rule judges once half the trend window has data
    and fires after forecast_for_seconds; its growth then stops and the forecast resolves as soon
    as the last local slope's span is flat (a window's median alone would keep it for minutes)."""
    h = t.gpu_memory_headroom
    rule = catalog.find("GpuMemoryHeadroomLow", reason="forecast")
    total, start = 24 * GIB + MIB, 12 * GIB
    local = recorded.local_slope_seconds(h.trend_window_seconds)
    active = int(math.ceil(h.trend_window_seconds / 2 / 60) * 60)
    at = active + math.ceil(h.forecast_for_seconds / 60) * 60 + 60
    left_at_eval = h.forecast_horizon_seconds / 2 + 0.5   # never a whole second: int() is safe
    rate = (total - start) / (at - 30 + left_at_eval)     # the 1 min average lags by 30 s
    if (total - start) / rate - (active - 30) > h.forecast_horizon_seconds:
        raise ValueError("forecast test: forecast_for_seconds too long for forecast_horizon_seconds")
    stop = at + 60                                         # growth stops here
    resolved = stop + int(math.ceil(local / 60) * 60)      # the last local slope's span is all flat
    test = Test("GPU memory forecast: GPU 0 fills within the horizon, then stops growing; GPU 1 "
                "rises too slowly, GPU 2 is flat, GPU 3 loads a model (one jump) just before the "
                "rule can judge", resolved + 120, catalog)
    for gpu in (GPU0, GPU1, GPU2, GPU3):
        test.constant(MEMORY_TOTAL.name, total, **gpu)
    test.values(MEMORY_USED.name, [start + rate * min(k * test.interval, stop) for k in range(test.samples)],
                **GPU0)
    slow = (total - start) / (4 * h.forecast_horizon_seconds) * test.interval
    test.add(MEMORY_USED.name, f"{start}+{slow!r}x{test.samples - 1}", **GPU1)
    test.constant(MEMORY_USED.name, 0.8 * total, **GPU2)
    jump = (active - 60) // test.interval   # samples before the jump
    test.add(MEMORY_USED.name,
             f"{num(0.1 * total)}x{jump - 1} {num(0.7 * total)}x{test.samples - jump - 1}", **GPU3)
    if h.forecast_for_seconds >= 60:
        test.expect(active + int(h.forecast_for_seconds) - 60, rule.alert)
    test.expect(at, rule.alert, test.alert(rule, GPU0, value=left_at_eval, per_hour=rate * 3600,
                                           free=rate * left_at_eval))
    test.expect(resolved, rule.alert)
    return test


def promtool_cases(t, catalog) -> list[Test]:
    return [used_case(t, catalog), forecast_case(t, catalog)]
