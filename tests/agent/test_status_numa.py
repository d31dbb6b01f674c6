"""The status page's NUMA lines: a process card names the node nearest its GPU (the GPU's PCI
device's sysfs numa_node), not NVML's NumaNodeId, which is GPU memory's own node on Grace."""
from __future__ import annotations

from hybridmon.agent.status.trends import Trends  # no history read: the plots are not under test here
from hybridmon.agent.status.signals import Decided, LatestValues, gpu_rows, processes_html
from hybridmon.exporters import numa
from tests.support.detector_history import (GIB, T0, THRESHOLDS, Trace, gpu_rows as gpu_series, numa_rows, pcie_rows,
                                            process_rows)


def grace_like_trace() -> Trace:
    # GPU 0's memory is NUMA node 4 (NVML); its PCI device sits on node 0 (sysfs), the node
    # process_numa judges the process against: 1 GiB of its 8 GiB resident is off it
    trace = Trace()
    trace.run(T0, T0 + 2,
              gpu=lambda t: gpu_series(numa_node=4, processes={"4242": ("vllm", 10 * GIB)}),
              pcie=lambda t: pcie_rows(numa_node=0), numa=lambda t: numa_rows(2),
              process=lambda t: process_rows("4242", "vllm", resident=8 * GIB),
              process_numa=lambda t: [(numa.PROCESS_RESIDENT_OFF_GPU_NODE, 1 * GIB, "4242", "vllm", "0")])
    return trace


def test_a_process_card_names_the_node_nearest_its_gpu_not_gpu_memorys_node():
    history = grace_like_trace().history
    page = processes_html(history, LatestValues(history), Trends(history, None, THRESHOLDS, None))
    assert "12 % off node 0" in page  # the node of its GPU's PCI device; the old page said node 4
    assert "node 4" not in page


def test_the_gpu_card_calls_nvmls_node_gpu_memorys():
    history = grace_like_trace().history
    rows = dict((label, value) for label, value, _ in gpu_rows(("0", "GPU-0000"), LatestValues(history), Decided(None)))
    assert rows["GPU memory NUMA node"] == "4" and "NUMA node" not in rows
