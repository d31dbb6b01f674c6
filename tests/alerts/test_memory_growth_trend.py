"""memory_growth keeps each process's trend from one evaluation to the next (issue 17): what it
finds must be what a detector without that memory finds, evaluation after evaluation."""
from __future__ import annotations

import pytest

from hybridmon.agent.alerts import memory_growth
from hybridmon.agent.alerts.memory_growth import trend as memory_growth_trend
from hybridmon.agent.detectors import windows
from tests.support.detector_history import GIB, T0, THRESHOLDS, Trace, process_rows

HOUR = 3600.0

STEP = 10.0


def growth():
    return memory_growth.Detector(THRESHOLDS.memory_growth)


def leaking(t, pid="4242", per_hour=GIB, start=T0 - 86400):
    return process_rows(pid, "vllm", start_time=start, resident=8 * GIB + per_hour * (t - T0) / HOUR,
                        cpu_seconds=2.0 * (t - T0), minor_faults=1000.0 * (t - T0))

RESTART = T0 + HOUR + 95   # pid 4243 restarts then (a new start time), within the evaluations


def two_processes(t):
    return leaking(t) + leaking(t, pid="4243", per_hour=2 * GIB, start=T0 - 86400 if t < RESTART else RESTART)


def comparable(findings):
    return [(f.labels, f.value, f.threshold, f.details, f.summary, f.description) for f in findings]


def test_findings_with_the_kept_trends_are_those_worked_out_afresh():
    """At the daemon's cadence, through minute boundaries, a commit that arrives after an
    evaluation of its minute and a restart, the detector that keeps its trends finds what a new
    detector finds at every evaluation."""
    trace = Trace()
    now = trace.run(T0, T0 + HOUR, STEP, process=two_processes)
    kept = growth()
    pids = []
    for _ in range(20):
        pids.append({f.labels["pid"] for f in kept.evaluate(trace.history, now)})
        assert comparable(kept.evaluate(trace.history, now)) == comparable(growth().evaluate(trace.history, now))
        now = trace.run(now + STEP, now + STEP, STEP, process=two_processes)
    assert pids[0] == {"4242", "4243"} and pids[-1] == {"4242"}   # 4243's window began again
    # the collector falls behind: an evaluation before the next commits, then the same time after
    lagging = now + 35
    assert comparable(kept.evaluate(trace.history, lagging)) == comparable(growth().evaluate(trace.history, lagging))
    trace.run(now + STEP, lagging, STEP, process=two_processes)
    assert comparable(kept.evaluate(trace.history, lagging)) == comparable(growth().evaluate(trace.history, lagging))
    assert kept.evaluate(trace.history, lagging)   # the leak is still found


def test_a_trend_is_worked_out_once_a_minute(monkeypatch):
    """The slopes and per-minute rates of the window ending at the last whole minute are worked
    out at the first evaluation of the minute; the others reuse them (each still reads the
    amount now: the finding's current figure is the last minute's)."""
    trace = Trace()
    # T0 is 20 s past a minute: T0 + 1 h and the next evaluation, 10 s on, share a minute
    now = trace.run(T0, T0 + HOUR, STEP, process=two_processes)
    assert memory_growth_trend.trend_end(now) == memory_growth_trend.trend_end(now + STEP)
    detector = growth()
    first = {f.labels["pid"]: f for f in detector.evaluate(trace.history, now)}["4242"]
    later = trace.run(now + STEP, now + STEP, STEP, process=two_processes)

    def spent(*args, **kwargs):
        raise AssertionError("worked out again within the minute")
    for name in ("theil_sen_slope", "theil_sen_slopes", "theil_sen_below", "rate_steps", "rate_steps_of"):
        monkeypatch.setattr(windows, name, spent)
    second = {f.labels["pid"]: f for f in detector.evaluate(trace.history, later)}["4242"]
    assert second.details["slope_bytes_per_second"] == first.details["slope_bytes_per_second"]
    assert second.details["current_bytes"] > first.details["current_bytes"]   # read now: it grew
    # told to forget (the benchmarks' first evaluation of a minute), it works them out anew
    detector.forget_trends()
    with pytest.raises(AssertionError, match="worked out again"):
        detector.evaluate(trace.history, later)
    # the next minute's window holds new points: worked out anew
    monkeypatch.undo()
    detector.evaluate(trace.history, later)
    for name in ("theil_sen_slope", "theil_sen_slopes", "theil_sen_below", "rate_steps", "rate_steps_of"):
        monkeypatch.setattr(windows, name, spent)
    next_minute = trace.run(later + STEP, later + 4 * STEP, STEP, process=two_processes)
    with pytest.raises(AssertionError, match="worked out again"):
        detector.evaluate(trace.history, next_minute)


def test_a_detector_asked_about_another_history_forgets_its_trends():
    """Two histories with the same tick times hold the same counts and first and last times: the
    trends are kept for one history only, so the flat one is not judged with the leak's."""
    leak, flat = Trace(), Trace()
    now = leak.run(T0, T0 + HOUR, STEP, process=leaking)
    flat.run(T0, T0 + HOUR, STEP, process=lambda t: leaking(t, per_hour=0.0))
    detector = growth()
    assert len(detector.evaluate(leak.history, now)) == 1
    assert detector.evaluate(flat.history, now) == []
