"""The status page's KV-loads link share (agent/status/inference.py): a server's KV offload loads
beside what NVML counts crossing its GPUs' host->device link and what that link carries.

The page must stay cheap (tests/integration/test_status_page.py counts its history reads), so this
reads no history: the loads are the minute's rate the page already has, the traffic the latest
PCIe throughput reading (as the page's GPU cards show it: the byte counters' increase since the
previous collection, ~1 s), the capacity the latest link state or what `hybridmon bench` measured
(kv_offload_pressure.link_capacity). The GPUs are those the server's process holds memory on,
else every GPU of the host, as InferenceKvOffloadPressure's offload_link picks them.
"""
from __future__ import annotations

from hybridmon.agent.alerts.kv_offload_pressure import HOST_TO_DEVICE, LinkShare, link_capacity
from hybridmon.agent.status.signals import LatestValues
from hybridmon.exporters.bench import MEASURED_CAPACITY
from hybridmon.exporters.gpu import PCIE_LINK_GENERATION, PCIE_LINK_WIDTH, PCIE_THROUGHPUT, PROCESS_MEMORY_USED

GPU = ("gpu", "uuid")


def link_share_now(loads: float, pid: str, latest: LatestValues) -> LinkShare:
    """`loads` (bytes/s) of the server listening at `pid` beside its GPUs' link now."""
    traffic = {key[:2]: value for key, value in
               latest.keyed(PCIE_THROUGHPUT.name, *GPU, "direction").items() if key[2] == HOST_TO_DEVICE}
    generation, width = latest.keyed(PCIE_LINK_GENERATION.name, *GPU), latest.keyed(PCIE_LINK_WIDTH.name, *GPU)
    measured = {key[:2]: value for key, value in
                latest.keyed(MEASURED_CAPACITY.name, *GPU, "direction").items() if key[2] == HOST_TO_DEVICE}
    every = set(traffic) | set(generation)
    held = {tuple(labels[n] for n in GPU) for labels, _ in latest.all(PROCESS_MEMORY_USED.name)
            if pid and labels.get("pid") == pid}
    mine = sorted(held & every or every)
    capacities = [found.bytes_per_second for gpu in mine
                  if (found := link_capacity(measured.get(gpu), generation.get(gpu), width.get(gpu)))]
    counted = [traffic[gpu] for gpu in mine if gpu in traffic]
    return LinkShare(loads, sum(counted) if counted else None, sum(capacities) if capacities else None,
                     tuple(gpu[0] for gpu in mine))
