"""The tests of the throughput_decay alert family (agent/alerts/throughput_decay.py): its detector, on
histories written sample by sample, and its rule's promtool cases (`promtool_cases`, written
to rules/tests/generated_throughput_decay.yml by `python -m tests.rules.generate` and run by
promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

import pytest

from hybridmon.agent.alerts.throughput_decay import GENERATED_TOKENS, REQUESTS_RUNNING
from hybridmon.agent.alerts.throughput_decay import Detector as ThroughputDecayDetector
from tests.support.detector_history import (
    GIB,
    T0,
    THRESHOLDS,
    VLLM_ENDPOINT,
    Trace,
    gpu_rows,
    host_memory_rows,
    inference_rows,
    pressure_rows,
    process_rows,
)
from tests.support.promtool_cases import Test, above
from tests.support.promtool_inputs import (
    LLAMA,
    LLAMA_SERVER,
    SGLANG_SERVER,
    VLLM,
    VLLM_SERVER,
    served,
    stepped,
    stepped_counter,
)

HOUR = 3600.0

STEP = 10.0

DECAY = THRESHOLDS.throughput_decay


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


def test_a_healthy_busy_server_on_a_healthy_host_gives_nothing():
    from hybridmon.agent.alerts.catalogue import all_detectors
    trace = Trace(retention_seconds=3 * HOUR)
    now = trace.run(T0, T0 + 8000, 20.0, **decaying(fall=0.0), host_memory=lambda t: host_memory_rows(
        swappiness=10, dirty_ratio=15))
    findings = [f for d in all_detectors(THRESHOLDS) for f in d.evaluate(trace.history, now)]
    assert [f for f in findings if f.alertname.startswith("InferenceKv") or "Throughput" in f.alertname
            or "Scrape" in f.alertname] == []


# --- its rule's promtool cases ------------------------------------------------------------------


def promtool_cases(t, catalog) -> list[Test]:
    """vLLM's speed per request falls by more than the share at `change` with the same load and
    fires; SGLang's falls as much while its running requests halve (load fell), llama.cpp's falls
    by half the share: both silent. The baseline is the first baseline_seconds of the window."""
    d = t.throughput_decay
    rule = catalog.find("InferenceThroughputDecay")
    recent, window = int(d.recent_seconds), int(d.window_seconds)
    change = window   # from here on the baseline window, [now - window, ...], holds only "before"
    decay = above(d.decay_share)
    active = next(s for s in range(0, recent + 60, 60) if decay * s / recent >= d.decay_share)
    at = change + max(recent, active + int(d.for_seconds)) + 300
    test = Test("throughput decay: vLLM slows per request under the same load; SGLang slows as its "
                "load falls; llama.cpp slows a little: only vLLM fires", at + 60, catalog)
    test.interval = 60
    load, speed = 8.0, 60.0
    for labels, after, running_after in (
            (served(VLLM_SERVER, VLLM["pid"]), 1 - decay, load),
            (served(SGLANG_SERVER, "6161"), 1 - decay, load / 2),
            (served(LLAMA_SERVER, LLAMA["pid"]), 1 - d.decay_share / 2, load)):
        test.values(GENERATED_TOKENS.name, stepped_counter(test, change, speed * load,
                                                           speed * after * running_after), **labels)
        test.values(REQUESTS_RUNNING.name, stepped(test, change, load, running_after), **labels)
    test.expect(change + active + int(d.for_seconds) - 120, rule.alert)
    test.expect(at, rule.alert, test.alert(
        rule, VLLM_SERVER, value=decay, after=speed * (1 - decay), before=speed,
        running_now=load, running_then=load))
    return [test]
