"""InferenceProcessMemoryGrowth: a watched process whose memory grows faster than its load explains
(incident 3's stale pointers to offloaded KV blocks). One rule per kind of memory (label
resource: gpu_memory, resident, locked). Runbook: InferenceProcessMemoryGrowth.md.

The load is that of the inference server tied to the process, else its own CPU time. A server is
tied to every watched process of the tree its listening process is in
(root_pid of hybridmon_process_info, from the parent pids): vLLM V1's engine core, which holds the
GPU memory, is a child of the API server that serves /metrics, and its own CPU time says nothing
of the traffic (its busy loop keeps a core at 100 %).

Growth and load are judged together: the memory's slope less its own noise (rise_noise_z
standard errors of its rise over the halves of the window) and less the part its load's own
relative rise explains (mean memory x the part of the load's rise, a share of its mean per hour,
beyond rise_noise_z of its standard errors, x load_following_factor) must reach
growth_per_hour_share of the mean memory per hour or growth_bytes_per_hour, whichever is smaller. Memory proportional to its load (plus any constant) never reaches it at
any ramp rate; a leak does once the ramp is slower than the leak. Growth also counts when the
page faults per unit of work climb, whatever the load does (per generated token where a server is
tied to it, else per CPU second).

Issue 28: a finding fires at the threshold and holds down to resolve_share of it; the rule reads
its own ALERTS series for that, the detector remembers what it returned (as long as Prometheus's
lookback delta). Both sides' noise is taken off because a bursty load's noise, judged as
estimated, explained more than a leak at the absolute rate (memory_leak_noisy_load fired at 31 min,
then flapped), while memory that follows its load carries the load's noise in its own scatter. A new finding needs the newest recent_seconds / 2 growing, and every
finding the last recent_seconds, so a ramp that stopped raises nothing and ends what it raised.

Slopes are robust to a single jump (a model or adapter load): the agent takes a Theil-Sen slope,
the rule rules.promql.robust_slope (the median of local least-squares slopes), which agree on
steady growth. Both judge the window up to the last whole minute, at one point per 15 s
(memory_growth/trend.py: the agent works a trend out once a minute and keeps it). The recordings
the rules read (slopes, the load and its rise, the exhaustion forecast) are the process group's,
in rules/process.py.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Sequence

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import common, servers, windows
from hybridmon.agent.alerts.memory_growth.load import (LOOKBACK_SECONDS, Load, LoadJudge, counter_rates,
                                                      rise_noise_per_hour, surely_below)
from hybridmon.agent.alerts.memory_growth.trend import (Growing, Inputs, ProcessKey, Trend, TrendMemory,
                                                       trend_end, trend_signature)
from hybridmon.agent.detectors.base import DetectorBase, Finding, HistoryReader
from hybridmon.agent.loop.history import SeriesHistory
from hybridmon.exporters.base import MetricSpec
from hybridmon.exporters.gpu import MEMORY_RESERVED as GPU_MEMORY_RESERVED
from hybridmon.exporters.gpu import MEMORY_TOTAL as GPU_MEMORY_TOTAL
from hybridmon.exporters.gpu import MEMORY_USED as GPU_MEMORY_USED
from hybridmon.exporters.gpu import PROCESS_MEMORY_USED
from hybridmon.exporters.host_memory import MEMORY_AVAILABLE
from hybridmon.exporters.cgroup_memory import CGROUP_MEMORY_HEADROOM
from hybridmon.exporters.inference_names import BY_FIELD as SERVER_SERIES
from hybridmon.exporters.process import (CPU_SECONDS, INFO, LOCKED, MAJOR_FAULTS, MINOR_FAULTS, PINNED,
                                         RESIDENT)
from hybridmon.rules import groups
from hybridmon.rules import process as recorded
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import data_spans, duration, number, query
from hybridmon.rules.templates import humanize1024, humanize_percentage

GENERATED_TOKENS = SERVER_SERIES["generated_tokens"]
REQUESTS_RUNNING = SERVER_SERIES["requests_running"]
INPUTS = (PROCESS_MEMORY_USED, RESIDENT, LOCKED, PINNED, CPU_SECONDS, MINOR_FAULTS, MAJOR_FAULTS,
          INFO, GENERATED_TOKENS, REQUESTS_RUNNING, GPU_MEMORY_TOTAL, GPU_MEMORY_USED,
          GPU_MEMORY_RESERVED, MEMORY_AVAILABLE, CGROUP_MEMORY_HEADROOM)


class Settings(Section):
    window_seconds: float
    min_window_seconds: float
    growth_per_hour_share: float
    growth_bytes_per_hour: float
    load_following_factor: float
    exhaustion_horizon_seconds: float
    resolve_share: float
    recent_seconds: float
    rise_noise_z: float


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
    # VmLck + VmPin in both doors: both are host memory the kernel cannot reclaim (rules/process.py
    # LOCKED_AND_PINNED); the data-span check reads VmLck, exported whenever the process is read
    Resource("locked", LOCKED, "locked memory", "locked and pinned host memory (VmLck + VmPin)", _HOST_BOUND),
)


def alerts(g: Settings) -> list[Alert]:
    window, recent = duration(g.window_seconds), duration(g.recent_seconds)
    newest = duration(g.recent_seconds / 2)
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
        held = f"{threshold} * {number(g.resolve_share)}"

        # bytes per hour of growth beyond its own noise (rise_noise_z standard errors of its rise)
        # that its load does not explain: less the mean amount times the part of the load's rise
        # (a share of its mean per hour, 0 when it falls) beyond the load's noise, times
        # load_following_factor
        unexplained = (f"{slope} * 3600 - {shared.rise_noise(window)}\n"
                       f"    - {mean} * on (job, instance, pid) group_left () "
                       f"{recorded.load_rise(window, confident=True)} * {number(g.load_following_factor)}")

        def grows(level: str) -> str:
            return (
                f"    {unexplained}\n"
                f"    >= {level}\n"
                "  or\n"
                "    # ...or any such growth while the page faults per unit of work grow\n"
                f"    {slope} * 3600 >= {level}\n"
                "    and on (job, instance, pid)\n"
                f"    {faults} * 3600 >= avg_over_time({recorded.FAULTS_PER_WORK}[{window}]) * {number(g.growth_per_hour_share)}\n"
                f"    and on (job, instance, pid) {faults} > 0\n"
            )
        firing = (f'ALERTS{{alertname="InferenceProcessMemoryGrowth", alertstate="firing", '
                  f'resource="{resource.label}"}}')
        expr = (
            "(\n"
            "  # a new finding: at the threshold (the share of the mean amount per hour, or the\n"
            "  # absolute rate if smaller), while the newer half of the recent part grows too\n"
            "  (\n"
            f"{grows(threshold)}"
            "  )\n"
            f"  and on (job, instance, pid) {shared.recent_slope(newest)} * 3600 >= {held}\n"
            "  or\n"
            "  # once firing, it holds down to resolve_share of the threshold (hysteresis)\n"
            "  (\n"
            f"{grows(held)}"
            "  )\n"
            f"  and on (job, instance, pid) {firing}\n"
            ")\n"
            "# while the recent part of the window still grows (a ramp that stopped raises nothing)\n"
            f"and on (job, instance, pid) {shared.recent_slope(recent)} * 3600 >= {held}\n"
            "# with the load's rise known, and data reaching back at least min_window_seconds\n"
            f"and on (job, instance, pid) {rise}\n"
            f"and {slope} > 0\n"
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
            "the local slopes in Prometheus) around a mean of <mean|humanize1024>B, and by "
            f"<recent|humanize1024>B per hour over the last {recent}, while its load "
            "rose <load_rise|humanizePercentage> of its mean per hour; memory that follows its load "
            f"grows at most {number(g.load_following_factor)} times that share (more than the load "
            "itself: tokens/s rise slower than the batch that memory follows). The growth beyond "
            f"it, each rise counted beyond {number(g.rise_noise_z)} standard errors of its own "
            "noise from its minute-by-minute scatter (or, while its page faults per unit of work "
            "keep rising, all of its growth) is <value|humanize1024>B per hour. "
            f"It fires at the threshold, {humanize_percentage(g.growth_per_hour_share)} of the mean "
            f"per hour or {humanize1024(g.growth_bytes_per_hour)}B per hour, whichever is smaller, "
            f"and holds until the growth falls below {humanize_percentage(g.resolve_share)} of the "
            f"threshold or the last {recent} grow slower than that. The load is the "
            "inference server tied to it (its own pid or a process of the same process tree: its "
            "generation tokens/s or running requests, whichever rose more, the newer half of the "
            "window against the older, and its faults per generated token), else its CPU time; "
            f"over the last {window} it averaged <cpu|humanize> CPU seconds per second<if tokens> and "
            "its server <tokens|humanize> generation tokens/s<else>, no inference server being tied "
            "to it<end><if running> with <running|humanize> running requests<else><end>. "
            f"<if exhaustion>At its full rate it takes {resource.limit} in <exhaustion|humanizeDuration> (now "
            "<current|humanize1024>B; the warning horizon is "
            f"{duration(g.exhaustion_horizon_seconds)}): if the growth is a leak, plan a restart "
            "before then.<else>It holds <current|humanize1024>B now; what bounds it is not "
            "reported, so no time to exhaustion is given.<end> Memory that grows without more work is being held, not reused: a leak, "
            "a cache without a bound, or references kept to KV blocks that were offloaded or "
            "freed, which ends in swapping, stalls or an OOM kill. From outside the process this "
            "shows the growth, not its cause: compare with the server's own KV cache usage "
            "metrics; the runbook says where else to look.",
            labels={"resource": resource.label},
            queries={
                "per_hour": query("{} * 3600", slope, "pid"),
                "recent": query("{} * 3600", shared.recent_slope(recent), "pid"),
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


class Detector(DetectorBase):
    """InferenceProcessMemoryGrowth, per watched process and resource (gpu_memory: NVML's
    per-process GPU memory summed over its GPUs; resident: VmRSS; locked: VmLck + VmPin).

    Over the window_seconds before the last whole minute (memory_growth.trend.trend_end), one
    point per 15 s, since the process (re)started, with at least min_window_seconds between its
    first and last point: the Theil-Sen slope x 3600, less rise_noise_z standard errors of its
    rise over the halves of the load's window (load.rise_noise_per_hour), less mean x the part of
    the load's rise per hour beyond its noise x load_following_factor (the growth its load
    explains), in bytes per hour (the value),
    >= min(growth_per_hour_share x mean, growth_bytes_per_hour); or the slope alone reaches that
    while its page faults (minor + major) per unit of work rise by growth_per_hour_share of their
    mean per hour. The load's rise (rules.process.half_window_rise; 0 when it falls or idles): the
    mean per-minute rate over the newer half of the window less that over the older half, per
    hour, over their mean, of the generation tokens/s or running requests (the larger) of the
    servers tied to the process (its pid or a pid of its process tree, summed), else of its CPU
    seconds per second. Without CPU figures for the process (not visible in this PID namespace),
    or without a point in the last minute, nothing is reported. The forecast is the time
    until it takes what bounds it: for host memory the tighter of MemAvailable and what its cgroup
    (or an ancestor's) limit leaves, for GPU memory the free memory of its GPUs (all on top of its
    own use); the horizon is reported, not a condition. A process's trend is worked out once per
    minute and kept (memory_growth.trend.TrendMemory); the current amount and the headroom are
    read at every evaluation."""

    name = "memory_growth"
    alertnames = ("InferenceProcessMemoryGrowth",)

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.min_history_seconds = config.min_window_seconds
        self.alerts = {rule.labels["resource"]: rule for rule in alerts(config)}
        self.loads = LoadJudge(config.window_seconds, config.growth_per_hour_share,
                               config.min_window_seconds, config.rise_noise_z)
        self._memory = TrendMemory()
        # (pid, resource) -> when it last fired: the rule's ALERTS series, which its hysteresis reads
        self._firing: dict[tuple[str, str], float] = {}
        self._firing_history: object | None = None

    def forget_trends(self) -> None:
        """The next evaluation works every trend out anew, as the first of a minute does (the
        benchmarks time that one beside the others without evaluating at another minute)."""
        self._memory = TrendMemory()

    def evaluate(self, history: HistoryReader, now: float) -> list[Finding]:
        end = trend_end(now)
        inputs = Inputs(history, end - self.config.window_seconds)
        self._memory.begin(history)
        roots = servers.tree_roots(history, now)
        cpu = inputs.cpu
        # NVML's per-process memory is keyed by pid alone: judge it once, with the process that
        # was seen last under that pid (a pid whose comm changed has two CPU series).
        newest = {}
        for key in sorted(cpu, key=lambda k: cpu[k].times[-1] if cpu[k].times else 0.0):
            newest[key[0]] = key
        trends: dict[ProcessKey, tuple[tuple, Trend]] = {}
        unknown = []   # the processes whose trend is to be worked out
        # per process and resource: its series, and their points of the last minute
        now_held: dict[ProcessKey, dict[str, tuple[list[SeriesHistory], list[SeriesHistory]]]] = {}
        for key in sorted(cpu, key=common.process_order):
            pid, process_name = key
            since = inputs.restart_time(key, now)
            judged: dict[str, tuple[str, list[SeriesHistory]]] = {}
            if key in inputs.resident:
                judged["resident"] = (process_name, [inputs.resident[key]])
            if key in inputs.locked:
                judged["locked"] = (process_name, inputs.locked[key])
            if (pid,) in inputs.gpu_memory and newest[pid] == key:
                series = inputs.gpu_memory[(pid,)]
                judged["gpu_memory"] = (series[-1].labels["process_name"], series)
            # a resource without a point in the last minute is not judged (the process is gone)
            now_held[key] = {resource: (series, recent) for resource, (_, series) in judged.items()
                             if (recent := _last_minute(series, now, since))}
            judged = {resource: judged[resource] for resource in now_held[key]}
            tied = servers.tied_pids(pid, roots)
            tokens, running = inputs.servers_of(tied)
            signature = trend_signature(since, self._window_start(end, since), end, tied, judged,
                                        (inputs.counters[key], tokens, running))
            trend = self._memory.recall(key, signature)
            if trend is None:
                unknown.append((key, since, signature, judged, tokens, running))
            else:
                trends[key] = (signature, trend)
        trends.update(self._trends(unknown, inputs, end))
        self._memory.keep(trends)
        if history.source is not self._firing_history:
            self._firing_history, self._firing = history.source, {}
        found = self._findings(history, trends, now_held, now)
        self._firing = {(f.labels["pid"], f.labels["resource"]): now for f in found}
        return found

    def _was_firing(self, pid: str, resource: str, now: float) -> bool:
        """Whether the finding fired at the last evaluation, no more than LOOKBACK_SECONDS ago,
        as the rule reads its own ALERTS series (Prometheus's lookback delta is how long its
        hysteresis remembers that it fired) (a sample within Prometheus's lookback delta; a
        resolved alert's series gets a stale marker)."""
        at = self._firing.get((pid, resource))
        return at is not None and 0 < now - at <= LOOKBACK_SECONDS

    def _window_start(self, end: float, since: float | None) -> float:
        return end - self.config.window_seconds if since is None else max(
            end - self.config.window_seconds, since)

    def _trends(self, unknown: list, inputs: Inputs, end: float) -> dict[ProcessKey, tuple[tuple, Trend]]:
        """The trends of the processes in `unknown` over the window ending at `end`: each
        resource glanced at, the slopes of those left worked out together, then the load of
        each process with a resource that may grow (most have none: no load is worked out)."""
        config = self.config
        growing = []
        for key, since, _, judged, _, _ in unknown:
            candidates = []
            for resource, (label_name, series) in judged.items():
                if resource == "resident":
                    times, values = windows.window_since(series[0], end, config.window_seconds, since)
                else:
                    times, values = _summed_window(series, end, config.window_seconds, since,
                                                   config.min_window_seconds)
                glance = self._glance(times, values)
                if glance is not None:
                    candidates.append((resource, label_name, times, values, *glance))
            growing.append((key, since, candidates))
        sloped = {key: candidates for key, _, candidates in self._with_slopes(growing, end)}
        rates = counter_rates(inputs.counters, {key: self._window_start(end, since)
                                                for key, since, _ in growing if key in sloped}, end)
        found = {}
        for key, _, signature, _, tokens, running in unknown:
            load = None if key not in sloped else self.loads.load(rates[key], tokens, running, end)
            found[key] = (signature, Trend(tuple(sloped.get(key, ())), load))
        return found

    def _findings(self, history: HistoryReader, trends: dict[ProcessKey, tuple[tuple, Trend]],
                  now_held: dict, now: float) -> list[Finding]:
        """The findings of an evaluation at `now`: each growing resource judged with its trend
        and its amount and headroom now."""
        available = common.host_series(history, MEMORY_AVAILABLE.name)
        host_available = None if available is None else windows.latest(available, now)
        cgroup_headroom = windows.by_labels(history.series(CGROUP_MEMORY_HEADROOM.name),
                                            *common.PROCESS_LABELS)
        gpu_free: dict[tuple[str, ...], float | None] = {}
        findings = []
        for key in now_held:   # in process order, worked out anew or not
            _, trend = trends[key]
            if trend.load is None:
                continue
            host_headroom = _tighter(host_available, None if key not in cgroup_headroom
                                     else windows.latest(cgroup_headroom[key], now))
            for growing in trend.growing:
                series, recent = now_held[key][growing.resource]
                headroom = host_headroom
                if growing.resource == "gpu_memory":
                    uuids = tuple(s.labels["uuid"] for s in series if windows.latest(s, now) is not None)
                    if uuids not in gpu_free:
                        gpu_free[uuids] = self._gpu_free(history, uuids, now)
                    headroom = gpu_free[uuids]
                held = self._was_firing(key[0], growing.resource, now)
                judged = self._judge(key[0], growing, _mean_of_sum(recent), headroom, trend.load, held)
                if judged is not None:
                    findings.append(judged)
        return findings

    def _glance(self, times, values) -> tuple[float, float | None, bool] | None:
        """The memory's mean over the window, the threshold its slope must reach where that rules
        it out, and whether _with_slopes is to work out its Theil-Sen slope in numpy; None where
        _judge surely returns None, whatever the load: too short a window, no memory, or a slope
        below the threshold (either way to fire needs slope x 3600 >= threshold: the load's part
        is never negative). Flat memory is ruled out at a glance; a long window's slope is left
        to _with_slopes (numpy, every process's at once), a short one's pairs are counted here."""
        config = self.config
        if len(times) < 2 or times[-1] - times[0] < config.min_window_seconds:
            return None
        mean = sum(values) / len(values)
        if mean <= 0:
            return None
        # the level a finding already firing holds down to: below it nothing can fire or hold
        level = config.resolve_share * min(mean * config.growth_per_hour_share, config.growth_bytes_per_hour)
        if config.load_following_factor < 0:
            return mean, None, False   # a falling load adds to the growth: no slope rules it out
        in_numpy = min(len(times), windows.LONG_TREND_POINTS) >= windows.NUMPY_PAIRS_FROM
        if surely_below(times, values, level / 3600, count_pairs=not in_numpy):
            return None
        return mean, level, in_numpy

    def _with_slopes(self, growing: list, end: float) -> list:
        """`growing` (key, since, candidates with their glance (mean, threshold, in_numpy)) with
        each candidate made a Growing: the long windows' slopes worked out together
        (windows.theil_sen_slopes, the floats theil_sen_slope gives one by one), the short ones
        one by one; a candidate whose slope is not positive or falls below its threshold dropped,
        and a process left with none dropped."""
        long_windows = [(candidate[2], candidate[3]) for _, _, candidates in growing
                        for candidate in candidates if candidate[-1]]
        slopes = iter(windows.theil_sen_slopes(long_windows, windows.LONG_TREND_POINTS)
                      if long_windows else ())
        kept = []
        for key, since, candidates in growing:
            judged = []
            for resource, label_name, times, values, mean, threshold, in_numpy in candidates:
                if in_numpy:
                    slope = next(slopes)
                    if slope is None or slope * 3600 < threshold:
                        continue
                else:
                    slope = windows.theil_sen_slope(times, values, windows.LONG_TREND_POINTS)
                if slope is None or slope <= 0:
                    continue
                # the recent part of the window and its newer half: their least-squares slopes
                recent, newest = (self._tail_slope(times, values, seconds) for seconds in
                                  (self.config.recent_seconds, self.config.recent_seconds / 2))
                # what its own scatter leaves unknown of its rise, over the halves of either
                # window the load's rise may be judged over
                noise = tuple((seconds, rise_noise_per_hour(times, values, end, seconds,
                                                            self.config.rise_noise_z))
                              for seconds in self.loads.windows_seconds)
                judged.append(Growing(resource, label_name, mean, slope, times[-1] - times[0],
                                      recent, newest, noise))
            if judged:
                kept.append((key, since, judged))
        return kept

    @staticmethod
    def _tail_slope(times, values, seconds: float) -> float:
        """The least-squares slope of the window's last `seconds`, as PromQL's deriv() over them
        (0 where it cannot be told: fewer than two points)."""
        first = bisect_left(times, times[-1] - seconds)
        ts, vs = times[first:], values[first:]
        if len(ts) < 2:
            return 0.0
        mean_t, mean_v = sum(ts) / len(ts), sum(vs) / len(vs)
        spread = sum((t - mean_t) ** 2 for t in ts)
        return 0.0 if spread <= 0 else sum((t - mean_t) * (v - mean_v) for t, v in zip(ts, vs)) / spread

    def _judge(self, pid: str, growing: Growing, current: float, headroom: float | None,
               load: Load, held: bool = False) -> Finding | None:
        """The finding for one resource of a process that may grow, or None; `held`: it fired
        at the last evaluation, so it holds down to resolve_share of the threshold."""
        config = self.config
        mean, slope = growing.mean, growing.slope
        threshold = min(mean * config.growth_per_hour_share, config.growth_bytes_per_hour)
        hold_level = threshold * config.resolve_share
        noise = growing.noise_over(load.window_seconds)
        if load.rise_per_hour is None or noise is None or growing.recent_slope * 3600 < hold_level:
            return None   # the load's rise not yet known, or the recent part no longer grows
        # the growth beyond what its own scatter leaves unknown, less the part of its load's rise
        # beyond the load's noise: memory that follows its load scatters with it, so only a rise
        # that stands out of both noises counts on either side
        unexplained = (slope * 3600 - noise
                       - mean * (load.confident_rise_per_hour or 0.0) * config.load_following_factor)

        def growth_at(level: float) -> float | None:
            if unexplained >= level:
                return unexplained
            return slope * 3600 if load.faults_rising and slope * 3600 >= level else None
        # as the rule's `or`: a new finding at the threshold, one already firing down to hold_level
        value = growth_at(threshold) if growing.newest_slope * 3600 >= hold_level else None
        if value is None and held:
            value = growth_at(hold_level)
        if value is None:
            return None
        forecast = None if headroom is None else max(headroom, 0.0) / slope
        details: dict[str, float | str] = {
            "slope_bytes_per_second": slope,
            "unexplained_bytes_per_hour": unexplained,
            "memory_noise_bytes_per_hour": noise,
            "mean_bytes": mean,
            "current_bytes": current,
            "growth_share_per_hour": slope * 3600 / mean,
            "load_rise_share_per_hour": load.rise_per_hour,
            "window_seconds": growing.window_seconds,
            "load_source": load.source,
            "faults_per_work_rising": "yes" if load.faults_rising else "no",
            "recent_slope_bytes_per_second": growing.recent_slope,
            "newest_slope_bytes_per_second": growing.newest_slope,
            "exhaustion_horizon_seconds": config.exhaustion_horizon_seconds,
        }
        details = {key: value for key, value in details.items() if value is not None}
        for what, rise in load.rises:
            details[f"load_{what}_rise_share_per_hour"] = rise
        if forecast is not None:
            details["forecast_seconds_to_exhaustion"] = forecast
            details["exhaustion_headroom_bytes"] = headroom
        return finding(
            self.alerts[growing.resource], {"pid": pid, "process_name": growing.label_name}, value,
            threshold, unit="B/h",
            values={"per_hour": slope * 3600, "mean": mean, "current": current,
                    "load_rise": load.rise_per_hour, "exhaustion": forecast,
                    "recent": growing.recent_slope * 3600,
                    "cpu": load.cpu_seconds_per_second, "tokens": load.tokens_per_second,
                    "running": load.requests_running},
            details=details)

    def _gpu_free(self, history: HistoryReader, uuids: tuple[str, ...], now: float) -> float | None:
        """Memory no process holds on the GPUs the process holds memory on now (`uuids`): total -
        used - reserved (nvmlMemory_v2_t: free is what is neither reserved nor allocated; without
        v2 the used figure already holds the reserved part and no reserved series exists)."""
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


def _last_minute(series: list[SeriesHistory], now: float, since: float | None) -> list[SeriesHistory]:
    """The series' points of the last minute (since the restart); none where no series has any."""
    cut = [SeriesHistory(one.name, one.labels,
                         *windows.window_since(one, now, windows.AVERAGE_SECONDS, since))
           for one in series]
    return cut if any(len(one.times) for one in cut) else []


def _mean_of_sum(series: list[SeriesHistory]) -> float:
    """The mean of the series summed time by time (a single one as it is)."""
    values = series[0].values if len(series) == 1 else windows.summed(series)[1]
    return sum(values) / len(values)


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
    group=groups.PROCESS,
    detector=Detector,
    alerts=lambda t: tuple(alerts(t.memory_growth)),
    collectors=(),
    lookback_seconds=lambda settings: settings.window_seconds,
    view_seconds=lambda settings: 0.0,   # the latest figures: its headroom and its servers' tree
    scenario="memory_growth",
)
