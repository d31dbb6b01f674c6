"""What several detectors share: finding the GPUs and processes in history (numbers are written
by hybridmon.units)."""
from __future__ import annotations

import math

from hybridmon.agent.detectors.base import HistoryReader
from hybridmon.agent.detectors import windows
from hybridmon.agent.loop.history import SeriesHistory
from hybridmon.exporters.numa import NODE_CPUS, NODE_MEMORY_TOTAL
from hybridmon.exporters.gpu import C2C_LINK_MAX_BANDWIDTH, C2C_LINK_UP, C2C_MODE, GPU_INFO

GPU_LABELS = ("gpu", "uuid")
PROCESS_LABELS = ("pid", "process_name")


def gpu_entity(key: tuple[str, ...]) -> dict[str, str]:
    return {"gpu": key[0], "uuid": key[1]}


def gpus_by_bus_id(history: HistoryReader) -> dict[str, dict[str, str]]:
    """pci_bus_id (lower case) -> gpu_info labels, from any time in history: a GPU that fell off
    the bus no longer reports its identity, so its last report names it. The PCIe collector's
    series (AER counters, presence, NUMA node) are keyed by bus id; this names their GPU."""
    found: dict[str, tuple[float, dict[str, str]]] = {}
    for series in history.series(GPU_INFO.name):
        bus_id = series.labels.get("pci_bus_id", "").lower()
        seen = series.times[-1] if series.times else -math.inf
        if bus_id and (bus_id not in found or seen >= found[bus_id][0]):
            found[bus_id] = (seen, series.labels)
    return {bus_id: labels for bus_id, (_, labels) in found.items()}


def gpu_reduced(history: HistoryReader, metric: str, now: float, reduce) -> dict[tuple[str, ...], float]:
    """reduce(series, now) per GPU (gpu, uuid); GPUs whose series give no value are left out."""
    found = {}
    for key, series in windows.by_labels(history.series(metric), *GPU_LABELS).items():
        value = reduce(series, now)
        if value is not None:
            found[key] = value
    return found


def gpu_averages(history: HistoryReader, metric: str, now: float) -> dict[tuple[str, ...], float]:
    """avg_over_time(metric[1m]) per GPU (gpu, uuid), GPUs without points in the minute left out."""
    return gpu_reduced(history, metric, now, windows.avg_over_time)


def gpu_maxima(history: HistoryReader, metric: str, now: float) -> dict[tuple[str, ...], float]:
    """max_over_time(metric[1m]) per GPU: the best state (link generation, width) seen over the
    window the averages cover, so a link that dropped speed at idle after a burst still counts
    at the speed it carried the burst with."""
    return gpu_reduced(history, metric, now, windows.max_over_time)


def gpu_latest(history: HistoryReader, metric: str, now: float) -> dict[tuple[str, ...], float]:
    """The current value of a state gauge (link generation, width, up) per GPU."""
    return gpu_reduced(history, metric, now, windows.latest)


def gpu_directions(history: HistoryReader, metric: str, now: float,
                   reduce=windows.latest) -> dict[tuple[str, ...], dict[str, float]]:
    """{(gpu, uuid): {direction: value}} of a per-direction GPU series, `reduce` (windows.latest
    or windows.avg_over_time) applied to each; series without a value now are left out."""
    found: dict[tuple[str, ...], dict[str, float]] = {}
    for series in history.series(metric):
        value = reduce(series, now)
        if value is not None:
            key = (series.labels["gpu"], series.labels["uuid"])
            found.setdefault(key, {})[series.labels["direction"]] = value
    return found


def gpu_traffic(history: HistoryReader, counter: str, sampled_counter: str, gauge: str,
                now: float) -> dict[tuple[str, ...], dict[str, float]]:
    """{(gpu, uuid): {direction: bytes/s}} over the last minute, per direction the first that has
    a value, as the rules' `rate(counter[1m]) or rate(sampled_counter[1m]) or
    avg_over_time(gauge[1m])` reads it: NVML's cumulative byte counter (exact), else the agent's
    running estimate from all its 20 ms throughput samples, else the throughput gauge's average
    (the agent keeps every tick; Prometheus keeps only the ticks it scraped)."""
    found = gpu_directions(history, gauge, now, windows.avg_over_time)
    # Later sources overwrite earlier ones, so the most exact is applied last.
    for source in (sampled_counter, counter):
        for key, directions in gpu_directions(history, source, now, windows.rate).items():
            found.setdefault(key, {}).update(directions)
    return found


def c2c_gpus(history: HistoryReader, now: float) -> set[tuple[str, ...]]:
    """The GPUs in NVLink-C2C mode now (GH200, GB200; issue 29): their host<->device copies, and so
    their offloaded KV and weights, cross C2C and not PCIe. As rules/pcie.py's C2C_ON."""
    return {key for key, mode in gpu_latest(history, C2C_MODE.name, now).items() if mode == 1}


def c2c_up_links(history: HistoryReader, now: float) -> dict[tuple[str, ...], float]:
    """(gpu, uuid) -> the maximum bandwidth NVML states for the GPU's NVLink-C2C links that are up
    now, summed (bytes/s); GPUs without an up link left out. As rules/pcie.py's C2C_UP_LINKS."""
    up = {(series.labels["gpu"], series.labels["uuid"], series.labels["link"])
          for series in history.series(C2C_LINK_UP.name) if windows.latest(series, now) == 1}
    found: dict[tuple[str, ...], float] = {}
    for series in history.series(C2C_LINK_MAX_BANDWIDTH.name):
        key = (series.labels["gpu"], series.labels["uuid"])
        value = windows.latest(series, now)
        if value is not None and (*key, series.labels["link"]) in up:
            found[key] = found.get(key, 0.0) + value
    return found


def host_latest(history: HistoryReader, metric: str, now: float, **labels: str) -> float | None:
    """The current value of a host-wide gauge (one series for the given labels)."""
    for series in history.series(metric, **labels):
        value = windows.latest(series, now)
        if value is not None:
            return value
    return None


def host_rate(history: HistoryReader, metric: str, now: float, **labels: str) -> float | None:
    """The 1 min rate of the host's counter (as PromQL's rate()); None without one."""
    for series in history.series(metric, **labels):
        value = windows.rate(series, now)
        if value is not None:
            return value
    return None


def host_series(history: HistoryReader, metric: str, **labels: str) -> SeriesHistory | None:
    found = history.series(metric, **labels)
    return found[0] if found else None


def numa_node_count(history: HistoryReader, now: float) -> int:
    """NUMA nodes currently reported (by memory or CPUs, a node may have only one of them)."""
    nodes = set()
    for metric in (NODE_MEMORY_TOTAL.name, NODE_CPUS.name):
        for series in history.series(metric):
            if windows.latest(series, now) is not None:
                nodes.add(series.labels.get("node"))
    return len(nodes)


def process_order(key: tuple[str, ...]) -> tuple:
    """Sort key for (pid, ...) tuples: numeric pid order."""
    return (len(key[0]), key)
