"""Host findings put in the inference server's terms: the server-side impact the engine adds to
PCIe, swap and NUMA findings (agent/detectors/impact.py)."""
import pytest

from hybridmon.agent.alerts import pcie_starvation
from hybridmon.agent.detectors import impact
from hybridmon.agent.detectors.base import DetectorBase, Finding
from hybridmon.agent.detectors.engine import Engine
from hybridmon.pcie_rates import theoretical_capacity
from tests.support.detector_history import (GIB, T0, THRESHOLDS, VLLM_ENDPOINT, Trace, gpu_rows,
                                          inference_rows, tree_info)

ONSET = T0 + 900
STEP = 5.0
GEN4_X16 = theoretical_capacity(4, 16)
LLAMA_ENDPOINT = "http://127.0.0.1:8080/metrics"


def starving_host(with_server: bool = True):
    """GPU 0's link fills at ONSET while the GPU idles; vLLM's latency rises, its tokens/s fall and
    its KV offload loads start (the pcie_starvation story in the server's terms)."""
    counters = {"tokens": 0.0, "loaded": 0.0}

    def gpu(t):
        after = t > ONSET
        return gpu_rows(utilization=0.3 if after else 0.9, h2d=(0.95 if after else 0.2) * GEN4_X16,
                        processes={"4242": ("python3", 20 * GIB)})

    def server(t):
        after = t > ONSET
        counters["tokens"] += (610.0 if after else 1450.0) * STEP
        counters["loaded"] += (11e9 if after else 0.0) * STEP
        return inference_rows(generated_tokens=counters["tokens"], offload_load_bytes=counters["loaded"],
                              inter_token_p50=0.210 if after else 0.038,
                              first_token_p50=0.5 if after else 0.47)

    return {"gpu": gpu, **({"inference": server} if with_server else {})}


def first_firing(collectors, detector, end=ONSET + 300):
    trace = Trace()
    engine = Engine([detector], trace.history)
    t = T0
    while t <= end:
        for name, rows in collectors.items():
            trace.commit(name, t, rows(t))
        firing = engine.evaluate(t)
        if firing:
            return firing[0].finding
        t += STEP
    raise AssertionError("never fired")


def test_pcie_starvation_carries_the_servers_latency_tokens_and_offload_loads():
    finding = first_firing(starving_host(), pcie_starvation.Detector(THRESHOLDS.pcie_starvation))
    details = finding.details
    assert details["server_inter_token_latency_p50_seconds_before"] == pytest.approx(0.038)
    assert details["server_inter_token_latency_p50_seconds_after"] == pytest.approx(0.210)
    assert details["server_generation_tokens_per_second_before"] == pytest.approx(1450)
    assert details["server_generation_tokens_per_second_after"] == pytest.approx(610)
    assert details["server_time_to_first_token_p50_seconds_after"] == pytest.approx(0.5)
    assert details["server_kv_offload_load_bytes_per_second"] == pytest.approx(11e9)
    assert details["server_preemptions_per_second"] == 0
    assert details["server"] == "vllm" and details["server_endpoint"] == VLLM_ENDPOINT
    sentence = details["server_impact"]
    assert finding.description.endswith(" " + sentence)
    assert sentence == (
        "Server side, the 10 min before this began against the last minute: vLLM (model "
        "llama-3-8b at http://127.0.0.1:8000/metrics): inter-token latency p50 rose from 38 ms to "
        "210 ms, time to first token p50 held at 500 ms, generation fell from 1,450 to 610 "
        "tokens/s, KV offload loads ran at 11.0 GB/s.")


def test_without_a_server_the_finding_is_unchanged():
    finding = first_firing(starving_host(with_server=False), pcie_starvation.Detector(THRESHOLDS.pcie_starvation))
    assert not any(key.startswith("server") for key in finding.details)
    assert "Server side" not in finding.description


def two_servers(trace: Trace, vllm_pid: str = "4242", llama_pid: str = "5151") -> float:
    tokens = {"n": 0.0}

    def rows(t):
        tokens["n"] += 100 * STEP
        return (inference_rows(pid=vllm_pid, generated_tokens=tokens["n"], inter_token_p50=0.05)
                + inference_rows(server="llamacpp", endpoint=LLAMA_ENDPOINT, model="", pid=llama_pid,
                                 generated_tokens=tokens["n"] / 10, kv_usage=None, preemptions=None))
    return trace.run(T0, T0 + 900, STEP, inference=rows)


def finding(alertname: str, **labels: str) -> Finding:
    return Finding(alertname, "warning", labels, 1.0, 1.0, "summary", "Description.")


def test_a_process_finding_reads_its_own_server_and_a_host_finding_every_server():
    trace = Trace()
    now = two_servers(trace)
    numa = impact.correlate(trace.history, finding("InferenceProcessNumaMisplaced", pid="5151"), now - 300, now)
    assert numa.details["server"] == "llamacpp"
    assert "llama.cpp (http://127.0.0.1:8080/metrics): generation held at 10 tokens/s" in numa.description
    assert "vLLM" not in numa.description
    host = impact.correlate(trace.history, finding("HostSwapThrash"), now - 300, now)
    assert "vLLM (model llama-3-8b at" in host.description and "llama.cpp (" in host.description
    # A process no server is tied to, while others are: nothing to say about it.
    other = finding("InferenceProcessNumaMisplaced", pid="7171")
    assert impact.correlate(trace.history, other, now - 300, now) == other
    # Alerts that are not about the link, swap or NUMA are left alone.
    growth = finding("GpuMemoryHeadroomLow", gpu="0")
    assert impact.correlate(trace.history, growth, now - 300, now) == growth


def gpus_in_use(trace: Trace, now: float, holders: dict[str, tuple[str, str]],
                roots: dict[str, str] | None = None) -> None:
    """NVML's per-process memory at `now`: holders pid -> (gpu, uuid); roots pid -> root_pid as
    the process collector's tree info gives it."""
    rows = []
    for pid, (index, uuid) in holders.items():
        rows += [row for row in gpu_rows(index, uuid, processes={pid: ("python3", 8 * GIB)})
                 if row[0].name.startswith("hybridmon_gpu_process")]
    trace.commit("gpu", now, rows)
    trace.commit("process", now, [tree_info(pid, "python3", root) for pid, root in (roots or {}).items()])


def test_a_gpu_finding_reads_only_the_servers_using_that_gpu():
    # vLLM (pid 4242) holds GPU 0, llama.cpp (pid 5151) GPU 1: the old correlation named both
    # servers under a finding about GPU 0.
    trace = Trace()
    now = two_servers(trace)
    gpus_in_use(trace, now, {"4242": ("0", "GPU-0000"), "5151": ("1", "GPU-1111")})
    starving = impact.correlate(trace.history, finding("GpuPcieStarvation", gpu="0"), now - 300, now)
    assert starving.details["server"] == "vllm"
    assert "vLLM (model llama-3-8b at" in starving.description and "llama.cpp" not in starving.description
    degraded = impact.correlate(trace.history, finding("GpuPcieLinkDegraded", gpu="1"), now - 300, now)
    assert degraded.details["server"] == "llamacpp" and "vLLM" not in degraded.description
    assert "every server on the host" not in degraded.description
    # a GPU no server uses: nothing to say
    idle = finding("GpuPcieLinkDegraded", gpu="2")
    assert impact.correlate(trace.history, idle, now - 300, now) == idle


def test_a_server_uses_the_gpu_its_child_process_holds():
    # vLLM V1: the API server (pid 4242) listens, its engine core (pid 4300) holds the GPU memory.
    trace = Trace()
    now = two_servers(trace)
    gpus_in_use(trace, now, {"4300": ("0", "GPU-0000"), "5151": ("1", "GPU-1111")},
                roots={"4242": "4242", "4300": "4242", "5151": "5151"})
    starving = impact.correlate(trace.history, finding("GpuPcieStarvation", gpu="0"), now - 300, now)
    assert "vLLM" in starving.description and "llama.cpp" not in starving.description


def test_servers_tied_to_no_gpu_are_all_read_and_the_sentence_says_so():
    trace = Trace()
    now = two_servers(trace)   # no process holds GPU memory by NVML's list
    starving = impact.correlate(trace.history, finding("GpuPcieStarvation", gpu="0"), now - 300, now)
    assert "vLLM" in starving.description and "llama.cpp" in starving.description
    assert starving.details["server_impact"].startswith(
        "Server side (every server on the host: none could be tied to a GPU through the processes "
        "holding GPU memory), the 10 min before")


def test_servers_tied_to_no_process_are_read_for_every_process_finding():
    trace = Trace()
    now = two_servers(trace, vllm_pid="", llama_pid="")
    numa = impact.correlate(trace.history, finding("InferenceProcessNumaMisplaced", pid="4242"), now - 300, now)
    assert "vLLM" in numa.description and "llama.cpp" in numa.description


def test_a_correlation_that_raises_leaves_the_finding_as_the_detector_gave_it():
    def broken(history, found, began, now):
        raise RuntimeError("boom")
    trace = Trace()
    collectors = starving_host()
    engine = Engine([pcie_starvation.Detector(THRESHOLDS.pcie_starvation)], trace.history, correlate=broken)
    t = T0
    while t <= ONSET + 300:
        for name, rows in collectors.items():
            trace.commit(name, t, rows(t))
        engine.evaluate(t)
        t += STEP
    (state,) = engine.firing()
    assert "Server side" not in state.finding.description
    assert engine.detector_errors == {"pcie_starvation": 0}


def test_the_before_window_is_anchored_where_the_condition_began_not_where_it_is_now():
    """The engine hands each finding's pending_since to the correlation, every evaluation: the
    'before' figures stay those of the minutes before the incident, however long it lasts."""
    holds = {"now": True}

    class Switch(DetectorBase):
        name, alertnames = "switch", ("HostSwapThrash",)

        def evaluate(self, history, now):
            return [finding("HostSwapThrash")] if holds["now"] else []

    began_seen = []

    def record(history, found, began, now):
        began_seen.append((now, began))
        return found
    engine = Engine([Switch()], Trace().history, correlate=record)
    for t in (100.0, 110.0, 120.0):
        engine.evaluate(t)
    holds["now"] = False
    engine.evaluate(130.0)
    holds["now"] = True
    engine.evaluate(140.0)
    assert began_seen == [(100.0, 100.0), (110.0, 100.0), (120.0, 100.0), (140.0, 140.0)]


def test_one_evaluation_works_the_servers_out_once_and_correlates_as_before(monkeypatch):
    # Issue 33: each correlated finding of an evaluation made the scraped servers and the servers
    # by GPU again. Through the engine's view of one evaluation they are made once and shared, and
    # each finding reads as it did through a view of its own.
    trace = Trace()
    now = two_servers(trace)
    gpus_in_use(trace, now, {"4242": ("0", "GPU-0000"), "5151": ("1", "GPU-1111")})
    engine = Engine([], trace.history, lookback_seconds=7200)
    findings = [finding("GpuPcieStarvation", gpu="0"), finding("GpuPcieLinkDegraded", gpu="1"),
                finding("InferenceProcessNumaMisplaced", pid="5151"), finding("HostSwapThrash")]
    each_its_own_view = [impact.correlate(engine.view_at(now).reading_back(None), one, now - 300, now)
                         for one in findings]
    made = {"scraped": 0, "by_gpu": 0}
    scraped, by_gpu = impact.servers.scraped, impact.servers_by_gpu

    def counted(name, real):
        def call(*args):
            made[name] += 1
            return real(*args)
        return call
    monkeypatch.setattr(impact.servers, "scraped", counted("scraped", scraped))
    monkeypatch.setattr(impact, "servers_by_gpu", counted("by_gpu", by_gpu))
    view = engine.view_at(now).reading_back(None)
    one_view = [impact.correlate(view, one, now - 300, now) for one in findings]
    assert one_view == each_its_own_view
    assert "vLLM" in one_view[0].description and "llama.cpp" not in one_view[0].description
    assert "llama.cpp" in one_view[1].description and "vLLM" not in one_view[1].description
    assert made == {"scraped": 1, "by_gpu": 1}
    # a History read straight is not a snapshot: there each call works them out again
    impact.correlate(trace.history, findings[0], now - 300, now)
    impact.correlate(trace.history, findings[1], now - 300, now)
    assert made == {"scraped": 3, "by_gpu": 3}
