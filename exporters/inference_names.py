"""What things are called: each inference server's metric names (RULES, newest first) and the
hybridmon_inference_* series they become.

Sources of the servers' names: /work/shared/reference/inference-servers.md and the servers' own
metrics code (vLLM vllm/v1/metrics/loggers.py and its KV offload connector, SGLang
sglang/srt/metrics/collector.py, llama.cpp tools/server, TGI router/src, LMCache
lmcache/observability.py). docs/inference-servers.md has the table per server.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hybridmon.exporters.base import MetricSpec

SERVERS = ("vllm", "sglang", "llamacpp", "tgi", "lmcache", "ollama")
# Metric-name prefix of each server that publishes /metrics, in the order a mixed body is read:
# LMCache runs inside vLLM and publishes through vLLM's /metrics, so vLLM comes first.
PREFIXES = {"vllm": "vllm:", "sglang": "sglang:", "llamacpp": "llamacpp:", "tgi": "tgi_",
            "lmcache": "lmcache:"}
# The ports inference servers listen on unless told otherwise: vLLM, llama.cpp's llama-server and
# TGI's container image, SGLang, Ollama.
USUAL_PORTS = (8000, 8080, 30000, 11434)


@dataclass(frozen=True)
class Rule:
    """Where one ServerStats field comes from on one server.

    how: "value" (a gauge or counter sample), "histogram" (the _bucket/_sum/_count of `sample`),
    "histogram_sum" (only its _sum), "sum_count" (sum in `sample`, count in `count_sample`).
    Series of one model (other labels: engine, worker, transfer type) are combined by `combine`.
    """

    field: str
    sample: str
    how: Literal["value", "histogram", "histogram_sum", "sum_count"] = "value"
    labels: tuple[tuple[str, str], ...] = ()
    combine: Literal["sum", "max", "mean"] = "sum"
    count_sample: str = ""


_GPU_TO_CPU, _CPU_TO_GPU = (("transfer_type", "GPU_to_CPU"),), (("transfer_type", "CPU_to_GPU"),)
RULES: dict[str, tuple[Rule, ...]] = {
    "vllm": (
        Rule("requests_running", "vllm:num_requests_running"),
        Rule("requests_waiting", "vllm:num_requests_waiting"),
        Rule("kv_cache_usage_ratio", "vllm:kv_cache_usage_perc", combine="max"),
        Rule("kv_cache_usage_ratio", "vllm:gpu_cache_usage_perc", combine="max"),  # before v0.10
        Rule("prompt_tokens", "vllm:prompt_tokens_total"),
        Rule("generated_tokens", "vllm:generation_tokens_total"),
        Rule("preemptions", "vllm:num_preemptions_total"),
        Rule("time_to_first_token", "vllm:time_to_first_token_seconds", "histogram"),
        Rule("inter_token_latency", "vllm:inter_token_latency_seconds", "histogram"),
        Rule("inter_token_latency", "vllm:time_per_output_token_seconds", "histogram"),  # older
        Rule("prefix_cache_queried_tokens", "vllm:prefix_cache_queries_total"),
        Rule("prefix_cache_hit_tokens", "vllm:prefix_cache_hits_total"),
        Rule("prefix_cache_hit_ratio", "vllm:gpu_prefix_cache_hit_rate", combine="mean"),  # V0
        Rule("kv_offload_store_bytes", "vllm:kv_offload_store_bytes_total"),
        Rule("kv_offload_store_bytes", "vllm:kv_offload_total_bytes_total", labels=_GPU_TO_CPU),
        Rule("kv_offload_load_bytes", "vllm:kv_offload_load_bytes_total"),
        Rule("kv_offload_load_bytes", "vllm:kv_offload_total_bytes_total", labels=_CPU_TO_GPU),
        Rule("kv_offload_store_seconds", "vllm:kv_offload_store_time_total"),
        Rule("kv_offload_store_seconds", "vllm:kv_offload_total_time_total", labels=_GPU_TO_CPU),
        Rule("kv_offload_load_seconds", "vllm:kv_offload_load_time_total"),
        Rule("kv_offload_load_seconds", "vllm:kv_offload_total_time_total", labels=_CPU_TO_GPU),
    ),
    "sglang": (
        Rule("requests_running", "sglang:num_running_reqs"),
        Rule("requests_waiting", "sglang:num_queue_reqs"),
        Rule("kv_cache_usage_ratio", "sglang:token_usage", combine="max"),
        Rule("prompt_tokens", "sglang:prompt_tokens_total"),
        Rule("generated_tokens", "sglang:generation_tokens_total"),
        Rule("preemptions", "sglang:num_retracted_requests_total"),
        Rule("time_to_first_token", "sglang:time_to_first_token_seconds", "histogram"),
        Rule("inter_token_latency", "sglang:inter_token_latency_seconds", "histogram"),
        Rule("inter_token_latency", "sglang:time_per_output_token_seconds", "histogram"),
        # The radix cache is looked up with every prompt token; cached_tokens are its hits.
        Rule("prefix_cache_queried_tokens", "sglang:prompt_tokens_total"),
        Rule("prefix_cache_hit_tokens", "sglang:cached_tokens_total"),
        Rule("prefix_cache_hit_ratio", "sglang:cache_hit_rate", combine="mean"),
    ),
    "llamacpp": (
        Rule("requests_running", "llamacpp:requests_processing"),
        Rule("requests_waiting", "llamacpp:requests_deferred"),
        Rule("kv_cache_usage_ratio", "llamacpp:kv_cache_usage_ratio", combine="max"),  # removed
        Rule("prompt_tokens", "llamacpp:prompt_tokens_total"),
        Rule("generated_tokens", "llamacpp:tokens_predicted_total"),
        # Its tokens/s gauges restart on every scrape; generation seconds over tokens do not.
        Rule("inter_token_latency", "llamacpp:tokens_predicted_seconds_total", "sum_count",
             count_sample="llamacpp:tokens_predicted_total"),
    ),
    "tgi": (
        Rule("requests_running", "tgi_batch_current_size"),
        Rule("requests_waiting", "tgi_queue_size"),
        Rule("prompt_tokens", "tgi_request_input_length", "histogram_sum"),
        Rule("generated_tokens", "tgi_request_generated_tokens", "histogram_sum"),
        Rule("inter_token_latency", "tgi_request_mean_time_per_token_duration", "histogram"),
    ),
    "lmcache": (
        Rule("prefix_cache_queried_tokens", "lmcache:num_requested_tokens_total"),
        Rule("prefix_cache_hit_tokens", "lmcache:num_hit_tokens_total"),
        Rule("prefix_cache_hit_ratio", "lmcache:retrieve_hit_rate", combine="mean"),
        Rule("kv_offload_store_seconds", "lmcache:time_to_store", "histogram_sum"),
        Rule("kv_offload_load_seconds", "lmcache:time_to_retrieve", "histogram_sum"),
        Rule("kv_offload_host_cache_bytes", "lmcache:local_cache_usage"),
    ),
}
# Fields every version of a server publishes: one of them missing means the names changed.
EXPECTED = {
    "vllm": ("requests_running", "generated_tokens", "kv_cache_usage_ratio"),
    "sglang": ("requests_running", "generated_tokens"),
    "llamacpp": ("requests_running", "generated_tokens"),
    "tgi": (), "lmcache": (), "ollama": (),
}



_SERVER = ("server", "endpoint", "model", "pid")
_WHICH = (" Labels: server (vllm, sglang, llamacpp, tgi, lmcache, ollama), endpoint (the URL "
          "scraped), model (the server's model_name label; empty where it names none) and pid (the "
          "watched process listening on the endpoint's port; empty when none is known).")


def _spec(name: str, kind: str, documentation: str, *extra_labels: str) -> MetricSpec:
    return MetricSpec(name, documentation + _WHICH, kind, _SERVER + extra_labels)  # type: ignore[arg-type]


# ServerStats field -> series, for the fields that are one number each.
BY_FIELD = {
    "requests_running": _spec(
        "hybridmon_inference_requests_running", "gauge",
        "Requests being processed (vllm:num_requests_running, sglang:num_running_reqs, "
        "llamacpp:requests_processing, tgi_batch_current_size)."),
    "requests_waiting": _spec(
        "hybridmon_inference_requests_waiting", "gauge",
        "Requests queued, not yet scheduled (vllm:num_requests_waiting, sglang:num_queue_reqs, "
        "llamacpp:requests_deferred, tgi_queue_size)."),
    "prompt_tokens": _spec(
        "hybridmon_inference_prompt_tokens_total", "counter",
        "Prompt (prefill) tokens processed (vllm:prompt_tokens_total, sglang:prompt_tokens_total, "
        "llamacpp:prompt_tokens_total, the sum of tgi_request_input_length)."),
    "generated_tokens": _spec(
        "hybridmon_inference_generated_tokens_total", "counter",
        "Tokens generated (vllm:generation_tokens_total, sglang:generation_tokens_total, "
        "llamacpp:tokens_predicted_total, the sum of tgi_request_generated_tokens); its rate is "
        "the server's output tokens per second."),
    "kv_cache_usage_ratio": _spec(
        "hybridmon_inference_kv_cache_usage_ratio", "gauge",
        "Share of the GPU KV cache in use, 0-1 (vllm:kv_cache_usage_perc, before v0.10 "
        "vllm:gpu_cache_usage_perc; sglang:token_usage; llamacpp:kv_cache_usage_ratio where the "
        "build still has it); the fullest engine when there are several."),
    "preemptions": _spec(
        "hybridmon_inference_preemptions_total", "counter",
        "Requests preempted for lack of KV cache, to be recomputed or reloaded "
        "(vllm:num_preemptions_total, sglang:num_retracted_requests_total)."),
    "prefix_cache_queried_tokens": _spec(
        "hybridmon_inference_prefix_cache_queried_tokens_total", "counter",
        "Prompt tokens looked up in the prefix cache (vllm:prefix_cache_queries_total, "
        "sglang:prompt_tokens_total, lmcache:num_requested_tokens_total)."),
    "prefix_cache_hit_tokens": _spec(
        "hybridmon_inference_prefix_cache_hit_tokens_total", "counter",
        "Prompt tokens found in the prefix cache (vllm:prefix_cache_hits_total, "
        "sglang:cached_tokens_total, lmcache:num_hit_tokens_total: LMCache's own tier)."),
    "prefix_cache_hit_ratio": _spec(
        "hybridmon_inference_prefix_cache_hit_ratio", "gauge",
        "Prefix cache hit ratio 0-1, from servers that publish only a ratio (vLLM V0 "
        "vllm:gpu_prefix_cache_hit_rate, sglang:cache_hit_rate, lmcache:retrieve_hit_rate)."),
    "kv_offload_host_cache_bytes": _spec(
        "hybridmon_inference_kv_offload_host_cache_bytes", "gauge",
        "Bytes of KV cache the offload tier holds in host memory (lmcache:local_cache_usage)."),
    "model_size_bytes": _spec(
        "hybridmon_inference_model_size_bytes", "gauge",
        "Bytes of a loaded model (Ollama /api/ps size)."),
    "model_host_memory_bytes": _spec(
        "hybridmon_inference_model_host_memory_bytes", "gauge",
        "Bytes of a loaded model that are not in GPU memory, so sit in host memory and run on the "
        "CPU (Ollama /api/ps size - size_vram)."),
}
OFFLOAD_BYTES = _spec(
    "hybridmon_inference_kv_offload_bytes_total", "counter",
    "KV cache bytes moved by the offload connector, by direction: store = GPU to host, load = host "
    "to GPU (vllm:kv_offload_store_bytes_total / load_bytes_total, before them "
    "vllm:kv_offload_total_bytes_total{transfer_type=GPU_to_CPU|CPU_to_GPU}).", "direction")
OFFLOAD_SECONDS = _spec(
    "hybridmon_inference_kv_offload_seconds_total", "counter",
    "Seconds the offload connector spent moving KV cache, by direction (vllm:kv_offload_store_time_"
    "total / load_time_total or kv_offload_total_time_total; the _sum of lmcache:time_to_store and "
    "time_to_retrieve). Bytes over seconds is the transfer rate the copies achieved.", "direction")


def _latency(name: str, what: str, sources: str) -> tuple[MetricSpec, MetricSpec, MetricSpec]:
    return (
        _spec(f"hybridmon_inference_{name}_percentile_seconds", "gauge",
              f"{what} in seconds at the percentile (p50, p95) of the observations made since the "
              f"previous scrape, from the bucket increases of {sources} (as histogram_quantile "
              "computes it); absent on the first scrape and when nothing was observed. Not a "
              "summary's quantile label: it is computed here.", "percentile"),
        _spec(f"hybridmon_inference_{name}_seconds_total", "counter",
              f"Sum of every {what.lower()} observed, in seconds (the histogram's _sum): its rate over "
              f"the rate of ..._{name}_observations_total is the mean.", ),
        _spec(f"hybridmon_inference_{name}_observations_total", "counter",
              f"Observations of {what.lower()} (the histogram's _count)."),
    )


HISTOGRAM_SPECS = {
    "time_to_first_token": _latency(
        "time_to_first_token", "Time to first token",
        "vllm:time_to_first_token_seconds or sglang:time_to_first_token_seconds"),
    "inter_token_latency": _latency(
        "inter_token_latency", "Inter-token latency",
        "vllm:inter_token_latency_seconds (before: time_per_output_token_seconds), "
        "sglang:inter_token_latency_seconds or tgi_request_mean_time_per_token_duration (one "
        "observation per request); llama.cpp gives only llamacpp:tokens_predicted_seconds_total over "
        "tokens_predicted_total, so the mean but no quantile"),
}
SCRAPE_SUCCESS = MetricSpec(
    "hybridmon_inference_scrape_success",
    "1 if the endpoint's last scrape gave the expected server's metrics, else 0 (the reason is in "
    "hybridmon_inference_scrape_error).", "gauge", ("endpoint",))
SCRAPE_DURATION = MetricSpec(
    "hybridmon_inference_scrape_duration_seconds",
    "Seconds the endpoint's last GET took, bounded by [inference] timeout_seconds.", "gauge", ("endpoint",))
SCRAPE_ERROR = MetricSpec(
    "hybridmon_inference_scrape_error",
    "1 with the reason the endpoint's last scrape failed; absent when it succeeded. timeout: no "
    "complete answer in time; refused: nothing listens; connection: reset, TLS or DNS failure; "
    "http_status: not HTTP 200; too_large: the body is over [inference] max_body_bytes; "
    "not_prometheus / not_json: not the expected format (an HTML page); unknown_server: no family "
    "of the expected server; missing_families: a family every version of the server publishes is "
    "missing (its names changed).", "gauge", ("endpoint", "reason"))

METRIC_SPECS = (*BY_FIELD.values(), OFFLOAD_BYTES, OFFLOAD_SECONDS,
                *(spec for specs in HISTOGRAM_SPECS.values() for spec in specs),
                SCRAPE_SUCCESS, SCRAPE_DURATION, SCRAPE_ERROR)
