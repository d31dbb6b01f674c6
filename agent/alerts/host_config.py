"""Static host configuration risks, six info alerts: HostSwappinessHigh, HostDirtyRatioHigh,
HostTransparentHugepageAlways, HostNumaBalancingEnabled, HostNoSwapLowHeadroom and
InferenceProcessMemlockLow (runbooks named like them). `hybridmon check` reports them too.

A setting is a state, not a measurement: each check reads current values, so one sample of the
host is enough to judge it (no `for`). Only the no-swap headroom compares 1 min averages.

RLIMIT_MEMLOCK is judged against what the process has locked, not on its own. The kernel charges
mlock() to mm->locked_vm (VmLck) and RDMA memory registration to mm->pinned_vm (VmPin), and
refuses the request that would take either counter past the limit (mm/mlock.c do_mlock,
drivers/infiniband/core/umem.c ib_umem_get), each on its own: so the larger of the two, not their
sum, is what the next request is checked with. CUDA pinned host memory is charged to neither: the
NVIDIA driver pins cudaHostRegister's pages with pin_user_pages (older drivers get_user_pages,
kernel-open/nvidia/os-mlock.c os_lock_user_pages) and maps cudaHostAlloc's own pages into the
process (kernel-open/nvidia/nv-mmap.c nvidia_mmap_sysmem), and kernel-open never touches
locked_vm, pinned_vm or RLIMIT_MEMLOCK (595.45.04). A low limit on a process that locks nothing,
the common case of a vLLM with a CPU KV tier, is therefore no risk. A counter past the limit means
the kernel let it through: the process holds CAP_IPC_LOCK, which the limit does not bind, so it is
not judged either.
"""
from __future__ import annotations

import math

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import common, windows
from hybridmon.agent.detectors.base import DetectorBase, Finding, HistoryReader
from hybridmon.exporters.host_memory import (MEMORY_AVAILABLE, MEMORY_TOTAL, SWAP_TOTAL, SYSCTL_VALUE,
                                             TRANSPARENT_HUGEPAGE_MODE)
from hybridmon.exporters.numa import NODE_MEMORY_TOTAL
from hybridmon.exporters.process import LOCKED, MEMLOCK_LIMIT, PINNED
from hybridmon.rules import groups
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import number, query
from hybridmon.rules.templates import humanize_percentage

INPUTS = (SYSCTL_VALUE, SWAP_TOTAL, MEMORY_TOTAL, MEMORY_AVAILABLE, TRANSPARENT_HUGEPAGE_MODE,
          NODE_MEMORY_TOTAL, LOCKED, PINNED, MEMLOCK_LIMIT)
NUMA_NODES = f"count without (node) ({NODE_MEMORY_TOTAL.name})"
# The larger of VmLck and VmPin of each process (the one its next request is checked with); VmPin
# absent (a kernel before 3.2) leaves VmLck alone.
LOCKED_OR_PINNED = f'max without () ({{__name__=~"{LOCKED.name}|{PINNED.name}"}})'


class Settings(Section):
    max_swappiness_with_swap: int
    max_dirty_ratio: int
    locked_share_of_memlock_limit: float
    min_available_share_without_swap: float


def _sysctl(name: str) -> str:
    """PromQL: one sysctl's value, without the sysctl label so it joins the host's series."""
    return f'max without (sysctl) ({SYSCTL_VALUE.name}{{sysctl="{name}"}})'


def swappiness_alert(c: Settings) -> Alert:
    return Alert(
        "HostSwappinessHigh",
        f"{_sysctl('vm.swappiness')} > {c.max_swappiness_with_swap}\n"
        f"and on (job, instance)\n{SWAP_TOTAL.name} > 0",
        0, "info",
        "<instance> has vm.swappiness=<value|humanize> with swap configured",
        f"vm.swappiness is <value|humanize> (threshold {c.max_swappiness_with_swap}) on a host "
        "with <swap|humanize1024>B of swap. At the default 60 the kernel swaps out anonymous "
        "memory, including an inference server's host KV tier, to keep page cache; this is how "
        "incident 3's tokens/s decayed. Set vm.swappiness=10 in /etc/sysctl.d and apply it "
        "with sysctl --system.",
        queries={"swap": query("{}", SWAP_TOTAL.name)},
    )


def dirty_ratio_alert(c: Settings) -> Alert:
    return Alert(
        "HostDirtyRatioHigh", f"{_sysctl('vm.dirty_ratio')} > {c.max_dirty_ratio}", 0, "info",
        "<instance> has vm.dirty_ratio=<value|humanize>",
        f"vm.dirty_ratio is <value|humanize> (threshold {c.max_dirty_ratio}): up to that "
        "percentage of memory may hold dirty page cache before writers are throttled, and "
        "flushing a large backlog stalls the host, the inference server included, and competes "
        "with swap and model loads for I/O. Set vm.dirty_ratio=15 in /etc/sysctl.d and apply it "
        "with sysctl --system.",
    )


def transparent_hugepage_alert(c: Settings) -> Alert:
    thp = (f"max without (setting, mode) "
           f'({TRANSPARENT_HUGEPAGE_MODE.name}{{setting="enabled", mode="always"}})')
    return Alert(
        "HostTransparentHugepageAlways", f"{thp} == 1", 0, "info",
        "<instance> has transparent huge pages set to always",
        f"/sys/kernel/mm/transparent_hugepage/enabled is [always] ({TRANSPARENT_HUGEPAGE_MODE.name} "
        "<value>; threshold: the mode always): every anonymous mapping may "
        "be backed by huge pages, so khugepaged compaction and page-fault latency spikes hit "
        "the inference server, and memory use grows by rounding to 2 MiB. Prefer madvise "
        "(echo madvise > /sys/kernel/mm/transparent_hugepage/enabled), so only programs that ask "
        "get huge pages.",
    )


def numa_balancing_alert(c: Settings) -> Alert:
    balancing = _sysctl("kernel.numa_balancing")
    return Alert(
        "HostNumaBalancingEnabled",
        # 1 is balancing, 3 balancing with memory tiering (2, tiering alone, moves no pages
        # between CPU nodes): the detector judges the same values.
        f"({balancing} == 1 or {balancing} == 3)\nand on (job, instance)\n{NUMA_NODES} >= 2",
        0, "info",
        "<instance> has automatic NUMA balancing on across <nodes|humanize> NUMA nodes",
        "kernel.numa_balancing is <value> (threshold: 1 or 3, on) on a host with <nodes|humanize> "
        "NUMA nodes: the kernel "
        "unmaps pages to sample accesses and migrates them between nodes, which adds "
        "page-fault latency and can move the server's host memory away from its GPU's node. On a "
        "host where the inference server is bound to its GPU's node, turn it off "
        "(kernel.numa_balancing=0 in /etc/sysctl.d).",
        queries={"nodes": query("count without (node) ({})", NODE_MEMORY_TOTAL.name)},
    )


def no_swap_headroom_alert(c: Settings) -> Alert:
    return Alert(
        "HostNoSwapLowHeadroom",
        f"avg_over_time({MEMORY_AVAILABLE.name}[1m]) / {MEMORY_TOTAL.name}\n"
        f"  < {number(c.min_available_share_without_swap)}\n"
        f"and on (job, instance)\n{SWAP_TOTAL.name} == 0",
        0, "info",
        "<instance> has no swap and <value|humanizePercentage> of its memory available",
        "The host has no swap and only <value|humanizePercentage> of MemTotal available "
        "(<available|humanize1024>B of <total|humanize1024>B, 1 min average; threshold "
        f"{humanize_percentage(c.min_available_share_without_swap)}). Without swap there is "
        "no buffer for a spike: the next large allocation, such as a host KV tier filling up, "
        "goes straight to the OOM killer. Shrink the host KV tier or co-located jobs, or add "
        "a modest swap device with vm.swappiness=10.",
        queries={"available": query("avg_over_time({}[1m])", MEMORY_AVAILABLE.name),
                 "total": query("{}", MEMORY_TOTAL.name)},
    )


def memlock_alert(c: Settings) -> Alert:
    share, limit = c.locked_share_of_memlock_limit, MEMLOCK_LIMIT.name
    return Alert(
        "InferenceProcessMemlockLow",
        # An unlimited limit is +Inf: the share is 0. A counter past the limit was let through
        # (CAP_IPC_LOCK), so the second line keeps it silent.
        f"{LOCKED_OR_PINNED} / {limit} >= {number(share)}\n"
        f"and {LOCKED_OR_PINNED} <= {limit}",
        0, "info",
        "<process_name> (pid <pid>) on <instance> has locked <value|humanizePercentage> of its "
        "memlock limit",
        "Watched process <process_name> (pid <pid>) holds <locked|humanize1024>B mlock()ed (VmLck)"
        "<if pinned> and <pinned|humanize1024>B pinned for DMA (VmPin)<else><end> of a soft "
        "RLIMIT_MEMLOCK of <limit|humanize1024>B: <value|humanizePercentage> of it (threshold "
        f"{humanize_percentage(share)}; /proc/<pid>/status and Max locked memory in "
        "/proc/<pid>/limits). The kernel refuses, with ENOMEM, the next mlock() or RDMA memory "
        "registration (NCCL over InfiniBand, GPUDirect RDMA) that would take either past the "
        "limit: llama.cpp --mlock then logs \"failed to mlock\" and leaves the rest of its "
        "weights pageable, an RDMA transport fails to register its buffers. CUDA pinned host "
        "memory (cudaHostAlloc, cudaHostRegister: KV offload tiers, pin_memory) is not charged to "
        "this limit. Raise the limit for the service (LimitMEMLOCK=infinity in its systemd unit, "
        "docker run --ulimit memlock=-1, or ulimit -l unlimited) and restart it.",
        queries={"locked": query("{}", LOCKED.name, "pid"), "pinned": query("{}", PINNED.name, "pid"),
                 "limit": query("{}", MEMLOCK_LIMIT.name, "pid")},
    )


def alerts(c: Settings) -> list[Alert]:
    return [swappiness_alert(c), dirty_ratio_alert(c), transparent_hugepage_alert(c),
            numa_balancing_alert(c), no_swap_headroom_alert(c), memlock_alert(c)]


class Detector(DetectorBase):
    """Six info checks on current values:

    - HostSwappinessHigh: vm.swappiness > max_swappiness_with_swap while SwapTotal > 0.
    - HostDirtyRatioHigh: vm.dirty_ratio > max_dirty_ratio.
    - HostTransparentHugepageAlways: THP `enabled` mode is `always`.
    - HostNumaBalancingEnabled: kernel.numa_balancing is 1 or 3 (bit 0, NUMA_BALANCING_NORMAL,
      set; 2 alone is memory tiering, which does not migrate tasks between nodes) on a host with
      at least two NUMA nodes.
    - HostNoSwapLowHeadroom: SwapTotal == 0 and MemAvailable / MemTotal (avg 1m each) below
      min_available_share_without_swap.
    - InferenceProcessMemlockLow (pid, process_name): the larger of a watched process's VmLck
      and VmPin has reached locked_share_of_memlock_limit of its soft RLIMIT_MEMLOCK and is not
      past it (unlimited is +Inf, never reached; past it, the process is exempt).
    """

    name = "host_config"
    alertnames = ("HostSwappinessHigh", "HostDirtyRatioHigh", "HostTransparentHugepageAlways",
                  "HostNumaBalancingEnabled", "HostNoSwapLowHeadroom", "InferenceProcessMemlockLow")

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.alerts = {alert.alert: alert for alert in alerts(config)}

    def evaluate(self, history: HistoryReader, now: float) -> list[Finding]:
        config = self.config
        sysctl = {name: common.host_latest(history, SYSCTL_VALUE.name, now, sysctl=name)
                  for name in ("vm.swappiness", "vm.dirty_ratio", "kernel.numa_balancing")}
        swap_total = common.host_latest(history, SWAP_TOTAL.name, now)
        findings = []

        swappiness = sysctl["vm.swappiness"]
        if (swappiness is not None and swap_total is not None and swap_total > 0
                and swappiness > config.max_swappiness_with_swap):
            findings.append(self._info("HostSwappinessHigh", swappiness, config.max_swappiness_with_swap,
                                       values={"swap": swap_total},
                                       details={"swap_total_bytes": swap_total}))

        dirty = sysctl["vm.dirty_ratio"]
        if dirty is not None and dirty > config.max_dirty_ratio:
            findings.append(self._info("HostDirtyRatioHigh", dirty, config.max_dirty_ratio, unit="%"))

        for series in history.series(TRANSPARENT_HUGEPAGE_MODE.name, setting="enabled", mode="always"):
            if windows.latest(series, now) == 1:
                findings.append(self._info("HostTransparentHugepageAlways", 1.0, 0.0))
                break

        balancing = sysctl["kernel.numa_balancing"]
        nodes = common.numa_node_count(history, now)
        if balancing is not None and int(balancing) & 1 and nodes >= 2:
            findings.append(self._info("HostNumaBalancingEnabled", balancing, 0.0,
                                       values={"nodes": nodes}, details={"numa_nodes": float(nodes)}))

        self._no_swap_headroom(history, now, swap_total, findings)
        self._memlock(history, now, findings)
        return findings

    def _info(self, alertname: str, value: float, threshold: float, *, unit: str = "",
              values: dict | None = None, details: dict | None = None,
              labels: dict[str, str] | None = None) -> Finding:
        return finding(self.alerts[alertname], labels or {}, float(value), float(threshold),
                       values=values, unit=unit, details=details)

    def _no_swap_headroom(self, history: HistoryReader, now: float, swap_total: float | None,
                          findings: list[Finding]) -> None:
        if swap_total is None or swap_total != 0:
            return
        total = common.host_series(history, MEMORY_TOTAL.name)
        available = common.host_series(history, MEMORY_AVAILABLE.name)
        total_value = windows.avg_over_time(total, now) if total else None
        available_value = windows.avg_over_time(available, now) if available else None
        if not total_value or available_value is None:
            return
        share = available_value / total_value
        limit = self.config.min_available_share_without_swap
        if share >= limit:
            return
        findings.append(self._info(
            "HostNoSwapLowHeadroom", share, limit, unit="ratio",
            values={"available": available_value, "total": total_value},
            details={"memory_available_bytes": available_value, "memory_total_bytes": total_value}))

    def _memlock(self, history: HistoryReader, now: float, findings: list[Finding]) -> None:
        share_limit = self.config.locked_share_of_memlock_limit
        held = {metric: windows.by_labels(history.series(metric), *common.PROCESS_LABELS)
                for metric in (LOCKED.name, PINNED.name)}
        processes = windows.by_labels(history.series(MEMLOCK_LIMIT.name), *common.PROCESS_LABELS)
        for process, series in sorted(processes.items(), key=lambda item: common.process_order(item[0])):
            limit = windows.latest(series, now)
            locked, pinned = (windows.latest(held[metric][process], now) if process in held[metric] else None
                              for metric in (LOCKED.name, PINNED.name))
            counters = [value for value in (locked, pinned) if value is not None]
            if limit is None or not math.isfinite(limit) or limit <= 0 or not counters:
                continue
            share = max(counters) / limit
            if share < share_limit or share > 1:
                continue
            pid, process_name = process
            findings.append(self._info(
                "InferenceProcessMemlockLow", share, share_limit, unit="ratio",
                values={"locked": locked, "pinned": pinned, "limit": limit},
                details={name: value for name, value in (("locked_bytes", locked), ("pinned_bytes", pinned),
                                                         ("memlock_limit_bytes", limit)) if value is not None},
                labels={"pid": pid, "process_name": process_name}))


FAMILY = AlertFamily(
    section="host_config",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group=groups.HOST_CONFIG,
    detector=Detector,
    alerts=lambda t: tuple(alerts(t.host_config)),
    collectors=(),
    lookback_seconds=lambda settings: 0.0,
    scenario="host_config_risks",
)
