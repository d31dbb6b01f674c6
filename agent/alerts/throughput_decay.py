"""InferenceThroughputDecay: an inference server generating fewer tokens per second per running
request than it did earlier on this host, under the same load (incident 3 of the seed stories:
40 % fewer tokens/s after two hours, no crash, the same traffic), and the host signals that moved
with it. Runbook: InferenceThroughputDecay.md.

Both doors compare the same two windows of the same window (thresholds: `[throughput_decay]`): the
baseline is the earliest baseline_seconds of the last window_seconds, the recent figure the last
recent_seconds, each a counter rate as PromQL's rate() computes it over the mean running requests.
"""
from __future__ import annotations

from dataclasses import dataclass
from textwrap import dedent

from pydantic import model_validator

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import servers, windows
from hybridmon.agent.detectors.base import DetectorBase, Finding, HistoryReader, add_note
from hybridmon.agent.detectors.servers import Server
from hybridmon.exporters.gpu import MEMORY_USED, PCIE_THROUGHPUT, PROCESS_MEMORY_USED
from hybridmon.exporters.host_memory import SWAP_IN_BYTES
from hybridmon.exporters.inference_names import BY_FIELD
from hybridmon.exporters.pressure import STALLED_SECONDS
from hybridmon.exporters.process import MAJOR_FAULTS, RESIDENT, SWAP
from hybridmon.rules import groups
from hybridmon.rules.inference import SERVER, SERVER_NAME, per_request, running
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import duration, number, query
from hybridmon.rules.templates import humanize_percentage
from hybridmon.units import human_bytes, human_duration, human_rate, percent

GENERATED_TOKENS = BY_FIELD["generated_tokens"]
REQUESTS_RUNNING = BY_FIELD["requests_running"]
# The host signals the finding names when they moved with the decay.
INPUTS = (GENERATED_TOKENS, REQUESTS_RUNNING, RESIDENT, SWAP, MAJOR_FAULTS, PROCESS_MEMORY_USED,
          PCIE_THROUGHPUT, MEMORY_USED, STALLED_SECONDS, SWAP_IN_BYTES)
# A move smaller than this is noise whatever its share (a major fault rate going from 0.01 to
# 0.1/s is +900 %): per kind of signal, the smallest change worth naming.
MIN_MOVE = {"bytes": 64 * 2**20, "bytes_per_second": 100e6, "per_second": 1.0, "ratio": 0.02,
            "swap_bytes_per_second": 1 * 2**20}


class Settings(Section):
    decay_share: float
    window_seconds: float
    baseline_seconds: float
    recent_seconds: float
    min_requests_running: float
    load_kept_share: float
    host_signal_moved_share: float
    for_seconds: float

    @model_validator(mode="after")
    def _windows_apart(self) -> "Settings":
        if self.baseline_seconds + self.recent_seconds > self.window_seconds:
            raise ValueError("baseline_seconds + recent_seconds must fit in window_seconds: the "
                             "baseline and the recent window must not overlap")
        return self

    @property
    def baseline_offset_seconds(self) -> float:
        """How far back the baseline window ends: it is the earliest part of the long window."""
        return self.window_seconds - self.baseline_seconds


def _server(template: str, metric: str) -> tuple[str, tuple[str, ...]]:
    return query(template, metric, *SERVER)


def alert(d: Settings) -> Alert:
    offset = d.baseline_offset_seconds
    recent, baseline = per_request(d.recent_seconds), per_request(d.baseline_seconds, offset)
    since = f"{duration(d.window_seconds)} to {duration(offset)} ago"
    return Alert(
        "InferenceThroughputDecay",
        dedent(f"""\
            max without (pid) (
              # the share generation per running request lost against the baseline...
                1 - {recent} / {baseline} >= {number(d.decay_share)}
              # ...while the load did not fall
              and
                {running(d.recent_seconds)} >= {number(d.load_kept_share)} * {running(d.baseline_seconds, offset)}
            )"""),
        d.for_seconds, "warning",
        f"{SERVER_NAME} on <instance>: generation per running request fell <value|humanizePercentage> "
        "(<before|humanize> to <after|humanize> tokens/s) under the same load",
        f"{SERVER_NAME} generated <after|humanize> tokens/s per running request over the last "
        f"{duration(d.recent_seconds)} against <before|humanize> over {duration(d.baseline_seconds)} "
        f"from {since}: <value|humanizePercentage> slower (threshold {humanize_percentage(d.decay_share)}), "
        f"while it ran <running_now|humanize> requests on average (<running_then|humanize> then; its "
        f"load must not have fallen below {humanize_percentage(d.load_kept_share)} of that). Users wait "
        "longer for every answer without any error. A host that decays over hours is usually paging "
        "(KV cache or weights pushed to swap: vm.swappiness), leaking memory or moving more over PCIe "
        "for the same work: compare process memory and swap, major faults, PCIe traffic, GPU memory "
        f"and memory pressure over the last {duration(d.window_seconds)}; the agent's own finding "
        "names the ones that moved.",
        queries={
            "after": _server("max without (pid) ({})", recent),
            "before": _server("max without (pid) ({})", baseline),
            "running_now": _server("max without (pid) ({})", running(d.recent_seconds)),
            "running_then": _server("max without (pid) ({})", running(d.baseline_seconds, offset)),
        },
    )


@dataclass(frozen=True)
class Signal:
    """One host signal over the baseline and recent windows."""

    key: str            # details key stem: host_<key>_before / _after
    what: str           # in words
    kind: str           # a MIN_MOVE key, also how it is printed
    before: float
    after: float

    def text(self) -> str:
        def show(value: float) -> str:
            if self.kind == "bytes":
                return human_bytes(value)
            if self.kind == "bytes_per_second":
                return human_rate(value)
            if self.kind == "swap_bytes_per_second":
                return f"{human_bytes(value)}/s"
            if self.kind == "ratio":
                return percent(value)
            return f"{servers.human_count(value)}/s"
        verb = "rose" if self.after > self.before else "fell"
        return f"{self.what} {verb} from {show(self.before)} to {show(self.after)}"


def host_sentence(moved: list[Signal]) -> str:
    """What the agent adds to the rule's text, which Prometheus cannot say: the host signals that
    moved with the decay (the rule's text ends by pointing here), or that none did."""
    if moved:
        return "Over the same two windows on the host, " + "; ".join(s.text() for s in moved) + "."
    return ("No host signal hybridmon watches moved with it (process memory, swap and faults, PCIe "
            "traffic, GPU memory, memory pressure): look inside the server (prompt and output "
            "lengths, sampling settings, scheduler, cache hit rate).")


class Detector(DetectorBase):
    """InferenceThroughputDecay, per server (labels server, endpoint, model), warning.

    Per request: generated tokens/s (rate of the counter, as PromQL's rate() computes it) divided
    by the mean running requests, over the baseline window (baseline_seconds, ending
    window_seconds - baseline_seconds ago: the earliest part of the long window) and over the
    recent window (the last recent_seconds). Fires when 1 - recent / baseline >= decay_share,
    with both windows' running requests at least min_requests_running and the recent one at
    least load_kept_share of the baseline's (the load did not fall). The finding names the host
    signals that moved between the same two windows by host_signal_moved_share or more."""

    name = "throughput_decay"
    alertnames = ("InferenceThroughputDecay",)

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.alert = alert(config)
        self.min_history_seconds = config.window_seconds

    def windows(self, now: float) -> tuple[tuple[float, float], tuple[float, float]]:
        """(start, end) of the baseline and of the recent window."""
        c = self.config
        baseline_end = now - c.baseline_offset_seconds
        return (baseline_end - c.baseline_seconds, baseline_end), (now - c.recent_seconds, now)

    def evaluate(self, history: HistoryReader, now: float) -> list[Finding]:
        c = self.config
        findings = []
        for server in servers.scraped(history, now):
            tokens = servers.series_of(history, GENERATED_TOKENS.name, server)
            load = servers.series_of(history, REQUESTS_RUNNING.name, server)
            if tokens is None or load is None:
                continue
            baseline_end = now - c.baseline_offset_seconds
            rates = (servers.rate(tokens, baseline_end, c.baseline_seconds),
                     servers.rate(tokens, now, c.recent_seconds))
            loads = (windows.avg_over_time(load, baseline_end, c.baseline_seconds),
                     windows.avg_over_time(load, now, c.recent_seconds))
            if None in rates or None in loads or min(loads) < c.min_requests_running:  # type: ignore[operator]
                continue
            (rate_before, rate_after), (load_before, load_after) = rates, loads
            speeds = (rate_before / load_before, rate_after / load_after)  # type: ignore[operator]
            if speeds[0] <= 0 or load_after < c.load_kept_share * load_before:  # type: ignore[operator]
                continue
            decay = 1 - speeds[1] / speeds[0]
            if decay >= c.decay_share:
                moved = self.host_signals(history, server, now)
                findings.append(self._finding(server, decay, speeds, rates, loads, moved))
        return findings

    def host_signals(self, history: HistoryReader, server: Server, now: float) -> list[Signal]:
        """Host signals whose mean moved by at least host_signal_moved_share (and MIN_MOVE)
        between the baseline and the recent window: the server's process (if known), its GPUs
        (every GPU if the process is unknown), and the host's memory pressure and swap-in."""
        (b0, b1), (r0, r1) = self.windows(now)
        found: list[Signal] = []

        def judge(key: str, what: str, kind: str, before: float | None, after: float | None) -> None:
            if before is None or after is None:
                return
            change = abs(after - before)
            if change >= MIN_MOVE[kind] and change >= self.config.host_signal_moved_share * abs(before):
                found.append(Signal(key, what, kind, before, after))

        def gauge(key, what, kind, series) -> None:
            judge(key, what, kind, servers.mean(series, b0, b1), servers.mean(series, r0, r1))

        def counter(key, what, kind, series) -> None:
            judge(key, what, kind, servers.mean_rate(series, b0, b1), servers.mean_rate(series, r0, r1))

        gpus: set[tuple[str, str]] = set()
        if server.pid:
            for series in history.series(RESIDENT.name, pid=server.pid):
                process_name = series.labels.get("process_name", "")
                gauge("process_resident_bytes", f"{process_name} (pid {server.pid}) resident memory",
                      "bytes", series)
            for series in history.series(SWAP.name, pid=server.pid):
                gauge("process_swap_bytes", "its swap", "bytes", series)
            for series in history.series(MAJOR_FAULTS.name, pid=server.pid):
                counter("process_major_faults_per_second", "its major faults", "per_second", series)
            gpus = {(s.labels["gpu"], s.labels["uuid"])
                    for s in history.series(PROCESS_MEMORY_USED.name, pid=server.pid)
                    if windows.latest(s, now) is not None}
        for series in history.series(PCIE_THROUGHPUT.name):
            gpu = (series.labels.get("gpu", ""), series.labels.get("uuid", ""))
            if gpus and gpu not in gpus:
                continue
            direction = series.labels.get("direction", "")
            gauge(f"gpu{gpu[0]}_pcie_{direction}_bytes_per_second",
                  f"GPU {gpu[0]} PCIe {direction.replace('_', ' ')}", "bytes_per_second", series)
        for series in history.series(MEMORY_USED.name):
            gpu = (series.labels.get("gpu", ""), series.labels.get("uuid", ""))
            if not gpus or gpu in gpus:
                gauge(f"gpu{gpu[0]}_memory_used_bytes", f"GPU {gpu[0]} memory used", "bytes", series)
        for series in history.series(STALLED_SECONDS.name, resource="memory", scope="some"):
            counter("memory_pressure_some_ratio", "memory pressure (PSI some)", "ratio", series)
        for series in history.series(SWAP_IN_BYTES.name):
            counter("swap_in_bytes_per_second", "swap-in", "swap_bytes_per_second", series)
        return found

    def _finding(self, server: Server, decay: float, speeds, rates, loads,
                 moved: list[Signal]) -> Finding:
        c = self.config
        details: dict[str, float | str] = {
            "tokens_per_second_per_request_before": speeds[0],
            "tokens_per_second_per_request_after": speeds[1],
            "generation_tokens_per_second_before": rates[0],
            "generation_tokens_per_second_after": rates[1],
            "requests_running_before": loads[0],
            "requests_running_after": loads[1],
            "baseline_window": f"{human_duration(c.window_seconds)} to "
                               f"{human_duration(c.baseline_offset_seconds)} ago",
            "pid": server.pid,
        }
        for signal in moved:
            details[f"host_{signal.key}_before"] = signal.before
            details[f"host_{signal.key}_after"] = signal.after
        found = finding(
            self.alert, server.labels, decay, c.decay_share, unit="ratio",
            values={"before": speeds[0], "after": speeds[1],
                    "running_then": loads[0], "running_now": loads[1]},
            details=details)
        # The one thing the agent says beyond the rule's text (as impact.correlate adds the
        # servers' side to host findings): which host signals moved with the decay.
        return add_note(found, host_sentence(moved))


FAMILY = AlertFamily(
    section="throughput_decay",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group=groups.INFERENCE,
    detector=Detector,
    alerts=lambda t: (alert(t.throughput_decay),),
    collectors=("inference",),
    lookback_seconds=lambda settings: settings.window_seconds,
    scenario="throughput_decay",
)
