"""What the inference servers say about themselves: a KV cache under pressure (full while requests
are preempted, or offload loads filling the PCIe link), and a server whose /metrics cannot be read.
"""
from __future__ import annotations

from hybridmon.agent.detectors import common, servers, windows
from hybridmon.agent.detectors.base import Finding, InferenceScrape, KvOffloadPressure
from hybridmon.agent.detectors.pcie import (GENERATION, MEASURED_CAPACITY, WIDTH, PcieStarvationDetector,
                                  link_name)
from hybridmon.agent.detectors.servers import Server
from hybridmon.agent.history import History

GPU_PROCESS_MEMORY = "hybridmon_gpu_process_memory_used_bytes"
# Why a scrape failed (exporters/inference_names.py SCRAPE_ERROR), in words, and the first check.
SCRAPE_REASONS = {
    "timeout": ("gave no complete answer within [inference] timeout_seconds",
                "a server stuck or overloaded; `curl -m 5 -sS -o /dev/null -w '%{time_total}' URL`"),
    "refused": ("refused the connection: nothing listens there",
                "the server is down or moved port; `ss -ltnp` and the server's own log"),
    "connection": ("failed at the connection (reset, TLS or DNS)", "`curl -v URL`"),
    "http_status": ("answered with an HTTP status other than 200",
                    "metrics switched off (llama-server needs --metrics, SGLang --enable-metrics) or a "
                    "proxy in the way; `curl -i URL`"),
    "too_large": ("answered a body over [inference] max_body_bytes",
                  "a label with unbounded values (one series per request) or the wrong URL"),
    "not_prometheus": ("answered something that is not the Prometheus text format (an HTML page)",
                       "the URL points at a web UI or a proxy's error page; `curl -s URL | head`"),
    "not_json": ("answered something that is not JSON (Ollama's /api/ps)", "`curl -s URL | head`"),
    "unknown_server": ("answered metrics of no server hybridmon knows",
                       "name the server in [inference] endpoints or check the URL"),
    "missing_families": ("answered, but a family every version of the server publishes is missing: "
                         "its metric names changed", "compare `curl -s URL` with docs/inference-servers.md"),
}


def gpus_of(history: History, pid: str, now: float) -> set[tuple[str, str]]:
    """(gpu, uuid) of the GPUs process `pid` holds memory on now (NVML per-process memory)."""
    if not pid:
        return set()
    return {(s.labels["gpu"], s.labels["uuid"]) for s in history.series(GPU_PROCESS_MEMORY, pid=pid)
            if windows.latest(s, now) is not None}


class KvOffloadPressureDetector:
    """InferenceKvOffloadPressure, per server (labels server, endpoint, model, reason), warning.

    kv_cache_full: KV cache usage (avg 1m) >= kv_cache_usage_at_least and the preemption rate
    (1m) > preemptions_per_second_above. offload_link: KV offload loads (rate 1m of the load
    direction) >= offload_load_share_of_capacity x the host->device capacity of the GPUs the
    server's process holds memory on (every GPU when the server is tied to no process, or its
    process holds none); capacity per GPU as GpuPcieStarvation reads it: measured by
    `hybridmon bench`, else the current link's theoretical rate."""

    name = "kv_offload_pressure"
    alertnames = ("InferenceKvOffloadPressure",)
    min_history_seconds = windows.AVERAGE_SECONDS

    def __init__(self, config: KvOffloadPressure) -> None:
        self.config = config

    def evaluate(self, history: History, now: float) -> list[Finding]:
        findings = []
        capacities: dict[tuple[str, str], tuple[float, str]] | None = None
        for server in servers.scraped(history, now):
            finding = self._cache_full(history, server, now)
            if finding:
                findings.append(finding)
            loads = servers.rate(servers.series_of(history, servers.OFFLOAD_BYTES, server,
                                                   direction="load"), now, windows.AVERAGE_SECONDS)
            if not loads:
                continue
            if capacities is None:
                capacities = self.capacities(history, now)
            mine = gpus_of(history, server.pid, now) & set(capacities) or set(capacities)
            capacity = sum(capacities[gpu][0] for gpu in mine)
            if capacity > 0 and loads >= self.config.offload_load_share_of_capacity * capacity:
                findings.append(self._link_full(server, loads, capacity,
                                                {gpu: capacities[gpu] for gpu in sorted(mine)}))
        return findings

    def capacities(self, history: History, now: float) -> dict[tuple[str, str], tuple[float, str]]:
        """(gpu, uuid) -> (host->device bytes/s, where it comes from: measured or Gen4 x16)."""
        generation = common.gpu_latest(history, GENERATION, now)
        width = common.gpu_latest(history, WIDTH, now)
        measured = common.gpu_directions(history, MEASURED_CAPACITY, now)
        found = {}
        for gpu in set(generation) | set(measured):
            capacity = PcieStarvationDetector.link_capacity(
                measured.get(gpu, {}).get("host_to_device"), generation.get(gpu), width.get(gpu))
            if capacity is not None:
                source = capacity[1] if capacity[1] == "measured" else \
                    f"theoretical {link_name(generation[gpu], width[gpu])}"
                found[gpu] = (capacity[0], source)
        return found

    def _cache_full(self, history: History, server: Server, now: float) -> Finding | None:
        c = self.config
        usage_series = servers.series_of(history, servers.KV_CACHE_USAGE, server)
        usage = None if usage_series is None else windows.avg_over_time(usage_series, now)
        preemptions = servers.rate(servers.series_of(history, servers.PREEMPTIONS, server), now,
                                   windows.AVERAGE_SECONDS)
        if (usage is None or preemptions is None or usage < c.kv_cache_usage_at_least
                or preemptions <= c.preemptions_per_second_above):
            return None
        return Finding(
            alertname="InferenceKvOffloadPressure",
            severity="warning",
            labels={**server.labels, "reason": "kv_cache_full"},
            value=usage,
            threshold=c.kv_cache_usage_at_least,
            unit="ratio",
            for_seconds=c.for_seconds,
            summary=(f"{server.name}: KV cache {common.percent(usage)} full, "
                     f"{servers.human_count(preemptions)} requests preempted per second"),
            description=(
                f"{server.name} has its GPU KV cache {common.percent(usage)} full (1 min average; "
                f"threshold {common.percent(c.kv_cache_usage_at_least)}) and preempts "
                f"{servers.human_count(preemptions)} requests per second (threshold: more than "
                f"{c.preemptions_per_second_above:g}). A preempted request loses its KV blocks and "
                f"is recomputed or reloaded from the offload tier: its tokens stop, time to first "
                f"token and inter-token latency jump. First: lower the concurrency or context "
                f"limits (vLLM --max-num-seqs, --max-model-len), give the KV cache more VRAM "
                f"(--gpu-memory-utilization, a quantised KV cache), or add a host-memory offload tier."),
            details={"kv_cache_usage_ratio": usage, "preemptions_per_second": preemptions,
                     "pid": server.pid},
        )

    def _link_full(self, server: Server, loads: float, capacity: float,
                   gpus: dict[tuple[str, str], tuple[float, str]]) -> Finding:
        c = self.config
        share = loads / capacity
        links = ", ".join(f"GPU {gpu[0]} {common.human_rate(rate)} ({source})"
                          for gpu, (rate, source) in gpus.items())
        details: dict[str, float | str] = {
            "kv_offload_load_bytes_per_second": loads, "capacity_bytes_per_second": capacity,
            "gpus": ",".join(gpu[0] for gpu in gpus), "pid": server.pid}
        return Finding(
            alertname="InferenceKvOffloadPressure",
            severity="warning",
            labels={**server.labels, "reason": "offload_link"},
            value=share,
            threshold=c.offload_load_share_of_capacity,
            unit="ratio",
            for_seconds=c.for_seconds,
            summary=(f"{server.name}: KV offload loads {common.human_rate(loads)}, "
                     f"{common.percent(share)} of the host->device link"),
            description=(
                f"{server.name} loads {common.human_rate(loads)} of offloaded KV cache from host "
                f"memory into the GPU (1 min rate): {common.percent(share)} of the "
                f"{common.human_rate(capacity)} host->device capacity of its GPUs ({links}; "
                f"threshold {common.percent(c.offload_load_share_of_capacity)}). The loads alone "
                f"fill the link: every request whose blocks were offloaded waits for the copy, and "
                f"weights or other transfers queue behind it. First: keep the hot blocks in VRAM "
                f"(more --gpu-memory-utilization, a quantised KV cache, fewer concurrent long "
                f"contexts), and check the link runs at its full generation and width."),
            details=details,
        )


class ScrapeFailingDetector:
    """InferenceServerScrapeFailing, per endpoint and reason, warning: the endpoint's last scrape
    failed (hybridmon_inference_scrape_error is present in the collector's latest run)."""

    name = "inference_scrape"
    alertnames = ("InferenceServerScrapeFailing",)
    min_history_seconds = 0.0

    def __init__(self, config: InferenceScrape) -> None:
        self.config = config

    def evaluate(self, history: History, now: float) -> list[Finding]:
        last_scrape = {series.labels["endpoint"]: _last_time(series, now)
                       for series in history.series(servers.SCRAPE_SUCCESS)}
        findings = []
        for series in sorted(history.series(servers.SCRAPE_ERROR),
                             key=lambda s: (s.labels["endpoint"], s.labels["reason"])):
            endpoint, reason = series.labels["endpoint"], series.labels["reason"]
            # In the endpoint's latest scrape, as Prometheus sees a series until it goes stale.
            at = _last_time(series, now)
            if at is not None and last_scrape.get(endpoint) == at:
                findings.append(self._finding(endpoint, reason))
        return findings

    def _finding(self, endpoint: str, reason: str) -> Finding:
        what, first = SCRAPE_REASONS.get(reason, (f"failed ({reason})", "`curl -v URL`"))
        wait = common.human_duration(self.config.for_seconds)
        return Finding(
            alertname="InferenceServerScrapeFailing",
            severity="warning",
            labels={"endpoint": endpoint, "reason": reason},
            value=1.0,
            threshold=1.0,
            unit="",
            for_seconds=self.config.for_seconds,
            summary=f"Inference server at {endpoint} cannot be read: it {what.split(':')[0]}",
            description=(
                f"The inference server at {endpoint} {what} (reason {reason}), at every scrape for "
                f"{wait} or more (threshold: {wait}). Either the server is down or failing, or its "
                f"metrics are: its tokens/s, latency and KV cache figures are missing from every "
                f"finding and dashboard until it answers. First: {first.replace('URL', endpoint)}."),
            details={"reason": reason},
        )


def _last_time(series, now: float) -> float | None:
    """Time of the series' last point at most a minute before `now`."""
    times, _ = windows.window(series, now, windows.INSTANT_LOOKBACK_SECONDS)
    return times[-1] if times else None
