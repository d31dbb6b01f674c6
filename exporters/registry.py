"""Every collector the agent runs: one list of the registrations declared beside each collector.

The configuration (collector names, `[collectors.<name>]`, the settings tables), the wiring, the
metrics reference (docs/metrics.md) and `hybridmon check`'s essential collectors all derive from
COLLECTORS; a test fails when an exporters/ module holds a collector that is not listed here.

The order is the agent's: collectors are built and first run in it, and a collector's factory sees
the ones before it (CollectorRegistration.runs_after names only earlier ones).
"""
from __future__ import annotations

from hybridmon.exporters import bench, faulting_processes, gpu, host_memory, inference, numa, pcie, pressure, process
from hybridmon.exporters.base import CollectorRegistration

COLLECTORS: tuple[CollectorRegistration, ...] = (
    gpu.REGISTRATION,
    host_memory.REGISTRATION,
    pressure.REGISTRATION,
    numa.REGISTRATION,
    pcie.REGISTRATION,
    process.REGISTRATION,
    faulting_processes.REGISTRATION,
    numa.PROCESS_NUMA_REGISTRATION,
    bench.REGISTRATION,
    inference.REGISTRATION,
)
NAMES: tuple[str, ...] = tuple(registration.name for registration in COLLECTORS)


def registration(name: str) -> CollectorRegistration:
    """The registration of the collector called `name`; KeyError for an unknown one."""
    for candidate in COLLECTORS:
        if candidate.name == name:
            return candidate
    raise KeyError(f"unknown collector {name!r}; known: {', '.join(NAMES)}")
