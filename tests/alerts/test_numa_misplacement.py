"""The tests of the numa_misplacement alert family (agent/alerts/numa_misplacement.py): its rule's promtool cases
(`promtool_cases`, written to rules/tests/generated_numa_misplacement.yml by `python -m tests.rules.generate`
and run by promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

from hybridmon.agent.alerts.numa_misplacement import cpu_limit
from hybridmon.exporters.gpu import GPU_INFO, NUMA_NODE
from hybridmon.exporters.numa import (
    NODE_CPUS,
    NODE_MEMORY_TOTAL,
    PROCESS_ALLOWED_CPUS_ON_NODE,
    PROCESS_CPU_SECONDS_ON_NODE,
    PROCESS_NUMA_RESIDENT,
)
from hybridmon.exporters.pcie import DEVICE_NUMA_NODE
from hybridmon.exporters.process import ALLOWED_CPUS
from hybridmon.rules import process as recorded

from tests.support.promtool_cases import (
    BUS0,
    BUS1,
    GIB,
    GPU0,
    GPU1,
    HOST,
    Catalog,
    Test,
    firing,
    not_yet,
)
from tests.support.promtool_inputs import HOST2, LLAMA, SGLANG, VLLM, on_gpu


def _misplaced_cpus_and_memory(t, catalog: Catalog) -> Test:
    n = t.numa_misplacement
    cpus_rule = catalog.find("InferenceProcessNumaMisplaced", reason="cpus")
    memory_rule = catalog.find("InferenceProcessNumaMisplaced", reason="memory")
    at = firing(n.for_seconds)
    limit = cpu_limit(n, 2)
    mapped = 12 * GIB
    test = Test("NUMA: python3 (pid 4242) on GPU 0 (node 0 per sysfs) is moved to node 1's CPUs; "
                "llama-server (pid 5151) on GPU 1 (node 1 per sysfs, NVML silent) gets its memory "
                "on node 0; sglang (pid 6161) on GPU 0 runs unpinned, the default layout: it may "
                "use all 16 CPUs, half of them remote, its threads run half, then 70 %, of their time "
                "on node 1 and its memory is 97 % local, then exactly half remote, and it stays "
                "silent; NVML's GPU-memory node 4 (Grace-like) is ignored; gpu-host-2 has one NUMA "
                "node and stays silent", at + 120, catalog)
    cores = 1.5
    for instance, nodes in ((HOST, ("0", "1")), (HOST2, ("0",))):
        for node in nodes:
            test.constant(NODE_MEMORY_TOTAL.name, 64 * GIB, instance, node=node)
            test.constant(NODE_CPUS.name, 8, instance, node=node)
        test.constant(NUMA_NODE.name, 4, instance, **GPU0)
        for gpu, bus in ((GPU0, BUS0), (GPU1, BUS1)):
            test.constant(GPU_INFO.name, 1, instance, **gpu, name="NVIDIA L40S", pci_bus_id=bus,
                          driver_version="550.54.15")
        # NVML names GPU 0's memory node 4 on purpose: only sysfs's nearest node counts
        test.constant(DEVICE_NUMA_NODE.name, 0, instance, pci_bus_id=BUS0)
        test.constant(DEVICE_NUMA_NODE.name, 1, instance, pci_bus_id=BUS1)
        on_gpu(test, GPU0, VLLM, 20 * GIB, instance)
        on_gpu(test, GPU1, LLAMA, 8 * GIB, instance)
        on_gpu(test, GPU0, SGLANG, 10 * GIB, instance)
        # python3: 8 CPUs, node 0's until the onset, node 1's after; its CPU time follows;
        # its memory stays put
        test.constant(ALLOWED_CPUS.name, 8, instance, **VLLM)
        test.gauge(PROCESS_ALLOWED_CPUS_ON_NODE.name, 8, 0, instance, **VLLM, node="0")
        test.gauge(PROCESS_ALLOWED_CPUS_ON_NODE.name, 0, 8, instance, **VLLM, node="1")
        test.counter(PROCESS_CPU_SECONDS_ON_NODE.name, cores, 0, instance, **VLLM, node="0")
        test.counter(PROCESS_CPU_SECONDS_ON_NODE.name, 0, cores, instance, **VLLM, node="1")
        test.constant(PROCESS_NUMA_RESIDENT.name, 0.97 * mapped, instance, **VLLM, node="0")
        test.constant(PROCESS_NUMA_RESIDENT.name, 0.03 * mapped, instance, **VLLM, node="1")
        # llama-server: CPUs and CPU time on node 1 throughout; memory moves to node 0 at the onset
        test.constant(ALLOWED_CPUS.name, 8, instance, **LLAMA)
        test.constant(PROCESS_ALLOWED_CPUS_ON_NODE.name, 0, instance, **LLAMA, node="0")
        test.constant(PROCESS_ALLOWED_CPUS_ON_NODE.name, 8, instance, **LLAMA, node="1")
        test.counter(PROCESS_CPU_SECONDS_ON_NODE.name, 0, 0, instance, **LLAMA, node="0")
        test.counter(PROCESS_CPU_SECONDS_ON_NODE.name, 6, 6, instance, **LLAMA, node="1")
        test.gauge(PROCESS_NUMA_RESIDENT.name, 0.02 * mapped, 0.8 * mapped, instance, **LLAMA, node="0")
        test.gauge(PROCESS_NUMA_RESIDENT.name, 0.98 * mapped, 0.2 * mapped, instance, **LLAMA, node="1")
        # sglang, unpinned: all 16 CPUs allowed (half remote: the old rule fired on that); CPU
        # time 50/50, then 70 % remote (under the 2-node limit of 75 %); memory 97 % local, then
        # exactly half remote (not "mostly")
        test.constant(ALLOWED_CPUS.name, 16, instance, **SGLANG)
        for node in ("0", "1"):
            test.constant(PROCESS_ALLOWED_CPUS_ON_NODE.name, 8, instance, **SGLANG, node=node)
        test.counter(PROCESS_CPU_SECONDS_ON_NODE.name, 1.0, 0.6, instance, **SGLANG, node="0")
        test.counter(PROCESS_CPU_SECONDS_ON_NODE.name, 1.0, 1.4, instance, **SGLANG, node="1")
        test.gauge(PROCESS_NUMA_RESIDENT.name, 0.97 * mapped, 0.5 * mapped, instance, **SGLANG, node="0")
        test.gauge(PROCESS_NUMA_RESIDENT.name, 0.03 * mapped, 0.5 * mapped, instance, **SGLANG, node="1")
    test.expect_samples(60, recorded.GPU_NODE, (GPU0, 0), (GPU1, 1),
                        ({**GPU0, "instance": HOST2}, 0), ({**GPU1, "instance": HOST2}, 1))
    test.expect(not_yet(n.for_seconds), "InferenceProcessNumaMisplaced")
    test.expect(at, "InferenceProcessNumaMisplaced",
                test.alert(cpus_rule, {**VLLM, "gpu": "0"}, value=1, cpus=8, cores=cores, node=0,
                           limit=limit),
                test.alert(memory_rule, {**LLAMA, "gpu": "1"}, value=0.8, mapped=mapped, node=1))
    return test


def promtool_cases(t, catalog: Catalog) -> list[Test]:
    return [_misplaced_cpus_and_memory(t, catalog)]
