"""Inputs several families' promtool cases share: a GPU's link, a host's memory, the watched
processes and the inference servers of the test hosts (tests.support.promtool_cases has the timing and Test)."""
from __future__ import annotations

from hybridmon.exporters.bench import MEASURED_BIDIRECTIONAL_CAPACITY, MEASURED_CAPACITY
from hybridmon.exporters.gpu import (PCIE_LINK_GENERATION, PCIE_LINK_MAX_GENERATION, PCIE_LINK_MAX_WIDTH,
                                     PCIE_LINK_WIDTH, PROCESS_MEMORY_USED)
from hybridmon.exporters.host_memory import (MAJOR_PAGE_FAULTS, SWAP_IN_BYTES, SWAP_OUT_BYTES, SWAP_TOTAL,
                                             SYSCTL_VALUE)
from hybridmon.exporters.pressure import STALLED_SECONDS
from hybridmon.exporters.process import INFO
from hybridmon.pcie_rates import LANE_BYTES_PER_SECOND, achievable_capacity, bidirectional_capacity
from tests.support.promtool_cases import GIB, HOST, Test

HOST2 = "gpu-host-2:9787"
HOST3 = "gpu-host-3:9787"
# Watched processes as the process and GPU collectors label them, and as their alerts do.
VLLM = {"pid": "4242", "process_name": "python3"}
LLAMA = {"pid": "5151", "process_name": "llama-server"}
SGLANG = {"pid": "6161", "process_name": "sglang"}
# Inference servers as the inference collector labels them.
VLLM_SERVER = {"server": "vllm", "endpoint": "http://127.0.0.1:8000/metrics", "model": "llama-3-8b"}
SGLANG_SERVER = {"server": "sglang", "endpoint": "http://127.0.0.1:30000/metrics", "model": "qwen2"}
LLAMA_SERVER = {"server": "llamacpp", "endpoint": "http://127.0.0.1:8080/metrics", "model": ""}


def capacity(generation: int, width: int) -> float:
    """Theoretical bytes/s per direction of a link (hybridmon.pcie_rates)."""
    return width * LANE_BYTES_PER_SECOND[generation]


def achievable(generation: int, width: int) -> float:
    """Bytes/s one direction of a link carries in practice (pcie_rates.achievable_capacity)."""
    return achievable_capacity(generation, width)


def bidirectional(generation: int, width: int) -> float:
    """Bytes/s both directions of a link carry together (pcie_rates.bidirectional_capacity)."""
    return bidirectional_capacity(generation, width)


def link(test: Test, gpu: dict, generation: float | tuple | list, width: float | tuple | list,
         max_generation: int = 4, max_width: int = 16) -> None:
    """Link state of one GPU; a (before, after) pair changes at the onset, a list gives every sample."""
    for metric, value in ((PCIE_LINK_GENERATION.name, generation), (PCIE_LINK_WIDTH.name, width)):
        if isinstance(value, list):
            test.values(metric, value, **gpu)
        elif isinstance(value, tuple):
            test.gauge(metric, *value, **gpu)
        else:
            test.constant(metric, value, **gpu)
    test.constant(PCIE_LINK_MAX_GENERATION.name, max_generation, **gpu)
    test.constant(PCIE_LINK_MAX_WIDTH.name, max_width, **gpu)


def measured(test: Test, gpu: dict, host_to_device: float, device_to_host: float) -> None:
    """What `hybridmon bench` measured on this GPU, per direction."""
    test.constant(MEASURED_CAPACITY.name, host_to_device, direction="host_to_device", **gpu)
    test.constant(MEASURED_CAPACITY.name, device_to_host, direction="device_to_host", **gpu)


def measured_bidirectional(test: Test, gpu: dict, host_to_device: float, device_to_host: float | None) -> None:
    """What `hybridmon bench` measured on this GPU per direction while the other direction copied
    too; None leaves that direction out (a run whose copy that way failed exports only the other)."""
    for direction, value in (("host_to_device", host_to_device), ("device_to_host", device_to_host)):
        if value is not None:
            test.constant(MEASURED_BIDIRECTIONAL_CAPACITY.name, value, direction=direction, **gpu)


def host_memory(test: Test, swap_in: float, swap_out: float, major_faults: float, pressure: float,
                instance: str = HOST) -> None:
    """Host swap traffic (bytes/s), major faults/s and PSI memory "some" share after the onset."""
    test.counter(SWAP_IN_BYTES.name, 0, swap_in, instance)
    test.counter(SWAP_OUT_BYTES.name, 0, swap_out, instance)
    test.counter(MAJOR_PAGE_FAULTS.name, 1, major_faults, instance)
    test.counter(STALLED_SECONDS.name, 0, pressure, instance, resource="memory", scope="some")
    test.constant(STALLED_SECONDS.name, 0, instance, resource="memory", scope="full")
    test.constant(SWAP_TOTAL.name, 8 * GIB, instance)
    test.constant(SYSCTL_VALUE.name, 60, instance, sysctl="vm.swappiness")
    test.constant(SYSCTL_VALUE.name, 20, instance, sysctl="vm.dirty_ratio")


def on_gpu(test: Test, gpu: dict, proc: dict, used: float | list[float], instance: str = HOST) -> None:
    """The GPU memory a process holds on one GPU (constant, or one value per sample)."""
    labels = {**gpu, **proc}
    if isinstance(used, list):
        test.values(PROCESS_MEMORY_USED.name, used, instance, **labels)
    else:
        test.constant(PROCESS_MEMORY_USED.name, used, instance, **labels)


def in_tree(test: Test, proc: dict, root: dict, instance: str = HOST) -> None:
    """The process's hybridmon_process_info, its command line unread: root_pid says the tree it is in."""
    test.constant(INFO.name, 1, instance, **proc, executable="", server="", model="", watch_reason="gpu",
                  root_pid=root["pid"])


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


def bursts(test: Test, period: int, burst: int, during: float, between: float) -> list[float]:
    """A gauge at `during` for the first `burst` seconds of every `period` (counted from the
    sample after each period starts), `between` otherwise: one value per sample."""
    return [during if 0 < index * test.interval % period <= burst else between
            for index in range(test.samples)]


def stepped(test: Test, change_at: int, before: float, after: float) -> list[float]:
    """A gauge at `before` until `change_at` seconds, `after` since."""
    return [before if index * test.interval <= change_at else after for index in range(test.samples)]
