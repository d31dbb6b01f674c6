"""Static host configuration risks, reported as info findings and by `hybridmon check`.

Each check reads current values (a setting is a state, not a measurement), so one sample of the
host is enough to judge it.
"""
from __future__ import annotations

import math

from hybridmon.agent.detectors import common, windows
from hybridmon.agent.detectors.base import Finding, HostConfig
from hybridmon.agent.history import History

SYSCTL = "hybridmon_sysctl_value"
SWAP_TOTAL = "hybridmon_swap_total_bytes"
MEMORY_TOTAL = "hybridmon_memory_total_bytes"
MEMORY_AVAILABLE = "hybridmon_memory_available_bytes"
THP_MODE = "hybridmon_transparent_hugepage_mode"
MEMLOCK_LIMIT = "hybridmon_process_memlock_limit_bytes"


class HostConfigDetector:
    """Six info checks on current values:

    - HostSwappinessHigh: vm.swappiness > max_swappiness_with_swap while SwapTotal > 0.
    - HostDirtyRatioHigh: vm.dirty_ratio > max_dirty_ratio.
    - HostTransparentHugepageAlways: THP `enabled` mode is `always`.
    - HostNumaBalancingEnabled: kernel.numa_balancing is 1 or 3 (bit 0, NUMA_BALANCING_NORMAL,
      set; 2 alone is memory tiering, which does not migrate tasks between nodes) on a host with
      at least two NUMA nodes.
    - HostNoSwapLowHeadroom: SwapTotal == 0 and MemAvailable / MemTotal (avg 1m each) below
      min_available_share_without_swap.
    - InferenceProcessMemlockLow (pid, process_name): the soft RLIMIT_MEMLOCK of a watched
      process below min_memlock_bytes (unlimited is +Inf, never low).
    """

    name = "host_config"
    alertnames = ("HostSwappinessHigh", "HostDirtyRatioHigh", "HostTransparentHugepageAlways",
                  "HostNumaBalancingEnabled", "HostNoSwapLowHeadroom", "InferenceProcessMemlockLow")
    min_history_seconds = 0.0

    def __init__(self, config: HostConfig) -> None:
        self.config = config

    def evaluate(self, history: History, now: float) -> list[Finding]:
        config = self.config
        sysctl = {name: common.host_latest(history, SYSCTL, now, sysctl=name)
                  for name in ("vm.swappiness", "vm.dirty_ratio", "kernel.numa_balancing")}
        swap_total = common.host_latest(history, SWAP_TOTAL, now)
        findings = []

        swappiness = sysctl["vm.swappiness"]
        if (swappiness is not None and swap_total is not None and swap_total > 0
                and swappiness > config.max_swappiness_with_swap):
            findings.append(_info(
                "HostSwappinessHigh", swappiness, config.max_swappiness_with_swap, "",
                f"vm.swappiness is {swappiness:.0f} on a host with "
                f"{common.human_bytes(swap_total)} of swap (at most {config.max_swappiness_with_swap})",
                f"vm.swappiness is {swappiness:.0f}, above {config.max_swappiness_with_swap}, and "
                f"the host has {common.human_bytes(swap_total)} of swap. Under memory pressure "
                f"the kernel then swaps out anonymous memory - KV cache and weights offloaded to "
                f"host memory included - rather than dropping page cache (incident 3). Fix: "
                f"`sysctl -w vm.swappiness=10` and persist it in /etc/sysctl.d/.",
                {"swap_total_bytes": swap_total}))

        dirty = sysctl["vm.dirty_ratio"]
        if dirty is not None and dirty > config.max_dirty_ratio:
            findings.append(_info(
                "HostDirtyRatioHigh", dirty, config.max_dirty_ratio, "%",
                f"vm.dirty_ratio is {dirty:.0f} % (at most {config.max_dirty_ratio} %)",
                f"vm.dirty_ratio is {dirty:.0f} %, above {config.max_dirty_ratio} %: this much of "
                f"memory can fill with dirty page cache before writers are throttled, and the "
                f"burst of writeback that follows competes with swap and model loads for I/O and "
                f"memory. Fix: `sysctl -w vm.dirty_ratio=15` and persist it in /etc/sysctl.d/."))

        for series in history.series(THP_MODE, setting="enabled", mode="always"):
            if windows.latest(series, now) == 1:
                findings.append(_info(
                    "HostTransparentHugepageAlways", 1.0, 0.0, "",
                    "Transparent huge pages are set to `always`",
                    "/sys/kernel/mm/transparent_hugepage/enabled is `always`: every anonymous "
                    "mapping may be backed by 2 MiB pages, so khugepaged compaction and direct "
                    "compaction stalls land on the inference server, and memory use grows in 2 MiB "
                    "steps. Fix: `echo madvise > /sys/kernel/mm/transparent_hugepage/enabled` "
                    "(frameworks that want huge pages ask for them with madvise)."))
                break

        balancing = sysctl["kernel.numa_balancing"]
        nodes = common.numa_node_count(history, now)
        if balancing is not None and int(balancing) & 1 and nodes >= 2:
            findings.append(_info(
                "HostNumaBalancingEnabled", balancing, 0.0, "",
                f"kernel.numa_balancing is {balancing:.0f} on a {nodes}-node host",
                f"kernel.numa_balancing is {balancing:.0f} on a host with {nodes} NUMA nodes: the "
                f"kernel unmaps pages periodically to sample access (extra minor faults) and "
                f"migrates pages and tasks between nodes, undoing pinning of the inference server "
                f"to its GPU's node. Fix: `sysctl -w kernel.numa_balancing=0` when processes are "
                f"pinned with numactl.",
                {"numa_nodes": float(nodes)}))

        self._no_swap_headroom(history, now, swap_total, findings)
        self._memlock(history, now, findings)
        return findings

    def _no_swap_headroom(self, history: History, now: float, swap_total: float | None,
                          findings: list[Finding]) -> None:
        if swap_total is None or swap_total != 0:
            return
        total = common.host_series(history, MEMORY_TOTAL)
        available = common.host_series(history, MEMORY_AVAILABLE)
        total_value = windows.avg_over_time(total, now) if total else None
        available_value = windows.avg_over_time(available, now) if available else None
        if not total_value or available_value is None:
            return
        share = available_value / total_value
        limit = self.config.min_available_share_without_swap
        if share >= limit:
            return
        findings.append(_info(
            "HostNoSwapLowHeadroom", share, limit, "ratio",
            f"No swap and only {common.percent(share)} of memory available "
            f"({common.human_bytes(available_value)})",
            f"The host has no swap and {common.human_bytes(available_value)} available of "
            f"{common.human_bytes(total_value)} ({common.percent(share)}, below "
            f"{common.percent(limit)}): a spike in host-side KV cache or a model load ends in the "
            f"OOM killer, with no slow path in between. Fix: reduce host offload size, or add a "
            f"small swap area with vm.swappiness=10 as a cushion.",
            {"memory_available_bytes": available_value, "memory_total_bytes": total_value}))

    def _memlock(self, history: History, now: float, findings: list[Finding]) -> None:
        limit = self.config.min_memlock_bytes
        processes = windows.by_labels(history.series(MEMLOCK_LIMIT), *common.PROCESS_LABELS)
        for (pid, name), series in sorted(processes.items(),
                                          key=lambda item: common.process_order(item[0])):
            value = windows.latest(series, now)
            if value is None or math.isinf(value) or value >= limit:
                continue
            findings.append(_info(
                "InferenceProcessMemlockLow", value, limit, "bytes",
                f"{name} (pid {pid}) may lock only {common.human_bytes(value)} of memory "
                f"(at least {common.human_bytes(limit)} wanted)",
                f"The soft RLIMIT_MEMLOCK of {name} (pid {pid}) is {common.human_bytes(value)}, "
                f"below {common.human_bytes(limit)}: page-locked (pinned) host buffers for KV "
                f"offload or fast transfers fail or fall back to pageable memory, which copies "
                f"slower (staged through a bounce buffer) and can be swapped out. Check `grep 'Max locked memory' "
                f"/proc/{pid}/limits`. Fix: raise it for the service (systemd LimitMEMLOCK=, "
                f"docker --ulimit memlock=-1, /etc/security/limits.conf) and restart it.",
                labels={"pid": pid, "process_name": name}))


def _info(alertname: str, value: float, threshold: float, unit: str, summary: str,
          description: str, details: dict | None = None,
          labels: dict[str, str] | None = None) -> Finding:
    return Finding(alertname=alertname, severity="info", labels=labels or {}, value=float(value),
                   threshold=float(threshold), unit=unit, summary=summary,
                   description=description, details=details or {})
