"""The latest offload benchmark run per GPU (`hybridmon bench`), read from the state directory.

Reads <state_dir>/bench/latest/*.json (format: bench_runs.py), so a run made by the CLI, the HTTP
endpoint or another host's copy of the file shows up on the next collection, and the agent has
its last measurement again after a restart. The values are measurements of the past: each series
carries the run's labels and `hybridmon_bench_timestamp_seconds` says when it was taken.
"""
from __future__ import annotations

import logging
import os

from hybridmon.exporters.base import CollectorRegistration, LogOnce, MetricSpec, NoDataError, Samples
from hybridmon.exporters.bench_report import SUMMED, ReportError
from hybridmon.exporters.bench_runs import (C2C_PATH, PCIE_PATH, StoredRun, bidirectional_capacity, latest_dir,
                                            measured_capacity, parse_stored_run)
from hybridmon.exporters.sources import RawSource
from hybridmon.pcie_rates import theoretical_capacity

log = logging.getLogger(__name__)

_RESULT_LABELS = ("gpu", "uuid", "direction", "memory", "issue", "transfer_bytes", "placement", "path")
_RESULT_WHERE = (
    " Labels: direction host_to_device or device_to_host (that direction alone), "
    "host_to_device_bidirectional or device_to_host_bidirectional (that direction's own bytes over "
    "its own time while the other direction copies twice the bytes, as nvbandwidth measures; runs "
    "stored before issue 29 gave both the same bytes), or bidirectional_summed (runs stored before "
    "issue 13: both directions' bytes over the slower stream's time), memory pinned or pageable, "
    "issue queued (the copies enqueued before the clock starts: the copies alone, nvbandwidth's "
    "timing) or loop (issued back to back as a server's copy loop: the per-copy issue cost "
    "included; pageable copies always), transfer_bytes per copy, placement local (host buffers on "
    "the GPU's NUMA node), remote (on the farthest other node) or unbound (GPU node unknown), path "
    "pcie or c2c (the link the copies crossed: c2c where the GPU's NVLink-C2C link was on, GH200 "
    "and GB200).")

BANDWIDTH = MetricSpec(
    "hybridmon_bench_bandwidth_bytes_per_second",
    "Median copy bandwidth of the latest `hybridmon bench` run (bytes/s), from "
    "<state_dir>/bench/latest/<pci_bus_id>.json." + _RESULT_WHERE, "gauge", _RESULT_LABELS)
EFFICIENCY = MetricSpec(
    "hybridmon_bench_efficiency_ratio",
    "Median bandwidth of the largest copies over the theoretical rate of the link the run saw "
    "(per direction; twice it for bidirectional_summed), per direction, memory and placement; "
    "absent when the link state was not known. Smaller copies measure per-copy overhead, not the "
    "link, and their bandwidth over hybridmon_bench_link_capacity_bytes_per_second gives theirs.",
    "gauge", _RESULT_LABELS)
LINK_CAPACITY = MetricSpec(
    "hybridmon_bench_link_capacity_bytes_per_second",
    "Theoretical per-direction rate of the PCIe link during the run (bytes/s): the fastest "
    "generation x width NVML reported while the copies ran.", "gauge", ("gpu", "uuid"))
TIMESTAMP = MetricSpec(
    "hybridmon_bench_timestamp_seconds",
    "When the latest benchmark run of the GPU finished (Unix time).", "gauge", ("gpu", "uuid"))
CONTENDED = MetricSpec(
    "hybridmon_bench_contended",
    "1 when the latest run was forced while the GPU was in use (its figures understate the link), "
    "else 0.", "gauge", ("gpu", "uuid"))
MEASURED_CAPACITY = MetricSpec(
    "hybridmon_gpu_pcie_measured_capacity_bytes_per_second",
    "What this host's link delivers per direction (bytes/s): the median of the largest pinned copy "
    "in one direction at a time (direction host_to_device or device_to_host) with NUMA-local host "
    "buffers in the latest benchmark run. GpuPcieStarvation divides traffic by it instead of the "
    "theoretical rate when present. Absent for a contended run, for a MIG instance's run and for "
    "a run over NVLink-C2C (hybridmon_gpu_c2c_measured_capacity_bytes_per_second instead).",
    "gauge", ("gpu", "uuid", "direction"))
MEASURED_BIDIRECTIONAL_CAPACITY = MetricSpec(
    "hybridmon_gpu_pcie_measured_bidirectional_capacity_bytes_per_second",
    "What one direction of this host's link delivers while the other direction copies too "
    "(bytes/s): the median of that direction's own bytes over its own time while the opposite "
    "direction copies twice the bytes, for the largest pinned copy with NUMA-local host buffers in "
    "the latest benchmark run (nvbandwidth's host_to_device_bidirectional_memcpy_ce / "
    "device_to_host_bidirectional_memcpy_ce). Absent when "
    "hybridmon_gpu_pcie_measured_capacity_bytes_per_second is, when the opposite direction stopped "
    "first, and for runs stored before issue 29 (their slower direction ran its tail alone).",
    "gauge", ("gpu", "uuid", "direction"))

C2C_MEASURED_CAPACITY = MetricSpec(
    "hybridmon_gpu_c2c_measured_capacity_bytes_per_second",
    "What this host's NVLink-C2C link delivers per direction (bytes/s): as "
    "hybridmon_gpu_pcie_measured_capacity_bytes_per_second, for a run taken while the GPU's C2C "
    "link was on (GH200, GB200: the copies crossed C2C, not PCIe). GpuC2cStarvation divides C2C "
    "traffic by it instead of the up links' maximum bandwidth x the share copies achieve.",
    "gauge", ("gpu", "uuid", "direction"))


class BenchCollector:
    name = "bench"
    default_interval_seconds = 30.0
    metric_specs = (BANDWIDTH, EFFICIENCY, LINK_CAPACITY, TIMESTAMP,
                    CONTENDED, MEASURED_CAPACITY, MEASURED_BIDIRECTIONAL_CAPACITY, C2C_MEASURED_CAPACITY)

    def __init__(self, source: RawSource, state_dir: str | os.PathLike[str]) -> None:
        self._source = source
        self._directory = str(latest_dir(state_dir))
        self._log_once = LogOnce(log)
        # path -> (its text, the samples it gave): a result file is written once per benchmark
        # run and read every 30 s; parsing and validating the same JSON again was most of this
        # collector's cost (issue 17). Still read through the source, so a trace holds it.
        self._read: dict[str, tuple[str, Samples]] = {}

    def collect(self) -> Samples:
        try:
            names = self._source.list_dir(self._directory)
        except OSError as error:
            raise NoDataError(f"no benchmark results in {self._directory} "
                              f"({error.strerror or error}): run `hybridmon bench`") from None
        samples, read = Samples(), {}
        for name in names:
            if not name.endswith(".json") or name.startswith("."):
                continue
            path = os.path.join(self._directory, name)
            try:
                text = self._source.read_text(path)
                known = self._read.get(path)
                if known is None or known[0] != text:
                    known = (text, Samples())
                    self._add(known[1], parse_stored_run(text))
            except (OSError, ReportError) as error:
                # One unreadable file costs that GPU's series, not the others'.
                self._log_once(path, "ignoring benchmark result %s: %s", path, error)
                continue
            read[path] = known
            samples.extend(known[1])
        self._read = read
        return samples

    @staticmethod
    def _add(samples: Samples, run: StoredRun) -> None:
        gpu = str(run.gpu_index) if run.gpu_index >= 0 else run.pci_bus_id
        link = theoretical_capacity(run.link.generation, run.link.width) if run.link else None
        samples.add(TIMESTAMP, run.finished_at, gpu, run.uuid)
        samples.add(CONTENDED, 1 if run.contended else 0, gpu, run.uuid)
        samples.add(LINK_CAPACITY, link, gpu, run.uuid)
        for placement, report in run.reports.items():
            largest = max((result.transfer_bytes for result in report.results), default=0)
            for result in report.results:
                labels = (gpu, run.uuid, result.direction, result.memory, result.issue,
                          result.transfer_bytes, placement, run.path)
                samples.add(BANDWIDTH, result.median_bytes_per_second, *labels)
                # Over C2C the PCIe link's rate bounds nothing the copies did.
                if link and result.transfer_bytes == largest and run.path == PCIE_PATH:
                    limit = link * (2 if result.direction == SUMMED else 1)
                    samples.add(EFFICIENCY, result.median_bytes_per_second / limit, *labels)
        if run.contended:
            return  # a forced run beside a busy GPU would understate the capacity starvation uses
        if run.path == C2C_PATH:
            # C2C's figures, never the PCIe link's capacity. No both-ways figure: none is
            # documented for C2C to check a bench's against (pcie_rates C2C notes).
            for direction, (value, _transfer) in sorted(measured_capacity(run).items()):
                samples.add(C2C_MEASURED_CAPACITY, value, gpu, run.uuid, direction)
            return
        for spec, figures in ((MEASURED_CAPACITY, measured_capacity(run)),
                              (MEASURED_BIDIRECTIONAL_CAPACITY, bidirectional_capacity(run))):
            for direction, (value, _transfer) in sorted(figures.items()):
                samples.add(spec, value, gpu, run.uuid, direction)

    def close(self) -> None:
        pass


# No settings of its own: [bench] configures the benchmark (`hybridmon bench`, POST /api/v1/bench);
# this collector only reads the results it leaves in the state directory.
REGISTRATION = CollectorRegistration(
    BenchCollector, lambda context: BenchCollector(context.source, state_dir=context.state_dir))
