"""InferenceKvOffloadPressure: an inference server's KV cache under pressure, for one of two reasons.
kv_cache_full: the GPU KV cache is (almost) full while requests are preempted, so they stop and are
recomputed or reloaded. offload_link: loads of offloaded KV cache from host memory alone fill the
host-to-device PCIe link of the server's GPUs. The agent's offload_link finding adds the loads'
share of the host->device traffic NVML counted on the same GPUs (detectors.links.LinkShare); the
rule's text keeps the capacity side. Every server with loads has its LinkShare in the detector's
figures, which the status page shows. Runbook: InferenceKvOffloadPressure.md.

A GPU in NVLink-C2C mode (GH200, GB200; issue 29) loads offloaded KV over C2C, not PCIe: its share
of the capacity is C2C's host->device capacity as GpuC2cStarvation sizes it (measured over C2C,
else the up links' maximum x pcie_rates.C2C_ACHIEVABLE_SHARE), and the traffic its loads are set
beside is the C2C throughput.
"""
from __future__ import annotations

from dataclasses import replace
from textwrap import dedent

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import common, servers, windows
from hybridmon.agent.detectors.links import HOST_TO_DEVICE, LinkShare
from hybridmon.agent.detectors.base import DetectorBase, Finding, HistoryReader, add_note
from hybridmon.agent.detectors.servers import Server
from hybridmon.exporters.bench import C2C_MEASURED_CAPACITY, MEASURED_CAPACITY
from hybridmon.exporters.gpu import (C2C_LINK_MAX_BANDWIDTH, C2C_LINK_UP, C2C_MODE, C2C_THROUGHPUT, PCIE_BYTES,
                                     PCIE_LINK_GENERATION, PCIE_LINK_WIDTH, PCIE_SAMPLED_BYTES, PCIE_THROUGHPUT,
                                     PROCESS_MEMORY_USED)
from hybridmon.exporters.inference_names import BY_FIELD, OFFLOAD_BYTES
from hybridmon.pcie_rates import LinkCapacity, c2c_capacity, effective_capacity
from hybridmon.rules import groups
from hybridmon.rules import inference as recorded
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import number, query
from hybridmon.rules.templates import humanize, humanize_percentage
from hybridmon.units import human_rate

KV_CACHE_USAGE = BY_FIELD["kv_cache_usage_ratio"]
PREEMPTIONS = BY_FIELD["preemptions"]
INPUTS = (KV_CACHE_USAGE, PREEMPTIONS, OFFLOAD_BYTES, PROCESS_MEMORY_USED, PCIE_LINK_GENERATION,
          PCIE_LINK_WIDTH, MEASURED_CAPACITY, PCIE_BYTES, PCIE_SAMPLED_BYTES, PCIE_THROUGHPUT,
          C2C_MODE, C2C_LINK_UP, C2C_LINK_MAX_BANDWIDTH, C2C_THROUGHPUT, C2C_MEASURED_CAPACITY)


class Settings(Section):
    kv_cache_usage_at_least: float
    preemptions_per_second_above: float
    offload_load_share_of_capacity: float
    for_seconds: float


def _server(template: str, metric: str) -> tuple[str, tuple[str, ...]]:
    return query(template, metric, *recorded.SERVER)


def cache_full_alert(k: Settings) -> Alert:
    return Alert(
        "InferenceKvOffloadPressure",
        dedent(f"""\
            max without (pid) (
              {recorded.KV_USAGE} >= {number(k.kv_cache_usage_at_least)}
              and
              {recorded.PREEMPTIONS} > {number(k.preemptions_per_second_above)}
            )"""),
        k.for_seconds, "warning",
        f"{recorded.SERVER_NAME} on <instance>: KV cache <value|humanizePercentage> full while "
        "<preemptions|humanize> requests per second are preempted",
        f"{recorded.SERVER_NAME} has its GPU KV cache <value|humanizePercentage> full (1 min average; "
        f"threshold {humanize_percentage(k.kv_cache_usage_at_least)}) and preempts "
        "<preemptions|humanize> requests per second (threshold: more than "
        f"{humanize(k.preemptions_per_second_above)}). A preempted request loses its KV blocks "
        "and is recomputed or reloaded from the offload tier: its tokens stop, time to first token "
        "and inter-token latency jump. Lower the concurrency or context limits (vLLM --max-num-seqs, "
        "--max-model-len), give the KV cache more VRAM (--gpu-memory-utilization, a quantised KV "
        "cache) or add a host-memory offload tier.",
        labels={"reason": "kv_cache_full"},
        queries={"preemptions": _server("max without (pid) ({})", recorded.PREEMPTIONS)},
    )


def offload_link_alert(k: Settings) -> Alert:
    return Alert(
        "InferenceKvOffloadPressure",
        f"max without (pid) (\n  {recorded.OFFLOAD_LOADS} / {recorded.SERVER_CAPACITY}\n"
        f"    >= {number(k.offload_load_share_of_capacity)}\n)",
        k.for_seconds, "warning",
        f"{recorded.SERVER_NAME} on <instance>: KV offload loads of <loads|humanize>B/s fill "
        "<value|humanizePercentage> of the host-to-device link",
        f"{recorded.SERVER_NAME} loads <loads|humanize>B/s of offloaded KV cache from host memory into "
        "the GPU (1 min rate): <value|humanizePercentage> of the <capacity|humanize>B/s "
        "host-to-device capacity of the GPUs its process uses (every GPU of the host when the "
        "server is tied to no process; capacity as hybridmon bench measured it, else what copies "
        "achieve on the best link of the minute, below its theoretical rate; threshold "
        f"{humanize_percentage(k.offload_load_share_of_capacity)}). "
        "The loads alone fill the link: requests whose blocks were offloaded wait for the copy, and "
        "weights or other transfers queue behind it. Keep the hot blocks in VRAM (more "
        "--gpu-memory-utilization, a quantised KV cache, fewer concurrent long contexts) and check "
        "the link runs at its full generation and width.",
        labels={"reason": "offload_link"},
        queries={"loads": _server("max without (pid) ({})", recorded.OFFLOAD_LOADS),
                 "capacity": _server("max without (pid) ({})", recorded.SERVER_CAPACITY)},
    )


def alerts(k: Settings) -> list[Alert]:
    return [cache_full_alert(k), offload_link_alert(k)]


def link_share(history: HistoryReader, server: Server, loads: float, now: float,
               capacities: dict[tuple[str, str], LinkCapacity],
               traffic: dict[tuple[str, ...], dict[str, float]]) -> LinkShare:
    """The LinkShare of `server`'s KV loads (bytes/s) over the GPUs the offload_link reason judges
    it on (those its process holds memory on, else every GPU of the host)."""
    known = set(capacities) or set(traffic)  # as the finding's capacity is summed, where there is one
    mine = sorted(gpus_of(history, server.pid, now) & known or known)
    to_gpu = [traffic[gpu][HOST_TO_DEVICE] for gpu in mine if HOST_TO_DEVICE in traffic.get(gpu, {})]
    carried = [capacities[gpu].bytes_per_second for gpu in mine if gpu in capacities]
    return LinkShare(loads, sum(to_gpu) if to_gpu else None, sum(carried) if carried else None,
                     tuple(gpu[0] for gpu in mine))


def gpu_capacities(history: HistoryReader, now: float) -> dict[tuple[str, str], LinkCapacity]:
    """(gpu, uuid) -> its host->device capacity, its link sized by the best generation and
    width of the minute the loads are averaged over (a link idling at Gen1 between loads
    still carries them at Gen4)."""
    generation = common.gpu_maxima(history, PCIE_LINK_GENERATION.name, now)
    width = common.gpu_maxima(history, PCIE_LINK_WIDTH.name, now)
    measured = common.gpu_directions(history, MEASURED_CAPACITY.name, now)
    found = {}
    for gpu in set(generation) | set(measured):
        capacity = effective_capacity(measured.get(gpu, {}).get(HOST_TO_DEVICE),
                                      generation.get(gpu), width.get(gpu))
        if capacity is not None:
            found[gpu] = capacity
    # In NVLink-C2C mode the loads cross C2C: its capacity, never the idle PCIe link's.
    measured_c2c = common.gpu_directions(history, C2C_MEASURED_CAPACITY.name, now)
    up_links = common.c2c_up_links(history, now)
    for gpu in common.c2c_gpus(history, now):
        found.pop(gpu, None)
        capacity = c2c_capacity(measured_c2c.get(gpu, {}).get(HOST_TO_DEVICE), HOST_TO_DEVICE, up_links.get(gpu))
        if capacity is not None:
            found[gpu] = capacity
    return found


def gpu_host_traffic(history: HistoryReader, now: float) -> dict[tuple[str, ...], dict[str, float]]:
    """Per GPU and direction, the bytes/s its host link carried over the last minute: PCIe's
    (common.gpu_traffic), C2C's throughput average for a GPU in NVLink-C2C mode."""
    traffic = common.gpu_traffic(history, PCIE_BYTES.name, PCIE_SAMPLED_BYTES.name, PCIE_THROUGHPUT.name, now)
    over_c2c = common.gpu_directions(history, C2C_THROUGHPUT.name, now, windows.avg_over_time)
    for gpu in common.c2c_gpus(history, now):
        traffic.pop(gpu, None)
        if gpu in over_c2c:
            traffic[gpu] = over_c2c[gpu]
    return traffic


def gpus_of(history: HistoryReader, pid: str, now: float) -> set[tuple[str, str]]:
    """(gpu, uuid) of the GPUs process `pid` holds memory on now (NVML per-process memory)."""
    if not pid:
        return set()
    return {(s.labels["gpu"], s.labels["uuid"]) for s in history.series(PROCESS_MEMORY_USED.name, pid=pid)
            if windows.latest(s, now) is not None}


class Detector(DetectorBase):
    """InferenceKvOffloadPressure, per server (labels server, endpoint, model, reason), warning.

    kv_cache_full: KV cache usage (avg 1m) >= kv_cache_usage_at_least and the preemption rate
    (1m) > preemptions_per_second_above. offload_link: KV offload loads (rate 1m of the load
    direction) >= offload_load_share_of_capacity x the host->device capacity of the GPUs the
    server's process holds memory on (every GPU when the server is tied to no process, or its
    process holds none); capacity per GPU as GpuPcieStarvation reads it: measured by
    `hybridmon bench`, else what copies achieve on the best link of the last minute
    (pcie_rates.effective_capacity); for a GPU in NVLink-C2C mode as GpuC2cStarvation reads its
    host->device direction (pcie_rates.c2c_capacity)."""

    name = "kv_offload_pressure"
    alertnames = ("InferenceKvOffloadPressure",)
    min_history_seconds = windows.AVERAGE_SECONDS

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.cache_full_alert = cache_full_alert(config)
        self.offload_link_alert = offload_link_alert(config)

    def evaluate(self, history: HistoryReader, now: float) -> list[Finding]:
        findings = []
        shares: dict[tuple[str, ...], LinkShare] = {}   # its figures: every server with KV loads
        capacities: dict[tuple[str, str], LinkCapacity] | None = None
        traffic: dict[tuple[str, ...], dict[str, float]] | None = None
        for server in servers.scraped(history, now):
            full = self._cache_full(history, server, now)
            if full:
                findings.append(full)
            loads = servers.rate(servers.series_of(history, OFFLOAD_BYTES.name, server, direction="load"),
                                 now, windows.AVERAGE_SECONDS)
            if not loads:
                continue
            if capacities is None:
                capacities = self.capacities(history, now)
                traffic = gpu_host_traffic(history, now)
            share = shares[(server.server, server.endpoint, server.model, server.pid)] = link_share(
                history, server, loads, now, capacities, traffic or {})
            mine = gpus_of(history, server.pid, now) & set(capacities) or set(capacities)
            total = sum(capacities[gpu].bytes_per_second for gpu in mine)
            if total > 0 and loads >= self.config.offload_load_share_of_capacity * total:
                found = self._link_full(server, loads, total, {gpu: capacities[gpu] for gpu in sorted(mine)})
                findings.append(self._with_link_share(found, share))
        self.figures = shares
        return findings

    def capacities(self, history: HistoryReader, now: float) -> dict[tuple[str, str], LinkCapacity]:
        return gpu_capacities(history, now)

    def _cache_full(self, history: HistoryReader, server: Server, now: float) -> Finding | None:
        c = self.config
        usage_series = servers.series_of(history, KV_CACHE_USAGE.name, server)
        usage = None if usage_series is None else windows.avg_over_time(usage_series, now)
        preemptions = servers.rate(servers.series_of(history, PREEMPTIONS.name, server), now,
                                   windows.AVERAGE_SECONDS)
        if (usage is None or preemptions is None or usage < c.kv_cache_usage_at_least
                or preemptions <= c.preemptions_per_second_above):
            return None
        return finding(
            self.cache_full_alert, server.labels, usage, c.kv_cache_usage_at_least, unit="ratio",
            values={"preemptions": preemptions},
            details={"kv_cache_usage_ratio": usage, "preemptions_per_second": preemptions,
                     "pid": server.pid})

    @staticmethod
    def _with_link_share(found: Finding, share: LinkShare) -> Finding:
        """The loads' share of the traffic NVML counted, which only the agent adds: the rule's
        text has the capacity side (the dashboard's inference panel shows both)."""
        sentence = share.sentence()
        if sentence is None:
            return found
        noted = add_note(found, sentence)
        return replace(noted, details={**noted.details, "host_to_device_bytes_per_second": share.traffic or 0.0,
                                       "loads_share_of_host_to_device_traffic": share.of_traffic or 0.0})

    def _link_full(self, server: Server, loads: float, total: float,
                   gpus: dict[tuple[str, str], LinkCapacity]) -> Finding:
        # Which GPUs' links make up the capacity, and where each figure comes from: more than
        # the rule can say, so it is a detail (the runbook points at the findings API for it).
        links = ", ".join(f"GPU {gpu[0]} {human_rate(capacity.bytes_per_second)} ({capacity.described})"
                          for gpu, capacity in gpus.items())
        return finding(
            self.offload_link_alert, server.labels, loads / total,
            self.config.offload_load_share_of_capacity, unit="ratio",
            values={"loads": loads, "capacity": total},
            details={"kv_offload_load_bytes_per_second": loads, "capacity_bytes_per_second": total,
                     "gpus": ",".join(gpu[0] for gpu in gpus), "capacity_sources": links,
                     "pid": server.pid})


FAMILY = AlertFamily(
    section="kv_offload_pressure",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group=groups.INFERENCE,
    detector=Detector,
    alerts=lambda t: tuple(alerts(t.kv_offload_pressure)),
    collectors=("inference",),
    lookback_seconds=lambda settings: 0.0,
    scenario="kv_cache_full",
)
