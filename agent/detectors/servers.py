"""The inference servers in history (the series of exporters/inference.py): which
are scraped now, which process each belongs to, and their load and latency over a window.

A server is one (server, endpoint, model, pid) label set: `pid` is the watched process listening
on the endpoint's port, "" when none is known.
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridmon.agent.detectors.base import HistoryReader
from hybridmon.agent.detectors import windows
from hybridmon.agent.loop.history import SeriesHistory
from hybridmon.exporters.process import INFO
from hybridmon.exporters.inference_names import BY_FIELD, HISTOGRAM_SPECS
from hybridmon.exporters.inference_names import OFFLOAD_BYTES as OFFLOAD_BYTES_SPEC
from hybridmon.exporters.inference_names import SCRAPE_ERROR as SCRAPE_ERROR_SPEC
from hybridmon.exporters.inference_names import SCRAPE_SUCCESS as SCRAPE_SUCCESS_SPEC

GENERATED_TOKENS = BY_FIELD["generated_tokens"].name
REQUESTS_RUNNING = BY_FIELD["requests_running"].name
KV_CACHE_USAGE = BY_FIELD["kv_cache_usage_ratio"].name
PREEMPTIONS = BY_FIELD["preemptions"].name
OFFLOAD_BYTES = OFFLOAD_BYTES_SPEC.name   # label direction: store | load
INTER_TOKEN_LATENCY_P, INTER_TOKEN_LATENCY_SUM, INTER_TOKEN_LATENCY_COUNT = (
    spec.name for spec in HISTOGRAM_SPECS["inter_token_latency"])
TIME_TO_FIRST_TOKEN_P = HISTOGRAM_SPECS["time_to_first_token"][0].name
SCRAPE_SUCCESS = SCRAPE_SUCCESS_SPEC.name
SCRAPE_ERROR = SCRAPE_ERROR_SPEC.name
SERVER_LABELS = ("server", "endpoint", "model", "pid")
# How each server calls itself, for the text of a finding.
DISPLAY_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "llamacpp": "llama.cpp", "tgi": "TGI",
                 "lmcache": "LMCache", "ollama": "Ollama"}
# Series that every server publishes one of: a server with none of them now is not scraped now.
PRESENCE = (GENERATED_TOKENS, REQUESTS_RUNNING, KV_CACHE_USAGE)


@dataclass(frozen=True)
class Server:
    server: str
    endpoint: str
    model: str
    pid: str

    @property
    def labels(self) -> dict[str, str]:
        """The labels its alerts carry: the pid is left out, as it changes on every restart."""
        return {"server": self.server, "endpoint": self.endpoint, "model": self.model}

    @property
    def name(self) -> str:
        """'vLLM (model llama-3-8b at http://127.0.0.1:8000/metrics)': which server, in words."""
        shown = DISPLAY_NAMES.get(self.server, self.server)
        model = f"model {self.model} at " if self.model else ""
        return f"{shown} ({model}{self.endpoint})"

    @property
    def short_name(self) -> str:
        return DISPLAY_NAMES.get(self.server, self.server)


def server_of(series: SeriesHistory) -> Server:
    return Server(*(series.labels.get(name, "") for name in SERVER_LABELS))


def scraped(history: HistoryReader, now: float) -> list[Server]:
    """Every server with a current point (at most a minute old) in one of the PRESENCE series."""
    found = set()
    for metric in PRESENCE:
        for series in history.series(metric):
            if windows.latest(series, now) is not None:
                found.add(server_of(series))
    return sorted(found, key=lambda s: (s.server, s.endpoint, s.model, s.pid))


def tree_roots(history: HistoryReader, now: float) -> dict[str, str]:
    """pid -> the root of its tree of watched processes (root_pid of hybridmon_process_info), as
    the process collector saw it last."""
    roots = {}
    for series in history.series(INFO.name):
        if windows.latest(series, now) is not None:
            roots[series.labels["pid"]] = series.labels["root_pid"]
    return roots


def tied_pids(pid: str, roots: dict[str, str]) -> set[str]:
    """The listening pids whose servers are tied to process `pid`: its own and every pid of the
    same process tree (vLLM V1's engine core is tied to its API server's /metrics;
    rules.process.tied_to_tree does the same in PromQL)."""
    if pid not in roots:
        return {pid}
    return {pid} | {other for other, root in roots.items() if root == roots[pid]}


def for_process(servers: list[Server], pid: str | None, tied: set[str] | None = None) -> list[Server]:
    """The servers a finding about process `pid` is about: those tied to it (listening at `pid`,
    or at a pid of `tied`: tied_pids(pid, tree_roots(...))); when no server is tied to any
    process (every pid label empty: the agent could not see who listens), all of them. None (a
    GPU or host finding): all of them."""
    if pid is None:
        return servers
    tied = [s for s in servers if s.pid == pid or s.pid in (tied or ())]
    if tied or any(s.pid for s in servers):
        return tied
    return servers


def series_of(history: HistoryReader, metric: str, server: Server, **labels: str) -> SeriesHistory | None:
    found = history.series(metric, server=server.server, endpoint=server.endpoint,
                           model=server.model, pid=server.pid, **labels)
    return found[0] if found else None


def mean(series: SeriesHistory | None, start: float, end: float) -> float | None:
    """Mean of a gauge's points in [start, end]; None without any."""
    if series is None:
        return None
    _, values = windows.window(series, end, end - start)
    return sum(values) / len(values) if values else None


def mean_rate(series: SeriesHistory | None, start: float, end: float) -> float | None:
    """A counter's increase per second over the points in [start, end] (resets handled): what it
    did while it was seen, where rate() would count the unseen part of the window as zero. None
    with fewer than two points."""
    if series is None:
        return None
    times, values = windows.window(series, end, end - start)
    if len(values) < 2 or times[-1] <= times[0]:
        return None
    return windows.counter_increase(values) / (times[-1] - times[0])


def rate(series: SeriesHistory | None, now: float, seconds: float) -> float | None:
    """PromQL's rate(x[seconds]) at now (windows.rate), for the findings a rule mirrors."""
    return None if series is None else windows.rate(series, now, seconds)


def summed_rate_steps(series: list[SeriesHistory], start: float, end: float
                      ) -> tuple[list[float], list[float]]:
    """rate(x[1m]) every minute from end back to start, summed over `series` at each step."""
    totals: dict[float, float] = {}
    for one in series:
        for time, value in zip(*windows.rate_steps(one, start, end)):
            totals[time] = totals.get(time, 0.0) + value
    times = sorted(totals)
    return times, [totals[t] for t in times]


def summed_average_steps(series: list[SeriesHistory], start: float, end: float
                         ) -> tuple[list[float], list[float]]:
    """avg_over_time(x[1m]) every minute from end back to start, summed over `series`."""
    totals: dict[float, float] = {}
    steps = windows.step_times(start, end)
    for one in series:
        for at in steps:
            value = windows.avg_over_time(one, at)
            if value is not None:
                totals[at] = totals.get(at, 0.0) + value
    times = sorted(totals)
    return times, [totals[t] for t in times]


def human_latency(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.1f} s"
    if seconds >= 0.01:
        return f"{seconds * 1000:.0f} ms"
    return f"{seconds * 1000:.1f} ms"


def human_count(value: float) -> str:
    """1,450 / 61 / 6.2 / 0.35: a rate the way it is read aloud."""
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.0f}"
    if abs(value) >= 1:
        return f"{value:.1f}"
    return f"{value:.2f}"
