"""The scenarios of issue 29: a Grace Hopper GPU whose offload crosses NVLink-C2C, not PCIe.

The gpu collector reads GPM on the tick's simulated time here, and the fake counts the C2C bytes
between samples at the levels each tick set (tests/support/scenarios/__init__.py _simulated_clock).

Written like library.py's: start from the healthy host, change what the story needs from onset.
GPU0 of the fixture host is made a GH200's Hopper: NVLink-C2C on, ten links up at 45,000 MBps
each (450 GB/s a direction, NVIDIA's 900 GB/s bidirectional C2C figure; the per-link split is
the fake's choice, as in fake_nvml's grace_hopper_gpu), GPM readable. Its PCIe link stays as
the fixture has it (Gen4 x16) and near idle: the driver's own traffic. Every figure is a
simulated input, not a measurement on a GPU.
"""
from __future__ import annotations

from tests.support.scenarios.host import SyntheticHost
from tests.support.scenarios.library import (GPU0_UUID, VLLM, VLLM_SERVER, GpuLoad, Step, apply, healthy_host,
                                             healthy_load, ramp, scenario)
from hybridmon.pcie_rates import c2c_capacity

MIB = 2 ** 20
C2C_LINKS, C2C_LINK_MEGABYTES_PER_SECOND = 10, 45_000
C2C_MAX = C2C_LINKS * C2C_LINK_MEGABYTES_PER_SECOND * 1e6                 # 450 GB/s a direction
C2C_H2D = c2c_capacity(None, "host_to_device", C2C_MAX).bytes_per_second  # 346.5: what copies reach
# The PCIe link of a GPU whose copies cross C2C: the driver's own traffic, 0.2 % of Gen4 x16.
PCIE_IDLE = 0.002


def grace_hopper(host: SyntheticHost, gpu: int) -> None:
    """Make `gpu` a GH200's Hopper as NVML shows it: C2C on, its links up, GPM readable."""
    nvml = host.gpu(gpu).nvml
    nvml.gpm_supported = True
    nvml.c2c_enabled = True
    nvml.c2c_links = [[True, C2C_LINK_MEGABYTES_PER_SECOND] for _ in range(C2C_LINKS)]


def c2c_traffic(host: SyntheticHost, gpu: int, host_to_device: float, device_to_host: float) -> None:
    """C2C bytes/s each way, as GPM reports them (MiB/s)."""
    nvml = host.gpu(gpu).nvml
    nvml.c2c_rx_mib_per_second = host_to_device / MIB
    nvml.c2c_tx_mib_per_second = device_to_host / MIB


@scenario("c2c_starvation", tick_seconds=1, duration_seconds=780, onset_seconds=60,
          # vLLM's KV loads are the C2C traffic, 95 % of what C2C carries host to device: past
          # [kv_offload_pressure]'s 85 % of that same capacity too.
          expected=[("GpuC2cStarvation", {"gpu": "0", "uuid": GPU0_UUID}),
                    ("InferenceKvOffloadPressure", {**VLLM_SERVER, "reason": "offload_link"})])
def c2c_starvation(host: SyntheticHost) -> Step:
    """Issue 29, incident 1 on a GH200. GPU0 (NVLink-C2C on, ten links up, 450 GB/s a direction)
    runs vLLM at ~88 % utilization with KV offload loads of 120 GB/s over C2C (35 % of the
    346.5 GB/s copies reach host to device, nvbandwidth on GH200) and its PCIe link near idle
    (0.2 % of Gen4 x16). From onset, KV offload fills C2C: host-to-device C2C traffic pinned at
    95 % of 346.5 GB/s (329 GB/s), device to host at 90 GB/s, while GPU0's utilization falls from
    ~90 % to ~20 % over 20 s; after 10 min (onset + 600 s) the offload stops and both return to
    normal. PCIe stays near idle throughout: nothing is claimed of it. vLLM feels it as in
    pcie_starvation: its KV offload loads rise to what C2C carries, inter-token latency p50
    38 -> 210 ms with 55 requests running, time to first token p50 0.15 -> 0.9 s, queue 2 -> 25."""
    healthy_host(host)
    grace_hopper(host, 0)
    onset, end = 60, 660

    def step(t: float) -> None:
        load = healthy_load()
        load.gpus[0] = GpuLoad(0.88, PCIE_IDLE, PCIE_IDLE / 2)
        kv_in, kv_out = 120e9, 30e9
        if onset <= t < end:
            load.gpus[0] = GpuLoad(ramp(t, onset, onset + 20, 0.90, 0.20), PCIE_IDLE, PCIE_IDLE / 2)
            load.processes[VLLM].cpu_cores = 3.0   # the copy threads are busy, the decode is not
            server = load.server
            server.inter_token_latency_seconds = ramp(t, onset, onset + 20, 0.038, 0.210)
            server.time_to_first_token_seconds = ramp(t, onset, onset + 20, 0.15, 0.9)
            server.waiting = ramp(t, onset, onset + 20, 2, 25)
            kv_in = ramp(t, onset, onset + 20, 120e9, 0.95 * C2C_H2D)
            kv_out = ramp(t, onset, onset + 20, 30e9, 90e9)
            server.kv_cache_usage = 0.8
        load.server.kv_offload_load_bytes_per_second = kv_in
        load.server.kv_offload_store_bytes_per_second = kv_out
        apply(host, load)
        pinned = onset <= t < end   # a saturated link shows almost no noise
        c2c_traffic(host, 0, host.jitter(kv_in, 0.003 if pinned else 0.01), host.jitter(kv_out, 0.02))
    return step


@scenario("healthy_c2c_offload", tick_seconds=1, duration_seconds=240, onset_seconds=None, expected=[])
def healthy_c2c_offload(host: SyntheticHost) -> Step:
    """A GH200 (GPU0 as in c2c_starvation) whose vLLM offloads KV over C2C at 200 GB/s host to
    device (58 % of what copies reach) and 60 GB/s back, ~85 % busy, while its PCIe link idles:
    nothing fires. Judged against PCIe, the naive reading, 200 GB/s of KV loads would be eight
    times what Gen4 x16 carries (InferenceKvOffloadPressure before issue 29); judged on PCIe's own
    traffic, the link is idle. Neither is what the GPU waits on."""
    healthy_host(host)
    grace_hopper(host, 0)

    def step(t: float) -> None:
        load = healthy_load()
        load.gpus[0] = GpuLoad(0.85, PCIE_IDLE, PCIE_IDLE / 2)
        load.server.kv_offload_load_bytes_per_second = 200e9
        load.server.kv_offload_store_bytes_per_second = 60e9
        apply(host, load)
        c2c_traffic(host, 0, host.jitter(200e9, 0.01), host.jitter(60e9, 0.02))
    return step
