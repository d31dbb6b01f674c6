"""The inference-server detectors on synthetic histories: throughput decay, KV offload pressure and
a failing scrape."""
import pytest

from hybridmon.agent.alerts.inference_scrape import Detector as ScrapeFailingDetector
from hybridmon.agent.alerts.kv_offload_pressure import Detector as KvOffloadPressureDetector
from hybridmon.agent.alerts.throughput_decay import Detector as ThroughputDecayDetector
from hybridmon.pcie_rates import achievable_capacity, theoretical_capacity
from tests.support.detector_history import (GIB, T0, THRESHOLDS, VLLM_ENDPOINT, Trace, alertnames,
                                          bench_rows, gpu_rows, host_memory_rows, inference_rows,
                                          only, pressure_rows, process_rows, scrape_error_rows)

HOUR = 3600.0
STEP = 10.0
DECAY = THRESHOLDS.throughput_decay
GEN4_X16 = theoretical_capacity(4, 16)
GEN4_ACHIEVABLE = achievable_capacity(4, 16)   # 0.81 of it: what copies achieve (pcie_rates)


def per_request(t: float, fall: float, start: float, over: float) -> float:
    """Tokens/s per running request: 60, falling linearly by `fall` over `over` seconds from `start`."""
    progress = min(max((t - start) / over, 0.0), 1.0)
    return 60.0 * (1 - fall * progress)


def tokens_so_far(t: float, running: float, fall: float, start: float, over: float) -> float:
    """The generated-tokens counter: the integral of running x per_request from T0 to t."""
    flat = min(t, start) - T0
    ramp = min(max(t - start, 0.0), over)
    after = max(t - start - over, 0.0)
    total = 60.0 * flat + 60.0 * (ramp - fall * ramp * ramp / (2 * over)) + 60.0 * (1 - fall) * after
    return running * total


def decaying(fall=0.4, start=T0 + 1800, over=2 * HOUR, running=lambda t: 8.0):
    """Collectors for a server whose speed per request falls by `fall` over `over` seconds while
    its process's memory and swap grow with it; GPU traffic stays flat."""
    def server(t):
        load = running(t)
        return inference_rows(running=load, generated_tokens=tokens_so_far(t, load, fall, start, over))

    def process(t):
        progress = min(max((t - start) / over, 0.0), 1.0)
        return process_rows("4242", "python3", resident=(20 + 10 * progress) * GIB,
                            swap=2 * GIB * progress, cpu_seconds=2 * (t - T0))

    return {"inference": server, "process": process,
            "gpu": lambda t: gpu_rows(h2d=5e9, d2h=1e9, processes={"4242": ("python3", 20 * GIB)}),
            "pressure": lambda t: pressure_rows(0.001 * (t - T0))}


def mean_per_request(begin: float, end: float, **story) -> float:
    """The mean speed per request over [begin, end], from the counter as rate() reads it."""
    load = 8.0
    return (tokens_so_far(end, load, **story) - tokens_so_far(begin, load, **story)) / (end - begin) / load


def test_throughput_decay_fires_against_the_earliest_part_of_the_window_and_names_what_moved():
    trace = Trace(retention_seconds=3 * HOUR)
    now = trace.run(T0, T0 + 9000, STEP, **decaying())
    (finding,) = ThroughputDecayDetector(DECAY).evaluate(trace.history, now)
    assert finding.alertname == "InferenceThroughputDecay" and finding.severity == "warning"
    assert finding.labels == {"server": "vllm", "endpoint": VLLM_ENDPOINT, "model": "llama-3-8b"}
    story = {"fall": 0.4, "start": T0 + 1800, "over": 2 * HOUR}
    baseline_end = now - DECAY.window_seconds + DECAY.baseline_seconds
    before = mean_per_request(baseline_end - DECAY.baseline_seconds, baseline_end, **story)
    after = mean_per_request(now - DECAY.recent_seconds, now, **story)
    assert finding.details["tokens_per_second_per_request_before"] == pytest.approx(before, rel=0.01)
    assert finding.details["tokens_per_second_per_request_after"] == pytest.approx(after, rel=0.01)
    assert finding.value == pytest.approx(1 - after / before, abs=0.01) and finding.value >= 0.3
    assert finding.threshold == DECAY.decay_share and finding.for_seconds == DECAY.for_seconds
    # Resident memory and swap moved with it; the flat PCIe traffic and GPU memory did not.
    assert finding.details["host_process_resident_bytes_after"] > finding.details["host_process_resident_bytes_before"]
    assert finding.details["host_process_swap_bytes_after"] > 1.5 * GIB
    assert not any(key.startswith("host_gpu") for key in finding.details)
    assert "python3 (pid 4242) resident memory rose from" in finding.description
    assert "its swap rose from 256.0 MiB to 1.9 GiB" in finding.description
    # The rule's text, with the agent's figures; then what only the agent can say.
    assert finding.summary.startswith(f"vllm (model llama-3-8b) at {VLLM_ENDPOINT} on ")
    assert f"fell {finding.value * 100:.4g}% (" in finding.summary
    assert finding.description.index("the agent's own finding names the ones that moved.") < \
        finding.description.index("Over the same two windows on the host, ")


def test_throughput_decay_stays_silent_when_small_when_load_fell_or_without_a_baseline():
    detector = ThroughputDecayDetector(DECAY)
    small = Trace(retention_seconds=3 * HOUR)
    now = small.run(T0, T0 + 9000, STEP, **decaying(fall=0.2))
    assert detector.evaluate(small.history, now) == []
    # The same -40 % per request, but the traffic went away: running requests fell from 8 to 4.
    quieter = Trace(retention_seconds=3 * HOUR)
    now = quieter.run(T0, T0 + 9000, STEP, **decaying(running=lambda t: 8.0 if t < T0 + 5400 else 4.0))
    assert detector.evaluate(quieter.history, now) == []
    # A sharp fall within the first hour of history: there is no baseline yet.
    young = Trace(retention_seconds=3 * HOUR)
    now = young.run(T0, T0 + HOUR, STEP, **decaying(fall=0.6, start=T0 + 600, over=600))
    assert detector.evaluate(young.history, now) == []


def test_throughput_decay_window_is_inside_the_lookback():
    from hybridmon.agent.alerts.catalogue import lookback_seconds
    assert lookback_seconds(THRESHOLDS) >= DECAY.window_seconds + 60


def kv_trace(**server) -> tuple[Trace, float]:
    trace = Trace()
    state = {"preempted": 0.0, "loaded": 0.0}

    def rows(t):
        state["preempted"] += server.get("preemptions_per_second", 0.0) * STEP
        state["loaded"] += server.get("loads_per_second", 0.0) * STEP
        return inference_rows(pid=server.get("pid", "4242"), kv_usage=server.get("usage", 0.5),
                              preemptions=state["preempted"], offload_load_bytes=state["loaded"])

    collectors = {"inference": rows, "gpu": lambda t: (
        gpu_rows(processes={"4242": ("python3", 20 * GIB)})
        + gpu_rows("1", "GPU-0001", generation=4, width=8, pci_bus_id="0000:ca:00.0"))}
    if "measured" in server:
        collectors["bench"] = lambda t: bench_rows(h2d=server["measured"])
    return trace, trace.run(T0, T0 + 300, STEP, **collectors)


def test_kv_cache_full_needs_preemptions_too():
    detector = KvOffloadPressureDetector(THRESHOLDS.kv_offload_pressure)
    trace, now = kv_trace(usage=0.97, preemptions_per_second=0.5)
    finding = only(detector.evaluate(trace.history, now), "InferenceKvOffloadPressure", reason="kv_cache_full")
    assert finding.labels == {"server": "vllm", "endpoint": VLLM_ENDPOINT, "model": "llama-3-8b",
                              "reason": "kv_cache_full"}
    assert finding.value == pytest.approx(0.97) and finding.details["preemptions_per_second"] == pytest.approx(0.5)
    for usage, preemptions in ((0.97, 0.0), (0.9, 0.5)):
        trace, now = kv_trace(usage=usage, preemptions_per_second=preemptions)
        assert detector.evaluate(trace.history, now) == []


def test_offload_loads_are_judged_against_the_link_of_the_servers_gpus():
    detector = KvOffloadPressureDetector(THRESHOLDS.kv_offload_pressure)
    share = THRESHOLDS.kv_offload_pressure.offload_load_share_of_capacity
    # pid 4242 holds memory on GPU 0 only (Gen4 x16): GPU 1's link does not count.
    trace, now = kv_trace(loads_per_second=(share + 0.05) * GEN4_ACHIEVABLE)
    finding = only(detector.evaluate(trace.history, now), "InferenceKvOffloadPressure", reason="offload_link")
    assert finding.value == pytest.approx(share + 0.05, rel=0.01)
    assert finding.details["capacity_bytes_per_second"] == pytest.approx(GEN4_ACHIEVABLE)
    assert finding.details["capacity_sources"] == "GPU 0 25.5 GB/s (achievable on Gen4 x16)"
    assert "of the 25.52GB/s host-to-device capacity" in finding.description
    trace, now = kv_trace(loads_per_second=(share - 0.05) * GEN4_ACHIEVABLE)
    assert alertnames(detector.evaluate(trace.history, now)) == []
    # What `hybridmon bench` measured is the capacity when there is a measurement.
    trace, now = kv_trace(loads_per_second=(share - 0.05) * GEN4_ACHIEVABLE, measured=0.7 * GEN4_X16)
    finding = only(detector.evaluate(trace.history, now), "InferenceKvOffloadPressure", reason="offload_link")
    assert finding.details["capacity_bytes_per_second"] == pytest.approx(0.7 * GEN4_X16)
    # A server tied to no process is judged against every GPU of the host (x16 + x8).
    trace, now = kv_trace(loads_per_second=(share + 0.05) * GEN4_ACHIEVABLE, pid="")
    assert alertnames(detector.evaluate(trace.history, now)) == []
    trace, now = kv_trace(loads_per_second=(share + 0.05) * 1.5 * GEN4_ACHIEVABLE, pid="")
    finding = only(detector.evaluate(trace.history, now), "InferenceKvOffloadPressure", reason="offload_link")
    assert finding.details["capacity_bytes_per_second"] == pytest.approx(1.5 * GEN4_ACHIEVABLE)


def test_offload_loads_that_fill_the_link_are_reachable():
    # 0.78 of the theoretical rate, what a copy engine moves short of its ceiling (0.81-0.83 on
    # Gen4 x16, nvbandwidth), fills the link; the old threshold, 0.80 of the theoretical rate,
    # sat at that ceiling and never saw it.
    detector = KvOffloadPressureDetector(THRESHOLDS.kv_offload_pressure)
    trace, now = kv_trace(loads_per_second=0.78 * GEN4_X16)
    finding = only(detector.evaluate(trace.history, now), "InferenceKvOffloadPressure", reason="offload_link")
    assert finding.value == pytest.approx(0.78 * GEN4_X16 / GEN4_ACHIEVABLE, rel=0.01)


def test_a_failing_scrape_is_reported_while_it_is_in_the_latest_scrape():
    detector = ScrapeFailingDetector(THRESHOLDS.inference_scrape)
    trace = Trace()
    other = "http://127.0.0.1:8080/metrics"
    now = trace.run(T0, T0 + 60, 5.0, inference=lambda t: (
        scrape_error_rows(reason="not_prometheus") + inference_rows(endpoint=other, server="llamacpp")))
    (finding,) = detector.evaluate(trace.history, now)
    assert finding.labels == {"endpoint": VLLM_ENDPOINT, "reason": "not_prometheus"}
    assert finding.for_seconds == THRESHOLDS.inference_scrape.for_seconds
    assert "HTML" in finding.description and VLLM_ENDPOINT in finding.summary
    assert finding.summary.endswith("cannot be read: not_prometheus")
    # The next scrape succeeds: the error is gone at once, as Prometheus marks it stale.
    now = trace.run(now + 5, now + 5, 5.0, inference=lambda t: inference_rows())
    assert detector.evaluate(trace.history, now) == []


def test_a_healthy_busy_server_on_a_healthy_host_gives_nothing():
    from hybridmon.agent.alerts.catalogue import all_detectors
    trace = Trace(retention_seconds=3 * HOUR)
    now = trace.run(T0, T0 + 8000, 20.0, **decaying(fall=0.0), host_memory=lambda t: host_memory_rows(
        swappiness=10, dirty_ratio=15))
    findings = [f for d in all_detectors(THRESHOLDS) for f in d.evaluate(trace.history, now)]
    assert [f for f in findings if f.alertname.startswith("InferenceKv") or "Throughput" in f.alertname
            or "Scrape" in f.alertname] == []
