"""The tests of the offload_host_memory alert family (agent/alerts/offload_host_memory.py): its detector, on
histories written sample by sample, and its rule's promtool cases (`promtool_cases`, written
to rules/tests/generated_offload_host_memory.yml by `python -m tests.rules.generate` and run by
promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

import pytest

from hybridmon.agent.alerts.offload_host_memory import HOST_TIER
from hybridmon.agent.alerts.offload_host_memory import Detector as HostMemoryDetector
from hybridmon.exporters.cgroup_memory import CGROUP_MEMORY_HEADROOM
from hybridmon.exporters.host_memory import MEMORY_AVAILABLE
from hybridmon.exporters.process import RESIDENT
from tests.support.detector_history import (
    T0,
    THRESHOLDS,
    VLLM_ENDPOINT,
    Trace,
    alertnames,
    assert_says_its_rules_words,
    host_memory_rows,
    inference_rows,
    only,
    process_rows,
    tree_info,
)
from tests.support.promtool_cases import GIB, HOST, Test, firing, not_yet
from tests.support.promtool_inputs import (
    HOST2,
    SGLANG,
    SGLANG_SERVER,
    VLLM,
    VLLM_SERVER,
    in_tree,
    served,
)


def trees(roots: dict[str, str]):
    return lambda t: [tree_info(pid, "python3", root) for pid, root in roots.items()]


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


# --- its rule's promtool cases ------------------------------------------------------------------


def tier_case(t, catalog) -> Test:
    """gpu-host-1: vLLM (pid 4242) configured with a 100 GiB host tier (192 GiB with the overhead)
    holds 40 GiB resident; MemAvailable falls from 400 to 150 GiB at the onset (a neighbour
    grows): 152 GiB still to take is past 0.9 of 150 GiB, fires. Its cgroup leaves it 500 GiB:
    silent there. SGLang (pid 6161) with a 20 GiB tier holding 10 GiB: 28.4 GiB left, silent.
    gpu-host-2: vLLM with the tier already allocated (resident 200 GiB), 20 GiB available:
    nothing left to take, silent; a cgroup case on gpu-host-1's SGLang: its cgroup leaves 30 GiB
    after the onset, 28.4 GiB left to take fires reason cgroup."""
    s = t.offload_host_memory
    factor = s.pinned_overhead_factor
    test = Test("host memory for the KV tier: the rest of vLLM's tier will not fit once MemAvailable "
                "falls; SGLang's fits the host but not its cgroup; an allocated tier is silent",
                firing(s.for_seconds) + 120, catalog)
    test.gauge(MEMORY_AVAILABLE.name, 400 * GIB, 150 * GIB)
    test.constant(MEMORY_AVAILABLE.name, 20 * GIB, HOST2)
    for labels, tier, resident, headroom, instance in (
            (VLLM, 100 * GIB, 40 * GIB, (500 * GIB, 500 * GIB), HOST),
            (SGLANG, 20 * GIB, 10 * GIB, (400 * GIB, 30 * GIB), HOST),
            (VLLM, 100 * GIB, 200 * GIB, None, HOST2)):
        server = VLLM_SERVER if labels is VLLM else SGLANG_SERVER
        test.constant(HOST_TIER.name, tier, instance, **served(server, labels["pid"]))
        test.constant(RESIDENT.name, resident, instance, **labels)
        in_tree(test, labels, labels, instance)
        if headroom:
            test.gauge(CGROUP_MEMORY_HEADROOM.name, *headroom, instance, **labels)
    available_rule = catalog.find("InferenceOffloadHostMemoryShort", reason="memory_available")
    cgroup_rule = catalog.find("InferenceOffloadHostMemoryShort", reason="cgroup")
    vllm_left = 100 * GIB * factor - 40 * GIB
    sglang_left = 20 * GIB * factor - 10 * GIB
    test.expect(not_yet(s.for_seconds), "InferenceOffloadHostMemoryShort")
    test.expect(firing(s.for_seconds), "InferenceOffloadHostMemoryShort",
                test.alert(cgroup_rule, SGLANG_SERVER, value=sglang_left / (30 * GIB), tier=20 * GIB),
                test.alert(available_rule, VLLM_SERVER, value=vllm_left / (150 * GIB), tier=100 * GIB))
    return test


def promtool_cases(t, catalog) -> list[Test]:
    return [tier_case(t, catalog)]
