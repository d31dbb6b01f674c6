"""InferenceWeightsCrossingBus, and the account of the bus it keeps: per GPU and direction, where
the host<->device bytes NVML counts go (KV offload the servers report, weights a server is
configured to read over the bus, and what stays unattributed).

Weights are named only on positive evidence. vLLM's and SGLang's --cpu-offload-gb N keep N GiB of
weights per GPU in pinned host memory, which the GPU reads through UVA "on the fly in each model
forward pass" (vLLM's EngineArgs help); no metric says so, so the command line
(hybridmon_process_weights_offload_bytes) is the evidence and the PCIe counters the measure (a
leftover --cpu-offload-gb was reported to cut 2,434 to 120 tokens/s, vllm#57771). Every forward
pass reads the offloaded bytes once on each GPU, and a decode step yields one token per running
request, so weights explain at most

    weights per token = offloaded bytes per GPU x its GPUs / running requests

Per server, over the GPUs its process tree holds memory on (NVML per-process memory and
root_pid of hybridmon_process_info, so vLLM's engine core and TP workers count for the API server
that listens):

    unexplained = sum over its GPUs of max(0, host->device bytes/s - KV loads/s on that GPU)
    tokens      = sum over its GPUs of the generated tokens/s on that GPU
    value       = min(unexplained / tokens, weights per token)  > unexplained_bytes_per_token_above

KV loads are what the servers report moving host->GPU: vLLM's offload connector, SGLang's HiCache
load-back, vLLM 0.33's HiSparse host->device bytes. Traffic nothing explains is NOT weights
without the evidence: LMCache's in-process CPU tier, vLLM V0's swap space and a connector without
byte counters move KV and publish no bytes, and another process's copies count too. The account
calls it unattributed and lists the leads that would attribute it.

llama.cpp partial offload (-ngl below the layer count) and Ollama's size_vram < size compute the
host layers on the CPU when decoding, so their weights do not cross per generated token; ggml's
CUDA backend copies them to the GPU only for batches of 32 tokens and more (ggml-cuda.cu
offload_op), that is in prompt processing. With no prompt-side byte rate to check against, they
are a lead, not a claim.

A server spread over n GPUs (tensor parallel) puts 1/n of its tokens and KV loads on each. Several
servers on one GPU share its traffic: NVML counts PCIe bytes per GPU, not per process. A server
whose process the agent does not see on any GPU is not judged. Runbook:
InferenceWeightsCrossingBus.md.

The account is PCIe's. On a GPU in NVLink-C2C mode (GH200, GB200; issue 29) the servers' KV loads
and stores and host-resident weights cross C2C, not PCIe: its account credits none of them to the
PCIe bytes (which stay near zero) and says where they went in a lead, so C2C-moved KV is never
read as PCIe traffic, attributed or not.
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import common, servers, windows
from hybridmon.agent.detectors.base import DetectorBase, Finding, HistoryReader
from hybridmon.agent.detectors.links import (DEVICE_TO_HOST, HOST_TO_DEVICE, KV_OFFLOAD, UNATTRIBUTED,
                                             WEIGHTS, BusAccount)
from hybridmon.agent.detectors.servers import Server
from hybridmon.exporters.bench import TIMESTAMP as BENCH_FINISHED
from hybridmon.exporters.gpu import (C2C_MODE, C2C_THROUGHPUT, PCIE_BYTES, PCIE_SAMPLED_BYTES, PCIE_THROUGHPUT,
                                     PROCESS_MEMORY_USED)
from hybridmon.exporters.inference_names import BY_FIELD, OFFLOAD_BYTES
from hybridmon.exporters.process import INFO, WEIGHTS_OFFLOAD
from hybridmon.rules import groups
from hybridmon.rules import inference as recorded
from hybridmon.rules import pcie
from hybridmon.rules.process import by_root
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import number, query
from hybridmon.rules.templates import humanize1024
from hybridmon.units import human_bytes, human_rate

GENERATED_TOKENS = BY_FIELD["generated_tokens"]
RUNNING = BY_FIELD["requests_running"]
SWAPPED = BY_FIELD["requests_swapped"]
HOST_TIER_BYTES = BY_FIELD["kv_offload_host_tier_bytes"]
HOST_TIER_TOKENS = BY_FIELD["kv_offload_host_tier_tokens"]
IN_LMCACHE = BY_FIELD["kv_offload_in_lmcache"]
MODEL_ON_HOST = BY_FIELD["model_host_memory_bytes"]
INPUTS = (GENERATED_TOKENS, RUNNING, OFFLOAD_BYTES, PCIE_BYTES, PCIE_SAMPLED_BYTES, PCIE_THROUGHPUT,
          PROCESS_MEMORY_USED, INFO, WEIGHTS_OFFLOAD, C2C_MODE)
# The lead of a GPU in NVLink-C2C mode: what its PCIe account leaves out, and where to see it.
OVER_C2C_LEAD = ("this GPU runs in NVLink-C2C mode: its servers' KV offload and host-resident weights "
                 f"cross C2C ({C2C_THROUGHPUT.name}), not PCIe, and this PCIe account credits none of them")
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
# The evidence, per tree: the bytes per GPU its command lines keep on the host, times its GPUs,
# over its running requests (at least one): the most weights a generated token can need.
RUNNING_NOW = RUNNING.name + '{pid!=""}'
WEIGHTS_PER_TOKEN = (
    f"max by (job, instance, root_pid) {by_root(WEIGHTS_OFFLOAD.name)}\n"
    f"* on (job, instance, root_pid) {GPU_COUNT}\n"
    f"/ on (job, instance, root_pid) (\n  clamp_min({_root_sum(RUNNING_NOW)}, 1)\n"
    f"  or on (job, instance, root_pid) {_root_sum(WEIGHTS_OFFLOAD.name)} * 0 + 1\n)")


def servers_of(tokens_selector: str) -> str:
    """One series of 1 per server of `tokens_selector` (a generated-tokens selector), with its
    root_pid."""
    return by_root(f"max by (job, instance, server, endpoint, model, pid) ({tokens_selector} * 0 + 1)")


SERVERS = servers_of(GENERATED_TOKENS.name + '{pid!=""}')


def bytes_per_token(tokens_selector: str) -> str:
    """PromQL, per server of `tokens_selector`: unexplained host->device bytes per generated token
    on its GPUs, unfiltered and whatever moved them (the dashboard's line)."""
    return (f"max without (pid, root_pid) (\n{servers_of(tokens_selector)}\n"
            f"* on (job, instance, root_pid) group_left () (\n  {UNEXPLAINED}\n  /\n  {TOKENS_ON_GPUS}\n))")


def alert(s: Settings) -> Alert:
    per_token = (f"({UNEXPLAINED} >= {number(s.min_unexplained_bytes_per_second)})\n  /\n"
                 f"  ({TOKENS_ON_GPUS} >= {number(s.min_generated_tokens_per_second)})")
    return Alert(
        "InferenceWeightsCrossingBus",
        "# unexplained host->device bytes/s over the generated tokens/s of the same GPUs (each side\n"
        "# only where large enough to matter), at most what the weights the tree's command line keeps\n"
        "# on the host can need per token (no such option: no alert)...\n"
        f"max without (pid, root_pid) (\n{SERVERS}\n* on (job, instance, root_pid) group_left () (\n"
        f"  (\n    (({per_token}) <= ({WEIGHTS_PER_TOKEN}))\n    or\n"
        f"    (({WEIGHTS_PER_TOKEN}) < ({per_token}))\n  )\n"
        f"  > {number(s.unexplained_bytes_per_token_above)}\n))",
        s.for_seconds, "warning",
        f"{recorded.SERVER_NAME} on <instance>: <value|humanize1024>B of offloaded weights cross PCIe "
        "per generated token",
        f"The GPUs that {recorded.SERVER_NAME} runs on received "
        "<value|humanize1024>B from the host per generated token that its command line's weight "
        "offload accounts for (1 min rates; host->device PCIe bytes less the servers' own KV "
        "loads, over the tokens/s generated on those GPUs, at most the offloaded bytes per GPU "
        "times its GPUs over its running requests; threshold "
        f"{humanize1024(s.unexplained_bytes_per_token_above)}B). The server generates "
        "<tokens|humanize> tokens/s. Its processes run with --cpu-offload-gb: those weights stay "
        "in host memory and every forward pass reads them over the bus, which caps the server at "
        "the link's bandwidth (a leftover --cpu-offload-gb has cut 2,434 to 120 tokens/s). Remove "
        "the option and give the weights VRAM instead (a smaller or quantised model, more GPUs "
        "with tensor parallelism, a higher --gpu-memory-utilization where nothing else needs the "
        "VRAM), or keep it only where the throughput it leaves is enough.",
        queries={"tokens": query("sum without (pid) (rate({}[1m]))", GENERATED_TOKENS.name,
                                 *SERVER_LABELS)},
    )


# -- the agent's door ----------------------------------------------------------------------------

@dataclass(frozen=True)
class GpuShare:
    """What one GPU carries for the servers on it, per second, each tree's figures spread evenly
    over its GPUs (weights_read: every forward pass of a tree reads its offloaded bytes on each
    of its GPUs, so it is not spread)."""

    host_to_device: float          # NVML PCIe bytes/s, counter rate else sampled else gauge
    kv_loads: float                # the servers' reported KV loads (host->GPU) bytes/s
    tokens: float                  # the servers' generated tokens/s
    device_to_host: float = 0.0
    kv_stores: float = 0.0         # the servers' reported KV stores (GPU->host) bytes/s
    weights_read: float = 0.0      # what the trees' weight offload can read per second, at most

    @property
    def unexplained(self) -> float:
        return max(0.0, self.host_to_device - self.kv_loads)

    def account(self, leads: tuple[str, ...], over_c2c: bool = False) -> BusAccount:
        """Where the PCIe bytes went; `over_c2c`: the GPU is in NVLink-C2C mode, whose KV and
        weights cross C2C, so none of its PCIe bytes are theirs."""
        if over_c2c:
            return GpuShare(self.host_to_device, 0.0, self.tokens, self.device_to_host).account(
                (OVER_C2C_LEAD, *leads))
        kv_in = min(self.host_to_device, self.kv_loads)
        weights = min(self.host_to_device - kv_in, self.weights_read)
        kv_out = min(self.device_to_host, self.kv_stores)
        return BusAccount(
            {HOST_TO_DEVICE: self.host_to_device, DEVICE_TO_HOST: self.device_to_host},
            {HOST_TO_DEVICE: {KV_OFFLOAD: kv_in, WEIGHTS: weights,
                              UNATTRIBUTED: self.host_to_device - kv_in - weights},
             DEVICE_TO_HOST: {KV_OFFLOAD: kv_out, WEIGHTS: 0.0, UNATTRIBUTED: self.device_to_host - kv_out}},
            leads)


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


def _root_figures(history: HistoryReader, metric: str, now: float, roots: dict[str, str],
                  reduce=None, combine=sum, **labels: str) -> dict[str, float]:
    """root_pid -> `combine` over its watched pids of `reduce` (default: the 1-minute rate)."""
    found: dict[str, list[float]] = {}
    for series in history.series(metric, **labels):
        root = roots.get(series.labels.get("pid", ""))
        if root is None:
            continue
        value = (reduce(series, now) if reduce is not None
                 else windows.rate(series, now, windows.AVERAGE_SECONDS))
        if value is not None:
            found.setdefault(root, []).append(value)
    return {root: combine(values) for root, values in found.items()}


@dataclass(frozen=True)
class Trees:
    """Each process tree's figures now, by root_pid."""

    gpus: dict[str, set[tuple[str, str]]]
    tokens: dict[str, float]
    kv_loads: dict[str, float]
    kv_stores: dict[str, float]
    running: dict[str, float]
    weights_per_gpu: dict[str, float]         # the evidence: bytes per GPU kept on the host

    def weights_per_token(self, root: str) -> float | None:
        """The most weight bytes a generated token of this tree can need; None without evidence."""
        offloaded = self.weights_per_gpu.get(root)
        if offloaded is None:
            return None
        return offloaded * len(self.gpus.get(root, ())) / max(self.running.get(root, 1.0), 1.0)

    def weights_read(self, root: str) -> float:
        """Bytes/s each of its GPUs reads for its offloaded weights, at most: one read a step."""
        offloaded = self.weights_per_gpu.get(root)
        if offloaded is None:
            return 0.0
        return offloaded * self.tokens.get(root, 0.0) / max(self.running.get(root, 1.0), 1.0)


def trees(history: HistoryReader, now: float, roots: dict[str, str]) -> Trees:
    return Trees(
        tree_gpus(history, now, roots),
        _root_figures(history, GENERATED_TOKENS.name, now, roots),
        _root_figures(history, OFFLOAD_BYTES.name, now, roots, direction="load"),
        _root_figures(history, OFFLOAD_BYTES.name, now, roots, direction="store"),
        _root_figures(history, RUNNING.name, now, roots, reduce=windows.latest),
        _root_figures(history, WEIGHTS_OFFLOAD.name, now, roots, reduce=windows.latest, combine=max))


def gpu_shares(history: HistoryReader, now: float, roots: dict[str, str],
               gpus: dict[str, set[tuple[str, str]]] | None = None,
               found: Trees | None = None) -> dict[tuple[str, str], GpuShare]:
    """(gpu, uuid) -> GpuShare, for the GPUs with host<->device traffic now."""
    found = found or trees(history, now, roots)
    gpus = found.gpus if gpus is None else gpus
    traffic = common.gpu_traffic(history, PCIE_BYTES.name, PCIE_SAMPLED_BYTES.name, PCIE_THROUGHPUT.name, now)
    shares = {}
    for key, directions in traffic.items():
        on_it = [root for root, held in gpus.items() if key in held]

        def spread(by_root: dict[str, float]) -> float:
            return sum(by_root.get(root, 0.0) / len(gpus[root]) for root in on_it)

        shares[key] = GpuShare(
            directions.get(HOST_TO_DEVICE, 0.0), spread(found.kv_loads), spread(found.tokens),
            directions.get(DEVICE_TO_HOST, 0.0), spread(found.kv_stores),
            sum(found.weights_read(root) for root in on_it))
    return shares


# LMCache inside vLLM publishes through vLLM's /metrics (lmcache/observability.py): tokens looked
# up and hit, its host cache's bytes, store and retrieve times; no bytes moved to or from the GPU.
LMCACHE_SIGNS = tuple(BY_FIELD[name] for name in ("prefix_cache_queried_tokens", "prefix_cache_hit_tokens",
                                                   "kv_offload_host_cache_bytes"))


def leads(history: HistoryReader, now: float, roots: dict[str, str], on_gpu: set[str],
          gpu: tuple[str, str] | None = None) -> tuple[str, ...]:
    """What would attribute the unattributed bytes of GPU `gpu`, whose process trees are `on_gpu`
    (root pids): movers that are configured or busy there but publish no byte counter, and a
    benchmark run that finished within the minute judged (so its copies are in it)."""
    def current(spec, **labels: str) -> list[tuple[Server, float]]:
        found = []
        for series in history.series(spec.name, **labels):
            value = windows.latest(series, now)
            if value and roots.get(series.labels.get("pid", "")) in on_gpu:
                found.append((servers.server_of(series), value))
        return found

    counted = {server.pid for server, _ in current(OFFLOAD_BYTES)}
    found = []
    for spec in LMCACHE_SIGNS:
        for server, _ in current(spec, server="lmcache"):
            found.append(f"LMCache runs in the engine at {server.endpoint}: its CPU tier moves KV "
                         "over the bus and publishes tokens, not bytes")
    for server, _ in current(IN_LMCACHE):
        found.append(f"{server.short_name} hands its KV offload to LMCache's server, whose bytes are on "
                     "LMCache's own exporter (port 9090 unless --prometheus-port)")
    for server, swapped in current(SWAPPED):
        found.append(f"{server.short_name} holds {swapped:.0f} requests' KV in its CPU swap space (V0 "
                     "--swap-space), which crosses the bus and has no byte counter")
    for spec in (HOST_TIER_BYTES, HOST_TIER_TOKENS):
        for server, _ in current(spec):
            if server.pid not in counted:
                found.append(f"{server.short_name} has a host KV tier but its connector publishes no "
                             "byte counter")
    for server, on_host in current(MODEL_ON_HOST):
        found.append(f"{server.short_name} keeps {human_bytes(on_host)} of its model in host memory: "
                     "prompt batches copy those layers' weights to the GPU")
    if gpu is not None:
        for series in history.series(BENCH_FINISHED.name, gpu=gpu[0], uuid=gpu[1]):
            finished = windows.latest(series, now)
            if finished is not None and now - windows.AVERAGE_SECONDS <= finished <= now:
                found.append(f"hybridmon bench finished a run on this GPU {now - finished:.0f} s ago: its "
                             "copies filled the link while it ran")
    return tuple(dict.fromkeys(found))


class Detector(DetectorBase):
    """InferenceWeightsCrossingBus per server (labels server, endpoint, model), warning, only for
    a server whose process tree runs with --cpu-offload-gb. Over the GPUs its tree holds memory
    on: the sum of max(0, host->device bytes/s - the KV loads/s of the servers there) over the sum
    of the tokens/s generated there (each tree's figures split evenly over its GPUs), at most the
    offloaded bytes per GPU x its GPUs / its running requests, above
    unexplained_bytes_per_token_above, with at least min_unexplained_bytes_per_second unexplained
    and min_generated_tokens_per_second generated. Rates over 1 min, as the rule's. Publishes each
    GPU's BusAccount as its figures."""

    name = "weight_offload"
    alertnames = ("InferenceWeightsCrossingBus",)
    min_history_seconds = windows.AVERAGE_SECONDS

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.alert = alert(config)
        self.figures = {}

    def evaluate(self, history: HistoryReader, now: float) -> list[Finding]:
        roots = roots_of(history, now)
        found = trees(history, now, roots)
        shares = gpu_shares(history, now, roots, found=found)
        scraped = [server for server in servers.scraped(history, now) if server.pid in roots]
        over_c2c = common.c2c_gpus(history, now)
        self.figures = {
            key: share.account(leads(history, now, roots, {root for root, held in found.gpus.items() if key in held},
                                     key), over_c2c=key in over_c2c)
            for key, share in shares.items()}
        findings = []
        for server in scraped:
            mine = sorted(found.gpus.get(roots[server.pid], set()) & set(shares))
            judged = self._judge(history, server, roots[server.pid], mine, shares, found, now)
            if judged:
                findings.append(judged)
        return findings

    def _judge(self, history: HistoryReader, server: Server, root: str, mine: list[tuple[str, str]],
               shares: dict[tuple[str, str], GpuShare], found: Trees, now: float) -> Finding | None:
        c = self.config
        bound = found.weights_per_token(root)
        if bound is None or not mine or servers.series_of(history, GENERATED_TOKENS.name, server) is None:
            return None
        unexplained = sum(shares[gpu].unexplained for gpu in mine)
        tokens = sum(shares[gpu].tokens for gpu in mine)
        if unexplained < c.min_unexplained_bytes_per_second or tokens < c.min_generated_tokens_per_second:
            return None
        per_token = min(unexplained / tokens, bound)
        if per_token <= c.unexplained_bytes_per_token_above:
            return None
        own = servers.rate(servers.series_of(history, GENERATED_TOKENS.name, server), now,
                           windows.AVERAGE_SECONDS) or 0.0
        h2d = sum(shares[gpu].host_to_device for gpu in mine)
        loads = sum(shares[gpu].kv_loads for gpu in mine)
        return finding(
            self.alert, server.labels, per_token, c.unexplained_bytes_per_token_above, unit="bytes",
            values={"tokens": own},
            details={"weights_bytes_per_token": per_token, "unexplained_bytes_per_token": unexplained / tokens,
                     "weights_offload_bytes_per_gpu": found.weights_per_gpu[root],
                     "weights_bytes_per_token_at_most": bound,
                     "host_to_device_bytes_per_second": h2d, "kv_offload_load_bytes_per_second": loads,
                     "unexplained_bytes_per_second": unexplained, "tokens_per_second_on_gpus": tokens,
                     "server_tokens_per_second": own, "gpus": ",".join(gpu for gpu, _ in mine),
                     "summary_figures": f"{human_rate(h2d)} in, {human_rate(loads)} KV loads, "
                                        f"{human_bytes(per_token)} of weights per token "
                                        f"({human_bytes(found.weights_per_gpu[root])} per GPU offloaded)",
                     "pid": server.pid})


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
