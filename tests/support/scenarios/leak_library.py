"""The scenarios of issue 28, classes 3 and 4: leaks that hold, and vLLM V1's engine core. A leak at
the absolute rate under a noisy load (it used to fire ~32 min after it began, then flap), a VRAM
ramp that stops while the hour's window still holds it (it used to raise a growth alert 18 min
after the stop), and V1's engine core whose page faults follow the traffic while its CPU stays at
one busy core (it used to get a growth warning on its faults per CPU second).

Written like library.py's: start from the healthy host, change what the story needs. Every figure
is a simulated input, not a measurement.
"""
from __future__ import annotations

from tests.support.scenarios.host import GIB, MIB, SyntheticHost
from tests.support.scenarios.library import (ENGINE, ENGINE_BYTES_PER_REQUEST, LLAMA, LLAMA_NAME, VLLM, Step,
                                             _split_load, _vllm_v1_split, apply, healthy_host, healthy_load,
                                             ramp, scenario)

# The leak of memory_leak_noisy_load: 1.25 x the absolute 128 MiB/h of [memory_growth]
# growth_bytes_per_hour, 1.3 %/h of a 12 GiB process (under the 5 %/h share): the absolute rate
# is what judges it.
NOISY_LEAK_BYTES_PER_HOUR = 160 * MIB
# llama-server's CPU per 10 s tick: 6 cores +-15 % (uniform). A server's CPU follows requests that
# arrive at random and differ in length; over a 10 s tick 15 % is a judgement of how bursty
# traffic is, not a measurement. Per minute it is +-~3.5 % (6 ticks): the load's rise over the
# halves of the hour then moves by ~1 %/h from noise alone (more over the halves of the first
# 26 min), x2 (load_following_factor) x 12 GiB = ~250 MiB/h of growth "explained" by noise at
# one standard error, more than the leak.
NOISY_CPU_CORES, NOISY_CPU_SPREAD = 6.0, 0.15


# A trend needs its window, and the load's rise a settled minute of figures in its older half.
@scenario("memory_leak_noisy_load", tick_seconds=10, duration_seconds=4200, onset_seconds=0,
          ramp=lambda t: t.memory_growth.min_window_seconds + 120,
          expected=[("InferenceProcessMemoryGrowth", {"pid": str(LLAMA), "process_name": LLAMA_NAME,
                                                      "resource": "resident"})])
def memory_leak_noisy_load(host: SyntheticHost) -> Step:
    """llama-server (pid 5151, no server metrics tied to it: its load is its CPU time) with 12 GiB
    resident leaks 160 MiB/h (1.25 x the absolute 128 MiB/h, 1.3 %/h of its size) from the start
    for 70 min, on a flat but bursty load: 6 CPU cores +-15 % per 10 s tick. The load's noise
    alone made the growth it explains hover around the leak, so the alert fired late (31 min) and
    flapped; only the part of the load's rise beyond its noise explains growth, so it fires within
    30 min and holds to the end, one episode."""
    healthy_host(host)
    llama = host.process(LLAMA)
    llama.rss_file_bytes = 0.0
    per_second = NOISY_LEAK_BYTES_PER_HOUR / 3600

    def step(t: float) -> None:
        load = healthy_load()
        load.processes[LLAMA].cpu_cores = host.jitter(NOISY_CPU_CORES, NOISY_CPU_SPREAD)
        apply(host, load)
        llama.rss_anon_bytes = 12 * GIB + per_second * t
    return step


# gpu_memory_ramp_stopped_window_holds: its GPU memory climbs for 15 min and stops, 18 min
# before the end of the trace (33 min).
RAMP_STOPPED_AT = 900
RAMP_STOPPED_END = RAMP_STOPPED_AT + 18 * 60


@scenario("gpu_memory_ramp_stopped_window_holds", tick_seconds=10, duration_seconds=RAMP_STOPPED_END,
          onset_seconds=None, expected=[])
def gpu_memory_ramp_stopped_window_holds(host: SyntheticHost) -> Step:
    """vLLM (pid 4242) fills its GPU memory lazily after a start: GPU0 (48 GiB) from 35 % to 45 %
    used over the first 15 min (4.8 GiB, ~19 GiB/h: a KV-cache pool or CUDA graphs allocated as
    the first long requests arrive), then flat for the last 18 min, its load flat throughout. At
    45 % the 26 GiB left would last 1.4 h at that rate, beyond the VRAM forecast's 1 h. The
    hour's window still holds the ramp when the trend is first judged; the recent part of it no
    longer grows: nothing fires (a growth alert 18 min after the stop is what issue 28 saw)."""
    healthy_host(host)
    gpu = host.gpu(0)
    gpu.set_memory_used_share(0.35, VLLM)

    def step(t: float) -> None:
        apply(host, healthy_load())
        gpu.set_memory_used_share(ramp(t, 0, RAMP_STOPPED_AT, 0.35, 0.45), VLLM)
    return step


# The engine core's page faults per running request per second: 1,500/s at 50 requests, the
# figure _split_load gives it flat (an illustration of faults that follow the batch: new request
# state, sampling buffers; not measured).
ENGINE_FAULTS_PER_REQUEST = 30.0


@scenario("healthy_vllm_v1_engine_faults_follow_load", tick_seconds=10, duration_seconds=3000,
          onset_seconds=None, expected=[])
def healthy_vllm_v1_engine_faults_follow_load(host: SyntheticHost) -> Step:
    """vLLM V1 split as in healthy_vllm_v1_traffic_ramp (API server 4242, engine core 4343 its
    child) with running requests rising 20 -> 50 over 50 min (tokens/s with them). The engine
    core's resident memory follows the traffic (8 GiB + 48 MiB per request) and so do its page
    faults, 30 per request per second, while its CPU stays at one busy core: per CPU second its
    faults rise with the traffic, per generated token they stay flat. Nothing fires."""
    healthy_host(host)
    _vllm_v1_split(host)
    engine = host.process(ENGINE)

    def step(t: float) -> None:
        running = ramp(t, 0, 3000, 20.0, 50.0)
        load = _split_load(running)
        load.processes[ENGINE].minor_faults_per_second = ENGINE_FAULTS_PER_REQUEST * running
        apply(host, load)
        engine.rss_anon_bytes = 6 * GIB + ENGINE_BYTES_PER_REQUEST * running
    return step
