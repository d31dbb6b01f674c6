"""The tests of the numa_misplacement alert family (agent/alerts/numa_misplacement.py): its detector, on
histories written sample by sample, and its rule's promtool cases (`promtool_cases`, written
to rules/tests/generated_numa_misplacement.yml by `python -m tests.rules.generate` and run by
promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

import pytest

from hybridmon.agent.alerts import numa_misplacement
from hybridmon.agent.alerts.numa_misplacement import cpu_limit
from hybridmon.exporters.gpu import GPU_INFO, NUMA_NODE
from hybridmon.exporters.numa import (
    NODE_CPUS,
    NODE_MEMORY_TOTAL,
    PROCESS_CPU_SECONDS_OFF_GPU_NODE,
    PROCESS_RESIDENT_OFF_GPU_NODE,
)
from hybridmon.exporters.pcie import DEVICE_NUMA_NODE
from hybridmon.exporters.process import ALLOWED_CPUS, CPU_SECONDS, RESIDENT
from hybridmon.rules import process as recorded
from tests.support.detector_history import (
    T0,
    THRESHOLDS,
    Trace,
    gpu_rows,
    numa_rows,
    only,
    pcie_rows,
    process_numa_rows,
    process_rows,
)
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


def detector():
    return numa_misplacement.Detector(THRESHOLDS.numa_misplacement)


def run(nodes=2, sysfs_node=0, nvml_node=None, cpus=None, resident=None, uses_gpu=True, cores=None,
        detail_series=True):
    """vllm (pid 4242) on GPU 0; its placement off the GPU's node is sampled every 30 s, as by
    default, its CPU time and VmRSS (the process collector's) with it.

    sysfs_node: the GPU's PCI device's numa_node (None: -1 or absent, and process_numa exports
    nothing against it); nvml_node: nvmlDeviceGetNumaNodeId (None: NOT_SUPPORTED, as on every x86
    host); cpus: allowed CPUs per node (hybridmon_process_allowed_cpus, the total, only with
    detail_series); cores: CPU seconds per second its threads run on each node (default: where it
    may run, one core per 8 allowed CPUs); resident: bytes per node."""
    trace = Trace()
    processes = {"4242": ("vllm", 10 * GIB)} if uses_gpu else {}
    now = trace.run(T0, T0 + 300, gpu=lambda t: gpu_rows(numa_node=nvml_node, processes=processes),
                    numa=lambda t: numa_rows(nodes), pcie=lambda t: pcie_rows(numa_node=sysfs_node))
    cpus = cpus or {"0": 16, "1": 0}
    cores = cores if cores is not None else {node: count / 8 for node, count in cpus.items()}
    resident = resident or {"0": 20 * GIB}
    # process_numa places only processes on a GPU, against the GPU's sysfs node
    gpu_nodes = [str(sysfs_node)] if uses_gpu and sysfs_node is not None else []
    t, counted = T0, {node: 0.0 for node in cores}
    while t <= now:
        total = sum(counted.values())
        trace.commit("process", t, process_rows(
            "4242", "vllm", cpu_seconds=total, resident=sum(resident.values()),
            allowed_cpus=sum(cpus.values()) if detail_series else None))
        rows = [(PROCESS_CPU_SECONDS_OFF_GPU_NODE, total - counted.get(node, 0.0), "4242", "vllm", node)
                for node in gpu_nodes]
        rows += [(PROCESS_RESIDENT_OFF_GPU_NODE, sum(size for other, size in resident.items() if other != node),
                  "4242", "vllm", node) for node in gpu_nodes]
        if detail_series:
            rows += process_numa_rows("4242", "vllm", cpus=cpus, resident=resident)
        trace.commit("process_numa", t, rows)
        counted = {node: seconds + cores[node] * 30 for node, seconds in counted.items()}
        t += 30
    return trace, now


def test_cpus_and_memory_on_the_other_node_than_the_gpu():
    trace, now = run(cpus={"0": 0, "1": 16}, resident={"0": 4 * GIB, "1": 20 * GIB})
    findings = detector().evaluate(trace.history, now)
    assert len(findings) == 2
    cpus = only(findings, "InferenceProcessNumaMisplaced", reason="cpus")
    assert cpus.labels == {"pid": "4242", "process_name": "vllm", "gpu": "0", "reason": "cpus"}
    assert cpus.value == 1.0 and cpus.threshold == 0.75 and cpus.for_seconds == 300
    assert cpus.details["cpu_cores_off_gpu_node"] == pytest.approx(2.0)
    assert "(2 cores) ran on CPUs outside NUMA node 0" in cpus.description
    assert "it may run on 16 CPUs" in cpus.description
    memory = only(findings, "InferenceProcessNumaMisplaced", reason="memory")
    assert memory.value == pytest.approx(20 / 24) and memory.threshold == 0.5
    assert memory.details["gpu_numa_node"] == "0"
    assert "of the 24GiB of resident memory" in memory.description
    assert "numactl --cpunodebind=0 --membind=0" in memory.description


def test_without_detail_series_the_text_leaves_out_the_allowed_cpus_and_judges_the_same():
    # hybridmon_process_allowed_cpus is a [process] detail_series series: context, not evidence
    trace, now = run(cpus={"0": 0, "1": 16}, resident={"0": 4 * GIB, "1": 20 * GIB}, detail_series=False)
    findings = detector().evaluate(trace.history, now)
    cpus = only(findings, "InferenceProcessNumaMisplaced", reason="cpus")
    assert cpus.value == 1.0 and len(findings) == 2
    assert "may run on" not in cpus.description and "unknown" not in cpus.description
    assert "grep Cpus_allowed_list /proc/4242/status" in cpus.description


def test_a_process_pinned_to_its_gpus_node_is_silent():
    trace, now = run(cpus={"0": 16, "1": 0}, resident={"0": 20 * GIB, "1": 1 * GIB})
    assert detector().evaluate(trace.history, now) == []


def test_the_gpus_node_is_its_pci_devices_sysfs_node_whatever_nvml_says():
    trace, now = run(nvml_node=0, sysfs_node=1, cpus={"0": 16, "1": 0},
                     resident={"0": 20 * GIB})
    findings = detector().evaluate(trace.history, now)
    assert {f.labels["reason"] for f in findings} == {"cpus", "memory"}
    assert all(f.details["gpu_numa_node"] == "1" for f in findings)


def test_a_single_node_host_gives_no_numa_findings():
    placement = dict(sysfs_node=1, cpus={"0": 16}, resident={"0": 20 * GIB})
    trace, now = run(nodes=1, **placement)
    assert detector().evaluate(trace.history, now) == []
    trace, now = run(nodes=2, **placement)   # the same placement on two nodes does fire
    assert len(detector().evaluate(trace.history, now)) == 2


def test_a_process_without_gpu_memory_is_not_judged():
    trace, now = run(cpus={"0": 0, "1": 16}, uses_gpu=False)
    assert detector().evaluate(trace.history, now) == []


def test_an_unpinned_process_with_local_memory_is_the_default_layout_and_silent():
    # Issue 14: unpinned on a 2-socket host, half its allowed CPUs are remote and its threads run
    # half their time there, but 97 % of its memory is local. The old detector judged the allowed
    # CPUs (8 of 16 off node, ">= 0.5") and warned on every default deployment.
    trace, now = run(cpus={"0": 8, "1": 8}, cores={"0": 1.0, "1": 1.0},
                     resident={"0": 0.97 * 20 * GIB, "1": 0.03 * 20 * GIB})
    assert detector().evaluate(trace.history, now) == []


@pytest.mark.parametrize("off, fires", [(0.7, False), (0.75, False), (0.8, True)])
def test_cpu_time_off_node_fires_past_three_quarters_on_two_nodes(off, fires):
    # the scheduler's wandering (70 % for a while) stays silent; a process kept off the node fires
    trace, now = run(cpus={"0": 8, "1": 8}, cores={"0": 2 * (1 - off), "1": 2 * off})
    findings = detector().evaluate(trace.history, now)
    assert [f.labels["reason"] for f in findings] == (["cpus"] if fires else [])
    if fires:
        assert findings[0].value == pytest.approx(off)


def test_an_unpinned_process_on_four_nodes_runs_three_quarters_off_node_and_is_silent():
    # spread evenly over 4 nodes, 75 % of its time is off the GPU's node by construction; the
    # limit there is 87.5 % (half of an even share on the node)
    even = {str(node): 0.5 for node in range(4)}
    trace, now = run(nodes=4, cpus={node: 8 for node in even}, cores=even)
    assert detector().evaluate(trace.history, now) == []
    away = {"0": 0.0, "1": 1.0, "2": 1.0, "3": 0.0}   # bound to nodes 1 and 2
    trace, now = run(nodes=4, cpus={"0": 0, "1": 8, "2": 8, "3": 0}, cores=away)
    (finding,) = detector().evaluate(trace.history, now)
    assert finding.labels["reason"] == "cpus" and finding.threshold == 0.875


def test_memory_exactly_half_off_node_is_not_mostly_off_node():
    trace, now = run(resident={"0": 10 * GIB, "1": 10 * GIB})
    assert detector().evaluate(trace.history, now) == []


def test_an_idle_process_has_no_cpu_placement_to_judge():
    trace, now = run(cpus={"0": 0, "1": 16}, cores={"0": 0.0, "1": 0.0})
    assert detector().evaluate(trace.history, now) == []


@pytest.mark.parametrize("sysfs_node", [0, None])
def test_grace_gpu_memory_node_is_not_taken_for_the_cpus_node(sysfs_node):
    # Grace Hopper: NVML's NumaNodeId is the GPU's own memory, a CPU-less node (4 here); the GPU's
    # PCI device sits on node 0 (or has no numa_node). A process on node 0 is where it belongs;
    # the old detector preferred NVML's node and found all its CPUs and memory "off node 4".
    trace, now = run(nodes=2, nvml_node=4, sysfs_node=sysfs_node, cpus={"0": 16, "1": 0},
                     resident={"0": 20 * GIB})
    assert detector().evaluate(trace.history, now) == []


def test_no_node_for_the_gpu_means_no_finding():
    trace, now = run(sysfs_node=None, cpus={"0": 0, "1": 16}, resident={"1": 20 * GIB})
    assert detector().evaluate(trace.history, now) == []


# --- its rule's promtool cases ------------------------------------------------------------------


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
        # process_numa exports each process's CPU time and resident memory off its GPU's node
        # (gpu_node) on the 2-node host only; the process collector its CPU time and VmRSS
        off_node = {"gpu_node": "0"} if instance == HOST else None
        llama_off_node = {"gpu_node": "1"} if instance == HOST else None
        # python3 on GPU 0 (node 0): 8 CPUs (a [process] detail_series series here, context for
        # the text), node 0's until the onset, node 1's after; its CPU time follows; its memory
        # stays put
        test.constant(ALLOWED_CPUS.name, 8, instance, **VLLM)
        test.counter(CPU_SECONDS.name, cores, cores, instance, **VLLM)
        test.constant(RESIDENT.name, mapped, instance, **VLLM)
        # llama-server on GPU 1 (node 1): CPU time on node 1 throughout; memory moves to node 0
        # at the onset; its allowed CPUs not exported ([process] detail_series off)
        test.counter(CPU_SECONDS.name, 6, 6, instance, **LLAMA)
        test.constant(RESIDENT.name, mapped, instance, **LLAMA)
        # sglang on GPU 0, unpinned: all 16 CPUs allowed (half remote: the old rule fired on
        # that); CPU time 50/50, then 70 % remote (under the 2-node limit of 75 %); memory 97 %
        # local, then exactly half remote (not "mostly")
        test.constant(ALLOWED_CPUS.name, 16, instance, **SGLANG)
        test.counter(CPU_SECONDS.name, 2.0, 2.0, instance, **SGLANG)
        test.constant(RESIDENT.name, mapped, instance, **SGLANG)
        if off_node:
            test.counter(PROCESS_CPU_SECONDS_OFF_GPU_NODE.name, 0, cores, instance, **VLLM, **off_node)
            test.constant(PROCESS_RESIDENT_OFF_GPU_NODE.name, 0.03 * mapped, instance, **VLLM, **off_node)
            test.counter(PROCESS_CPU_SECONDS_OFF_GPU_NODE.name, 0, 0, instance, **LLAMA, **llama_off_node)
            test.gauge(PROCESS_RESIDENT_OFF_GPU_NODE.name, 0.02 * mapped, 0.8 * mapped, instance, **LLAMA,
                       **llama_off_node)
            test.counter(PROCESS_CPU_SECONDS_OFF_GPU_NODE.name, 1.0, 1.4, instance, **SGLANG, **off_node)
            test.gauge(PROCESS_RESIDENT_OFF_GPU_NODE.name, 0.03 * mapped, 0.5 * mapped, instance, **SGLANG,
                       **off_node)
    test.expect_samples(60, recorded.GPU_NODE, (GPU0, 0), (GPU1, 1),
                        ({**GPU0, "instance": HOST2}, 0), ({**GPU1, "instance": HOST2}, 1))
    test.expect(not_yet(n.for_seconds), "InferenceProcessNumaMisplaced")
    test.expect(at, "InferenceProcessNumaMisplaced",
                test.alert(cpus_rule, {**VLLM, "gpu": "0"}, value=1, cpus=8, cores=cores, node=0,
                           limit=limit),
                test.alert(memory_rule, {**LLAMA, "gpu": "1"}, value=0.8, resident=mapped, node=1))
    return test


def promtool_cases(t, catalog: Catalog) -> list[Test]:
    return [_misplaced_cpus_and_memory(t, catalog)]
