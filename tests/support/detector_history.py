"""Synthetic histories for the detector tests, built from the collectors' own MetricSpecs so that
metric names and labels are exactly the ones the agent records. (No tests in here.)"""
from __future__ import annotations

from typing import Callable, Iterable

from hybridmon.agent.alerts.catalogue import load_thresholds
from hybridmon.agent.loop.history import History
from hybridmon.exporters import bench, gpu, host_memory, inference_names, numa, pcie, pressure, process
from hybridmon.exporters.base import Samples
from hybridmon.exporters.registry import NAMES as COLLECTOR_NAMES

T0 = 1_700_000_000.0
THRESHOLDS = load_thresholds()
VLLM_ENDPOINT = "http://127.0.0.1:8000/metrics"
GIB = 2**30
MIB = 2**20

Row = tuple  # (MetricSpec, value, *label values)


class Trace:
    """A History filled tick by tick; each collector commits the rows a function gives for t."""

    def __init__(self, retention_seconds: float = 7200.0, interval_seconds: float = 1.0) -> None:
        self.history = History(retention_seconds)
        for name in COLLECTOR_NAMES:
            self.history.add_collector(name, interval_seconds)

    def commit(self, collector: str, time: float, rows: Iterable[Row]) -> None:
        samples = Samples()
        for spec, value, *labels in rows:
            samples.add(spec, value, *labels)
        self.history.commit(collector, time, samples)

    def run(self, start: float, end: float, step: float = 1.0,
            **collectors: Callable[[float], Iterable[Row]]) -> float:
        """Commit every collector at start, start + step, ... up to end; returns the last tick."""
        tick = 0
        time = start
        while time <= end + 1e-9:
            for name, rows in collectors.items():
                self.commit(name, time, rows(time))
            tick += 1
            time = start + tick * step
        return start + (tick - 1) * step


def gpu_rows(gpu_index: str = "0", uuid: str = "GPU-0000", *, up: float | None = 1,
             utilization: float | None = 0.9, h2d: float | None = 1e9, d2h: float | None = 1e9,
             generation: float | None = 4, max_generation: float | None = 4,
             width: float | None = 16, max_width: float | None = 16,
             used: float | None = 10 * GIB, total: float | None = 24 * GIB,
             replays: float | None = None, numa_node: float | None = None,
             pci_bus_id: str = "0000:17:00.0",
             processes: dict[str, tuple[str, float]] | None = None) -> list[Row]:
    """One GPU's series in one tick; None leaves a series out (unsupported)."""
    labels = (gpu_index, uuid)
    rows: list[Row] = [(gpu.GPU_INFO, 1, gpu_index, uuid, "NVIDIA Test", pci_bus_id, "550.54")]
    rows.append((gpu.GPU_UP, up, *labels))
    if up == 0:
        return rows
    rows += [
        (gpu.UTILIZATION, utilization, *labels),
        (gpu.PCIE_THROUGHPUT, h2d, *labels, "host_to_device"),
        (gpu.PCIE_THROUGHPUT, d2h, *labels, "device_to_host"),
        (gpu.PCIE_LINK_GENERATION, generation, *labels),
        (gpu.PCIE_LINK_MAX_GENERATION, max_generation, *labels),
        (gpu.PCIE_LINK_WIDTH, width, *labels),
        (gpu.PCIE_LINK_MAX_WIDTH, max_width, *labels),
        (gpu.MEMORY_USED, used, *labels),
        (gpu.MEMORY_TOTAL, total, *labels),
        (gpu.PCIE_REPLAYS, replays, *labels),
        (gpu.NUMA_NODE, numa_node, *labels),
    ]
    for pid, (name, used_bytes) in (processes or {}).items():
        rows.append((gpu.PROCESS_MEMORY_USED, used_bytes, *labels, pid, name))
    return rows


def c2c_rows(gpu_index: str = "0", uuid: str = "GPU-0000", *, enabled: float | None = 1,
             links: dict[str, tuple[float, float]] | None = None, h2d: float | None = None,
             d2h: float | None = None) -> list[Row]:
    """One GPU's NVLink-C2C series in one tick, as the gpu collector exports them (exporters/gpu.py
    C2C_*): the mode (1 on, 0 off, None: NVML does not answer), per link (up 1/0, NVML's maximum
    bandwidth in bytes/s), and the GPM throughput per direction (None: GPM not readable)."""
    labels = (gpu_index, uuid)
    links = {} if links is None else links
    rows: list[Row] = [(gpu.C2C_MODE, enabled, *labels), (gpu.C2C_LINKS, len(links) if links else None, *labels),
                       (gpu.C2C_THROUGHPUT, h2d, *labels, "host_to_device"),
                       (gpu.C2C_THROUGHPUT, d2h, *labels, "device_to_host")]
    for link, (up, max_bytes_per_second) in links.items():
        rows += [(gpu.C2C_LINK_UP, up, *labels, link), (gpu.C2C_LINK_MAX_BANDWIDTH, max_bytes_per_second, *labels, link)]
    return rows


def c2c_bench_rows(gpu_index: str = "0", uuid: str = "GPU-0000", *, h2d: float, d2h: float,
                   finished_at: float = T0 - 3600) -> list[Row]:
    """A benchmark run taken over NVLink-C2C as exporters/bench.py exports it: C2C's measured
    capacity per direction, nothing of PCIe's."""
    return [(bench.TIMESTAMP, finished_at, gpu_index, uuid),
            (bench.CONTENDED, 0, gpu_index, uuid),
            (bench.C2C_MEASURED_CAPACITY, h2d, gpu_index, uuid, "host_to_device"),
            (bench.C2C_MEASURED_CAPACITY, d2h, gpu_index, uuid, "device_to_host")]


def bench_rows(gpu_index: str = "0", uuid: str = "GPU-0000", *, h2d: float = 26e9,
               d2h: float = 26e9, finished_at: float = T0 - 3600) -> list[Row]:
    """A stored benchmark run as exporters/bench.py exports it: the measured capacity per direction."""
    return [(bench.TIMESTAMP, finished_at, gpu_index, uuid),
            (bench.CONTENDED, 0, gpu_index, uuid),
            (bench.MEASURED_CAPACITY, h2d, gpu_index, uuid, "host_to_device"),
            (bench.MEASURED_CAPACITY, d2h, gpu_index, uuid, "device_to_host")]


def host_memory_rows(*, swap_in: float = 0.0, swap_out: float = 0.0, major_faults: float = 0.0,
                     memory_total: float = 64 * GIB, memory_available: float | None = 32 * GIB,
                     swap_total: float = 8 * GIB, swap_free: float | None = None,
                     swappiness: float | None = 60, dirty_ratio: float | None = 20,
                     numa_balancing: float | None = 0, thp_enabled: str | None = "madvise"
                     ) -> list[Row]:
    """Host memory figures; swap_in/swap_out/major_faults are the counters' current values."""
    rows: list[Row] = [
        (host_memory.SWAP_IN_BYTES, swap_in),
        (host_memory.SWAP_OUT_BYTES, swap_out),
        (host_memory.MAJOR_PAGE_FAULTS, major_faults),
        (host_memory.PAGE_FAULTS, major_faults * 10),
        (host_memory.MEMORY_TOTAL, memory_total),
        (host_memory.MEMORY_AVAILABLE, memory_available),
        (host_memory.SWAP_TOTAL, swap_total),
        (host_memory.SWAP_FREE, swap_total if swap_free is None else swap_free),
        (host_memory.SYSCTL_VALUE, swappiness, "vm.swappiness"),
        (host_memory.SYSCTL_VALUE, dirty_ratio, "vm.dirty_ratio"),
        (host_memory.SYSCTL_VALUE, numa_balancing, "kernel.numa_balancing"),
    ]
    if thp_enabled is not None:
        rows.append((host_memory.TRANSPARENT_HUGEPAGE_MODE, 1, "enabled", thp_enabled))
    return rows


def pressure_rows(memory_some_seconds: float) -> list[Row]:
    return [(pressure.STALLED_SECONDS, memory_some_seconds, "memory", "some"),
            (pressure.STALLED_SECONDS, memory_some_seconds / 2, "memory", "full")]


def process_rows(pid: str, name: str, *, start_time: float = T0 - 86400, resident: float = 8 * GIB,
                 swap: float = 0.0, locked: float = 0.0, pinned: float | None = 0.0,
                 cpu_seconds: float = 0.0, minor_faults: float = 0.0, major_faults: float = 0.0,
                 memlock_limit: float | None = 8 * MIB, allowed_cpus: float | None = 32) -> list[Row]:
    labels = (pid, name)
    return [
        (process.RESIDENT, resident, *labels),
        (process.SWAP, swap, *labels),
        (process.LOCKED, locked, *labels),
        (process.PINNED, pinned, *labels),
        (process.ALLOWED_CPUS, allowed_cpus, *labels),
        (process.CPU_SECONDS, cpu_seconds, *labels),
        (process.MINOR_FAULTS, minor_faults, *labels),
        (process.MAJOR_FAULTS, major_faults, *labels),
        (process.START_TIME, start_time, *labels),
        (process.MEMLOCK_LIMIT, memlock_limit, *labels),
        (process.INFO, 1, *labels, name, "", "", "gpu", pid),
    ]


def tree_info(pid: str, name: str, root: str) -> Row:
    """hybridmon_process_info of a process whose command line was not read, in `root`'s tree: the
    root_pid the process collector gives it."""
    return (process.INFO, 1, pid, name, "", "", "", "gpu", root)


def numa_rows(nodes: int = 2, cpus_per_node: float = 16) -> list[Row]:
    rows: list[Row] = []
    for node in range(nodes):
        rows += [(numa.NODE_CPUS, cpus_per_node, str(node)),
                 (numa.NODE_MEMORY_TOTAL, 32 * GIB, str(node)),
                 (numa.NODE_MEMORY_FREE, 16 * GIB, str(node))]
    return rows


def process_numa_rows(pid: str, name: str, *, cpus: dict[str, float],
                      resident: dict[str, float]) -> list[Row]:
    rows: list[Row] = []
    for node, count in cpus.items():
        rows.append((numa.PROCESS_ALLOWED_CPUS_ON_NODE, count, pid, name, node))
    for node, size in resident.items():
        rows.append((numa.PROCESS_NUMA_RESIDENT, size, pid, name, node))
    return rows


def pcie_rows(pci_bus_id: str = "0000:17:00.0", *, present: float | None = 1,
              numa_node: float | None = None, aer: dict[str, float] | None = None) -> list[Row]:
    rows: list[Row] = [(pcie.DEVICE_PRESENT, present, pci_bus_id),
                       (pcie.DEVICE_NUMA_NODE, numa_node, pci_bus_id)]
    for severity, count in (aer or {}).items():
        rows.append((pcie.AER_ERRORS, count, pci_bus_id, severity))
    return rows


def inference_rows(*, server: str = "vllm", endpoint: str = VLLM_ENDPOINT, model: str = "llama-3-8b",
                   pid: str = "4242", running: float | None = 8, waiting: float | None = 0,
                   generated_tokens: float | None = 0.0, kv_usage: float | None = 0.5,
                   preemptions: float | None = 0.0, offload_load_bytes: float | None = None,
                   offload_store_bytes: float | None = None, inter_token_p50: float | None = None,
                   first_token_p50: float | None = None) -> list[Row]:
    """One server's series in one scrape, as exporters/inference.py exports them; counters are
    their current values. None leaves a series out (the server does not publish it)."""
    names = inference_names
    labels = (server, endpoint, model, pid)
    latency = names.HISTOGRAM_SPECS
    return [
        (names.SCRAPE_SUCCESS, 1, endpoint),
        (names.SCRAPE_DURATION, 0.01, endpoint),
        (names.BY_FIELD["requests_running"], running, *labels),
        (names.BY_FIELD["requests_waiting"], waiting, *labels),
        (names.BY_FIELD["generated_tokens"], generated_tokens, *labels),
        (names.BY_FIELD["kv_cache_usage_ratio"], kv_usage, *labels),
        (names.BY_FIELD["preemptions"], preemptions, *labels),
        (names.OFFLOAD_BYTES, offload_load_bytes, *labels, "load"),
        (names.OFFLOAD_BYTES, offload_store_bytes, *labels, "store"),
        (latency["inter_token_latency"][0], inter_token_p50, *labels, "p50"),
        (latency["time_to_first_token"][0], first_token_p50, *labels, "p50"),
    ]


def scrape_error_rows(endpoint: str = VLLM_ENDPOINT, reason: str = "refused") -> list[Row]:
    """A failed scrape: success 0 and the reason, no server series."""
    return [(inference_names.SCRAPE_SUCCESS, 0, endpoint),
            (inference_names.SCRAPE_DURATION, 0.001, endpoint),
            (inference_names.SCRAPE_ERROR, 1, endpoint, reason)]


def alertnames(findings) -> list[str]:
    return sorted(f.alertname for f in findings)


def only(findings, alertname: str, **labels: str):
    """The one finding with this alertname whose labels include `labels`."""
    matching = [f for f in findings if f.alertname == alertname
                and all(f.labels.get(k) == v for k, v in labels.items())]
    assert len(matching) == 1, f"expected one {alertname} {labels}, got {findings}"
    return matching[0]


def rule_of(finding):
    """The alerting rule of a finding: same alertname and severity, its static labels held."""
    from hybridmon.agent.alerts.catalogue import FAMILIES
    rules = [rule for family in FAMILIES for rule in family.alerts(THRESHOLDS)
             if rule.alert == finding.alertname and rule.severity == finding.severity
             and set(rule.labels.items()) <= set(finding.labels.items())]
    assert len(rules) == 1, (finding.alertname, finding.severity, finding.labels)
    return rules[0]


def assert_says_its_rules_words(finding) -> None:
    """The finding's text is its rule's annotation text filled with the finding's values, as
    Prometheus fills the template (the promtool cases check Prometheus's side); the agent may add
    one note after it (details.agent_note). expected_text raises on a marker of the chosen <if>
    branch the finding left unfilled."""
    from hybridmon.rules.templates import expected_text
    rule = rule_of(finding)
    assert {key: value for key, value in finding.values.items() if key in finding.labels} == finding.labels
    assert finding.summary == expected_text(rule.summary, finding.values), finding.alertname
    rendered = expected_text(rule.description, finding.values)
    note = finding.details.get("agent_note")
    assert finding.description == (f"{rendered} {note}" if note else rendered), finding.alertname


# The labels of the GPU gpu_rows writes by default, as a GPU finding carries them.
HISTORY_GPU0 = {"gpu": "0", "uuid": "GPU-0000"}
# A Gen4 x16 link's bytes/s per direction, written out (128b/130b at 16 GT/s) rather than read from
# hybridmon.pcie_rates, so a test that divides by it checks the tables too.
GEN4_X16 = 16 * 1969.2e6
# vLLM (pid 4242) holding 20 GiB of GPU 0, as gpus_over_time takes its processes.
VLLM_ON_GPU0 = {"0": {"4242": ("python3", 20 * GIB)}}


def gpus_over_time(h2d: dict[str, float], processes: dict[str, dict[str, tuple[str, float]]]):
    """gpu collector rows at t for GPUs "0", "1", ...: host->device bytes/s and the processes on each."""
    def rows(t):
        found = []
        for index, traffic in h2d.items():
            found += gpu_rows(index, f"GPU-{index}", h2d=traffic, d2h=1e8,
                              processes=processes.get(index, {}))
        return found
    return rows


def servers_over_time(*specs: dict):
    """inference collector rows at t: each spec gives pid, tokens (per second), loads (bytes/s),
    endpoint, server, model and running (requests, 8 unless given)."""
    def rows(t):
        found = []
        for spec in specs:
            loads = spec.get("loads")
            found += inference_rows(
                pid=spec["pid"], endpoint=spec.get("endpoint", VLLM_ENDPOINT), running=spec.get("running", 8),
                server=spec.get("server", "vllm"), model=spec.get("model", "llama-3-8b"),
                generated_tokens=spec["tokens"] * (t - T0),
                offload_load_bytes=None if loads is None else loads * (t - T0))
        return found
    return rows
