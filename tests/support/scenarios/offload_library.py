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
    """vLLM without a KV offload connector was restarted in a quiet hour with a leftover
    --cpu-offload-gb 12 on its command line and idles until onset (no requests, GPU0 ~2 % busy,
    0.1 GB/s in). At onset its usual 55 requests arrive and every decode step reads the 12 GiB
    of weights left in host memory over the bus: over 10 s GPU0's host-to-device traffic rises
    to 82 % of Gen4 x16's theoretical rate (25.8 GB/s) and the requests run at 458 ms per token
    (120 tokens/s, vllm#57771's figure; 1,450 on this host without the option), time to first
    token p50 1.5 s. GPU0 is ~92 % busy: its kernels read the host's weights themselves (UVA), so
    NVML counts them running, and this is not PCIe starvation. 215 MB cross per token, within the
    234 MB a token that 12 GiB read once per step of 55 requests can need."""
    healthy_host(host)
    host.set_cmdline(VLLM, *VLLM_ARGUMENTS, "--cpu-offload-gb", "12")
    onset = 60

    def step(t: float) -> None:
        load = healthy_load()
        if t < onset:
            load.gpus[0] = GpuLoad(0.02, 0.003, 0.001)
            load.server = ServerLoad(running=0, waiting=0, kv_cache_usage=0.0,
                                     kv_offload_load_bytes_per_second=None, kv_offload_store_bytes_per_second=None)
        else:
            load.gpus[0] = GpuLoad(0.92, ramp(t, onset, onset + 10, 0.003, 0.82), 0.12)
            load.server = ServerLoad(inter_token_latency_seconds=55 / 120, time_to_first_token_seconds=1.5,
                                     kv_offload_load_bytes_per_second=None, kv_offload_store_bytes_per_second=None)
        apply(host, load)
    return step


# The fixture's vLLM command line (tests/fixtures/host-2node/proc/4242/cmdline).
VLLM_ARGUMENTS = ("python3", "-m", "vllm.entrypoints.openai.api_server", "--model",
                  "meta-llama/Meta-Llama-3-8B-Instruct")


# Three hosts whose KV crosses the bus with no byte counter to say so (issue 28): the bytes per
# token are over InferenceWeightsCrossingBus's bound, but no process runs with --cpu-offload-gb,
# so the traffic is unattributed (with a lead), never weights.

def _steady_kv_without_counters(host: SyntheticHost, gpu0: GpuLoad, **server) -> Step:
    """The healthy host with GPU0 and vLLM held at these figures, vLLM publishing no kv_offload
    family (its byte counters), from start to end."""
    healthy_host(host)

    def step(t: float) -> None:
        load = healthy_load()
        load.gpus[0] = GpuLoad(gpu0.utilization, gpu0.host_to_device, gpu0.device_to_host)
        load.server = ServerLoad(kv_offload_load_bytes_per_second=None, kv_offload_store_bytes_per_second=None,
                                 **server)
        apply(host, load)
    return step


@scenario("healthy_kv_through_lmcache_cpu_tier", tick_seconds=1, duration_seconds=240, onset_seconds=None,
          expected=[])
def healthy_kv_through_lmcache_cpu_tier(host: SyntheticHost) -> Step:
    """vLLM runs LMCache in its own process (LMCacheConnectorV1, local CPU backend, 40 GB in its
    host cache): LMCache moves KV between the GPU and pinned host memory and publishes tokens and
    its cache's bytes, not bytes moved, and vLLM publishes no kv_offload family. GPU0 receives
    17.7 GB/s (56 % of Gen4 x16's theoretical rate, the figure of healthy_kv_prefix_reload) at ~80 %
    utilization while 20 requests run at 50 ms per token (400 tokens/s): 44 MB a token, over the
    32 MiB bound, all unattributed."""
    return _steady_kv_without_counters(host, GpuLoad(0.80, 0.562, 0.15), running=20, waiting=1,
                                       inter_token_latency_seconds=0.050, time_to_first_token_seconds=0.3,
                                       kv_cache_usage=0.85, lmcache_host_cache_bytes=40e9)


@scenario("healthy_kv_through_v0_swap_space", tick_seconds=1, duration_seconds=240, onset_seconds=None,
          expected=[])
def healthy_kv_through_v0_swap_space(host: SyntheticHost) -> Step:
    """A vLLM V0 server with --swap-space whose KV cache is full (90 % used, the rest the running
    batch's next blocks; healthy_host's other servers stay under 93 %): 12 requests sit in
    its CPU swap space and come back as others finish, so their blocks cross the bus both ways;
    V0 publishes vllm:num_requests_swapped and no byte counter. GPU0 receives 18.9 GB/s (60 %
    of Gen4 x16's theoretical rate) at ~85 % utilization while 30 requests run at 60 ms per token
    (500 tokens/s): 38 MB a token, over the 32 MiB bound, all unattributed."""
    return _steady_kv_without_counters(host, GpuLoad(0.85, 0.60, 0.45), running=30, waiting=4,
                                       inter_token_latency_seconds=0.060, time_to_first_token_seconds=0.4,
                                       kv_cache_usage=0.90, requests_swapped=12)


@scenario("healthy_kv_connector_without_byte_counters", tick_seconds=1, duration_seconds=240,
          onset_seconds=None, expected=[])
def healthy_kv_connector_without_byte_counters(host: SyntheticHost) -> Step:
    """An A100 (Gen4 x16) whose vLLM offloads KV to a 64 GiB CPU tier through a connector that
    publishes its configuration (vllm:kv_offload_config_info) but no byte counters: its copy
    engine runs flat out at 25.8 GB/s host-to-device (82 % of the theoretical rate, just above
    what copies achieve on Gen4 x16), GPU0 stays ~75 % busy (no starvation: its kernels are not
    waiting), 25 requests run at 45 ms per token (556 tokens/s): 46 MB a token, over the 32 MiB
    bound, all unattributed."""
    return _steady_kv_without_counters(host, GpuLoad(0.75, 0.82, 0.30), running=25, waiting=2,
                                       inter_token_latency_seconds=0.045, time_to_first_token_seconds=0.35,
                                       kv_cache_usage=0.90, kv_offload_host_tier_bytes=64 * GIB)


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
