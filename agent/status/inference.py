"""The status page's "Inference servers" section (agent/status/page.py): per scraped endpoint, what
its users feel (tokens/s, queue, time to first token, inter-token latency) and the KV cache
pressure behind it (usage, preemptions, offload traffic), or why the scrape failed.

Gauges come from the latest samples; the counter rates (COUNTERS_READ: tokens, preemptions over
requests finished, prefix hits by tier, offload bytes) read the last minute of their series only,
like the other rates of the page. Above the cards, the tiered-KV comparison of every server over
the last hour, and in each card its latency and offload plots (agent/status/kv_tiers.py).
Endpoint URLs, model names and reasons are whatever the servers and the configuration
say: template.py escapes them.
"""
from __future__ import annotations

from hybridmon.agent.detectors.servers import DISPLAY_NAMES, SERVER_LABELS as SERVER, human_latency
from hybridmon.agent.loop.history import History
from hybridmon.agent.status.kv_tiers import HITS_COUNT_EVERY_TIER, comparison_html, fine_percent, tier_plots
from hybridmon.agent.status.signals import Decided, LatestValues, counter_rates
from hybridmon.agent.status.template import Row, card, key_values, paragraph
from hybridmon.agent.status.trends import Trends, server_plots
from hybridmon.exporters.inference_names import (BY_FIELD, HISTOGRAM_SPECS, OFFLOAD_BYTES, OFFLOAD_SECONDS,
                                                 SCRAPE_DURATION, SCRAPE_ERROR, SCRAPE_REASONS, SCRAPE_SUCCESS)
from hybridmon.units import human_bytes, human_rate, percent

# generated and prompt tokens, preemptions, requests finished, prefix queries, hits and host hits,
# offload bytes: one series read each
COUNTERS_READ = 8


def inference_html(history: History, latest: LatestValues, trends: Trends, decided: Decided) -> str:
    success = latest.keyed(SCRAPE_SUCCESS.name, "endpoint")
    errors: dict[str, list[str]] = {}
    for labels, _ in latest.all(SCRAPE_ERROR.name):
        errors.setdefault(labels["endpoint"], []).append(labels["reason"])
    served: dict[str, list[tuple[str, ...]]] = {}
    for spec in (*BY_FIELD.values(), OFFLOAD_BYTES, OFFLOAD_SECONDS):  # each server has some of them
        for labels, _ in latest.all(spec.name):
            key = tuple(labels[name] for name in SERVER)
            if key not in served.setdefault(key[1], []):
                served[key[1]].append(key)
    endpoints = sorted({e for (e,) in success} | set(errors) | set(served))
    if not endpoints:
        return paragraph("No inference server scraped (none configured in [inference] endpoints, and "
                         "none found beside the watched processes).", "meta")
    rates = ServerRates(history, latest)
    duration = latest.keyed(SCRAPE_DURATION.name, "endpoint")
    cards = []
    for endpoint in endpoints:
        rows: list[Row] = []
        took = duration.get((endpoint,))
        took_text = f" in {took * 1000:.0f} ms" if took is not None else ""
        if errors.get(endpoint):
            reasons = "; ".join(f"{SCRAPE_REASONS.get(reason, ('see the agent log',))[0]} ({reason})"
                                for reason in sorted(errors[endpoint]))
            rows.append(("Last scrape", f"failed{took_text}: {reasons}", True))
        elif success.get((endpoint,)) is not None:
            rows.append(("Last scrape", f"ok{took_text}", False))
        body = key_values(rows)
        for key in sorted(served.get(endpoint, [])):
            server, _endpoint, model, pid = key
            heading = " · ".join(part for part in (DISPLAY_NAMES.get(server, server), model,
                                                   f"pid {pid}" if pid else "") if part)
            body += (paragraph(heading, "sub") + key_values(server_rows(key, latest, rates, decided))
                     + server_plots(trends, key) + tier_plots(trends, key))
        cards.append(card(endpoint, body))
    keys = sorted(key for endpoint in endpoints for key in served.get(endpoint, []))
    return comparison_html(trends, keys) + f'<div class="grid">{"".join(cards)}</div>'


class ServerRates:
    """The last minute's counter rates of every scraped server, keyed by (server, endpoint, model,
    pid[, direction])."""

    def __init__(self, history: History, latest: LatestValues) -> None:
        def rates(metric: str, *extra: str, **wanted: str) -> dict[tuple[str, ...], float]:
            return counter_rates(history, latest, metric, (*SERVER, *extra), **wanted)

        self.generated = rates(BY_FIELD["generated_tokens"].name)
        self.prompt = rates(BY_FIELD["prompt_tokens"].name)
        self.preemptions = rates(BY_FIELD["preemptions"].name)
        self.finished = rates(BY_FIELD["requests_finished"].name)
        self.queried = rates(BY_FIELD["prefix_cache_queried_tokens"].name)
        self.hits = rates(BY_FIELD["prefix_cache_hit_tokens"].name)
        self.host_hits = rates(BY_FIELD["prefix_cache_host_hit_tokens"].name)
        self.offload = rates(OFFLOAD_BYTES.name, "direction")


def offload_elsewhere_rows(in_lmcache: float | None) -> list[Row]:
    """vLLM with --kv-offloading-backend lmcache publishes no offload family: say where the
    traffic is counted instead of letting an absent row read as "no offload" (issue 15)."""
    if not in_lmcache:
        return []
    return [("KV offload", "by LMCache's multiprocess server: vLLM publishes no offload series, "
             "LMCache's exporter does (port 9090 unless --prometheus-port; scraped as server lmcache)", False)]


def prefix_hit_rows(key: tuple[str, ...], rates: ServerRates) -> list[Row]:
    """The last minute's prefix-cache hits by tier, shares of the prompt tokens looked up (which
    tiers a server's hit counter covers: agent/status/kv_tiers.py)."""
    queried, hits, host = rates.queried.get(key), rates.hits.get(key), rates.host_hits.get(key)
    if not queried or hits is None:
        return []
    if host is None:
        return [("Prefix cache hits", f"{fine_percent(hits / queried)} of prompt tokens", False)]
    device = hits - host if key[0] in HITS_COUNT_EVERY_TIER else hits
    return [("Prefix cache hits", f"{fine_percent(device / queried)} on the GPU · {fine_percent(host / queried)} from host "
             f"memory · {fine_percent((device + host) / queried)} in all", False)]


def server_rows(key: tuple[str, ...], latest: LatestValues, rates: ServerRates, decided: Decided) -> list[Row]:
    def gauge(field: str) -> float | None:
        return latest.keyed(BY_FIELD[field].name, *SERVER).get(key)

    def percentile(histogram: str, which: str) -> float | None:
        spec = HISTOGRAM_SPECS[histogram][0]
        return latest.keyed(spec.name, *SERVER, "percentile").get((*key, which))

    rows: list[Row] = []
    tokens = [f"{rate:,.0f} generated" for rate in [rates.generated.get(key)] if rate is not None]
    tokens += [f"{rate:,.0f} prompt" for rate in [rates.prompt.get(key)] if rate is not None]
    if tokens:
        rows.append(("Tokens/s", " · ".join(tokens), False))
    running, waiting = gauge("requests_running"), gauge("requests_waiting")
    if running is not None or waiting is not None:
        rows.append(("Requests", " · ".join(f"{value:.0f} {what}" for value, what in (
            (running, "running"), (waiting, "waiting")) if value is not None), False))
    for histogram, label in (("time_to_first_token", "Time to first token"),
                             ("inter_token_latency", "Inter-token latency")):
        p50, p95 = percentile(histogram, "p50"), percentile(histogram, "p95")
        if p50 is not None:
            rows.append((label, f"p50 {human_latency(p50)}" + (f" · p95 {human_latency(p95)}" if p95 is not None else ""), False))
    usage = gauge("kv_cache_usage_ratio")
    if usage is not None:
        rows.append(("KV cache used", percent(usage), False))
    preemptions = rates.preemptions.get(key)
    if preemptions is not None:
        finished = rates.finished.get(key)
        of_requests = f" · {fine_percent(preemptions / finished)} of requests finished" if finished else ""
        rows.append(("Preemptions", f"{preemptions:.1f}/s{of_requests}", False))
    rows += prefix_hit_rows(key, rates)
    load, store = rates.offload.get((*key, "load")), rates.offload.get((*key, "store"))
    if load is not None or store is not None:
        rows.append(("KV offload", " · ".join(f"{what} {human_rate(rate)}" for rate, what in (
            (load, "loads"), (store, "stores")) if rate is not None), False))
    # the loads beside the GPUs' NVML host->device traffic and capacity over the minute, as
    # InferenceKvOffloadPressure judged them at its last evaluation (issue 15; no history read)
    share = decided.kv_shares.get(key)
    if share is not None and (share.of_traffic is not None or share.of_capacity is not None):
        parts = []
        if share.of_traffic is not None:
            parts.append(f"{percent(share.of_traffic)} of the {human_rate(share.traffic or 0.0)} NVML counted")
        if share.of_capacity is not None:
            parts.append(f"{percent(share.of_capacity)} of its {human_rate(share.capacity or 0.0)} capacity")
        rows.append((f"KV loads on GPU {', '.join(share.gpus)} host→device link", " · ".join(parts), False))
    host_cache = gauge("kv_offload_host_cache_bytes")
    if host_cache is not None:
        rows.append(("KV offload tier", f"{human_bytes(host_cache)} in host memory", False))
    rows += offload_elsewhere_rows(gauge("kv_offload_in_lmcache"))
    size, in_host = gauge("model_size_bytes"), gauge("model_host_memory_bytes")
    if size and in_host is not None:
        rows.append(("Model in host memory", f"{human_bytes(in_host)} of {human_bytes(size)} ({percent(in_host / size)})", False))
    return rows or [("Signals", "none yet (rates need two scrapes in a minute)", False)]

