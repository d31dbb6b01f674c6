"""HostSwapThrash: the host pages in and out of swap at once while tasks stall on memory
(incident 3: vm.swappiness=60 evicting the offloaded KV cache to swap)."""
from __future__ import annotations

from hybridmon.agent.detectors import common, windows
from hybridmon.agent.detectors.base import Finding, SwapThrash
from hybridmon.agent.history import History

SWAP_IN = "hybridmon_swap_in_bytes_total"
SWAP_OUT = "hybridmon_swap_out_bytes_total"
MAJOR_FAULTS = "hybridmon_memory_major_page_faults_total"
STALLED = "hybridmon_pressure_stalled_seconds_total"
SYSCTL = "hybridmon_sysctl_value"
PROCESS_SWAP = "hybridmon_process_swap_bytes"
PROCESS_MAJOR_FAULTS = "hybridmon_process_major_faults_total"


def host_rate(history: History, metric: str, now: float, **labels: str) -> float | None:
    for series in history.series(metric, **labels):
        value = windows.rate(series, now)
        if value is not None:
            return value
    return None


class SwapThrashDetector:
    """HostSwapThrash, warning (no labels): swap-in rate >= swap_in_bytes_per_second and swap-out
    rate >= swap_out_bytes_per_second and (major faults/s >= major_faults_per_second or PSI
    memory some >= memory_pressure_some_ratio), all over the last minute.

    While that holds, also one critical finding per watched process that itself swaps (labels
    pid, process_name): VmSwap (avg 1m) >= process_swap_bytes and growing (its last value in the
    minute above its first), or its major faults/s >= process_major_faults_per_second. Both kinds
    carry vm.swappiness, vm.dirty_ratio and the VmSwap in their details."""

    name = "swap_thrash"
    alertnames = ("HostSwapThrash",)
    min_history_seconds = windows.AVERAGE_SECONDS

    def __init__(self, config: SwapThrash) -> None:
        self.config = config

    def evaluate(self, history: History, now: float) -> list[Finding]:
        config = self.config
        swap_in = host_rate(history, SWAP_IN, now)
        swap_out = host_rate(history, SWAP_OUT, now)
        major = host_rate(history, MAJOR_FAULTS, now)
        pressure = host_rate(history, STALLED, now, resource="memory", scope="some")
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
        if major is not None:
            host["major_faults_per_second"] = major
        if pressure is not None:
            host["memory_pressure_some_ratio"] = pressure
        for sysctl in ("vm.swappiness", "vm.dirty_ratio"):
            value = common.host_latest(history, SYSCTL, now, sysctl=sysctl)
            if value is not None:
                host[sysctl.replace(".", "_")] = value
        processes = self._processes(history, now)
        worst = max(processes, key=lambda p: p["swap_bytes"], default=None)
        findings = [self._host_finding(host, worst)]
        for process in processes:
            if process["swapping"]:
                findings.append(self._process_finding(host, process))
        return findings

    def _processes(self, history: History, now: float) -> list[dict]:
        """Every watched process with its VmSwap (avg 1m), whether it grows, its major faults/s."""
        faults = {key: windows.rate(series, now) for key, series in
                  windows.by_labels(history.series(PROCESS_MAJOR_FAULTS),
                                    *common.PROCESS_LABELS).items()}
        found = []
        swap_series = windows.by_labels(history.series(PROCESS_SWAP), *common.PROCESS_LABELS)
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
            swaps = (swap is not None and swap >= self.config.process_swap_bytes and growing)
            faulting = major is not None and major >= self.config.process_major_faults_per_second
            found.append({"pid": key[0], "name": key[1], "swap_bytes": swap or 0.0,
                          "growing": growing, "major_faults_per_second": major,
                          "swapping": swaps or faulting, "by_swap": swaps})
        return found

    def _host_finding(self, host: dict, worst: dict | None) -> Finding:
        config = self.config
        details = dict(host)
        worst_text = ""
        if worst is not None:
            details.update(process_swap_bytes=worst["swap_bytes"], pid=worst["pid"],
                           process_name=worst["name"])
            worst_text = (f" The watched process with most in swap is {worst['name']} (pid "
                          f"{worst['pid']}) with VmSwap {common.human_bytes(worst['swap_bytes'])}.")
        return Finding(
            alertname="HostSwapThrash",
            severity="warning",
            labels={},
            value=host["swap_in_bytes_per_second"],
            threshold=config.swap_in_bytes_per_second,
            unit="B/s",
            for_seconds=config.for_seconds,
            summary=(f"Host swap thrash: {common.human_bytes(host['swap_in_bytes_per_second'])}/s "
                     f"in, {common.human_bytes(host['swap_out_bytes_per_second'])}/s out"
                     f"{_sysctl_text(host)}"),
            description=(
                f"The host reads {common.human_bytes(host['swap_in_bytes_per_second'])}/s from "
                f"swap and writes {common.human_bytes(host['swap_out_bytes_per_second'])}/s to it "
                f"(thresholds {common.human_bytes(config.swap_in_bytes_per_second)}/s each, last "
                f"minute) while {_stall_text(host, config)}.{worst_text} Pages are evicted and "
                f"faulted back in a loop: offloaded KV blocks and weights wait on disk and "
                f"tokens/s collapses.{_sysctl_text(host, sentence=True)} First: find who swaps "
                f"(VmSwap in /proc/<pid>/status), set `sysctl -w vm.swappiness=10` and "
                f"`sysctl -w vm.dirty_ratio=15`, and size the offload to fit RAM."),
            details=details,
        )

    def _process_finding(self, host: dict, process: dict) -> Finding:
        config = self.config
        pid, name = process["pid"], process["name"]
        major = process["major_faults_per_second"]
        details = dict(host)
        details.update(process_swap_bytes=process["swap_bytes"])
        if major is not None:
            details["process_major_faults_per_second"] = major
        if process["by_swap"]:
            value, threshold, unit = process["swap_bytes"], config.process_swap_bytes, "bytes"
            what = (f"has {common.human_bytes(value)} in swap and growing (threshold "
                    f"{common.human_bytes(threshold)})")
        else:
            value, threshold, unit = major, config.process_major_faults_per_second, "faults/s"
            what = (f"major-faults {value:.0f} times/s (threshold {threshold:g}/s), VmSwap "
                    f"{common.human_bytes(process['swap_bytes'])}")
        return Finding(
            alertname="HostSwapThrash",
            severity="critical",
            labels={"pid": pid, "process_name": name},
            value=value,
            threshold=threshold,
            unit=unit,
            for_seconds=config.for_seconds,
            summary=f"Inference process {name} (pid {pid}) is swapping: it {what}",
            description=(
                f"The host is thrashing swap ({common.human_bytes(host['swap_in_bytes_per_second'])}"
                f"/s in, {common.human_bytes(host['swap_out_bytes_per_second'])}/s out) and the "
                f"watched process {name} (pid {pid}) {what}. Its own pages are on disk: every "
                f"token that touches them waits for swap I/O.{_sysctl_text(host, sentence=True)} "
                f"First: `grep -e VmSwap -e VmRSS /proc/{pid}/status`, set "
                f"`sysctl -w vm.swappiness=10` and `sysctl -w vm.dirty_ratio=15`, and shrink the "
                f"host-side KV/weight offload or add RAM."),
            details=details,
        )


def _stall_text(host: dict, config: SwapThrash) -> str:
    parts = []
    if "major_faults_per_second" in host:
        parts.append(f"{host['major_faults_per_second']:.0f} major faults/s (threshold "
                     f"{config.major_faults_per_second:g})")
    if "memory_pressure_some_ratio" in host:
        parts.append(f"tasks stall on memory {common.percent(host['memory_pressure_some_ratio'])} "
                     f"of the time (threshold {common.percent(config.memory_pressure_some_ratio)})")
    return " and ".join(parts)


def _sysctl_text(host: dict, sentence: bool = False) -> str:
    known = [f"vm.{name}={host['vm_' + name]:.0f}" for name in ("swappiness", "dirty_ratio")
             if "vm_" + name in host]
    if not known:
        return ""
    return f" Now {', '.join(known)}." if sentence else f" ({', '.join(known)})"
