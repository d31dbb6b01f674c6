"""Builds the collectors from the configuration, each with the raw source it reads through."""
from __future__ import annotations

from typing import Callable

from hybridmon.agent.config import COLLECTOR_NAMES, AgentConfig
from hybridmon.agent.sampler import Scheduled
from hybridmon.agent.sources import RawSource
from hybridmon.exporters.bench import BenchCollector
from hybridmon.exporters.gpu import GpuCollector
from hybridmon.exporters.host_memory import HostMemoryCollector
from hybridmon.exporters.inference import inference_collector
from hybridmon.exporters.numa import NumaCollector, ProcessNumaCollector
from hybridmon.exporters.pcie import PcieCollector
from hybridmon.exporters.pressure import PressureCollector
from hybridmon.exporters.process import ProcessCollector

SourceFactory = Callable[[str], RawSource]
# First runs wait for the collectors they take their watch lists from (see Scheduled.after).
RUNS_AFTER = {"process": ("gpu",), "process_numa": ("process",), "inference": ("process",)}


def build_collectors(config: AgentConfig, source_for: SourceFactory, replay: bool = False) -> list[Scheduled]:
    """One Scheduled per enabled collector. In a replay NVML is not loaded: the trace answers."""
    sources = {name: source_for(name) for name in COLLECTOR_NAMES}
    paths = config.paths
    gpu = GpuCollector(
        sources["gpu"],
        nvml_module=None if replay else config.gpu.nvml_module,
        max_workers=config.gpu.max_workers,
    )
    gpu_enabled = config.collector("gpu").enabled and config.process.auto_detect_gpu_processes

    def gpu_processes() -> dict[int, str]:
        # Read through the process collector's source so a replay sees exactly what was seen live.
        if not gpu_enabled:
            return {}
        recorded = sources["process"].call(
            "agent.gpu_processes", lambda: {str(pid): name for pid, name in gpu.gpu_processes().items()}
        )
        return {int(pid): name for pid, name in recorded.items()}

    process = ProcessCollector(
        sources["process"],
        procfs=paths.procfs,
        pids=config.process.pids,
        names=config.process.names,
        cmdline_patterns=config.process.cmdline_patterns,
        gpu_processes=gpu_processes,
        discovery_interval_seconds=config.process.discovery_interval_seconds,
        export_cmdline=config.process.export_cmdline,
    )

    def watched_processes(source: RawSource = sources["process_numa"]) -> dict[int, str]:
        recorded = source.call(
            "agent.watched_processes", lambda: {str(pid): name for pid, name in process.watched().items()}
        )
        return {int(pid): name for pid, name in recorded.items()}

    collectors = [
        gpu,
        HostMemoryCollector(sources["host_memory"], procfs=paths.procfs, sysfs=paths.sysfs),
        PressureCollector(sources["pressure"], procfs=paths.procfs),
        NumaCollector(sources["numa"], sysfs=paths.sysfs),
        PcieCollector(sources["pcie"], sysfs=paths.sysfs, use_udev=None if config.pcie.udev else False,
                      monitor_events=config.pcie.udev),
        process,
        ProcessNumaCollector(sources["process_numa"], procfs=paths.procfs, sysfs=paths.sysfs,
                             watched=watched_processes),
        BenchCollector(sources["bench"], state_dir=config.resolved_state_dir()),
        inference_collector(config.inference, sources["inference"], paths.procfs,
                            watched=lambda: watched_processes(sources["inference"])),
    ]
    enabled = [c for c in collectors if config.collector(c.name).enabled]
    enabled_names = {c.name for c in enabled}
    scheduled = []
    for collector in enabled:
        interval = config.collector(collector.name).interval_seconds or collector.default_interval_seconds
        interval = max(interval, config.interval_seconds)
        after = tuple(name for name in RUNS_AFTER.get(collector.name, ()) if name in enabled_names)
        scheduled.append(Scheduled(collector, interval, sources[collector.name], after=after))
    return scheduled
