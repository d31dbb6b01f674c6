import pytest

from hybridmon.agent.alerts import numa_misplacement
from tests.support.detector_history import (GIB, T0, THRESHOLDS, Trace, gpu_rows, numa_rows, only,
                                          pcie_rows, process_numa_rows)


def detector():
    return numa_misplacement.Detector(THRESHOLDS.numa_misplacement)


def run(nodes=2, sysfs_node=0, nvml_node=None, cpus=None, resident=None, uses_gpu=True):
    """vllm (pid 4242) on GPU 0; its per-node placement is sampled every 30 s, as by default.

    sysfs_node: the GPU's PCI device's numa_node (None: -1 or absent); nvml_node:
    nvmlDeviceGetNumaNodeId (None: NOT_SUPPORTED, as on every x86 host)."""
    trace = Trace()
    processes = {"4242": ("vllm", 10 * GIB)} if uses_gpu else {}
    now = trace.run(T0, T0 + 300, gpu=lambda t: gpu_rows(numa_node=nvml_node, processes=processes),
                    numa=lambda t: numa_rows(nodes), pcie=lambda t: pcie_rows(numa_node=sysfs_node))
    t = T0
    while t <= now:
        trace.commit("process_numa", t, process_numa_rows(
            "4242", "vllm", cpus=cpus or {"0": 16, "1": 0}, resident=resident or {"0": 20 * GIB}))
        t += 30
    return trace, now


def test_cpus_and_memory_on_the_other_node_than_the_gpu():
    trace, now = run(cpus={"0": 0, "1": 16}, resident={"0": 4 * GIB, "1": 20 * GIB})
    findings = detector().evaluate(trace.history, now)
    assert len(findings) == 2
    cpus = only(findings, "InferenceProcessNumaMisplaced", reason="cpus")
    assert cpus.labels == {"pid": "4242", "process_name": "vllm", "gpu": "0", "reason": "cpus"}
    assert cpus.value == 1.0 and cpus.threshold == 0.5 and cpus.for_seconds == 300
    memory = only(findings, "InferenceProcessNumaMisplaced", reason="memory")
    assert memory.value == pytest.approx(20 / 24)
    assert memory.details["gpu_numa_node"] == "0"
    assert "numactl --cpunodebind=0 --membind=0" in memory.description


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


def test_half_the_cpus_off_node_reaches_the_threshold():
    # unpinned on a 2-node host: half its CPUs are remote, which is what pinning fixes
    trace, now = run(cpus={"0": 16, "1": 16}, resident={"0": 20 * GIB})
    (finding,) = detector().evaluate(trace.history, now)
    assert finding.labels["reason"] == "cpus" and finding.value == 0.5


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

