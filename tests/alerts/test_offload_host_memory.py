"""The tests of the offload_host_memory alert family (agent/alerts/offload_host_memory.py): its rule's promtool cases
(`promtool_cases`, written to rules/tests/generated_offload_host_memory.yml by `python -m tests.rules.generate`
and run by promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

from hybridmon.agent.alerts.offload_host_memory import HOST_TIER
from hybridmon.exporters.cgroup_memory import CGROUP_MEMORY_HEADROOM
from hybridmon.exporters.host_memory import MEMORY_AVAILABLE
from hybridmon.exporters.process import RESIDENT, TREE_ROOT

from tests.support.promtool_cases import GIB, HOST, Test, firing, not_yet
from tests.support.promtool_inputs import (
    HOST2,
    SGLANG,
    SGLANG_SERVER,
    VLLM,
    VLLM_SERVER,
    served,
)


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
        test.constant(TREE_ROOT.name, 1, instance, **labels, root_pid=labels["pid"])
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
