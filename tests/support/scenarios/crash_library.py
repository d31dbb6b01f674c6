"""The scenarios of issue 28's class 6, crashes of the inference server: the seed incident's clinic
(PCIe starvation, then the server OOM-killed at the same context length, again and again), an OOM
kill of an unrelated process (the host's alone), and a planned restart (silent).

Written like library.py's: start from the healthy host, change what the story needs from onset.
Every figure is a simulated input, not a measurement on a GPU. The host is the fixture's, with
what an on-premise clinic server leaves the inference server: 20 GiB of MemAvailable (MemFree 10
GiB), swap configured and idle. Ticks are 5 s: the exits, kills and restarts fall on them, and a 1
min rate still holds 12 points.
"""
from __future__ import annotations

from tests.support.scenarios.host import GIB, SyntheticHost
from tests.support.scenarios.library import (GPU0_UUID, VLLM, GpuLoad, Load, Step, apply, healthy_host, healthy_load,
                                             ramp, scenario)

# The story's server, as the process collector names it (process_name, server, model): vLLM's
# python3 serving the fixture's model (its command line, tests/fixtures/host-2node/proc/4242).
VLLM_IDENTITY = {"process_name": "python3", "server": "vllm", "model": "meta-llama/Meta-Llama-3-8B-Instruct"}
AVAILABLE, FREE = 20 * GIB, 10 * GIB

# Mistral-7B's KV cache: 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes (fp16) = 128 KiB a
# token (its config.json: num_hidden_layers 32, num_key_value_heads 8, head_dim 128). 20 patient
# histories at 4,200 tokens each hold 20 x 4,200 x 128 KiB = 10.3 GiB, offloaded to host memory as
# pinned shared memory at vllm#53042's 1.92x: 19.7 GiB, all but 0.3 GiB of what the host has left.
KV_PER_TOKEN = 128 * 1024
SEQUENCES, CRASH_TOKENS = 20, 4200
PINNED_OVERHEAD = 1.92
HOST_TIER_AT_CRASH = SEQUENCES * CRASH_TOKENS * KV_PER_TOKEN * PINNED_OVERHEAD
# The batch grows to 4,200 tokens in 75 s (prefill of the 12,000-token histories chunked, then
# decode), the link saturated all along; the kernel kills vLLM when MemAvailable reaches its
# watermark (0.4 GiB left: min_free_kbytes plus what the kernel will not reclaim).
GROWTH_SECONDS = 75
# systemd Restart=always restarts at once (RestartSec defaults to 100 ms); vLLM then answers
# /metrics again after 30 s: its 15 GB of weights come from the page cache and cross the link at
# 40 % of Gen4 x16 (12.6 GB/s, 1.2 s), the rest is its start-up (imports, CUDA context, profiling).
LOAD_SECONDS = 30
CYCLE_SECONDS = GROWTH_SECONDS + LOAD_SECONDS
ONSET = 60
CRASHES = tuple(ONSET + GROWTH_SECONDS + n * CYCLE_SECONDS for n in range(3))   # 135, 240, 345
RESTARTED_PIDS = (4400, 4500, 4600)


def clinic_host(host: SyntheticHost) -> None:
    healthy_host(host)
    host.set_meminfo(MemAvailable=AVAILABLE, MemFree=FREE)


def _started_at(t: float) -> float:
    from tests.support.scenarios import START_TIME  # the trace's first tick, set by write_trace
    return START_TIME + t


def _serving(load: Load, pid: int) -> None:
    """The load's vLLM figures for the process serving now (a restart's new pid)."""
    if pid != VLLM:
        load.processes[pid] = load.processes.pop(VLLM)


@scenario("server_crash_loop", tick_seconds=5, duration_seconds=420, onset_seconds=ONSET,
          expected=[("InferenceServerOomKilled", VLLM_IDENTITY), ("InferenceServerCrashLooping", VLLM_IDENTITY),
                    ("HostOomKill", {})],
          # a starved link for 75 s before each kill: GpuPcieStarvation needs 120 s, and may not
          # fire; the weights alert reads the same link (pcie_starvation allows it too)
          allowed=[("GpuPcieStarvation", {"gpu": "0", "uuid": GPU0_UUID}),
                   ("InferenceWeightsCrossingBus", {"server": "vllm"})],
          ramp=2 * CYCLE_SECONDS + GROWTH_SECONDS)
def server_crash_loop(host: SyntheticHost) -> Step:
    """The seed incident: a clinic's vLLM (GPU0, Gen4 x16) is sent 20 long patient histories at
    onset. As their contexts grow, the offloaded KV cache saturates the link (host-to-device 82 %
    of 31.5 GB/s, GPU0 ~20 % busy) and its pinned host tier grows to 19.7 GiB (20 x 4,200 tokens
    x 128 KiB x 1.92) over 75 s, MemAvailable 20 -> 0.4 GiB, swapping 8 MiB/s each way in the last
    30 s. At 4,200 tokens (135 s) the OOM killer kills it (oom_kill +1, pid 4242 gone);
    systemd restarts it at once (pid 4400), it loads for 30 s (endpoint refused, link 40 %
    busy with weights) and the client retries the same batch: killed again at 240 (pid 4500)
    and 345 (pid 4600). Three OOM kills in 3.5 min: a crash loop."""
    clinic_host(host)
    vllm_memory = host.gpu(0).process_memory[VLLM]
    resident = host.process(VLLM).rss_anon_bytes
    serving = [VLLM]                                    # the pids, in the order they served

    def step(t: float) -> None:
        crashed = [at for at in CRASHES if t >= at]
        while len(serving) <= len(crashed):             # a kill at this tick, and the restart
            host.count_oom_kills(1)
            host.restart_process(serving[-1], RESTARTED_PIDS[len(serving) - 1], _started_at(t))
            serving.append(RESTARTED_PIDS[len(serving) - 1])
        pid = serving[-1]
        load = healthy_load()
        _serving(load, pid)
        grown = 0.0
        if crashed and t < crashed[-1] + LOAD_SECONDS:  # loading its weights
            load.gpus[0] = GpuLoad(0.10, 0.40, 0.02)
            load.server.answer = "down"
            host.gpu(0).process_memory[pid] = 15e9       # its weights, before its KV pool
        else:
            host.gpu(0).process_memory[pid] = vllm_memory
            batch = crashed[-1] + LOAD_SECONDS if crashed else ONSET   # the client (re)sends it
            if t >= batch:
                since = t - batch
                grown = min(since / GROWTH_SECONDS, 1.0) * HOST_TIER_AT_CRASH
                load.gpus[0] = GpuLoad(ramp(since, 0, 10, 0.88, 0.20), ramp(since, 0, 10, 0.40, 0.82), 0.30)
                if since >= GROWTH_SECONDS - 30:
                    load.swap_in_bytes_per_second = load.swap_out_bytes_per_second = 8 * 2**20
        apply(host, load)
        host.process(pid).rss_anon_bytes = resident + grown
        host.set_meminfo(MemAvailable=max(AVAILABLE - grown, 0.4 * GIB), MemFree=max(FREE - grown, 0.2 * GIB))
    return step


@scenario("unrelated_oom_kill", tick_seconds=5, duration_seconds=180, onset_seconds=60,
          expected=[("HostOomKill", {})])
def unrelated_oom_kill(host: SyntheticHost) -> Step:
    """An unwatched batch job (no GPU memory, not a server's command line) grows by 19.6 GiB over
    60 s from onset, taking MemAvailable from 20 to 0.4 GiB, and the OOM killer kills it at 120
    (the largest process: oom_badness ranks by RSS). vLLM serves on, untouched: the host's alert,
    never the server's."""
    clinic_host(host)

    def step(t: float) -> None:
        apply(host, healthy_load())
        taken = ramp(t, 60, 120, 0.0, AVAILABLE - 0.4 * GIB) if t < 120 else 0.0
        if t == 120:
            host.count_oom_kills(1)
        host.set_meminfo(MemAvailable=AVAILABLE - taken, MemFree=max(FREE - taken, 0.2 * GIB))
    return step


@scenario("planned_restart", tick_seconds=5, duration_seconds=180, onset_seconds=None, expected=[])
def planned_restart(host: SyntheticHost) -> Step:
    """An operator restarts vLLM at 60 (systemctl restart: SIGTERM, a clean exit, no OOM kill;
    the new pid 4400 at once), which loads for 30 s (endpoint refused, GPU0 idle but for its
    weights' upload) and serves again: one exit, nothing to alert on."""
    clinic_host(host)
    serving = {"pid": VLLM}

    def step(t: float) -> None:
        if t >= 60 and serving["pid"] == VLLM:
            host.restart_process(VLLM, 4400, _started_at(t))
            serving["pid"] = 4400
        load = healthy_load()
        _serving(load, serving["pid"])
        if 60 <= t < 60 + LOAD_SECONDS:
            load.gpus[0] = GpuLoad(0.10, 0.40, 0.02)
            load.server.answer = "down"
        apply(host, load)
    return step
