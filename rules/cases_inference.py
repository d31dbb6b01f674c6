"""promtool tests for the inference-server rules (see rules.scenarios for the timing)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the schema is built from the families, which import these rules
    from hybridmon.agent.alerts.catalogue import Thresholds

from hybridmon.rules import inference
from hybridmon.rules.cases_gpu import capacity, link
from hybridmon.rules.cases_process import on_gpu
from hybridmon.rules.cases_host import LLAMA, VLLM
from hybridmon.rules.scenarios import BEFORE_SAMPLES, GPU0, GPU1, Catalog, Test, above, firing, not_yet

VLLM_SERVER = {"server": "vllm", "endpoint": "http://127.0.0.1:8000/metrics", "model": "llama-3-8b"}
SGLANG_SERVER = {"server": "sglang", "endpoint": "http://127.0.0.1:30000/metrics", "model": "qwen2"}
LLAMA_SERVER = {"server": "llamacpp", "endpoint": "http://127.0.0.1:8080/metrics", "model": ""}
TOKENS = "hybridmon_inference_generated_tokens_total"
RUNNING = "hybridmon_inference_requests_running"


def served(server: dict, pid: str, endpoint: str | None = None) -> dict:
    """The labels of one server's series: server, endpoint, model, pid."""
    return {**server, **({"endpoint": endpoint} if endpoint else {}), "pid": pid}


def stepped_counter(test: Test, change_at: int, before: float, after: float) -> list[float]:
    """A counter rising `before` per second until `change_at` seconds, `after` per second since."""
    values, total = [], 0.0
    for index in range(test.samples):
        if index:
            total += (before if index * test.interval <= change_at else after) * test.interval
        values.append(total)
    return values


def stepped(test: Test, change_at: int, before: float, after: float) -> list[float]:
    return [before if index * test.interval <= change_at else after for index in range(test.samples)]


def throughput_decay(t: Thresholds, catalog: Catalog) -> Test:
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
    load, per_request = 8.0, 60.0
    for labels, after, running_after in (
            (served(VLLM_SERVER, VLLM["pid"]), 1 - decay, load),
            (served(SGLANG_SERVER, "6161"), 1 - decay, load / 2),
            (served(LLAMA_SERVER, LLAMA["pid"]), 1 - d.decay_share / 2, load)):
        test.values(TOKENS, stepped_counter(test, change, per_request * load,
                                            per_request * after * running_after), **labels)
        test.values(RUNNING, stepped(test, change, load, running_after), **labels)
    test.expect(change + active + int(d.for_seconds) - 120, rule.alert)
    test.expect(at, rule.alert, test.alert(
        rule, VLLM_SERVER, value=decay, after=per_request * (1 - decay), before=per_request,
        running_now=load, running_then=load))
    return test


def kv_cache_full(t: Thresholds, catalog: Catalog) -> Test:
    k = t.kv_offload_pressure
    rule = catalog.find("InferenceKvOffloadPressure", reason="kv_cache_full")
    full, preempting = above(k.kv_cache_usage_at_least), k.preemptions_per_second_above + 0.5
    test = Test("KV cache full: vLLM fills and preempts; SGLang is full without preempting and "
                "llama.cpp preempts below the threshold: both silent", firing(k.for_seconds) + 120, catalog)
    for labels, usage, preemptions in (
            (served(VLLM_SERVER, VLLM["pid"]), (0.5, full), preempting),
            (served(SGLANG_SERVER, "6161"), (full, full), 0.0),
            (served(LLAMA_SERVER, LLAMA["pid"]), (0.5, k.kv_cache_usage_at_least - 0.05), preempting)):
        test.gauge("hybridmon_inference_kv_cache_usage_ratio", *usage, **labels)
        test.counter("hybridmon_inference_preemptions_total", 0, preemptions, **labels)
    test.expect(not_yet(k.for_seconds), rule.alert)
    test.expect(firing(k.for_seconds), rule.alert,
                test.alert(rule, VLLM_SERVER, value=full, preemptions=preempting))
    return test


def offload_link(t: Thresholds, catalog: Catalog) -> Test:
    """GPU 0 (python3, pid 4242) at its theoretical Gen4 x16 rate; GPU 1 (llama-server, pid 5151)
    measured by hybridmon bench at half of it. A server tied to no process is judged against both."""
    k = t.kv_offload_pressure
    rule = catalog.find("InferenceKvOffloadPressure", reason="offload_link")
    share = above(k.offload_load_share_of_capacity)
    full, measured = capacity(4, 16), capacity(4, 16) / 2
    second_vllm = served(VLLM_SERVER, LLAMA["pid"], "http://127.0.0.1:8001/metrics")
    quiet_vllm = served(VLLM_SERVER, VLLM["pid"], "http://127.0.0.1:8002/metrics")
    test = Test("KV offload loads: vLLM on GPU 0 past the share of its link, a second vLLM past the "
                "share of GPU 1's measured capacity; SGLang, tied to no process, is judged against "
                "both GPUs and a third vLLM stays under: both silent", firing(k.for_seconds) + 120, catalog)
    for gpu in (GPU0, GPU1):
        link(test, gpu, 4, 16)
    for direction in ("host_to_device", "device_to_host"):
        test.constant("hybridmon_gpu_pcie_measured_capacity_bytes_per_second", measured,
                      direction=direction, **GPU1)
    on_gpu(test, GPU0, VLLM, 20e9)
    on_gpu(test, GPU1, LLAMA, 8e9)
    servers = ((served(VLLM_SERVER, VLLM["pid"]), share * full), (second_vllm, share * measured),
               (served(SGLANG_SERVER, ""), share * full),
               (quiet_vllm, (k.offload_load_share_of_capacity - 0.05) * full))
    for labels, loads in servers:
        test.counter("hybridmon_inference_kv_offload_bytes_total", 0, loads, direction="load", **labels)
    test.expect_samples(60, inference.SERVER_CAPACITY, *(
        (labels, full + measured if labels["pid"] == "" else
         measured if labels["pid"] == LLAMA["pid"] else full) for labels, _ in servers))
    test.expect(not_yet(k.for_seconds), rule.alert)
    test.expect(firing(k.for_seconds), rule.alert,
                test.alert(rule, VLLM_SERVER, value=share, loads=share * full, capacity=full),
                test.alert(rule, {k2: v for k2, v in second_vllm.items() if k2 != "pid"},
                           value=share, loads=share * measured, capacity=measured))
    return test


def scrape_failing(t: Thresholds, catalog: Catalog) -> Test:
    wait = t.inference_scrape.for_seconds
    rule = catalog.find("InferenceServerScrapeFailing")
    test = Test("scrape failing: vLLM's endpoint answers HTML from the onset; llama.cpp's times out "
                "once", firing(wait) + 120, catalog)
    vllm, llama = VLLM_SERVER["endpoint"], LLAMA_SERVER["endpoint"]
    test.gauge("hybridmon_inference_scrape_success", 1, 0, endpoint=vllm)
    test.gauge("hybridmon_inference_scrape_error", None, 1, endpoint=vllm, reason="not_prometheus")
    test.constant("hybridmon_inference_scrape_success", 1, endpoint=llama)
    rest = test.samples - BEFORE_SAMPLES - 1
    test.add("hybridmon_inference_scrape_error", f"_x{BEFORE_SAMPLES} 1 stale _x{rest - 1}",
             endpoint=llama, reason="timeout")
    test.expect(not_yet(wait), rule.alert)
    test.expect(firing(wait), rule.alert,
                test.alert(rule, {"endpoint": vllm, "reason": "not_prometheus"}))
    return test


def files(t: Thresholds, catalog: Catalog) -> dict[str, list[Test]]:
    return {"inference": [throughput_decay(t, catalog), kv_cache_full(t, catalog),
                          offload_link(t, catalog), scrape_failing(t, catalog)]}
