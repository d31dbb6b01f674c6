"""The tests of the weight_offload alert family (agent/alerts/weight_offload.py): its detector, on
histories written sample by sample, and its rule's promtool cases (`promtool_cases`, written
to rules/tests/generated_weight_offload.yml by `python -m tests.rules.generate` and run by
promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

import pytest

from hybridmon.agent.alerts.weight_offload import GENERATED_TOKENS, HOST_TO_DEVICE, RUNNING
from hybridmon.agent.detectors.links import KV_OFFLOAD, UNATTRIBUTED
from hybridmon.agent.detectors.links import WEIGHTS as WEIGHTS_CAUSE
from hybridmon.agent.alerts.weight_offload import Detector as WeightOffloadDetector
from hybridmon.exporters import process as process_metrics
from hybridmon.exporters.gpu import PCIE_BYTES
from hybridmon.exporters.inference_names import BY_FIELD, OFFLOAD_BYTES
from hybridmon.exporters.process import WEIGHTS_OFFLOAD
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
    gpus_over_time,
    only,
    servers_over_time,
    tree_info,
)
from tests.support.promtool_cases import GPU0, GPU1, GPU2, GPU3, Test, firing, not_yet
from tests.support.promtool_inputs import (
    LLAMA,
    LLAMA_SERVER,
    SGLANG,
    SGLANG_SERVER,
    VLLM,
    VLLM_SERVER,
    in_tree,
    on_gpu,
    served,
)

WEIGHTS = THRESHOLDS.weight_offload

SECOND_ENDPOINT = "http://127.0.0.1:8001/metrics"



def trees(roots: dict[str, str], offload: dict[str, float]):
    """The process collector's rows: tree roots, and --cpu-offload-gb's bytes per GPU by pid."""
    return lambda t: ([tree_info(pid, "python3", root) for pid, root in roots.items()]
                      + [(process_metrics.WEIGHTS_OFFLOAD, offloaded, pid, "python3")
                         for pid, offloaded in offload.items()])


def weights_run(h2d, processes, *specs, roots=None, offload=None, extra=None, bench=None, gpu_extra=None):
    """Every pid watched, each the root of its own tree unless `roots` says otherwise; `offload`:
    pid -> the bytes per GPU its command line keeps on the host; `gpu_extra`: more gpu collector
    rows at t. (detector, its findings)."""
    trace = Trace()
    pids = {spec["pid"] for spec in specs if spec["pid"]} | {pid for on in processes.values() for pid in on}
    servers = servers_over_time(*specs)
    gpus = gpus_over_time(h2d, processes)
    collectors = {"gpu": (lambda t: gpus(t) + gpu_extra(t)) if gpu_extra else gpus,
                  "inference": (lambda t: servers(t) + extra(t)) if extra else servers,
                  "process": trees({**{pid: pid for pid in pids}, **(roots or {})}, offload or {})}
    if bench is not None:
        collectors["bench"] = bench
    now = trace.run(T0, T0 + 120, **collectors)
    detector = WeightOffloadDetector(WEIGHTS)
    return detector, detector.evaluate(trace.history, now)


def weights_trace(h2d, processes, *specs, roots=None, offload=None):
    return weights_run(h2d, processes, *specs, roots=roots, offload=offload)[1]


VLLM_OFFLOADS_12_GIB = {"4242": 12 * GIB}


def test_weights_crossing_every_step_fire_with_bytes_per_token():
    # vllm#57771's shape: 120 tokens/s while the GPU takes 20 GB/s from the host, with 12 GiB of
    # weights per GPU left on the host: at 8 running requests a token may need 1.6 GB of them
    findings = weights_trace({"0": 20e9}, VLLM_ON_GPU0, {"pid": "4242", "tokens": 120},
                             offload=VLLM_OFFLOADS_12_GIB)
    finding = only(findings, "InferenceWeightsCrossingBus")
    assert finding.labels == {"server": "vllm", "endpoint": VLLM_ENDPOINT, "model": "llama-3-8b"}
    assert finding.value == pytest.approx(20e9 / 120, rel=0.01)
    assert finding.details["gpus"] == "0"
    assert finding.details["weights_bytes_per_token_at_most"] == pytest.approx(12 * GIB / 8)
    assert "--cpu-offload-gb" in finding.description
    assert_says_its_rules_words(finding)


def test_traffic_without_weight_offload_evidence_is_unattributed_never_weights():
    # the same 20 GB/s at 120 tokens/s, but no --cpu-offload-gb: LMCache's CPU tier, a V0 swap
    # space or another process could move it; the account says so, the alert stays silent
    detector, findings = weights_run({"0": 20e9}, VLLM_ON_GPU0, {"pid": "4242", "tokens": 120})
    assert findings == []
    (account,) = detector.figures.values()
    assert account.causes[HOST_TO_DEVICE][UNATTRIBUTED] == pytest.approx(20e9, rel=0.01)
    assert account.causes[HOST_TO_DEVICE][WEIGHTS_CAUSE] == 0.0


def test_weights_are_claimed_only_up_to_what_the_offloaded_bytes_can_need():
    # 1 GiB per GPU offloaded, 64 requests running: a step reads 1 GiB for 64 tokens, 16.8 MB a
    # token, under the 32 MiB bound, though 167 MB a token arrive: the rest is not weights
    detector, findings = weights_run({"0": 20e9}, VLLM_ON_GPU0, {"pid": "4242", "tokens": 120, "running": 64},
                                     offload={"4242": GIB})
    assert findings == []
    (account,) = detector.figures.values()
    steps_per_second = 120 / 64
    assert account.causes[HOST_TO_DEVICE][WEIGHTS_CAUSE] == pytest.approx(GIB * steps_per_second, rel=0.02)
    assert account.causes[HOST_TO_DEVICE][UNATTRIBUTED] == pytest.approx(20e9 - GIB * steps_per_second, rel=0.02)
    # 4 GiB at 8 running: 537 MB a token at most, so the 167 MB measured are all weights
    detector, findings = weights_run({"0": 20e9}, VLLM_ON_GPU0, {"pid": "4242", "tokens": 120},
                                     offload={"4242": 4 * GIB})
    assert only(findings, "InferenceWeightsCrossingBus").value == pytest.approx(20e9 / 120, rel=0.01)
    # 3 GiB at 64 running: 48 MiB a token at most, over 32 MiB though under the 167 MB measured:
    # fires at the bound
    findings = weights_trace({"0": 20e9}, VLLM_ON_GPU0, {"pid": "4242", "tokens": 120, "running": 64},
                             offload={"4242": 3 * GIB})
    assert only(findings, "InferenceWeightsCrossingBus").value == pytest.approx(3 * GIB / 64)


def test_kv_loads_the_server_reports_explain_their_traffic():
    # a KV offload connector reloading prefix KV: 19.5 of the 20 GB/s are its own loads
    detector, findings = weights_run({"0": 20e9}, VLLM_ON_GPU0, {"pid": "4242", "tokens": 120, "loads": 19.5e9},
                                     offload=VLLM_OFFLOADS_12_GIB)
    assert alertnames(findings) == []
    (account,) = detector.figures.values()
    assert account.causes[HOST_TO_DEVICE][KV_OFFLOAD] == pytest.approx(19.5e9, rel=0.01)
    assert account.causes[HOST_TO_DEVICE][WEIGHTS_CAUSE] == pytest.approx(0.5e9, rel=0.05)
    # ...but loads on another GPU explain nothing here
    findings = weights_trace({"0": 20e9, "1": 20e9},
                             {"0": {"4242": ("python3", 20 * GIB)}, "1": {"5151": ("python3", 20 * GIB)}},
                             {"pid": "4242", "tokens": 120},
                             {"pid": "5151", "tokens": 120, "loads": 19.5e9, "endpoint": SECOND_ENDPOINT},
                             offload={"4242": 12 * GIB, "5151": 12 * GIB})
    assert [f.labels["endpoint"] for f in findings] == [VLLM_ENDPOINT]


def test_kv_moved_over_nvlink_c2c_is_not_called_pcie_traffic():
    """A GH200 (issue 29; simulated): vLLM loads 100 GB/s of KV over C2C while the PCIe link
    carries the driver's 50 MB/s. Without C2C mode the account would credit KV with those 50 MB/s
    of PCIe; in C2C mode it credits KV and weights with none of them, leaves them unattributed, and
    its first lead says where the KV went."""
    on_c2c = lambda t: c2c_rows("0", "GPU-0", links={"0": (1, 450e9)}, h2d=100e9, d2h=2e9)
    detector, findings = weights_run({"0": 5e7}, VLLM_ON_GPU0, {"pid": "4242", "tokens": 120, "loads": 100e9},
                                     offload=VLLM_OFFLOADS_12_GIB, gpu_extra=on_c2c)
    assert alertnames(findings) == []
    (account,) = detector.figures.values()
    assert account.causes[HOST_TO_DEVICE][KV_OFFLOAD] == 0.0 and account.causes[HOST_TO_DEVICE][WEIGHTS_CAUSE] == 0.0
    assert account.causes[HOST_TO_DEVICE][UNATTRIBUTED] == pytest.approx(5e7, rel=0.01)
    assert "NVLink-C2C mode" in account.leads[0] and "credits none of them" in account.leads[0]
    pcie = weights_run({"0": 5e7}, VLLM_ON_GPU0, {"pid": "4242", "tokens": 120, "loads": 100e9},
                       offload=VLLM_OFFLOADS_12_GIB)[0]
    (on_pcie,) = pcie.figures.values()
    assert on_pcie.causes[HOST_TO_DEVICE][KV_OFFLOAD] == pytest.approx(5e7, rel=0.01)
    assert not any("C2C" in lead for lead in on_pcie.leads)


def test_idle_or_quiet_servers_are_silent():
    per_token = WEIGHTS.unexplained_bytes_per_token_above
    offload = VLLM_OFFLOADS_12_GIB
    # below a token a second (an idle server with a busy link)
    assert weights_trace({"0": 20e9}, VLLM_ON_GPU0, {"pid": "4242", "tokens": 0.5}, offload=offload) == []
    # many bytes per token but too little traffic to matter
    assert weights_trace({"0": 0.5e9}, VLLM_ON_GPU0, {"pid": "4242", "tokens": 2}, offload=offload) == []
    # enough traffic, under the bound per token
    assert weights_trace({"0": 2e9}, VLLM_ON_GPU0, {"pid": "4242", "tokens": 2e9 / per_token * 1.2},
                         offload=offload) == []


def test_tensor_parallel_workers_count_for_the_server_that_listens():
    # vLLM TP=2: the API server (7000, whose command line has --cpu-offload-gb) holds no GPU
    # memory, its workers 7001 and 7002 one GPU each; each GPU receives its shard of the weights
    # per step: 6 GB/s each at 100 tokens/s in all.
    tp = {"0": {"7001": ("VLLM::Worker", 30 * GIB)}, "1": {"7002": ("VLLM::Worker", 30 * GIB)}}
    findings = weights_trace({"0": 6e9, "1": 6e9}, tp, {"pid": "7000", "tokens": 100},
                             roots={"7000": "7000", "7001": "7000", "7002": "7000"}, offload={"7000": 8 * GIB})
    finding = only(findings, "InferenceWeightsCrossingBus")
    assert finding.value == pytest.approx(12e9 / 100, rel=0.01)
    assert finding.details["gpus"] == "0,1"
    # workers whose parent is not watched are roots of their own: the server's GPUs are unknown
    assert weights_trace({"0": 6e9, "1": 6e9}, tp, {"pid": "7000", "tokens": 100}, offload={"7000": 8 * GIB}) == []


def test_servers_sharing_a_gpu_share_its_traffic_per_token():
    both_on_gpu0 = {"0": {"4242": ("python3", 20 * GIB), "5151": ("python3", 20 * GIB)}}
    fast = {"pid": "5151", "tokens": 3000, "endpoint": SECOND_ENDPOINT}
    offload = {"4242": 12 * GIB, "5151": 12 * GIB}
    # 20 GB/s over 3,100 tokens/s is 6.5 MB a token (20 GB/s / 100 alone would be 200 MB): silent
    assert weights_trace({"0": 20e9}, both_on_gpu0, {"pid": "4242", "tokens": 100}, fast, offload=offload) == []
    # 20 GB/s over 500 tokens/s is 40 MB a token: both are named, the traffic is the GPU's
    findings = weights_trace({"0": 20e9}, both_on_gpu0, {"pid": "4242", "tokens": 100}, {**fast, "tokens": 400},
                             offload=offload)
    assert sorted(f.labels["endpoint"] for f in findings) == [VLLM_ENDPOINT, SECOND_ENDPOINT]
    assert all(f.value == pytest.approx(20e9 / 500, rel=0.01) for f in findings)


def test_a_server_on_no_gpu_the_agent_sees_is_not_judged():
    offload = VLLM_OFFLOADS_12_GIB
    assert weights_trace({"0": 20e9}, {}, {"pid": "4242", "tokens": 120}, offload=offload) == []
    assert weights_trace({"0": 20e9}, VLLM_ON_GPU0, {"pid": "", "tokens": 120}, offload=offload) == []
    # a pid the process collector does not watch (no tree info)
    trace = Trace()
    now = trace.run(T0, T0 + 120, gpu=gpus_over_time({"0": 20e9}, VLLM_ON_GPU0),
                    inference=servers_over_time({"pid": "4242", "tokens": 120}))
    assert WeightOffloadDetector(WEIGHTS).evaluate(trace.history, now) == []


def _server_rows(field: str, value: float, pid: str = "4242", server: str = "vllm"):
    return lambda t: [(BY_FIELD[field], value, server, VLLM_ENDPOINT, "llama-3-8b", pid)]


@pytest.mark.parametrize("extra, lead", [
    # LMCache in vLLM's process: its series come from the same /metrics (exporters/inference_
    # formats.py joins them to vLLM's model), tokens only, no bytes (lmcache/observability.py)
    (_server_rows("prefix_cache_hit_tokens", 1e6, server="lmcache"), "LMCache runs in"),
    (_server_rows("kv_offload_in_lmcache", 1), "LMCache's server"),
    (_server_rows("requests_swapped", 12), "12 requests' KV in its CPU swap space"),
    (_server_rows("kv_offload_host_tier_bytes", 64 * GIB), "publishes no byte counter"),
    (_server_rows("model_host_memory_bytes", 6 * GIB, server="ollama"), "6.0 GiB of its model in host memory"),
])
def test_unattributed_traffic_comes_with_what_would_attribute_it(extra, lead):
    detector, findings = weights_run({"0": 20e9}, VLLM_ON_GPU0, {"pid": "4242", "tokens": 120}, extra=extra)
    assert findings == []
    (account,) = detector.figures.values()
    assert account.causes[HOST_TO_DEVICE][UNATTRIBUTED] == pytest.approx(20e9, rel=0.01)
    assert any(lead in text for text in account.leads), account.leads


def test_a_benchmark_run_within_the_minute_is_a_lead_one_before_it_is_not():
    # the run finished 20 s before the evaluation (T0 + 120): its copies are in the minute judged
    recent = lambda t: bench_rows("0", "GPU-0", finished_at=T0 + 100) if t >= T0 + 100 else []
    detector, findings = weights_run({"0": 20e9}, VLLM_ON_GPU0, {"pid": "4242", "tokens": 120}, bench=recent)
    (account,) = detector.figures.values()
    assert findings == [] and any("hybridmon bench finished a run on this GPU 20 s ago" in text
                                  for text in account.leads), account.leads
    # an hour-old run moved nothing in this minute
    detector, _ = weights_run({"0": 20e9}, VLLM_ON_GPU0, {"pid": "4242", "tokens": 120},
                              bench=lambda t: bench_rows("0", "GPU-0"))
    (account,) = detector.figures.values()
    assert account.leads == ()


def test_a_connector_that_counts_its_bytes_leaves_no_lead():
    extra = _server_rows("kv_offload_host_tier_bytes", 64 * GIB)
    detector, _ = weights_run({"0": 20e9}, VLLM_ON_GPU0, {"pid": "4242", "tokens": 120, "loads": 4e9}, extra=extra)
    (account,) = detector.figures.values()
    assert account.leads == ()
    assert account.causes[HOST_TO_DEVICE][KV_OFFLOAD] == pytest.approx(4e9, rel=0.01)


# --- its rule's promtool cases ------------------------------------------------------------------


def _h2d(test: Test, gpu: dict, before: float, after: float) -> None:
    test.counter(PCIE_BYTES.name, before, after, direction=HOST_TO_DEVICE, **gpu)


def weights_cross_case(t, catalog, *, evidence: bool = True) -> Test:
    """GPU 0: vLLM (pid 4242, --cpu-offload-gb 12, 8 running) at 120 tokens/s with 20 GB/s in, no
    KV connector: 167 MB a token, within the 1.6 GB its offload can need, fires at 167 MB. GPU 1:
    SGLang loads 15 GB/s of prefix KV of the 16 GB/s in at 200 tokens/s: 5 MB unexplained a
    token, silent. GPUs 2-3: a TP=2 vLLM whose listening pid (7000, --cpu-offload-gb 0.25, 8
    running) holds no GPU memory, its workers 7001 and 7002 one GPU each, 6 GB/s in on each at
    100 tokens/s: 120 MB a token over both, but its offload can need only 0.25 GiB x 2 / 8 = 67 MB
    a token: fires at that bound. llama.cpp (pid 5151) shares GPU 1 with SGLang at 0.5 tokens/s.
    Before the onset every GPU idles at 0.1 GB/s in with the same tokens/s (every server silent).
    Without `evidence` (no --cpu-offload-gb anywhere) the same traffic fires nothing."""
    s = t.weight_offload
    rule = catalog.find("InferenceWeightsCrossingBus")
    tp_server = served(VLLM_SERVER, "7000", "http://127.0.0.1:8001/metrics")
    name = ("weights crossing the bus: vLLM with cpu_offload_gb and a TP=2 vLLM fire; SGLang loading "
            "prefix KV and an idle llama.cpp stay silent" if evidence else
            "the same traffic without --cpu-offload-gb on any server: unattributed, nothing fires")
    test = Test(name, firing(s.for_seconds) + 120, catalog)
    for gpu, after in ((GPU0, 20e9), (GPU1, 16e9), (GPU2, 6e9), (GPU3, 6e9)):
        _h2d(test, gpu, 0.1e9, after)
    on_gpu(test, GPU0, VLLM, 10e9)
    on_gpu(test, GPU1, SGLANG, 30e9)
    on_gpu(test, GPU1, LLAMA, 4e9)
    for pid, gpu in (("7001", GPU2), ("7002", GPU3)):
        on_gpu(test, gpu, {"pid": pid, "process_name": "VLLM::Worker"}, 30e9)
    for pid in ("7000", "7001", "7002"):
        in_tree(test, {"pid": pid, "process_name": "python3"}, {"pid": "7000"})
    for process in (VLLM, SGLANG, LLAMA):   # each the root of its own tree
        in_tree(test, process, process)
    for labels, tokens in ((served(VLLM_SERVER, VLLM["pid"]), 120), (served(SGLANG_SERVER, SGLANG["pid"]), 200),
                           (served(LLAMA_SERVER, LLAMA["pid"]), 0.5), (tp_server, 100)):
        test.counter(GENERATED_TOKENS.name, tokens, tokens, **labels)
    for labels in (served(VLLM_SERVER, VLLM["pid"]), tp_server):
        test.constant(RUNNING.name, 8, **labels)
    test.counter(OFFLOAD_BYTES.name, 0, 15e9, direction="load", **served(SGLANG_SERVER, SGLANG["pid"]))
    test.expect(not_yet(s.for_seconds), rule.alert)
    if not evidence:
        test.expect(firing(s.for_seconds), rule.alert)
        return test
    test.constant(WEIGHTS_OFFLOAD.name, 12 * GIB, **VLLM)
    test.constant(WEIGHTS_OFFLOAD.name, GIB / 4, pid="7000", process_name="python3")
    test.expect(firing(s.for_seconds), rule.alert,
                test.alert(rule, VLLM_SERVER, value=20e9 / 120, tokens=120),
                test.alert(rule, {k: v for k, v in tp_server.items() if k != "pid"},
                           value=GIB / 4 * 2 / 8, tokens=100))
    return test


def promtool_cases(t, catalog) -> list[Test]:
    return [weights_cross_case(t, catalog), weights_cross_case(t, catalog, evidence=False)]
