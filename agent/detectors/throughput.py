"""InferenceThroughputDecay: an inference server generating fewer tokens per second per running
request than it did earlier on this host, under the same load (incident 3 of the seed stories:
40 % fewer tokens/s after two hours, no crash, the same traffic), and the host signals that moved
with it.
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridmon.agent.detectors import common, servers, windows
from hybridmon.agent.detectors.base import Finding, ThroughputDecay
from hybridmon.agent.detectors.servers import Server
from hybridmon.agent.history import History

RESIDENT = "hybridmon_process_resident_bytes"
PROCESS_SWAP = "hybridmon_process_swap_bytes"
PROCESS_MAJOR_FAULTS = "hybridmon_process_major_faults_total"
GPU_PROCESS_MEMORY = "hybridmon_gpu_process_memory_used_bytes"
PCIE_THROUGHPUT = "hybridmon_gpu_pcie_throughput_bytes_per_second"
GPU_MEMORY_USED = "hybridmon_gpu_memory_used_bytes"
STALLED = "hybridmon_pressure_stalled_seconds_total"
SWAP_IN = "hybridmon_swap_in_bytes_total"
# A move smaller than this is noise whatever its share (a major fault rate going from 0.01 to
# 0.1/s is +900 %): per kind of signal, the smallest change worth naming.
MIN_MOVE = {"bytes": 64 * 2**20, "bytes_per_second": 100e6, "per_second": 1.0, "ratio": 0.02,
            "swap_bytes_per_second": 1 * 2**20}


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
                return common.human_bytes(value)
            if self.kind in ("bytes_per_second",):
                return common.human_rate(value)
            if self.kind == "swap_bytes_per_second":
                return f"{common.human_bytes(value)}/s"
            if self.kind == "ratio":
                return common.percent(value)
            return f"{servers.human_count(value)}/s"
        verb = "rose" if self.after > self.before else "fell"
        return f"{self.what} {verb} from {show(self.before)} to {show(self.after)}"


class ThroughputDecayDetector:
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

    def __init__(self, config: ThroughputDecay) -> None:
        self.config = config
        self.min_history_seconds = config.window_seconds

    def windows(self, now: float) -> tuple[tuple[float, float], tuple[float, float]]:
        """(start, end) of the baseline and of the recent window."""
        c = self.config
        baseline_end = now - c.baseline_offset_seconds
        return (baseline_end - c.baseline_seconds, baseline_end), (now - c.recent_seconds, now)

    def evaluate(self, history: History, now: float) -> list[Finding]:
        c = self.config
        findings = []
        for server in servers.scraped(history, now):
            tokens = servers.series_of(history, servers.GENERATED_TOKENS, server)
            running = servers.series_of(history, servers.REQUESTS_RUNNING, server)
            if tokens is None or running is None:
                continue
            baseline_end = now - c.baseline_offset_seconds
            rates = (servers.rate(tokens, baseline_end, c.baseline_seconds),
                     servers.rate(tokens, now, c.recent_seconds))
            loads = (windows.avg_over_time(running, baseline_end, c.baseline_seconds),
                     windows.avg_over_time(running, now, c.recent_seconds))
            if None in rates or None in loads or min(loads) < c.min_requests_running:  # type: ignore[operator]
                continue
            (rate_before, rate_after), (load_before, load_after) = rates, loads
            per_request = (rate_before / load_before, rate_after / load_after)  # type: ignore[operator]
            if per_request[0] <= 0 or load_after < c.load_kept_share * load_before:  # type: ignore[operator]
                continue
            decay = 1 - per_request[1] / per_request[0]
            if decay >= c.decay_share:
                moved = self.host_signals(history, server, now)
                findings.append(self._finding(server, decay, per_request, rates, loads, moved))
        return findings

    def host_signals(self, history: History, server: Server, now: float) -> list[Signal]:
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
            name = ""
            for series in history.series(RESIDENT, pid=server.pid):
                name = series.labels.get("name", "")
                gauge("process_resident_bytes", f"{name} (pid {server.pid}) resident memory", "bytes", series)
            for series in history.series(PROCESS_SWAP, pid=server.pid):
                gauge("process_swap_bytes", "its swap", "bytes", series)
            for series in history.series(PROCESS_MAJOR_FAULTS, pid=server.pid):
                counter("process_major_faults_per_second", "its major faults", "per_second", series)
            gpus = {(s.labels["gpu"], s.labels["uuid"]) for s in history.series(GPU_PROCESS_MEMORY, pid=server.pid)
                    if windows.latest(s, now) is not None}
        for series in history.series(PCIE_THROUGHPUT):
            gpu = (series.labels.get("gpu", ""), series.labels.get("uuid", ""))
            if gpus and gpu not in gpus:
                continue
            direction = series.labels.get("direction", "")
            gauge(f"gpu{gpu[0]}_pcie_{direction}_bytes_per_second",
                  f"GPU {gpu[0]} PCIe {direction.replace('_', ' ')}", "bytes_per_second", series)
        for series in history.series(GPU_MEMORY_USED):
            gpu = (series.labels.get("gpu", ""), series.labels.get("uuid", ""))
            if not gpus or gpu in gpus:
                gauge(f"gpu{gpu[0]}_memory_used_bytes", f"GPU {gpu[0]} memory used", "bytes", series)
        for series in history.series(STALLED, resource="memory", scope="some"):
            counter("memory_pressure_some_ratio", "memory pressure (PSI some)", "ratio", series)
        for series in history.series(SWAP_IN):
            counter("swap_in_bytes_per_second", "swap-in", "swap_bytes_per_second", series)
        return found

    def _finding(self, server: Server, decay: float, per_request, rates, loads,
                 moved: list[Signal]) -> Finding:
        c = self.config
        details: dict[str, float | str] = {
            "tokens_per_second_per_request_before": per_request[0],
            "tokens_per_second_per_request_after": per_request[1],
            "generation_tokens_per_second_before": rates[0],
            "generation_tokens_per_second_after": rates[1],
            "requests_running_before": loads[0],
            "requests_running_after": loads[1],
            "baseline_window": f"{common.human_duration(c.window_seconds)} to "
                               f"{common.human_duration(c.baseline_offset_seconds)} ago",
            "pid": server.pid,
        }
        for signal in moved:
            details[f"host_{signal.key}_before"] = signal.before
            details[f"host_{signal.key}_after"] = signal.after
        if moved:
            host_text = ("Over the same two windows on the host, " + "; ".join(s.text() for s in moved)
                         + ".")
        else:
            host_text = ("No host signal hybridmon watches moved with it (process memory, swap and "
                         "faults, PCIe traffic, GPU memory, memory pressure): look inside the server "
                         "(prompt and output lengths, sampling settings, scheduler, cache hit rate).")
        count = servers.human_count
        return Finding(
            alertname="InferenceThroughputDecay",
            severity="warning",
            labels=server.labels,
            value=decay,
            threshold=c.decay_share,
            unit="ratio",
            for_seconds=c.for_seconds,
            summary=(f"{server.name}: generation per running request fell {common.percent(decay)} "
                     f"({count(per_request[0])} -> {count(per_request[1])} tokens/s) under the "
                     f"same load"),
            description=(
                f"{server.name} generates {count(per_request[1])} tokens/s per running request "
                f"over the last {common.human_duration(c.recent_seconds)} "
                f"({count(rates[1])} tokens/s for {count(loads[1])} running requests) against "
                f"{count(per_request[0])} tokens/s per request {details['baseline_window']} "
                f"({count(rates[0])} tokens/s for {count(loads[0])}): "
                f"{common.percent(decay)} slower, at or above the threshold of "
                f"{common.percent(c.decay_share)}, while its load did not fall. Users wait longer "
                f"for every answer without any error. {host_text} A host that decays over hours "
                f"is usually paging (KV cache or weights pushed to swap: vm.swappiness), "
                f"leaking memory, or moving more over PCIe for the same work."),
            details=details,
        )
