"""InferenceProcessMemoryGrowth: a watched process whose memory grows steadily while its load
does not (incident 3's stale pointers to offloaded KV blocks)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from hybridmon.agent.detectors import common, servers, windows
from hybridmon.agent.detectors.base import Finding, MemoryGrowth
from hybridmon.agent.history import History, SeriesHistory

RESIDENT = "hybridmon_process_resident_bytes"
LOCKED = "hybridmon_process_locked_bytes"
PINNED = "hybridmon_process_pinned_bytes"
CPU_SECONDS = "hybridmon_process_cpu_seconds_total"
MINOR_FAULTS = "hybridmon_process_minor_faults_total"
MAJOR_FAULTS = "hybridmon_process_major_faults_total"
GPU_PROCESS_MEMORY = "hybridmon_gpu_process_memory_used_bytes"
GPU_MEMORY_USED = "hybridmon_gpu_memory_used_bytes"  # for gpu_memory.py
GPU_MEMORY_TOTAL = "hybridmon_gpu_memory_total_bytes"
MEMORY_TOTAL = "hybridmon_memory_total_bytes"

# Long trends are re-judged every evaluation; 150 of the 3,600 points of an hour at 1 s (one per
# 24 s) keep Theil-Sen near 2 ms per series in pure Python.
GROWTH_TREND_POINTS = 150
RESOURCE_TEXT = {"gpu_memory": "GPU memory", "resident": "resident host memory",
                 "locked": "locked/pinned host memory"}


@dataclass(frozen=True)
class _Load:
    """A process's load over the window, as per-minute rates: CPU seconds per second, or its
    server's generation tokens per second (source "server")."""

    mean: float
    slope_per_hour: float | None
    flat: bool
    faults_rising: bool
    fault_intensity_slope_per_hour: float | None
    source: str = "cpu"
    server: str = ""                          # the server's name, for the text
    requests_running: float | None = None     # mean over the window
    requests_slope_per_hour: float | None = None


def _flat(times: list[float], values: list[float], share: float) -> tuple[bool, float | None, float]:
    """(flat, slope per hour, mean): flat unless the slope x 3600 reaches share x the mean."""
    slope = _slope_per_hour(times, values)
    mean = sum(values) / len(values)
    return slope is not None and (slope <= 0 or slope < share * mean), slope, mean


def _slope_per_hour(times: list[float], values: list[float]) -> float | None:
    slope = windows.theil_sen_slope(times, values, GROWTH_TREND_POINTS)
    return None if slope is None else slope * 3600


class MemoryGrowthDetector:
    """InferenceProcessMemoryGrowth, per watched process and resource (gpu_memory: NVML's
    per-process GPU memory summed over its GPUs; resident: VmRSS; locked: VmLck + VmPin).

    Over the last window_seconds since the process (re)started, with at least min_window_seconds
    between its first and last point: the Theil-Sen slope x 3600 >= growth_per_hour_share x the
    current value (avg 1m), and either the load is flat or its page faults per CPU second (minor
    + major) rise by at least growth_per_hour_share of their mean per hour. The load is the
    process's inference server when one is tied to its pid (hybridmon_inference_*{pid}): flat when
    neither its generation tokens/s nor its running requests (per minute, summed over its
    servers) rise by load_flat_per_hour_share of their mean per hour (Theil-Sen slope); else its
    CPU seconds per second, judged the same way. Without CPU figures for the process (not
    visible in this PID namespace) nothing is reported. The forecast is the time until the
    process alone reaches the memory total of its GPUs (gpu_memory) or the host's MemTotal (host
    resources), as the brief defines it; the horizon (exhaustion_horizon_seconds) is reported,
    not a condition, since the alert table's condition does not include it."""

    name = "memory_growth"
    alertnames = ("InferenceProcessMemoryGrowth",)

    def __init__(self, config: MemoryGrowth) -> None:
        self.config = config
        self.min_history_seconds = config.min_window_seconds

    def evaluate(self, history: History, now: float) -> list[Finding]:
        cpu = windows.by_labels(history.series(CPU_SECONDS), *common.PROCESS_LABELS)
        resident = windows.by_labels(history.series(RESIDENT), *common.PROCESS_LABELS)
        locked = windows.group_by(history.series(LOCKED) + history.series(PINNED),
                                  *common.PROCESS_LABELS)
        gpu_memory = windows.group_by(history.series(GPU_PROCESS_MEMORY), "pid")
        host_total = self._host_total(history, now)
        # NVML's per-process memory is keyed by pid alone: judge it once, with the process that
        # was seen last under that pid (a pid whose comm changed has two CPU series).
        newest = {}
        for key in sorted(cpu, key=lambda k: cpu[k].times[-1] if cpu[k].times else 0.0):
            newest[key[0]] = key
        findings = []
        for key in sorted(cpu, key=common.process_order):
            pid, name = key
            since = common.process_restart_time(history, pid, name, now)
            load = self._load(history, key, cpu[key], now, since)
            if load is None or not (load.flat or load.faults_rising):
                continue
            candidates: list[tuple[str, str, list[float], list[float], float | None]] = []
            if key in resident:
                times, values = windows.window_since(resident[key], now, self.config.window_seconds,
                                                     since)
                candidates.append(("resident", name, times, values, host_total))
            if key in locked:
                times, values = _summed_window(locked[key], now, self.config.window_seconds, since)
                candidates.append(("locked", name, times, values, host_total))
            if (pid,) in gpu_memory and newest[pid] == key:
                series = gpu_memory[(pid,)]
                times, values = _summed_window(series, now, self.config.window_seconds, since)
                candidates.append(("gpu_memory", series[-1].labels["process_name"], times, values,
                                   self._gpu_total(history, series, now)))
            for resource, label_name, times, values, limit in candidates:
                finding = self._judge(pid, label_name, resource, times, values, limit, load, now)
                if finding is not None:
                    findings.append(finding)
        return findings

    def _load(self, history: History, key: tuple[str, ...], cpu: SeriesHistory, now: float,
              since: float | None) -> _Load | None:
        start = now - self.config.window_seconds if since is None else max(
            now - self.config.window_seconds, since)
        times, rates = windows.rate_steps(cpu, start, now)
        server = self._server_load(history, key[0], start, now)
        if len(rates) < 2:
            return server
        flat, slope, mean = _flat(times, rates, self.config.load_flat_per_hour_share)
        intensity_times, intensity = self._fault_intensity(history, key, dict(zip(times, rates)),
                                                           start, now)
        fault_slope = _slope_per_hour(intensity_times, intensity) if len(intensity) >= 2 else None
        mean_intensity = sum(intensity) / len(intensity) if intensity else 0.0
        rising = (fault_slope is not None and mean_intensity > 0
                  and fault_slope >= self.config.growth_per_hour_share * mean_intensity)
        if server is not None:
            return replace(server, faults_rising=rising, fault_intensity_slope_per_hour=fault_slope)
        return _Load(mean, slope, flat, rising, fault_slope)

    def _server_load(self, history: History, pid: str, start: float, now: float) -> _Load | None:
        """The load of the inference servers tied to `pid`: generation tokens/s and running
        requests, per minute, summed over its servers and models. None without such a server."""
        tokens = history.series(servers.GENERATED_TOKENS, pid=pid)
        times, rates = servers.summed_rate_steps(tokens, start, now)
        if len(rates) < 2:
            return None
        share = self.config.load_flat_per_hour_share
        flat, slope, mean = _flat(times, rates, share)
        running_times, running = servers.summed_average_steps(
            history.series(servers.REQUESTS_RUNNING, pid=pid), start, now)
        requests_mean = requests_slope = None
        if len(running) >= 2:
            requests_flat, requests_slope, requests_mean = _flat(running_times, running, share)
            flat = flat and requests_flat
        names = sorted({servers.server_of(s).short_name for s in tokens})
        return _Load(mean, slope, flat, False, None, "server", " and ".join(names),
                     requests_mean, requests_slope)

    def _fault_intensity(self, history: History, key: tuple[str, ...], cpu_rates: dict,
                         start: float, now: float) -> tuple[list[float], list[float]]:
        """Page faults (minor + major) per CPU second, minute by minute: a process that faults
        more for the same work is touching memory it did not touch before."""
        per_step: dict[float, float] = {}
        for metric in (MINOR_FAULTS, MAJOR_FAULTS):
            for series in common.process_series(history, metric, key[0], key[1]):
                for time, value in zip(*windows.rate_steps(series, start, now)):
                    per_step[time] = per_step.get(time, 0.0) + value
        times = [t for t in sorted(per_step) if cpu_rates.get(t, 0) > 0]
        return times, [per_step[t] / cpu_rates[t] for t in times]

    def _judge(self, pid, name, resource, times, values, limit, load: _Load,
               now: float) -> Finding | None:
        config = self.config
        if len(times) < 2 or times[-1] - times[0] < config.min_window_seconds:
            return None
        recent = [v for t, v in zip(times, values) if t >= now - windows.AVERAGE_SECONDS]
        if not recent:
            return None
        current = sum(recent) / len(recent)
        slope = windows.theil_sen_slope(times, values, GROWTH_TREND_POINTS)
        if current <= 0 or slope is None or slope <= 0:
            return None
        share_per_hour = slope * 3600 / current
        if share_per_hour < config.growth_per_hour_share:
            return None
        forecast = windows.seconds_until(current, slope, limit) if limit is not None else None
        details: dict[str, float | str] = {
            "slope_bytes_per_second": slope,
            "current_bytes": current,
            "growth_share_per_hour": share_per_hour,
            "window_seconds": times[-1] - times[0],
            "load_source": load.source,
            "load_flat": "yes" if load.flat else "no",
            "faults_per_cpu_second_rising": "yes" if load.faults_rising else "no",
            "exhaustion_horizon_seconds": config.exhaustion_horizon_seconds,
        }
        if load.source == "server":
            details["load_generation_tokens_per_second"] = load.mean
            if load.requests_running is not None:
                details["load_requests_running"] = load.requests_running
            if load.requests_slope_per_hour is not None:
                details["load_requests_running_slope_per_hour"] = load.requests_slope_per_hour
        else:
            details["load_cpu_seconds_per_second"] = load.mean
        if load.slope_per_hour is not None:
            details["load_slope_per_hour"] = load.slope_per_hour
        if forecast is not None:
            details["forecast_seconds_to_exhaustion"] = forecast
            details["exhaustion_limit_bytes"] = limit
        what = RESOURCE_TEXT[resource]
        if load.source == "server":
            running = ("" if load.requests_running is None
                       else f", {servers.human_count(load.requests_running)} running requests")
            flat_text = (f"while the load of its {load.server} server stays flat "
                         f"({servers.human_count(load.mean)} tokens/s{running})")
        else:
            flat_text = "while its CPU load stays flat"
        why = flat_text if load.flat else "while its page faults per CPU second keep rising"
        forecast_text = ""
        if forecast is not None:
            limit_text = ("the memory total of its GPUs" if resource == "gpu_memory"
                          else "the host's MemTotal")
            within = forecast <= config.exhaustion_horizon_seconds
            forecast_text = (
                f" At this rate it reaches {limit_text} ({common.human_bytes(limit)}) in "
                f"{common.human_duration(forecast)}"
                + (f", within the {common.human_duration(config.exhaustion_horizon_seconds)} "
                   "warning horizon." if within else "."))
        return Finding(
            alertname="InferenceProcessMemoryGrowth",
            severity="warning",
            labels={"pid": pid, "process_name": name, "resource": resource},
            value=slope,
            threshold=current * config.growth_per_hour_share / 3600,
            unit="B/s",
            summary=(f"{name} (pid {pid}) {what} grows {common.human_bytes(slope * 3600)}/h "
                     f"({common.percent(share_per_hour)}/h of {common.human_bytes(current)}) {why}"),
            description=(
                f"The {what} of {name} (pid {pid}) has grown steadily by "
                f"{common.human_bytes(slope * 3600)} per hour (Theil-Sen slope over the last "
                f"{common.human_duration(times[-1] - times[0])}), {common.percent(share_per_hour)} "
                f"of its current {common.human_bytes(current)} per hour, at or above "
                f"{common.percent(config.growth_per_hour_share)}/h, {why}.{forecast_text} Memory "
                f"that grows without more work is a leak: blocks (e.g. offloaded KV cache) that "
                f"are never freed, which ends in swapping, stalls or an OOM kill. From outside the "
                f"process this shows growth, not its cause. First: compare with the server's own "
                f"KV cache usage metrics, and plan a restart before the forecast runs out."),
            details=details,
        )

    def _host_total(self, history: History, now: float) -> float | None:
        series = common.host_series(history, MEMORY_TOTAL)
        return windows.avg_over_time(series, now) if series else None

    def _gpu_total(self, history: History, series: list[SeriesHistory],
                   now: float) -> float | None:
        """Memory installed on the GPUs the process holds memory on now."""
        uuids = {s.labels["uuid"] for s in series if windows.latest(s, now) is not None}
        total = 0.0
        for uuid in uuids:
            found = common.host_series(history, GPU_MEMORY_TOTAL, uuid=uuid)
            value = windows.avg_over_time(found, now) if found else None
            if value is None:
                return None
            total += value
        return total if uuids else None


def _summed_window(series: list[SeriesHistory], now: float, seconds: float,
                   since: float | None) -> tuple[list[float], list[float]]:
    parts = []
    for one in series:
        times, values = windows.window_since(one, now, seconds, since)
        parts.append(SeriesHistory(one.name, one.labels, times, values))
    return windows.summed(parts)
