"""The synthetic host's vLLM (tests/support/scenarios/inference.py): what it serves reads back, through
the real collector over loopback HTTP, as the load it was rendered from; and in each scenario's
trace the server's metrics tell the scenario's story (docs/scenarios.md).

The traces are the session's (tests/conftest.py `scenarios`), replayed once each.
"""
from __future__ import annotations

import math

import pytest

from tests.support.scenarios import SCENARIOS, START_TIME
from tests.support.scenarios.inference import (ENDPOINT, ITL_BOUNDS, ITL_SPREAD, MODEL, OUTPUT_TOKENS, PROMPT_TOKENS,
                                       TTFT_BOUNDS, TTFT_SPREAD, InferenceServer, ServerLoad, latency_shares)
from tests.support.scenarios.loopback import LoopbackServer
from tests.support.scenarios.host import GIB
from tests.support.scenarios.c2c_library import C2C_H2D
from tests.support.scenarios.library import GEN4_X16, VLLM
from hybridmon.exporters.sources import LiveSource
from hybridmon.exporters import inference_scrape
from hybridmon.exporters.inference import InferenceCollector
from hybridmon.exporters.inference_formats import recent_quantile
from hybridmon.exporters.inference_stats import Histogram
from tests.support.scenario_traces import between, one, rate, value_at

SERVER = {"server": "vllm", "endpoint": ENDPOINT, "model": MODEL}
P = "hybridmon_inference_"


def server(history, metric: str, **labels: str):
    return one(history, P + metric, **SERVER, **labels)


def p50(history, latency: str):
    return server(history, f"{latency}_percentile_seconds", percentile="p50")


def bucket_of(bounds, value: float) -> tuple[float, float]:
    upper = next(i for i, bound in enumerate(bounds) if value <= bound)
    return (bounds[upper - 1] if upper else 0.0), bounds[upper]


# --- the server model ------------------------------------------------------------------------------

@pytest.mark.parametrize("bounds, spread, median", [
    (ITL_BOUNDS, ITL_SPREAD, 0.038), (ITL_BOUNDS, ITL_SPREAD, 0.210), (ITL_BOUNDS, ITL_SPREAD, 0.0251),
    (ITL_BOUNDS, ITL_SPREAD, 0.1), (TTFT_BOUNDS, TTFT_SPREAD, 0.15), (TTFT_BOUNDS, TTFT_SPREAD, 2.0),
    (TTFT_BOUNDS, TTFT_SPREAD, 0.0011),
])
def test_histogram_quantile_of_the_buckets_is_the_chosen_median(bounds, spread, median):
    shares = latency_shares(bounds, median, spread)
    assert all(b >= a for a, b in zip(shares, shares[1:])) and shares[0] >= 0 and shares[-1] == 1.0
    buckets = tuple(zip(bounds + (math.inf,), [1e6 * s for s in shares] + [1e6]))
    histogram = Histogram(buckets, 0.0, 1e6)
    empty = Histogram(tuple((bound, 0.0) for bound, _ in buckets), 0.0, 0.0)
    assert recent_quantile(empty, histogram, 0.5) == pytest.approx(median, rel=1e-9)
    assert median < recent_quantile(empty, histogram, 0.95) <= bounds[-1]


def test_a_load_the_model_cannot_serve_is_refused():
    with pytest.raises(ValueError, match="outside the buckets"):
        latency_shares(ITL_BOUNDS, 100.0, ITL_SPREAD)
    state = InferenceServer()
    with pytest.raises(ValueError, match="unknown answer 'teapot'"):
        state.set_load(ServerLoad(answer="teapot"))
    with pytest.raises(ValueError, match="must be > 0"):
        state.set_load(ServerLoad(inter_token_latency_seconds=0))
    state.set_load(ServerLoad(running=-1), noise=0)
    with pytest.raises(ValueError, match="negative load"):
        state.advance(1)


def collect_twice(state: InferenceServer, seconds: float):
    """Two scrapes of the served body by the real collector, `seconds` of serving apart."""
    with LoopbackServer(state) as loopback:
        collector = InferenceCollector(LiveSource(), endpoints=[(ENDPOINT, "vllm")],
                                       fetch=loopback.route(inference_scrape.fetch))
        state.publish()
        first = collector.collect()
        state.advance(seconds)
        state.publish()
        return first, collector.collect()


def test_what_is_served_reads_back_as_the_load_it_was_rendered_from():
    state = InferenceServer(seed=7)
    load = ServerLoad(running=40, waiting=7, inter_token_latency_seconds=0.05, time_to_first_token_seconds=0.3,
                      kv_cache_usage=0.7, preemptions_per_second=2.0, kv_offload_load_bytes_per_second=9e9,
                      kv_offload_store_bytes_per_second=3e9)
    state.set_load(load, noise=0)
    state.advance(3600)
    first, second = collect_twice(state, 100)
    labels = {**SERVER, "pid": ""}

    def per_second(metric: str, **extra: str) -> float:
        return (second.value(P + metric, **labels, **extra) - first.value(P + metric, **labels, **extra)) / 100

    tokens_per_second = 40 / 0.05
    assert per_second("generated_tokens_total") == pytest.approx(tokens_per_second, abs=0.01)
    assert per_second("prompt_tokens_total") == pytest.approx(tokens_per_second / OUTPUT_TOKENS * PROMPT_TOKENS,
                                                              abs=0.01)
    assert per_second("preemptions_total") == pytest.approx(2.0, abs=0.01)
    assert per_second("kv_offload_bytes_total", direction="load") == pytest.approx(9e9, rel=1e-9)
    assert per_second("kv_offload_bytes_total", direction="store") == pytest.approx(3e9, rel=1e-9)
    assert per_second("kv_offload_seconds_total", direction="load") == pytest.approx(
        9e9 / load.kv_offload_copy_bytes_per_second, rel=1e-5)
    assert second.value(P + "requests_running", **labels) == 40
    assert second.value(P + "requests_waiting", **labels) == 7
    assert second.value(P + "kv_cache_usage_ratio", **labels) == 0.7
    # Every token after a request's first is one inter-token gap; the first is its TTFT.
    observations = per_second("inter_token_latency_observations_total")
    assert observations == pytest.approx(tokens_per_second * (1 - 1 / OUTPUT_TOKENS), abs=0.02)
    assert per_second("time_to_first_token_observations_total") == pytest.approx(tokens_per_second / OUTPUT_TOKENS,
                                                                                 abs=0.02)
    mean = per_second("inter_token_latency_seconds_total") / observations
    assert bucket_of(ITL_BOUNDS, 0.05)[0] < mean < bucket_of(ITL_BOUNDS, 0.05)[1] * 1.2
    # The quantiles of the scrape interval: 79,680 gaps give the median to a few parts in 10^5;
    # 320 first tokens to within their bucket.
    itl = second.value(P + "inter_token_latency_percentile_seconds", **labels, percentile="p50")
    assert itl == pytest.approx(0.05, rel=1e-3)
    ttft = second.value(P + "time_to_first_token_percentile_seconds", **labels, percentile="p50")
    low, high = bucket_of(TTFT_BOUNDS, 0.3)
    assert low < ttft <= high and ttft == pytest.approx(0.3, rel=0.02)
    assert second.value(P + "scrape_success", endpoint=ENDPOINT) == 1
    assert not second.find(P + "scrape_error")


@pytest.mark.parametrize("answer, reason", [("html", "not_prometheus"), ("unavailable", "http_status"),
                                            ("down", "refused")])
def test_a_failing_endpoint_gives_the_collector_its_reason_then_recovers(answer, reason):
    state = InferenceServer(seed=1)
    state.set_load(ServerLoad(answer=answer), noise=0)
    with LoopbackServer(state) as loopback:
        collector = InferenceCollector(LiveSource(), endpoints=[(ENDPOINT, "vllm")],
                                       fetch=loopback.route(inference_scrape.fetch))
        state.publish()
        failed = collector.collect()
        state.set_load(ServerLoad(), noise=0)
        state.publish()
        recovered = collector.collect()
    assert failed.value(P + "scrape_success", endpoint=ENDPOINT) == 0
    assert failed.value(P + "scrape_error", endpoint=ENDPOINT, reason=reason) == 1
    assert not failed.find(P + "requests_running")
    assert recovered.value(P + "scrape_success", endpoint=ENDPOINT) == 1
    assert recovered.value(P + "requests_running", **SERVER) == 55


def test_the_loopback_server_is_gone_after_generation():
    state = InferenceServer()
    with LoopbackServer(state) as loopback:
        port = loopback.port
        state.publish()
        assert inference_scrape.fetch(f"http://127.0.0.1:{port}/metrics", 2, 1 << 20)["status"] == 200
        assert inference_scrape.fetch(f"http://127.0.0.1:{port}/other", 2, 1 << 20)["status"] == 404
    assert inference_scrape.fetch(f"http://127.0.0.1:{port}/metrics", 2, 1 << 20)["error"] == "refused"


# --- in every trace --------------------------------------------------------------------------------

# Stories in which vLLM's endpoint refuses for a while: down, or restarting (30 s of loading each
# time, tests/support/scenarios/crash_library.py).
ENDPOINT_DOWN_AT_TIMES = {"inference_server_down", "server_crash_loop", "planned_restart"}


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_server_is_scraped_and_tied_to_vllm_in_every_trace(name, scenarios):
    history = scenarios.replayed(name).history
    success = one(history, P + "scrape_success", endpoint=ENDPOINT)
    running = server(history, "requests_running")
    assert running.labels["pid"] == str(VLLM)  # the endpoint's port is the one vLLM listens on
    if name not in ENDPOINT_DOWN_AT_TIMES:
        assert set(success.values) == {1} and not history.series(P + "scrape_error")
        assert len(running.values) == len(success.values)


@pytest.mark.parametrize("name", SCENARIOS)
def test_tokens_and_latency_and_offload_agree_with_each_other_and_the_link(name, scenarios):
    """Each running request emits a token per inter-token latency; KV offload loads are part of
    GPU0's host-to-device traffic, never more than it."""
    history = scenarios.replayed(name).history
    tokens, running = server(history, "generated_tokens_total"), server(history, "requests_running")
    if name == "healthy_idle_downshifted":  # nothing runs: no token, so no latency to read
        assert set(running.values) == {0} and len(set(tokens.values)) == 1
        assert not history.series(P + "inter_token_latency_percentile_seconds")
        return
    itl = p50(history, "inter_token_latency")
    traffic = host_to_device_link(history)
    loads = history.series(P + "kv_offload_bytes_total", **SERVER, direction="load")
    latencies = {t - START_TIME: v for t, v in zip(itl.times, itl.values)}
    checked = 0
    for index in range(1, len(tokens.times)):
        start, end = tokens.times[index - 1] - START_TIME, tokens.times[index] - START_TIME
        busy = value_at(running, end)
        if not busy or end - start > 30:  # idle, or a gap in scraping (a failing endpoint)
            continue
        latency, previous = value_at(itl, end), latencies.get(start)
        if previous is None or abs(latency / previous - 1) > 0.05:
            continue  # a ramp: the window's median is not its mean rate's latency
        # Noise: running requests ±3 % (whole requests) and the latency ±2 % on each tick.
        assert rate(tokens, start, end) == pytest.approx(busy / latency, rel=0.08), (name, end)
        if loads:
            mean_traffic = sum(between(traffic, start + 1, end + 1)) / len(between(traffic, start + 1, end + 1))
            assert rate(loads[0], start, end) <= 1.01 * mean_traffic, (name, end)
        checked += 1
    # every scrape but the ramps' and the outages' (a short 5 s-tick story is scraped 12 times)
    assert checked >= min(10, len(tokens.times) // 2)


def on_c2c(history) -> bool:
    """GPU0 is a Grace Hopper's, its offload crossing NVLink-C2C (c2c_library.py)."""
    mode = history.series("hybridmon_gpu_c2c_mode_enabled", gpu="0")
    return bool(mode) and mode[0].values[-1] == 1


def host_to_device_link(history):
    """GPU0's host-to-device traffic on the link its offload crosses: C2C on a GH200, else PCIe."""
    if on_c2c(history):
        return one(history, "hybridmon_gpu_c2c_throughput_bytes_per_second", gpu="0", direction="host_to_device")
    return one(history, "hybridmon_gpu_pcie_throughput_bytes_per_second", gpu="0", direction="host_to_device")


@pytest.mark.parametrize("name", [name for name, scenario in SCENARIOS.items() if scenario.healthy])
def test_healthy_servers_are_far_from_every_server_alert(name, scenarios):
    history = scenarios.replayed(name).history
    assert max(server(history, "kv_cache_usage_ratio").values) < 0.93
    assert len(set(server(history, "preemptions_total").values)) == 1
    # issue 28's hosts whose KV moves with no byte counter publish none; a GH200's moves over C2C
    link = C2C_H2D if on_c2c(history) else GEN4_X16
    for loads in history.series(P + "kv_offload_bytes_total", **SERVER, direction="load"):
        assert rate(loads, 0, loads.times[-1] - START_TIME) < 0.6 * link


# --- each scenario's server story --------------------------------------------------------------------

def test_pcie_starvation_slows_every_token_and_loads_the_kv_cache_over_the_link(scenarios):
    history = scenarios.replayed("pcie_starvation").history
    onset = SCENARIOS["pcie_starvation"].onset_seconds
    itl = p50(history, "inter_token_latency")
    assert all(v == pytest.approx(0.038, rel=0.05) for v in between(itl, 0, onset))
    assert all(v == pytest.approx(0.210, rel=0.05) for v in between(itl, onset + 30, 660))
    assert all(v == pytest.approx(0.038, rel=0.05) for v in between(itl, 680, 1e9))
    loads = server(history, "kv_offload_bytes_total", direction="load")
    assert rate(loads, onset + 30, 650) == pytest.approx(11e9, rel=0.02)
    assert rate(loads, 0, onset) == pytest.approx(4e9, rel=0.02)
    tokens = server(history, "generated_tokens_total")
    assert rate(tokens, 0, onset) == pytest.approx(1450, rel=0.03)
    assert rate(tokens, onset + 30, 650) == pytest.approx(55 / 0.210, rel=0.03)


def test_swap_thrash_delays_the_first_token(scenarios):
    history = scenarios.replayed("swap_thrash").history
    onset = SCENARIOS["swap_thrash"].onset_seconds
    ttft = p50(history, "time_to_first_token")
    assert max(between(ttft, 0, onset)) < 0.2 and min(between(ttft, onset + 60, 1e9)) > 0.9


def test_memory_growth_serves_the_same_tokens_throughout(scenarios):
    history = scenarios.replayed("memory_growth").history
    tokens = server(history, "generated_tokens_total")
    assert rate(tokens, 7800, 8400) == pytest.approx(rate(tokens, 600, 1200), rel=0.02)
    assert rate(tokens, 600, 1200) == pytest.approx(1450, rel=0.03)


def test_healthy_growth_serves_more_tokens_as_memory_grows(scenarios):
    history = scenarios.replayed("healthy_growth_with_load").history
    tokens, running = server(history, "generated_tokens_total"), server(history, "requests_running")
    assert rate(tokens, 7800, 8400) >= 3 * rate(tokens, 0, 600)
    per_request_early = rate(tokens, 0, 600) / value_at(running, 600)
    per_request_late = rate(tokens, 7800, 8400) / value_at(running, 8400)
    assert 0.8 < per_request_late / per_request_early < 0.9  # decode steps lengthen a little with the batch


def test_throughput_decay_loses_40_percent_per_request_at_steady_load(scenarios):
    history = scenarios.replayed("throughput_decay").history
    scenario = SCENARIOS["throughput_decay"]
    onset, end = scenario.onset_seconds, scenario.duration_seconds
    tokens, running = server(history, "generated_tokens_total"), server(history, "requests_running")
    assert set(running.values) <= {31, 32, 33}
    before, after = rate(tokens, 0, onset) / 32, rate(tokens, end - 300, end) / 32
    assert before == pytest.approx(25, rel=0.02) and after / before == pytest.approx(0.6, rel=0.03)
    # The host signals that moved with it, each short of its own alert.
    resident = one(history, "hybridmon_process_resident_bytes", pid=str(VLLM))
    growth_per_hour = 3600 * rate(resident, onset, end) / value_at(resident, end)
    assert 0.01 < growth_per_hour < 0.03  # InferenceProcessMemoryGrowth: 5 %/h
    faults = one(history, "hybridmon_process_major_faults_total", pid=str(VLLM))
    assert rate(faults, 0, onset) < 0.2 and 5 < rate(faults, end - 300, end) < 10
    vm_swap = one(history, "hybridmon_process_swap_bytes", pid=str(VLLM))
    assert value_at(vm_swap, onset) == 0 and value_at(vm_swap, end) == GIB
    for direction in ("in", "out"):
        swapped = one(history, f"hybridmon_swap_{direction}_bytes_total")
        assert rate(swapped, 0, onset - 30) == 0 and 0 < rate(swapped, onset, end) < 256 * 1024  # thrash: 1 MiB/s
    memory_some = one(history, "hybridmon_pressure_stalled_seconds_total", resource="memory", scope="some")
    assert rate(memory_some, 0, onset) < 0.005 and 0.03 < rate(memory_some, end - 300, end) < 0.1
    traffic = one(history, "hybridmon_gpu_pcie_throughput_bytes_per_second", gpu="0", direction="host_to_device")
    assert max(between(traffic, 0, onset)) < 0.45 * GEN4_X16 < 0.55 * GEN4_X16 < min(between(traffic, end - 300, 1e9))
    assert max(traffic.values) < 0.85 * GEN4_X16


def test_kv_cache_full_preempts_while_the_host_sees_nothing(scenarios):
    history = scenarios.replayed("kv_cache_full").history
    onset = SCENARIOS["kv_cache_full"].onset_seconds
    usage, preemptions = server(history, "kv_cache_usage_ratio"), server(history, "preemptions_total")
    assert max(between(usage, 0, onset)) < 0.65 and min(between(usage, onset + 60, 1e9)) >= 0.95
    assert rate(preemptions, 0, onset + 50) == 0 and rate(preemptions, onset + 60, 600) == pytest.approx(1.5, rel=0.05)
    assert not history.series(P + "kv_offload_bytes_total")  # no connector, no family
    assert min(between(server(history, "requests_waiting"), onset + 60, 1e9)) >= 30
    gpu_memory = one(history, "hybridmon_gpu_memory_used_bytes", gpu="0")
    assert len(set(gpu_memory.values)) == 1


def test_kv_offload_link_loads_near_the_links_capacity_while_the_gpu_works(scenarios):
    history = scenarios.replayed("kv_offload_link").history
    onset = SCENARIOS["kv_offload_link"].onset_seconds
    loads = server(history, "kv_offload_bytes_total", direction="load")
    assert rate(loads, 0, onset) < 0.2 * GEN4_X16
    assert rate(loads, onset + 30, 600) == pytest.approx(0.76 * GEN4_X16, rel=0.01)
    traffic = one(history, "hybridmon_gpu_pcie_throughput_bytes_per_second", gpu="0", direction="host_to_device")
    assert min(between(traffic, onset + 20, 1e9)) >= 0.79 * GEN4_X16
    assert min(between(one(history, "hybridmon_gpu_utilization_ratio", gpu="0"), onset + 20, 1e9)) >= 0.7
    assert max(server(history, "kv_cache_usage_ratio").values) < 0.95


def test_inference_server_down_fails_three_ways_then_recovers(scenarios):
    history = scenarios.replayed("inference_server_down").history
    success = one(history, P + "scrape_success", endpoint=ENDPOINT)
    assert set(between(success, 0, 60)) == {1} and set(between(success, 60, 600)) == {0}
    assert set(between(success, 600, 1e9)) == {1}
    for reason, start, end in (("refused", 60, 240), ("not_prometheus", 240, 420), ("http_status", 420, 600)):
        error = one(history, P + "scrape_error", endpoint=ENDPOINT, reason=reason)
        assert [t - START_TIME for t in error.times] == list(range(start, end, 10)), reason
    tokens = server(history, "generated_tokens_total")
    assert [t - START_TIME for t in tokens.times] == list(range(0, 60, 10)) + list(range(600, 721, 10))
    # The server kept serving while its endpoint failed: its counter went on, with no reset.
    assert rate(tokens, 50, 600) == pytest.approx(1450, rel=0.03)
