"""The synthetic host's inference server: a vLLM whose /metrics follows the scenario's state.

vLLM (pid 4242 on the fixture host, listening on 0.0.0.0:18000 in its /proc/4242/net/tcp) serves
one model; a scenario may add more servers at other endpoints (SyntheticHost.add_inference_server,
each an InferenceServer of its own). A scenario sets its load each tick (`ServerLoad`: running and waiting requests, the
median inter-token latency and time to first token, KV-cache usage, preemptions, prefix hits by
tier, KV offload traffic, and how the endpoint answers); `InferenceServer.advance` integrates the counters and
histograms over the tick, and `published` gives the answer of the moment: the body vLLM's V1
engine would serve (the new names: kv_cache_usage_perc, inter_token_latency_seconds,
kv_offload_{load,store}_{bytes,time}_total), or how the endpoint fails.
While a trace is generated, loopback.LoopbackServer serves the published answer over HTTP on
127.0.0.1 and the recording agent's inference collector reaches it through the real HTTP client.

Consistency by construction: each running request emits one token per inter-token latency, so
generation tokens/s = running / ITL; each request generates OUTPUT_TOKENS after PROMPT_TOKENS of
prompt, so its first token is one TTFT observation and the other tokens ITL observations, and it
finishes (vllm:request_success_total, finished_reason "length") with its last token; the
histograms place their observations so that the quantile Prometheus's histogram_quantile (and the
collector) reads from the bucket increases is the scenario's median; KV offload seconds are the
bytes over the copy rate the link sustains.
"""
from __future__ import annotations

import math
import random
import threading
from dataclasses import dataclass, replace

from prometheus_client.utils import floatToGoString

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
# The fixture's vLLM listens here; the collector is configured with this URL, so the endpoint
# label is the same in every trace and the endpoint is tied to pid 4242 (see loopback.py).
ENDPOINT = "http://127.0.0.1:18000/metrics"
PROMPT_TOKENS = 1000   # prompt tokens per request
OUTPUT_TOKENS = 250    # tokens generated per request
PREFIX_HIT_SHARE = 0.25  # share of prompt tokens found in the prefix cache
# vLLM V1's bucket bounds (vllm/v1/metrics/loggers.py), as tests/fixtures/inference/ has them.
TTFT_BOUNDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BOUNDS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
              20.0, 40.0, 80.0)
# Log-normal spread (sigma of ln) of each latency around its median: decode steps vary little,
# time to first token (queueing, prompt length) a lot.
ITL_SPREAD, TTFT_SPREAD = 0.2, 0.5
ANSWERS = ("metrics", "html", "unavailable", "down")
HTML_PAGE = ("<!DOCTYPE html>\n<html><head><title>Sign in</title></head>"
             "<body><form method=\"post\" action=\"/login\">Sign in</form></body></html>\n")


@dataclass
class ServerLoad:
    """The server at one moment; the defaults are the healthy host's vLLM (1,450 tokens/s)."""

    running: float = 55.0                          # requests in the running batch
    waiting: float = 2.0                           # requests queued
    inter_token_latency_seconds: float = 0.038     # median
    time_to_first_token_seconds: float = 0.15      # median
    kv_cache_usage: float = 0.55                   # 0-1 of the GPU KV cache
    preemptions_per_second: float = 0.0
    # None: no KV offload connector configured, so vLLM publishes no kv_offload family.
    kv_offload_load_bytes_per_second: float | None = 4e9    # host -> GPU
    kv_offload_store_bytes_per_second: float | None = 2e9   # GPU -> host
    kv_offload_copy_bytes_per_second: float = 27.7e9  # what one copy achieves (Gen4 x16: 88 %)
    # The configured CPU KV tier (vLLM 0.33's vllm:kv_offload_config_info, label
    # cpu_kv_cache_size_bytes; docs/server-metric-names/vllm-0.33.0.txt); None: not published.
    kv_offload_host_tier_bytes: float | None = None
    # LMCache inside vLLM (LMCacheConnectorV1, local CPU backend): its families in vLLM's body,
    # labels model_name and worker_id as tests/fixtures/inference/lmcache.1.prom has them; they
    # count tokens and the host cache's bytes, never bytes moved (lmcache/observability.py).
    lmcache_host_cache_bytes: float | None = None
    # V0's swap space (vllm/engine/metrics.py vllm:num_requests_swapped); None: V1, not published.
    requests_swapped: float | None = None
    # Shares of prompt tokens found in the prefix cache: on the GPU (vllm:prefix_cache_hits, local
    # only) and, with a KV offload connector, in its host tier (an external hit: 0.33's
    # vllm:prompt_tokens_cached_by_source{source="host"}, which sums with source="device" to
    # prefix_cache_hits + external_prefix_cache_hits; docs/server-metric-names/vllm-0.33.0.txt:117).
    # None: the by-source family is not published.
    prefix_device_hit_share: float = PREFIX_HIT_SHARE
    prefix_host_hit_share: float | None = None
    # Share of finished requests that were preempted on their way; None: preemptions_per_second
    # sets them instead. A share follows the requests whatever the noise does to their rate.
    preempted_share: float | None = None
    # Where a source gives time to first token as a mean (H10's table): the histogram's _sum grows
    # by it per first token, while the buckets follow the median; None: the buckets' midpoints.
    time_to_first_token_mean_seconds: float | None = None
    answer: str = "metrics"  # metrics, html (a login page), unavailable (HTTP 503), down (refused)

    @property
    def generation_tokens_per_second(self) -> float:
        return self.running / self.inter_token_latency_seconds if self.running > 0 else 0.0


def latency_shares(bounds: tuple[float, ...], median: float, spread: float) -> list[float]:
    """Cumulative share of observations at or below each bound: log-normal around `median`,
    except that the median's own bucket is filled so that interpolating linearly in it (what
    histogram_quantile does) gives exactly `median`. Nothing falls above the last bound."""
    if not bounds[0] < median <= bounds[-1]:
        raise ValueError(f"median {median} s is outside the buckets ({bounds[0]}, {bounds[-1]}]")
    smooth = [0.5 * math.erfc(-math.log(bound / median) / (spread * math.sqrt(2))) for bound in bounds]
    upper = next(i for i, bound in enumerate(bounds) if median <= bound)
    lower_bound = bounds[upper - 1]
    within = (median - lower_bound) / (bounds[upper] - lower_bound)
    in_bucket = min(0.5, max(0.05, smooth[upper] - smooth[upper - 1]))
    below, above = 0.5 - in_bucket * within, 0.5 + in_bucket * (1 - within)
    shares = []
    for i, share in enumerate(smooth):
        if i < upper - 1:
            shares.append(below * share / smooth[upper - 1] if smooth[upper - 1] > 0 else 0.0)
        elif i == upper - 1:
            shares.append(below)
        elif i == upper:
            shares.append(above)
        else:
            tail = smooth[-1] - smooth[upper]
            shares.append(above + (1 - above) * ((share - smooth[upper]) / tail if tail > 0 else 1.0))
    shares[-1] = 1.0
    return shares


class LatencyHistogram:
    """A Prometheus histogram whose bucket counts only grow and are whole numbers when read."""

    def __init__(self, bounds: tuple[float, ...], spread: float) -> None:
        self.bounds = bounds
        self.spread = spread
        self.cumulative = [0.0] * len(bounds)  # fractional, so that small steps add up exactly
        self.sum = 0.0

    def observe(self, count: float, median: float, mean: float | None = None) -> None:
        if count <= 0:
            return
        shares = latency_shares(self.bounds, median, self.spread)
        self.cumulative = [total + count * share for total, share in zip(self.cumulative, shares)]
        if mean is not None:
            self.sum += count * mean
            return
        edges = (0.0,) + self.bounds
        self.sum += count * sum((shares[i] - (shares[i - 1] if i else 0.0)) * (edges[i] + edges[i + 1]) / 2
                                for i in range(len(shares)))

    def lines(self, name: str, labels: str) -> list[str]:
        counts = [math.floor(total) for total in self.cumulative]
        lines = [f'{name}_bucket{{{labels},le="{floatToGoString(bound)}"}} {floatToGoString(count)}'
                 for bound, count in zip(self.bounds, counts)]
        lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {floatToGoString(counts[-1])}')
        lines.append(f"{name}_count{{{labels}}} {floatToGoString(counts[-1])}")
        lines.append(f"{name}_sum{{{labels}}} {floatToGoString(self.sum)}")
        return lines


class InferenceServer:
    """The state of the synthetic host's vLLM and the answer its endpoint gives."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)  # its own, so the host's noise is the same with or without it
        self.load = ServerLoad()
        self.prompt_tokens = 0.0
        self.generation_tokens = 0.0
        self.preemptions = 0.0
        self.prefix_queries = 0.0
        self.prefix_hits = {"device": 0.0, "host": 0.0}
        self.requests_finished = 0.0
        self.kv_offload_bytes = {"load": 0.0, "store": 0.0}
        self.kv_offload_seconds = {"load": 0.0, "store": 0.0}
        self.time_to_first_token = LatencyHistogram(TTFT_BOUNDS, TTFT_SPREAD)
        self.inter_token_latency = LatencyHistogram(ITL_BOUNDS, ITL_SPREAD)
        # The HTTP server's thread reads while the scenario's thread waits on the collector; the
        # lock makes that safe whatever the order. The body is rendered when asked for: most ticks
        # are not scraped.
        self._lock = threading.Lock()
        self._published: tuple[str, str | None] = ("down", None)

    def set_load(self, load: ServerLoad, noise: float = 1.0) -> None:
        """The load from now on, with a little deterministic noise (0: exact)."""
        with self._lock:
            self._set_load(load, noise)

    def _set_load(self, load: ServerLoad, noise: float) -> None:
        if load.answer not in ANSWERS:
            raise ValueError(f"unknown answer {load.answer!r}; one of {', '.join(ANSWERS)}")
        if min(load.inter_token_latency_seconds, load.time_to_first_token_seconds,
               load.kv_offload_copy_bytes_per_second) <= 0:
            raise ValueError("latencies and the copy rate must be > 0")

        def jitter(value: float | None, relative: float) -> float | None:
            return None if value is None else value * (1.0 + noise * self.rng.uniform(-relative, relative))

        self.load = replace(
            load, running=float(round(jitter(load.running, 0.03))), waiting=float(round(jitter(load.waiting, 0.1))),
            inter_token_latency_seconds=jitter(load.inter_token_latency_seconds, 0.02),
            time_to_first_token_seconds=jitter(load.time_to_first_token_seconds, 0.05),
            time_to_first_token_mean_seconds=jitter(load.time_to_first_token_mean_seconds, 0.05),
            kv_cache_usage=min(1.0, max(0.0, load.kv_cache_usage + noise * self.rng.uniform(-0.005, 0.005))),
            kv_offload_load_bytes_per_second=jitter(load.kv_offload_load_bytes_per_second, 0.01),
            kv_offload_store_bytes_per_second=jitter(load.kv_offload_store_bytes_per_second, 0.01))

    def advance(self, dt: float) -> None:
        """Let `dt` seconds of serving pass at the current load."""
        with self._lock:
            self._advance(dt)

    def _advance(self, dt: float) -> None:
        load = self.load
        if load.preemptions_per_second < 0 or load.running < 0:
            raise ValueError("negative load: running requests and preemptions/s must be >= 0")
        generated = load.generation_tokens_per_second * dt
        requests = generated / OUTPUT_TOKENS
        self.generation_tokens += generated
        self.prompt_tokens += requests * PROMPT_TOKENS
        self.prefix_queries += requests * PROMPT_TOKENS
        self.prefix_hits["device"] += requests * PROMPT_TOKENS * load.prefix_device_hit_share
        self.prefix_hits["host"] += requests * PROMPT_TOKENS * (load.prefix_host_hit_share or 0.0)
        self.requests_finished += requests
        if load.preempted_share is not None:
            self.preemptions += requests * load.preempted_share
        else:
            self.preemptions += load.preemptions_per_second * dt
        self.time_to_first_token.observe(requests, load.time_to_first_token_seconds,
                                         load.time_to_first_token_mean_seconds)
        self.inter_token_latency.observe(generated - requests, load.inter_token_latency_seconds)
        for direction in ("load", "store"):
            rate = getattr(load, f"kv_offload_{direction}_bytes_per_second")
            if rate is not None:
                self.kv_offload_bytes[direction] += rate * dt
                self.kv_offload_seconds[direction] += rate * dt / load.kv_offload_copy_bytes_per_second

    def publish(self) -> None:
        """Make the current state the endpoint's answer (what the next GET gets)."""
        with self._lock:
            self._published = (self.load.answer, None)

    def published(self) -> tuple[str, str]:
        """The answer (one of ANSWERS) and the body it comes with."""
        with self._lock:
            answer, body = self._published
            if body is None:
                body = self.render() if answer == "metrics" else HTML_PAGE
                self._published = (answer, body)
            return answer, body

    def render(self) -> str:
        """The body of vLLM's /metrics (prometheus_client's text format, V1 engine names)."""
        labels = f'engine="0",model_name="{MODEL}"'
        load = self.load
        lines = ["# HELP process_resident_memory_bytes Resident memory size in bytes.",
                 "# TYPE process_resident_memory_bytes gauge",
                 "process_resident_memory_bytes 3.105882112e+09"]

        def family(name: str, kind: str, help_text: str, value: float) -> None:
            lines.extend((f"# HELP {name} {help_text}", f"# TYPE {name} {kind}",
                          f"{name}{{{labels}}} {floatToGoString(value)}"))

        family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", load.running)
        family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", load.waiting)
        family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
               round(load.kv_cache_usage, 6))
        family("vllm:prefix_cache_queries_total", "counter",
               "Prefix cache queries, in terms of number of queried tokens.", math.floor(self.prefix_queries))
        family("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.",
               math.floor(self.prefix_hits["device"]))
        if load.prefix_host_hit_share is not None:
            name = "vllm:prompt_tokens_cached_by_source_total"
            lines.extend((f"# HELP {name} Prefix-cache hit tokens by the cache tier that supplied them: device "
                          "(local HBM), host (offloaded to DRAM), disk, p2p (transferred from another vLLM "
                          "instance) or external_unspecified. Counted at admission; sums to "
                          "vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.", f"# TYPE {name} counter"))
            lines.extend(f'{name}{{{labels},source="{source}"}} {floatToGoString(math.floor(self.prefix_hits[source]))}'
                         for source in ("device", "host"))
        # every request ends at its OUTPUT_TOKENS: finished_reason "length" (vllm/v1/metrics/loggers.py:808)
        name = "vllm:request_success_total"
        lines.extend((f"# HELP {name} Count of successfully processed requests.", f"# TYPE {name} counter",
                      f'{name}{{{labels},finished_reason="length"}} {floatToGoString(math.floor(self.requests_finished))}'))
        family("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
               math.floor(self.preemptions))
        family("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
               math.floor(self.prompt_tokens))
        family("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
               math.floor(self.generation_tokens))
        for name, help_text, histogram in (
                ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                 self.time_to_first_token),
                ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                 self.inter_token_latency)):
            lines.extend((f"# HELP {name} {help_text}", f"# TYPE {name} histogram"))
            lines.extend(histogram.lines(name, labels))
        if load.kv_offload_load_bytes_per_second is not None:
            for direction, verb in (("store", "stored"), ("load", "loaded")):
                family(f"vllm:kv_offload_{direction}_bytes_total", "counter",
                       f"Number of bytes {verb} by the KV offloading connector.",
                       math.floor(self.kv_offload_bytes[direction]))
            for direction, verb in (("store", "storing"), ("load", "loading")):
                family(f"vllm:kv_offload_{direction}_time_total", "counter", f"Time spent {verb} KV data, in seconds.",
                       round(self.kv_offload_seconds[direction], 6))
        if load.requests_swapped is not None:
            family("vllm:num_requests_swapped", "gauge", "Number of requests swapped to CPU.", load.requests_swapped)
        if load.lmcache_host_cache_bytes is not None:
            lmcache = f'model_name="{MODEL}",worker_id="0"'
            for name, kind, help_text, value in (
                    ("lmcache:num_requested_tokens_total", "counter", "Total number of tokens requested from lmcache",
                     math.floor(self.prompt_tokens)),
                    ("lmcache:num_hit_tokens_total", "counter", "Total number of tokens hit in lmcache",
                     math.floor(self.prompt_tokens * PREFIX_HIT_SHARE)),
                    ("lmcache:local_cache_usage", "gauge", "Local cache usage (bytes) of lmcache",
                     load.lmcache_host_cache_bytes)):
                lines.extend((f"# HELP {name} {help_text}", f"# TYPE {name} {kind}",
                              f"{name}{{{lmcache}}} {floatToGoString(value)}"))
        if load.kv_offload_host_tier_bytes is not None:
            # an info series: the figures are labels, the value 1; HELP and label names as in
            # tests/fixtures/inference/vllm-0.33-offloading.prom (the collector reads only the label)
            lines.extend(("# HELP vllm:kv_offload_config_info Static configuration of the KV offload "
                          "managers of this engine instance. The configured offloading spec declares the "
                          "label names, and each manager fills the values, so a series appears from the "
                          "first scheduler step of its engine. A manager reports one series for each "
                          "configuration it holds, and a label of its own tells the series apart. Each "
                          "engine reports its own configuration, not the instance total.",
                          "# TYPE vllm:kv_offload_config_info gauge",
                          f'vllm:kv_offload_config_info{{{labels},cpu_kv_cache_size_bytes='
                          f'"{int(load.kv_offload_host_tier_bytes)}"}} 1.0'))
        return "\n".join(lines) + "\n"
