"""The tests of the kv_offload_pressure alert family (agent/alerts/kv_offload_pressure.py): its detector, on
histories written sample by sample, and its rule's promtool cases (`promtool_cases`, written
to rules/tests/generated_kv_offload_pressure.yml by `python -m tests.rules.generate` and run by
promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

import pytest

from hybridmon.agent.alerts.catalogue import all_detectors
from hybridmon.agent.alerts.kv_offload_pressure import KV_CACHE_USAGE, PREEMPTIONS
from hybridmon.agent.alerts.kv_offload_pressure import (
    Detector as KvOffloadPressureDetector,
)
from hybridmon.agent.status.trends import (
    Trends,  # no history read: the plots are not under test here
)
from hybridmon.exporters.bench import MEASURED_CAPACITY
from hybridmon.exporters.inference_names import BY_FIELD, OFFLOAD_BYTES
from hybridmon.exporters import gpu as gpu_metrics
from hybridmon.pcie_rates import achievable_capacity, c2c_capacity, theoretical_capacity
from hybridmon.rules import inference as recorded
from tests.support.detector_history import (
    GIB,
    T0,
    THRESHOLDS,
    VLLM_ENDPOINT,
    VLLM_ON_GPU0,
    Trace,
    alertnames,
    assert_says_its_rules_words,
    bench_rows,
    c2c_rows,
    gpu_rows,
    gpus_over_time,
    inference_rows,
    only,
    servers_over_time,
)
from tests.support.promtool_cases import GPU0, GPU1, Test, above, firing, not_yet
from tests.support.promtool_inputs import (
    LLAMA,
    LLAMA_SERVER,
    SGLANG_SERVER,
    VLLM,
    VLLM_SERVER,
    achievable,
    capacity,
    link,
    on_gpu,
    served,
)

STEP = 10.0

GEN4_X16 = theoretical_capacity(4, 16)

GEN4_ACHIEVABLE = achievable_capacity(4, 16)   # 0.81 of it: what copies achieve (pcie_rates)


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




def loading_trace(loads: float, h2d: float):
    trace = Trace()
    now = trace.run(T0, T0 + 120, gpu=gpus_over_time({"0": h2d}, VLLM_ON_GPU0),
                    inference=servers_over_time({"pid": "4242", "tokens": 500, "loads": loads}))
    return trace, now


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


def test_the_kv_offload_finding_says_what_share_of_the_counted_traffic_its_loads_are():
    from hybridmon.agent.alerts.kv_offload_pressure import (
        Detector as KvOffloadPressureDetector,
    )
    from hybridmon.pcie_rates import achievable_capacity
    loads = 0.9 * achievable_capacity(4, 16)
    trace, now = loading_trace(loads, loads / 0.8)
    finding = only(KvOffloadPressureDetector(THRESHOLDS.kv_offload_pressure).evaluate(trace.history, now),
                   "InferenceKvOffloadPressure", reason="offload_link")
    assert finding.details["loads_share_of_host_to_device_traffic"] == pytest.approx(0.8, rel=0.01)
    assert finding.details["agent_note"].startswith("NVML counted 28.7 GB/s host to device on GPU 0")
    assert "KV loads were 80 % of it" in finding.description
    assert_says_its_rules_words(finding)


# A GH200 (issue 29; simulated): C2C on, one link up at 450 GB/s, its PCIe link at the driver's
# 50 MB/s. Its KV loads cross C2C and are judged against C2C's host->device capacity.
C2C_MAX = 450e9
C2C_H2D = c2c_capacity(None, "host_to_device", C2C_MAX).bytes_per_second   # 346.5 GB/s


def c2c_loading_trace(loads: float):
    trace = Trace()
    pcie = gpus_over_time({"0": 5e7}, VLLM_ON_GPU0)
    now = trace.run(T0, T0 + 120, gpu=lambda t: pcie(t) + c2c_rows("0", "GPU-0", links={"0": (1, C2C_MAX)},
                                                                  h2d=loads, d2h=1e9),
                    inference=servers_over_time({"pid": "4242", "tokens": 500, "loads": loads}))
    return trace, now


def test_kv_loads_over_nvlink_c2c_are_judged_against_c2c_not_the_idle_pcie_link():
    detector = KvOffloadPressureDetector(THRESHOLDS.kv_offload_pressure)
    share = THRESHOLDS.kv_offload_pressure.offload_load_share_of_capacity
    # 200 GB/s: eight times what Gen4 x16 carries, 58 % of what C2C carries host to device
    trace, now = c2c_loading_trace(200e9)
    assert alertnames(detector.evaluate(trace.history, now)) == []
    (link_share,) = detector.figures.values()
    assert link_share.capacity == pytest.approx(C2C_H2D) and link_share.traffic == pytest.approx(200e9)
    trace, now = c2c_loading_trace((share + 0.05) * C2C_H2D)
    finding = only(detector.evaluate(trace.history, now), "InferenceKvOffloadPressure", reason="offload_link")
    assert finding.value == pytest.approx(share + 0.05, rel=0.01)
    assert finding.details["capacity_sources"] == "GPU 0 346.5 GB/s (achievable on NVLink-C2C)"
    assert finding.details["loads_share_of_host_to_device_traffic"] == pytest.approx(1.0, rel=0.02)
    assert_says_its_rules_words(finding)


def test_the_status_page_shows_the_link_share_of_kv_loads_as_the_family_judged_it():
    """The page reads the LinkShare InferenceKvOffloadPressure worked out at its last evaluation
    (its figures), for every server with KV loads, firing or not: it works nothing out itself."""
    from hybridmon.agent.detectors.engine import Engine
    from hybridmon.agent.status.inference import inference_html
    from hybridmon.agent.status.signals import Decided, LatestValues
    trace, now = loading_trace(5e9, 20e9)
    engine = Engine(all_detectors(THRESHOLDS), trace.history)

    def page() -> str:
        return inference_html(trace.history, LatestValues(trace.history),
                              Trends(trace.history, None, THRESHOLDS, None), Decided(engine))

    assert "KV loads on GPU 0" not in page()   # not judged yet
    engine.evaluate(now)
    assert engine.firing() == [] and engine.pending() == []   # 20 % of the link: nothing to say
    assert "KV loads on GPU 0 host→device link" in page()
    assert "25 % of the 20.0 GB/s NVML counted" in page()
    assert "20 % of its 25.5 GB/s capacity" in page()


# --- its rule's promtool cases ------------------------------------------------------------------


def kv_cache_full_case(t, catalog) -> Test:
    k = t.kv_offload_pressure
    rule = catalog.find("InferenceKvOffloadPressure", reason="kv_cache_full")
    full, preempting = above(k.kv_cache_usage_at_least), k.preemptions_per_second_above + 0.5
    test = Test("KV cache full: vLLM fills and preempts; SGLang is full without preempting and "
                "llama.cpp preempts below the threshold: both silent", firing(k.for_seconds) + 120, catalog)
    for labels, usage, preemptions in (
            (served(VLLM_SERVER, VLLM["pid"]), (0.5, full), preempting),
            (served(SGLANG_SERVER, "6161"), (full, full), 0.0),
            (served(LLAMA_SERVER, LLAMA["pid"]), (0.5, k.kv_cache_usage_at_least - 0.05), preempting)):
        test.gauge(KV_CACHE_USAGE.name, *usage, **labels)
        test.counter(PREEMPTIONS.name, 0, preemptions, **labels)
    test.expect(not_yet(k.for_seconds), rule.alert)
    test.expect(firing(k.for_seconds), rule.alert,
                test.alert(rule, VLLM_SERVER, value=full, preemptions=preempting))
    return test


def offload_link_case(t, catalog) -> Test:
    """GPU 0 (python3, pid 4242) at what copies achieve on its Gen4 x16 link; GPU 1 (llama-server,
    pid 5151) measured by hybridmon bench at half the theoretical rate. A server tied to no process
    is judged against both."""
    k = t.kv_offload_pressure
    rule = catalog.find("InferenceKvOffloadPressure", reason="offload_link")
    share = above(k.offload_load_share_of_capacity)
    full, measured = achievable(4, 16), capacity(4, 16) / 2
    second_vllm = served(VLLM_SERVER, LLAMA["pid"], "http://127.0.0.1:8001/metrics")
    quiet_vllm = served(VLLM_SERVER, VLLM["pid"], "http://127.0.0.1:8002/metrics")
    test = Test("KV offload loads: vLLM on GPU 0 past the share of its link, a second vLLM past the "
                "share of GPU 1's measured capacity; SGLang, tied to no process, is judged against "
                "both GPUs and a third vLLM stays under: both silent", firing(k.for_seconds) + 120, catalog)
    for gpu in (GPU0, GPU1):
        link(test, gpu, 4, 16)
    for direction in ("host_to_device", "device_to_host"):
        test.constant(MEASURED_CAPACITY.name, measured, direction=direction, **GPU1)
    on_gpu(test, GPU0, VLLM, 20e9)
    on_gpu(test, GPU1, LLAMA, 8e9)
    loading = ((served(VLLM_SERVER, VLLM["pid"]), share * full), (second_vllm, share * measured),
               (served(SGLANG_SERVER, ""), share * full),
               (quiet_vllm, (k.offload_load_share_of_capacity - 0.05) * full))
    for labels, loads in loading:
        test.counter(OFFLOAD_BYTES.name, 0, loads, direction="load", **labels)
    test.expect_samples(60, recorded.SERVER_CAPACITY, *(
        (labels, full + measured if labels["pid"] == "" else
         measured if labels["pid"] == LLAMA["pid"] else full) for labels, _ in loading))
    test.expect(not_yet(k.for_seconds), rule.alert)
    test.expect(firing(k.for_seconds), rule.alert,
                test.alert(rule, VLLM_SERVER, value=share, loads=share * full, capacity=full),
                test.alert(rule, {name: v for name, v in second_vllm.items() if name != "pid"},
                           value=share, loads=share * measured, capacity=measured))
    return test


def offload_link_over_c2c_case(t, catalog) -> Test:
    """GPU 0 a GH200 (C2C on, one link up at 450 GB/s; simulated), its PCIe link Gen4 x16 as the
    fixture's: vLLM's loads past the share of C2C's host->device capacity fire against it, and a
    second vLLM on GPU 0 at 200 GB/s, eight times what the PCIe link carries and well under C2C's,
    stays silent. GPU 1, C2C off, is still sized by its PCIe link."""
    k = t.kv_offload_pressure
    rule = catalog.find("InferenceKvOffloadPressure", reason="offload_link")
    share = above(k.offload_load_share_of_capacity)
    quiet_vllm = served(VLLM_SERVER, LLAMA["pid"], "http://127.0.0.1:8002/metrics")
    test = Test("KV offload loads over NVLink-C2C: judged against C2C's host->device capacity, "
                "not the idle PCIe link's", firing(k.for_seconds) + 120, catalog)
    for gpu in (GPU0, GPU1):
        link(test, gpu, 4, 16)
    test.constant(gpu_metrics.C2C_MODE.name, 1, **GPU0)
    test.constant(gpu_metrics.C2C_MODE.name, 0, **GPU1)
    test.constant(gpu_metrics.C2C_LINK_UP.name, 1, link="0", **GPU0)
    test.constant(gpu_metrics.C2C_LINK_MAX_BANDWIDTH.name, C2C_MAX, link="0", **GPU0)
    on_gpu(test, GPU0, VLLM, 20e9)
    on_gpu(test, GPU0, LLAMA, 8e9)
    for labels, loads in ((served(VLLM_SERVER, VLLM["pid"]), share * C2C_H2D), (quiet_vllm, 200e9)):
        test.counter(OFFLOAD_BYTES.name, 0, loads, direction="load", **labels)
    test.expect_samples(60, recorded.OFFLOAD_CAPACITY, ({**GPU0, "direction": "host_to_device"}, C2C_H2D),
                        ({**GPU1, "direction": "host_to_device"}, achievable(4, 16)))
    test.expect(not_yet(k.for_seconds), rule.alert)
    test.expect(firing(k.for_seconds), rule.alert,
                test.alert(rule, VLLM_SERVER, value=share, loads=share * C2C_H2D, capacity=C2C_H2D))
    return test


def preempted_share_case(t, catalog) -> Test:
    """The recorded share of requests preempted (issue 31): a vLLM preempting a quarter of the
    requests it finishes, another an eighth (shares a float holds exactly: promtool compares
    exactly; H10's 17.5 % and 8.5 % are read from the scenario through the dashboard's expressions,
    tests/integration/test_dashboards.py); one that finishes nothing records none."""
    test = Test("requests preempted: the share of finished requests", 600, catalog)
    single, tiered = (served(VLLM_SERVER, VLLM["pid"]), served(VLLM_SERVER, "", "http://127.0.0.1:18001/metrics"))
    idle = served(SGLANG_SERVER, "")
    for labels, finished, share in ((single, 4.0, 0.25), (tiered, 4.0, 0.125), (idle, 0.0, 0.0)):
        test.counter(BY_FIELD["requests_finished"].name, finished, finished, **labels)
        test.counter(BY_FIELD["preemptions"].name, finished * share, finished * share, **labels)
    test.expect_samples(600, recorded.PREEMPTED_SHARE, (single, 0.25), (tiered, 0.125))
    return test


def promtool_cases(t, catalog) -> list[Test]:
    return [kv_cache_full_case(t, catalog), offload_link_case(t, catalog), offload_link_over_c2c_case(t, catalog),
            preempted_share_case(t, catalog)]
