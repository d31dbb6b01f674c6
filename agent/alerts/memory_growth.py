"""InferenceProcessMemoryGrowth: a watched process whose memory grows steadily while its load does
not (incident 3's stale pointers to offloaded KV blocks). One rule per kind of memory (label
resource: gpu_memory, resident, locked). Runbook: InferenceProcessMemoryGrowth.md.

The load is the process's inference server where one is tied to its pid (generation tokens/s and
running requests), else its CPU time: a GPU-bound server's CPU barely follows its traffic. Growth
also counts when the page faults per CPU second climb, whatever the load does.

Slopes are robust to a single jump (a model or adapter load): the agent takes a Theil-Sen slope,
the rule rules.promql.robust_slope (the median of local least-squares slopes), which agree on
steady growth. The recordings the rules read (slopes, the load, the exhaustion forecast) are the
process group's, in rules/process.py.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import common, servers, windows
from hybridmon.agent.detectors.base import Finding
from hybridmon.agent.history import History, SeriesHistory
from hybridmon.exporters.base import MetricSpec
from hybridmon.exporters.gpu import MEMORY_TOTAL as GPU_MEMORY_TOTAL
from hybridmon.exporters.gpu import PROCESS_MEMORY_USED
from hybridmon.exporters.host_memory import MEMORY_TOTAL
from hybridmon.exporters.inference_names import BY_FIELD as SERVER_SERIES
from hybridmon.exporters.process import CPU_SECONDS, LOCKED, MAJOR_FAULTS, MINOR_FAULTS, PINNED, RESIDENT
from hybridmon.rules import process as recorded
from hybridmon.rules.case_inputs import LLAMA, SGLANG, VLLM, on_gpu
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import data_spans, duration, number, query
from hybridmon.rules.promtool_cases import GIB, GPU0, Catalog, Test
from hybridmon.rules.templates import humanize_percentage

GENERATED_TOKENS = SERVER_SERIES["generated_tokens"]
REQUESTS_RUNNING = SERVER_SERIES["requests_running"]
INPUTS = (PROCESS_MEMORY_USED, RESIDENT, LOCKED, PINNED, CPU_SECONDS, MINOR_FAULTS, MAJOR_FAULTS,
          GENERATED_TOKENS, REQUESTS_RUNNING, GPU_MEMORY_TOTAL, MEMORY_TOTAL)


class Settings(Section):
    window_seconds: float
    min_window_seconds: float
    growth_per_hour_share: float
    load_flat_per_hour_share: float
    exhaustion_horizon_seconds: float


@dataclass(frozen=True)
class Resource:
    """One kind of memory the family watches, as its rule and its text name it."""

    label: str          # the alert's resource label
    gauge: MetricSpec   # the raw gauge: its oldest sample in the window says the window is filled
    short: str          # for the summary
    what: str           # for the description
    limit: str          # what it runs out of


RESOURCES = (
    Resource("gpu_memory", PROCESS_MEMORY_USED, "GPU memory", "GPU memory (NVML, summed over its GPUs)",
             "the memory total of its GPUs"),
    Resource("resident", RESIDENT, "resident memory", "resident host memory (VmRSS)", "the host's MemTotal"),
    Resource("locked", LOCKED, "locked memory", "locked host memory (VmLck)", "the host's MemTotal"),
)


def alerts(g: Settings) -> list[Alert]:
    window = duration(g.window_seconds)
    load, faults = recorded.load_slope(window), recorded.fault_slope(window)
    tokens_slope, running_slope = recorded.server_slopes(window)
    flat = number(g.load_flat_per_hour_share)
    recordings = {r.label: r for r in recorded.resources()}   # its slope, amount and forecast
    rules = []
    for resource in RESOURCES:
        shared = recordings[resource.label]
        slope = shared.slope(window)
        expr = (
            "# bytes/s, at least the share of the current amount per hour\n"
            f"{slope} >= {shared.current} * {number(g.growth_per_hour_share)} / 3600\n"
            f"and {slope} > 0\n"
            "# with data reaching back at least min_window_seconds\n"
            "and on (job, instance, pid)\n"
            f"{data_spans(resource.gauge.name, g.window_seconds, g.min_window_seconds)}\n"
            "# while the load stays flat: its inference server's tokens/s and running requests...\n"
            "and on (job, instance, pid)\n"
            "(\n"
            f"    {tokens_slope} * 3600 <= {recorded.SERVER_TOKENS} * {flat}\n"
            f"    unless on (job, instance, pid) {running_slope} * 3600 > {recorded.SERVER_RUNNING} * {flat}\n"
            "  or\n"
            "    # ...or, with no server tied to the process, its CPU load...\n"
            f"    {load} * 3600 <= {recorded.CPU} * {flat}\n"
            f"    unless on (job, instance, pid) {recorded.SERVER_TOKENS}\n"
            "  or\n"
            "    # ...or the page faults per CPU second grow\n"
            f"    {faults} * 3600 >= avg_over_time({recorded.FAULTS_PER_CPU}[{window}]) * {number(g.growth_per_hour_share)}\n"
            f"    and {faults} > 0\n"
            ")"
        )
        rules.append(Alert(
            "InferenceProcessMemoryGrowth", expr, 0, "warning",
            f"<process_name> (pid <pid>) on <instance>: {resource.short} grows "
            "<per_hour|humanize1024>B per hour without more load",
            f"The {resource.what} of watched process <process_name> (pid <pid>) grew steadily at "
            "<value|humanize1024>B/s (<per_hour|humanize1024>B per hour over the last "
            f"{window}, a slope that ignores a single jump: Theil-Sen in the agent, the median of "
            f"the local slopes in Prometheus; threshold {humanize_percentage(g.growth_per_hour_share)} "
            "of the current <current|humanize1024>B per hour) while its load stayed flat (within "
            f"{humanize_percentage(g.load_flat_per_hour_share)} per hour: its inference server's "
            "generation tokens/s and running requests where a server is tied to it, else its CPU "
            "time) or its page faults per CPU second kept rising. Its load over the last "
            f"{window} averaged <cpu|humanize> CPU seconds per second and, on the inference server "
            "tied to it (unknown where none is), <tokens|humanize> generation tokens/s with "
            "<running|humanize> running requests. "
            f"At this rate it reaches {resource.limit} in <exhaustion|humanizeDuration> (the "
            f"warning horizon is {duration(g.exhaustion_horizon_seconds)}): if the growth is a "
            "leak, plan a restart before then. Memory that grows without more work is being held, "
            "not reused: a leak, a cache without a bound, or references kept to KV blocks that were "
            "offloaded or freed, which ends in swapping, stalls or an OOM kill. From outside the "
            "process this shows the growth, not its cause: compare with the server's own KV cache "
            "usage metrics; the runbook says where else to look.",
            labels={"resource": resource.label},
            queries={
                "per_hour": query("{} * 3600", slope, "pid"),
                "current": query("{}", shared.current, "pid"),
                "exhaustion": query("{}", shared.exhaustion(), "pid"),
                "cpu": query(f"avg_over_time({{}}[{window}])", recorded.CPU, "pid"),
                "tokens": query(f"avg_over_time({{}}[{window}])", recorded.SERVER_TOKENS, "pid"),
                "running": query(f"avg_over_time({{}}[{window}])", recorded.SERVER_RUNNING, "pid"),
            },
        ))
    return rules


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
    requests_running: float | None = None     # mean over the window
    requests_slope_per_hour: float | None = None
    cpu_seconds_per_second: float | None = None   # mean over the window, whichever load is judged


def _flat(times: list[float], values: list[float], share: float) -> tuple[bool, float | None, float]:
    """(flat, slope per hour, mean): flat unless the slope x 3600 reaches share x the mean."""
    slope = _slope_per_hour(times, values)
    mean = sum(values) / len(values)
    return slope is not None and (slope <= 0 or slope < share * mean), slope, mean


def _slope_per_hour(times: list[float], values: list[float]) -> float | None:
    slope = windows.theil_sen_slope(times, values, windows.LONG_TREND_POINTS)
    return None if slope is None else slope * 3600


class Detector:
    """InferenceProcessMemoryGrowth, per watched process and resource (gpu_memory: NVML's
    per-process GPU memory summed over its GPUs; resident: VmRSS; locked: VmLck + VmPin).

    Over the last window_seconds since the process (re)started, with at least min_window_seconds
    between its first and last point: the Theil-Sen slope x 3600 >= growth_per_hour_share x the
    current value (avg 1m), and either the load is flat or its page faults per CPU second (minor
    + major) rise by at least growth_per_hour_share of their mean per hour. The load is the
    process's inference server when one is tied to its pid (label pid of its series): flat when
    neither its generation tokens/s nor its running requests (per minute, summed over its
    servers) rise by load_flat_per_hour_share of their mean per hour (Theil-Sen slope); else its
    CPU seconds per second, judged the same way. Without CPU figures for the process (not
    visible in this PID namespace) nothing is reported. The forecast is the time until the
    process alone reaches the memory total of its GPUs (gpu_memory) or the host's MemTotal (host
    resources), as the brief defines it; the horizon (exhaustion_horizon_seconds) is reported,
    not a condition, since the alert table's condition does not include it."""

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
        host_total = self._host_total(history, now)
        # NVML's per-process memory is keyed by pid alone: judge it once, with the process that
        # was seen last under that pid (a pid whose comm changed has two CPU series).
        newest = {}
        for key in sorted(cpu, key=lambda k: cpu[k].times[-1] if cpu[k].times else 0.0):
            newest[key[0]] = key
        findings = []
        for key in sorted(cpu, key=common.process_order):
            pid, process_name = key
            since = common.process_restart_time(history, pid, process_name, now)
            load = self._load(history, key, cpu[key], now, since)
            if load is None or not (load.flat or load.faults_rising):
                continue
            candidates: list[tuple[str, str, list[float], list[float], float | None]] = []
            if key in resident:
                times, values = windows.window_since(resident[key], now, self.config.window_seconds,
                                                     since)
                candidates.append(("resident", process_name, times, values, host_total))
            if key in locked:
                times, values = _summed_window(locked[key], now, self.config.window_seconds, since)
                candidates.append(("locked", process_name, times, values, host_total))
            if (pid,) in gpu_memory and newest[pid] == key:
                series = gpu_memory[(pid,)]
                times, values = _summed_window(series, now, self.config.window_seconds, since)
                candidates.append(("gpu_memory", series[-1].labels["process_name"], times, values,
                                   self._gpu_total(history, series, now)))
            for resource, label_name, times, values, limit in candidates:
                judged = self._judge(pid, label_name, resource, times, values, limit, load, now)
                if judged is not None:
                    findings.append(judged)
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
            return replace(server, faults_rising=rising, fault_intensity_slope_per_hour=fault_slope,
                           cpu_seconds_per_second=mean)
        return _Load(mean, slope, flat, rising, fault_slope, cpu_seconds_per_second=mean)

    def _server_load(self, history: History, pid: str, start: float, now: float) -> _Load | None:
        """The load of the inference servers tied to `pid`: generation tokens/s and running
        requests, per minute, summed over its servers and models. None without such a server."""
        tokens = history.series(GENERATED_TOKENS.name, pid=pid)
        times, rates = servers.summed_rate_steps(tokens, start, now)
        if len(rates) < 2:
            return None
        share = self.config.load_flat_per_hour_share
        flat, slope, mean = _flat(times, rates, share)
        running_times, running = servers.summed_average_steps(
            history.series(REQUESTS_RUNNING.name, pid=pid), start, now)
        requests_mean = requests_slope = None
        if len(running) >= 2:
            requests_flat, requests_slope, requests_mean = _flat(running_times, running, share)
            flat = flat and requests_flat
        return _Load(mean, slope, flat, False, None, "server", requests_mean, requests_slope)

    def _fault_intensity(self, history: History, key: tuple[str, ...], cpu_rates: dict,
                         start: float, now: float) -> tuple[list[float], list[float]]:
        """Page faults (minor + major) per CPU second, minute by minute: a process that faults
        more for the same work is touching memory it did not touch before."""
        per_step: dict[float, float] = {}
        for metric in (MINOR_FAULTS.name, MAJOR_FAULTS.name):
            for series in history.series(metric, pid=key[0], process_name=key[1]):
                for time, value in zip(*windows.rate_steps(series, start, now)):
                    per_step[time] = per_step.get(time, 0.0) + value
        times = [t for t in sorted(per_step) if cpu_rates.get(t, 0) > 0]
        return times, [per_step[t] / cpu_rates[t] for t in times]

    def _judge(self, pid, process_name, resource, times, values, limit, load: _Load,
               now: float) -> Finding | None:
        config = self.config
        if len(times) < 2 or times[-1] - times[0] < config.min_window_seconds:
            return None
        recent = [v for t, v in zip(times, values) if t >= now - windows.AVERAGE_SECONDS]
        if not recent:
            return None
        current = sum(recent) / len(recent)
        slope = windows.theil_sen_slope(times, values, windows.LONG_TREND_POINTS)
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
        return finding(
            self.alerts[resource], {"pid": pid, "process_name": process_name}, slope,
            current * config.growth_per_hour_share / 3600, unit="B/s",
            values={"per_hour": slope * 3600, "current": current, "exhaustion": forecast,
                    "cpu": load.cpu_seconds_per_second,
                    "tokens": load.mean if load.source == "server" else None,
                    "running": load.requests_running},
            details=details)

    def _host_total(self, history: History, now: float) -> float | None:
        series = common.host_series(history, MEMORY_TOTAL.name)
        return windows.avg_over_time(series, now) if series else None

    def _gpu_total(self, history: History, series: list[SeriesHistory],
                   now: float) -> float | None:
        """Memory installed on the GPUs the process holds memory on now."""
        uuids = {s.labels["uuid"] for s in series if windows.latest(s, now) is not None}
        total = 0.0
        for uuid in uuids:
            found = common.host_series(history, GPU_MEMORY_TOTAL.name, uuid=uuid)
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


# --- promtool cases --------------------------------------------------------------------------

TGI = {"pid": "7171", "process_name": "text-generation"}


def _exact_enough(*seconds: float) -> bool:
    """humanizeDuration truncates to whole seconds: keep expected values off the boundaries."""
    return all(0.05 < s % 1 < 0.95 for s in seconds)


def _mean_rate(rate: float, share_per_hour: float, at: int, window_seconds: float) -> float:
    """avg_over_time(...[window]) at `at` of the 1 min rate of a counter sampled every minute
    whose rate grows linearly, rate x (1 + share x t/h): the rates are recorded from the first
    minute on, each the rate at the middle of its minute."""
    middles = [t - 30 for t in range(60, at + 1, 60) if t >= at - window_seconds]
    return sum(rate * (1 + share_per_hour * m / 3600) for m in middles) / len(middles)


def _growth_on_flat_load(t, catalog: Catalog) -> Test:
    """Every minute for min_window + 10 min; the window fills at min_window_seconds."""
    g = t.memory_growth
    rules = {r: catalog.find("InferenceProcessMemoryGrowth", resource=r)
             for r in ("gpu_memory", "resident", "locked")}
    at = int(g.min_window_seconds) + 300
    test = Test("memory growth: python3 (pid 4242) grows in GPU, resident and locked memory on a "
                "flat load; sglang (pid 6161) grows with its load but its faults per CPU second climb; "
                "llama-server (pid 5151) grows with its load and text-generation (pid 7171) jumps "
                "once: both stay silent", at + 300, catalog)
    test.interval = 60
    minutes = range(test.samples)
    per_hour = 2 * g.growth_per_hour_share       # twice the threshold, as a share of the start
    load_growth = 5 * g.load_flat_per_hour_share  # per hour, well past "flat"
    # Faults outgrow the load, so faults per CPU second rise (as the detector judges them).
    fault_growth = load_growth + 4 * g.growth_per_hour_share

    def linear(start: float, share_per_hour: float) -> list[float]:
        return [start * (1 + share_per_hour * m / 60) for m in minutes]

    def accumulated(rate: float, share_per_hour: float) -> list[float]:
        """A counter whose rate grows linearly: the integral of rate x (1 + share x t/h)."""
        return [rate * (m * 60 + share_per_hour * (m * 60) ** 2 / 7200) for m in minutes]

    starts = {"gpu_memory": 16 * GIB, "resident": 8 * GIB, "locked": 1 * GIB}
    extra = next(e for e in range(0, 10 ** 7, 4099) if _exact_enough(*(
        ((total + e) - starts[r] * (1 + per_hour * at / 3600)) / (starts[r] * per_hour / 3600)
        for r, total in (("gpu_memory", 24 * GIB), ("resident", 64 * GIB), ("locked", 64 * GIB)))))
    gpu_total, mem_total = 24 * GIB + extra, 64 * GIB + extra
    test.constant(MEMORY_TOTAL.name, mem_total)
    test.constant(GPU_MEMORY_TOTAL.name, gpu_total, **GPU0)
    on_gpu(test, GPU0, VLLM, linear(starts["gpu_memory"], per_hour))
    test.values(RESIDENT.name, linear(starts["resident"], per_hour), **VLLM)
    test.values(LOCKED.name, linear(starts["locked"], per_hour), **VLLM)
    test.values(CPU_SECONDS.name, [2.0 * 60 * m for m in minutes], **VLLM)
    test.values(MINOR_FAULTS.name, [100.0 * 60 * m for m in minutes], **VLLM)
    for proc, faults in ((SGLANG, fault_growth), (LLAMA, 0.0)):
        test.values(RESIDENT.name, linear(8 * GIB, per_hour), **proc)
        test.constant(LOCKED.name, 0, **proc)
        test.values(CPU_SECONDS.name, accumulated(1.0, load_growth), **proc)
        test.values(MINOR_FAULTS.name, accumulated(100.0, faults), **proc)
    # text-generation: one jump (an adapter loaded) on a flat load, then flat: not growth
    jump = int(g.min_window_seconds) // 60 - 5
    test.values(RESIDENT.name, [8 * GIB if m < jump else 12 * GIB for m in minutes], **TGI)
    test.constant(LOCKED.name, 0, **TGI)
    test.values(CPU_SECONDS.name, [2.0 * 60 * m for m in minutes], **TGI)
    test.values(MINOR_FAULTS.name, [100.0 * 60 * m for m in minutes], **TGI)
    for proc in (VLLM, SGLANG, LLAMA, TGI):
        test.constant(MAJOR_FAULTS.name, 0, **proc)

    def expected(rule_name: str, proc: dict, start: float, total: float, cpu: float) -> dict:
        slope = start * per_hour / 3600
        current = start * (1 + per_hour * at / 3600)
        return test.alert(rules[rule_name], proc, value=slope, per_hour=slope * 3600,
                          current=current, exhaustion=(total - current) / slope, cpu=cpu,
                          tokens=None, running=None)

    test.expect(int(g.min_window_seconds) - 300, "InferenceProcessMemoryGrowth")
    test.expect(at, "InferenceProcessMemoryGrowth",
                expected("gpu_memory", VLLM, starts["gpu_memory"], gpu_total, 2.0),
                expected("resident", VLLM, starts["resident"], mem_total, 2.0),
                expected("locked", VLLM, starts["locked"], mem_total, 2.0),
                expected("resident", SGLANG, 8 * GIB, mem_total, _mean_rate(1.0, load_growth, at, g.window_seconds)))
    return test


def _growth_against_server_load(t, catalog: Catalog) -> Test:
    """Where an inference server is tied to the process, its load is the one judged: python3 (pid
    4242) burns more CPU every hour but its vLLM server's tokens/s and running requests stay flat:
    it fires. llama-server (pid 5151) has a flat CPU but its server's tokens/s rise, and sglang
    (pid 6161) a flat CPU and tokens/s but more running requests: both silent."""
    g = t.memory_growth
    rule = catalog.find("InferenceProcessMemoryGrowth", resource="resident")
    at = int(g.min_window_seconds) + 300
    test = Test("memory growth against the inference server's load: tokens/s and running requests "
                "tied to the process by pid win over its CPU time", at + 300, catalog)
    test.interval = 60
    minutes = range(test.samples)
    per_hour, rising = 2 * g.growth_per_hour_share, 5 * g.load_flat_per_hour_share

    def accumulated(rate: float, share_per_hour: float) -> list[float]:
        return [rate * (m * 60 + share_per_hour * (m * 60) ** 2 / 7200) for m in minutes]

    def linear(start: float, share_per_hour: float) -> list[float]:
        return [start * (1 + share_per_hour * m / 60) for m in minutes]

    slope = 8 * GIB * per_hour / 3600
    current = 8 * GIB * (1 + per_hour * at / 3600)
    total = next(64 * GIB + e for e in range(0, 10 ** 7, 4099)
                 if _exact_enough((64 * GIB + e - current) / slope))
    test.constant(MEMORY_TOTAL.name, total)
    loads = {VLLM["pid"]: ("vllm", 0.0, 0.0, rising), LLAMA["pid"]: ("llamacpp", rising, 0.0, 0.0),
             SGLANG["pid"]: ("sglang", 0.0, rising, 0.0)}
    for proc in (VLLM, LLAMA, SGLANG):
        server, tokens_growth, running_growth, cpu_growth = loads[proc["pid"]]
        labels = {"server": server, "endpoint": f"http://127.0.0.1:{proc['pid']}/metrics",
                  "model": "", "pid": proc["pid"]}
        test.values(RESIDENT.name, linear(8 * GIB, per_hour), **proc)
        test.values(CPU_SECONDS.name, accumulated(2.0, cpu_growth), **proc)
        # page faults in step with the CPU time: their rate per CPU second stays flat
        test.values(MINOR_FAULTS.name, accumulated(200.0, cpu_growth), **proc)
        test.constant(MAJOR_FAULTS.name, 0, **proc)
        test.values(GENERATED_TOKENS.name, accumulated(1000.0, tokens_growth), **labels)
        test.values(REQUESTS_RUNNING.name, linear(8, running_growth), **labels)
    test.expect(at, "InferenceProcessMemoryGrowth", test.alert(
        rule, VLLM, value=slope, per_hour=slope * 3600, current=current,
        exhaustion=(total - current) / slope, cpu=_mean_rate(2.0, rising, at, g.window_seconds), tokens=1000,
        running=8))
    return test


def cases(t, catalog: Catalog) -> list[Test]:
    return [_growth_on_flat_load(t, catalog), _growth_against_server_load(t, catalog)]


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
