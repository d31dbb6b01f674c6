"""The host overview's inference-server panels: per scraped endpoint (a row repeated over
$endpoint), what its users feel (tokens/s, queue, time to first token, inter-token latency) and
the KV cache pressure behind it, with the KV offload traffic beside the PCIe host -> device traffic
and capacity of the same host; then the health of every scrape.

The series are the agent's hybridmon_inference_* (docs/metrics.md): one per server, endpoint and
model, whatever server publishes them. Counters are read as rates; the latency percentiles are
gauges the agent computes from the bucket increases between two scrapes, and the mean is the
rate of the histogram's sum over the rate of its count.
"""
from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as grafana

from hybridmon.agent.alerts import offload_host_memory, weight_offload
from hybridmon.agent.alerts.catalogue import Thresholds
from hybridmon.agent.status.kv_tiers import HITS_COUNT_EVERY_TIER
from hybridmon.dashboards.common import graph, override_unit, query, runbook_links, selector, value_table
from hybridmon.dashboards.gpu_panels import DASHED, THROUGHPUT
from hybridmon.exporters.inference_names import (BY_FIELD, HISTOGRAM_SPECS, OFFLOAD_BYTES, SCRAPE_DURATION,
                                                 SCRAPE_ERROR, SCRAPE_SUCCESS)
from hybridmon.exporters.gpu import PROCESS_MEMORY_USED
from hybridmon.rules.inference import OFFLOAD_LOADS as RECORDED_LOADS
from hybridmon.rules.inference import SERVER_CAPACITY
from hybridmon.rules.pcie import MEASURED_CAPACITY, TRAFFIC

ENDPOINT = 'endpoint=~"$endpoint"'
TOKENS_PER_SECOND = "suffix: tokens/s"
ROW = grafana.Row("Inference server: $endpoint").repeat("endpoint")
DECAY, PRESSURE, SCRAPE = "InferenceThroughputDecay", "InferenceKvOffloadPressure", "InferenceServerScrapeFailing"
WEIGHTS, HOST_TIER = "InferenceWeightsCrossingBus", "InferenceOffloadHostMemoryShort"


def _server(metric: str, *matchers: str) -> str:
    return selector(metric, ENDPOINT, *matchers, gpu=False)


def _rate(metric: str, *matchers: str) -> str:
    return f"rate({_server(metric, *matchers)}[$__rate_interval])"


def _field(name: str) -> str:
    """The series of one ServerStats field (exporters/inference_names.py BY_FIELD)."""
    return BY_FIELD[name].name


def _percentiles(histogram: str) -> str:
    percentile, _total, _observations = HISTOGRAM_SPECS[histogram]
    return _server(percentile.name)


def _mean(histogram: str) -> str:
    _percentile, total, observations = HISTOGRAM_SPECS[histogram]
    return f"{_rate(total.name)}\n/\n{_rate(observations.name)}"


HOST_TO_DEVICE = 'direction="host_to_device"'
# KV offload loads over the host -> device capacity of the links they cross, with the capacity
# InferenceKvOffloadPressure divides by (a recording rule of rules/inference.py): the links of the
# GPUs the server's process holds memory on, else every link of the host; measured by
# `hybridmon bench` where it has run, else what copies achieve on the best link of the minute.
OFFLOAD_LOADS = _rate(OFFLOAD_BYTES.name, 'direction="load"')
OFFLOAD_SHARE = f"sum without (direction) ({OFFLOAD_LOADS})\n/\n{_server(SERVER_CAPACITY)}"
# The same loads (1 min rate, as recorded) over the host -> device bytes/s NVML counted on the same
# GPUs (those the server's process holds memory on, else every GPU of the host, as SERVER_CAPACITY
# picks them): the loads' share of what really crossed; the rest is weights, activations and other
# processes. The agent's LinkShare (agent/alerts/kv_offload_pressure.py) computes the same.
_H2D = f'{TRAFFIC}{{{HOST_TO_DEVICE}}}'
_LOADS = _server(RECORDED_LOADS)
OFFLOAD_SHARE_OF_TRAFFIC = (
    f"{_LOADS}\n/\n(\n"
    f"  {_LOADS} * 0 + on (job, instance, pid) group_left ()\n"
    f"    sum by (job, instance, pid) ({_H2D} * on (job, instance, gpu, uuid) group_right ()\n"
    f"      max without (process_name) ({PROCESS_MEMORY_USED.name} * 0 + 1))\n"
    f"  or\n  {_LOADS} * 0 + on (job, instance) group_left () sum by (job, instance) ({_H2D})\n)")


def load_and_latency(runbooks: str):
    return [
        graph("Tokens per second", TOKENS_PER_SECOND,
              "Generated (output) and prompt (prefill) tokens per second: rates of the server's "
              "token counters, whatever server publishes them.",
              query(_rate(_field("generated_tokens")), "{{model}} generated", "A"),
              query(_rate(_field("prompt_tokens")), "{{model}} prompt", "B"),
              width=8, links=runbook_links(runbooks, DECAY)),
        graph("Requests running and waiting", "short",
              "Requests the server is working on, and those queued for a free slot or KV cache.",
              query(_server(_field("requests_running")), "{{model}} running", "A"),
              query(_server(_field("requests_waiting")), "{{model}} waiting", "B"),
              width=8),
        graph("Generated tokens/s per running request", TOKENS_PER_SECOND,
              "What each request gets: generated tokens per second over the requests running. "
              "InferenceThroughputDecay fires when it falls against this host's own baseline while "
              "the load does not.",
              query(f"{_rate(_field('generated_tokens'))}\n/\n"
                    f"(avg_over_time({_server(_field('requests_running'))}[$__rate_interval]) > 0)",
                    "{{model}}"),
              width=8, links=runbook_links(runbooks, DECAY)),
        graph("Time to first token", "s",
              "p50 and p95 of the requests that got their first token between two scrapes (from the "
              "server's histogram buckets), and the mean over the rate interval.",
              query(_percentiles("time_to_first_token"), "{{model}} {{percentile}}", "A"),
              query(_mean("time_to_first_token"), "{{model}} mean", "B"),
              links=runbook_links(runbooks, DECAY)),
        graph("Inter-token latency", "s",
              "p50 and p95 of the gaps between generated tokens observed between two scrapes, and "
              "the mean over the rate interval (llama.cpp gives only the mean).",
              query(_percentiles("inter_token_latency"), "{{model}} {{percentile}}", "A"),
              query(_mean("inter_token_latency"), "{{model}} mean", "B"),
              links=runbook_links(runbooks, DECAY)),
    ]


def kv_cache(t: Thresholds, runbooks: str):
    pressure = t.kv_offload_pressure
    traffic = graph(
        "KV offload vs PCIe host → device", "Bps",
        "KV cache bytes the offload connector moves (load: host to GPU, store: GPU to host) beside "
        "each chosen GPU's PCIe host → device traffic (NVML) and what `hybridmon bench` measured "
        "for its link (pinned, local copies). Loads near the measured rate mean the link, not the "
        "GPU, sets the pace.",
        query(_rate(OFFLOAD_BYTES.name), "{{model}} KV offload {{direction}}", "A"),
        query(selector(THROUGHPUT, HOST_TO_DEVICE), "GPU {{gpu}} PCIe host → device", "B"),
        query(selector(MEASURED_CAPACITY, HOST_TO_DEVICE), "GPU {{gpu}} measured capacity", "C"),
        width=16, links=runbook_links(runbooks, PRESSURE, "GpuPcieStarvation"))
    return [
        graph("KV cache usage", "percentunit",
              "Share of the GPU KV cache in use (the fullest engine). The line is "
              "kv_cache_usage_at_least of [kv_offload_pressure]: at or above it (1 min average) with "
              "preemptions rising, InferenceKvOffloadPressure fires with reason kv_cache_full.",
              query(_server(_field("kv_cache_usage_ratio")), "{{model}}"),
              threshold=pressure.kv_cache_usage_at_least, width=8, links=runbook_links(runbooks, PRESSURE)).max(1),
        graph("Preemptions per second", "short",
              "Requests preempted for lack of KV cache, to be recomputed or reloaded. The line is "
              "preemptions_per_second_above of [kv_offload_pressure]: above it with the KV cache "
              "full is reason kv_cache_full.",
              query(_rate(_field("preemptions")), "{{model}}"),
              threshold=pressure.preemptions_per_second_above, width=8, links=runbook_links(runbooks, PRESSURE)),
        graph("Prefix cache hit ratio", "percentunit",
              "Prompt tokens found in the prefix cache over those looked up, over the rate interval; "
              "for servers that publish only a ratio (vLLM V0, SGLang, LMCache), their ratio.",
              query(f"(\n{_rate(_field('prefix_cache_hit_tokens'))}\n/\n"
                    f"{_rate(_field('prefix_cache_queried_tokens'))}\n)\nor\n"
                    f"max without () ({_server(_field('prefix_cache_hit_ratio'))})",
                    "{{server}} {{model}}"),
              width=8).max(1),
        traffic.override_by_query("C", [DASHED]),
        graph("KV offload loads, share of host → device capacity", "percentunit",
              "KV offload loads over the host → device capacity of the links they cross: those of "
              "the GPUs the server's process uses (all of the host's where that is not known), "
              "measured by `hybridmon bench` where it ran, else what copies achieve on the link. The line is "
              "offload_load_share_of_capacity of [kv_offload_pressure]: at or above it, "
              "InferenceKvOffloadPressure fires with reason offload_link.",
              query(OFFLOAD_SHARE, "{{model}} of capacity", "A"),
              query(OFFLOAD_SHARE_OF_TRAFFIC, "{{model}} of NVML host → device traffic", "B"),
              threshold=pressure.offload_load_share_of_capacity, width=8, links=runbook_links(runbooks, PRESSURE)),
        graph("Host → device bytes per generated token, KV loads taken off", "bytes",
              "PCIe bytes the server's GPUs received from the host (NVML) less the KV offload loads "
              "the servers there report, over the tokens/s generated on those GPUs (a tensor-parallel "
              "server's GPUs summed; servers sharing a GPU share its traffic). A token's KV is at "
              "most ~1.6 MiB; far above the line, weights cross the bus every step (vLLM "
              "--cpu-offload-gb): InferenceWeightsCrossingBus, when also at least "
              "min_unexplained_bytes_per_second and min_generated_tokens_per_second of [weight_offload].",
              query(weight_offload.bytes_per_token(_server(_field("generated_tokens"), 'pid!=""')), "{{model}}"),
              threshold=t.weight_offload.unexplained_bytes_per_token_above, width=12,
              links=runbook_links(runbooks, WEIGHTS)),
        graph("Host KV tier still to allocate, share of MemAvailable", "percentunit",
              "The configured host-memory KV tier x pinned_overhead_factor of [offload_host_memory] "
              "(1.92: pinned buffers round up, vllm#53042), less what the server's processes hold "
              "resident, over the host's MemAvailable. At or above the line, "
              "InferenceOffloadHostMemoryShort fires before the tier fills and the OOM killer acts.",
              query(offload_host_memory.share_of_available(
                  t.offload_host_memory, _server(_field("kv_offload_host_tier_bytes"), 'pid!=""')), "{{model}}"),
              threshold=t.offload_host_memory.remaining_share_of_free_at_least, width=12,
              links=runbook_links(runbooks, HOST_TIER)),
    ]


# --- the tiered-KV view (issue 31): H10's figures per server ------------------------------------
# Which servers' hit counter already holds the host tier's hits: agent/status/kv_tiers.py.
_EVERY_TIER = f'server=~"{"|".join(sorted(HITS_COUNT_EVERY_TIER))}"'
_GPU_ONLY = f'server!~"{"|".join(sorted(HITS_COUNT_EVERY_TIER))}"'


def _over(metric: str, window: str, *matchers: str) -> str:
    return f"rate({_server(metric, *matchers)}[{window}])"


def preempted_share(window: str) -> str:
    """Preemptions over requests finished: the share of requests preempted (H10's 17.5 % / 8.5 %)."""
    return f"{_over(_field('preemptions'), window)}\n/\n{_over(_field('requests_finished'), window)}"


def prefix_hits(tier: str, window: str) -> str:
    """Prompt tokens found in tier `tier` (device, host, all) over those looked up. vLLM's hit
    counter is its GPU's own and host hits come beside it; SGLang's and LMCache's hold every tier,
    so their GPU share is the hits less the host hits (all of them where no host hits are read)."""
    hits, host = _field("prefix_cache_hit_tokens"), _field("prefix_cache_host_hit_tokens")
    numerator = {
        "device": (f"{_over(hits, window, _GPU_ONLY)}\nor\n"
                   f"{_over(hits, window, _EVERY_TIER)} - {_over(host, window)}\nor\n"
                   f"{_over(hits, window, _EVERY_TIER)}"),
        "host": _over(host, window),
        "all": (f"{_over(hits, window, _GPU_ONLY)} + {_over(host, window)}\nor\n{_over(hits, window)}"),
    }[tier]
    return f"(\n{numerator}\n)\n/\n{_over(_field('prefix_cache_queried_tokens'), window)}"


def latency_mean(histogram: str, window: str) -> str:
    _percentile, total, observations = HISTOGRAM_SPECS[histogram]
    return f"{_over(total.name, window)}\n/\n{_over(observations.name, window)}"


def offload_rate(direction: str, window: str) -> str:
    return _over(OFFLOAD_BYTES.name, window, f'direction="{direction}"')


TIER_COMPARISON_TITLE = "Tiered KV cache: servers compared over the dashboard's time range"


def kv_tiers(runbooks: str):
    """Inside the row repeated per endpoint: the preempted share, prefix hits by tier and the host
    tier's size beside the TTFT, ITL and offload panels above (issue 31)."""
    window = "$__rate_interval"
    return [
        graph("Share of requests preempted", "percentunit",
              "Preemptions over requests finished (vllm:num_preemptions_total over "
              "vllm:request_success_total, SGLang's retractions over num_requests_total): the share "
              "of requests preempted, as the seeds' experiment H10 compared a single-tier and a "
              "tiered KV cache (17.5 % against 8.5 %).",
              query(preempted_share(window), "{{model}}"), width=8, links=runbook_links(runbooks, PRESSURE)).max(1),
        graph("Prefix cache hits by tier", "percentunit",
              "Prompt tokens found in the prefix cache over those looked up, by the tier that held "
              "them: the GPU, host memory (the offload tier) and all tiers together. vLLM counts "
              "host hits apart from its GPU's (0.33 prompt_tokens_cached_by_source); no server's "
              "disk or remote tier is read yet.",
              query(prefix_hits("device", window), "{{model}} GPU", "A"),
              query(prefix_hits("host", window), "{{model}} host memory", "B"),
              query(prefix_hits("all", window), "{{model}} all tiers", "C"), width=8).max(1),
        graph("Host KV tier: size and contents", "bytes",
              "The configured size of the host-memory KV tier (vLLM 0.33 kv_offload_config_info) "
              "and what it holds where the server says (LMCache's local cache).",
              query(_server(_field("kv_offload_host_tier_bytes")), "{{model}} size", "A"),
              query(_server(_field("kv_offload_host_cache_bytes")), "{{model}} holds", "B"), width=8),
    ]


def tier_comparison(runbooks: str):
    """The chosen endpoints in one table over the dashboard's range, a row per server: a
    single-tier and a tiered server (or one server before and after a change, by the time range)
    compare at a glance, as H10's table does."""
    window = "$__range"
    columns = {
        "A": (preempted_share(window), "Requests preempted"),
        "B": (prefix_hits("device", window), "Prefix hits on the GPU"),
        "C": (prefix_hits("host", window), "Prefix hits from host memory"),
        "D": (prefix_hits("all", window), "Prefix hits, all tiers"),
        "E": (latency_mean("time_to_first_token", window), "TTFT mean"),
        "F": (latency_mean("inter_token_latency", window), "ITL mean"),
        "G": (offload_rate("load", window), "KV loads host → GPU"),
        "H": (offload_rate("store", window), "KV stores GPU → host"),
        "I": (f"{_server(_field('kv_offload_host_tier_used_tokens'))}\n/\n"
              f"{_server(_field('kv_offload_host_tier_tokens'))}", "Host KV tier used"),
    }
    panel = value_table(
        TIER_COMPARISON_TITLE, "percentunit",
        "Per server over the dashboard's time range: the share of finished requests that were "
        "preempted, prefix-cache hits by tier (shares of prompt tokens looked up), the mean time to "
        "first token and inter-token latency, the KV offload traffic per direction and how full the "
        "host tier is now (tokens held over its capacity, where the server says: SGLang HiCache). The seeds' "
        "experiment H10 read 17.5 % / 8.5 % preempted, 0.5 % / 4.5 % hits and 417 / 299 ms for a "
        "single-tier and a tiered KV cache.", columns, width=24, height=6, links=runbook_links(runbooks, PRESSURE))
    for column, unit in (("TTFT mean", "s"), ("ITL mean", "s"), ("KV loads host → GPU", "Bps"),
                         ("KV stores GPU → host", "Bps")):
        panel = override_unit(panel, column, unit)
    return [panel]


def scrapes(runbooks: str):
    health = value_table(
        "Inference endpoints: last scrape", "short",
        "Each endpoint the agent scrapes (configured, or found beside a watched process): 1 when "
        "its last answer gave the expected server's metrics, and how long the GET took.",
        {"A": (selector(SCRAPE_SUCCESS.name, ENDPOINT, gpu=False), "scraped ok"),
         "B": (selector(SCRAPE_DURATION.name, ENDPOINT, gpu=False), "seconds")},
        width=12, height=6, links=runbook_links(runbooks, SCRAPE))
    errors = value_table(
        "Inference scrape errors", "short",
        "Endpoints whose last scrape failed, and why: timeout, refused, connection, http_status, "
        "too_large, not_prometheus / not_json (an HTML page), unknown_server, missing_families "
        "(the server renamed its metrics). InferenceServerScrapeFailing fires after 2 minutes.",
        {"A": (selector(SCRAPE_ERROR.name, ENDPOINT, gpu=False), None)},
        width=12, height=6, links=runbook_links(runbooks, SCRAPE))
    return [override_unit(health, "seconds", "s"), errors]
