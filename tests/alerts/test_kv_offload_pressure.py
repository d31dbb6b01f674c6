"""The tests of the kv_offload_pressure alert family (agent/alerts/kv_offload_pressure.py): its rule's promtool cases
(`promtool_cases`, written to rules/tests/generated_kv_offload_pressure.yml by `python -m tests.rules.generate`
and run by promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

from hybridmon.agent.alerts.kv_offload_pressure import KV_CACHE_USAGE, PREEMPTIONS
from hybridmon.exporters.bench import MEASURED_CAPACITY
from hybridmon.exporters.inference_names import OFFLOAD_BYTES
from hybridmon.rules import inference as recorded

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


def promtool_cases(t, catalog) -> list[Test]:
    return [kv_cache_full_case(t, catalog), offload_link_case(t, catalog)]
