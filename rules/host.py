"""Host memory and host configuration rules: swap thrash and the static risks.

Settings (sysctls, THP mode, swap size, memlock limits) are states and are read as they are now;
measurements are compared as 1 min averages and counters as 1 min rates, as in the agent.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the schema is built from the families, which import these rules
    from hybridmon.agent.alerts.catalogue import Thresholds

from textwrap import dedent

from hybridmon.rules.model import Alert, Group, Recording
from hybridmon.rules.promql import as_process_name, indent, number, query
from hybridmon.rules.templates import humanize, humanize1024, humanize_percentage

SWAP_IN = "instance:hybridmon_swap_in_bytes:rate1m"
SWAP_OUT = "instance:hybridmon_swap_out_bytes:rate1m"
MAJOR_FAULTS = "instance:hybridmon_memory_major_page_faults:rate1m"
STALLED = "instance:hybridmon_pressure_stalled_seconds:rate1m"
PROCESS_SWAP = "process:hybridmon_process_swap_bytes:avg1m"
PROCESS_MAJOR_FAULTS = "process:hybridmon_process_major_faults:rate1m"
NUMA_NODES = "count without (node) (hybridmon_numa_node_memory_total_bytes)"

SETTINGS = {
    "swappiness": query("{}", "hybridmon_sysctl_value", sysctl="vm.swappiness"),
    "dirty_ratio": query("{}", "hybridmon_sysctl_value", sysctl="vm.dirty_ratio"),
}


def _bytes(value: float) -> str:
    return f"{humanize1024(value)}B"


def host_thrash(t: Thresholds) -> str:
    s = t.swap_thrash
    return dedent(f"""\
        {SWAP_IN} >= {number(s.swap_in_bytes_per_second)}
        and on (job, instance)
        {SWAP_OUT} >= {number(s.swap_out_bytes_per_second)}
        and on (job, instance)
        (
            {MAJOR_FAULTS} >= {number(s.major_faults_per_second)}
          or on (job, instance)
            {STALLED}{{resource="memory", scope="some"}} >= {number(s.memory_pressure_some_ratio)}
        )""")


def recordings() -> tuple[Recording, ...]:
    return (
        Recording(SWAP_IN, "rate(hybridmon_swap_in_bytes_total[1m])"),
        Recording(SWAP_OUT, "rate(hybridmon_swap_out_bytes_total[1m])"),
        Recording(MAJOR_FAULTS, "rate(hybridmon_memory_major_page_faults_total[1m])"),
        Recording(STALLED, "rate(hybridmon_pressure_stalled_seconds_total[1m])"),
        Recording(PROCESS_SWAP, "avg_over_time(hybridmon_process_swap_bytes[1m])"),
        Recording(PROCESS_MAJOR_FAULTS, "rate(hybridmon_process_major_faults_total[1m])"),
    )


def swap_thrash(t: Thresholds) -> list[Alert]:
    s = t.swap_thrash
    condition = (
        f"swap-in at or above {_bytes(s.swap_in_bytes_per_second)}/s and swap-out at or above "
        f"{_bytes(s.swap_out_bytes_per_second)}/s (1 min rates), with major page faults at or above "
        f"{humanize(s.major_faults_per_second)}/s or tasks stalled on memory at least "
        f"{humanize_percentage(s.memory_pressure_some_ratio)} of the time")
    watched = (
        "# the process's VmSwap, when it holds enough swap and it grows, or it major-faults...\n"
        f"{PROCESS_SWAP}\n"
        "and\n"
        "(\n"
        f"    {PROCESS_SWAP} >= {number(s.process_swap_bytes)}"
        " and deriv(hybridmon_process_swap_bytes[1m]) > 0\n"
        "  or\n"
        f"    {PROCESS_MAJOR_FAULTS} >= {number(s.process_major_faults_per_second)}\n"
        ")\n"
        "# ...while the host thrashes\n"
        "and on (job, instance)\n"
        "(\n"
        f"{indent(host_thrash(t), 2)}\n"
        ")"
    )
    return [
        Alert(
            "HostSwapThrash", host_thrash(t), s.for_seconds, "warning",
            "<instance> is thrashing swap: <value|humanize1024>B/s in, <swap_out|humanize1024>B/s out",
            "The host reads <value|humanize1024>B/s back from swap and writes "
            "<swap_out|humanize1024>B/s out, with <major_faults|humanize> major page faults/s and "
            "tasks stalled on memory <pressure|humanizePercentage> of the time (thresholds: "
            f"{condition}). Settings: vm.swappiness=<swappiness>, vm.dirty_ratio=<dirty_ratio>. The "
            "kernel is evicting memory still in use and reading it straight back, so offloaded KV "
            "blocks and weights wait on the disk and tokens/s decay without a crash. Lower "
            "vm.swappiness to 10 and vm.dirty_ratio to 15, and find who holds swap (VmSwap in "
            "/proc/PID/status).",
            queries={
                "swap_out": query("{}", SWAP_OUT),
                "major_faults": query("{}", MAJOR_FAULTS),
                "pressure": query("{}", STALLED, resource="memory", scope="some"),
                **SETTINGS,
            },
        ),
        Alert(
            "HostSwapThrash", as_process_name(watched), s.for_seconds, "critical",
            "<process_name> (pid <pid>) on <instance> is swapping: <value|humanize1024>B in swap "
            "while the host thrashes",
            "Watched process <process_name> (pid <pid>) has <value|humanize1024>B in swap (VmSwap, "
            f"1 min average; threshold {_bytes(s.process_swap_bytes)} and growing) and takes "
            "<major_faults|humanize> major page faults/s (threshold "
            f"{humanize(s.process_major_faults_per_second)}/s); either makes it critical while the "
            f"host thrashes ({condition}). Settings: vm.swappiness=<swappiness>, "
            "vm.dirty_ratio=<dirty_ratio>. The inference server's own memory goes to disk and "
            "comes back one fault at a time, and each fault stalls a token. Lower vm.swappiness to "
            "10 and vm.dirty_ratio to 15, and give the server room: a smaller host KV tier, fewer "
            "co-located jobs or more RAM.",
            queries={
                "major_faults": query("{}", PROCESS_MAJOR_FAULTS, "pid"),
                **SETTINGS,
            },
        ),
    ]


def host_config(t: Thresholds) -> list[Alert]:
    c = t.host_config
    swappiness = 'max without (sysctl) (hybridmon_sysctl_value{sysctl="vm.swappiness"})'
    dirty_ratio = 'max without (sysctl) (hybridmon_sysctl_value{sysctl="vm.dirty_ratio"})'
    balancing = 'max without (sysctl) (hybridmon_sysctl_value{sysctl="kernel.numa_balancing"})'
    thp = 'max without (setting, mode) (hybridmon_transparent_hugepage_mode{setting="enabled", mode="always"})'
    return [
        Alert(
            "HostSwappinessHigh",
            f"{swappiness} > {c.max_swappiness_with_swap}\n"
            "and on (job, instance)\nhybridmon_swap_total_bytes > 0",
            0, "info",
            "<instance> has vm.swappiness=<value|humanize> with swap configured",
            f"vm.swappiness is <value|humanize> (threshold {c.max_swappiness_with_swap}) on a host "
            "with <swap|humanize1024>B of swap. At the default 60 the kernel swaps out anonymous "
            "memory, including an inference server's host KV tier, to keep page cache; this is how "
            "incident 3's tokens/s decayed. Set vm.swappiness=10 in /etc/sysctl.d and apply it "
            "with sysctl --system.",
            queries={"swap": query("{}", "hybridmon_swap_total_bytes")},
        ),
        Alert(
            "HostDirtyRatioHigh", f"{dirty_ratio} > {c.max_dirty_ratio}", 0, "info",
            "<instance> has vm.dirty_ratio=<value|humanize>",
            f"vm.dirty_ratio is <value|humanize> (threshold {c.max_dirty_ratio}): up to that "
            "percentage of memory may hold dirty page cache before writers are throttled, and "
            "flushing a large backlog stalls the host, the inference server included. Set "
            "vm.dirty_ratio=15 in /etc/sysctl.d and apply it with sysctl --system.",
        ),
        Alert(
            "HostTransparentHugepageAlways", f"{thp} == 1", 0, "info",
            "<instance> has transparent huge pages set to always",
            "/sys/kernel/mm/transparent_hugepage/enabled is [always] (hybridmon_transparent_hugepage_mode "
            "<value>; threshold: the mode always): every anonymous mapping may "
            "be backed by huge pages, so khugepaged compaction and page-fault latency spikes hit "
            "the inference server, and memory use grows by rounding to 2 MiB. Prefer madvise, so "
            "only programs that ask get huge pages.",
        ),
        Alert(
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
            queries={"nodes": query(NUMA_NODES.replace("hybridmon_numa_node_memory_total_bytes", "{}"),
                                    "hybridmon_numa_node_memory_total_bytes")},
        ),
        Alert(
            "HostNoSwapLowHeadroom",
            "avg_over_time(hybridmon_memory_available_bytes[1m]) / hybridmon_memory_total_bytes\n"
            f"  < {number(c.min_available_share_without_swap)}\n"
            "and on (job, instance)\nhybridmon_swap_total_bytes == 0",
            0, "info",
            "<instance> has no swap and <value|humanizePercentage> of its memory available",
            "The host has no swap and only <value|humanizePercentage> of MemTotal available "
            "(1 min average; threshold "
            f"{humanize_percentage(c.min_available_share_without_swap)}). Without swap there is "
            "no buffer for a spike: the next large allocation, such as a host KV tier filling up, "
            "goes straight to the OOM killer. Shrink the host KV tier or co-located jobs, or add "
            "a modest swap device with vm.swappiness=10.",
        ),
        Alert(
            "InferenceProcessMemlockLow",
            as_process_name(f"hybridmon_process_memlock_limit_bytes < {number(c.min_memlock_bytes)}"),
            0, "info",
            "<process_name> (pid <pid>) on <instance> may lock only <value|humanize1024>B",
            "Watched process <process_name> (pid <pid>) has a soft RLIMIT_MEMLOCK of "
            f"<value|humanize1024>B (threshold {_bytes(c.min_memlock_bytes)}). Pinned host buffers "
            "for KV offload need page-locked memory; with a low limit their allocation fails or "
            "the server falls back to slower pageable copies. Raise the limit for the service "
            "(LimitMEMLOCK=infinity in its systemd unit, or ulimit -l unlimited) and restart it.",
        ),
    ]


def groups(t: Thresholds) -> list[Group]:
    return [
        Group("hybridmon-host-memory", (*recordings(), *swap_thrash(t))),
        Group("hybridmon-host-config", tuple(host_config(t))),
    ]
