"""InferenceWeightsCrossingBus: an inference server's GPUs receive far more host->device bytes per
generated token than any KV cache can explain, so model weights cross PCIe on every decode step.

vLLM's --cpu-offload-gb (cpu_offload_gb) keeps part of the weights in pinned host memory and reads
them over the bus (UVA) in every forward pass; it publishes no metric of its own, so only the PCIe
side shows it (a leftover --cpu-offload-gb was reported to cut 2,434 to 120 tokens/s, vllm#57771).

The judgement, per server, over the GPUs its process tree holds memory on (NVML per-process
memory and hybridmon_process_tree_root_info, so vLLM's engine core and TP workers count for the
API server that listens):

    unexplained = sum over its GPUs of max(0, host->device bytes/s - KV offload loads/s on that GPU)
    tokens      = sum over its GPUs of the generated tokens/s on that GPU
    unexplained / tokens > unexplained_bytes_per_token_above

A server spread over n GPUs (tensor parallel) puts 1/n of its tokens and of its KV loads on each:
each GPU receives its shard of the offloaded weights per step, so the sums give the whole model's
bytes per token. Several servers on one GPU share its traffic: it is judged per generated token of
all of them, because NVML counts PCIe bytes per GPU, not per process. A server whose process the
agent does not see on any GPU is not judged (the traffic could belong to anything).

llama.cpp partial offload (-ngl below the layer count) and Ollama's size_vram < size are NOT this:
the layers left on the host are computed there by the CPU, their weights never cross the bus; what
crosses per token is one layer boundary's activations (kilobytes). Those servers stay silent here
unless something else moves weights. Runbook: InferenceWeightsCrossingBus.md.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import common, servers, windows
from hybridmon.agent.detectors.base import DetectorBase, Finding, HistoryReader
from hybridmon.agent.detectors.servers import Server
from hybridmon.exporters.gpu import (PCIE_BYTES, PCIE_SAMPLED_BYTES, PCIE_THROUGHPUT,
                                     PROCESS_MEMORY_USED)
from hybridmon.exporters.inference_names import BY_FIELD, OFFLOAD_BYTES
from hybridmon.exporters.process import TREE_ROOT
from hybridmon.rules import groups
from hybridmon.rules import inference as recorded
from hybridmon.rules import pcie
from hybridmon.rules.process import by_root
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import number, query
from hybridmon.rules.templates import humanize1024
from hybridmon.units import human_bytes, human_rate

GENERATED_TOKENS = BY_FIELD["generated_tokens"]
INPUTS = (GENERATED_TOKENS, OFFLOAD_BYTES, PCIE_BYTES, PCIE_SAMPLED_BYTES, PCIE_THROUGHPUT,
          PROCESS_MEMORY_USED, TREE_ROOT)
HOST_TO_DEVICE = "host_to_device"
SERVER_LABELS = ("server", "endpoint", "model")


class Settings(Section):
    unexplained_bytes_per_token_above: float = 32 * 1024 ** 2
    min_unexplained_bytes_per_second: float = 1e9
    min_generated_tokens_per_second: float = 1.0
    for_seconds: float = 180


# -- PromQL ---------------------------------------------------------------------------------------
# Every step is keyed by the root of the process tree (root_pid, rules.process.by_root): a server's
# listening pid and the processes holding its GPU memory meet there. Every watched process has its
# tree info (the process itself as root when its parent is not watched), so both doors judge
# watched pids only.

# (job, instance, gpu, uuid, root_pid) = 1: the trees holding memory on each GPU
GPU_ROOT = ("max by (job, instance, gpu, uuid, root_pid) "
            + by_root(f"max without (process_name) ({PROCESS_MEMORY_USED.name} * 0 + 1)"))
GPU_COUNT = f"count by (job, instance, root_pid) ({GPU_ROOT})"
H2D = f'sum by (job, instance, gpu, uuid) ({pcie.TRAFFIC}{{direction="{HOST_TO_DEVICE}"}})'


def _root_sum(per_pid: str) -> str:
    return f"sum by (job, instance, root_pid) {by_root(per_pid)}"


def _per_gpu(per_root: str) -> str:
    """A tree figure spread evenly over the GPUs the tree holds memory on, summed per GPU."""
    return (f"sum by (job, instance, gpu, uuid) (\n  {GPU_ROOT}\n  * on (job, instance, root_pid) "
            f"group_left ()\n  ({per_root} / on (job, instance, root_pid) {GPU_COUNT})\n)")


def _over_tree_gpus(per_gpu: str) -> str:
    """A per-GPU figure summed over the GPUs each tree holds memory on."""
    return (f"sum by (job, instance, root_pid) (\n  {per_gpu}\n  * on (job, instance, gpu, uuid) "
            f"group_right ()\n  {GPU_ROOT}\n)")


TOKENS_RATE = f'rate({GENERATED_TOKENS.name}{{pid!=""}}[1m])'
LOADS_RATE = f'rate({OFFLOAD_BYTES.name}{{direction="load",pid!=""}}[1m])'
UNEXPLAINED = _over_tree_gpus(
    f"clamp_min(\n  {H2D}\n  - on (job, instance, gpu, uuid)\n  ({_per_gpu(_root_sum(LOADS_RATE))}\n"
    f"   or {H2D} * 0),\n  0)")
TOKENS_ON_GPUS = _over_tree_gpus(_per_gpu(_root_sum(TOKENS_RATE)))


def servers_of(tokens_selector: str) -> str:
    """One series of 1 per server of `tokens_selector` (a generated-tokens selector), with its
    root_pid."""
    return by_root(f"max by (job, instance, server, endpoint, model, pid) ({tokens_selector} * 0 + 1)")


SERVERS = servers_of(GENERATED_TOKENS.name + '{pid!=""}')


def bytes_per_token(tokens_selector: str) -> str:
    """PromQL, per server of `tokens_selector`: unexplained host->device bytes per generated token
    on its GPUs, unfiltered (the dashboard's line; the alert adds its floors)."""
    return (f"max without (pid, root_pid) (\n{servers_of(tokens_selector)}\n"
            f"* on (job, instance, root_pid) group_left () (\n  {UNEXPLAINED}\n  /\n  {TOKENS_ON_GPUS}\n))")


def alert(s: Settings) -> Alert:
    return Alert(
        "InferenceWeightsCrossingBus",
        "# unexplained host->device bytes/s over the generated tokens/s of the same GPUs, each\n"
        "# side only where it is large enough to matter (a filter keeps the left value)...\n"
        f"max without (pid, root_pid) (\n{SERVERS}\n* on (job, instance, root_pid) group_left () (\n"
        f"  ({UNEXPLAINED} >= {number(s.min_unexplained_bytes_per_second)})\n  /\n"
        f"  ({TOKENS_ON_GPUS} >= {number(s.min_generated_tokens_per_second)})\n"
        f"  > {number(s.unexplained_bytes_per_token_above)}\n))",
        s.for_seconds, "warning",
        f"{recorded.SERVER_NAME} on <instance>: <value|humanize1024>B cross PCIe per generated "
        "token, weights are read over the bus every step",
        f"The GPUs that {recorded.SERVER_NAME} runs on received "
        "<value|humanize1024>B from the host per generated token (1 min rates; host->device PCIe "
        "bytes less the server's own KV offload loads, over the tokens/s generated on those GPUs; "
        f"threshold {humanize1024(s.unexplained_bytes_per_token_above)}B). The server generates "
        "<tokens|humanize> tokens/s. A token's KV cache is at most about 1.6 MiB even for "
        "the largest dense models, and reported KV loads are already subtracted: this much "
        "traffic per token means model weights cross the bus on every decode step, which caps "
        "the server at the link's bandwidth (a leftover --cpu-offload-gb has cut 2,434 to 120 "
        "tokens/s). Check the server for vLLM --cpu-offload-gb / cpu_offload_gb or another "
        "weight-offload option and remove it, giving the weights VRAM instead (a smaller or "
        "quantised model, more GPUs with tensor parallelism, a higher --gpu-memory-utilization "
        "where nothing else needs the VRAM). llama.cpp partial offload (-ngl) and Ollama's "
        "size_vram below size compute host layers on the CPU and do not raise this.",
        queries={"tokens": query("sum without (pid) (rate({}[1m]))", GENERATED_TOKENS.name,
                                 *SERVER_LABELS)},
    )


# -- the agent's door ----------------------------------------------------------------------------

@dataclass(frozen=True)
class GpuShare:
    """What one GPU carries for the servers on it, per second, each tree's figures spread evenly
    over its GPUs."""

    host_to_device: float          # NVML PCIe bytes/s, counter rate else sampled else gauge
    kv_loads: float                # the servers' reported KV offload loads (host->GPU) bytes/s
    tokens: float                  # the servers' generated tokens/s

    @property
    def unexplained(self) -> float:
        return max(0.0, self.host_to_device - self.kv_loads)


def roots_of(history: HistoryReader, now: float) -> dict[str, str]:
    """pid -> root_pid of its tree of watched processes; a pid not listed is not watched."""
    return servers.tree_roots(history, now)


def tree_gpus(history: HistoryReader, now: float, roots: dict[str, str]) -> dict[str, set[tuple[str, str]]]:
    """root_pid -> the (gpu, uuid) its tree's processes hold memory on now."""
    found: dict[str, set[tuple[str, str]]] = {}
    for series in history.series(PROCESS_MEMORY_USED.name):
        root = roots.get(series.labels["pid"])
        if root is not None and windows.latest(series, now) is not None:
            found.setdefault(root, set()).add((series.labels["gpu"], series.labels["uuid"]))
    return found


def _root_rates(history: HistoryReader, metric: str, now: float, roots: dict[str, str],
                **labels: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for series in history.series(metric, **labels):
        root = roots.get(series.labels.get("pid", ""))
        value = windows.rate(series, now, windows.AVERAGE_SECONDS) if root is not None else None
        if root is not None and value is not None:
            totals[root] = totals.get(root, 0.0) + value
    return totals


def gpu_shares(history: HistoryReader, now: float, roots: dict[str, str],
               gpus: dict[str, set[tuple[str, str]]]) -> dict[tuple[str, str], GpuShare]:
    """(gpu, uuid) -> GpuShare, for the GPUs with host->device traffic now."""
    traffic = common.gpu_traffic(history, PCIE_BYTES.name, PCIE_SAMPLED_BYTES.name, PCIE_THROUGHPUT.name, now)
    tokens = _root_rates(history, GENERATED_TOKENS.name, now, roots)
    loads = _root_rates(history, OFFLOAD_BYTES.name, now, roots, direction="load")
    shares = {}
    for key, directions in traffic.items():
        if HOST_TO_DEVICE not in directions:
            continue
        on_it = [root for root, held in gpus.items() if key in held]
        shares[key] = GpuShare(
            directions[HOST_TO_DEVICE],
            sum(loads.get(root, 0.0) / len(gpus[root]) for root in on_it),
            sum(tokens.get(root, 0.0) / len(gpus[root]) for root in on_it))
    return shares


class Detector(DetectorBase):
    """InferenceWeightsCrossingBus per server (labels server, endpoint, model), warning. Over the
    GPUs its process tree holds memory on: the sum of max(0, host->device bytes/s - the KV
    offload loads/s of the servers there) over the sum of the tokens/s generated there (each
    tree's figures split evenly over its GPUs) above unexplained_bytes_per_token_above, with at
    least min_unexplained_bytes_per_second unexplained and min_generated_tokens_per_second
    generated. Rates over 1 min, as the rule's."""

    name = "weight_offload"
    alertnames = ("InferenceWeightsCrossingBus",)
    min_history_seconds = windows.AVERAGE_SECONDS

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.alert = alert(config)

    def evaluate(self, history: HistoryReader, now: float) -> list[Finding]:
        roots = roots_of(history, now)
        scraped = [server for server in servers.scraped(history, now) if server.pid in roots]
        if not scraped:
            return []
        gpus = tree_gpus(history, now, roots)
        shares = gpu_shares(history, now, roots, gpus)
        findings = []
        for server in scraped:
            mine = sorted(gpus.get(roots[server.pid], set()) & set(shares))
            found = self._judge(history, server, mine, shares, now)
            if found:
                findings.append(found)
        return findings

    def _judge(self, history: HistoryReader, server: Server, mine: Iterable[tuple[str, str]],
               shares: dict[tuple[str, str], GpuShare], now: float) -> Finding | None:
        c = self.config
        mine = list(mine)
        if servers.series_of(history, GENERATED_TOKENS.name, server) is None or not mine:
            return None
        unexplained = sum(shares[gpu].unexplained for gpu in mine)
        tokens = sum(shares[gpu].tokens for gpu in mine)
        if unexplained < c.min_unexplained_bytes_per_second or tokens < c.min_generated_tokens_per_second:
            return None
        per_token = unexplained / tokens
        if per_token <= c.unexplained_bytes_per_token_above:
            return None
        own = servers.rate(servers.series_of(history, GENERATED_TOKENS.name, server), now,
                           windows.AVERAGE_SECONDS) or 0.0
        h2d = sum(shares[gpu].host_to_device for gpu in mine)
        loads = sum(shares[gpu].kv_loads for gpu in mine)
        return finding(
            self.alert, server.labels, per_token, c.unexplained_bytes_per_token_above, unit="bytes",
            values={"tokens": own},
            details={"unexplained_bytes_per_token": per_token,
                     "host_to_device_bytes_per_second": h2d, "kv_offload_load_bytes_per_second": loads,
                     "unexplained_bytes_per_second": unexplained, "tokens_per_second_on_gpus": tokens,
                     "server_tokens_per_second": own, "gpus": ",".join(gpu for gpu, _ in mine),
                     "summary_figures": f"{human_rate(h2d)} in, {human_rate(loads)} KV loads, "
                                        f"{human_bytes(per_token)} per token",
                     "pid": server.pid})


# -- promtool cases ------------------------------------------------------------------------------


FAMILY = AlertFamily(
    section="weight_offload",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group=groups.INFERENCE,
    detector=Detector,
    alerts=lambda t: (alert(t.weight_offload),),
    collectors=("inference", "gpu", "process"),
    lookback_seconds=lambda settings: 0.0,
    scenario="weights_crossing_bus",
)
