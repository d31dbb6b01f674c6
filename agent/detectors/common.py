"""What several detectors share: finding the GPUs and processes in history, and writing numbers
the way an operator reads them."""
from __future__ import annotations

from hybridmon.agent.detectors import windows
from hybridmon.units import human_bytes, human_duration, human_rate, percent  # noqa: F401 (the detectors' formatting)
from hybridmon.agent.history import History, SeriesHistory

GPU_LABELS = ("gpu", "uuid")
PROCESS_LABELS = ("pid", "name")


def gpu_entity(key: tuple[str, ...]) -> dict[str, str]:
    return {"gpu": key[0], "uuid": key[1]}


def gpu_averages(history: History, metric: str, now: float) -> dict[tuple[str, ...], float]:
    """avg_over_time(metric[1m]) per GPU (gpu, uuid), GPUs without points in the minute left out."""
    found = {}
    for key, series in windows.by_labels(history.series(metric), *GPU_LABELS).items():
        value = windows.avg_over_time(series, now)
        if value is not None:
            found[key] = value
    return found


def gpu_latest(history: History, metric: str, now: float) -> dict[tuple[str, ...], float]:
    """The current value of a state gauge (link generation, width, up) per GPU."""
    found = {}
    for key, series in windows.by_labels(history.series(metric), *GPU_LABELS).items():
        value = windows.latest(series, now)
        if value is not None:
            found[key] = value
    return found


def gpu_directions(history: History, metric: str, now: float,
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


def host_latest(history: History, metric: str, now: float, **labels: str) -> float | None:
    """The current value of a host-wide gauge (one series for the given labels)."""
    for series in history.series(metric, **labels):
        value = windows.latest(series, now)
        if value is not None:
            return value
    return None


def host_series(history: History, metric: str, **labels: str) -> SeriesHistory | None:
    found = history.series(metric, **labels)
    return found[0] if found else None


def numa_node_count(history: History, now: float) -> int:
    """NUMA nodes currently reported (by memory or CPUs, a node may have only one of them)."""
    nodes = set()
    for metric in ("hybridmon_numa_node_memory_total_bytes", "hybridmon_numa_node_cpus"):
        for series in history.series(metric):
            if windows.latest(series, now) is not None:
                nodes.add(series.labels.get("node"))
    return len(nodes)


def process_series(history: History, metric: str, pid: str, name: str) -> list[SeriesHistory]:
    """The series of one process (pid and comm). History.series takes the metric name as its
    `name` argument, so the `name` label is matched here."""
    return [s for s in history.series(metric, pid=pid) if s.labels.get("name") == name]


def process_restart_time(history: History, pid: str, name: str, now: float) -> float | None:
    """When the process now running as `pid` was first seen with its current start time: points
    before it belong to an earlier process that had the same pid."""
    for series in process_series(history, "hybridmon_process_start_time_seconds", pid, name):
        return windows.first_of_latest_run(series, now)
    return None


def process_order(key: tuple[str, ...]) -> tuple:
    """Sort key for (pid, ...) tuples: numeric pid order."""
    return (len(key[0]), key)
