"""The scenarios of issue 15, read from both sides of the bus: what NVML counts crossing PCIe beside
what the server says it moves (InferenceWeightsCrossingBus), and the host KV tier it is configured
with beside the host's free memory (InferenceOffloadHostMemoryShort). Each incident has a healthy
counterpart that the naive reading would flag.

Written like library.py's: start from the healthy host, change what the story needs from onset.
Every figure is a simulated input, not a measurement on a GPU.
"""
from __future__ import annotations

from tests.support.scenarios.host import GIB, SyntheticHost
from tests.support.scenarios.inference import ServerLoad
from tests.support.scenarios.library import (VLLM, VLLM_SERVER, GpuLoad, Step, apply, healthy_host, healthy_load,
                                             ramp, scenario)

# [offload_host_memory] pinned_overhead_factor: vllm#53042's 1.92x of the configured size.
PINNED_OVERHEAD = 1.92


@scenario("weights_crossing_bus", tick_seconds=1, duration_seconds=360, onset_seconds=60,
          expected=[("InferenceWeightsCrossingBus", VLLM_SERVER)])
def weights_crossing_bus(host: SyntheticHost) -> Step:
    """vLLM without a KV offload connector is restarted with a leftover --cpu-offload-gb (the
    simulated server keeps its counters): from onset, over 10 s, GPU0's host-to-device traffic
    rises from 40 % to 82 % of Gen4 x16's theoretical rate (25.8 GB/s: the offloaded weights read
    over the bus every decode step) while the 55 running requests slow from 38 ms to 458 ms per
    token (1,450 -> 120 tokens/s, vllm#57771's figure) and time to first token p50 from 0.15 s to
    1.5 s. GPU0 stays ~92 % busy: its kernels read the host's weights themselves (UVA), so NVML
    counts them running, and this is not PCIe starvation. Before onset 12.6 GB/s over 1,450
    tokens/s is 8.7 MB a token (under 32 MiB); after, 215 MB."""
    healthy_host(host)
    onset = 60

    def step(t: float) -> None:
        load = healthy_load()
        load.gpus[0] = GpuLoad(ramp(t, onset, onset + 10, 0.88, 0.92), ramp(t, onset, onset + 10, 0.40, 0.82), 0.12)
        load.server = ServerLoad(
            inter_token_latency_seconds=ramp(t, onset, onset + 10, 0.038, 55 / 120),
            time_to_first_token_seconds=ramp(t, onset, onset + 10, 0.15, 1.5),
            kv_offload_load_bytes_per_second=None, kv_offload_store_bytes_per_second=None)
        apply(host, load)
    return step


@scenario("healthy_kv_prefix_reload", tick_seconds=1, duration_seconds=270, onset_seconds=None, expected=[])
def healthy_kv_prefix_reload(host: SyntheticHost) -> Step:
    """vLLM's KV offload connector reloads long shared prefixes all the time: loads 15 GB/s (59 %
    of the 25.5 GB/s copies achieve on Gen4 x16, well under KV offload pressure's 85 %: a healthy
    host stays far from every server alert), stores 3 GB/s, GPU0's host-to-device traffic 56 % of
    the theoretical rate (17.7 GB/s) at ~80 % utilization; 20 requests running at 50 ms per token
    (400 tokens/s), KV cache 85 % used. 44 MB of host-to-device bytes a token, over the 32 MiB
    bound, but 37.5 MB of it are the server's own KV loads: 6.7 MB unexplained, silent."""
    healthy_host(host)

    def step(t: float) -> None:
        load = healthy_load()
        load.gpus[0] = GpuLoad(0.80, 0.562, 0.15)
        load.server = ServerLoad(running=20, waiting=1, inter_token_latency_seconds=0.050,
                                 time_to_first_token_seconds=0.3, kv_cache_usage=0.85,
                                 kv_offload_load_bytes_per_second=15e9, kv_offload_store_bytes_per_second=3e9)
        apply(host, load)
    return step


@scenario("offload_host_memory_short", tick_seconds=1, duration_seconds=240, onset_seconds=60,
          expected=[("InferenceOffloadHostMemoryShort", {**VLLM_SERVER, "reason": "memory_available"})])
def offload_host_memory_short(host: SyntheticHost) -> Step:
    """vLLM is configured with a 120 GiB CPU KV tier (vllm:kv_offload_config_info), 230 GiB with
    the pinned overhead, of which its 28 GiB resident hold little: 202 GiB still to take, 78 % of
    the host's 260 GiB MemAvailable. At onset a neighbour takes 80 GiB over 30 s: MemAvailable
    falls to 180 GiB, and the tier's rest is 112 % of it: when the tier fills, the host OOMs."""
    healthy_host(host)
    onset = 60
    available, free = host.meminfo_bytes("MemAvailable"), host.meminfo_bytes("MemFree")

    def step(t: float) -> None:
        load = healthy_load()
        load.server = ServerLoad(kv_offload_host_tier_bytes=120 * GIB)
        apply(host, load)
        taken = ramp(t, onset, onset + 30, 0.0, 80 * GIB)
        host.set_meminfo(MemAvailable=available - taken, MemFree=free - taken)
    return step


@scenario("healthy_host_tier_allocated", tick_seconds=1, duration_seconds=180, onset_seconds=None, expected=[])
def healthy_host_tier_allocated(host: SyntheticHost) -> Step:
    """vLLM's 100 GiB CPU KV tier is allocated already: its 192 GiB of pinned shared memory are
    resident in the process (220 GiB in all) and gone from MemAvailable (68 GiB left; MemFree 20
    GiB). Against
    MemAvailable alone the tier would look 2.8 times too big; what the process holds covers it,
    silent."""
    healthy_host(host)
    vllm = host.process(VLLM)
    tier = 100 * GIB
    vllm.rss_file_bytes += tier * PINNED_OVERHEAD   # shared memory counts as RssShmem, file-backed
    held = tier * PINNED_OVERHEAD
    # the rest came out of the page cache: MemFree, 150 GiB on the healthy host, is at 20 GiB
    host.set_meminfo(MemAvailable=host.meminfo_bytes("MemAvailable") - held, MemFree=20 * GIB)

    def step(t: float) -> None:
        load = healthy_load()
        load.server = ServerLoad(kv_offload_host_tier_bytes=tier)
        apply(host, load)
    return step
