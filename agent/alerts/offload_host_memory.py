"""InferenceOffloadHostMemoryShort: the host-memory KV tier an inference server is configured with
will not fit in what the host (reason memory_available) or the server's cgroup (reason cgroup) has
left, counting the pinned-allocation overhead: a finding before the OOM, not after.

What is compared, per server (a pid is needed: its process tree's memory is what has already
been taken):

    need      = configured host tier bytes x pinned_overhead_factor
    held      = resident bytes (VmRSS) of every watched process of the server's tree
    remaining = max(0, need - held)        # what the tier can still take
    remaining / MemAvailable (1 min average)       >= remaining_share_of_free_at_least  (memory_available)
    remaining / the tree's least cgroup headroom   >= remaining_share_of_free_at_least  (cgroup)

The overhead factor: vLLM's KV offloading was reported to take 1.92x its configured size as
unreclaimable shared memory (vllm#53042; the same for --cpu-offload-gb, vllm#56410), because each
pinned buffer is rounded up. A tier already allocated is no longer in MemAvailable, so what the
process holds is subtracted from the need, never from MemAvailable: the held figure counts every
resident byte of the tree, model and Python heap too, so it can only under-state what is left to
allocate (the check errs towards silence once the server is up). Pinned shared memory mapped by
the process is resident (RssShmem is part of VmRSS).

Not compared: RLIMIT_MEMLOCK. CUDA's pinned host allocations (cudaHostAlloc, cudaHostRegister,
what torch's pin_memory and vLLM's CPU tier use) are pinned by the NVIDIA driver and are not
charged to it (exporters/process.py PINNED: counted in neither VmPin nor VmLck), so comparing the
tier with it would raise an alarm on healthy servers; the limit matters for RDMA registration and
mlock, which InferenceProcessMemlockLow (host_config) already judges. This is a new family, not a
reason of InferenceKvOffloadPressure, because it is about the host's memory before an OOM, with its
own inputs and runbook, where that one is about the GPU cache and the link while serving.
Runbook: InferenceOffloadHostMemoryShort.md.
"""
from __future__ import annotations

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import common, servers, windows
from hybridmon.agent.detectors.base import DetectorBase, Finding, HistoryReader
from hybridmon.agent.detectors.servers import Server
from hybridmon.exporters.cgroup_memory import CGROUP_MEMORY_HEADROOM
from hybridmon.exporters.host_memory import MEMORY_AVAILABLE
from hybridmon.exporters.inference_names import BY_FIELD
from hybridmon.exporters.process import INFO, RESIDENT
from hybridmon.rules import groups
from hybridmon.rules import inference as recorded
from hybridmon.rules.model import Alert
from hybridmon.rules.process import by_root
from hybridmon.rules.promql import number, query
from hybridmon.rules.templates import humanize_percentage

HOST_TIER = BY_FIELD["kv_offload_host_tier_bytes"]
INPUTS = (HOST_TIER, MEMORY_AVAILABLE, RESIDENT, INFO, CGROUP_MEMORY_HEADROOM)
SERVER_LABELS = ("server", "endpoint", "model")
REASONS = ("memory_available", "cgroup")


class Settings(Section):
    pinned_overhead_factor: float = 1.92
    remaining_share_of_free_at_least: float = 0.9
    for_seconds: float = 60


# -- PromQL ---------------------------------------------------------------------------------------

def _tree_sum(metric: str) -> str:
    return f"sum by (job, instance, root_pid) {by_root(f'max without (process_name) ({metric})')}"


def _tree_min(metric: str) -> str:
    return f"min by (job, instance, root_pid) {by_root(f'min without (process_name) ({metric})')}"


def remaining(s: Settings, tiers_selector: str = HOST_TIER.name + '{pid!=""}') -> str:
    """PromQL: per server (labels server, endpoint, model, pid, root_pid), the bytes its host tier
    can still take: configured size x overhead, less what its process tree holds resident."""
    tiers = by_root(tiers_selector)
    return (f"clamp_min(\n  {tiers} * {number(s.pinned_overhead_factor)}\n"
            f"  - on (job, instance, root_pid) group_left ()\n  {_tree_sum(RESIDENT.name)},\n  0)")


def _alert(s: Settings, reason: str, free: str, free_text: str) -> Alert:
    return Alert(
        "InferenceOffloadHostMemoryShort",
        "# what the host KV tier can still take (x the pinned overhead) against what is free\n"
        f"max without (pid, root_pid) (\n  {remaining(s)}\n  / {free}\n"
        f"  >= {number(s.remaining_share_of_free_at_least)}\n)",
        s.for_seconds, "warning",
        f"{recorded.SERVER_NAME} on <instance>: its host KV tier can still take "
        f"<value|humanizePercentage> of {free_text}",
        f"{recorded.SERVER_NAME} is configured with a <tier|humanize1024>B host-memory KV tier. "
        f"Pinned host buffers have been seen to take {s.pinned_overhead_factor:g}x their configured "
        "size as unreclaimable shared memory (vllm#53042), and what the server's processes do not "
        "hold resident yet of that comes to <value|humanizePercentage> of "
        f"{free_text} (threshold {humanize_percentage(s.remaining_share_of_free_at_least)}). When "
        "the tier fills, the kernel cannot reclaim it: the OOM killer ends the server or a "
        "neighbour. Shrink the tier (vLLM --kv-offloading-size / kv_offload config, SGLang "
        "--hicache-size or --hicache-ratio, LMCache max_local_cpu_size) to fit, or free memory.",
        labels={"reason": reason},
        queries={"tier": query("max without (pid) ({})", HOST_TIER.name, *SERVER_LABELS)},
    )


AVAILABLE = f"on (job, instance) group_left ()\n  avg_over_time({MEMORY_AVAILABLE.name}[1m])"


def share_of_available(s: Settings, tiers_selector: str) -> str:
    """PromQL, per server of `tiers_selector`: what its host tier can still take over MemAvailable
    (the dashboard's line; the alert's memory_available reason compares it)."""
    return f"max without (pid, root_pid) (\n  {remaining(s, tiers_selector)}\n  / {AVAILABLE}\n)"


def alerts(s: Settings) -> list[Alert]:
    available = AVAILABLE
    headroom = f"on (job, instance, root_pid) group_left ()\n  {_tree_min(CGROUP_MEMORY_HEADROOM.name)}"
    return [_alert(s, "memory_available", available, "the host's available memory"),
            _alert(s, "cgroup", headroom, "what its cgroup's memory limit leaves")]


# -- the agent's door ----------------------------------------------------------------------------

class Detector(DetectorBase):
    """InferenceOffloadHostMemoryShort per server with a pid and a configured host tier (labels
    server, endpoint, model, reason), warning: max(0, tier x pinned_overhead_factor - resident
    bytes of its process tree) over MemAvailable (avg 1m; reason memory_available) and over the
    least cgroup headroom of its tree (latest; reason cgroup) at or above
    remaining_share_of_free_at_least."""

    name = "offload_host_memory"
    alertnames = ("InferenceOffloadHostMemoryShort",)

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.alerts = {a.labels["reason"]: a for a in alerts(config)}

    def evaluate(self, history: HistoryReader, now: float) -> list[Finding]:
        available_series = common.host_series(history, MEMORY_AVAILABLE.name)
        available = windows.avg_over_time(available_series, now) if available_series else None
        roots = servers.tree_roots(history, now)
        resident = self._tree_values(history, RESIDENT.name, now, roots, sum)
        headroom = self._tree_values(history, CGROUP_MEMORY_HEADROOM.name, now, roots, min)
        findings = []
        for series in history.series(HOST_TIER.name):
            tier = windows.latest(series, now)
            server = servers.server_of(series)
            root = roots.get(server.pid)
            if tier is None or root not in resident:  # not watched: what it holds is unknown
                continue
            left = max(0.0, tier * self.config.pinned_overhead_factor - resident[root])
            for reason, free in (("memory_available", available), ("cgroup", headroom.get(root))):
                found = self._judge(reason, server, tier, resident[root], left, free)
                if found:
                    findings.append(found)
        return findings

    @staticmethod
    def _tree_values(history: HistoryReader, metric: str, now: float, roots: dict[str, str], reduce) -> dict[str, float]:
        values: dict[str, list[float]] = {}
        for series in history.series(metric):
            value = windows.latest(series, now)
            root = roots.get(series.labels["pid"])
            if value is not None and root is not None:
                values.setdefault(root, []).append(value)
        return {root: reduce(found) for root, found in values.items()}

    def _judge(self, reason: str, server: Server, tier: float, held: float, left: float,
               free: float | None) -> Finding | None:
        threshold = self.config.remaining_share_of_free_at_least
        if free is None or left <= 0:
            return None
        share = left / free if free > 0 else float("inf")
        if share < threshold:
            return None
        return finding(
            self.alerts[reason], server.labels, share, threshold, unit="ratio",
            values={"tier": tier},
            details={"host_tier_bytes": tier,
                     "needed_bytes": tier * self.config.pinned_overhead_factor,
                     "held_resident_bytes": held, "remaining_bytes": left, "free_bytes": free,
                     "pid": server.pid})


# -- promtool cases ------------------------------------------------------------------------------


FAMILY = AlertFamily(
    section="offload_host_memory",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group=groups.INFERENCE,
    detector=Detector,
    alerts=lambda t: tuple(alerts(t.offload_host_memory)),
    collectors=("inference", "process"),
    lookback_seconds=lambda settings: 0.0,
    scenario="offload_host_memory_short",
)
