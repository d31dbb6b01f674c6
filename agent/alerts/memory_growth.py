"""InferenceProcessMemoryGrowth: a watched process whose memory grows faster than its load explains
(incident 3's stale pointers to offloaded KV blocks). One rule per kind of memory (label
resource: gpu_memory, resident, locked). Runbook: InferenceProcessMemoryGrowth.md.

The load is that of the inference server tied to the process, else its own CPU time. A server is
tied to every watched process of the tree its listening process is in
(hybridmon_process_tree_root_info, from the parent pids): vLLM V1's engine core, which holds the
GPU memory, is a child of the API server that serves /metrics, and its own CPU time says nothing
of the traffic (its busy loop keeps a core at 100 %).

Growth and load are judged together: the memory's slope less the part its load's own relative
rise explains (mean memory x the load's rise, a share of its mean per hour, x
load_following_factor) must reach growth_per_hour_share of the mean memory per hour or growth_bytes_per_hour,
whichever is smaller. Memory proportional to its load (plus any constant) never reaches it at
any ramp rate; a leak does once the ramp is slower than the leak. Growth also counts when the
page faults per CPU second climb, whatever the load does.

Slopes are robust to a single jump (a model or adapter load): the agent takes a Theil-Sen slope,
the rule rules.promql.robust_slope (the median of local least-squares slopes), which agree on
steady growth. The recordings the rules read (slopes, the load and its rise, the exhaustion
forecast) are the process group's, in rules/process.py.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Callable, Sequence

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import common, servers, windows
from hybridmon.agent.detectors.base import Finding
from hybridmon.agent.history import History, SeriesHistory
from hybridmon.exporters.base import MetricSpec
from hybridmon.exporters.gpu import MEMORY_RESERVED as GPU_MEMORY_RESERVED
from hybridmon.exporters.gpu import MEMORY_TOTAL as GPU_MEMORY_TOTAL
from hybridmon.exporters.gpu import MEMORY_USED as GPU_MEMORY_USED
from hybridmon.exporters.gpu import PROCESS_MEMORY_USED
from hybridmon.exporters.host_memory import MEMORY_AVAILABLE
from hybridmon.exporters.cgroup_memory import CGROUP_MEMORY_HEADROOM
from hybridmon.exporters.inference_names import BY_FIELD as SERVER_SERIES
from hybridmon.exporters.process import (CPU_SECONDS, LOCKED, MAJOR_FAULTS, MINOR_FAULTS, PINNED, RESIDENT,
                                         TREE_ROOT)
from hybridmon.rules import process as recorded
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import data_spans, duration, number, query
from hybridmon.agent.alerts.memory_growth_cases import cases
from hybridmon.rules.templates import humanize1024, humanize_percentage

GENERATED_TOKENS = SERVER_SERIES["generated_tokens"]
REQUESTS_RUNNING = SERVER_SERIES["requests_running"]
INPUTS = (PROCESS_MEMORY_USED, RESIDENT, LOCKED, PINNED, CPU_SECONDS, MINOR_FAULTS, MAJOR_FAULTS,
          TREE_ROOT, GENERATED_TOKENS, REQUESTS_RUNNING, GPU_MEMORY_TOTAL, GPU_MEMORY_USED,
          GPU_MEMORY_RESERVED, MEMORY_AVAILABLE, CGROUP_MEMORY_HEADROOM)


class Settings(Section):
    window_seconds: float
    min_window_seconds: float
    growth_per_hour_share: float
    growth_bytes_per_hour: float
    load_following_factor: float
    exhaustion_horizon_seconds: float


@dataclass(frozen=True)
class Resource:
    """One kind of memory the family watches, as its rule and its text name it."""

    label: str          # the alert's resource label
    gauge: MetricSpec   # the raw gauge: its oldest sample in the window says the window is filled
    short: str          # for the summary
    what: str           # for the description
    limit: str          # what bounds it


_HOST_BOUND = "the tighter of MemAvailable and its cgroup's memory limit, plus its own use"
RESOURCES = (
    Resource("gpu_memory", PROCESS_MEMORY_USED, "GPU memory", "GPU memory (NVML, summed over its GPUs)",
             "the free memory of its GPUs plus its own use"),
    Resource("resident", RESIDENT, "resident memory", "resident host memory (VmRSS)",
             _HOST_BOUND),
    Resource("locked", LOCKED, "locked memory", "locked host memory (VmLck)", _HOST_BOUND),
)


def alerts(g: Settings) -> list[Alert]:
    window = duration(g.window_seconds)
    faults = recorded.fault_slope(window)
    rise = recorded.load_rise(window)
    recordings = {r.label: r for r in recorded.resources()}   # its slope, amount and forecast
    rules = []
    for resource in RESOURCES:
        shared = recordings[resource.label]
        slope = shared.slope(window)
        mean = f"avg_over_time({shared.current}[{window}])"
        share, floor = number(g.growth_per_hour_share), number(g.growth_bytes_per_hour)
        threshold = f"clamp_max({mean} * {share}, {floor})"
        expr = (
            "(\n"
            "    # bytes per hour of growth its load does not explain: the slope less the mean amount\n"
            "    # times the load's own rise (a share of its mean per hour, 0 when it falls), times\n"
            "    # load_following_factor\n"
            f"    {slope} * 3600\n"
            f"    - {mean} * on (job, instance, pid) group_left () {rise} * {number(g.load_following_factor)}\n"
            "    # at least the share of the mean amount per hour, or the absolute rate if smaller\n"
            f"    >= {threshold}\n"
            "  or\n"
            "    # ...or any such growth while the page faults per CPU second grow\n"
            f"    {slope} * 3600 >= {threshold}\n"
            "    and on (job, instance, pid)\n"
            f"    {faults} * 3600 >= avg_over_time({recorded.FAULTS_PER_CPU}[{window}]) * {number(g.growth_per_hour_share)}\n"
            f"    and on (job, instance, pid) {faults} > 0\n"
            ")\n"
            f"and {slope} > 0\n"
            "# with data reaching back at least min_window_seconds\n"
            "and on (job, instance, pid)\n"
            f"{data_spans(resource.gauge.name, g.window_seconds, g.min_window_seconds)}"
        )
        rules.append(Alert(
            "InferenceProcessMemoryGrowth", expr, 0, "warning",
            f"<process_name> (pid <pid>) on <instance>: {resource.short} grows "
            "<value|humanize1024>B per hour more than its load explains",
            f"The {resource.what} of watched process <process_name> (pid <pid>) grew steadily by "
            "<per_hour|humanize1024>B per hour over the last "
            f"{window} (a slope that ignores a single jump: Theil-Sen in the agent, the median of "
            "the local slopes in Prometheus) around a mean of <mean|humanize1024>B, while its load "
            "rose <load_rise|humanizePercentage> of its mean per hour; memory that follows its load "
            f"grows at most {number(g.load_following_factor)} times that share (more than the load "
            "itself: tokens/s rise slower than the batch that memory follows). The growth beyond it, "
            "<value|humanize1024>B per hour, "
            f"reaches the threshold: {humanize_percentage(g.growth_per_hour_share)} of the mean per "
            f"hour or {humanize1024(g.growth_bytes_per_hour)}B per hour, whichever is smaller (or "
            "any such growth while its page faults per CPU second keep rising). The load is the "
            "inference server tied to it (its own pid or a process of the same process tree: its "
            "generation tokens/s or running requests, whichever rose more, the newer half of the "
            "window against the older), else its CPU time; "
            f"over the last {window} it averaged <cpu|humanize> CPU seconds per second and, on the "
            "server (unknown where none is tied), <tokens|humanize> generation tokens/s with "
            "<running|humanize> running requests. "
            f"At its full rate it takes {resource.limit} in <exhaustion|humanizeDuration> (now "
            "<current|humanize1024>B; the warning horizon is "
            f"{duration(g.exhaustion_horizon_seconds)}): if the growth is a leak, plan a restart "
            "before then. Memory that grows without more work is being held, not reused: a leak, "
            "a cache without a bound, or references kept to KV blocks that were offloaded or "
            "freed, which ends in swapping, stalls or an OOM kill. From outside the process this "
            "shows the growth, not its cause: compare with the server's own KV cache usage "
            "metrics; the runbook says where else to look.",
            labels={"resource": resource.label},
            queries={
                "per_hour": query("{} * 3600", slope, "pid"),
                "mean": query(f"avg_over_time({{}}[{window}])", shared.current, "pid"),
                "current": query("{}", shared.current, "pid"),
                "load_rise": query("{}", rise, "pid"),
                "exhaustion": query("{}", shared.exhaustion(), "pid"),
                "cpu": query(f"avg_over_time({{}}[{window}])", recorded.CPU, "pid"),
                "tokens": query(f"avg_over_time({{}}[{window}])", recorded.SERVER_TOKENS, "pid"),
                "running": query(f"avg_over_time({{}}[{window}])", recorded.SERVER_RUNNING, "pid"),
            },
        ))
    return rules


@dataclass(frozen=True)
class _Load:
    """A process's load over the window, from per-minute rates: how fast it rose (a share of its
    mean per hour, never below 0) and the means the text reports."""

    rise_per_hour: float | None                   # None: too little history to tell
    source: str                                   # "server" or "cpu"
    faults_rising: bool
    cpu_seconds_per_second: float | None = None   # means over the window
    tokens_per_second: float | None = None
    requests_running: float | None = None
    rises: tuple[tuple[str, float], ...] = ()     # (what, its rise per hour), for the details


def _surely_below(times: Sequence[float], values: Sequence[float], per_second: float,
                  count_pairs: bool = True) -> bool:
    """Whether the Theil-Sen slope of _slope_per_hour and _judge is surely below `per_second`
    (positive), a hair under it so that slope x 3600 >= limit x 3600 cannot hold where True;
    count_pairs as windows.theil_sen_below."""
    return per_second > 0 and windows.theil_sen_below(
        times, values, per_second * (1 - 1e-9), windows.LONG_TREND_POINTS, count_pairs)


def _slope_per_hour(times: list[float], values: list[float]) -> float | None:
    slope = windows.theil_sen_slope(times, values, windows.LONG_TREND_POINTS)
    return None if slope is None else slope * 3600


class Detector:
    """InferenceProcessMemoryGrowth, per watched process and resource (gpu_memory: NVML's
    per-process GPU memory summed over its GPUs; resident: VmRSS; locked: VmLck + VmPin).

    Over the last window_seconds since the process (re)started, with at least min_window_seconds
    between its first and last point: the Theil-Sen slope x 3600 less mean x the load's rise per
    hour x load_following_factor (the growth its load explains), in bytes per hour (the value),
    >= min(growth_per_hour_share x mean, growth_bytes_per_hour); or the slope alone reaches that
    while its page faults (minor + major) per CPU second rise by growth_per_hour_share of their
    mean per hour. The load's rise (rules.process.half_window_rise; 0 when it falls or idles): the
    mean per-minute rate over the newer half of the window less that over the older half, per
    hour, over their mean, of the generation tokens/s or running requests (the larger) of the
    servers tied to the process (its pid or a pid of its process tree, summed), else of its CPU
    seconds per second. Without CPU figures for the
    process (not visible in this PID namespace) nothing is reported. The forecast is the time
    until it takes what bounds it: for host memory the tighter of MemAvailable and what its cgroup
    (or an ancestor's) limit leaves, for GPU memory the free memory of its GPUs (all on top of its
    own use); the horizon is reported, not a condition."""

    name = "memory_growth"
    alertnames = ("InferenceProcessMemoryGrowth",)

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.min_history_seconds = config.min_window_seconds
        self.alerts = {rule.labels["resource"]: rule for rule in alerts(config)}

    def evaluate(self, history: History, now: float) -> list[Finding]:
        cpu = windows.by_labels(history.series(CPU_SECONDS.name), *common.PROCESS_LABELS)
        resident = windows.by_labels(history.series(RESIDENT.name), *common.PROCESS_LABELS)
        locked = windows.group_by(history.series(LOCKED.name) + history.series(PINNED.name),
                                  *common.PROCESS_LABELS)
        gpu_memory = windows.group_by(history.series(PROCESS_MEMORY_USED.name), "pid")
        available = common.host_series(history, MEMORY_AVAILABLE.name)
        host_available = None if available is None else windows.latest(available, now)
        cgroup_headroom = windows.by_labels(history.series(CGROUP_MEMORY_HEADROOM.name),
                                            *common.PROCESS_LABELS)
        roots = servers.tree_roots(history, now)
        # NVML's per-process memory is keyed by pid alone: judge it once, with the process that
        # was seen last under that pid (a pid whose comm changed has two CPU series).
        newest = {}
        for key in sorted(cpu, key=lambda k: cpu[k].times[-1] if cpu[k].times else 0.0):
            newest[key[0]] = key
        growing: list[tuple[tuple[str, ...], float | None, list]] = []
        for key in sorted(cpu, key=common.process_order):
            pid, process_name = key
            since = common.process_restart_time(history, pid, process_name, now)
            candidates: list[tuple[str, str, list[float], list[float], Callable[[], float | None]]] = []
            host_headroom = _tighter(host_available, None if key not in cgroup_headroom
                                     else windows.latest(cgroup_headroom[key], now))
            if key in resident:
                times, values = windows.window_since(resident[key], now, self.config.window_seconds,
                                                     since)
                candidates.append(("resident", process_name, times, values, lambda h=host_headroom: h))
            if key in locked:
                times, values = _summed_window(locked[key], now, self.config.window_seconds, since,
                                               self.config.min_window_seconds)
                candidates.append(("locked", process_name, times, values, lambda h=host_headroom: h))
            if (pid,) in gpu_memory and newest[pid] == key:
                series = gpu_memory[(pid,)]
                times, values = _summed_window(series, now, self.config.window_seconds, since,
                                               self.config.min_window_seconds)
                candidates.append(("gpu_memory", series[-1].labels["process_name"], times, values,
                                   lambda s=series: self._gpu_free(history, s, now)))
            # Most memory does not grow: the load (per-minute rates over the window) and the
            # headroom are worked out only for a process with memory that may.
            candidates = [(*c, *glance) for c in candidates
                          if (glance := self._glance(c[2], c[3], now)) is not None]
            if candidates:
                growing.append((key, since, candidates))
        growing = self._with_slopes(growing)
        rates = self._counter_rates(history, cpu, [(key, since) for key, since, _ in growing], now)
        findings = []
        for key, since, candidates in growing:
            load = self._load(history, rates[key], now, servers.tied_pids(key[0], roots))
            if load is None:
                continue
            for resource, label_name, times, values, headroom, mean, slope in candidates:
                judged = self._judge(key[0], label_name, resource, times, values, mean, slope,
                                     headroom(), load, now)
                if judged is not None:
                    findings.append(judged)
        return findings

    def _window_start(self, now: float, since: float | None) -> float:
        return now - self.config.window_seconds if since is None else max(
            now - self.config.window_seconds, since)

    def _counter_rates(self, history: History, cpu: dict[tuple[str, ...], SeriesHistory],
                       processes: list[tuple[tuple[str, ...], float | None]], now: float
                       ) -> dict[tuple[str, ...], tuple[float, list[tuple[list[float], list[float]]]]]:
        """Per process (key, since): its window's start and the per-minute rates of its CPU time
        then its page-fault counters. One collector samples them all on the same ticks, so every
        process's counters are rated together, in passes of arrays (windows.rate_steps_of), over
        the steps of the longest window; a process whose window starts later (it restarted)
        keeps the newer steps, the ones its own window has: a step's rate depends only on the
        points in its minute, so each figure is the one a pass of its own gives."""
        starts = {key: self._window_start(now, since) for key, since in processes}
        if not starts:
            return {}
        counters: list[SeriesHistory] = []
        owners: list[tuple[str, ...]] = []
        for key in starts:
            faults = [series for metric in (MINOR_FAULTS.name, MAJOR_FAULTS.name)
                      for series in history.series(metric, pid=key[0], process_name=key[1])]
            counters += [cpu[key], *faults]
            owners += [key] * (1 + len(faults))
        rated = windows.rate_steps_of(counters, min(starts.values()), now)
        found: dict[tuple[str, ...], tuple[float, list[tuple[list[float], list[float]]]]] = {
            key: (start, []) for key, start in starts.items()}
        for key, (times, values) in zip(owners, rated):
            first = bisect_left(times, starts[key] + windows.AVERAGE_SECONDS)
            found[key][1].append((times[first:], values[first:]))
        return found

    def _load(self, history: History, rated: tuple[float, list[tuple[list[float], list[float]]]],
              now: float, server_pids: set[str]) -> _Load | None:
        """The process's load; `rated`: its window's start and the per-minute rates of its CPU
        time then its page faults (_counter_rates)."""
        start, ((times, rates), *fault_rates) = rated
        # the load's rise needs settled figures in the window's older half; until then only the
        # page faults can tell (as in the rule, whose load_rise recording is absent until then)
        known = any(times[0] + 60 <= t <= now - self.config.window_seconds / 2 for t in times)
        rising = self._faults_rising(fault_rates, dict(zip(times, rates)))
        cpu_mean = sum(rates) / len(rates) if rates else None
        tokens = [s for pid in sorted(server_pids)
                  for s in history.series(GENERATED_TOKENS.name, pid=pid)]
        token_times, token_rates = servers.summed_rate_steps(tokens, start, now)
        if len(token_rates) >= 2:   # a server is tied to it: its load is the one judged
            running = [s for pid in sorted(server_pids)
                       for s in history.series(REQUESTS_RUNNING.name, pid=pid)]
            running_times, running_values = servers.summed_average_steps(running, start, now)
            rises = tuple((what, rise) for what, rise in (
                ("tokens", self._half_window_rise(token_times, token_rates, now)),
                ("running", self._half_window_rise(running_times, running_values, now)))
                if rise is not None)
            return _Load(max([0.0] + [rise for _, rise in rises]) if known else None, "server", rising, cpu_mean,
                         sum(token_rates) / len(token_rates),
                         sum(running_values) / len(running_values) if running_values else None,
                         rises)
        if len(rates) < 2:
            return None
        rise = self._half_window_rise(times, rates, now)
        return _Load(max(0.0, rise or 0.0) if known else None, "cpu", rising, cpu_mean,
                     rises=() if rise is None else (("cpu", rise),))

    def _half_window_rise(self, times: list[float], values: list[float], now: float) -> float | None:
        """rules.process.half_window_rise: the line through the means (of times and values) of
        the window's newer and older halves, per hour, over the mean of both halves' values;
        None without both halves or a load."""
        half = self.config.window_seconds / 2
        # as the rule's settled recordings: without the first minute of figures
        points = [(t, v) for t, v in zip(times, values) if times and t >= times[0] + 60]
        newer = [(t, v) for t, v in points if t >= now - half]
        older = [(t, v) for t, v in points if now - 2 * half <= t <= now - half]
        if not newer or not older:
            return None
        (newer_time, newer_mean), (older_time, older_mean) = (
            (sum(t for t, _ in part) / len(part), sum(v for _, v in part) / len(part))
            for part in (newer, older))
        mean = (newer_mean + older_mean) / 2
        if newer_time <= older_time:
            return None
        if mean <= 0:
            return 0.0   # idle: nothing explains growth
        return (newer_mean - older_mean) * 3600 / (newer_time - older_time) / mean

    def _faults_rising(self, fault_rates: list[tuple[list[float], list[float]]], cpu_rates: dict) -> bool:
        """Page faults (minor + major: per-minute rates of each series, fault_rates) per CPU
        second, minute by minute, rising by at least growth_per_hour_share of their mean per
        hour: a process that faults more for the same work is touching memory it did not touch
        before."""
        per_step: dict[float, float] = {}
        for steps, rates in fault_rates:
            for time, value in zip(steps, rates):
                per_step[time] = per_step.get(time, 0.0) + value
        times = [t for t in sorted(per_step) if cpu_rates.get(t, 0) > 0]
        intensity = [per_step[t] / cpu_rates[t] for t in times]
        if len(intensity) < 2:
            return False
        mean = sum(intensity) / len(intensity)
        if mean <= 0 or _surely_below(times, intensity, self.config.growth_per_hour_share * mean / 3600):
            return False
        slope = _slope_per_hour(times, intensity)
        return slope is not None and mean > 0 and slope >= self.config.growth_per_hour_share * mean

    def _glance(self, times, values, now: float) -> tuple[float, float | None, bool] | None:
        """The memory's mean over the window, the threshold its slope must reach where that rules
        it out, and whether _with_slopes is to work out its Theil-Sen slope; None where _judge
        surely returns None, whatever the load: too short a window, no recent point, no memory,
        or a slope below the threshold (either way to fire needs slope x 3600 >= threshold: the
        load's part is never negative). Flat memory is ruled out at a glance; a long window's
        slope is left to _with_slopes (numpy, every process's at once), a short one's pairs are
        counted here."""
        config = self.config
        if len(times) < 2 or times[-1] - times[0] < config.min_window_seconds:
            return None
        if bisect_left(times, now - windows.AVERAGE_SECONDS) == len(times):
            return None
        mean = sum(values) / len(values)
        if mean <= 0:
            return None
        threshold = min(mean * config.growth_per_hour_share, config.growth_bytes_per_hour)
        if config.load_following_factor < 0:
            return mean, None, False   # a falling load adds to the growth: no slope rules it out
        in_numpy = min(len(times), windows.LONG_TREND_POINTS) >= windows.NUMPY_PAIRS_FROM
        if _surely_below(times, values, threshold / 3600, count_pairs=not in_numpy):
            return None
        return mean, threshold, in_numpy

    @staticmethod
    def _with_slopes(growing: list) -> list:
        """`growing` with each candidate's (mean, threshold, in_numpy) glance made (mean, slope):
        the long windows' slopes worked out together (windows.theil_sen_slopes, the floats
        theil_sen_slope gives one by one), a candidate whose slope falls below its threshold
        dropped, and a process left with none dropped; slope None: _judge works it out."""
        long_windows = [(candidate[2], candidate[3]) for _, _, candidates in growing
                        for candidate in candidates if candidate[-1]]
        slopes = iter(windows.theil_sen_slopes(long_windows, windows.LONG_TREND_POINTS)
                      if long_windows else ())
        kept = []
        for key, since, candidates in growing:
            judged = []
            for *candidate, mean, threshold, in_numpy in candidates:
                slope = next(slopes) if in_numpy else None
                if in_numpy and (slope is None or slope * 3600 < threshold):
                    continue
                judged.append((*candidate, mean, slope))
            if judged:
                kept.append((key, since, judged))
        return kept

    def _judge(self, pid, process_name, resource, times, values, mean: float, slope: float | None,
               headroom, load: _Load, now: float) -> Finding | None:
        """The finding for one resource of a process that may grow (its `mean`, and its `slope`
        where _with_slopes worked it out), or None."""
        config = self.config
        recent = values[bisect_left(times, now - windows.AVERAGE_SECONDS):]   # times rise
        current = sum(recent) / len(recent)
        threshold = min(mean * config.growth_per_hour_share, config.growth_bytes_per_hour)
        if slope is None:
            slope = windows.theil_sen_slope(times, values, windows.LONG_TREND_POINTS)
        if slope is None or slope <= 0:
            return None
        unexplained = None if load.rise_per_hour is None else (
            slope * 3600 - mean * load.rise_per_hour * config.load_following_factor)
        if unexplained is not None and unexplained >= threshold:
            value = unexplained
        elif load.faults_rising and slope * 3600 >= threshold:
            value = slope * 3600
        else:
            return None
        forecast = None if headroom is None else max(headroom, 0.0) / slope
        details: dict[str, float | str] = {
            "slope_bytes_per_second": slope,
            "unexplained_bytes_per_hour": unexplained,
            "mean_bytes": mean,
            "current_bytes": current,
            "growth_share_per_hour": slope * 3600 / mean,
            "load_rise_share_per_hour": load.rise_per_hour,
            "window_seconds": times[-1] - times[0],
            "load_source": load.source,
            "faults_per_cpu_second_rising": "yes" if load.faults_rising else "no",
            "exhaustion_horizon_seconds": config.exhaustion_horizon_seconds,
        }
        details = {key: value for key, value in details.items() if value is not None}
        for what, rise in load.rises:
            details[f"load_{what}_rise_share_per_hour"] = rise
        if forecast is not None:
            details["forecast_seconds_to_exhaustion"] = forecast
            details["exhaustion_headroom_bytes"] = headroom
        return finding(
            self.alerts[resource], {"pid": pid, "process_name": process_name}, value, threshold,
            unit="B/h",
            values={"per_hour": slope * 3600, "mean": mean, "current": current,
                    "load_rise": load.rise_per_hour, "exhaustion": forecast,
                    "cpu": load.cpu_seconds_per_second, "tokens": load.tokens_per_second,
                    "running": load.requests_running},
            details=details)

    def _gpu_free(self, history: History, series: list[SeriesHistory], now: float) -> float | None:
        """Memory no process holds on the GPUs the process holds memory on now: total - used -
        reserved (nvmlMemory_v2_t: free is what is neither reserved nor allocated; without v2 the
        used figure already holds the reserved part and no reserved series exists)."""
        uuids = {s.labels["uuid"] for s in series if windows.latest(s, now) is not None}
        free = 0.0
        for uuid in uuids:
            figures = []
            for spec in (GPU_MEMORY_TOTAL, GPU_MEMORY_USED, GPU_MEMORY_RESERVED):
                found = common.host_series(history, spec.name, uuid=uuid)
                figures.append(None if found is None else windows.latest(found, now))
            total, used, reserved = figures
            if total is None or used is None:
                return None
            free += total - used - (reserved or 0.0)
        return free if uuids else None


def _tighter(*headrooms: float | None) -> float | None:
    """The least of the known headrooms: a cgroup limit bounds a process before MemAvailable does."""
    known = [headroom for headroom in headrooms if headroom is not None]
    return min(known) if known else None


def _summed_window(series: list[SeriesHistory], now: float, seconds: float, since: float | None,
                   min_span: float = 0.0) -> tuple[Sequence[float], Sequence[float]]:
    """The series' points in the window, summed time by time; nothing where they span less than
    `min_span` (too short to judge: not worth the sum) or every point is 0. A single series (a
    process on one GPU, the common case) is its own sum: its points are returned as they are, not
    added to 0.0 one by one (which changes no value but a -0.0)."""
    cut = [windows.window_since(one, now, seconds, since) for one in series]
    spanned = [times for times, _ in cut if len(times)]
    if not spanned or max(t[-1] for t in spanned) - min(t[0] for t in spanned) < min_span:
        return [], []
    if not any(map(any, (values for _, values in cut))):
        return [], []   # most processes lock no memory: a mean of 0 is never judged
    if len(cut) == 1:
        return cut[0]
    return windows.summed([SeriesHistory(one.name, one.labels, times, values)
                           for one, (times, values) in zip(series, cut)])


FAMILY = AlertFamily(
    section="memory_growth",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group="hybridmon-process",
    detector=Detector,
    alerts=lambda t: tuple(alerts(t.memory_growth)),
    cases=cases,
    collectors=(),
    lookback_seconds=lambda settings: settings.window_seconds,
)
