"""The scenario of issue 28, class 5: one collection of NVML_ERROR_GPU_IS_LOST that does not hold.

Traces from hosts the team never modelled showed a GPU answering GPU_IS_LOST at one 1 s
collection and answering every call again at the next, its PCI link and function untouched. A GPU
really lost stays lost until it is reset (nvml.h documents NVML_ERROR_GPU_IS_LOST as "fallen off
the bus or otherwise inaccessible"; the kernel's Xid 79 asks for a reset or reboot), so this host
is healthy: GpuLost must not page, and nothing else may read the GPU's series vanishing for one
tick (memory, traffic, utilization and its processes all go with it) as an incident. The paging
counterparts stay in library.py (gpu_lost, gpu_lost_and_reset).

Written like library.py's: start from the healthy host, change what the story needs. The blip is
at 60 s, a multiple of both evaluation grids the suite replays on (every 10 s in
tests/integration/test_detection.py, every 15 s in test_rules_vs_detectors.py, and the 15 s scrape
grid), so both doors read the GPU down at an evaluation: the worst case, not a lucky miss.
"""
from __future__ import annotations

from tests.support.scenarios.host import SyntheticHost
from tests.support.scenarios.library import Step, apply, healthy_host, healthy_load, scenario

# When the lost reading comes, seconds from the start: one minute of healthy history before it,
# so every 1-minute window the detectors and rules read is full of healthy samples when it comes;
# one minute after it, so that the 1-minute windows that hold the missing tick pass over it
# entirely before the end (a `for: 0` alert would fire on it within that minute).
BLIP_AT = 60


@scenario("gpu_blip", tick_seconds=1, duration_seconds=120, onset_seconds=None, expected=[])
def gpu_blip(host: SyntheticHost) -> Step:
    """A healthy host where NVML answers NVML_ERROR_GPU_IS_LOST for every call on GPU1 at one
    collection (60 s) and answers normally from the next (61 s); its PCI function and link never
    move and llama-server keeps its load (GPU memory, traffic and processes of GPU1 are absent
    for that one tick, as exporters/gpu.py reports a down GPU). Not a loss: must stay silent."""
    healthy_host(host)
    gpu = host.gpu(1)

    def step(t: float) -> None:
        apply(host, healthy_load())
        gpu.lost = t == BLIP_AT
    return step
