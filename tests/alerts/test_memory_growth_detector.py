"""The memory_growth family's detector (agent/alerts/memory_growth/), on histories written sample
by sample: growth against the process's own load or its server's, restarts, trees, forecasts.
Its promtool cases are in test_memory_growth.py, its kept trends' tests in
test_memory_growth_trend.py."""
from __future__ import annotations

import random
import re

import pytest

from hybridmon.agent.alerts import memory_growth
from hybridmon.agent.alerts.memory_growth import load
from hybridmon.agent.alerts.memory_growth import trend as memory_growth_trend
from hybridmon.agent.detectors import servers
from hybridmon.exporters.cgroup_memory import CGROUP_MEMORY_HEADROOM
from hybridmon.exporters.process import RESIDENT
from tests.support.detector_history import (
    GIB,
    MIB,
    T0,
    THRESHOLDS,
    Trace,
    assert_says_its_rules_words,
    gpu_rows,
    host_memory_rows,
    inference_rows,
    process_rows,
    tree_info,
)

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


def with_server(tokens_per_second, running=lambda t: 8.0, pid="4242"):
    """A vLLM server tied to `pid` generating tokens_per_second(t) (its counter integrated per
    STEP) while running running(t) requests."""
    state = {"tokens": 0.0}

    def rows(t):
        state["tokens"] += tokens_per_second(t) * STEP
        return inference_rows(generated_tokens=state["tokens"], running=running(t), pid=pid)
    return rows


def tree(pid, name, root):
    """root_pid of one process (hybridmon_process_info), as exporters/process.py exports it."""
    return [tree_info(pid, name, root)]


def vllm_v1(tokens_growth_per_hour, *, with_tree=True, engine_faults_per_token=0.0):
    """vLLM V1 under a traffic ramp: the API server (pid 4242) serves /metrics, its child the
    engine core (pid 4343) holds memory exactly proportional to the tokens/s while its busy loop
    keeps one core flat at 100 %."""
    def rate(t):
        return 1000.0 * (1 + tokens_growth_per_hour * (t - T0) / HOUR)

    def tokens(t):
        """Generated so far: the integral of rate(t) from T0."""
        s = t - T0
        return 1000.0 * (s + tokens_growth_per_hour * s * s / (2 * HOUR))

    def processes(t):
        s = t - T0
        rows = (process_rows("4242", "python3", resident=2 * GIB, cpu_seconds=0.2 * s,
                             minor_faults=100 * s)
                + process_rows("4343", "python3", resident=4 * GIB * rate(t) / 1000.0,
                               cpu_seconds=1.0 * s, minor_faults=100 * s + engine_faults_per_token * tokens(t)))
        if with_tree:
            rows += tree("4242", "python3", "4242") + tree("4343", "python3", "4242")
        return rows
    return processes, with_server(rate)


def test_steady_growth_under_flat_load_fires_with_slope_and_forecast():
    trace = Trace()
    now = trace.run(T0, T0 + HOUR, STEP, process=leaking,
                    host_memory=lambda t: host_memory_rows(memory_available=32 * GIB))
    (finding,) = growth().evaluate(trace.history, now)
    assert finding.alertname == "InferenceProcessMemoryGrowth" and finding.severity == "warning"
    assert finding.labels == {"pid": "4242", "process_name": "vllm", "resource": "resident"}
    slope = GIB / HOUR
    assert finding.details["slope_bytes_per_second"] == pytest.approx(slope)
    # The forecast is against what bounds it: MemAvailable (32 GiB) on top of its own 8.5 GiB,
    # not MemTotal (64 GiB) for the process alone.
    assert finding.details["forecast_seconds_to_exhaustion"] == pytest.approx(32 * GIB / slope)
    assert finding.details["load_rise_share_per_hour"] == 0
    # the value: growth per hour its (flat) load does not explain, all of it
    assert finding.value == pytest.approx(GIB) and finding.unit == "B/h"
    # 5 % of the mean 8.5 GiB per hour is 435 MiB: the absolute 128 MiB/h is the smaller
    assert finding.threshold == pytest.approx(128 * MIB)
    mean = 8 * GIB + GIB * 0.5
    assert finding.details["growth_share_per_hour"] == pytest.approx(GIB / mean, rel=1e-3)
    # 1 GiB/h to within a float's rounding, which may leave it a hair under 1 GiB (1024 MiB)
    assert re.search("resident memory grows (1GiB|1024MiB) per hour more than its load explains",
                     finding.summary)
    # 32 h, to within rounding either side
    assert re.search("takes the tighter of MemAvailable and its cgroup's memory limit, plus its own use in "
                     "(1d 7h 59m|1d 8h) ", finding.description)


def test_a_restarted_process_is_judged_over_its_own_window_beside_the_others():
    """Memory growth rates all growing processes' counters together over the longest window;
    one that restarted a quarter of an hour in keeps its own window's steps: its finding is the
    one it gets when judged alone."""
    restart = T0 + HOUR / 4

    def restarting(t):
        if t < restart:
            return leaking(t, pid="4243", base=4 * GIB)
        return leaking(t, pid="4243", start=restart, since=restart, per_hour=2 * GIB)

    together_trace, alone_trace = Trace(), Trace()
    now = together_trace.run(T0, T0 + HOUR, STEP, process=lambda t: leaking(t) + restarting(t))
    alone_trace.run(T0, T0 + HOUR, STEP, process=restarting)
    together = {f.labels["pid"]: f for f in growth().evaluate(together_trace.history, now)}
    (by_itself,) = growth().evaluate(alone_trace.history, now)
    assert set(together) == {"4242", "4243"}
    assert together["4243"].details == by_itself.details and together["4243"].value == by_itself.value
    assert together["4243"].details["window_seconds"] <= now - restart
    assert together["4242"].details["window_seconds"] > now - restart


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
    # memory and load both double over the hour: the load explains all of the growth...
    assert finding.details["unexplained_bytes_per_hour"] < 0
    assert finding.details["load_rise_share_per_hour"] > 0.5
    # ...but the faults per CPU second (no server is tied to it) say it touches new memory: the
    # value is the whole growth
    assert finding.details["faults_per_work_rising"] == "yes"
    assert finding.value == pytest.approx(8 * GIB, rel=0.01)


def test_too_little_history_gives_no_finding():
    trace = Trace()
    span = THRESHOLDS.memory_growth.min_window_seconds
    now = trace.run(T0, T0 + span + 30, STEP, process=leaking)
    # min_window_seconds of memory at T0 + span, but the trend ends at the last whole minute (T0
    # is 20 s past one): T0 + span - 20 at T0 + span + 30
    assert growth().evaluate(trace.history, now) == []
    # T0 + span + 40: the window spans it, and the load's rise is judged over its halves (the
    # hour's older half is empty): a leak from the start fires a minute after the window spans
    now = trace.run(now + STEP, T0 + span + 40, STEP, process=leaking)
    assert len(growth().evaluate(trace.history, now)) == 1


def test_a_gap_in_history_does_not_stop_the_trend():
    trace = Trace()
    last = trace.run(T0, T0 + 1500, STEP, process=leaking)
    now = trace.run(last + 900, T0 + HOUR, STEP, process=leaking)   # 15 min without samples
    (finding,) = growth().evaluate(trace.history, now)
    assert finding.details["slope_bytes_per_second"] == pytest.approx(GIB / HOUR)


def test_a_restart_under_the_same_pid_starts_the_window_again():
    trace = Trace()
    restart = T0 + 2200

    def sawtooth(t):
        if t < restart:
            return leaking(t, per_hour=4 * GIB)
        return leaking(t, start=restart - 1, since=restart, per_hour=4 * GIB)
    now = trace.run(T0, T0 + HOUR, STEP, process=sawtooth)
    # 1,400 s since the restart is below the 1,500 s minimum: no finding yet
    assert growth().evaluate(trace.history, now) == []
    now = trace.run(now + STEP, restart + 1560, STEP, process=sawtooth)
    (finding,) = growth().evaluate(trace.history, now)
    # from the restart to the last whole minute, where the trend's window ends
    assert finding.details["window_seconds"] == pytest.approx(memory_growth_trend.trend_end(now) - restart)


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
    # what bounds it: the GPU's free memory (24 GiB - all used, 12 GiB + 1 GiB at the end) on
    # top of its own use, not the GPU's total for the process alone
    assert finding.details["forecast_seconds_to_exhaustion"] == pytest.approx(11 * GIB / slope)


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


def test_growth_under_the_servers_flat_load_fires_and_says_so():
    trace = Trace()
    now = trace.run(T0, T0 + HOUR, STEP, process=leaking, inference=with_server(lambda t: 1200.0))
    (finding,) = growth().evaluate(trace.history, now)
    assert finding.details["load_source"] == "server"
    assert finding.values["tokens"] == pytest.approx(1200, rel=0.01)
    assert finding.values["running"] == pytest.approx(8)
    assert finding.details["load_tokens_rise_share_per_hour"] == pytest.approx(0, abs=1e-9)
    assert "load_cpu_rise_share_per_hour" not in finding.details
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


def test_a_vllm_engine_core_is_judged_with_its_api_servers_traffic():
    """Issue 14 item 1: the engine core is a child of the API server that serves /metrics; on
    its own flat CPU a 30 %/h traffic ramp looked like a 30 %/h leak."""
    processes, server = vllm_v1(0.3)
    trace = Trace()
    now = trace.run(T0, T0 + HOUR, STEP, process=processes, inference=server)
    assert growth().evaluate(trace.history, now) == []
    # the same host without the process tree: the engine core falls back to its flat CPU
    processes, server = vllm_v1(0.3, with_tree=False)
    trace = Trace()
    now = trace.run(T0, T0 + HOUR, STEP, process=processes, inference=server)
    (finding,) = growth().evaluate(trace.history, now)
    assert finding.labels["pid"] == "4343" and finding.details["load_source"] == "cpu"


def test_tied_pids_are_the_whole_tree_of_the_process():
    roots = {"4242": "4242", "4343": "4242", "4444": "4242", "5151": "5151"}
    assert servers.tied_pids("4343", roots) == {"4242", "4343", "4444"}
    assert servers.tied_pids("5151", roots) == {"5151"}
    assert servers.tied_pids("9999", roots) == {"9999"}
    api = servers.Server("vllm", "http://127.0.0.1:8000/metrics", "m", "4242")
    assert servers.for_process([api], "4343") == []
    assert servers.for_process([api], "4343", servers.tied_pids("4343", roots)) == [api]


@pytest.mark.parametrize("ramp", [0.02, 0.07, 0.3, 1.0])
def test_memory_proportional_to_its_servers_load_is_silent_at_any_ramp(ramp):
    """Issue 14 item 2: at 7 %/h the memory passed the 5 %/h growth band while the tokens/s
    stayed inside the old 10 %/h "flat" band, and the text said the load was flat."""
    trace = Trace()

    def rate(t):
        return 1000.0 * (1 + ramp * (t - T0) / HOUR)

    def proportional(t):
        return process_rows("4242", "vllm", resident=8 * GIB * rate(t) / 1000.0,
                            cpu_seconds=1.0 * (t - T0), minor_faults=100 * (t - T0))
    now = trace.run(T0, T0 + HOUR, STEP, process=proportional, inference=with_server(rate))
    assert growth().evaluate(trace.history, now) == []


def test_a_leak_on_top_of_a_ramp_is_the_growth_beyond_the_ramp():
    trace = Trace()

    def rate(t):
        return 1000.0 * (1 + 0.07 * (t - T0) / HOUR)

    def leaking_on_a_ramp(t):
        s = t - T0
        return process_rows("4242", "vllm", resident=8 * GIB * rate(t) / 1000.0 + GIB * s / HOUR,
                            cpu_seconds=1.0 * s, minor_faults=100 * s)
    now = trace.run(T0, T0 + HOUR, STEP, process=leaking_on_a_ramp, inference=with_server(rate))
    (finding,) = growth().evaluate(trace.history, now)
    rise = finding.details["load_tokens_rise_share_per_hour"]
    assert rise == pytest.approx(0.07 / 1.035, rel=0.02)
    # The slope, 8 GiB x 7 %/h + 1 GiB/h, less what following the load allows: mean x rise x 2
    mean, slope = finding.details["mean_bytes"], finding.details["slope_bytes_per_second"]
    assert slope * 3600 == pytest.approx(1.56 * GIB, rel=0.01)
    # a ramp without noise: neither side's noise takes anything off
    assert finding.details["memory_noise_bytes_per_hour"] < MIB
    assert finding.value == pytest.approx(slope * 3600 - mean * rise * 2, abs=MIB)
    assert finding.value >= finding.threshold == 128 * MIB


def test_a_leak_in_a_big_process_fires_on_the_absolute_rate():
    """Issue 14 item 3: 3 MB/min (4.3 GB a day) is 1.4 %/h of a 12 GiB process, under the 5 %/h
    share that a 2.6 GB process would have passed."""
    leak_per_second = 3e6 / 60
    trace = Trace()

    def big(t):
        s = t - T0
        return process_rows("5151", "llama-server", resident=12 * GIB + leak_per_second * s,
                            cpu_seconds=1.0 * s, minor_faults=100 * s)
    now = trace.run(T0, T0 + HOUR, STEP, process=big,
                    host_memory=lambda t: host_memory_rows(memory_total=256 * GIB,
                                                           memory_available=200 * GIB))
    (finding,) = growth().evaluate(trace.history, now)
    assert finding.value == pytest.approx(leak_per_second * 3600)
    assert finding.threshold == THRESHOLDS.memory_growth.growth_bytes_per_hour
    assert finding.details["growth_share_per_hour"] < THRESHOLDS.memory_growth.growth_per_hour_share
    # what bounds it is MemAvailable on top of its own use, not MemTotal (256 GiB)
    assert finding.details["forecast_seconds_to_exhaustion"] == pytest.approx(
        200 * GIB / leak_per_second)
    # half that leak stays under the absolute rate: silent
    trace = Trace()
    now = trace.run(T0, T0 + HOUR, STEP, process=lambda t: [
        (row[0], 12 * GIB + leak_per_second / 2 * (t - T0), *row[2:])
        if row[0].name == RESIDENT.name else row for row in big(t)])
    assert growth().evaluate(trace.history, now) == []


def test_a_cgroup_limit_bounds_the_forecast_before_memavailable():
    """Issue 14 item 3: in a container whose limit leaves 2 GiB, the same leak runs out in
    2 GiB / rate, though the host has 200 GiB available."""
    leak_per_second = 3e6 / 60
    trace = Trace()

    def contained(t):
        rows = process_rows("5151", "llama-server", resident=12 * GIB + leak_per_second * (t - T0),
                            cpu_seconds=1.0 * (t - T0), minor_faults=100 * (t - T0))
        return rows + [(CGROUP_MEMORY_HEADROOM, 2 * GIB - leak_per_second * (t - T0), "5151",
                        "llama-server")]
    now = trace.run(T0, T0 + HOUR, STEP, process=contained,
                    host_memory=lambda t: host_memory_rows(memory_total=256 * GIB,
                                                           memory_available=200 * GIB))
    (finding,) = growth().evaluate(trace.history, now)
    assert finding.details["forecast_seconds_to_exhaustion"] == pytest.approx(
        (2 * GIB - leak_per_second * HOUR) / leak_per_second, rel=0.01)


def test_memory_that_does_not_grow_costs_no_slopes_and_no_load(monkeypatch):
    """Issue 17: an hour of flat memory under a steady load is ruled out without the n^2/2
    pairwise slopes or the per-minute load rates, so an evaluation costs little per process;
    growth is still judged in full."""
    trace = Trace()
    now = trace.run(T0, T0 + HOUR, STEP, process=lambda t: leaking(t, per_hour=0.0))

    def spent(*args, **kwargs):
        raise AssertionError("worked out for memory that does not grow")
    monkeypatch.setattr(memory_growth.windows, "theil_sen_slope", spent)
    monkeypatch.setattr(memory_growth.windows, "theil_sen_slopes", spent)
    monkeypatch.setattr(memory_growth.windows, "rate_steps", spent)
    # locked memory is VmLck + VmPin, both 0 here (most processes lock none): never added up
    monkeypatch.setattr(memory_growth.windows, "summed", spent)
    assert growth().evaluate(trace.history, now) == []
    monkeypatch.undo()
    trace = Trace()
    now = trace.run(T0, T0 + HOUR, STEP, process=leaking)
    (finding,) = growth().evaluate(trace.history, now)
    assert finding.details["slope_bytes_per_second"] == pytest.approx(GIB / HOUR)


def test_an_engine_core_whose_faults_follow_the_traffic_is_silent():
    """Issue 28, class 4: vLLM V1's engine core at one busy core, its memory and its page faults
    following the traffic (2 faults per generated token). Per CPU second its faults rise 30 %/h,
    which fired the "faults keep rising" clause; per generated token (its server's work) they
    stay flat."""
    processes, server = vllm_v1(0.3, engine_faults_per_token=2.0)
    trace = Trace()
    now = trace.run(T0, T0 + HOUR, STEP, process=processes, inference=server)
    assert growth().evaluate(trace.history, now) == []
    # without its tree, the same faults are judged per CPU second: rising, and it fires
    processes, server = vllm_v1(0.3, with_tree=False, engine_faults_per_token=2.0)
    trace = Trace()
    now = trace.run(T0, T0 + HOUR, STEP, process=processes, inference=server)
    (finding,) = growth().evaluate(trace.history, now)
    assert finding.details["faults_per_work_rising"] == "yes"


def stops(t, *, at, per_hour=GIB):
    """`leaking` until `at`, flat after."""
    return leaking(min(t, at), per_hour=per_hour) if t <= at else (
        process_rows("4242", "vllm", start_time=T0 - 86400, resident=8 * GIB + per_hour * (at - T0) / HOUR,
                     cpu_seconds=2.0 * (t - T0), minor_faults=500.0 * 2.0 * (t - T0)))


def test_a_ramp_that_stopped_raises_nothing_and_ends_the_finding_it_raised():
    """Issue 28, class 3: the hour's slope still holds a ramp after it stops. A ramp that stopped
    11 min before the window could first be judged (26 min) raises nothing, though the hour's slope
    is well above the threshold; one that was firing resolves once the last 10 min stop growing."""
    trace, detector = Trace(), growth()
    stop = T0 + 900

    def process(t):
        return stops(t, at=stop, per_hour=4 * GIB)
    now = trace.run(T0, T0 + 1600, STEP, process=process)
    assert detector.evaluate(trace.history, now) == []
    trace, detector = Trace(), growth()
    stop = T0 + 2400
    now = trace.run(T0, stop, STEP, process=lambda t: stops(t, at=stop))
    (finding,) = detector.evaluate(trace.history, now)
    resolved = None
    while resolved is None and now < stop + 1200:
        now = trace.run(now + STEP, now + STEP, STEP, process=lambda t: stops(t, at=stop))
        if not detector.evaluate(trace.history, now):
            resolved = now
    # the last 10 min's least-squares slope falls below half the threshold (64 MiB/h of a 1 GiB/h
    # ramp) once ~94 % of them are flat: ~9.5 min, plus the minute the trend moves on
    assert resolved is not None and resolved - stop <= 660, resolved - stop


def test_a_finding_holds_down_to_half_its_threshold_and_a_new_one_needs_all_of_it():
    """Issue 28, class 3: hysteresis. A leak of 100 MiB/h (under the 128 MiB/h it takes to fire,
    over the 64 MiB/h it takes to hold) on a flat load: a detector that saw it firing (after the
    leak ran at 200 MiB/h) holds it; a fresh detector raises nothing."""
    def process(t):
        s = t - T0
        grown = (200 * min(s, 1800) + 100 * max(s - 1800, 0)) * MIB / HOUR
        return process_rows("4242", "vllm", start_time=T0 - 86400, resident=12 * GIB + grown,
                            cpu_seconds=2.0 * s, minor_faults=1000.0 * s)
    trace, held = Trace(), growth()
    now = trace.run(T0, T0 + 1800, STEP, process=process)
    assert len(held.evaluate(trace.history, now)) == 1
    for _ in range(6 * 60):   # an hour more, evaluated every 10 s: the slope falls to 100 MiB/h
        now = trace.run(now + STEP, now + STEP, STEP, process=process)
        (finding,) = held.evaluate(trace.history, now)
    assert finding.value == pytest.approx(100 * MIB, rel=0.02)
    assert growth().evaluate(trace.history, now) == []


def bursty(seed, spread=0.15):
    """A load that jitters +-spread (uniform) about its level at each tick, the same on every run."""
    draw = random.Random(seed)
    return lambda level: level * (1 + draw.uniform(-spread, spread))


def test_a_leak_on_a_bursty_flat_load_fires_as_soon_as_the_window_allows():
    """Issue 28, class 3: 160 MiB/h in a 12 GiB process (1.25 x the absolute rate) on a CPU load
    that jitters +-15 % per tick. Judged against the load's rise as estimated, the noise of that
    estimate explained more than the leak and the alert fired late, then flapped; only the part of
    the load's rise beyond its noise explains growth, and the smooth memory loses nothing to its
    own noise."""
    leak = 160 * MIB
    cpu = bursty(28)
    state = {"cpu": 0.0}

    def process(t):
        state["cpu"] += cpu(6.0) * STEP
        return process_rows("5151", "llama-server", resident=12 * GIB + leak * (t - T0) / HOUR,
                            cpu_seconds=state["cpu"], minor_faults=100 * (t - T0))
    trace, detector = Trace(), growth()
    now = trace.run(T0, T0 + THRESHOLDS.memory_growth.min_window_seconds + 60, STEP, process=process)
    (finding,) = detector.evaluate(trace.history, now)
    assert finding.details["memory_noise_bytes_per_hour"] < MIB
    assert finding.value == pytest.approx(leak, rel=0.02)
    for _ in range(6 * 30):   # and it holds for the next 30 min, evaluated every 10 s
        now = trace.run(now + STEP, now + STEP, STEP, process=process)
        assert len(detector.evaluate(trace.history, now)) == 1, now - T0


@pytest.mark.parametrize("ramp", [0.0, 0.07])
def test_memory_that_scatters_with_a_bursty_load_is_silent(ramp):
    """The other side of the same noise: resident memory proportional to a load that jitters
    +-15 % per tick (KV blocks of the requests in flight) on a flat load or a 7 %/h ramp. The
    part of the load's rise within its noise explains nothing, but the memory's slope scatters
    as much and that part of it counts for nothing either: silent at every evaluation."""
    cpu = bursty(14)
    state = {"cpu": 0.0}

    def process(t):
        load = cpu(6.0 * (1 + ramp * (t - T0) / HOUR))
        state["cpu"] += load * STEP
        return process_rows("4242", "vllm", resident=2 * GIB * load, cpu_seconds=state["cpu"],
                            minor_faults=100 * (t - T0))
    trace, detector = Trace(), growth()
    now = trace.run(T0, T0 + THRESHOLDS.memory_growth.min_window_seconds, STEP, process=process)
    while now < T0 + 1.5 * HOUR:
        now = trace.run(now + STEP, now + STEP, STEP, process=process)
        assert detector.evaluate(trace.history, now) == [], now - T0


def test_a_memorys_noise_is_the_standard_error_of_its_halves_as_the_rule_records_it():
    """load.rise_noise_per_hour mirrors rules.process.HalfWindow over a gauge: its value at each
    whole minute of the window (the latest point at or before it, within the lookback delta), the
    halves' means and their scatter about the line through them."""
    end, window = 7200.0, 1200.0
    times = [end - window + 15 * i for i in range(int(window / 15) + 1)]
    assert load.rise_noise_per_hour(times, [1e9 + 50 * t for t in times], end, window, 2.0) == pytest.approx(
        0.0, abs=1e-3)
    # +-d about a line, alternating minute by minute: each half's scatter is d^2 (11 figures
    # each, both ends of a half being in it), so the standard error of the difference is
    # sqrt(2 d^2 / 11), and the halves' mean times are 10 min apart
    d = 4 * MIB
    values = [1e9 + 50 * t + (d if int(t // 60) % 2 else -d) for t in times]
    found = load.Halves.of(load.minute_points(times, values, end, window), end, window)
    assert found.span == pytest.approx(600.0)
    expected = 2.0 * (2 * d * d / 11) ** 0.5 * 3600 / 600
    assert load.rise_noise_per_hour(times, values, end, window, 2.0) == pytest.approx(expected, rel=0.02)
    # a subquery step finds the last point at or before it, not one after
    assert load.minute_points([0.0, 59.0, 61.0], [1.0, 2.0, 3.0], 60.0, 60.0) == [(0.0, 1.0), (60.0, 2.0)]
    # ...and none older than the lookback delta
    assert load.minute_points([0.0], [1.0], 420.0, 60.0) == []
