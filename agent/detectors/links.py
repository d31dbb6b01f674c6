"""What the PCIe families judge a link by, as they publish it for the status page (Detector.figures):
each direction of a GPU's link against what it carries (GpuPcieStarvation), the link GPUs behind a
switch share (PcieUplinkStarvation), and a server's KV
offload loads against its GPUs' host->device link (InferenceKvOffloadPressure). The page shows
these as the families decided them and works nothing out again; the capacity is always
hybridmon.pcie_rates.effective_capacity of the best link of the minute judged."""
from __future__ import annotations

from dataclasses import dataclass

from hybridmon.pcie_rates import LinkCapacity
from hybridmon.units import human_rate, percent

HOST_TO_DEVICE, DEVICE_TO_HOST = "host_to_device", "device_to_host"


@dataclass(frozen=True)
class DirectionLoad:
    """One direction of a GPU's link over the minute judged: its traffic (the byte counters'
    rate, else the sampled counter's, else the throughput gauge's average) and its capacity."""

    traffic: float                     # bytes/s
    capacity: LinkCapacity | None      # None: neither a benchmark nor the link's state is known

    @property
    def share(self) -> float | None:
        return self.traffic / self.capacity.bytes_per_second if self.capacity else None


@dataclass(frozen=True)
class UplinkLoad:
    """One PCIe link several GPUs behind a switch share on their way to the CPU, over the minute
    PcieUplinkStarvation judged: the link, the GPUs behind it with each one's part of its traffic
    (both directions together), and the fullest of each direction and both together against what
    it carries."""

    uplink: str                                  # PCI address of the switch port below the link
    root_port: str
    link: str | None                             # "Gen4 x16"; None while its state is unknown
    gpus: tuple[tuple[str, float | None], ...]   # (gpu index, part of the traffic), largest first
    share: float | None                          # None: no traffic or no capacity known


@dataclass(frozen=True)
class LinkShare:
    """How much of its GPUs' host->device link a server's KV offload loads take, over the last
    minute: beside what NVML counted crossing it (the loads' share of the real traffic; the rest
    is weights, activations and other processes) and beside what it carries (capacity)."""

    loads: float                   # the server's KV offload loads, bytes/s (its own /metrics)
    traffic: float | None          # NVML host->device bytes/s of the same GPUs (counter, sampled, gauge)
    capacity: float | None         # their host->device capacity, bytes/s (measured, else achievable)
    gpus: tuple[str, ...]          # the GPU indexes, as the finding names them

    @property
    def of_traffic(self) -> float | None:
        return self.loads / self.traffic if self.traffic else None

    @property
    def of_capacity(self) -> float | None:
        return self.loads / self.capacity if self.capacity else None

    def sentence(self) -> str | None:
        """The finding's note: the loads beside the traffic NVML counted on the same GPUs."""
        if self.of_traffic is None:
            return None
        return (f"NVML counted {human_rate(self.traffic or 0.0)} host to device on GPU "
                f"{', '.join(self.gpus)} over the same minute: the server's KV loads were "
                f"{percent(self.of_traffic)} of it (the rest: weights, activations, other processes).")


@dataclass(frozen=True)
class BusAccount:
    """Where one GPU's host<->device bytes went over the last minute (InferenceWeightsCrossingBus
    works it out; the status page, /metrics and the GPU dashboard show it). Bytes/s per direction
    and cause: kv_offload (what the servers on the GPU report moving: connector, HiCache, HiSparse
    loads and stores), weights (host-resident weights a server's command line configures, at most
    what its forward passes read: see alerts/weight_offload.py) and unattributed (the rest, never
    guessed). `leads` say what would attribute the rest: evidence of a mover that publishes no
    byte counter (LMCache's CPU tier, vLLM's swap space, a connector without counters, Ollama's
    host-resident layers) and a `hybridmon bench` run that finished within the minute."""

    traffic: dict[str, float]                     # direction -> NVML bytes/s
    causes: dict[str, dict[str, float]]           # direction -> cause -> bytes/s
    leads: tuple[str, ...] = ()

    def unattributed(self, direction: str) -> float:
        return self.causes.get(direction, {}).get(UNATTRIBUTED, 0.0)


KV_OFFLOAD, WEIGHTS, UNATTRIBUTED = "kv_offload", "weights", "unattributed"
BUS_CAUSES = (KV_OFFLOAD, WEIGHTS, UNATTRIBUTED)
