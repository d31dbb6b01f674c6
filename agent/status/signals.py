"""The signals of the status page (agent/status/page.py): per GPU, per watched process, the host's
memory and the last benchmark.

Cheap by construction: gauges come from every collector's latest samples (History.latest(), one
pass, no copy of the history arrays); the three counter rates shown (PSI memory some and full,
each process's major faults) read the last minute of their series only.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridmon.agent.detectors import windows
from hybridmon.agent.detectors.common import PROCESS_LABELS
from hybridmon.agent.detectors.engine import Engine
from hybridmon.agent.detectors.links import BUS_CAUSES, HOST_TO_DEVICE, BusAccount, DirectionLoad, LinkShare, UplinkLoad
from hybridmon.agent.loop.history import History
from hybridmon.agent.status.template import Row, card, clock_and_age, key_values, paragraph, table
from hybridmon.agent.status.trends import Trends, gpu_plots, host_plots, process_plots
from hybridmon.exporters import bench, host_memory, numa, pcie_topology, pressure, process
from hybridmon.exporters import gpu as gpu_metrics
from hybridmon.exporters.base import MetricSpec
from hybridmon.pcie_rates import link_name
from hybridmon.units import human_bytes, human_rate, percent

DIRECTIONS = {"host_to_device": "host → device", "device_to_host": "device → host",
              # hybridmon bench's streams while the other direction copies too (report version 2)
              "host_to_device_bidirectional": "host → device, both ways at once",
              "device_to_host_bidirectional": "device → host, both ways at once",
              # version-1 reports summed both streams over the slower one's time
              "bidirectional_summed": "both ways, summed (old report)",
              "bidirectional": "both ways"}

Labels = dict[str, str]


class LatestValues:
    """Every collector's latest samples by metric name."""

    def __init__(self, history: History) -> None:
        self.by_metric: dict[str, list[tuple[Labels, float]]] = {}
        self.newest: float | None = None
        self._keyed: dict[tuple[str, tuple[str, ...]], dict[tuple[str, ...], float]] = {}
        for at, samples in history.latest().values():
            if len(samples):
                self.newest = at if self.newest is None else max(self.newest, at)
            for sample in samples:
                labels = dict(zip(sample.spec.label_names, sample.label_values))
                self.by_metric.setdefault(sample.spec.name, []).append((labels, sample.value))

    def all(self, metric: str) -> list[tuple[Labels, float]]:
        return self.by_metric.get(metric, [])

    def keyed(self, metric: str, *label_names: str) -> dict[tuple[str, ...], float]:
        """Values by the given labels' values, e.g. per (gpu, uuid); built once per page."""
        found = self._keyed.get((metric, label_names))
        if found is None:
            found = self._keyed[(metric, label_names)] = {
                tuple(labels.get(n, "") for n in label_names): value for labels, value in self.all(metric)}
        return found


class Decided:
    """What the alert families decided at the engine's last evaluation (Detector.figures), which the
    page shows as they were decided and never works out again: each GPU link's load against its
    capacity (GpuPcieStarvation), each server's KV loads against its GPUs' link
    (InferenceKvOffloadPressure), each lost GPU's last identity (GpuLost), where each GPU's bus
    bytes went (InferenceWeightsCrossingBus's account), each shared uplink's load and the GPUs
    behind it (PcieUplinkStarvation). Empty before the
    first evaluation and with the detectors off."""

    def __init__(self, engine: Engine | None) -> None:
        def figures(detector: str) -> Mapping[tuple[str, ...], Any]:
            return engine.figures(detector) if engine is not None else {}

        self.link_loads: Mapping[tuple[str, ...], dict[str, DirectionLoad]] = figures("pcie_starvation")
        self.kv_shares: Mapping[tuple[str, ...], LinkShare] = figures("kv_offload_pressure")
        self.lost_gpus: Mapping[tuple[str, ...], Labels] = figures("gpu_lost")
        self.bus: Mapping[tuple[str, ...], BusAccount] = figures("weight_offload")
        self.uplinks: Mapping[tuple[str, ...], UplinkLoad] = figures("pcie_uplink_starvation")


def counter_rates(history: History, latest: LatestValues, metric: str, label_names: tuple[str, ...],
                  **wanted: str) -> dict[tuple[str, ...], float]:
    """rate(metric[1m]) per label set over the minute that ends at the newest sample (not the wall
    clock: a replay's samples are in recorded time), reading only that minute of the series."""
    if latest.newest is None:
        return {}
    rates = {}
    end = latest.newest
    for series in history.series(metric, since=end - windows.AVERAGE_SECONDS, **wanted):
        value = windows.rate(series, end)
        if value is not None:
            rates[tuple(series.labels.get(n, "") for n in label_names)] = value
    return rates


def gpus_html(latest: LatestValues, trends: Trends, decided: Decided) -> str:
    """One card per GPU. A lost GPU reports no gpu_info any more (exporters/gpu.py): it is named
    by what it reported while it answered, as GpuLost found it (Decided.lost_gpus)."""
    gpu = ("gpu", "uuid")
    identity = {tuple(labels[n] for n in gpu): labels for labels, _ in latest.all(gpu_metrics.GPU_INFO.name)}
    up = latest.keyed(gpu_metrics.GPU_UP.name, *gpu)
    keys = sorted(set(identity) | set(up), key=numeric_first)
    if not keys:
        return paragraph("No GPU seen (no NVIDIA driver, or the gpu collector is off or failing: see Agent).", "meta")
    cards = []
    for key in keys:
        info = identity.get(key) or decided.lost_gpus.get(key, {})
        title = f"GPU {key[0]} · {info.get('name') or 'model unknown'}"
        subtitle = " · ".join(part for part in (info.get("pci_bus_id") or "PCI address unknown", key[1]) if part)
        if up.get(key) == 0:
            rows: list[Row] = [("State", "lost: no NVML call on it succeeds (fell off the bus, or the driver is gone)", True)]
            plots = ""
        else:
            rows = gpu_rows(key, latest, decided)
            plots = gpu_plots(trends, key, lambda spec: latest.keyed(spec.name, *gpu).get(key),
                              decided.link_loads.get(key, {}).get(HOST_TO_DEVICE))
        cards.append(card(title, key_values(rows) + plots, subtitle))
    return f'<div class="grid">{"".join(cards)}</div>'


def gpu_rows(key: tuple[str, ...], latest: LatestValues, decided: Decided) -> list[Row]:
    def get(spec: MetricSpec) -> float | None:
        return latest.keyed(spec.name, "gpu", "uuid").get(key)

    traffic = latest.keyed(gpu_metrics.PCIE_THROUGHPUT.name, "gpu", "uuid", "direction")
    rows: list[Row] = []
    utilization = get(gpu_metrics.UTILIZATION)
    if utilization is not None:
        rows.append(("Utilization", percent(utilization), False))
    used, total = get(gpu_metrics.MEMORY_USED), get(gpu_metrics.MEMORY_TOTAL)
    if used is not None and total:
        rows.append(("Memory used", f"{human_bytes(used)} of {human_bytes(total)} ({percent(used / total)})", False))
    generation, width = get(gpu_metrics.PCIE_LINK_GENERATION), get(gpu_metrics.PCIE_LINK_WIDTH)
    loads = decided.link_loads.get(key, {})
    for direction in ("host_to_device", "device_to_host"):
        load = loads.get(direction)
        if load is not None and load.capacity is not None and load.share is not None:
            # As GpuPcieStarvation judged its last minute: the traffic against the capacity it
            # divided by (measured by `hybridmon bench`, else what copies achieve on the best
            # link of the minute).
            rows.append((f"PCIe {DIRECTIONS[direction]}", f"{human_rate(load.traffic)} of "
                         f"{human_rate(load.capacity.bytes_per_second)} {load.capacity.described} "
                         f"({percent(load.share)}) over the last minute", False))
        elif (now := traffic.get((*key, direction))) is not None:  # not judged yet: the reading alone
            rows.append((f"PCIe {DIRECTIONS[direction]}", f"{human_rate(now)} now", False))
    rows += bus_rows(decided.bus.get(key))
    best_generation, best_width = get(gpu_metrics.PCIE_LINK_MAX_GENERATION), get(gpu_metrics.PCIE_LINK_MAX_WIDTH)
    if generation and width:
        best = f" (max {link_name(best_generation, best_width)})" if best_generation and best_width else ""
        rows.append(("PCIe link", f"{link_name(generation, width)}{best}", False))
    shared = uplink_row(key, latest, decided)
    if shared is not None:
        rows.append(shared)
    replays = get(gpu_metrics.PCIE_REPLAYS)
    if replays is not None:
        rows.append(("PCIe replays", f"{replays:.0f} since the driver loaded", False))
    node = get(gpu_metrics.NUMA_NODE)  # only where GPU memory is a NUMA node (Grace)
    if node is not None:
        rows.append(("GPU memory NUMA node", f"{node:.0f}", False))
    return rows


def uplink_row(key: tuple[str, ...], latest: LatestValues, decided: Decided) -> Row | None:
    """The PCIe link this GPU shares with other GPUs behind a switch (exporters/pcie_topology.py):
    the switch port below it, its link, the GPUs sharing it, and how full PcieUplinkStarvation
    judged it over its last minute (each GPU's part of the traffic); None for a GPU with a link of
    its own to its root port."""
    index_of_bus = {labels.get("pci_bus_id"): labels["gpu"] for labels, _ in latest.all(gpu_metrics.GPU_INFO.name)}
    bus = next((bus for bus, gpu in index_of_bus.items() if gpu == key[0]), None)
    behind: dict[str, list[str]] = {}
    for labels, _ in latest.all(pcie_topology.UPLINK_INFO.name):
        behind.setdefault(labels["uplink"], []).append(labels["pci_bus_id"])
    uplink = next((port for port, buses in behind.items() if bus in buses), None)
    if uplink is None:
        return None
    others = sorted(index_of_bus.get(other, other) for other in behind[uplink] if other != bus)
    load = decided.uplinks.get((uplink,))
    generation = latest.keyed(pcie_topology.UPLINK_GENERATION.name, "uplink").get((uplink,))
    width = latest.keyed(pcie_topology.UPLINK_WIDTH.name, "uplink").get((uplink,))
    link = load.link if load is not None and load.link else (
        link_name(generation, width) if generation and width else "link state unknown")
    text = f"switch port {uplink} ({link}), shared with GPU {', '.join(others)}"
    if load is not None and load.share is not None:
        parts = ", ".join(f"GPU {gpu} {percent(part)}" for gpu, part in load.gpus if part is not None)
        text += f"; {percent(load.share)} full over the last minute ({parts} of its traffic)"
    return ("Shared PCIe uplink", text, False)


CAUSE_NAMES = {"kv_offload": "KV offload", "weights": "weights", "unattributed": "unattributed"}


def bus_rows(account: BusAccount | None) -> list[Row]:
    """Where the bus time goes: each direction's bytes by cause over the last minute, and what
    would attribute the unattributed part (flagged when it is most of a busy direction)."""
    if account is None:
        return []
    rows: list[Row] = []
    for direction, traffic in sorted(account.traffic.items()):
        if traffic <= 0:
            continue
        causes = account.causes.get(direction, {})
        parts = ", ".join(f"{CAUSE_NAMES[cause]} {human_rate(causes[cause])}"
                          for cause in BUS_CAUSES if causes.get(cause))
        rows.append((f"Bus {DIRECTIONS[direction]}", f"{human_rate(traffic)}: {parts}", False))
    if account.leads and any(account.unattributed(direction) > 0 for direction in account.traffic):
        rows.append(("Unattributed: leads", "; ".join(account.leads), False))
    return rows


def processes_html(history: History, latest: LatestValues, trends: Trends) -> str:
    watched = {(labels["pid"], labels["process_name"]): labels for labels, _ in latest.all(process.INFO.name)}
    for labels, _ in latest.all(process.RESIDENT.name):
        watched.setdefault((labels["pid"], labels["process_name"]), labels)
    if not watched:
        return paragraph("No inference process watched (none found by command line, configuration or GPU memory).", "meta")
    resident = latest.keyed(process.RESIDENT.name, *PROCESS_LABELS)
    swap = latest.keyed(process.SWAP.name, *PROCESS_LABELS)
    faults = counter_rates(history, latest, process.MAJOR_FAULTS.name, PROCESS_LABELS)
    on_gpus: dict[str, list[tuple[str, float]]] = {}
    for labels, used in latest.all(gpu_metrics.PROCESS_MEMORY_USED.name):
        on_gpus.setdefault(labels["pid"], []).append((labels["gpu"], used))
    cmdlines = {(labels["pid"], labels["process_name"]): labels["cmdline"]
                for labels, _ in latest.all(process.CMDLINE_INFO.name)}
    # process_numa's resident bytes off each GPU node of the process (the node nearest the GPU:
    # its PCI device's, never NVML's NumaNodeId), over its VmRSS: what InferenceProcessNumaMisplaced judges
    off_gpu_nodes: dict[tuple[str, str], list[tuple[str, float]]] = {}
    for labels, off in latest.all(numa.PROCESS_RESIDENT_OFF_GPU_NODE.name):
        off_gpu_nodes.setdefault((labels["pid"], labels["process_name"]), []).append((labels["gpu_node"], off))
    cards = []
    for key in sorted(watched, key=numeric_first):
        pid, process_name = key
        rows: list[Row] = []
        if key in resident:
            rows.append(("Resident", human_bytes(resident[key]), False))
        if key in swap:
            rows.append(("Swapped out", human_bytes(swap[key]), False))
        gpus = sorted(on_gpus.get(pid, []))
        rows.append(("GPU memory", ", ".join(f"{human_bytes(used)} on GPU {gpu}" for gpu, used in gpus) or "none", False))
        rate = faults.get(key)
        rows.append(("Major faults", f"{rate:.1f}/s" if rate is not None else "no rate yet (needs two samples in a minute)", False))
        off = sorted(off_gpu_nodes.get(key, []), key=numeric_first)
        if off and resident.get(key):
            shares = ", ".join(f"{percent(size / resident[key])} off node {node}" for node, size in off)
            rows.append(("Memory vs its GPUs' NUMA nodes", shares, False))
        if key in cmdlines:  # only with process.export_cmdline = true, and redacted
            rows.append(("Command line", cmdlines[key], False))
        info = watched[key]
        executable = info.get("executable", "")
        subtitle = " · ".join(part for part in (
            info.get("server", ""), info.get("model", ""),
            f"runs {executable}" if executable and executable != process_name else "",
            f"watched: {info['watch_reason']}" if info.get("watch_reason") else "",
        ) if part)
        cards.append(card(f"{process_name} · pid {pid}", key_values(rows) + process_plots(trends, pid, process_name),
                          subtitle))
    return f'<div class="grid">{"".join(cards)}</div>'


def host_html(history: History, latest: LatestValues, trends: Trends) -> str:
    def one(spec: MetricSpec) -> float | None:
        found = latest.all(spec.name)
        return found[0][1] if found else None

    rows: list[Row] = []
    available, total = one(host_memory.MEMORY_AVAILABLE), one(host_memory.MEMORY_TOTAL)
    if available is not None and total:
        rows.append(("Memory available", f"{human_bytes(available)} of {human_bytes(total)} ({percent(available / total)})", False))
    swap_total, swap_free = one(host_memory.SWAP_TOTAL), one(host_memory.SWAP_FREE)
    if swap_total == 0:
        rows.append(("Swap used", "no swap configured", False))
    elif swap_total is not None and swap_free is not None:
        rows.append(("Swap used", f"{human_bytes(swap_total - swap_free)} of {human_bytes(swap_total)}", False))
    stalled = counter_rates(history, latest, pressure.STALLED_SECONDS.name, ("scope",), resource="memory")
    for scope, meaning in (("some", "some task stalled"), ("full", "every task stalled")):
        if (scope,) in stalled:
            rows.append((f"PSI memory {scope}", f"{stalled[(scope,)] * 100:.1f} % of the last minute ({meaning})", False))
    if not rows:
        return paragraph("No host memory samples yet.", "meta")
    return card("This host", key_values(rows) + host_plots(trends))


def bench_html(latest: LatestValues, now: float) -> str:
    finished = latest.keyed(bench.TIMESTAMP.name, "gpu", "uuid")
    if not finished:
        return '<p class="meta">No benchmark yet: run <code>hybridmon bench</code>.</p>'
    link_rates = latest.keyed(bench.LINK_CAPACITY.name, "gpu", "uuid")
    contended = latest.keyed(bench.CONTENDED.name, "gpu", "uuid")
    figures = {spec.name: latest.keyed(spec.name, *bench.BANDWIDTH.label_names)
               for spec in (bench.BANDWIDTH, bench.EFFICIENCY)}
    cards = []
    for key in sorted(finished, key=numeric_first):
        results = [labels for labels in figures[bench.BANDWIDTH.name] if labels[:2] == key]
        # The largest copies stand for the link (small ones measure launch overhead).
        largest = max((as_number(labels[5]) for labels in results), default=0.0)
        rows = [bench_row(labels, figures) for labels in sorted(results, key=bench_order)
                if as_number(labels[5]) == largest]
        subtitle = " · ".join(part for part in (
            f"finished {clock_and_age(finished[key], now)}",
            f"link {human_rate(link_rates[key])} per direction" if link_rates.get(key) else "",
            f"copies of {human_bytes(largest)}" if largest else "",
            "run forced while the GPU was busy: figures understate the link" if contended.get(key) else "",
        ) if part)
        body = table(("direction", "host memory", "median", "of link"), rows) if rows else ""
        cards.append(card(f"GPU {key[0]}", body, subtitle))
    return f'<div class="grid">{"".join(cards)}</div>'


def bench_row(labels: tuple[str, ...], figures: dict[str, dict[tuple[str, ...], float]]) -> tuple[str, ...]:
    _gpu, _uuid, direction, memory, _issue, _size, placement, path = labels
    efficiency = figures[bench.EFFICIENCY.name].get(labels)
    over = ", over NVLink-C2C" if path == "c2c" else ""
    return (DIRECTIONS.get(direction, direction), f"{memory}, {placement}{over}",
            human_rate(figures[bench.BANDWIDTH.name][labels]),
            percent(efficiency) if efficiency is not None else "n/a")


def bench_order(labels: tuple[str, ...]) -> tuple:
    direction, memory, placement = labels[2], labels[3], labels[6]
    known = list(DIRECTIONS)
    return (known.index(direction) if direction in known else len(known), memory != "pinned",
            placement != "local", labels)


def numeric_first(key: tuple) -> tuple:
    """GPU indexes, pids and NUMA nodes (the first item) in numeric order: 2 before 10."""
    return (len(key[0]), key)


def as_number(label: str) -> float:
    try:
        return float(label)
    except ValueError:
        return 0.0
