"""One small model per server and model: what the inference collector reads from any server
(inference_formats.py fills it from each server's own names, inference_llamacpp.py refines
llama.cpp's), so a detector reads "generated tokens" or "KV cache usage" without knowing which
server it is looking at.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

# A parsed /metrics body: {sample name: [(labels, value)]}.
SampleIndex = dict[str, list[tuple[dict[str, str], float]]]


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts (upper bound, count; +Inf last), the sum and the count.

    No buckets: the server gives only the sum and the count (llama.cpp's generation seconds and
    tokens), so the mean is known but no quantile.
    """

    buckets: tuple[tuple[float, float], ...]
    sum: float
    count: float


@dataclass
class ServerStats:
    """One model on one server at one scrape. None: the server does not publish it (absent)."""

    server: str
    model: str
    requests_running: float | None = None
    requests_waiting: float | None = None
    requests_swapped: float | None = None  # vLLM V0's swap space
    prompt_tokens: float | None = None  # counter
    generated_tokens: float | None = None  # counter
    time_to_first_token: Histogram | None = None
    inter_token_latency: Histogram | None = None
    kv_cache_usage_ratio: float | None = None
    preemptions: float | None = None  # counter
    preempted_prompt_tokens: float | None = None  # counter, prompt tokens of preempted requests
    preempted_generated_tokens: float | None = None  # counter, their generated tokens, recomputed
    requests_finished: float | None = None  # counter, every finish reason together (issue 31)
    prefix_cache_queried_tokens: float | None = None  # counter
    prefix_cache_hit_tokens: float | None = None  # counter
    prefix_cache_hit_ratio: float | None = None  # for servers that publish only a ratio
    kv_offload_store_bytes: float | None = None  # counter, device -> host
    kv_offload_load_bytes: float | None = None  # counter, host -> device
    kv_offload_store_seconds: float | None = None  # counter
    kv_offload_load_seconds: float | None = None  # counter
    kv_offload_store_tokens: float | None = None  # counter, device -> host
    kv_offload_load_tokens: float | None = None  # counter, host -> device
    # counters by secondary tier (vLLM's tiering: "1:fs"...), beyond the host tier
    kv_offload_secondary_store_bytes: dict[str, float] | None = None  # host -> tier
    kv_offload_secondary_load_bytes: dict[str, float] | None = None  # tier -> host
    kv_offload_host_cache_bytes: float | None = None
    kv_offload_host_tier_bytes: float | None = None  # gauge, configured size of the host KV tier
    kv_offload_host_tier_tokens: float | None = None
    kv_offload_host_tier_used_tokens: float | None = None
    kv_offload_host_tier_blocks: float | None = None
    kv_offload_host_tier_pinned_ratio: float | None = None  # pinned by in-flight transfers, not fullness
    kv_offload_host_tier_pinned_by_store_ratio: float | None = None
    kv_offload_allocation_failures: float | None = None  # counter
    kv_offload_load_blocks: float | None = None  # counter
    kv_offload_store_dropped_blocks: float | None = None  # counter, host pool full
    kv_offload_host_tier_evicted_chunks: float | None = None  # counter
    kv_offload_dropped_tokens: dict[str, float] | None = None  # counters by reason
    kv_cache_evicted_tokens: float | None = None  # counter
    prefix_cache_host_hit_tokens: float | None = None  # counter
    requests_waiting_deferred: float | None = None
    weights_offloaded: float | None = None  # 0 or 1
    batch_reserved_tokens: float | None = None
    batch_max_tokens: float | None = None
    kv_offload_in_lmcache: float | None = None  # 1: vLLM hands its KV offload to LMCache's server (cmdline)
    model_size_bytes: float | None = None
    model_host_memory_bytes: float | None = None

    def known_fields(self) -> set[str]:
        return {f.name for f in fields(self)[2:] if getattr(self, f.name) is not None}
