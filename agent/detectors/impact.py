"""The server-side impact of a host finding: what the inference servers' users felt while the PCIe
link starved or ran degraded, the host swapped, or a process sat on the wrong NUMA node.

The engine calls `correlate` with every finding and the time its condition began (the finding's
pending_since): for the CORRELATED alerts it adds the servers' figures over two windows, "before"
(the BEFORE_SECONDS before the condition began, ending a minute before it, as the condition is
judged on 1 min averages) and "now" (the last minute), as Finding.details keys and one sentence
that ends the description. A finding about one process (label pid) reads the servers tied to that
pid; a GPU finding (label gpu) reads the servers using that GPU: those whose process, or the
process at the root of its tree (vLLM's engine core and workers under the API server that
listens), holds memory on it by NVML's per-process list. When no server on the host can be tied to
any GPU that way, a GPU finding reads every server and its sentence says so. A host finding reads
every server scraped on the host. With no server to read the finding is returned unchanged.

Figures: generation tokens/s from the generated-tokens counter; inter-token latency and time to
first token p50 as the mean of the collector's per-scrape p50 gauges (llama.cpp publishes no
histogram: its mean inter-token latency instead); preemptions/s and KV offload load bytes/s (host
to GPU) over the last minute.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, TypeVar

from hybridmon.agent.detectors import servers, windows
from hybridmon.agent.detectors.base import Finding, HistoryReader, add_note
from hybridmon.agent.detectors.servers import Server
from hybridmon.exporters.gpu import PROCESS_MEMORY_USED
from hybridmon.units import human_duration, human_rate

CORRELATED = frozenset({"GpuPcieStarvation", "GpuPcieLinkDegraded", "HostSwapThrash",
                        "InferenceProcessNumaMisplaced"})
BEFORE_SECONDS = 600.0
NOW_SECONDS = windows.AVERAGE_SECONDS
# A figure within this share of its value before "held"; beyond it, it rose or fell.
STEADY_SHARE = 0.10
Figures = dict[str, float]
T = TypeVar("T")


def correlate(history: HistoryReader, finding: Finding, began: float, now: float) -> Finding:
    """`finding` with its server-side impact added, or unchanged (not a CORRELATED alert, no
    server scraped, no figure known)."""
    if finding.alertname not in CORRELATED:
        return finding
    chosen, untied = servers_concerned(history, finding, now)
    measured = [(server, measure(history, server, began, now)) for server in chosen]
    measured = [(server, figures) for server, figures in measured if server_parts(figures)]
    if not measured:
        return finding
    measured.sort(key=lambda item: -_hurt(item[1]))
    sentence = impact_sentence(measured, untied)
    details = dict(finding.details)
    first, figures = measured[0]
    details.update(server=first.server, server_endpoint=first.endpoint, server_model=first.model)
    details.update({f"server_{key}": value for key, value in figures.items()})
    details["server_impact"] = sentence
    return add_note(replace(finding, details=details), sentence)


def servers_concerned(history: HistoryReader, finding: Finding, now: float) -> tuple[list[Server], bool]:
    """The servers whose figures belong with `finding`, and whether they are every server of the
    host only because none could be tied to a GPU (the sentence then says so)."""
    scraped = _per_evaluation(history, ("scraped servers", now), lambda: servers.scraped(history, now))
    pid, gpu = finding.labels.get("pid"), finding.labels.get("gpu")
    if pid is not None or gpu is None:
        return servers.for_process(scraped, pid), False
    by_gpu = _per_evaluation(history, ("servers by gpu", now), lambda: servers_by_gpu(history, scraped, now))
    if not any(by_gpu.values()):
        return scraped, bool(scraped)
    uuid = finding.labels.get("uuid")
    return sorted({server for (index, gpu_uuid), tied in by_gpu.items() for server in tied
                   if index == gpu and uuid in (None, gpu_uuid)},
                  key=lambda s: (s.server, s.endpoint, s.model, s.pid)), False


def _per_evaluation(history: HistoryReader, key: tuple, work: Callable[[], T]) -> T:
    """`work()` once per evaluation where `history` is the engine's view of one (its shared()):
    each correlated finding of an evaluation asks for the same servers. Read straight from a
    History, which changes between calls, it is worked out each time."""
    shared = getattr(history, "shared", None)
    return work() if shared is None else shared(key, work)


def servers_by_gpu(history: HistoryReader, scraped: list[Server], now: float
                   ) -> dict[tuple[str, str], set[Server]]:
    """(gpu, uuid) -> the scraped servers using it: a server uses a GPU when the process it is tied
    to (its pid label), or a process in that process's tree (same root_pid of
    hybridmon_process_info: servers.tree_roots), holds memory on it now (NVML's per-process memory). vLLM's
    API server, which listens, holds no GPU memory; its engine core child does."""
    roots = servers.tree_roots(history, now)
    by_pid: dict[str, list[Server]] = {}
    for server in scraped:
        if server.pid:
            by_pid.setdefault(server.pid, []).append(server)
    # the servers tied to any process of each tree, gathered once (not per process: quadratic)
    by_root: dict[str, set[Server]] = {}
    for other, root in roots.items():
        by_root.setdefault(root, set()).update(by_pid.get(other, ()))
    tied: dict[tuple[str, str], set[Server]] = {}
    for series in history.series(PROCESS_MEMORY_USED.name):
        if windows.latest(series, now) is None:
            continue
        pid = series.labels["pid"]
        key = (series.labels.get("gpu", ""), series.labels.get("uuid", ""))
        found = tied.setdefault(key, set())
        for candidate in {pid, roots.get(pid, pid)}:
            found.update(by_pid.get(candidate, ()))
        # a server tied to the root of this process's tree: the process is one of its children
        if pid in roots:
            found.update(by_root[roots[pid]])
    return tied


def measure(history: HistoryReader, server: Server, began: float, now: float) -> Figures:
    """The server's figures before the condition began and now; keys as in Finding.details, less
    the `server_` prefix. Figures the server does not publish are left out."""
    before = (began - NOW_SECONDS - BEFORE_SECONDS, began - NOW_SECONDS)
    recent = (now - NOW_SECONDS, now)
    figures: Figures = {}

    def put(key: str, reader: Callable[[float, float], float | None]) -> None:
        for suffix, (start, end) in (("_before", before), ("_after", recent)):
            value = reader(start, end)
            if value is not None:
                figures[key + suffix] = value

    def series(metric: str, **labels: str):
        return servers.series_of(history, metric, server, **labels)

    tokens = series(servers.GENERATED_TOKENS)
    put("generation_tokens_per_second", lambda a, b: servers.mean_rate(tokens, a, b))
    inter_token = series(servers.INTER_TOKEN_LATENCY_P, percentile="p50")
    if inter_token is not None:
        put("inter_token_latency_p50_seconds", lambda a, b: servers.mean(inter_token, a, b))
    else:
        total, count = series(servers.INTER_TOKEN_LATENCY_SUM), series(servers.INTER_TOKEN_LATENCY_COUNT)

        def mean_latency(a: float, b: float) -> float | None:
            seconds, observed = servers.mean_rate(total, a, b), servers.mean_rate(count, a, b)
            return seconds / observed if seconds is not None and observed else None
        put("inter_token_latency_mean_seconds", mean_latency)
    first_token = series(servers.TIME_TO_FIRST_TOKEN_P, percentile="p50")
    put("time_to_first_token_p50_seconds", lambda a, b: servers.mean(first_token, a, b))
    for key, found in (("preemptions_per_second", series(servers.PREEMPTIONS)),
                       ("kv_offload_load_bytes_per_second",
                        series(servers.OFFLOAD_BYTES, direction="load"))):
        value = servers.mean_rate(found, *recent)
        if value is not None:
            figures[key] = value
    return figures


def _hurt(figures: Figures) -> float:
    """How much worse the server got: the largest of its latency rise and generation fall ratios."""
    worst = 1.0
    for key in ("inter_token_latency_p50_seconds", "inter_token_latency_mean_seconds",
                "time_to_first_token_p50_seconds"):
        before, after = figures.get(key + "_before"), figures.get(key + "_after")
        if before and after is not None:
            worst = max(worst, after / before)
    before = figures.get("generation_tokens_per_second_before")
    after = figures.get("generation_tokens_per_second_after")
    if before and after:
        worst = max(worst, before / after)
    return worst


def _latency(value: float) -> tuple[str, str]:
    return servers.human_latency(value), ""


def _tokens(value: float) -> tuple[str, str]:
    return servers.human_count(value), " tokens/s"


def change(what: str, before: float | None, after: float | None,
           fmt: Callable[[float], tuple[str, str]]) -> str | None:
    """'inter-token latency p50 rose from 38 ms to 210 ms', 'generation fell from 1,450 to 610
    tokens/s', '... held at 40 ms'; 'was 210 ms' without a figure before."""
    if after is None:
        return None
    now_text, unit = fmt(after)
    if before is None:
        return f"{what} was {now_text}{unit}"
    before_text, _ = fmt(before)
    if before > 0 and abs(after - before) <= STEADY_SHARE * before:
        return f"{what} held at {now_text}{unit}"
    verb = "rose" if after > before else "fell"
    return f"{what} {verb} from {before_text} to {now_text}{unit}"


def server_parts(figures: Figures) -> list[str]:
    parts = []
    for what, key, fmt in (
            ("inter-token latency p50", "inter_token_latency_p50_seconds", _latency),
            ("mean inter-token latency", "inter_token_latency_mean_seconds", _latency),
            ("time to first token p50", "time_to_first_token_p50_seconds", _latency),
            ("generation", "generation_tokens_per_second", _tokens)):
        text = change(what, figures.get(key + "_before"), figures.get(key + "_after"), fmt)
        if text:
            parts.append(text)
    preemptions = figures.get("preemptions_per_second")
    if preemptions:
        parts.append(f"{servers.human_count(preemptions)} requests preempted per second")
    loads = figures.get("kv_offload_load_bytes_per_second")
    if loads:
        parts.append(f"KV offload loads ran at {human_rate(loads)}")
    return parts


def impact_sentence(measured: list[tuple[Server, Figures]], untied: bool = False) -> str:
    """One sentence over every server: 'Server side, the 10 min before this began against the last
    minute: vLLM (model m at http://...): inter-token latency p50 rose from 38 ms to 210 ms, ...'.
    `untied`: the servers are every one on the host because none could be tied to a GPU."""
    clauses = [f"{server.name}: {', '.join(parts)}"
               for server, figures in measured if (parts := server_parts(figures))]
    window = human_duration(BEFORE_SECONDS)
    scope = (" (every server on the host: none could be tied to a GPU through the processes "
             "holding GPU memory)") if untied else ""
    return (f"Server side{scope}, the {window} before this began against the last minute: "
            + "; ".join(clauses) + ".")
