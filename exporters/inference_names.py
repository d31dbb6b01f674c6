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
# LMCache in multiprocess mode (the default behind vLLM's lmcache backend) runs a standalone server
# whose OpenTelemetry instruments (lmcache_mp.*) reach Prometheus through the OTel exporter on its
# own port (9090 unless --prometheus-port), with dots as underscores and no "lmcache:" prefix.
PREFIXES: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm:",), "sglang": ("sglang:",), "llamacpp": ("llamacpp:",), "tgi": ("tgi_",),
    "lmcache": ("lmcache:", "lmcache_mp_")}
ALL_PREFIXES = tuple(prefix for prefixes in PREFIXES.values() for prefix in prefixes)
# The ports inference servers listen on unless told otherwise: vLLM, llama.cpp's llama-server and
# TGI's container image, SGLang, Ollama.
# TGI's --prometheus-port (9000) and LMCache MP's exporter (9090) are not probed: 9090 is
# Prometheus's own port on many hosts, and both are found among a watched process's ports.
USUAL_PORTS = (8000, 8080, 30000, 11434)
# Labels of SGLang's scheduler series that tell its ranks apart (observability/metrics_collector.py
# SchedulerMetricsCollector.init_new); dp_rank is not one: data-parallel ranks serve other requests.
SGLANG_RANK_LABELS = ("tp_rank", "pp_rank", "moe_ep_rank")
# Servers some of whose series carry no model label although the server serves one model: their
# fields are filed under the endpoint's model when it serves exactly one (inference_formats
# normalise). SGLang 0.5.23's HiCache families (RadixCacheMetricsCollector) are labelled
# cache_type, tp_rank, pp_rank and dp_rank only; vLLM's cache_config_info has every CacheConfig
# field and engine as labels, no model_name (v1/metrics/loggers.py log_metrics_info). Not LMCache:
# its MP server's L1 pool and transfers serve every vLLM that connects, whichever its model.
MODELLESS_JOINED = ("vllm", "sglang")


@dataclass(frozen=True)
class Rule:
    """Where one ServerStats field comes from on one server.

    how: "value" (a gauge or counter sample), "histogram" (the _bucket/_sum/_count of `sample`),
    "histogram_sum" (only its _sum), "sum_count" (sum in `sample`, count in `count_sample`),
    "label" (the number in label `label` of an info-style series, e.g. a configured size),
    "by_label" (a {value of label `label`: number} mapping, e.g. drops per reason).
    Series of one model (other labels: engine, worker, transfer type) are combined by `combine`.
    same_on_every_rank: labels (SGLang's tp_rank, pp_rank...) under which every rank reports the
    same logical count: the largest rank's value is taken before combining, never their sum.
    total_under_empty: a label whose empty value holds the total and whose other values break the
    same total down (SGLang's queue gauges by priority): only the total is read.
    labels_not: (label, value) pairs a series must NOT carry (vLLM's cache_config_info with no
    offload size configured, where its backend label means nothing).
    scale: what a number read from a label is multiplied by (a size in GiB read as bytes).
    """

    field: str
    sample: str
    how: Literal["value", "histogram", "histogram_sum", "sum_count", "label", "by_label"] = "value"
    labels: tuple[tuple[str, str], ...] = ()
    combine: Literal["sum", "max", "mean"] = "sum"
    count_sample: str = ""
    label: str = ""
    same_on_every_rank: tuple[str, ...] = ()
    total_under_empty: str = ""
    labels_not: tuple[tuple[str, str], ...] = ()
    scale: float = 1.0


_GPU_TO_CPU, _CPU_TO_GPU = (("transfer_type", "GPU_to_CPU"),), (("transfer_type", "CPU_to_GPU"),)
_STAGING_D2H, _STAGING_H2D = ((("phase", "staging"), ("direction", "d2h")),
                              (("phase", "staging"), ("direction", "h2d")))


def _sglang(field: str, sample: str, how: str = "value", **options) -> Rule:
    """An SGLang rule whose series repeat the same count on every TP/PP rank."""
    return Rule(field, sample, how, same_on_every_rank=SGLANG_RANK_LABELS, **options)  # type: ignore[arg-type]

RULES: dict[str, tuple[Rule, ...]] = {
    "vllm": (
        Rule("requests_running", "vllm:num_requests_running"),
        Rule("requests_waiting", "vllm:num_requests_waiting"),
        # V0 only (vllm/engine/metrics.py, removed with V0): requests whose KV cache was swapped
        # to the CPU swap space (--swap-space) and comes back over the bus when they resume.
        Rule("requests_swapped", "vllm:num_requests_swapped"),
        Rule("kv_cache_usage_ratio", "vllm:kv_cache_usage_perc", combine="max"),
        Rule("kv_cache_usage_ratio", "vllm:gpu_cache_usage_perc", combine="max"),  # before v0.10
        Rule("prompt_tokens", "vllm:prompt_tokens_total"),
        Rule("generated_tokens", "vllm:generation_tokens_total"),
        Rule("preemptions", "vllm:num_preemptions_total"),
        # One series per finished_reason (stop, length, abort, error, repetition: FinishReason in
        # vllm/v1/engine/__init__.py), each created at 0 (v1/metrics/loggers.py:808): all summed.
        Rule("requests_finished", "vllm:request_success_total"),
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
        # 0.33's HiSparse connector: KV bytes from host storage to its GPU hot buffers
        # (kv_connector/v1/hisparse/stats.py:112), read only where no offload connector counts.
        Rule("kv_offload_load_bytes", "vllm:hisparse_host_to_device_bytes_total"),
        Rule("kv_offload_store_seconds", "vllm:kv_offload_store_time_total"),
        Rule("kv_offload_store_seconds", "vllm:kv_offload_total_time_total", labels=_GPU_TO_CPU),
        Rule("kv_offload_load_seconds", "vllm:kv_offload_load_time_total"),
        Rule("kv_offload_load_seconds", "vllm:kv_offload_total_time_total", labels=_CPU_TO_GPU),
        # 0.33: the CPU tier's configuration and state (OffloadingConnector, CPUOffloadingSpec).
        Rule("kv_offload_host_tier_bytes", "vllm:kv_offload_config_info", "label",
             label="cpu_kv_cache_size_bytes"),
        Rule("kv_offload_host_tier_tokens", "vllm:kv_offload_config_info", "label",
             label="cpu_kv_cache_size_tokens"),
        # Where no offload manager reports yet (its series appears at the first scheduler step) or
        # LMCache runs the offload: CacheConfig's kv_offloading_size, in GiB summed over the TP
        # ranks (config/cache.py:383), as str() of the float in vllm:cache_config_info
        # (loggers.py:1120, every CacheConfig field a label); "None" when offloading is off.
        Rule("kv_offload_host_tier_bytes", "vllm:cache_config_info", "label", label="kv_offloading_size",
             scale=2**30),
        # --kv-offloading-backend lmcache with a size: the offload runs in LMCache, which vLLM does
        # not count (the same fact the collector reads from the command line).
        Rule("kv_offload_in_lmcache", "vllm:cache_config_info", labels=(("kv_offloading_backend", "lmcache"),),
             labels_not=(("kv_offloading_size", "None"),), combine="max"),
        # 0.33's tiering manager: traffic between the host (primary) tier and each secondary tier
        # (tier label "<n>:<type>", e.g. "1:fs": kv_offload/tiering/metrics.py tier_label).
        Rule("kv_offload_secondary_store_bytes", "vllm:kv_offload_tiering_write_bytes_total", "by_label",
             label="tier"),
        Rule("kv_offload_secondary_load_bytes", "vllm:kv_offload_tiering_read_bytes_total", "by_label",
             label="tier"),
        Rule("kv_offload_host_tier_pinned_ratio", "vllm:kv_offload_cpu_cache_usage_perc", combine="max"),
        Rule("kv_offload_host_tier_pinned_by_store_ratio", "vllm:kv_offload_cpu_cache_write_usage_perc",
             combine="max"),
        Rule("kv_offload_allocation_failures", "vllm:kv_offload_allocation_failure_total"),
        Rule("prefix_cache_host_hit_tokens", "vllm:prompt_tokens_cached_by_source_total",
             labels=(("source", "host"),)),
        Rule("requests_waiting_deferred", "vllm:num_requests_waiting_by_reason",
             labels=(("reason", "deferred"),)),
        Rule("weights_offloaded", "vllm:engine_sleep_state", labels=(("sleep_state", "weights_offloaded"),),
             combine="max"),
        # VLLM_USE_SIMPLE_KV_OFFLOAD=1: SimpleCPUOffloadConnector counts blocks, not bytes.
        Rule("kv_offload_load_blocks", "vllm:simple_kv_offload_load_blocks_total"),
        Rule("kv_offload_store_dropped_blocks", "vllm:simple_kv_offload_save_outcomes_total",
             labels=(("outcome", "dropped_cpu_full"),)),
        Rule("kv_offload_host_tier_blocks", "vllm:simple_kv_offload_info", "label", label="capacity_blocks"),
    ),
    "sglang": (
        # With --enable-priority-scheduling the queue gauges hold the total under priority="" and
        # the same requests again under priority="<n>" (metrics_collector.py _log_gauge_queue_count);
        # the token counters, filled per request, hold each priority's share once (no total).
        _sglang("requests_running", "sglang:num_running_reqs", total_under_empty="priority"),
        _sglang("requests_waiting", "sglang:num_queue_reqs", total_under_empty="priority"),
        _sglang("kv_cache_usage_ratio", "sglang:token_usage", combine="max"),
        _sglang("prompt_tokens", "sglang:prompt_tokens_total"),
        _sglang("generated_tokens", "sglang:generation_tokens_total"),
        _sglang("preemptions", "sglang:num_retracted_requests_total"),
        _sglang("preempted_prompt_tokens", "sglang:num_retracted_input_tokens_total"),
        _sglang("preempted_generated_tokens", "sglang:num_retracted_output_tokens_total"),
        # The tokenizer's, once per finished request (observe_one_finished_request), by
        # is_streaming and, with priority scheduling, each priority's share: all summed.
        _sglang("requests_finished", "sglang:num_requests_total"),
        _sglang("time_to_first_token", "sglang:time_to_first_token_seconds", "histogram"),
        _sglang("inter_token_latency", "sglang:inter_token_latency_seconds", "histogram"),
        _sglang("inter_token_latency", "sglang:time_per_output_token_seconds", "histogram"),
        # The radix cache is looked up with every prompt token; cached_tokens are its hits (0.5.23:
        # by cache_source device/host/storage, all of them hits).
        _sglang("prefix_cache_queried_tokens", "sglang:prompt_tokens_total"),
        _sglang("prefix_cache_hit_tokens", "sglang:cached_tokens_total"),
        _sglang("prefix_cache_host_hit_tokens", "sglang:cached_tokens_total", labels=(("cache_source", "host"),)),
        _sglang("prefix_cache_hit_ratio", "sglang:cache_hit_rate", combine="mean"),
        # HiCache (0.5.23's RadixCacheMetricsCollector, metrics_collector.py:2417-2432): labels
        # cache_type, tp_rank, pp_rank, dp_rank and no model_name; normalise() files them under
        # the endpoint's one model. Backup = GPU -> host (store), load back = host -> GPU (load).
        # Bytes are each rank's own KV shard ("sum ranks for the physical total"), so they are
        # summed; token counts are "the same logical count" on every rank: one rank's (the
        # largest). dp_rank is not a rank label here: data-parallel ranks cache other requests.
        Rule("kv_offload_store_bytes", "sglang:hicache_backup_bytes_total"),
        Rule("kv_offload_load_bytes", "sglang:load_back_bytes_total"),
        Rule("kv_offload_store_seconds", "sglang:hicache_backup_duration_seconds", "histogram_sum"),
        Rule("kv_offload_load_seconds", "sglang:load_back_duration_seconds", "histogram_sum"),
        _sglang("kv_offload_host_tier_used_tokens", "sglang:hicache_host_used_tokens", combine="max"),
        _sglang("kv_offload_host_tier_tokens", "sglang:hicache_host_total_tokens", combine="max"),
        _sglang("kv_offload_store_tokens", "sglang:hicache_backup_tokens_total", labels=(("pool", "kv"),)),
        _sglang("kv_offload_load_tokens", "sglang:load_back_tokens_total", labels=(("pool", "kv"),)),
        _sglang("kv_cache_evicted_tokens", "sglang:evicted_tokens_total"),
        _sglang("kv_offload_dropped_tokens", "sglang:hicache_dropped_tokens_total", "by_label", label="reason"),
    ),
    "llamacpp": (
        Rule("requests_running", "llamacpp:requests_processing"),
        Rule("requests_waiting", "llamacpp:requests_deferred"),
        Rule("kv_cache_usage_ratio", "llamacpp:kv_cache_usage_ratio", combine="max"),  # removed
        Rule("prompt_tokens", "llamacpp:prompt_tokens_total"),
        # Moves only when a request finishes; inference_llamacpp.refine() replaces it with
        # n_decode_total x n_busy_slots_per_decode, which rises with every decode, where published.
        Rule("generated_tokens", "llamacpp:tokens_predicted_total"),
        # Its tokens/s gauges restart on every scrape; generation seconds over tokens do not. The
        # mean reads low by (n - 1) / n per request: the server divides t_gen by n - 1.
        Rule("inter_token_latency", "llamacpp:tokens_predicted_seconds_total", "sum_count",
             count_sample="llamacpp:tokens_predicted_total"),
        # Prompt tokens reused from the prefix cache (b11434 has it); queried = these + processed.
        Rule("prefix_cache_hit_tokens", "llamacpp:prompt_tokens_cached_total"),
    ),
    "tgi": (
        Rule("requests_running", "tgi_batch_current_size"),
        Rule("requests_waiting", "tgi_queue_size"),
        Rule("prompt_tokens", "tgi_request_input_length", "histogram_sum"),
        Rule("generated_tokens", "tgi_request_generated_tokens", "histogram_sum"),
        Rule("inter_token_latency", "tgi_request_mean_time_per_token_duration", "histogram"),
        # Tokens the running batch may still grow to (its KV reservation) against the most the
        # router lets a batch hold (--max-batch-total-tokens, or what the warmup found fits).
        Rule("batch_reserved_tokens", "tgi_batch_current_max_tokens"),
        Rule("batch_max_tokens", "tgi_batch_max_total_tokens", combine="max"),
    ),
    "lmcache": (
        Rule("prefix_cache_queried_tokens", "lmcache:num_requested_tokens_total"),
        Rule("prefix_cache_hit_tokens", "lmcache:num_hit_tokens_total"),
        Rule("prefix_cache_hit_ratio", "lmcache:retrieve_hit_rate", combine="mean"),
        Rule("kv_offload_store_seconds", "lmcache:time_to_store", "histogram_sum"),
        Rule("kv_offload_load_seconds", "lmcache:time_to_retrieve", "histogram_sum"),
        Rule("kv_offload_host_cache_bytes", "lmcache:local_cache_usage"),
        # Chunks ("keys") evicted from the local CPU backend (observability.py:1029; the
        # evict_count beside it counts eviction passes, not what they freed).
        Rule("kv_offload_host_tier_evicted_chunks", "lmcache:local_cpu_evict_keys_count_total"),
        # MP mode's standalone server (OTel instruments; L0 = GPU, L1 = host DRAM, L2 = storage).
        Rule("prefix_cache_queried_tokens", "lmcache_mp_lookup_requested_tokens_total"),
        Rule("prefix_cache_hit_tokens", "lmcache_mp_lookup_hit_tokens_total"),
        Rule("prefix_cache_host_hit_tokens", "lmcache_mp_lookup_hit_l1_tokens_total"),
        Rule("kv_offload_host_cache_bytes", "lmcache_mp_l1_memory_usage_bytes"),
        Rule("kv_offload_allocation_failures", "lmcache_mp_l1_allocation_failure_chunks_total"),
        Rule("kv_offload_host_tier_evicted_chunks", "lmcache_mp_l1_evicted_chunks_total"),
        # GPU <-> host bytes of the plan executor (subscribers/metrics/phase_timing.py:71), per
        # phase and direction (d2h, h2d: TransferDirection). The staging phase is the DMA over the
        # bus, the kernel phase the gather on the GPU; the HELP divides bytes by time for staging
        # only, so staging is read. The attributes carry no model: the series sit under "".
        Rule("kv_offload_store_bytes", "lmcache_mp_transfer_phase_bytes_total", labels=_STAGING_D2H),
        Rule("kv_offload_load_bytes", "lmcache_mp_transfer_phase_bytes_total", labels=_STAGING_H2D),
        Rule("kv_offload_store_seconds", "lmcache_mp_transfer_phase_elapsed_seconds_total", labels=_STAGING_D2H),
        Rule("kv_offload_load_seconds", "lmcache_mp_transfer_phase_elapsed_seconds_total", labels=_STAGING_H2D),
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
          "scraped), model (the server's model_name label, LMCache's served_model_name where set; "
          "series without one, SGLang's HiCache families, take the endpoint's model when it serves "
          "one, else it is empty) and pid (the "
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
    "requests_swapped": _spec(
        "hybridmon_inference_requests_swapped", "gauge",
        "Requests whose KV cache sits in the CPU swap space (vllm:num_requests_swapped, vLLM V0 "
        "with --swap-space): their blocks cross the bus back to the GPU when they resume."),
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
    "preempted_prompt_tokens": _spec(
        "hybridmon_inference_preempted_prompt_tokens_total", "counter",
        "Prompt tokens of preempted requests, whose KV is recomputed or reloaded when they resume "
        "(sglang:num_retracted_input_tokens_total; one TP rank)."),
    "preempted_generated_tokens": _spec(
        "hybridmon_inference_preempted_generated_tokens_total", "counter",
        "Tokens preempted requests had generated, whose KV is recomputed or reloaded when they "
        "resume (sglang:num_retracted_output_tokens_total; one TP rank)."),
    "requests_finished": _spec(
        "hybridmon_inference_requests_finished_total", "counter",
        "Requests the server finished, whatever the reason (vllm:request_success_total summed over "
        "finished_reason, sglang:num_requests_total); preemptions over it is the share of requests "
        "preempted."),
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
    "kv_offload_host_tier_bytes": _spec(
        "hybridmon_inference_kv_offload_host_tier_bytes", "gauge",
        "Configured size in bytes of the server's host-memory KV cache tier (vLLM 0.33: the "
        "cpu_kv_cache_size_bytes label of vllm:kv_offload_config_info, per engine, summed; where "
        "that is absent, the kv_offloading_size label (GiB) of vllm:cache_config_info). Absent "
        "where the server publishes no size in bytes: SGLang gives its HiCache host tier in tokens "
        "only (..._host_tier_tokens), LMCache only its usage (..._host_cache_bytes)."),
    "kv_offload_host_tier_tokens": _spec(
        "hybridmon_inference_kv_offload_host_tier_tokens", "gauge",
        "Capacity of the host-memory KV tier in tokens (sglang:hicache_host_total_tokens; vLLM: "
        "the cpu_kv_cache_size_tokens label of vllm:kv_offload_config_info, at max_model_len)."),
    "kv_offload_host_tier_used_tokens": _spec(
        "hybridmon_inference_kv_offload_host_tier_used_tokens", "gauge",
        "Tokens held in the host-memory KV tier (sglang:hicache_host_used_tokens; one TP rank, "
        "every rank holds its shard of the same tokens)."),
    "kv_offload_host_tier_blocks": _spec(
        "hybridmon_inference_kv_offload_host_tier_blocks", "gauge",
        "Capacity in KV blocks of vLLM's simple CPU offload pool (VLLM_USE_SIMPLE_KV_OFFLOAD: the "
        "capacity_blocks label of vllm:simple_kv_offload_info)."),
    "kv_offload_host_tier_pinned_ratio": _spec(
        "hybridmon_inference_kv_offload_host_tier_pinned_ratio", "gauge",
        "Share 0-1 of the host KV tier's chunks pinned by in-flight transfers (being written or "
        "read), not how full it is: cached chunks that may be evicted are not counted "
        "(vllm:kv_offload_cpu_cache_usage_perc, named usage by vLLM; the fullest engine)."),
    "kv_offload_host_tier_pinned_by_store_ratio": _spec(
        "hybridmon_inference_kv_offload_host_tier_pinned_by_store_ratio", "gauge",
        "Share 0-1 of the host KV tier's chunks pinned by stores not yet complete (GPU to host; "
        "vllm:kv_offload_cpu_cache_write_usage_perc). Pinned minus this is pinned by loads."),
    "kv_offload_allocation_failures": _spec(
        "hybridmon_inference_kv_offload_allocation_failures_total", "counter",
        "Stores into the host KV tier that could not get space (vllm:kv_offload_allocation_"
        "failure_total; LMCache MP lmcache_mp_l1_allocation_failure_chunks_total, in chunks)."),
    "kv_offload_load_blocks": _spec(
        "hybridmon_inference_kv_offload_load_blocks_total", "counter",
        "KV blocks loaded back to the GPU from vLLM's simple CPU offload pool "
        "(vllm:simple_kv_offload_load_blocks_total)."),
    "kv_offload_store_dropped_blocks": _spec(
        "hybridmon_inference_kv_offload_store_dropped_blocks_total", "counter",
        "KV blocks vLLM's simple CPU offload did not store because the pool was full "
        "(vllm:simple_kv_offload_save_outcomes_total{outcome=\"dropped_cpu_full\"})."),
    "kv_offload_host_tier_evicted_chunks": _spec(
        "hybridmon_inference_kv_offload_host_tier_evicted_chunks_total", "counter",
        "KV chunks evicted from the host-memory tier to make room (LMCache lmcache:local_cpu_evict_"
        "keys_count_total; MP mode lmcache_mp_l1_evicted_chunks_total): what a later prompt no "
        "longer finds in host memory."),
    "kv_cache_evicted_tokens": _spec(
        "hybridmon_inference_kv_cache_evicted_tokens_total", "counter",
        "GPU KV token slots freed by eviction, backed up to host or not (sglang:evicted_tokens_"
        "total; one TP rank)."),
    "prefix_cache_host_hit_tokens": _spec(
        "hybridmon_inference_prefix_cache_host_hit_tokens_total", "counter",
        "Prompt tokens whose KV was found in host memory (the offload tier) rather than on the GPU "
        "(vllm:prompt_tokens_cached_by_source_total{source=\"host\"}, sglang:cached_tokens_total"
        "{cache_source=\"host\"}, LMCache MP lmcache_mp_lookup_hit_l1_tokens_total)."),
    "requests_waiting_deferred": _spec(
        "hybridmon_inference_requests_waiting_deferred", "gauge",
        "Waiting requests held back by a transient constraint (KV transfer, LoRA budget) rather "
        "than capacity (vllm:num_requests_waiting_by_reason{reason=\"deferred\"})."),
    "weights_offloaded": _spec(
        "hybridmon_inference_weights_offloaded", "gauge",
        "1 while the engine sleeps with its weights offloaded to host memory (sleep level 1; "
        "vllm:engine_sleep_state{sleep_state=\"weights_offloaded\"}), else 0."),
    "batch_reserved_tokens": _spec(
        "hybridmon_inference_batch_reserved_tokens", "gauge",
        "Tokens the running batch may grow to, the KV cache it reserves (tgi_batch_current_max_"
        "tokens)."),
    "batch_max_tokens": _spec(
        "hybridmon_inference_batch_max_tokens", "gauge",
        "Most tokens a batch may hold (tgi_batch_max_total_tokens): reserved over this is how "
        "full TGI's KV cache is."),
    "kv_offload_in_lmcache": _spec(
        "hybridmon_inference_kv_offload_in_lmcache", "gauge",
        "1 where vLLM hands its KV offload to LMCache's multiprocess server (its command line has "
        "--kv-offloading-backend lmcache or LMCacheMPConnector, or vllm:cache_config_info says "
        "kv_offloading_backend=\"lmcache\" with a kv_offloading_size): vLLM then publishes no offload "
        "family at all, and the traffic is on LMCache's own exporter (port 9090 unless "
        "--prometheus-port), not zero; absent otherwise."),
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
    "vllm:kv_offload_total_bytes_total{transfer_type=GPU_to_CPU|CPU_to_GPU}; SGLang HiCache "
    "sglang:hicache_backup_bytes_total / load_back_bytes_total, summed over ranks; vLLM 0.33 "
    "HiSparse vllm:hisparse_host_to_device_bytes_total as load where no connector counts; LMCache "
    "MP lmcache_mp_transfer_phase_bytes_total{phase=\"staging\",direction=d2h|h2d}).", "direction")
OFFLOAD_TOKENS = _spec(
    "hybridmon_inference_kv_offload_tokens_total", "counter",
    "Tokens whose KV the offload tier moved, by direction: store = GPU to host, load = host to GPU "
    "(SGLang HiCache sglang:hicache_backup_tokens_total / load_back_tokens_total of pool kv; one TP "
    "rank, every rank counts the same logical tokens).", "direction")
OFFLOAD_SECONDARY_TIER_BYTES = _spec(
    "hybridmon_inference_kv_offload_secondary_tier_bytes_total", "counter",
    "KV bytes moved between the host tier and a secondary tier (disk, object store, peer), by tier "
    "as the server names it and direction: store = host to the tier, load = the tier to host "
    "(vLLM 0.33 vllm:kv_offload_tiering_write_bytes_total / read_bytes_total{tier=\"<n>:<type>\"}, "
    "summed over engines).", "tier", "direction")
OFFLOAD_DROPPED_TOKENS = _spec(
    "hybridmon_inference_kv_offload_dropped_tokens_total", "counter",
    "GPU KV tokens evicted without a host copy, by reason (sglang:hicache_dropped_tokens_total: "
    "host_pressure, write_through_unbacked_eviction; one TP rank, every rank counts the same "
    "logical tokens).", "reason")
OFFLOAD_SECONDS = _spec(
    "hybridmon_inference_kv_offload_seconds_total", "counter",
    "Seconds the offload connector spent moving KV cache, by direction (vllm:kv_offload_store_time_"
    "total / load_time_total or kv_offload_total_time_total; the _sum of lmcache:time_to_store and "
    "time_to_retrieve, of sglang:hicache_backup_duration_seconds and load_back_duration_seconds; "
    "LMCache MP lmcache_mp_transfer_phase_elapsed_seconds_total{phase=\"staging\"}). "
    "Bytes over seconds is the transfer rate the copies achieved.", "direction")


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
MODELS_LEFT_OUT = MetricSpec(
    "hybridmon_inference_models_left_out",
    "Models the endpoint's last scrape published beyond [inference] max_models_per_endpoint, whose "
    "series the agent left out (it keeps the busiest by generated tokens); 0 when none. Counted among "
    "the models it reads of a body: the first 4 x max_models_per_endpoint (at least 64). A peer that "
    "publishes thousands of models would otherwise cost memory and /metrics time per series.",
    "gauge", ("endpoint",))
SCRAPE_ERROR = MetricSpec(
    "hybridmon_inference_scrape_error",
    "1 with the reason the endpoint's last scrape failed; absent when it succeeded. timeout: no "
    "complete answer in time; refused: nothing listens; connection: reset, TLS or DNS failure; "
    "http_status: not HTTP 200; too_large: the body is over [inference] max_body_bytes; "
    "not_prometheus / not_json: not the expected format (an HTML page); unknown_server: no family "
    "of the expected server; missing_families: a family every version of the server publishes is "
    "missing (its names changed); unreadable: the agent failed to read the answer (a bug, logged).",
    "gauge", ("endpoint", "reason"))

# What each `reason` of SCRAPE_ERROR means and what to check first: the finding's text
# (agent/alerts/inference_scrape.py) and the status page name them in these words.
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
    "unreadable": ("answered something the agent failed to read: a bug in hybridmon, whose other "
                   "endpoints are still read", "the agent log's ERROR line for the endpoint; please report it"),
}

METRIC_SPECS = (*BY_FIELD.values(), OFFLOAD_BYTES, OFFLOAD_SECONDS, OFFLOAD_TOKENS, OFFLOAD_DROPPED_TOKENS,
                OFFLOAD_SECONDARY_TIER_BYTES,
                *(spec for specs in HISTOGRAM_SPECS.values() for spec in specs),
                SCRAPE_SUCCESS, SCRAPE_DURATION, SCRAPE_ERROR, MODELS_LEFT_OUT)
