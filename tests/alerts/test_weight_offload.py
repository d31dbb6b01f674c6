"""The tests of the weight_offload alert family (agent/alerts/weight_offload.py): its rule's promtool cases
(`promtool_cases`, written to rules/tests/generated_weight_offload.yml by `python -m tests.rules.generate`
and run by promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

from hybridmon.agent.alerts.weight_offload import GENERATED_TOKENS, HOST_TO_DEVICE
from hybridmon.exporters.gpu import PCIE_BYTES
from hybridmon.exporters.inference_names import OFFLOAD_BYTES
from hybridmon.exporters.process import TREE_ROOT

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
