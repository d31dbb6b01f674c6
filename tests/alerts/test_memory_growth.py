"""The tests of the memory_growth alert family (agent/alerts/memory_growth/): its rule's promtool
cases (`promtool_cases`, written to rules/tests/generated_memory_growth.yml by `python -m
tests.rules.generate` and run by promtool in tests/rules/test_rules.py): series every minute, each
case's expected alerts with the text Prometheus must render. Its detector's tests are in
test_memory_growth_detector.py and test_memory_growth_trend.py."""
from __future__ import annotations

import math

from hybridmon.exporters.cgroup_memory import CGROUP_MEMORY_HEADROOM
from hybridmon.exporters.gpu import MEMORY_TOTAL as GPU_MEMORY_TOTAL
from hybridmon.exporters.gpu import MEMORY_USED as GPU_MEMORY_USED
from hybridmon.exporters.host_memory import MEMORY_AVAILABLE
from hybridmon.exporters.inference_names import BY_FIELD as SERVER_SERIES
from hybridmon.exporters.process import (
    CPU_SECONDS,
    LOCKED,
    PINNED,
    MAJOR_FAULTS,
    MINOR_FAULTS,
    RESIDENT,
)
from tests.support.promtool_cases import GIB, GPU0, Catalog, Test
from tests.support.promtool_inputs import LLAMA, SGLANG, VLLM, in_tree, on_gpu

GENERATED_TOKENS = SERVER_SERIES["generated_tokens"]
REQUESTS_RUNNING = SERVER_SERIES["requests_running"]

TGI = {"pid": "7171", "process_name": "text-generation"}
# vLLM V1's engine core: a child of the API server (VLLM), holding the GPU memory and growing with
# its traffic while its busy loop keeps its CPU flat (vllm/v1/engine/core_client.py starts it with
# multiprocessing; layout from vLLM's V1 architecture docs, recalled, not read here).
ENGINE = {"pid": "4343", "process_name": "python3"}


def _exact_enough(*seconds: float) -> bool:
    """humanizeDuration truncates to whole seconds: keep expected values off the boundaries."""
    return all(0.05 < s % 1 < 0.95 for s in seconds)


def _mean_rate(rate: float, share_per_hour: float, at: int, window_seconds: float) -> float:
    """avg_over_time(...[window]) at `at` of the 1 min rate of a counter sampled every minute
    whose rate grows linearly, rate x (1 + share x t/h): the rates are recorded from the first
    minute on, each the rate at the middle of its minute."""
    middles = [t - 30 for t in range(60, at + 1, 60) if t >= at - window_seconds]
    return sum(rate * (1 + share_per_hour * m / 3600) for m in middles) / len(middles)


def _mean_linear(start: float, share_per_hour: float, at: int, window_seconds: float) -> float:
    """avg_over_time(x[window]) at `at` of a gauge start x (1 + share x t/h) sampled every minute
    (Prometheus 2's ranges hold both ends)."""
    times = [t for t in range(0, at + 1, 60) if t >= at - window_seconds]
    return sum(start * (1 + share_per_hour * t / 3600) for t in times) / len(times)


def _headroom(slopes: list[float], at_least: float) -> float:
    """A headroom near `at_least` whose forecasts (headroom / slope) stay off whole seconds."""
    return next(at_least + e for e in range(0, 10 ** 7, 4099)
                if _exact_enough(*((at_least + e) / slope for slope in slopes)))


def _judged_over_the_hour(g) -> int:
    """When the load's rise is judged over the halves of the whole window: once the older half
    holds as many minutes as the short window's half (rules.process._load_rise), plus 6 min
    (5 min put a mean CPU rate on a rounding tie, 1.1875)."""
    return int(math.ceil((g.window_seconds + g.min_window_seconds) / 2 / 60)) * 60 + 360


def _ramp(minutes: range):
    def linear(start: float, share_per_hour: float) -> list[float]:
        return [start * (1 + share_per_hour * m / 60) for m in minutes]

    def accumulated(rate: float, share_per_hour: float) -> list[float]:
        """A counter whose rate grows linearly: the integral of rate x (1 + share x t/h)."""
        return [rate * (m * 60 + share_per_hour * (m * 60) ** 2 / 7200) for m in minutes]
    return linear, accumulated


def _growth_on_flat_load(t, catalog: Catalog) -> Test:
    """Every minute for 50 min; the window fills at min_window_seconds, the load is judged over
    the hour's halves from 40 min on."""
    g = t.memory_growth
    rules = {r: catalog.find("InferenceProcessMemoryGrowth", resource=r)
             for r in ("gpu_memory", "resident", "locked")}
    at = _judged_over_the_hour(g)
    test = Test("memory growth: python3 (pid 4242) grows in GPU, resident and locked memory on a "
                "flat load; sglang (pid 6161) grows slower than its load but its faults per CPU "
                "second climb; llama-server (pid 5151) grows slower than its load and "
                "text-generation (pid 7171) jumps once: both stay silent", at + 300, catalog)
    test.interval = 60
    minutes = range(test.samples)
    linear, accumulated = _ramp(minutes)
    per_hour = 2 * g.growth_per_hour_share       # twice the threshold, as a share of the start
    load_growth = 0.5                             # per hour: the load outgrows the memory
    # Faults outgrow the load, so faults per CPU second rise (as the detector judges them).
    fault_growth = load_growth + 4 * g.growth_per_hour_share
    starts = {"gpu_memory": 16 * GIB, "resident": 8 * GIB, "locked": 1 * GIB}
    slopes = {r: start * per_hour / 3600 for r, start in starts.items()}
    available = _headroom([slopes["resident"], slopes["locked"]], 32 * GIB)
    gpu_free = _headroom([slopes["gpu_memory"]], 4 * GIB)
    test.constant(MEMORY_AVAILABLE.name, available)
    test.constant(GPU_MEMORY_TOTAL.name, 24 * GIB, **GPU0)
    test.constant(GPU_MEMORY_USED.name, 24 * GIB - gpu_free, **GPU0)
    on_gpu(test, GPU0, VLLM, linear(starts["gpu_memory"], per_hour))
    test.values(RESIDENT.name, linear(starts["resident"], per_hour), **VLLM)
    # locked memory is VmLck + VmPin in both doors: half of it mlock()ed, half pinned for DMA (an
    # RDMA registration); the others have no VmPin (a kernel before 3.2): it counts as 0
    test.values(LOCKED.name, linear(starts["locked"] / 2, per_hour), **VLLM)
    test.values(PINNED.name, linear(starts["locked"] / 2, per_hour), **VLLM)
    test.values(CPU_SECONDS.name, [2.0 * 60 * m for m in minutes], **VLLM)
    test.values(MINOR_FAULTS.name, [100.0 * 60 * m for m in minutes], **VLLM)
    for proc, faults in ((SGLANG, fault_growth), (LLAMA, load_growth)):
        test.values(RESIDENT.name, linear(8 * GIB, per_hour), **proc)
        test.constant(LOCKED.name, 0, **proc)
        test.values(CPU_SECONDS.name, accumulated(1.0, load_growth), **proc)
        test.values(MINOR_FAULTS.name, accumulated(100.0, faults), **proc)
    # text-generation: one jump (an adapter loaded) on a flat load, then flat: not growth
    jump = int(g.min_window_seconds) // 60 - 5
    test.values(RESIDENT.name, [8 * GIB if m < jump else 12 * GIB for m in minutes], **TGI)
    test.constant(LOCKED.name, 0, **TGI)
    test.values(CPU_SECONDS.name, [2.0 * 60 * m for m in minutes], **TGI)
    test.values(MINOR_FAULTS.name, [100.0 * 60 * m for m in minutes], **TGI)
    for proc in (VLLM, SGLANG, LLAMA, TGI):
        test.constant(MAJOR_FAULTS.name, 0, **proc)

    def expected(rule_name: str, proc: dict, start: float, headroom: float, cpu: float,
                 load_rise: float) -> dict:
        slope = start * per_hour / 3600
        return test.alert(rules[rule_name], proc, value=slope * 3600, per_hour=slope * 3600, recent=slope * 3600,
                          mean=_mean_linear(start, per_hour, at, g.window_seconds),
                          current=start * (1 + per_hour * at / 3600), load_rise=load_rise,
                          exhaustion=headroom / slope, cpu=cpu, tokens=None, running=None)

    cpu_mean = _mean_rate(1.0, load_growth, at, g.window_seconds)
    # the settled 1 m rates (rules.process.settled: from the second recorded minute on) of each half
    half = int(g.window_seconds) // 2
    newer, older = (
        sum(1 + load_growth * (m - 30) / 3600 for m in steps) / len(steps)
        for steps in ([m for m in range(120, at + 1, 60) if m >= at - half],
                      [m for m in range(120, at + 1, 60) if at - 2 * half <= m <= at - half]))
    cpu_rise = load_growth / ((newer + older) / 2)   # the line through the halves: the slope
    test.expect(int(g.min_window_seconds) - 300, "InferenceProcessMemoryGrowth")
    test.expect(at, "InferenceProcessMemoryGrowth",
                expected("gpu_memory", VLLM, starts["gpu_memory"], gpu_free, 2.0, 0),
                expected("resident", VLLM, starts["resident"], available, 2.0, 0),
                expected("locked", VLLM, starts["locked"], available, 2.0, 0),
                expected("resident", SGLANG, 8 * GIB, available, cpu_mean, cpu_rise))
    return test


def _growth_against_server_load(t, catalog: Catalog) -> Test:
    """Where an inference server is tied to the process, its load is the one judged: python3 (pid
    4242) burns more CPU every hour but its vLLM server's tokens/s and running requests stay flat:
    it fires. llama-server (pid 5151) has a flat CPU but its server's tokens/s rise, and sglang
    (pid 6161) a flat CPU and tokens/s but more running requests, both faster than their memory:
    both silent."""
    g = t.memory_growth
    rule = catalog.find("InferenceProcessMemoryGrowth", resource="resident")
    at = _judged_over_the_hour(g)
    test = Test("memory growth against the inference server's load: tokens/s and running requests "
                "tied to the process by pid win over its CPU time", at + 300, catalog)
    test.interval = 60
    minutes = range(test.samples)
    linear, accumulated = _ramp(minutes)
    per_hour, rising = 2 * g.growth_per_hour_share, 0.5
    slope = 8 * GIB * per_hour / 3600
    available = _headroom([slope], 32 * GIB)
    test.constant(MEMORY_AVAILABLE.name, available)
    loads = {VLLM["pid"]: ("vllm", 0.0, 0.0, rising), LLAMA["pid"]: ("llamacpp", rising, 0.0, 0.0),
             SGLANG["pid"]: ("sglang", 0.0, rising, 0.0)}
    for proc in (VLLM, LLAMA, SGLANG):
        server, tokens_growth, running_growth, cpu_growth = loads[proc["pid"]]
        labels = {"server": server, "endpoint": f"http://127.0.0.1:{proc['pid']}/metrics",
                  "model": "", "pid": proc["pid"]}
        test.values(RESIDENT.name, linear(8 * GIB, per_hour), **proc)
        test.values(CPU_SECONDS.name, accumulated(2.0, cpu_growth), **proc)
        # page faults in step with the CPU time: their rate per CPU second stays flat
        test.values(MINOR_FAULTS.name, accumulated(200.0, cpu_growth), **proc)
        test.constant(MAJOR_FAULTS.name, 0, **proc)
        test.values(GENERATED_TOKENS.name, accumulated(1000.0, tokens_growth), **labels)
        test.values(REQUESTS_RUNNING.name, linear(8, running_growth), **labels)
    test.expect(at, "InferenceProcessMemoryGrowth", test.alert(
        rule, VLLM, value=slope * 3600, per_hour=slope * 3600, recent=slope * 3600,
        mean=_mean_linear(8 * GIB, per_hour, at, g.window_seconds),
        current=8 * GIB * (1 + per_hour * at / 3600), load_rise=0, exhaustion=available / slope,
        cpu=_mean_rate(2.0, rising, at, g.window_seconds), tokens=1000, running=8))
    return test


def _real_deployments(t, catalog: Catalog) -> Test:
    """Issue 14 items 1-3. vLLM V1: the API server (python3, pid 4242) serves /metrics while its
    child the engine core (pid 4343, same process tree) holds memory that grows with the traffic,
    tokens/s +30 %/h, on a flat CPU: silent (it used to be judged on its CPU). sglang (pid 6161):
    memory exactly proportional to its tokens/s, which rise 7 %/h, between the growth and the old
    "flat" bands: silent. llama-server (pid 5151): 12 GiB resident leaking 3 MB/min (1.4 %/h,
    under the share) on a flat load: fires on the absolute rate, and its forecast counts down to
    what its container's cgroup limit leaves (about 1.5 GiB), not to MemAvailable (64 GiB)."""
    g = t.memory_growth
    rule = catalog.find("InferenceProcessMemoryGrowth", resource="resident")
    at = _judged_over_the_hour(g)
    test = Test("memory growth on real deployments: a vLLM V1 engine core judged with its API "
                "server's traffic, memory proportional to a 7 %/h ramp, a leak in a big process",
                at + 300, catalog)
    test.interval = 60
    minutes = range(test.samples)
    linear, accumulated = _ramp(minutes)
    # bytes/s: 3 MB/min, or more where growth_bytes_per_hour asks more (still under the share)
    leak = max(3e6 / 60, 1.4 * g.growth_bytes_per_hour / 3600)
    available = _headroom([leak], 64 * GIB)
    test.constant(MEMORY_AVAILABLE.name, available)
    cgroup_headroom = _headroom([leak], 1.5 * GIB)
    test.constant(CGROUP_MEMORY_HEADROOM.name, cgroup_headroom, **LLAMA)
    for proc, root in ((VLLM, VLLM), (ENGINE, VLLM), (SGLANG, SGLANG), (LLAMA, LLAMA)):
        in_tree(test, proc, root)
        test.values(CPU_SECONDS.name, [1.0 * 60 * m for m in minutes], **proc)   # busy loops
        test.values(MINOR_FAULTS.name, [100.0 * 60 * m for m in minutes], **proc)
        test.constant(MAJOR_FAULTS.name, 0, **proc)
    test.constant(RESIDENT.name, 2 * GIB, **VLLM)
    test.values(RESIDENT.name, linear(4 * GIB, 0.3), **ENGINE)
    test.values(RESIDENT.name, linear(8 * GIB, 0.07), **SGLANG)
    test.values(RESIDENT.name, [12 * GIB + leak * 60 * m for m in minutes], **LLAMA)
    for proc, server, growth in ((VLLM, "vllm", 0.3), (SGLANG, "sglang", 0.07)):
        labels = {"server": server, "endpoint": f"http://127.0.0.1:{proc['pid']}/metrics",
                  "model": "", "pid": proc["pid"]}
        test.values(GENERATED_TOKENS.name, accumulated(1000.0, growth), **labels)
        test.constant(REQUESTS_RUNNING.name, 8, **labels)
    mean = 12 * GIB + leak * (max(0, at - g.window_seconds) + at) / 2
    test.expect(at, "InferenceProcessMemoryGrowth", test.alert(
        rule, LLAMA, value=leak * 3600, per_hour=leak * 3600, recent=leak * 3600, mean=mean,
        current=12 * GIB + leak * at, load_rise=0, exhaustion=cgroup_headroom / leak, cpu=1.0,
        tokens=None, running=None))
    return test


def promtool_cases(t, catalog: Catalog) -> list[Test]:
    return [_growth_on_flat_load(t, catalog), _growth_against_server_load(t, catalog),
            _real_deployments(t, catalog)]
