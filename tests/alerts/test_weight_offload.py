"""The tests of the weight_offload alert family (agent/alerts/weight_offload.py): its detector, on
histories written sample by sample, and its rule's promtool cases (`promtool_cases`, written
to rules/tests/generated_weight_offload.yml by `python -m tests.rules.generate` and run by
promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

import pytest

from hybridmon.agent.alerts.weight_offload import GENERATED_TOKENS, HOST_TO_DEVICE
from hybridmon.agent.alerts.weight_offload import Detector as WeightOffloadDetector
from hybridmon.exporters import process as process_metrics
from hybridmon.exporters.gpu import PCIE_BYTES
from hybridmon.exporters.inference_names import OFFLOAD_BYTES
from hybridmon.exporters.process import TREE_ROOT
from tests.support.detector_history import (
    GIB,
    T0,
    THRESHOLDS,
    VLLM_ENDPOINT,
    VLLM_ON_GPU0,
    Trace,
    alertnames,
    assert_says_its_rules_words,
    gpus_over_time,
    only,
    servers_over_time,
)
from tests.support.promtool_cases import GPU0, GPU1, GPU2, GPU3, Test, firing, not_yet
from tests.support.promtool_inputs import (
    LLAMA,
    LLAMA_SERVER,
    SGLANG,
    SGLANG_SERVER,
    VLLM,
    VLLM_SERVER,
    on_gpu,
    served,
)

WEIGHTS = THRESHOLDS.weight_offload

SECOND_ENDPOINT = "http://127.0.0.1:8001/metrics"



def trees(roots: dict[str, str]):
    return lambda t: [(process_metrics.TREE_ROOT, 1, pid, "python3", root) for pid, root in roots.items()]


def weights_trace(h2d, processes, *specs, roots=None):
    """Every pid watched, each the root of its own tree unless `roots` says otherwise."""
    trace = Trace()
    pids = {spec["pid"] for spec in specs if spec["pid"]} | {pid for on in processes.values() for pid in on}
    collectors = {"gpu": gpus_over_time(h2d, processes), "inference": servers_over_time(*specs),
                  "process": trees({**{pid: pid for pid in pids}, **(roots or {})})}
    now = trace.run(T0, T0 + 120, **collectors)
    return WeightOffloadDetector(WEIGHTS).evaluate(trace.history, now)



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
    now = trace.run(T0, T0 + 120, gpu=gpus_over_time({"0": 20e9}, VLLM_ON_GPU0),
                    inference=servers_over_time({"pid": "4242", "tokens": 120}))
    assert WeightOffloadDetector(WEIGHTS).evaluate(trace.history, now) == []


# --- its rule's promtool cases ------------------------------------------------------------------


def _h2d(test: Test, gpu: dict, before: float, after: float) -> None:
    test.counter(PCIE_BYTES.name, before, after, direction=HOST_TO_DEVICE, **gpu)


def weights_cross_case(t, catalog) -> Test:
    """GPU 0: vLLM (pid 4242) at 120 tokens/s with 20 GB/s in, no KV connector: 167 MB a token,
    fires. GPU 1: SGLang loads 15 GB/s of prefix KV of the 16 GB/s in at 200 tokens/s: 5 MB
    unexplained a token, silent. GPUs 2-3: a TP=2 vLLM whose listening pid (7000) holds no GPU
    memory, its workers 7001 and 7002 one GPU each, 6 GB/s in on each at 100 tokens/s: 120 MB a
    token over both, fires. llama.cpp (pid 5151) shares GPU 1 with SGLang at 0.5 tokens/s. Before
    the onset every GPU idles at 0.1 GB/s in with the same tokens/s (every server silent)."""
    s = t.weight_offload
    rule = catalog.find("InferenceWeightsCrossingBus")
    tp_server = served(VLLM_SERVER, "7000", "http://127.0.0.1:8001/metrics")
    test = Test("weights crossing the bus: vLLM with cpu_offload_gb and a TP=2 vLLM fire; SGLang "
                "loading prefix KV and an idle llama.cpp stay silent", firing(s.for_seconds) + 120, catalog)
    for gpu, after in ((GPU0, 20e9), (GPU1, 16e9), (GPU2, 6e9), (GPU3, 6e9)):
        _h2d(test, gpu, 0.1e9, after)
    on_gpu(test, GPU0, VLLM, 10e9)
    on_gpu(test, GPU1, SGLANG, 30e9)
    on_gpu(test, GPU1, LLAMA, 4e9)
    for pid, gpu in (("7001", GPU2), ("7002", GPU3)):
        on_gpu(test, gpu, {"pid": pid, "process_name": "VLLM::Worker"}, 30e9)
    for pid in ("7000", "7001", "7002"):
        test.constant(TREE_ROOT.name, 1, pid=pid, process_name="python3", root_pid="7000")
    for process in (VLLM, SGLANG, LLAMA):   # each the root of its own tree
        test.constant(TREE_ROOT.name, 1, **process, root_pid=process["pid"])
    for labels, tokens in ((served(VLLM_SERVER, VLLM["pid"]), 120), (served(SGLANG_SERVER, SGLANG["pid"]), 200),
                           (served(LLAMA_SERVER, LLAMA["pid"]), 0.5), (tp_server, 100)):
        test.counter(GENERATED_TOKENS.name, tokens, tokens, **labels)
    test.counter(OFFLOAD_BYTES.name, 0, 15e9, direction="load", **served(SGLANG_SERVER, SGLANG["pid"]))
    test.expect(not_yet(s.for_seconds), rule.alert)
    test.expect(firing(s.for_seconds), rule.alert,
                test.alert(rule, VLLM_SERVER, value=20e9 / 120, tokens=120),
                test.alert(rule, {k: v for k, v in tp_server.items() if k != "pid"},
                           value=12e9 / 100, tokens=100))
    return test


def promtool_cases(t, catalog) -> list[Test]:
    return [weights_cross_case(t, catalog)]
