"""The two detectors that read both sides of the bus: InferenceWeightsCrossingBus (host->device
PCIe bytes per generated token that no KV traffic explains) and InferenceOffloadHostMemoryShort
(a host KV tier that will not fit), on synthetic histories. Figures are hand-written inputs, not
measurements."""
import pytest

from hybridmon.agent.status.trends import Trends  # no history read: the plots are not under test here
from hybridmon.agent.alerts.catalogue import all_detectors
from hybridmon.agent.alerts.offload_host_memory import Detector as HostMemoryDetector
from hybridmon.agent.alerts.weight_offload import Detector as WeightOffloadDetector
from hybridmon.exporters import process
from hybridmon.exporters.cgroup_memory import CGROUP_MEMORY_HEADROOM
from hybridmon.exporters.inference_names import BY_FIELD
from tests.support.detector_history import (GIB, T0, THRESHOLDS, VLLM_ENDPOINT, Trace, alertnames,
                                          assert_says_its_rules_words, gpu_rows, host_memory_rows,
                                          inference_rows, only, process_rows)

WEIGHTS = THRESHOLDS.weight_offload
HOST_TIER = BY_FIELD["kv_offload_host_tier_bytes"]
SECOND_ENDPOINT = "http://127.0.0.1:8001/metrics"


def gpus(h2d: dict[str, float], processes: dict[str, dict[str, tuple[str, float]]]):
    """Collector rows for GPUs "0", "1", ...: host->device bytes/s and the processes on each."""
    def rows(t):
        found = []
        for index, traffic in h2d.items():
            found += gpu_rows(index, f"GPU-{index}", h2d=traffic, d2h=1e8,
                              processes=processes.get(index, {}))
        return found
    return rows


def servers(*specs: dict):
    """Inference rows: each spec gives pid, tokens (per second), loads (bytes/s) and endpoint."""
    def rows(t):
        found = []
        for spec in specs:
            loads = spec.get("loads")
            found += inference_rows(
                pid=spec["pid"], endpoint=spec.get("endpoint", VLLM_ENDPOINT),
                server=spec.get("server", "vllm"), model=spec.get("model", "llama-3-8b"),
                generated_tokens=spec["tokens"] * (t - T0),
                offload_load_bytes=None if loads is None else loads * (t - T0))
        return found
    return rows


def trees(roots: dict[str, str]):
    return lambda t: [(process.TREE_ROOT, 1, pid, "python3", root) for pid, root in roots.items()]


def weights_trace(h2d, processes, *specs, roots=None):
    """Every pid watched, each the root of its own tree unless `roots` says otherwise."""
    trace = Trace()
    pids = {spec["pid"] for spec in specs if spec["pid"]} | {pid for on in processes.values() for pid in on}
    collectors = {"gpu": gpus(h2d, processes), "inference": servers(*specs),
                  "process": trees({**{pid: pid for pid in pids}, **(roots or {})})}
    now = trace.run(T0, T0 + 120, **collectors)
    return WeightOffloadDetector(WEIGHTS).evaluate(trace.history, now)


VLLM_ON_GPU0 = {"0": {"4242": ("python3", 20 * GIB)}}


def test_weights_crossing_every_step_fire_with_bytes_per_token():
    # vllm#57771's shape: 120 tokens/s while the GPU takes 20 GB/s from the host
    findings = weights_trace({"0": 20e9}, VLLM_ON_GPU0, {"pid": "4242", "tokens": 120})
    finding = only(findings, "InferenceWeightsCrossingBus")
    assert finding.labels == {"server": "vllm", "endpoint": VLLM_ENDPOINT, "model": "llama-3-8b"}
    assert finding.value == pytest.approx(20e9 / 120, rel=0.01)
    assert finding.details["gpus"] == "0"
    assert "--cpu-offload-gb" in finding.description
    assert_says_its_rules_words(finding)


def test_kv_loads_the_server_reports_explain_their_traffic():
    # a KV offload connector reloading prefix KV: 19.5 of the 20 GB/s are its own loads
    findings = weights_trace({"0": 20e9}, VLLM_ON_GPU0, {"pid": "4242", "tokens": 120, "loads": 19.5e9})
    assert alertnames(findings) == []
    # ...but loads on another GPU explain nothing here
    findings = weights_trace({"0": 20e9, "1": 20e9},
                             {"0": {"4242": ("python3", 20 * GIB)}, "1": {"5151": ("python3", 20 * GIB)}},
                             {"pid": "4242", "tokens": 120},
                             {"pid": "5151", "tokens": 120, "loads": 19.5e9, "endpoint": SECOND_ENDPOINT})
    assert [f.labels["endpoint"] for f in findings] == [VLLM_ENDPOINT]


def test_idle_or_quiet_servers_are_silent():
    per_token = WEIGHTS.unexplained_bytes_per_token_above
    # below a token a second (an idle server with a busy link)
    assert weights_trace({"0": 20e9}, VLLM_ON_GPU0, {"pid": "4242", "tokens": 0.5}) == []
    # many bytes per token but too little traffic to matter
    assert weights_trace({"0": 0.5e9}, VLLM_ON_GPU0, {"pid": "4242", "tokens": 2}) == []
    # enough traffic, under the bound per token (llama.cpp partial offload: activations only)
    assert weights_trace({"0": 2e9}, VLLM_ON_GPU0, {"pid": "4242", "tokens": 2e9 / per_token * 1.2}) == []


def test_tensor_parallel_workers_count_for_the_server_that_listens():
    # vLLM TP=2: the API server (7000) holds no GPU memory, its workers 7001 and 7002 one GPU each;
    # each GPU receives its shard of the weights per step: 6 GB/s each at 100 tokens/s in all.
    findings = weights_trace({"0": 6e9, "1": 6e9},
                             {"0": {"7001": ("VLLM::Worker", 30 * GIB)}, "1": {"7002": ("VLLM::Worker", 30 * GIB)}},
                             {"pid": "7000", "tokens": 100},
                             roots={"7000": "7000", "7001": "7000", "7002": "7000"})
    finding = only(findings, "InferenceWeightsCrossingBus")
    assert finding.value == pytest.approx(12e9 / 100, rel=0.01)
    assert finding.details["gpus"] == "0,1"
    # workers whose parent is not watched are roots of their own: the server's GPUs are unknown
    assert weights_trace({"0": 6e9, "1": 6e9},
                         {"0": {"7001": ("VLLM::Worker", 30 * GIB)}, "1": {"7002": ("VLLM::Worker", 30 * GIB)}},
                         {"pid": "7000", "tokens": 100}) == []


def test_servers_sharing_a_gpu_share_its_traffic_per_token():
    both_on_gpu0 = {"0": {"4242": ("python3", 20 * GIB), "5151": ("python3", 20 * GIB)}}
    fast = {"pid": "5151", "tokens": 3000, "endpoint": SECOND_ENDPOINT}
    # 20 GB/s over 3,100 tokens/s is 6.5 MB a token (20 GB/s / 100 alone would be 200 MB): silent
    assert weights_trace({"0": 20e9}, both_on_gpu0, {"pid": "4242", "tokens": 100}, fast) == []
    # 20 GB/s over 500 tokens/s is 40 MB a token: both are named, the traffic is the GPU's
    findings = weights_trace({"0": 20e9}, both_on_gpu0, {"pid": "4242", "tokens": 100}, {**fast, "tokens": 400})
    assert sorted(f.labels["endpoint"] for f in findings) == [VLLM_ENDPOINT, SECOND_ENDPOINT]
    assert all(f.value == pytest.approx(20e9 / 500, rel=0.01) for f in findings)


def test_a_server_on_no_gpu_the_agent_sees_is_not_judged():
    assert weights_trace({"0": 20e9}, {}, {"pid": "4242", "tokens": 120}) == []
    assert weights_trace({"0": 20e9}, VLLM_ON_GPU0, {"pid": "", "tokens": 120}) == []
    # a pid the process collector does not watch (no tree info)
    trace = Trace()
    now = trace.run(T0, T0 + 120, gpu=gpus({"0": 20e9}, VLLM_ON_GPU0),
                    inference=servers({"pid": "4242", "tokens": 120}))
    assert WeightOffloadDetector(WEIGHTS).evaluate(trace.history, now) == []


# -- InferenceOffloadHostMemoryShort -------------------------------------------------------------

def host_trace(*, tier=100 * GIB, resident=40 * GIB, available=150 * GIB, headroom=None, pid="4242"):
    trace = Trace()

    def inference(t):
        rows = inference_rows(pid=pid, generated_tokens=10 * (t - T0))
        return rows + [(HOST_TIER, tier, "vllm", VLLM_ENDPOINT, "llama-3-8b", pid)]

    def processes(t):
        rows = process_rows("4242", "python3", resident=resident) + trees({"4242": "4242"})(t)
        if headroom is not None:
            rows.append((CGROUP_MEMORY_HEADROOM, headroom, "4242", "python3"))
        return rows

    now = trace.run(T0, T0 + 60, inference=inference, process=processes,
                    host_memory=lambda t: host_memory_rows(memory_total=512 * GIB, memory_available=available))
    return HostMemoryDetector(THRESHOLDS.offload_host_memory).evaluate(trace.history, now)


def test_a_tier_that_will_not_fit_in_memory_available_is_found_before_it_fills():
    factor = THRESHOLDS.offload_host_memory.pinned_overhead_factor
    finding = only(host_trace(), "InferenceOffloadHostMemoryShort", reason="memory_available")
    assert finding.value == pytest.approx((100 * factor - 40) / 150)
    assert finding.details["remaining_bytes"] == pytest.approx((100 * factor - 40) * GIB)
    assert_says_its_rules_words(finding)


def test_a_tier_already_held_or_with_room_is_silent():
    # resident 200 GiB: the tier is allocated, MemAvailable already lacks it
    assert host_trace(resident=200 * GIB, available=20 * GIB) == []
    assert host_trace(available=400 * GIB) == []
    # a server the agent cannot tie to a process: what it holds is unknown
    assert host_trace(pid="") == []


def test_the_cgroup_headroom_bounds_the_tier_too():
    findings = host_trace(available=400 * GIB, headroom=100 * GIB)
    finding = only(findings, "InferenceOffloadHostMemoryShort", reason="cgroup")
    factor = THRESHOLDS.offload_host_memory.pinned_overhead_factor
    assert finding.value == pytest.approx((100 * factor - 40) / 100)
    assert alertnames(findings) == ["InferenceOffloadHostMemoryShort"]
    assert_says_its_rules_words(finding)


# -- the link share of KV loads (InferenceKvOffloadPressure's note, the status page) -------------

def loading_trace(loads: float, h2d: float):
    trace = Trace()
    now = trace.run(T0, T0 + 120, gpu=gpus({"0": h2d}, VLLM_ON_GPU0),
                    inference=servers({"pid": "4242", "tokens": 500, "loads": loads}))
    return trace, now


def test_the_kv_offload_finding_says_what_share_of_the_counted_traffic_its_loads_are():
    from hybridmon.agent.alerts.kv_offload_pressure import Detector as KvOffloadPressureDetector
    from hybridmon.pcie_rates import achievable_capacity
    loads = 0.9 * achievable_capacity(4, 16)
    trace, now = loading_trace(loads, loads / 0.8)
    finding = only(KvOffloadPressureDetector(THRESHOLDS.kv_offload_pressure).evaluate(trace.history, now),
                   "InferenceKvOffloadPressure", reason="offload_link")
    assert finding.details["loads_share_of_host_to_device_traffic"] == pytest.approx(0.8, rel=0.01)
    assert finding.details["agent_note"].startswith("NVML counted 28.7 GB/s host to device on GPU 0")
    assert "KV loads were 80 % of it" in finding.description
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
