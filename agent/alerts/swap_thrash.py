"""HostSwapThrash: the host pages in and out of swap at once while tasks stall on memory
(incident 3: vm.swappiness=60 evicting the offloaded KV cache to swap). Swap traffic is the swap
device's and zswap's compressed pool's together: a page zswap stores or serves is not counted in
pswpout/pswpin (exporters/host_memory.py), so a host thrashing through zswap shows almost no
device traffic. A warning for the host, naming the processes that fault most, watched or not
(the faulting_processes collector, which reads them only while the host swaps in); a critical
alert, naming the process, for each watched inference process that itself swaps and faults.
Runbook: HostSwapThrash.md.
"""
from __future__ import annotations

from textwrap import dedent

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import common, windows
from hybridmon.agent.detectors.base import DetectorBase, Finding, HistoryReader
from hybridmon.exporters.faulting_processes import MAJOR_FAULT_RATE
from hybridmon.exporters.host_memory import (MAJOR_PAGE_FAULTS, SWAP_IN_BYTES, SWAP_OUT_BYTES, SYSCTL_VALUE,
                                             ZSWAP_IN_BYTES, ZSWAP_OUT_BYTES)
from hybridmon.exporters.pressure import STALLED_SECONDS
from hybridmon.exporters.process import MAJOR_FAULTS as PROCESS_MAJOR_FAULTS
from hybridmon.exporters.process import SWAP as PROCESS_SWAP
from hybridmon.rules import groups
from hybridmon.rules import host as recorded
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import indent, number, query
from hybridmon.rules.templates import humanize, humanize1024, humanize_percentage

INPUTS = (SWAP_IN_BYTES, SWAP_OUT_BYTES, ZSWAP_IN_BYTES, ZSWAP_OUT_BYTES, MAJOR_PAGE_FAULTS, STALLED_SECONDS,
          SYSCTL_VALUE, PROCESS_SWAP, PROCESS_MAJOR_FAULTS, MAJOR_FAULT_RATE)
# The two sysctls both alerts quote: the usual culprits of incident 3 and their fix.
SYSCTLS = ("vm.swappiness", "vm.dirty_ratio")


class Settings(Section):
    swap_in_bytes_per_second: float
    swap_out_bytes_per_second: float
    major_faults_per_second: float
    memory_pressure_some_ratio: float
    for_seconds: float
    process_swap_bytes: float
    process_major_faults_per_second: float


def _bytes(value: float) -> str:
    return f"{humanize1024(value)}B"


def _settings_queries() -> dict[str, tuple[str, tuple[str, ...]]]:
    """The sysctls the texts quote, read as they are now (a setting is a state)."""
    return {name.removeprefix("vm."): query("{}", SYSCTL_VALUE.name, sysctl=name) for name in SYSCTLS}


def host_thrash(s: Settings) -> str:
    """PromQL: the host swaps in and out at once (1 min rates, swap device and zswap together)
    while it major-faults or tasks stall on memory."""
    return dedent(f"""\
        {recorded.SWAP_IN_WITH_ZSWAP} >= {number(s.swap_in_bytes_per_second)}
        and on (job, instance)
        {recorded.SWAP_OUT_WITH_ZSWAP} >= {number(s.swap_out_bytes_per_second)}
        and on (job, instance)
        (
            {recorded.MAJOR_FAULTS} >= {number(s.major_faults_per_second)}
          or on (job, instance)
            {recorded.STALLED}{{resource="memory", scope="some"}} >= {number(s.memory_pressure_some_ratio)}
        )""")


def _condition(s: Settings) -> str:
    return (
        f"swap-in at or above {_bytes(s.swap_in_bytes_per_second)}/s and swap-out at or above "
        f"{_bytes(s.swap_out_bytes_per_second)}/s (1 min rates, swap device and zswap together), "
        "with major page faults at or above "
        f"{humanize(s.major_faults_per_second)}/s or tasks stalled on memory at least "
        f"{humanize_percentage(s.memory_pressure_some_ratio)} of the time")


def host_alert(s: Settings) -> Alert:
    return Alert(
        "HostSwapThrash", host_thrash(s), s.for_seconds, "warning",
        "<instance> is thrashing swap: <value|humanize1024>B/s in, <swap_out|humanize1024>B/s out",
        "The host reads <value|humanize1024>B/s back from swap and writes "
        "<swap_out|humanize1024>B/s out (swap device and zswap's compressed pool together), with "
        "<major_faults|humanize> major page faults/s and "
        "tasks stalled on memory <pressure|humanizePercentage> of the time (thresholds: "
        f"{_condition(s)}). Settings: vm.swappiness=<swappiness>, vm.dirty_ratio=<dirty_ratio>. "
        "Processes taking the most major faults, watched or not: <faulting|processes>. The "
        "watched process with the most in swap holds <most_swapped|humanize1024>B (VmSwap, 1 min "
        "average). The kernel is evicting memory still in use and reading it straight back, so "
        "offloaded KV blocks and weights wait on the disk and tokens/s decay without a crash. Lower "
        "vm.swappiness to 10 and vm.dirty_ratio to 15, find who holds swap (VmSwap in "
        "/proc/PID/status), and size the host-side offload to fit in RAM.",
        queries={
            "swap_out": query("{}", recorded.SWAP_OUT_WITH_ZSWAP),
            "major_faults": query("{}", recorded.MAJOR_FAULTS),
            "faulting": query("sort_desc({})", MAJOR_FAULT_RATE.name),
            "pressure": query("{}", recorded.STALLED, resource="memory", scope="some"),
            "most_swapped": query("max({})", recorded.PROCESS_SWAP),
            **_settings_queries(),
        },
    )


def process_alert(s: Settings) -> Alert:
    watched = (
        "# the process's VmSwap, when it holds enough swap, it grows and the process faults its\n"
        "# pages back (a process that does not fault is not hurt by what it has in swap), or it\n"
        "# major-faults fast...\n"
        f"{recorded.PROCESS_SWAP}\n"
        "and\n"
        "(\n"
        f"    {recorded.PROCESS_SWAP} >= {number(s.process_swap_bytes)}"
        f" and deriv({PROCESS_SWAP.name}[1m]) > 0 and {recorded.PROCESS_MAJOR_FAULTS} > 0\n"
        "  or\n"
        f"    {recorded.PROCESS_MAJOR_FAULTS} >= {number(s.process_major_faults_per_second)}\n"
        ")\n"
        "# ...while the host thrashes\n"
        "and on (job, instance)\n"
        "(\n"
        f"{indent(host_thrash(s), 2)}\n"
        ")"
    )
    return Alert(
        "HostSwapThrash", watched, s.for_seconds, "critical",
        "<process_name> (pid <pid>) on <instance> is swapping: <value|humanize1024>B in swap "
        "while the host thrashes",
        "Watched process <process_name> (pid <pid>) has <value|humanize1024>B in swap (VmSwap, "
        f"1 min average; threshold {_bytes(s.process_swap_bytes)}, growing while it faults) and takes "
        "<major_faults|humanize> major page faults/s (threshold "
        f"{humanize(s.process_major_faults_per_second)}/s); either makes it critical while the "
        "host thrashes (now <swap_in|humanize1024>B/s in, <swap_out|humanize1024>B/s out; "
        f"thresholds: {_condition(s)}). Settings: vm.swappiness=<swappiness>, "
        "vm.dirty_ratio=<dirty_ratio>. The inference server's own memory goes to disk and "
        "comes back one fault at a time, and each fault stalls a token. Check with "
        "grep -e VmSwap -e VmRSS /proc/<pid>/status. Lower vm.swappiness to "
        "10 and vm.dirty_ratio to 15, and give the server room: a smaller host KV tier, fewer "
        "co-located jobs or more RAM.",
        queries={
            "major_faults": query("{}", recorded.PROCESS_MAJOR_FAULTS, "pid"),
            "swap_in": query("{}", recorded.SWAP_IN_WITH_ZSWAP),
            "swap_out": query("{}", recorded.SWAP_OUT_WITH_ZSWAP),
            **_settings_queries(),
        },
    )


def alerts(s: Settings) -> list[Alert]:
    return [host_alert(s), process_alert(s)]


class Detector(DetectorBase):
    """HostSwapThrash, warning (no labels): swap-in rate >= swap_in_bytes_per_second and swap-out
    rate >= swap_out_bytes_per_second, each the swap device's (pswpin/pswpout) plus zswap's
    (zswpin/zswpout, where the kernel counts them), and (major faults/s >= major_faults_per_second
    or PSI memory some >= memory_pressure_some_ratio), all over the last minute. Its text names
    the processes that fault most, watched or not (the faulting_processes collector's last scan).

    While that holds, also one critical finding per watched process that itself swaps (labels
    pid, process_name): VmSwap (avg 1m) >= process_swap_bytes and growing (its last value in the
    minute above its first) while it major-faults at all, or its major faults/s >=
    process_major_faults_per_second. A process that takes no major faults is never blamed: what it
    has in swap costs it nothing until it touches it. Both kinds carry vm.swappiness,
    vm.dirty_ratio and the VmSwap in their details."""

    name = "swap_thrash"
    alertnames = ("HostSwapThrash",)
    min_history_seconds = windows.AVERAGE_SECONDS

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.host_alert = host_alert(config)
        self.process_alert = process_alert(config)

    def evaluate(self, history: HistoryReader, now: float) -> list[Finding]:
        config = self.config
        device_in = common.host_rate(history, SWAP_IN_BYTES.name, now)
        device_out = common.host_rate(history, SWAP_OUT_BYTES.name, now)
        zswap_in = common.host_rate(history, ZSWAP_IN_BYTES.name, now)
        zswap_out = common.host_rate(history, ZSWAP_OUT_BYTES.name, now)
        # As the recording rules add them: zswap's rate where the kernel counts it, else nothing.
        swap_in = None if device_in is None else device_in + (zswap_in or 0.0)
        swap_out = None if device_out is None else device_out + (zswap_out or 0.0)
        major = common.host_rate(history, MAJOR_PAGE_FAULTS.name, now)
        pressure = common.host_rate(history, STALLED_SECONDS.name, now, resource="memory", scope="some")
        if swap_in is None or swap_out is None:
            return []
        stalled = ((major is not None and major >= config.major_faults_per_second)
                   or (pressure is not None and pressure >= config.memory_pressure_some_ratio))
        if (swap_in < config.swap_in_bytes_per_second or swap_out < config.swap_out_bytes_per_second
                or not stalled):
            return []
        host: dict[str, float | str] = {
            "swap_in_bytes_per_second": swap_in,
            "swap_out_bytes_per_second": swap_out,
        }
        if zswap_in is not None:
            host["zswap_in_bytes_per_second"] = zswap_in
        if zswap_out is not None:
            host["zswap_out_bytes_per_second"] = zswap_out
        if major is not None:
            host["major_faults_per_second"] = major
        if pressure is not None:
            host["memory_pressure_some_ratio"] = pressure
        settings: dict[str, float | None] = {}
        for sysctl in SYSCTLS:
            value = common.host_latest(history, SYSCTL_VALUE.name, now, sysctl=sysctl)
            settings[sysctl.removeprefix("vm.")] = value
            if value is not None:
                host[sysctl.replace(".", "_")] = value
        processes = self._processes(history, now)
        worst = max(processes, key=lambda p: p["swap_bytes"], default=None)
        # The rule's max() over the processes' VmSwap averages: processes seen only by their
        # fault counter have no VmSwap series and take no part.
        most_swapped = max((p["swap_bytes"] for p in processes if p["swap_known"]), default=None)
        faulting = _faulting(history, now)
        findings = [self._host_finding(host, worst, major, pressure, most_swapped, settings, faulting)]
        for process in processes:
            if process["swapping"]:
                findings.append(self._process_finding(host, process, settings))
        return findings

    def _processes(self, history: HistoryReader, now: float) -> list[dict]:
        """Every watched process with its VmSwap (avg 1m), whether it grows, its major faults/s."""
        faults = {key: windows.rate(series, now) for key, series in
                  windows.by_labels(history.series(PROCESS_MAJOR_FAULTS.name),
                                    *common.PROCESS_LABELS).items()}
        found = []
        swap_series = windows.by_labels(history.series(PROCESS_SWAP.name), *common.PROCESS_LABELS)
        for key in sorted(set(swap_series) | set(faults), key=common.process_order):
            swap = None
            growing = False
            if key in swap_series:
                _, values = windows.window(swap_series[key], now, windows.AVERAGE_SECONDS)
                if values:
                    swap = sum(values) / len(values)
                    growing = values[-1] > values[0]
            major = faults.get(key)
            if swap is None and major is None:
                continue
            swaps = (swap is not None and swap >= self.config.process_swap_bytes and growing
                     and major is not None and major > 0)
            faulting = major is not None and major >= self.config.process_major_faults_per_second
            found.append({"pid": key[0], "process_name": key[1], "swap_bytes": swap or 0.0,
                          "swap_known": swap is not None, "growing": growing,
                          "major_faults_per_second": major, "swapping": swaps or faulting,
                          "by_swap": swaps})
        return found

    def _host_finding(self, host: dict, worst: dict | None, major: float | None,
                      pressure: float | None, most_swapped: float | None,
                      settings: dict[str, float | None], faulting: tuple) -> Finding:
        details = dict(host)
        if faulting:
            name, pid, rate = faulting[0]
            details.update(top_faulting_pid=pid, top_faulting_process_name=name,
                           top_faulting_major_faults_per_second=rate)
        if worst is not None:
            details.update(process_swap_bytes=worst["swap_bytes"], pid=worst["pid"],
                           process_name=worst["process_name"])
        return finding(
            self.host_alert, {}, host["swap_in_bytes_per_second"], self.config.swap_in_bytes_per_second,
            unit="B/s",
            values={"swap_out": host["swap_out_bytes_per_second"], "major_faults": major,
                    "pressure": pressure, "most_swapped": most_swapped, "faulting": faulting,
                    **settings},
            details=details)

    def _process_finding(self, host: dict, process: dict, settings: dict[str, float | None]) -> Finding:
        config = self.config
        major = process["major_faults_per_second"]
        details = dict(host)
        details.update(process_swap_bytes=process["swap_bytes"])
        if major is not None:
            details["process_major_faults_per_second"] = major
        # The finding's value is what crossed its threshold: the VmSwap, or the fault rate when only
        # that did. The text, like the rule's $value, always quotes the VmSwap.
        if process["by_swap"]:
            value, threshold, unit = process["swap_bytes"], config.process_swap_bytes, "bytes"
        else:
            value, threshold, unit = major, config.process_major_faults_per_second, "faults/s"
        return finding(
            self.process_alert, {"pid": process["pid"], "process_name": process["process_name"]},
            value, threshold, unit=unit,
            values={"value": process["swap_bytes"], "major_faults": major,
                    "swap_in": host["swap_in_bytes_per_second"],
                    "swap_out": host["swap_out_bytes_per_second"], **settings},
            details=details)


def _faulting(history: HistoryReader, now: float) -> tuple[tuple[str, str, float], ...]:
    """(process_name, pid, major faults/s) of the faulting_processes collector's last scan, busiest
    first: what the rule's sort_desc() query finds on the latest scrape. Its series are absent
    when it last found none, and a scan older than a minute is not current."""
    latest = history.latest().get("faulting_processes")
    if latest is None or not 0 <= now - latest[0] <= windows.INSTANT_LOOKBACK_SECONDS:
        return ()
    found = [(dict(zip(sample.spec.label_names, sample.label_values)), sample.value)
             for sample in latest[1].find(MAJOR_FAULT_RATE.name)]
    ordered = sorted(found, key=lambda item: (-item[1], int(item[0]["pid"])))
    return tuple((labels["process_name"], labels["pid"], value) for labels, value in ordered)


FAMILY = AlertFamily(
    section="swap_thrash",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group=groups.HOST_MEMORY,
    detector=Detector,
    alerts=lambda t: tuple(alerts(t.swap_thrash)),
    collectors=(),
    lookback_seconds=lambda settings: 0.0,
    scenario="swap_thrash",
)
