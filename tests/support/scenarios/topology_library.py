"""The scenarios of issue 29: GPUs behind one PCIe switch sharing its uplink to the CPU.

The synthetic host gets a switch of the kind dense servers carry (tests/fixtures/host-switch has
the same layout): root port 0000:e0:01.0 on NUMA node 1, the switch's upstream port 0000:e1:00.0
below it over one Gen4 x16 link, downstream ports 0000:e2:08.0 and 0000:e2:10.0, and a GPU like
the fixture's GPU0 (an L40S, Gen4 x16) below each: GPUs 2 (0000:e3:00.0) and 3 (0000:e4:00.0), NVML
listing them after the fixture's two in bus order. GPU0 (vLLM) and GPU1 keep root ports of their
own. Simulated inputs, written like library.py's: start from the healthy host, change what the
story needs; never presented as measurements.

Copy engines pinned on one Gen4 x16 link move 0.82 of its theoretical 31.5 GB/s (nvbandwidth:
25.5-26.3 GB/s, hybridmon/pcie_rates.py), and two GPUs copying through one x16 uplink together can
move no more than that, so each of the two starving GPUs shows about half of what its own link
carries (0.42 and 0.40 of theoretical: 0.52 and 0.49 of what the link achieves, far from
GpuPcieStarvation's 0.90); a split of 0.55 each would be more than the uplink passes.
"""
from __future__ import annotations

from tests.support.scenarios.host import SyntheticHost
from tests.support.scenarios.library import GpuLoad, Load, Step, apply, healthy_host, healthy_load, ramp, scenario

ROOT_PORT, SWITCH_UPLINK = "0000:e0:01.0", "0000:e1:00.0"
DOWNSTREAM_PORTS = ("0000:e2:08.0", "0000:e2:10.0")
SWITCHED_GPUS = ((DOWNSTREAM_PORTS[0], "0000:e3:00.0", "GPU-2a1b2c3d-0000-4000-8000-000000000002"),
                 (DOWNSTREAM_PORTS[1], "0000:e4:00.0", "GPU-3a1b2c3d-0000-4000-8000-000000000003"))
ONSET, END = 60, 480


def host_with_switch(host: SyntheticHost) -> None:
    """The healthy host, plus the switch and its two GPUs (idle, their links at Gen4 x16)."""
    healthy_host(host)
    host.add_switch(ROOT_PORT, SWITCH_UPLINK, DOWNSTREAM_PORTS, node=1)
    for port, address, uuid in SWITCHED_GPUS:
        host.add_gpu_behind(port, address, template=0, uuid=uuid)


def switched_load(h2d: tuple[float, float], utilization: tuple[float, float]) -> Load:
    """healthy_load with GPUs 2 and 3 moving `h2d` (shares of their own link's theoretical rate)
    host to device, 0.02 back, at `utilization`; GPU0 busy at 0.55 of its own link (vLLM prefetching
    KV blocks at 88 % utilization: no starvation, and behind no shared link)."""
    load = healthy_load()
    load.gpus[0] = GpuLoad(0.88, 0.55, 0.12)
    for index, (traffic, busy) in zip((2, 3), zip(h2d, utilization)):
        load.gpus[index] = GpuLoad(busy, traffic, 0.02)
    return load


@scenario("pcie_uplink_starvation", tick_seconds=1, duration_seconds=600, onset_seconds=ONSET,
          expected=[("PcieUplinkStarvation", {"uplink": SWITCH_UPLINK})])
def pcie_uplink_starvation(host: SyntheticHost) -> Step:
    """GPUs 2 and 3 sit behind one PCIe switch whose Gen4 x16 uplink (port 0000:e1:00.0) is their
    only way to the CPU; GPU0 and GPU1 have root ports of their own. Before onset GPUs 2 and 3 serve
    from VRAM at ~85 % utilization with little traffic (0.10 of their links each). From onset (60 s)
    both start offloading KV cache over 20 s: host-to-device traffic 0.42 and 0.40 of the
    theoretical rate of their own Gen4 x16 links (0.52 and 0.49 of what each link carries: no GPU's
    own link is full), 0.82 together: what copies top out at on the one x16 uplink, which is full;
    their utilization falls to ~25 % and ~35 %. GPU0 moves 0.55 of its own link at 88 %
    utilization throughout: busy, but alone on its root port. At 480 s the offload stops."""
    host_with_switch(host)

    def step(t: float) -> None:
        if ONSET <= t < END:
            load = switched_load((ramp(t, ONSET, ONSET + 20, 0.10, 0.42), ramp(t, ONSET, ONSET + 20, 0.10, 0.40)),
                                 (ramp(t, ONSET, ONSET + 20, 0.85, 0.25), ramp(t, ONSET, ONSET + 20, 0.85, 0.35)))
        else:
            load = switched_load((0.10, 0.10), (0.85, 0.85))
        apply(host, load)
        if ONSET + 20 <= t < END:  # pinned: a saturated link shows almost no noise
            host.set_traffic_share(2, host.jitter(0.42, 0.003), host.jitter(0.02, 0.02))
            host.set_traffic_share(3, host.jitter(0.40, 0.003), host.jitter(0.02, 0.02))
    return step


@scenario("pcie_uplink_healthy", tick_seconds=1, duration_seconds=300, onset_seconds=None, expected=[])
def pcie_uplink_healthy(host: SyntheticHost) -> Step:
    """The same switch, GPUs 2 and 3 both offloading at 0.30 of their own links' theoretical rate
    (0.60 together: 0.74 of what the uplink carries) at ~40 % utilization, GPU0 busy alone at 0.55
    of its link: a shared uplink well used and not full. Must stay silent."""
    host_with_switch(host)

    def step(t: float) -> None:
        apply(host, switched_load((0.30, 0.30), (0.40, 0.40)))
    return step
