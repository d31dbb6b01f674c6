"""Crashes of the inference server: one killed by the kernel OOM killer, one that keeps exiting, and
the host-level OOM kill node_exporter users alert on. Each says what preceded it on the host.

The seed incident (a clinic's Mistral-7B "crashed repeatedly at 4,200 tokens; early warning came
from Prometheus alerts on OOM kills, but the root cause was PCIe starvation") needs both: the kill
named, and the starved link, the host memory, the VRAM and the swap of the minutes before it.

What is judged comes from the process collector (exporters/process.py), which counts each watched
identity's exits and, among them, those the OOM killer caused (its own cgroup's memory.events
oom_kill where readable, else the host's /proc/vmstat oom_kill covering every watched exit of the
run): an OOM kill of an unwatched process, or in another cgroup, is never one of the server's.
Counts over a window are `max_over_time - min_over_time` of the counters, exact and without
PromQL's extrapolation (increase() of one exit over four 15 s scrapes reads up to 1.33).

Runbooks: InferenceServerOomKilled.md, InferenceServerCrashLooping.md, HostOomKill.md.
"""
from __future__ import annotations

import math

from hybridmon.agent.alerts import pcie_starvation
from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import windows
from hybridmon.agent.detectors.base import DetectorBase, Finding, HistoryReader
from hybridmon.agent.loop.history import SeriesHistory
from hybridmon.exporters.gpu import MEMORY_TOTAL, MEMORY_USED, PROCESS_MEMORY_USED
from hybridmon.exporters.host_memory import MEMORY_AVAILABLE, OOM_KILLS, SWAP_IN_BYTES
from hybridmon.exporters.process import EXITS, INFO, OOM_KILLED
from hybridmon.rules import groups
from hybridmon.rules import host as host_recorded
from hybridmon.rules import pcie as pcie_recorded
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import duration, number, selector

INPUTS = (EXITS, OOM_KILLED, OOM_KILLS, INFO, PROCESS_MEMORY_USED, MEMORY_USED, MEMORY_TOTAL,
          MEMORY_AVAILABLE, SWAP_IN_BYTES) + pcie_starvation.INPUTS
IDENTITY = ("process_name", "server", "model")
# Prometheus and the agent both judge on this grid when they look back at the minutes before (the
# usual scrape and evaluation interval): the agent takes the 1 min rates and shares every 15 s.
STEP_SECONDS = 15.0


class Settings(Section):
    """Defaults as thresholds.toml sets them: a thresholds file copied before this family loads."""

    window_seconds: float = 60.0
    restarts_at_least: int = 3
    restart_window_seconds: float = 900.0
    antecedent_seconds: float = 300.0


def counted(metric: str, window_seconds: float) -> str:
    """PromQL: what a counter rose by over the window, without extrapolation."""
    span = duration(window_seconds)
    return f"max_over_time({metric}[{span}]) - min_over_time({metric}[{span}])"


def counted_query(template: str, metric: str, window_seconds: float,
                  *label_names: str) -> tuple[str, tuple[str, ...]]:
    """A template query of counted() for the alert's target (and labels): `{}` in `template`
    stands for it."""
    chosen, names = selector(metric, *label_names)
    return template.replace("{}", counted(chosen, window_seconds)), names + names


def _its_gpus(s: Settings) -> tuple[str, tuple[str, ...]]:
    """PromQL (template): the GPUs a process of the alert's identity held memory on in the minutes
    before, as `gpu` labels."""
    span = duration(s.antecedent_seconds)
    memory, memory_labels = selector(PROCESS_MEMORY_USED.name)
    info, info_labels = selector(INFO.name, *IDENTITY)
    return (f"max by (gpu) (max_over_time({memory}[{span}]) * on (pid, process_name) group_left "
            f"max by (pid, process_name) (max_over_time({info}[{span}])))", memory_labels + info_labels)


def _antecedent_queries(s: Settings, on_gpu: bool) -> dict[str, tuple[str, tuple[str, ...]]]:
    span = duration(s.antecedent_seconds)
    available, available_labels = selector(MEMORY_AVAILABLE.name)
    swap_in, swap_labels = selector(host_recorded.SWAP_IN)
    queries = {
        "available": (f"min_over_time({available}[{span}])", available_labels),
        "swap_in": (f"max_over_time({swap_in}[{span}])", swap_labels),
    }
    if on_gpu:
        gpus, gpu_labels = _its_gpus(s)
        share, share_labels = selector(pcie_recorded.TRAFFIC_SHARE)
        used, used_labels = selector(MEMORY_USED.name)
        total, total_labels = selector(MEMORY_TOTAL.name)
        queries["link"] = (f"max(max without (direction) (max_over_time({share}[{span}])) and on (gpu) {gpus})",
                           share_labels + gpu_labels)
        queries["vram_free"] = (f"min((max without (uuid) (max_over_time({total}[{span}])) - max without (uuid) "
                                f"(max_over_time({used}[{span}]))) and on (gpu) {gpus})",
                                total_labels + used_labels + gpu_labels)
    return queries


def _antecedents(s: Settings, on_gpu: bool) -> str:
    """What preceded it, one sentence per figure, each left out where its figure is absent."""
    gpu = ("<if link>Its GPU's PCIe link ran up to <link|humanizePercentage> full (1 min averages; the "
           "fuller direction, or both together, against what the link carries). <else><end>"
           "<if vram_free>Its GPU had as little as <vram_free|humanize1024>B of VRAM free. <else><end>"
           if on_gpu else "")
    return (f"In the {duration(s.antecedent_seconds)} before: {gpu}"
            "<if available>Host memory available fell to <available|humanize1024>B. <else><end>"
            "<if swap_in>Swap-in peaked at <swap_in|humanize1024>B/s (1 min rate). <else><end>")


WHO = "<process_name><if server> (<server>)<else><end><if model> serving <model><else><end>"


def oom_killed_alert(s: Settings) -> Alert:
    return Alert(
        "InferenceServerOomKilled",
        f"# a watched process of this identity exited, and the OOM killer caused it (its cgroup's\n"
        f"# memory.events oom_kill, else the host's oom_kill covering every watched exit)\n"
        f"{counted(OOM_KILLED.name, s.window_seconds)} > 0",
        0, "critical",
        f"{WHO} on <instance> was killed by the kernel OOM killer",
        f"The kernel OOM killer killed watched process {WHO} <value> time(s) in the last "
        f"{duration(s.window_seconds)} (threshold: any): its memory cgroup counted the kill (memory.events "
        "oom_kill), or, where that cannot be read, the host's oom_kill rose with it and no other "
        "watched process exited. " + _antecedents(s, on_gpu=True) +
        "The server dies with every request in flight, and its supervisor restarts it into the same "
        "load. A full PCIe link before it means the KV cache or weights offloaded to host memory "
        "outgrew what the host holds: cap the host KV tier (vLLM kv_offloading_size, LMCache "
        "max_local_cpu_size) and max_model_len or max_num_seqs so it fits in MemAvailable, and read "
        "dmesg for the kill's line.",
        queries=_antecedent_queries(s, on_gpu=True),
    )


def crash_loop_alert(s: Settings) -> Alert:
    window = duration(s.restart_window_seconds)
    return Alert(
        "InferenceServerCrashLooping",
        f"# processes of this identity exited this many times in the window (each restart a new pid)\n"
        f"{counted(EXITS.name, s.restart_window_seconds)} >= {number(s.restarts_at_least)}",
        0, "warning",
        f"{WHO} on <instance> exited <value> times in {window}",
        f"Watched process {WHO} exited <value> times in the last {window} (threshold "
        f"{s.restarts_at_least}), each time started again as a new process: a crash loop, not a "
        f"planned restart. <if oom_killed>The OOM killer caused <oom_killed> of them. <else><end>"
        + _antecedents(s, on_gpu=True) +
        "Every restart reloads the model and drops the requests in flight, so clients see errors "
        "and the GPU sits idle while it loads. Read the server's last log lines before each exit "
        "(journalctl -u UNIT, kubectl logs --previous) and dmesg for OOM kills; a loop that "
        "starts with the same request each time points at a context length the host or the GPU "
        "cannot hold.",
        queries={"oom_killed": counted_query("{}", OOM_KILLED.name, s.restart_window_seconds, *IDENTITY),
                 **_antecedent_queries(s, on_gpu=True)},
    )


def host_alert(s: Settings) -> Alert:
    return Alert(
        "HostOomKill",
        f"# the kernel OOM killer killed a process, any process (node_exporter users' usual rule:\n"
        f"# increase(node_vmstat_oom_kill[1m]) > 0)\n"
        f"{counted(OOM_KILLS.name, s.window_seconds)} > 0",
        0, "warning",
        "The OOM killer killed <value> process(es) on <instance>",
        f"The kernel OOM killer killed <value> process(es) in the last {duration(s.window_seconds)} "
        "(oom_kill of /proc/vmstat; threshold: any). <if watched>Watched inference processes among them: <watched> "
        "(InferenceServerOomKilled names each). <else><end>" + _antecedents(s, on_gpu=False) +
        "The host ran out of memory and swap it could reclaim; the next victim may be the inference "
        "server. Find the victim with dmesg | grep -i 'killed process', and give the host room: "
        "fewer co-located jobs, a smaller host KV tier, or limits on the jobs that grew.",
        queries={"watched": counted_query("sum({})", OOM_KILLED.name, s.window_seconds),
                 **_antecedent_queries(s, on_gpu=False)},
    )


def alerts(s: Settings) -> list[Alert]:
    return [oom_killed_alert(s), crash_loop_alert(s), host_alert(s)]


def risen(series: SeriesHistory, now: float, seconds: float) -> float | None:
    """max - min of the counter's points in [now - seconds, now]: the rule's counted()."""
    _, values = windows.window(series, now, seconds)
    return max(values) - min(values) if values else None


class Detector(DetectorBase):
    """InferenceServerOomKilled (critical), per identity (process_name, server, model): its OOM
    kills (hybridmon_process_oom_killed_total) rose within window_seconds.
    InferenceServerCrashLooping (warning), per identity: its exits rose by restarts_at_least or
    more within restart_window_seconds.
    HostOomKill (warning, no labels): /proc/vmstat's oom_kill rose within window_seconds.
    Each finding carries what preceded it over antecedent_seconds: the fullest 1 min PCIe share
    of the identity's GPUs (every 15 s), its least free VRAM, the least MemAvailable, the peak
    1 min swap-in rate (every 15 s)."""

    name = "server_crash"
    alertnames = ("InferenceServerOomKilled", "InferenceServerCrashLooping", "HostOomKill")

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.oom_alert = oom_killed_alert(config)
        self.loop_alert = crash_loop_alert(config)
        self.host_alert = host_alert(config)
        # Its link shares do not depend on its thresholds (they judge the shares afterwards).
        self._starvation = pcie_starvation.Detector(pcie_starvation.Settings(
            traffic_share_of_capacity=1.0, gpu_utilization_at_most=0.0, for_seconds=0.0))
        self._shares_at: dict[float, dict[tuple[str, ...], float]] = {}  # evaluation time -> shares

    def evaluate(self, history: HistoryReader, now: float) -> list[Finding]:
        config = self.config
        findings: list[Finding] = []
        oom = {_identity(series): risen(series, now, config.window_seconds)
               for series in history.series(OOM_KILLED.name)}
        for series in history.series(OOM_KILLED.name):
            kills = oom[_identity(series)]
            if kills is not None and kills > 0:
                findings.append(finding(self.oom_alert, dict(zip(IDENTITY, _identity(series))), kills, 0,
                                        unit="processes", values=self._before(history, now, series.labels)))
        for series in history.series(EXITS.name):
            exits = risen(series, now, config.restart_window_seconds)
            if exits is None or exits < config.restarts_at_least:
                continue
            killed = next((risen(s, now, config.restart_window_seconds) for s in history.series(OOM_KILLED.name)
                           if _identity(s) == _identity(series)), None)
            findings.append(finding(self.loop_alert, dict(zip(IDENTITY, _identity(series))), exits,
                                    config.restarts_at_least, unit="exits",
                                    values={"oom_killed": killed, **self._before(history, now, series.labels)}))
        host = [value for series in history.series(OOM_KILLS.name)
                if (value := risen(series, now, config.window_seconds)) is not None]
        if host and host[0] > 0:
            watched = [value for value in oom.values() if value is not None]
            findings.append(finding(self.host_alert, {}, host[0], 0, unit="processes",
                                    values={"watched": sum(watched) if watched else None,
                                            **self._before(history, now, None)}))
        return findings

    def _before(self, history: HistoryReader, now: float, identity: dict[str, str] | None) -> dict:
        """The figures of the minutes before (the text's queries); None where absent."""
        # the 1 min rates that end in the window, as max_over_time of a recorded rate reads them
        start = now - self.config.antecedent_seconds - windows.AVERAGE_SECONDS
        available = [value for series in history.series(MEMORY_AVAILABLE.name)
                     for value in windows.window(series, now, self.config.antecedent_seconds)[1]]
        swap = [max(rates) for series in history.series(SWAP_IN_BYTES.name)
                if (rates := windows.rate_steps(series, start, now, STEP_SECONDS)[1])]
        figures: dict[str, float | None] = {"available": min(available) if available else None,
                                            "swap_in": max(swap) if swap else None}
        if identity is not None:
            gpus = self._gpus_of(history, now, identity)
            figures["link"] = self._fullest_link(history, now, gpus)
            figures["vram_free"] = _least_free(history, now, self.config.antecedent_seconds, gpus)
        return figures

    def _gpus_of(self, history: HistoryReader, now: float, identity: dict[str, str]) -> set[str]:
        """The GPUs (gpu label) a process of the identity held memory on in the minutes before."""
        seconds = self.config.antecedent_seconds
        pids = {(series.labels["pid"], series.labels["process_name"])
                for series in history.series(INFO.name, **{k: identity[k] for k in IDENTITY})
                if windows.window(series, now, seconds)[1]}
        return {series.labels["gpu"] for series in history.series(PROCESS_MEMORY_USED.name)
                if (series.labels["pid"], series.labels["process_name"]) in pids
                and windows.window(series, now, seconds)[1]}

    def _fullest_link(self, history: HistoryReader, now: float, gpus: set[str]) -> float | None:
        """The fullest 1 min link share of those GPUs, as pcie_starvation judges it, every 15 s."""
        if not gpus:
            return None
        shares = []
        start = now - self.config.antecedent_seconds
        # Remembered by time: a crash loop's finding holds for 15 min and asks every evaluation.
        self._shares_at = {at: found for at, found in self._shares_at.items() if start <= at <= now}
        for at in windows.step_times(start, now, STEP_SECONDS, 0.0):
            if at not in self._shares_at:
                self._starvation.evaluate(history, at)
                self._shares_at[at] = self._starvation.link_shares
            shares += [share for (gpu, _), share in self._shares_at[at].items() if gpu in gpus]
        return max(shares) if shares else None


def _least_free(history: HistoryReader, now: float, seconds: float, gpus: set[str]) -> float | None:
    """min over the GPUs of (their greatest total - their greatest use) in the window."""
    def greatest(metric: str) -> dict[str, float]:
        found: dict[str, float] = {}
        for series in history.series(metric):
            gpu = series.labels["gpu"]
            values = windows.window(series, now, seconds)[1]
            if gpu in gpus and values:
                found[gpu] = max(found.get(gpu, -math.inf), max(values))
        return found
    total, used = greatest(MEMORY_TOTAL.name), greatest(MEMORY_USED.name)
    free = [total[gpu] - used[gpu] for gpu in total if gpu in used]
    return min(free) if free else None


def _identity(series: SeriesHistory) -> tuple[str, str, str]:
    return tuple(series.labels[name] for name in IDENTITY)  # type: ignore[return-value]


FAMILY = AlertFamily(
    section="server_crash",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group=groups.PROCESS,
    detector=Detector,
    alerts=lambda t: tuple(alerts(t.server_crash)),
    collectors=("process",),
    lookback_seconds=lambda settings: max(settings.restart_window_seconds, settings.antecedent_seconds + 60.0),
    scenario="server_crash_loop",
)
