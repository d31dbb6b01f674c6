"""The status page's tiered-KV view (issue 31): per inference server, the figures by which the
seeds' experiment H10 compared a single-tier and a tiered KV cache (share of requests preempted,
prefix-cache hits, time to first token), with the host tier's traffic and size beside them.

Two shapes, both from agent/status/trends.py's hour (no series read twice):
- `comparison_html`: one table over the last hour, a column per server of the host, so a
  single-tier and a tiered server (or one server before and after a change, as two endpoints)
  read side by side as H10's table does. Figures as rows keep it a phone's width with two servers.
- `tier_plots`: each server's time to first token, inter-token latency and offload traffic over
  the hour, in its own card.

Which hits a server's hit counter holds (exporters/inference_names.py): vLLM's
vllm:prefix_cache_hits counts its GPU cache only, the offload tier's hits are external
(0.33's prompt_tokens_cached_by_source sums to prefix_cache_hits + external_prefix_cache_hits,
docs/server-metric-names/vllm-0.33.0.txt:117); SGLang's cached_tokens_total and LMCache MP's
lookup_hit_tokens count every tier, host hits among them. No server's disk or remote tier hits
are read yet, so the view has no such row.
"""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from hybridmon.agent.detectors.servers import DISPLAY_NAMES, human_latency
from hybridmon.agent.status.template import card, paragraph, table
from hybridmon.agent.status.trends import Trends
from hybridmon.exporters.inference_names import BY_FIELD, HISTOGRAM_SPECS, OFFLOAD_BYTES
from hybridmon.units import human_bytes, human_rate

# Servers whose prefix_cache_hit_tokens include the host tier's hits (see the module doc).
HITS_COUNT_EVERY_TIER = frozenset({"sglang", "lmcache"})


def fine_percent(ratio: float) -> str:
    """A share with one decimal: H10's figures are 0.5 % and 4.5 %, which whole percents lose."""
    return f"{ratio * 100:.1f} %"


@dataclass(frozen=True)
class TierFigures:
    """One server's last hour; None where it publishes nothing to compute a figure from."""

    preempted_share: float | None = None     # preemptions over requests finished
    device_hit_share: float | None = None    # prompt tokens found on the GPU, over those looked up
    host_hit_share: float | None = None      # ... found in host memory (the offload tier)
    hit_share: float | None = None           # ... found in any tier
    time_to_first_token_mean: float | None = None   # seconds
    inter_token_latency_mean: float | None = None   # seconds
    loads_per_second: float | None = None    # KV bytes host -> GPU
    stores_per_second: float | None = None   # KV bytes GPU -> host
    host_tier_bytes: float | None = None     # configured size of the host tier
    host_cache_bytes: float | None = None    # what the tier holds (LMCache)
    host_tier_used_share: float | None = None  # tokens held over its capacity in tokens (SGLang)

    def any(self) -> bool:
        return any(value is not None for value in vars(self).values())


def tier_figures(trends: Trends, key: tuple[str, ...]) -> TierFigures:
    server, endpoint, model, pid = key
    labels = {"server": server, "endpoint": endpoint, "model": model, "pid": pid}

    def grown(spec, **extra: str) -> float | None:
        found = trends.increase(spec, **labels, **extra)
        return found[0] if found is not None else None

    def ratio(numerator: float | None, denominator: float | None) -> float | None:
        return numerator / denominator if numerator is not None and denominator else None

    def rate(direction: str) -> float | None:
        found = trends.increase(OFFLOAD_BYTES, **labels, direction=direction)
        return found[0] / found[1] if found is not None and found[1] > 0 else None

    def latest(field: str) -> float | None:
        values = trends.gauge(BY_FIELD[field], **labels)
        return next((v for v in reversed(values) if v == v), None) if values else None

    queried = grown(BY_FIELD["prefix_cache_queried_tokens"])
    hits, host = grown(BY_FIELD["prefix_cache_hit_tokens"]), grown(BY_FIELD["prefix_cache_host_hit_tokens"])
    if server in HITS_COUNT_EVERY_TIER:
        device, every = (hits - host if hits is not None and host is not None else None), hits
    else:
        device, every = hits, (hits + (host or 0.0) if hits is not None else host)
    ttft, itl = HISTOGRAM_SPECS["time_to_first_token"], HISTOGRAM_SPECS["inter_token_latency"]
    return TierFigures(
        preempted_share=ratio(grown(BY_FIELD["preemptions"]), grown(BY_FIELD["requests_finished"])),
        device_hit_share=ratio(device, queried), host_hit_share=ratio(host, queried), hit_share=ratio(every, queried),
        time_to_first_token_mean=ratio(grown(ttft[1]), grown(ttft[2])),
        inter_token_latency_mean=ratio(grown(itl[1]), grown(itl[2])),
        loads_per_second=rate("load"), stores_per_second=rate("store"),
        host_tier_bytes=latest("kv_offload_host_tier_bytes"), host_cache_bytes=latest("kv_offload_host_cache_bytes"),
        host_tier_used_share=ratio(latest("kv_offload_host_tier_used_tokens"), latest("kv_offload_host_tier_tokens")))


def server_heading(key: tuple[str, ...]) -> str:
    """The endpoint's host:port: short enough for two columns at a phone's width."""
    endpoint = key[1]
    return urlsplit(endpoint).netloc or endpoint


def server_identity(key: tuple[str, ...]) -> tuple[str, str]:
    """(server and pid, model): the rows under the heading that tell two servers of an endpoint apart."""
    server, _endpoint, model, pid = key
    return DISPLAY_NAMES.get(server, server) + (f" · pid {pid}" if pid else ""), model or "—"


ROWS = (
    ("Requests preempted", lambda f: f.preempted_share, fine_percent),
    ("Prefix hits on the GPU", lambda f: f.device_hit_share, fine_percent),
    ("Prefix hits from host memory", lambda f: f.host_hit_share, fine_percent),
    ("Prefix hits, all tiers", lambda f: f.hit_share, fine_percent),
    ("Time to first token, mean", lambda f: f.time_to_first_token_mean, human_latency),
    ("Inter-token latency, mean", lambda f: f.inter_token_latency_mean, human_latency),
    ("KV loads host → GPU", lambda f: f.loads_per_second, human_rate),
    ("KV stores GPU → host", lambda f: f.stores_per_second, human_rate),
    ("Host KV tier size", lambda f: f.host_tier_bytes, human_bytes),
    ("Host KV tier holds", lambda f: f.host_cache_bytes, human_bytes),
    ("Host KV tier used", lambda f: f.host_tier_used_share, fine_percent),
)


def comparison_html(trends: Trends, keys: list[tuple[str, ...]]) -> str:
    """The last hour of every server side by side; empty when no server has a figure. A figure a
    server does not publish reads "not published" in its column, not 0."""
    figures = [(key, tier_figures(trends, key)) for key in keys]
    figures = [(key, found) for key, found in figures if found.any()]
    if not figures:
        return ""
    servers, models = zip(*(server_identity(key) for key, _ in figures))
    rows = [["Server", *servers], ["Model", *models]]
    for label, pick, show in ROWS:
        values = [pick(found) for _, found in figures]
        if any(value is not None for value in values):
            rows.append([label, *(show(v) if v is not None else "not published" for v in values)])
    return card("Servers compared: tiered KV cache, last hour",
                paragraph("The share of finished requests that were preempted, of prompt tokens found in "
                          "the prefix cache by tier, the mean latencies and the host tier's traffic, per "
                          "server", "sub")
                + table(["Last hour", *(server_heading(key) for key, _ in figures)], rows), classes="compare")


def tier_plots(trends: Trends, key: tuple[str, ...]) -> str:
    """Time to first token and inter-token latency (mean from the histogram's sum and count, p95
    from the agent's percentile gauge) and the KV offload traffic per direction, over the hour."""
    server, endpoint, model, pid = key
    labels = {"server": server, "endpoint": endpoint, "model": model, "pid": pid}
    plots = []
    for histogram, title in (("time_to_first_token", "Time to first token, last hour"),
                             ("inter_token_latency", "Inter-token latency, last hour")):
        percentile, total, observations = HISTOGRAM_SPECS[histogram]
        sums, counts = trends.rate(total, **labels), trends.rate(observations, **labels)
        mean = None if sums is None or counts is None else [
            s / c if c == c and s == s and c > 0 else float("nan") for s, c in zip(sums, counts)]
        plots.append(trends.plot(title, [("mean", mean),
                                         ("p95", trends.gauge(percentile, **labels, percentile="p95"))],
                                 human_latency))
    plots.append(trends.plot("KV offload traffic, last hour", [
        ("loads host → GPU", trends.rate(OFFLOAD_BYTES, **labels, direction="load")),
        ("stores GPU → host", trends.rate(OFFLOAD_BYTES, **labels, direction="store"))], human_rate))
    return "".join(plots)

