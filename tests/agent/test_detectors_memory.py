import pytest

from hybridmon.agent.detectors.engine import Engine
from hybridmon.agent.alerts import gpu_memory_headroom
from hybridmon.agent.alerts import memory_growth
from tests.support.detector_history import (assert_says_its_rules_words, GIB, T0, THRESHOLDS,
                                            Trace, gpu_rows, host_memory_rows, inference_rows,
                                            process_rows)

HOUR = 3600.0
STEP = 10.0  # samples every 10 s keep an hour of trace quick to build


def growth():
    return memory_growth.Detector(THRESHOLDS.memory_growth)


def leaking(t, *, pid="4242", start=T0 - 86400, base=8 * GIB, per_hour=GIB, since=T0,
            cpu_rate=2.0, faults_per_cpu_second=500.0):
    """A process whose resident memory grows per_hour while it burns a steady cpu_rate."""
    s = t - since
    cpu = cpu_rate * s
    return process_rows(pid, "vllm", start_time=start, resident=base + per_hour * s / HOUR,
                        cpu_seconds=cpu, minor_faults=faults_per_cpu_second * cpu)


def test_steady_growth_under_flat_load_fires_with_slope_and_forecast():
    trace = Trace()
    now = trace.run(T0, T0 + HOUR, STEP, process=leaking,
                    host_memory=lambda t: host_memory_rows(memory_available=32 * GIB))
    (finding,) = growth().evaluate(trace.history, now)
    assert finding.alertname == "InferenceProcessMemoryGrowth" and finding.severity == "warning"
    assert finding.labels == {"pid": "4242", "process_name": "vllm", "resource": "resident"}
    slope = GIB / HOUR
    assert finding.details["slope_bytes_per_second"] == pytest.approx(slope)
    current = 8 * GIB + GIB * (3570 / HOUR)   # the mean of the last minute (t = 3540..3600 s)
    assert finding.details["forecast_seconds_to_exhaustion"] == pytest.approx(
        (64 * GIB - current) / slope)
    assert finding.details["load_flat"] == "yes"
    assert finding.value == pytest.approx(slope) and finding.unit == "B/s"
    assert finding.threshold == pytest.approx(current * 0.05 / HOUR)
    assert finding.details["growth_share_per_hour"] == pytest.approx(GIB / current)
    assert "resident memory grows 1GiB per hour" in finding.summary
    assert "reaches the host's MemTotal in 2d 7h" in finding.description


def test_memory_growing_with_load_is_silent():
    trace = Trace()

    def with_load(t):
        s = t - T0
        cpu = s + s * s / (2 * HOUR)          # load rises from 1 to 2 CPUs over the hour
        return process_rows("4242", "vllm", resident=8 * GIB * (1 + s / HOUR), cpu_seconds=cpu,
                            minor_faults=500 * cpu)  # faults in step with the work
    now = trace.run(T0, T0 + HOUR, STEP, process=with_load)
    assert growth().evaluate(trace.history, now) == []


def test_growth_with_rising_faults_per_unit_of_work_fires_even_as_load_grows():
    trace = Trace()

    def faulting(t):
        s = t - T0
        cpu = s + s * s / (2 * HOUR)
        # fault rate 1500 (1 + s/h)^2 per second: faults per CPU second double over the hour
        faults = 1500 * HOUR / 3 * ((1 + s / HOUR) ** 3 - 1)
        return process_rows("4242", "vllm", resident=8 * GIB * (1 + s / HOUR), cpu_seconds=cpu,
                            minor_faults=faults)
    now = trace.run(T0, T0 + HOUR, STEP, process=faulting)
    (finding,) = growth().evaluate(trace.history, now)
    assert finding.details["load_flat"] == "no"
    assert finding.details["faults_per_cpu_second_rising"] == "yes"


def test_too_little_history_gives_no_finding():
    trace = Trace()
    now = trace.run(T0, T0 + 1700, STEP, process=leaking)
    assert growth().evaluate(trace.history, now) == []
    now = trace.run(now + STEP, T0 + 1810, STEP, process=leaking)
    assert len(growth().evaluate(trace.history, now)) == 1


def test_a_gap_in_history_does_not_stop_the_trend():
    trace = Trace()
    last = trace.run(T0, T0 + 1500, STEP, process=leaking)
    now = trace.run(last + 900, T0 + HOUR, STEP, process=leaking)   # 15 min without samples
    (finding,) = growth().evaluate(trace.history, now)
    assert finding.details["slope_bytes_per_second"] == pytest.approx(GIB / HOUR)


def test_a_restart_under_the_same_pid_starts_the_window_again():
    trace = Trace()
    restart = T0 + 2000

    def sawtooth(t):
        if t < restart:
            return leaking(t, per_hour=4 * GIB)
        return leaking(t, start=restart - 1, since=restart, per_hour=4 * GIB)
    now = trace.run(T0, T0 + HOUR, STEP, process=sawtooth)
    # 1,600 s since the restart is below the 1,800 s minimum: no finding yet
    assert growth().evaluate(trace.history, now) == []
    now = trace.run(now + STEP, restart + 1900, STEP, process=sawtooth)
    (finding,) = growth().evaluate(trace.history, now)
    assert finding.details["window_seconds"] == pytest.approx(1900)


def test_a_process_that_went_away_is_not_judged():
    trace = Trace()
    now = trace.run(T0, T0 + HOUR, STEP, process=lambda t: leaking(t) if t < T0 + 3000
                    else process_rows("5000", "vllm", start_time=T0 + 3000,
                                      cpu_seconds=2 * (t - T0 - 3000)))
    assert growth().evaluate(trace.history, now) == []


def test_gpu_memory_of_a_process_grows_while_its_load_is_flat():
    trace = Trace()

    def gpu(t):
        process_bytes = 10 * GIB + 2 * GIB * (t - T0) / HOUR
        return gpu_rows(used=process_bytes + GIB, total=24 * GIB,
                        processes={"4242": ("python3", process_bytes)})
    now = trace.run(T0, T0 + HOUR, STEP, gpu=gpu,
                    process=lambda t: leaking(t, per_hour=0))
    (finding,) = growth().evaluate(trace.history, now)
    assert finding.labels == {"pid": "4242", "process_name": "python3", "resource": "gpu_memory"}
    slope = 2 * GIB / HOUR
    assert finding.details["slope_bytes_per_second"] == pytest.approx(slope)
    current = 10 * GIB + 2 * GIB * 3570 / HOUR               # the last-minute mean
    assert finding.details["forecast_seconds_to_exhaustion"] == pytest.approx(
        (24 * GIB - current) / slope)


def test_locked_memory_is_locked_plus_pinned():
    trace = Trace()
    now = trace.run(T0, T0 + HOUR, STEP, process=lambda t: [
        row if row[0].name not in ("hybridmon_process_locked_bytes",
                                   "hybridmon_process_pinned_bytes")
        else (row[0], GIB + GIB * (t - T0) / HOUR, *row[2:])
        for row in leaking(t, per_hour=0)])
    (finding,) = growth().evaluate(trace.history, now)
    assert finding.labels["resource"] == "locked"
    assert_says_its_rules_words(finding)
    assert finding.details["slope_bytes_per_second"] == pytest.approx(2 * GIB / HOUR)


def with_server(tokens_per_second, running=lambda t: 8.0, pid="4242"):
    """A vLLM server tied to `pid` generating tokens_per_second(t) (its counter integrated per
    STEP) while running running(t) requests."""
    state = {"tokens": 0.0}

    def rows(t):
        state["tokens"] += tokens_per_second(t) * STEP
        return inference_rows(generated_tokens=state["tokens"], running=running(t), pid=pid)
    return rows


def test_growth_under_the_servers_flat_load_fires_and_says_so():
    trace = Trace()
    now = trace.run(T0, T0 + HOUR, STEP, process=leaking, inference=with_server(lambda t: 1200.0))
    (finding,) = growth().evaluate(trace.history, now)
    assert finding.details["load_source"] == "server"
    assert finding.details["load_generation_tokens_per_second"] == pytest.approx(1200, rel=0.01)
    assert finding.details["load_requests_running"] == pytest.approx(8)
    assert "load_cpu_seconds_per_second" not in finding.details
    assert "1.2k generation tokens/s with 8 running requests" in finding.description


def test_growth_with_the_servers_load_is_silent_though_the_cpu_is_flat():
    """The CPU of a GPU-bound server barely moves with its load: tokens/s and running requests
    tell growth with load from growth without it."""
    rising = (lambda t: 600.0 * (1 + (t - T0) / HOUR), lambda t: 8.0)
    more_requests = (lambda t: 1200.0, lambda t: 4.0 * (1 + (t - T0) / HOUR))
    for tokens, running in (rising, more_requests):
        trace = Trace()
        now = trace.run(T0, T0 + HOUR, STEP, process=leaking, inference=with_server(tokens, running))
        assert growth().evaluate(trace.history, now) == []


def test_a_server_on_another_pid_does_not_stand_for_the_process_load():
    trace = Trace()
    rising = with_server(lambda t: 600.0 * (1 + (t - T0) / HOUR), pid="5151")
    now = trace.run(T0, T0 + HOUR, STEP, process=leaking, inference=rising)
    (finding,) = growth().evaluate(trace.history, now)
    assert finding.details["load_source"] == "cpu"


# --- GpuMemoryHeadroomLow ------------------------------------------------------------------

def headroom():
    return gpu_memory_headroom.Detector(THRESHOLDS.gpu_memory_headroom)


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
    trace = Trace()
    now = trace.run(T0, T0 + 600, STEP, gpu=lambda t: gpu_rows(
        used=2 * GIB + 40 * GIB * (t - T0) / HOUR, total=24 * GIB))
    assert headroom().evaluate(trace.history, now) == []


def test_a_model_load_is_a_step_not_a_trend():
    # 1 GiB, then a model load to 20 GiB at T0 + 900, flat after. Least squares would forecast
    # the GPU full for half an hour; the median of pairwise slopes is positive only while the
    # step sits within about a minute of the window's middle, shorter than for_seconds.
    trace = Trace()
    engine = Engine([headroom()], trace.history)
    returned_at = []
    t = T0
    while t <= T0 + 3600:
        trace.commit("gpu", t, gpu_rows(used=GIB if t < T0 + 900 else 20 * GIB, total=24 * GIB))
        engine.evaluate(t)
        if engine.pending():
            returned_at.append(t)
        assert engine.firing() == [], t
        t += STEP
    assert returned_at and max(returned_at) - min(returned_at) < 300
