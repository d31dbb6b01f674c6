"""Inference server collector: fixtures of every server, rates and quantiles between two scrapes,
bad answers, discovery beside a watched process, record and replay."""
from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmon.agent.config import AgentConfig, ConfigError, load_config, tomllib
from hybridmon.agent.daemon import Agent
from hybridmon.agent.detectors import windows
from hybridmon.agent.loop.history import History
from hybridmon.agent.status.inference import offload_elsewhere_rows
from hybridmon.exporters.sources import LiveSource, RecordingSource, ReplaySource
from hybridmon.exporters.base import NoDataError, ParseError
from hybridmon.exporters import inference
from hybridmon.exporters.inference import InferenceCollector, endpoint_url
from hybridmon.exporters.inference_formats import (interpret, keep_known_families, normalise,
                                                   parse_ollama_ps, parse_prometheus, recent_quantile)
from hybridmon.exporters.inference_stats import Histogram, ServerStats
from hybridmon.exporters.inference_names import METRIC_SPECS
from hybridmon.exporters.inference_scrape import connect_host, fetch, find_listeners, parse_proc_net_tcp
from tests.support.agent_helpers import fixture_config, run_every_collector_once
from tests.support.paths import FIXTURE_HOST, FIXTURES
from tests.support.fake_inference_server import FakeInferenceServer, vllm_with_models
from tests.support.parser_properties import texts_like
import functools

from hybridmon.exporters.inference_formats import parse_with_prometheus_client
from tests.support.parser_properties import ParserRow, read

INFERENCE = FIXTURES / "inference"
LLAMA_3 = "meta-llama/Meta-Llama-3-8B-Instruct"
QWEN_7B = "Qwen/Qwen2.5-7B-Instruct"
QWEN_14B = "Qwen/Qwen2.5-14B-Instruct"
FIXTURE_PROCFS = str(FIXTURE_HOST / "proc")
FIXTURE_TCP = (FIXTURE_HOST / "proc/4242/net/tcp").read_text()
STEP = 5.0  # the fixtures' two bodies are "5 s apart", the collector's default interval


def body(name: str) -> str:
    return (INFERENCE / name).read_text()


def pair(stem: str) -> tuple[str, str]:
    suffix = "json" if stem.startswith("ollama") else "prom"
    return body(f"{stem}.1.{suffix}"), body(f"{stem}.2.{suffix}")


def ok(url: str, text: str, content_type: str = "text/plain; version=0.0.4") -> dict:
    return {"url": url, "status": 200, "content_type": content_type, "body": text, "error": None,
            "detail": "", "seconds": 0.01}


def refused(url: str) -> dict:
    return {"url": url, "status": None, "content_type": None, "body": None, "error": "refused",
            "detail": "connection refused", "seconds": 0.001}


def scalars(stats: ServerStats) -> dict:
    """The fields that are numbers, absent ones left out."""
    return {name: getattr(stats, name) for name in sorted(stats.known_fields())
            if not isinstance(getattr(stats, name), (Histogram, dict))}


def values(samples, name: str, **labels: str) -> dict[tuple[str, ...], float]:
    return {s.label_values: s.value for s in samples.find(name, **labels)}


# --- every fixture, read into the model -----------------------------------------------------------

def test_vllm_v1_names_are_read():
    (stats,) = interpret(ok("u", body("vllm-v1-names.1.prom")), None).stats
    assert (stats.server, stats.model) == ("vllm", LLAMA_3)
    assert scalars(stats) == {
        "requests_running": 12, "requests_waiting": 3, "kv_cache_usage_ratio": 0.42,
        "prefix_cache_queried_tokens": 120000, "prefix_cache_hit_tokens": 30000, "preemptions": 4,
        "prompt_tokens": 250000, "generated_tokens": 180000,
        "kv_offload_store_bytes": 12e9, "kv_offload_load_bytes": 40e9,
        "kv_offload_store_seconds": 1.5, "kv_offload_load_seconds": 3.2,
    }
    assert (stats.time_to_first_token.sum, stats.time_to_first_token.count) == (95.5, 1000)
    assert stats.time_to_first_token.buckets[4] == (0.04, 150)
    assert stats.time_to_first_token.buckets[-1] == (float("inf"), 1000)
    assert (stats.inter_token_latency.sum, stats.inter_token_latency.count) == (6802.0, 179000)


def test_vllm_hisparse_host_to_device_bytes_are_kv_loads_where_no_connector_counts():
    """vLLM 0.33's HiSparse connector counts the KV bytes it copies from host storage to its GPU
    hot buffers (kv_connector/v1/hisparse/stats.py:112; labels model_name and engine, HELP as
    docs/server-metric-names/vllm-0.33.0.txt lists it); a connector's own counter wins."""
    hisparse = ('# HELP vllm:hisparse_host_to_device_bytes_total Bytes transferred from host KV storage to '
                'HiSparse hot buffers.\n# TYPE vllm:hisparse_host_to_device_bytes_total counter\n'
                f'vllm:hisparse_host_to_device_bytes_total{{engine="0",model_name="{LLAMA_3}"}} 7.5e+09\n')
    (stats,) = interpret(ok("u", body("vllm-v1-names.1.prom") + hisparse), None).stats
    assert stats.kv_offload_load_bytes == 40e9          # the offload connector's own
    without_connector = "".join(line + "\n" for line in body("vllm-v1-names.1.prom").splitlines()
                                if "kv_offload" not in line)
    (stats,) = interpret(ok("u", without_connector + hisparse), None).stats
    assert stats.kv_offload_load_bytes == 7.5e9


def test_vllm_v0_names_are_read_into_the_same_fields():
    (stats,) = interpret(ok("u", body("vllm-v0-names.1.prom")), None).stats
    assert (stats.server, stats.model) == ("vllm", QWEN_7B)
    assert scalars(stats) == {
        "requests_running": 5, "requests_waiting": 0, "kv_cache_usage_ratio": 0.31,
        "prefix_cache_hit_ratio": 0.12, "preemptions": 0, "prompt_tokens": 50000, "generated_tokens": 40000,
        "requests_swapped": 0,
    }
    assert (stats.time_to_first_token.sum, stats.time_to_first_token.count) == (12.4, 200)
    # time_per_output_token_seconds stands in for inter_token_latency_seconds
    assert (stats.inter_token_latency.sum, stats.inter_token_latency.count) == (995.0, 39800)


def test_vllm_offload_by_transfer_type_and_engines_are_combined():
    (stats,) = interpret(ok("u", body("vllm-v1-transfer-type.prom")), None).stats
    assert scalars(stats) == {
        "requests_running": 7, "requests_waiting": 1, "kv_cache_usage_ratio": 0.7,  # the fuller engine
        "generated_tokens": 2500, "kv_offload_store_bytes": 4e6, "kv_offload_load_bytes": 4e6,
        "kv_offload_store_seconds": 0.75, "kv_offload_load_seconds": pytest.approx(0.4),
    }


def test_llamacpp_is_read_from_its_counters_not_its_resetting_gauges():
    (stats,) = interpret(ok("u", body("llamacpp.1.prom")), None).stats
    assert (stats.server, stats.model) == ("llamacpp", "")
    assert scalars(stats) == {"requests_running": 2, "requests_waiting": 1, "prompt_tokens": 52000,
                              "generated_tokens": 20000}
    assert stats.inter_token_latency == Histogram((), 1000.0, 20000.0)
    assert stats.kv_cache_usage_ratio is None  # removed from llama.cpp; absent, not 0


def test_old_llamacpp_kv_cache_ratio_is_read():
    text = body("llamacpp.1.prom") + "# TYPE llamacpp:kv_cache_usage_ratio gauge\nllamacpp:kv_cache_usage_ratio 0.25\n"
    assert interpret(ok("u", text), None).stats[0].kv_cache_usage_ratio == 0.25


def test_sglang_is_read():
    (stats,) = interpret(ok("u", body("sglang.1.prom")), None).stats
    assert (stats.server, stats.model) == ("sglang", QWEN_14B)
    assert scalars(stats) == {
        "requests_running": 20, "requests_waiting": 0, "kv_cache_usage_ratio": 0.63, "preemptions": 3,
        "prompt_tokens": 800000, "generated_tokens": 400000, "prefix_cache_queried_tokens": 800000,
        "prefix_cache_hit_tokens": 360000, "prefix_cache_hit_ratio": 0.45,
    }
    assert (stats.time_to_first_token.sum, stats.inter_token_latency.count) == (600.0, 398000)


def test_tgi_is_read_from_histogram_sums():
    (stats,) = interpret(ok("u", body("tgi.1.prom")), None).stats
    assert (stats.server, stats.model) == ("tgi", "")
    assert scalars(stats) == {"requests_running": 8, "requests_waiting": 2, "prompt_tokens": 250000,
                              "generated_tokens": 100000, "batch_reserved_tokens": 12000}
    assert (stats.inter_token_latency.sum, stats.inter_token_latency.count) == (12.45, 498)
    assert stats.time_to_first_token is None


def test_lmcache_workers_are_combined():
    (stats,) = interpret(ok("u", body("lmcache.1.prom")), None).stats
    assert (stats.server, stats.model) == ("lmcache", LLAMA_3)
    assert scalars(stats) == {
        "prefix_cache_queried_tokens": 1e6, "prefix_cache_hit_tokens": 300000,
        "prefix_cache_hit_ratio": pytest.approx(0.3), "kv_offload_host_cache_bytes": 16e9,
        "kv_offload_load_seconds": 20.0, "kv_offload_store_seconds": 5.0,
    }


def test_lmcache_inside_vllm_metrics_gives_both_servers():
    reading = interpret(ok("u", body("vllm-v1-names.1.prom") + body("lmcache.1.prom")), None)
    assert reading.error is None
    assert [(s.server, s.model) for s in reading.stats] == [("vllm", LLAMA_3), ("lmcache", LLAMA_3)]


def test_ollama_ps_gives_the_bytes_in_host_memory():
    stats = parse_ollama_ps(body("ollama-ps.1.json"))
    assert [(s.server, s.model, s.model_size_bytes, s.model_host_memory_bytes) for s in stats] == [
        ("ollama", "llama3.1:70b", 47e9, 25e9), ("ollama", "nomic-embed-text:latest", 6e8, 0.0)]
    assert parse_ollama_ps('{"models": []}') == [] and parse_ollama_ps('{"models": null}') == []
    (odd,) = parse_ollama_ps('{"models": [{"name": "m", "size": 10, "size_vram": 20}]}')
    assert odd.model_host_memory_bytes is None  # more in VRAM than the model: unknown, not negative


def test_nan_and_infinite_values_are_absent():
    text = "vllm:num_requests_running NaN\nvllm:num_requests_waiting +Inf\nvllm:generation_tokens_total 5\n"
    assert parse_prometheus(text) == {"vllm:generation_tokens_total": [({}, 5.0)]}


def test_only_known_families_are_kept_and_other_bodies_stay_whole():
    kept = keep_known_families(body("vllm-v1-names.1.prom"))
    assert "python_gc" not in kept and "http_requests_total" not in kept
    whole = parse_prometheus(body("vllm-v1-names.1.prom"))
    assert normalise("vllm", parse_prometheus(kept)) == normalise("vllm", whole)
    page = "<html>\n<body>vllm:</body></html>\n"
    assert keep_known_families(page) == page


# --- the servers as released (issue 15): fixtures written from the wheels' metric definitions -----
# (docs/server-metric-names/*.txt; tests/fixtures/inference/README.md says which file stands for what)

SERVED_NAME = "llama-3-8b"  # vLLM started with --served-model-name llama-3-8b


def only(name: str, server: str | None = None) -> ServerStats:
    reading = interpret(ok("u", body(name)), server)
    assert reading.error is None, reading.detail
    (stats,) = reading.stats
    return stats


def test_vllm_033_offloading_connector_counts_each_byte_once():
    """0.33 emits the flat kv_offload_{store,load}_* and, deprecated, kv_offload_total_*{transfer_type}
    with the same bytes (offloading/metrics.py _increase_counter): read once, not added."""
    stats = only("vllm-0.33-offloading.prom")
    assert (stats.server, stats.model) == ("vllm", SERVED_NAME)
    assert scalars(stats) == {
        "requests_running": 6, "requests_waiting": 4, "requests_waiting_deferred": 3,
        "kv_cache_usage_ratio": 0.91, "preemptions": 2, "prompt_tokens": 50000, "generated_tokens": 20000,
        "prefix_cache_queried_tokens": 50000, "prefix_cache_hit_tokens": 30000,
        "prefix_cache_host_hit_tokens": 8000, "weights_offloaded": 0,
        "kv_offload_store_bytes": 4e9, "kv_offload_load_bytes": 2e9,
        "kv_offload_store_seconds": 0.5, "kv_offload_load_seconds": 0.25,
        "kv_offload_host_tier_bytes": 34359738368, "kv_offload_host_tier_tokens": 262144,
        "kv_offload_host_tier_pinned_ratio": 0.25, "kv_offload_host_tier_pinned_by_store_ratio": 0.15,
        "kv_offload_allocation_failures": 3, "requests_finished": 200,
    }


def test_vllm_config_info_without_a_size_leaves_the_tier_size_absent():
    text = body("vllm-0.33-offloading.prom").replace('cpu_kv_cache_size_tokens="262144"', 'cpu_kv_cache_size_tokens="None"')
    (stats,) = interpret(ok("u", text), None).stats
    assert stats.kv_offload_host_tier_tokens is None and stats.kv_offload_host_tier_bytes == 34359738368


def test_vllm_033_weights_offloaded_while_asleep():
    text = body("vllm-0.33-offloading.prom").replace(
        'sleep_state="weights_offloaded"} 0.0', 'sleep_state="weights_offloaded"} 1.0')
    (stats,) = interpret(ok("u", text), None).stats
    assert stats.weights_offloaded == 1


def test_vllm_033_simple_cpu_offload_block_counters():
    stats = only("vllm-0.33-simple-offload.prom")
    assert (stats.kv_offload_load_blocks, stats.kv_offload_store_dropped_blocks, stats.kv_offload_host_tier_blocks) == (
        3100, 250, 8192)
    assert stats.kv_offload_store_bytes is None  # blocks only: no bytes to show as zero


def test_sglang_0523_priority_totals_and_tp_ranks_are_not_added_up():
    """Priority scheduling writes each queue's total under priority="" and again per priority; with
    --enable-metrics-for-all-schedulers both TP ranks report the same requests. Bytes are per-rank
    shards and are summed, as SGLang's HELP says; the token counters are per-priority shares, the
    HiCache token counts "the same logical count" on every rank (one rank's). The HiCache families
    carry no model_name (cache_type, tp_rank, pp_rank, dp_rank) and still sit under the model."""
    stats = only("sglang-0.5.23-hicache.prom")
    assert (stats.server, stats.model) == ("sglang", QWEN_14B)
    assert scalars(stats) == {
        "requests_running": 10, "requests_waiting": 3, "kv_cache_usage_ratio": 0.8, "preemptions": 2,
        "preempted_prompt_tokens": 7000, "preempted_generated_tokens": 900, "requests_finished": 200,
        "prompt_tokens": 50000, "generated_tokens": 15000, "prefix_cache_queried_tokens": 50000,
        "prefix_cache_hit_tokens": 22000, "prefix_cache_host_hit_tokens": 8000,
        "kv_offload_store_bytes": 6e9, "kv_offload_load_bytes": 2e9,
        "kv_offload_store_tokens": 60000, "kv_offload_load_tokens": 20000,
        "kv_offload_store_seconds": pytest.approx(1.2), "kv_offload_load_seconds": pytest.approx(0.4),
        "kv_offload_host_tier_used_tokens": 400000, "kv_offload_host_tier_tokens": 1e6,
        "kv_cache_evicted_tokens": 50000,
    }
    assert stats.kv_offload_dropped_tokens == {"host_pressure": 1200, "write_through_unbacked_eviction": 300}
    assert stats.kv_offload_host_tier_bytes is None  # SGLang gives the host tier in tokens only


def test_sglang_0523_hicache_families_carry_the_radix_cache_labels_not_the_schedulers():
    """The fixture as 0.5.23 publishes it (metrics_collector.py radix_cache_metric_labels:
    cache_type, tp_rank, pp_rank, dp_rank; the scheduler's labels elsewhere)."""
    index = parse_prometheus(body("sglang-0.5.23-hicache.prom"))
    for name in ("sglang:hicache_backup_bytes_total", "sglang:load_back_bytes_total", "sglang:evicted_tokens_total",
                 "sglang:hicache_dropped_tokens_total", "sglang:hicache_backup_tokens_total"):
        for labels, _ in index[name]:
            assert "model_name" not in labels
            assert {"cache_type", "tp_rank", "pp_rank", "dp_rank"} <= set(labels), name
    assert {labels["tp_rank"] for labels, _ in index["sglang:hicache_backup_bytes_total"]} == {"0", "1"}


HICACHE_ONLY = ('sglang:hicache_backup_bytes_total{cache_type="UnifiedRadixCache",tp_rank="0",pp_rank="0",'
                'dp_rank="0"} 5.0\n')


def test_sglang_hicache_series_join_the_one_model_and_stay_apart_with_several(caplog):
    one = 'sglang:num_running_reqs{model_name="a"} 1\nsglang:generation_tokens_total{model_name="a"} 1\n'
    (stats,) = interpret(ok("u", one + HICACHE_ONLY), "sglang").stats
    assert (stats.model, stats.kv_offload_store_bytes) == ("a", 5)
    two = one + one.replace('"a"', '"b"')
    reading = interpret(ok("u", two + HICACHE_ONLY), "sglang")
    assert {s.model: s.kv_offload_store_bytes for s in reading.stats} == {"": 5, "a": None, "b": None}
    (note,) = reading.notes
    assert "kv_offload_store_bytes" in note and "2 models (a, b)" in note
    url = "http://127.0.0.1:30000/metrics"
    collector = InferenceCollector(LiveSource(), endpoints=[(url, "sglang")],
                                   fetch=lambda u, t, m: ok(u, two + HICACHE_ONLY))
    with caplog.at_level(logging.INFO, logger="hybridmon.exporters.inference"):
        collector.collect()
        collector.collect()
    assert sum("which one they belong to is not published" in r.getMessage() for r in caplog.records) == 1


def test_sglang_hicache_ranks_of_other_dp_ranks_are_added():
    """Data-parallel ranks cache other requests: their tokens add up; TP ranks repeat one count."""
    series = "".join(f'sglang:evicted_tokens_total{{cache_type="UnifiedRadixCache",tp_rank="{tp}",pp_rank="0",'
                     f'dp_rank="{dp}"}} {100 * (dp + 1)}\n' for tp in (0, 1) for dp in (0, 1))
    one = 'sglang:num_running_reqs{model_name="a"} 1\nsglang:generation_tokens_total{model_name="a"} 1\n'
    (stats,) = interpret(ok("u", one + series), "sglang").stats
    assert stats.kv_cache_evicted_tokens == 100 + 200


def test_vllm_033_finished_requests_are_summed_over_reasons_and_engines():
    text = "".join(f'vllm:request_success_total{{model_name="m",engine="{e}",finished_reason="{r}"}} {v}\n'
                   for e in ("0", "1") for r, v in (("stop", 10), ("length", 2), ("abort", 1)))
    (stats,) = interpret(ok("u", text + 'vllm:num_requests_running{model_name="m",engine="0"} 1\n'), None).stats
    assert stats.requests_finished == 26


def test_vllm_033_cache_config_info_gives_the_host_tier_size_and_lmcache_backend():
    """vllm:cache_config_info carries every CacheConfig field as a label and no model_name
    (loggers.py:1120): joined to the one model; kv_offloading_size is in GiB (config/cache.py:383)."""
    text = body("vllm-0.33-offloading.prom")
    without_offload_info = "".join(line + "\n" for line in text.splitlines() if "kv_offload_config_info" not in line)
    stats = only_text(without_offload_info)
    assert (stats.model, stats.kv_offload_host_tier_bytes, stats.kv_offload_in_lmcache) == (SERVED_NAME, 32 * 2**30, None)
    lmcache = without_offload_info.replace('kv_offloading_backend="native"', 'kv_offloading_backend="lmcache"')
    assert only_text(lmcache).kv_offload_in_lmcache == 1
    switched_off = lmcache.replace('kv_offloading_size="32.0"', 'kv_offloading_size="None"')
    stats = only_text(switched_off)
    assert (stats.kv_offload_in_lmcache, stats.kv_offload_host_tier_bytes) == (None, None)


def only_text(text: str) -> ServerStats:
    reading = interpret(ok("u", text), None)
    assert reading.error is None and not reading.notes, (reading.detail, reading.notes)
    (stats,) = reading.stats
    return stats


def test_vllm_033_secondary_tier_traffic_by_tier_summed_over_engines():
    url = "http://127.0.0.1:8000/metrics"
    stats = only("vllm-0.33-tiering.prom")
    assert (stats.kv_offload_secondary_store_bytes, stats.kv_offload_secondary_load_bytes) == (
        {"1:fs": 10e9}, {"1:fs": 2e9})
    samples = InferenceCollector(LiveSource(), endpoints=[(url, "vllm")],
                                 fetch=lambda u, t, m: ok(u, body("vllm-0.33-tiering.prom"))).collect()
    assert values(samples, "hybridmon_inference_kv_offload_secondary_tier_bytes_total") == {
        ("vllm", url, "llama-3-70b", "", "1:fs", "store"): 10e9, ("vllm", url, "llama-3-70b", "", "1:fs", "load"): 2e9}


def test_lmcache_056_served_model_name_and_cpu_evictions():
    """0.5.6 labels model_name (the path), worker_id, role and served_model_name
    (observability.py:1906): the served name joins vLLM's series even with several vLLM models."""
    stats = only("lmcache-0.5.6.prom")
    assert (stats.model, stats.kv_offload_host_tier_evicted_chunks) == (SERVED_NAME, 600)
    two_vllm = body("vllm-0.33-offloading.prom") + 'vllm:num_requests_running{model_name="other",engine="0"} 1\n'
    reading = interpret(ok("u", two_vllm + body("lmcache-0.5.6.prom")), None)
    assert ("lmcache", SERVED_NAME) in [(s.server, s.model) for s in reading.stats]


def test_lmcache_mp_transfer_bytes_are_the_staging_phase_by_direction():
    by_model = {s.model: s for s in interpret(ok("u", body("lmcache-mp.prom")), None).stats}
    pool = by_model[""]
    assert (pool.kv_offload_store_bytes, pool.kv_offload_load_bytes) == (8e9, 3e9)  # not kernel + staging
    assert (pool.kv_offload_store_seconds, pool.kv_offload_load_seconds) == (0.4, 0.125)
    assert pool.kv_offload_host_tier_evicted_chunks == 450


def test_sglang_priority_total_reads_10_not_20():
    text = "".join(f'sglang:num_running_reqs{{model_name="m",priority="{p}"}} {v}\n'
                   for p, v in (("", 10), ("0", 4), ("1", 6)))
    (stats,) = interpret(ok("u", text + 'sglang:generation_tokens_total{model_name="m"} 1\n'), None).stats
    assert stats.requests_running == 10


def test_lmcache_mp_exporter_is_recognised_as_lmcache():
    """The standalone MP server's OTel instruments, as opentelemetry-exporter-prometheus names them."""
    reading = interpret(ok("u", body("lmcache-mp.prom")), None)
    assert reading.error is None
    by_model = {(s.server, s.model): s for s in reading.stats}
    # The L1 (host DRAM) pool and the transfers carry no model: they serve every model.
    assert scalars(by_model["lmcache", ""]) == {
        "kv_offload_host_cache_bytes": 2.4e10, "kv_offload_host_tier_evicted_chunks": 450,
        "kv_offload_store_bytes": 8e9, "kv_offload_load_bytes": 3e9,
        "kv_offload_store_seconds": 0.4, "kv_offload_load_seconds": 0.125}
    assert scalars(by_model["lmcache", "/models/Meta-Llama-3-8B-Instruct"]) == {
        "prefix_cache_queried_tokens": 200000, "prefix_cache_hit_tokens": 90000,
        "prefix_cache_host_hit_tokens": 70000, "kv_offload_allocation_failures": 7}
    kept = keep_known_families(body("lmcache-mp.prom"))
    assert "lmcache_mp_l1_memory_usage_bytes" in kept and "python_gc" not in kept and "target_info" not in kept


def test_lmcache_takes_vllms_served_name_from_the_same_body():
    """LMCache labels with the model path, vLLM with --served-model-name; one vLLM serves one model."""
    reading = interpret(ok("u", body("vllm-0.33-offloading.prom") + body("lmcache.1.prom")), None)
    assert [(s.server, s.model) for s in reading.stats] == [("vllm", SERVED_NAME), ("lmcache", SERVED_NAME)]


def test_tgi_batch_tokens_against_its_maximum():
    stats = only("tgi-3.3.prom")
    assert (stats.batch_reserved_tokens, stats.batch_max_tokens) == (12000, 48000)


def test_new_fields_are_exported_with_their_labels():
    url = "http://127.0.0.1:30000/metrics"
    samples = InferenceCollector(LiveSource(), endpoints=[(url, "sglang")],
                                 fetch=lambda u, t, m: ok(u, body("sglang-0.5.23-hicache.prom"))).collect()
    assert values(samples, "hybridmon_inference_kv_offload_dropped_tokens_total") == {
        ("sglang", url, QWEN_14B, "", "host_pressure"): 1200, ("sglang", url, QWEN_14B, "", "write_through_unbacked_eviction"): 300}
    assert values(samples, "hybridmon_inference_kv_offload_bytes_total", direction="store") == {
        ("sglang", url, QWEN_14B, "", "store"): 6e9}
    assert values(samples, "hybridmon_inference_kv_offload_tokens_total") == {
        ("sglang", url, QWEN_14B, "", "store"): 60000, ("sglang", url, QWEN_14B, "", "load"): 20000}
    assert values(samples, "hybridmon_inference_requests_finished_total") == {("sglang", url, QWEN_14B, ""): 200}
    assert values(samples, "hybridmon_inference_preempted_prompt_tokens_total") == {("sglang", url, QWEN_14B, ""): 7000}


# --- recent quantiles and rates between two scrapes ------------------------------------------------

QUANTILE_CASES = {  # hand computed from the bucket increases, see tests/fixtures/inference/README.md
    "vllm-v1-names": {"time_to_first_token": (0.06 + 0.02 * 20 / 30, 0.375), "inter_token_latency": (0.078125, 0.1275)},
    "vllm-v0-names": {"time_to_first_token": (0.06, 0.2125), "inter_token_latency": (0.0211, 0.051875)},
    "sglang": {"time_to_first_token": (0.55, 1.5), "inter_token_latency": (0.0319, 0.049)},
    "tgi": {"inter_token_latency": (0.034, 0.075)},
    "llamacpp": {},
}


def scrape_pair(stem: str, server: str | None = None):
    """The collector's samples after each of the two bodies, scraped from a configured URL."""
    first, second = pair(stem)
    served = [first]
    url = "http://127.0.0.1:9/api/ps" if stem.startswith("ollama") else "http://127.0.0.1:9/metrics"
    collector = InferenceCollector(LiveSource(), endpoints=[(url, server)], fetch=lambda u, t, m: ok(u, served[0]))
    before = collector.collect()
    served[0] = second
    return collector, before, collector.collect()


@pytest.mark.parametrize("stem", sorted(QUANTILE_CASES))
def test_quantiles_of_the_requests_between_two_scrapes(stem):
    _, before, after = scrape_pair(stem)
    assert before.find("hybridmon_inference_time_to_first_token_percentile_seconds") == []  # no previous scrape
    assert before.find("hybridmon_inference_inter_token_latency_percentile_seconds") == []
    found = {}
    for field in ("time_to_first_token", "inter_token_latency"):
        by_percentile = {s.label_values[-1]: s.value
                         for s in after.find(f"hybridmon_inference_{field}_percentile_seconds")}
        if by_percentile:
            found[field] = (by_percentile["p50"], by_percentile["p95"])
    assert found.keys() == QUANTILE_CASES[stem].keys()
    for field, expected in QUANTILE_CASES[stem].items():
        assert found[field] == pytest.approx(expected), field


RATE_CASES = {  # (metric, extra labels) -> per second over the 5 s between the bodies
    "vllm-v1-names": {("generated_tokens_total", ()): 1820, ("prompt_tokens_total", ()): 5000,
                      ("preemptions_total", ()): 1, ("kv_offload_bytes_total", ("load",)): 11e9,
                      ("kv_offload_bytes_total", ("store",)): 0.4e9, ("prefix_cache_hit_tokens_total", ()): 1200},
    "vllm-v0-names": {("generated_tokens_total", ()): 300, ("prompt_tokens_total", ()): 600},
    "llamacpp": {("generated_tokens_total", ()): 24, ("prompt_tokens_total", ()): 80,
                 ("inter_token_latency_seconds_total", ()): 8.4 / 5},
    "sglang": {("generated_tokens_total", ()): 1000, ("prefix_cache_hit_tokens_total", ()): 3000,
               ("prefix_cache_queried_tokens_total", ()): 6000, ("preemptions_total", ()): 0.4},
    "tgi": {("prompt_tokens_total", ()): 800, ("generated_tokens_total", ()): 500},
    "lmcache": {("prefix_cache_hit_tokens_total", ()): 10000, ("prefix_cache_queried_tokens_total", ()): 20000,
                ("kv_offload_seconds_total", ("load",)): 0.4},
}


@pytest.mark.parametrize("stem", sorted(RATE_CASES))
def test_rates_from_counters_in_history(stem):
    """What a detector sees: the counters committed 5 s apart, rate() over the history."""
    _, before, after = scrape_pair(stem)
    history = History(600)
    history.add_collector("inference", STEP)
    history.commit("inference", 1000.0, before)
    history.commit("inference", 1000.0 + STEP, after)
    for (metric, extra), expected in RATE_CASES[stem].items():
        matching = [s for s in history.series(f"hybridmon_inference_{metric}")
                    if tuple(s.labels[k] for k in ("direction",) if k in s.labels) == extra]
        assert len(matching) == 1, metric
        assert windows.rate(matching[0], 1000.0 + STEP, STEP) == pytest.approx(expected), metric


def test_llamacpp_mean_time_per_token_over_the_interval():
    _, before, after = scrape_pair("llamacpp")
    seconds = [run.value("hybridmon_inference_inter_token_latency_seconds_total") for run in (before, after)]
    tokens = [run.value("hybridmon_inference_inter_token_latency_observations_total") for run in (before, after)]
    assert (seconds[1] - seconds[0]) / (tokens[1] - tokens[0]) == pytest.approx(0.07)


def test_ollama_bytes_in_host_memory_follow_the_model():
    _, before, after = scrape_pair("ollama-ps")
    assert values(before, "hybridmon_inference_model_host_memory_bytes") == {
        ("ollama", "http://127.0.0.1:9/api/ps", "llama3.1:70b", ""): 25e9,
        ("ollama", "http://127.0.0.1:9/api/ps", "nomic-embed-text:latest", ""): 0.0}
    assert values(after, "hybridmon_inference_model_host_memory_bytes") == {
        ("ollama", "http://127.0.0.1:9/api/ps", "llama3.1:70b", ""): 29e9}


def test_recent_quantile_edges():
    buckets = ((0.1, 10.0), (0.2, 20.0), (float("inf"), 30.0))
    current = Histogram(buckets, 3.0, 30.0)
    assert recent_quantile(None, current, 0.5) is None
    assert recent_quantile(current, current, 0.5) is None  # nothing observed since
    later = Histogram(((0.1, 10.0), (0.2, 20.0), (float("inf"), 40.0)), 5.0, 40.0)
    assert recent_quantile(current, later, 0.5) == 0.2  # all in +Inf: the highest finite bound
    restarted = Histogram(((0.1, 4.0), (0.2, 4.0), (float("inf"), 4.0)), 0.2, 4.0)
    assert recent_quantile(current, restarted, 0.5) == pytest.approx(0.05)  # since the restart


# --- bad answers: a clear scrape error, nothing else breaks ---------------------------------------

def collect_once(url: str, server: str | None = None, **options):
    collector = InferenceCollector(LiveSource(), endpoints=[(url, server)], **options)
    started = time.monotonic()
    samples = collector.collect()
    return samples, time.monotonic() - started


def scrape_error(samples, url: str) -> list[str]:
    assert samples.value("hybridmon_inference_scrape_success", endpoint=url) == 0.0
    return [s.label_values[1] for s in samples.find("hybridmon_inference_scrape_error", endpoint=url)]


@pytest.fixture
def vllm_server():
    with FakeInferenceServer({"/metrics": pair("vllm-v1-names")}, slow_seconds=3.0) as server:
        yield server


@pytest.mark.slow
def test_a_good_scrape_over_http(vllm_server):
    samples, _ = collect_once(vllm_server.url())
    assert samples.value("hybridmon_inference_scrape_success", endpoint=vllm_server.url()) == 1.0
    assert samples.find("hybridmon_inference_scrape_error") == []
    assert 0 < samples.value("hybridmon_inference_scrape_duration_seconds", endpoint=vllm_server.url()) < 2
    assert samples.value("hybridmon_inference_requests_running", server="vllm") == 12


@pytest.mark.slow
@pytest.mark.parametrize("mode, reason", [
    ("html", "not_prometheus"), ("status_500", "http_status"), ("huge", "too_large"),
    ("huge_declared", "too_large"), ("slow", "timeout"), ("trickle", "timeout"),
])
def test_bad_answers_are_a_clear_scrape_error(vllm_server, mode, reason):
    vllm_server.mode = mode
    samples, took = collect_once(vllm_server.url(), timeout_seconds=0.5, max_body_bytes=1 << 20)
    assert scrape_error(samples, vllm_server.url()) == [reason]
    assert samples.find("hybridmon_inference_requests_running") == []
    assert took < 1.5  # the whole GET is bounded, also when bytes keep trickling in
    if mode == "huge":
        assert vllm_server.bytes_sent < 20 * 1024 * 1024  # stopped reading soon past the limit


@pytest.mark.slow
def test_a_server_that_is_down_is_refused_then_comes_back(vllm_server):
    vllm_server.down()
    samples, _ = collect_once(vllm_server.url())
    assert scrape_error(samples, vllm_server.url()) == ["refused"]
    vllm_server.up()
    samples, _ = collect_once(vllm_server.url())
    assert samples.value("hybridmon_inference_scrape_success", endpoint=vllm_server.url()) == 1.0


@pytest.mark.parametrize("text, server, reason, still_read", [
    ("node_load1 0.5\n", None, "unknown_server", 0),
    (body("vllm-v1-names.1.prom").replace("vllm:", "vllm_"), None, "unknown_server", 0),
    (body("vllm-v1-names.1.prom"), "sglang", "unknown_server", 0),
    (body("vllm-v1-names.1.prom").replace("vllm:kv_cache_usage_perc", "vllm:kv_cache_fill"), None,
     "missing_families", 1),
    (body("vllm-v1-names.1.prom") + "vllm:garbage{\n", None, "not_prometheus", 0),
])
def test_changed_names_are_a_clear_scrape_error(text, server, reason, still_read):
    url = "http://127.0.0.1:9/metrics"
    collector = InferenceCollector(LiveSource(), endpoints=[(url, server)], fetch=lambda u, t, m: ok(u, text))
    samples = collector.collect()
    assert scrape_error(samples, url) == [reason]
    assert len(samples.find("hybridmon_inference_requests_running")) == still_read


def test_missing_families_names_what_is_missing():
    text = body("vllm-v1-names.1.prom").replace("vllm:kv_cache_usage_perc", "vllm:kv_cache_fill")
    assert interpret(ok("u", text), None).detail == "vllm: nothing read for kv_cache_usage_ratio"


@pytest.mark.slow
def test_slow_endpoints_are_scraped_together_within_one_timeout(vllm_server):
    vllm_server.mode = "slow"
    urls = [vllm_server.url(f"/metrics?replica={i}") for i in range(3)]
    collector = InferenceCollector(LiveSource(), endpoints=[(u, None) for u in urls], timeout_seconds=0.5)
    started = time.monotonic()
    samples = collector.collect()
    assert time.monotonic() - started < 1.2  # three 0.5 s timeouts side by side, not 1.5 s in a row
    assert [scrape_error(samples, u) for u in urls] == [["timeout"]] * 3


@pytest.mark.slow
def test_the_agent_keeps_every_other_collector_going_with_a_broken_server(vllm_server):
    vllm_server.mode = "html"
    agent = Agent(fixture_config(**{"inference.endpoints": [vllm_server.url()], "inference.timeout_seconds": 0.5}))
    try:
        run_every_collector_once(agent, at=1_700_000_000.0)
        states = {i.collector.name: i.state.last_success for i in agent.sampler.scheduled}
        text = agent.exposition.render().decode()
    finally:
        agent.stop()
    assert set(states.values()) == {True}, states
    assert f'hybridmon_inference_scrape_error{{endpoint="{vllm_server.url()}",reason="not_prometheus"}} 1.0' in text
    assert 'hybridmon_process_resident_bytes{pid="4242",process_name="python3"}' in text


@pytest.mark.slow
def test_exposition_with_every_series_passes_promtool(vllm_server):
    promtool = shutil.which("promtool")
    assert promtool, "promtool is installed by scripts/test (Debian package prometheus)"
    agent = Agent(fixture_config(**{"inference.endpoints": [vllm_server.url()]}))
    try:
        run_every_collector_once(agent, at=1_700_000_000.0)
        vllm_server.next_body()
        run_every_collector_once(agent, at=1_700_000_005.0)
        text = agent.exposition.render()
    finally:
        agent.stop()
    assert b"hybridmon_inference_inter_token_latency_percentile_seconds{" in text
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


# --- discovery beside the watched process ----------------------------------------------------------

def test_listening_sockets_of_the_fixture_vllm_process():
    assert find_listeners(LiveSource(), FIXTURE_PROCFS, [4242, 5151, 99999]) == {
        "4242": [["0.0.0.0", 18000], ["127.0.0.1", 29500]]}  # not sshd's port 22, not the client socket


def test_proc_net_tcp_addresses_and_ports():
    tcp6 = ("  sl  local_address                         remote_address                        st tx_queue\n"
            "   0: 00000000000000000000000001000000:1F40 00000000000000000000000000000000:0000 0A 0:0 0:0 0 0 0 7 1\n"
            "   1: 0000000000000000FFFF00000100007F:0BB8 00000000000000000000000000000000:0000 0A 0:0 0:0 0 0 0 8 1\n")
    assert [(l.address, l.port, l.inode) for l in parse_proc_net_tcp(tcp6, "little")] == [
        ("::1", 8000, 7), (str(ipaddress.ip_address("::ffff:127.0.0.1")), 3000, 8)]
    assert [(l.address, l.port) for l in parse_proc_net_tcp(FIXTURE_TCP, "little")] == [
        ("0.0.0.0", 22), ("0.0.0.0", 18000), ("127.0.0.1", 29500)]
    big_endian = FIXTURE_TCP.replace("0100007F:733C", "7F000001:733C")
    assert parse_proc_net_tcp(big_endian, "big")[2].address == "127.0.0.1"
    assert [connect_host(a) for a in ("0.0.0.0", "::", "::1", "::ffff:127.0.0.1", "10.1.2.3")] == [
        "127.0.0.1", "[::1]", "[::1]", "127.0.0.1", "10.1.2.3"]
    with pytest.raises(ParseError):
        parse_proc_net_tcp("<html>")


def test_discovery_on_the_fixture_host_asks_the_vllm_process_ports():
    asked = []

    def answer(url, timeout, limit):
        asked.append(url)
        return ok(url, body("vllm-v1-names.1.prom")) if ":18000/" in url else refused(url)

    collector = InferenceCollector(LiveSource(), procfs=FIXTURE_PROCFS, fetch=answer,
                                   watched=lambda: {4242: "python3", 5151: "llama-server"})
    samples = collector.collect()
    assert asked == ["http://127.0.0.1:18000/metrics", "http://127.0.0.1:29500/metrics"]
    assert values(samples, "hybridmon_inference_requests_running") == {
        ("vllm", "http://127.0.0.1:18000/metrics", LLAMA_3, "4242"): 12}
    assert values(samples, "hybridmon_inference_scrape_success") == {("http://127.0.0.1:18000/metrics",): 1.0}
    asked.clear()
    collector.collect()  # before the next discovery: only the server found is scraped
    assert asked == ["http://127.0.0.1:18000/metrics"]


def test_configured_endpoint_gets_the_pid_of_the_process_listening_there():
    collector = InferenceCollector(LiveSource(), procfs=FIXTURE_PROCFS, watched=lambda: {4242: "python3"},
                                   endpoints=[("http://localhost:18000/metrics", "vllm")],
                                   fetch=lambda u, t, m: ok(u, body("vllm-v1-names.1.prom")))
    samples = collector.collect()
    assert {s.label_values[-1] for s in samples.find("hybridmon_inference_requests_running")} == {"4242"}


def test_a_port_that_is_no_server_is_not_reported(caplog):
    collector = InferenceCollector(LiveSource(), procfs=FIXTURE_PROCFS, watched=lambda: {4242: "python3"},
                                   fetch=lambda u, t, m: {**refused(u), "error": None, "status": 404})
    with caplog.at_level(logging.INFO), pytest.raises(NoDataError, match="no inference server found"):
        collector.collect()
    assert "pid 4242 listens at http://127.0.0.1:18000, which does not answer as an inference server" in caplog.text


@pytest.mark.slow
def test_live_discovery_of_a_server_in_this_process_on_the_real_proc(vllm_server):
    """The fake server's socket belongs to this test process: /proc/self is read for real."""
    collector = InferenceCollector(LiveSource(), watched=lambda: {os.getpid(): "pytest"}, timeout_seconds=0.5)
    samples = collector.collect()
    assert values(samples, "hybridmon_inference_requests_running") == {
        ("vllm", vllm_server.url(), LLAMA_3, str(os.getpid())): 12}


@pytest.mark.slow
def test_usual_ports_are_probed_when_no_watched_process_listens(vllm_server):
    collector = InferenceCollector(LiveSource(), probe_ports=(vllm_server.port,), watched=lambda: {})
    samples = collector.collect()
    assert values(samples, "hybridmon_inference_scrape_success") == {(vllm_server.url(),): 1.0}
    assert {s.label_values[-1] for s in samples.find("hybridmon_inference_requests_running")} == {""}


@pytest.mark.slow
def test_ollama_is_found_on_api_ps_when_metrics_is_404():
    with FakeInferenceServer({"/api/ps": pair("ollama-ps")}, content_types={"/api/ps": "application/json"}) as ollama:
        collector = InferenceCollector(LiveSource(), probe_ports=(ollama.port,))
        samples = collector.collect()
    assert ollama.requests == ["/metrics", "/api/ps"]
    assert values(samples, "hybridmon_inference_model_host_memory_bytes", model="llama3.1:70b") == {
        ("ollama", ollama.url("/api/ps"), "llama3.1:70b", ""): 25e9}


@pytest.mark.slow
def test_ollama_without_a_loaded_model_is_still_found_and_other_json_is_not_ollama():
    with FakeInferenceServer({"/api/ps": ['{"models": []}']}) as ollama:
        samples = InferenceCollector(LiveSource(), probe_ports=(ollama.port,)).collect()
    assert values(samples, "hybridmon_inference_scrape_success") == {(ollama.url("/api/ps"),): 1.0}
    assert samples.find("hybridmon_inference_model_size_bytes") == []
    with pytest.raises(ParseError):
        parse_ollama_ps('{"status": "ok"}')


def test_a_found_server_is_dropped_once_its_process_stops_listening(tmp_path):
    procfs = tmp_path / "proc"
    shutil.copytree(FIXTURE_HOST / "proc", procfs, symlinks=True)
    now = [0.0]
    collector = InferenceCollector(LiveSource(), procfs=str(procfs), watched=lambda: {4242: "python3"},
                                   clock=lambda: now[0], fetch=lambda u, t, m: ok(u, body("vllm-v1-names.1.prom")))
    assert values(collector.collect(), "hybridmon_inference_scrape_success") == {
        ("http://127.0.0.1:18000/metrics",): 1.0, ("http://127.0.0.1:29500/metrics",): 1.0}
    (procfs / "4242/fd/3").unlink()  # the API socket closed
    now[0] = 29.0
    assert len(collector.collect().find("hybridmon_inference_scrape_success")) == 2  # not looked again yet
    now[0] = 30.0
    assert values(collector.collect(), "hybridmon_inference_scrape_success") == {
        ("http://127.0.0.1:29500/metrics",): 1.0}


def test_this_host_without_a_server_says_so():
    try:
        samples = InferenceCollector(LiveSource(), watched=lambda: {os.getpid(): "pytest"},
                                     timeout_seconds=0.5).collect()
    except NoDataError as absent:
        assert "no inference server found" in str(absent)
    else:  # a developer's own server on a usual port: then it must read as one
        assert {s.label_values[0] for s in samples.find("hybridmon_inference_requests_running")} <= {
            "vllm", "sglang", "llamacpp", "tgi", "lmcache"}


@pytest.mark.slow
def test_a_listening_socket_of_this_process_is_found_on_the_real_proc():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        found = find_listeners(LiveSource(), "/proc", [os.getpid()])
    assert ["127.0.0.1", port] in found[str(os.getpid())]


def fake_process(procfs: Path, pid: int, parent: int, argv: list[str], port: int | None = None) -> None:
    """/proc/<pid> as find_listeners and the runner check read it: cmdline (NUL-terminated
    arguments), stat (field 4 the parent pid; comm in parentheses), and, with a port, one listening
    socket: an fd linking socket:[inode] and that inode in net/tcp (127.0.0.1, state 0A)."""
    base = procfs / str(pid)
    (base / "fd").mkdir(parents=True)
    (base / "net").mkdir()
    (base / "cmdline").write_text("\0".join(argv) + "\0")
    (base / "stat").write_text(f"{pid} ({Path(argv[0]).name[:15]}) S {parent} {pid} {pid} 0 -1 4194560" + " 0" * 44 + "\n")
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    rows = ""
    if port is not None:
        inode = 700000 + pid
        os.symlink(f"socket:[{inode}]", base / "fd" / "3")
        rows = (f"   0: 0100007F:{port:04X} 00000000:0000 0A 00000000:00000000 00:00000000 00000000"
                f"     0        0 {inode} 1 0000000000000000 100 0 0 10 0\n")
    (base / "net" / "tcp").write_text(header + rows)


def test_an_ollama_runner_child_is_read_through_ollamas_api_ps_not_probed(tmp_path, caplog):
    """Ollama (pid 700, port 11434) runs upstream llama-server (pid 701) on a random loopback port
    without --metrics, and an older `ollama runner` (pid 702): neither child is asked, the
    parent's /api/ps is, once per scrape, and no "does not answer" line is logged."""
    procfs = tmp_path / "proc"
    fake_process(procfs, 700, 1, ["/usr/local/bin/ollama", "serve"], 11434)
    fake_process(procfs, 701, 700, ["/usr/lib/ollama/llama-server", "--model", "/root/.ollama/models/blobs/sha256-1",
                                    "--port", "41234", "--host", "127.0.0.1"], 41234)
    fake_process(procfs, 702, 700, ["/usr/local/bin/ollama", "runner", "--model", "/root/.ollama/models/blobs/sha256-2",
                                    "--port", "38211"], 38211)
    asked, now = [], [0.0]

    def answer(url, timeout, limit):
        asked.append(url)
        if url.endswith(":11434/api/ps"):
            return ok(url, body("ollama-ps.1.json"), "application/json; charset=utf-8")
        return {**refused(url), "error": None, "status": 404, "body": "404 page not found"}

    collector = InferenceCollector(LiveSource(), procfs=str(procfs), fetch=answer, clock=lambda: now[0],
                                   watched=lambda: {700: "ollama", 701: "llama-server", 702: "ollama"})
    with caplog.at_level(logging.DEBUG):
        for cycle in range(4):  # two discoveries (every 30 s), four scrapes
            samples = collector.collect()
            now[0] += 15.0
    assert not [url for url in asked if ":41234" in url or ":38211" in url]
    assert asked.count("http://127.0.0.1:11434/api/ps") == 4  # one a scrape (the first also confirms it)
    assert values(samples, "hybridmon_inference_model_host_memory_bytes", model="llama3.1:70b") == {
        ("ollama", "http://127.0.0.1:11434/api/ps", "llama3.1:70b", "700"): 25e9}
    assert "does not answer as an inference server" not in caplog.text


def test_a_llama_server_not_started_by_ollama_is_still_asked(tmp_path):
    procfs = tmp_path / "proc"
    fake_process(procfs, 800, 1, ["/bin/bash"])
    fake_process(procfs, 801, 800, ["/opt/llama.cpp/llama-server", "--metrics", "--port", "8080"], 8080)
    asked = []
    collector = InferenceCollector(LiveSource(), procfs=str(procfs), watched=lambda: {801: "llama-server"},
                                   fetch=lambda u, t, m: asked.append(u) or ok(u, body("llamacpp.1.prom")))
    collector.collect()
    assert asked == ["http://127.0.0.1:8080/metrics"]


@pytest.mark.parametrize("argv, in_lmcache", [
    (["vllm", "serve", "m", "--kv-offloading-size", "64", "--kv-offloading-backend", "lmcache"], 1.0),
    (["vllm", "serve", "m", "--kv-offloading-backend=lmcache"], 1.0),
    (["python3", "-m", "vllm.entrypoints.openai.api_server", "--kv-transfer-config",
      '{"kv_connector":"LMCacheMPConnector","kv_role":"kv_both"}'], 1.0),
    (["vllm", "serve", "m", "--kv-offloading-size", "64"], None),  # native: vLLM counts it itself
])
def test_vllm_offloading_through_lmcache_is_said_not_shown_as_zero(tmp_path, argv, in_lmcache):
    procfs = tmp_path / "proc"
    fake_process(procfs, 900, 1, argv, 8000)
    collector = InferenceCollector(LiveSource(), procfs=str(procfs), watched=lambda: {900: "vllm"},
                                   fetch=lambda u, t, m: ok(u, body("vllm-v1-names.1.prom").replace(
                                       "vllm:kv_offload", "vllm:other")))
    samples = collector.collect()
    found = values(samples, "hybridmon_inference_kv_offload_in_lmcache")
    assert found == ({} if in_lmcache is None else {("vllm", "http://127.0.0.1:8000/metrics", LLAMA_3, "900"): 1.0})
    assert samples.find("hybridmon_inference_kv_offload_bytes_total") == []  # absent, not zero
    rows = offload_elsewhere_rows(in_lmcache)
    assert bool(rows) == (in_lmcache is not None) and all("LMCache" in text for _, text, _ in rows)


# --- record and replay ----------------------------------------------------------------------------

@pytest.mark.slow
def test_record_then_replay_gives_identical_samples(vllm_server):
    recorder = RecordingSource(LiveSource())

    def watched(source, live=lambda: {str(os.getpid()): "pytest"}):
        return {int(pid): name for pid, name in source.call("agent.watched_processes", live).items()}

    live = InferenceCollector(recorder, watched=lambda: watched(recorder), timeout_seconds=0.5)
    recorded, readings = [], []
    for mode in ("serve", "serve", "html", "serve"):
        vllm_server.mode = mode
        recorded.append([(s.spec.name, s.label_values, s.value) for s in live.collect()])
        readings.append(recorder.take_readings())
        vllm_server.next_body()
    json.dumps(readings)  # a trace holds JSON
    assert all("python_gc" not in json.dumps(r) for r in readings)
    vllm_server.down()  # a replay asks the trace, not the server
    replay = ReplaySource()
    replayed_collector = InferenceCollector(replay, watched=lambda: watched(replay), timeout_seconds=0.5)
    replayed = []
    for run in readings:
        replay.load(run)
        replayed.append([(s.spec.name, s.label_values, s.value) for s in replayed_collector.collect()])
    assert replayed == recorded
    assert any(name.endswith("_percentile_seconds") for name, _, _ in recorded[1])


# --- configuration and wiring ----------------------------------------------------------------------

def test_configuration_takes_urls_or_tables_and_refuses_bad_ones():
    config = load_config(environ={"HYBRIDMON_INFERENCE__ENDPOINTS": json.dumps(
        ["http://127.0.0.1:8000/metrics", {"url": "http://127.0.0.1:11434", "server": "ollama"}])})
    assert [(e.url, e.server) for e in config.inference.endpoints] == [
        ("http://127.0.0.1:8000/metrics", None), ("http://127.0.0.1:11434", "ollama")]
    with pytest.raises(ConfigError, match="inference.endpoints.0.url"):
        load_config(environ={"HYBRIDMON_INFERENCE__ENDPOINTS": '["ftp://x"]'})
    with pytest.raises(ConfigError, match="credentials"):
        load_config(overrides={"inference.endpoints": ["http://user:secret@127.0.0.1:8000/metrics"]})
    with pytest.raises(ConfigError, match="unknown server 'triton'"):
        load_config(overrides={"inference.endpoints": [{"url": "http://x:1", "server": "triton"}]})
    with pytest.raises(ConfigError, match="inference.timeout_seconds"):
        load_config(overrides={"inference.timeout_seconds": 60})


def test_the_documented_configuration_is_valid():
    text = (Path(__file__).resolve().parents[2] / "docs" / "inference-servers.md").read_text()
    (example,) = re.findall(r"```toml\n(.*?)```", text, flags=re.S)
    config = AgentConfig.model_validate(tomllib.loads(example))
    assert [(e.url, e.server) for e in config.inference.endpoints] == [
        ("http://127.0.0.1:8000/metrics", None), ("http://127.0.0.1:11434", "ollama")]


def test_configured_urls_get_their_path():
    assert endpoint_url("http://h:11434", "ollama") == "http://h:11434/api/ps"
    assert endpoint_url("http://h:8000/", None) == "http://h:8000/metrics"
    assert endpoint_url("http://h:9000/custom", None) == "http://h:9000/custom"


def test_every_series_is_documented_and_hybridmon_named():
    names = [spec.name for spec in METRIC_SPECS]
    assert len(names) == len(set(names))
    assert all(name.startswith("hybridmon_inference_") and len(spec.documentation) > 40
               for name, spec in zip(names, METRIC_SPECS))


# --- any answer is read or named as an error (that the parsers raise only ParseError:
# tests/exporters/test_parsers_robustness.py) ------------------------------------------------------------------

@settings(deadline=None)
@given(texts_like(body("sglang.1.prom")[:2000]), st.sampled_from([None, "vllm", "sglang", "ollama"]),
       st.sampled_from(["text/plain", "text/html", None]))
def test_any_answer_is_read_or_named_as_an_error(text, server, content_type):
    reading = interpret(ok("http://h:1/metrics", text, content_type), server)
    assert reading.error in (None, "not_prometheus", "not_json", "unknown_server", "missing_families")
    assert isinstance(keep_known_families(text), str)


def test_fetch_names_network_failures():
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    assert fetch(f"http://127.0.0.1:{port}/metrics", 0.5, 1024)["error"] == "refused"
    started = time.monotonic()
    assert fetch("http://name.invalid:1/metrics", 0.5, 1024)["error"] in ("connection", "timeout")
    assert time.monotonic() - started < 1.5


# This module's parsers, each with realistic samples, for tests/exporters/test_parsers_robustness.py
# (which holds every parse_* of exporters/ to its one promised error).
_BODIES = read(FIXTURES / "inference/vllm-v1-names.1.prom", FIXTURES / "inference/llamacpp.1.prom",
               FIXTURES / "inference/tgi.1.prom", FIXTURES / "inference/sglang-0.5.23-hicache.prom",
               FIXTURES / "inference/vllm-0.33-offloading.prom", FIXTURES / "inference/lmcache-mp.prom")
PARSER_ROWS = [
    ParserRow(parse_prometheus, _BODIES),
    # parse_prometheus's fallback for bodies its fast path does not read (and the tests' reference)
    ParserRow(parse_with_prometheus_client, _BODIES),
    ParserRow(parse_ollama_ps, read(FIXTURES / "inference/ollama-ps.1.json")),
    # The fixture was written on (and the addresses are words of) a little-endian host.
    ParserRow(parse_proc_net_tcp, read(FIXTURE_HOST / "proc/4242/net/tcp", FIXTURE_HOST / "proc/4242/net/tcp6"),
              call=functools.partial(parse_proc_net_tcp, byteorder="little")),
]


# --- issue 30: a peer that publishes more than it should ------------------------------------------

def answering(body: str):
    """A fetch that answers every URL with `body`, as inference_scrape.fetch returns an answer."""
    return lambda url, _timeout, _max_bytes: {"url": url, "status": 200, "content_type": "text/plain",
                                              "body": body, "error": None, "detail": "", "seconds": 0.01}


def test_an_endpoint_with_thousands_of_models_keeps_the_busiest_up_to_the_cap(caplog):
    """20,000 models (a `nobody` process named llama-server made 579 MB and a status page that timed
    out): only the first 64 models of the body are read (4 x the cap of 16, at least 64), and of
    them the 16 busiest by generated tokens are kept, the rest counted and logged once."""
    url = "http://127.0.0.1:8000/metrics"
    collector = InferenceCollector(LiveSource(), endpoints=[(url, "vllm")],
                                   fetch=answering(vllm_with_models(20_000)))
    for _ in range(2):
        samples = collector.collect()
    read = max(inference.MODELS_READ_PER_CAP * 16, inference.MIN_MODELS_READ)
    kept = {labels[2] for labels in values(samples, "hybridmon_inference_requests_running")}
    assert kept == {f"hostile/model-{i}" for i in range(read - 16, read)}
    assert samples.value("hybridmon_inference_models_left_out", endpoint=url) == read - 16
    assert len(samples) < 1000
    assert caplog.text.count(f"publishes {read} models") == 1


def test_a_normal_endpoint_leaves_no_model_out_and_the_cap_is_a_setting():
    url = "http://127.0.0.1:8000/metrics"
    samples = InferenceCollector(LiveSource(), endpoints=[(url, "vllm")], fetch=answering(vllm_with_models(3))).collect()
    assert samples.value("hybridmon_inference_models_left_out", endpoint=url) == 0
    assert len(values(samples, "hybridmon_inference_requests_running")) == 3
    config = load_config(environ={"HYBRIDMON_INFERENCE__MAX_MODELS_PER_ENDPOINT": "2"})
    assert config.inference.max_models_per_endpoint == 2


def test_a_long_model_label_is_bounded_and_two_long_ones_stay_apart():
    url = "http://127.0.0.1:8000/metrics"
    body = vllm_with_models(2, name="x" * 5000 + "{}")
    samples = InferenceCollector(LiveSource(), endpoints=[(url, "vllm")], fetch=answering(body)).collect()
    models = {labels[2] for labels in values(samples, "hybridmon_inference_requests_running")}
    assert len(models) == 2 and all(len(model) == 128 and model.startswith("xxx") for model in models)


def test_an_answer_the_collector_fails_on_costs_only_that_endpoints_series(monkeypatch, caplog):
    """Issue 30: one bad process or endpoint costs only its own series. A bug in reading one
    answer (here injected into interpret) leaves the other endpoint read, and says so."""
    good, bad = "http://127.0.0.1:8000/metrics", "http://127.0.0.1:8001/metrics"
    bodies = {good: vllm_with_models(1, name="good-{}"), bad: vllm_with_models(1, name="bad-{}")}
    real = inference.interpret

    def failing_on_bad(answer, server, max_models=None):
        if "bad-0" in (answer.get("body") or ""):
            raise IndexError("injected: a parser bug")
        return real(answer, server, max_models)
    monkeypatch.setattr(inference, "interpret", failing_on_bad)
    fetch = lambda url, _timeout, _max: answering(bodies[url])(url, _timeout, _max)  # noqa: E731
    samples = InferenceCollector(LiveSource(), endpoints=[(good, "vllm"), (bad, "vllm")], fetch=fetch).collect()
    assert {labels[2] for labels in values(samples, "hybridmon_inference_requests_running")} == {"good-0"}
    assert values(samples, "hybridmon_inference_scrape_error") == {(bad, "unreadable"): 1.0}
    assert samples.value("hybridmon_inference_scrape_success", endpoint=bad) == 0
    assert "inference endpoint http://127.0.0.1:8001/metrics: its answer could not be read (IndexError" in caplog.text


@settings(max_examples=40, deadline=None)
@given(models=st.integers(1, 400), cap=st.integers(1, 64))
def test_any_number_of_models_keeps_at_most_the_cap_and_counts_the_rest(models, cap):
    url = "http://127.0.0.1:8000/metrics"
    samples = InferenceCollector(LiveSource(), endpoints=[(url, "vllm")], fetch=answering(vllm_with_models(models)),
                                 max_models_per_endpoint=cap).collect()
    read = min(models, max(inference.MODELS_READ_PER_CAP * cap, inference.MIN_MODELS_READ))
    kept = {labels[2] for labels in values(samples, "hybridmon_inference_requests_running")}
    assert kept == {f"hostile/model-{i}" for i in range(max(0, read - cap), read)}
    assert samples.value("hybridmon_inference_models_left_out", endpoint=url) == read - len(kept)


def test_a_body_of_known_families_only_is_kept_as_it_is_not_copied():
    """Issue 30: a peer's 7.9 MB body of known families was split and joined again at every scrape
    (~21 MB more held); such a body is now returned as it is. A body with other families still
    loses them, blank lines and all."""
    body = vllm_with_models(3)
    assert keep_known_families(body) is body
    mixed = "# HELP python_gc_objects_collected_total x\npython_gc_objects_collected_total 1\n\n" + body
    assert keep_known_families(mixed) == body
