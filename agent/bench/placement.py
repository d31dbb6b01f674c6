"""Where the benchmark's host buffers and copying thread go: the GPU's NUMA node and local CPUs,
within what this process may use (a container's cpuset), with a note for whatever was not bound.

nvbandwidth binds the copying thread with nvmlDeviceSetCpuAffinity before it allocates pinned
memory, so the buffers and the thread are both on the GPU's socket. hybridmon computes the same
thing from sysfs instead and hands it to the binary (`--cpus`, `--numa-node`):

- `/sys/bus/pci/devices/<bus id>/local_cpulist` is the kernel's list of the CPUs on the device's
  node, the topology NVML's ideal affinity is built from; reading it needs no NVML handle in the
  binary and is testable with a directory tree;
- nvmlDeviceSetCpuAffinity binds the calling thread to the GPU's CPUs whatever the container's
  cpuset allows, and says nothing when the two do not meet; here the GPU's CPUs are intersected
  with `Cpus_allowed_list` and the outcome is written into the stored run;
- the memory node must be in `Mems_allowed_list` (the cgroup's cpuset.mems.effective):
  set_mempolicy(MPOL_BIND) on another node fails with EINVAL, which used to fail the local run.

Both lists come from <procfs>/self/status of this process; the binary inherits its cpuset.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from hybridmon.exporters.base import ParseError
from hybridmon.exporters.procfs import parse_cpu_list

PROC_SELF_STATUS = "/proc/self/status"


@dataclass(frozen=True)
class Placement:
    """The binary's `--numa-node` and `--cpus` values and why anything was left unbound."""

    numa_node: int | None  # memory node to bind; None: not bound
    cpus: frozenset[int] | None  # CPUs to bind the copying thread to; None: not bound
    notes: tuple[str, ...]

    def arguments(self) -> list[str]:
        return ["--numa-node", "none" if self.numa_node is None else str(self.numa_node),
                "--cpus", "none" if self.cpus is None else format_cpu_list(self.cpus)]


@dataclass(frozen=True)
class Allowed:
    """What the process may use, from /proc/self/status; None where the line is missing."""

    cpus: frozenset[int] | None
    memory_nodes: frozenset[int] | None


def format_cpu_list(cpus: frozenset[int] | set[int]) -> str:
    """The kernel's cpulist form, e.g. {0, 1, 2, 5} -> "0-2,5"."""
    ranges, ordered = [], sorted(cpus)
    start = previous = None
    for cpu in ordered + [None]:
        if cpu is not None and previous is not None and cpu == previous + 1:
            previous = cpu
            continue
        if start is not None:
            ranges.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = cpu
    return ",".join(ranges)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as handle:
            return handle.read(65536).strip()
    except (OSError, UnicodeDecodeError):
        return None


def _cpu_set(text: str | None) -> frozenset[int] | None:
    if not text:
        return None
    try:
        return frozenset(parse_cpu_list(text))
    except ParseError:
        return None


def allowed(status_path: str = PROC_SELF_STATUS) -> Allowed:
    """Cpus_allowed_list and Mems_allowed_list of this process (proc(5))."""
    fields = {}
    for line in (_read(status_path) or "").splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return Allowed(_cpu_set(fields.get("Cpus_allowed_list")), _cpu_set(fields.get("Mems_allowed_list")))


def gpu_locality(sysfs: str, bus_id: str) -> tuple[int | None, frozenset[int] | None]:
    """(NUMA node, local CPUs) of a PCI device from sysfs; None where the kernel does not know
    (numa_node -1 on single-node hosts and on some VMs; local_cpulist missing or empty)."""
    device = os.path.join(sysfs, "bus/pci/devices", bus_id.lower())
    node_text = _read(os.path.join(device, "numa_node"))
    try:
        node = int(node_text) if node_text is not None else -1
    except ValueError:
        node = -1
    cpus = _cpu_set(_read(os.path.join(device, "local_cpulist")))
    return (node if node >= 0 else None), (cpus or None)


def plan(gpu_node: int | None, gpu_cpus: frozenset[int] | None, permitted: Allowed,
         memory_node: int | None = None) -> Placement:
    """Where to put the buffers (`memory_node`, default the GPU's own) and the copying thread (the
    GPU's local CPUs, narrowed to the permitted ones). Nothing is ever an error: what cannot be
    bound is left to the kernel's default and the note says so."""
    notes = []
    target = gpu_node if memory_node is None else memory_node
    if target is None:
        notes.append("no locality known (sysfs numa_node is -1 or unreadable): host memory not bound")
    elif permitted.memory_nodes is not None and target not in permitted.memory_nodes:
        notes.append(f"NUMA node {target} is outside this process's allowed memory nodes "
                     f"{format_cpu_list(permitted.memory_nodes)} (Mems_allowed_list, the "
                     "container's cpuset.mems): host memory not bound")
        target = None
    cpus = gpu_cpus
    if cpus is None:
        notes.append("no locality known (no local_cpulist in sysfs): CPUs not bound")
    elif permitted.cpus is not None:
        usable = cpus & permitted.cpus
        if not usable:
            notes.append(f"the GPU's local CPUs {format_cpu_list(cpus)} are outside this process's "
                         f"allowed CPUs {format_cpu_list(permitted.cpus)} (Cpus_allowed_list): "
                         "CPUs not bound")
            cpus = None
        elif usable != cpus:
            notes.append(f"CPUs bound to {format_cpu_list(usable)}: the GPU's local CPUs "
                         f"{format_cpu_list(cpus)} narrowed to the allowed ones")
            cpus = usable
    return Placement(target, cpus, tuple(notes))
