"""The memory limit of a process's cgroup: what bounds its growth inside a container, a Kubernetes
pod or a systemd unit with MemoryMax, long before MemAvailable runs out.

Where the numbers are (kernel Documentation/admin-guide/cgroup-v2.rst and cgroup-v1/memory.rst):
- which cgroup: /proc/<pid>/cgroup, "0::<path>" on cgroup v2, "<n>:memory:<path>" (the memory
  controller, maybe comma-joined with others) on v1. Hosts with both (systemd's hybrid layout, as on
  the CI machine) keep the memory controller on v1; the unified tree then has no memory.max.
- where its tree is mounted: /proc/self/mountinfo (field 5 the mount point, field 4 the root the
  mount shows, which in a container is the container's own cgroup, not "/").
- the limit: v2 memory.max ("max": none), v1 memory.limit_in_bytes (no limit reads as
  PAGE_COUNTER_MAX in pages, 9223372036854771712 on 4 KiB pages);
- the usage: v2 memory.current, v1 memory.usage_in_bytes. Both count page cache, which the kernel
  reclaims before it OOM-kills, so what is judged is the working set: usage less inactive_file of
  memory.stat (v1: total_inactive_file, which includes descendants) - cAdvisor's and the kubelet's
  definition of container_memory_working_set_bytes, the figure Kubernetes evicts on.

A parent's limit bounds its children too (the pod's limit above the container's, a slice above a
service): the bound is the ancestor with the least headroom.

OOM kills of a cgroup: the `oom_kill` line of v2 memory.events ("the number of processes belonging
to this cgroup killed by any kind of OOM killer", hierarchical: its descendants' count too) or of
v1 memory.oom_control (since Linux 4.13). The process's own cgroup is read: a service's or a
container's, which holds the server and its children alone.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from hybridmon.exporters.base import MetricSpec, ParseError
from hybridmon.exporters.sources import RawSource

_PROCESS = ("pid", "process_name")
# v1 reports "no limit" as PAGE_COUNTER_MAX pages (LONG_MAX rounded down to a page); anything this
# large is no limit on any page size.
_NO_LIMIT_FROM_BYTES = 2 ** 62

CGROUP_MEMORY_LIMIT = MetricSpec(
    "hybridmon_process_cgroup_memory_limit_bytes",
    "Memory limit in bytes of the process's cgroup or of the ancestor cgroup that leaves it the "
    "least room (v2 memory.max, v1 memory.limit_in_bytes); absent when no cgroup on its path has a "
    "limit. Re-read every [process] discovery_interval_seconds. Only with [process] detail_series = "
    "true: the alerts read the headroom.", "gauge", _PROCESS)
CGROUP_MEMORY_HEADROOM = MetricSpec(
    "hybridmon_process_cgroup_memory_headroom_bytes",
    "Bytes the process's cgroup can still take before its memory limit: the limit less the working "
    "set (usage less inactive_file of memory.stat, as the kubelet computes it), in the cgroup on "
    "its path with the least room; absent when none has a limit.", "gauge", _PROCESS)


@dataclass(frozen=True)
class CgroupMount:
    """One mounted cgroup hierarchy: where it is mounted, which cgroup it shows as its root."""

    version: int          # 1 or 2
    mount_point: str
    root: str


@dataclass(frozen=True)
class CgroupMemoryBound:
    limit_bytes: float
    headroom_bytes: float
    cgroup: str           # the path of the cgroup that sets it, for a finding's text


def parse_memory_mounts(mountinfo: str) -> list[CgroupMount]:
    """The cgroup v2 mounts and the v1 mounts carrying the memory controller, from mountinfo."""
    mounts = []
    for line in mountinfo.splitlines():
        before, separator, after = line.partition(" - ")
        fields, rest = before.split(), after.split()
        if not separator or len(fields) < 5 or len(rest) < 3:
            continue
        fs_type, super_options = rest[0], rest[2].split(",")
        if fs_type == "cgroup2":
            mounts.append(CgroupMount(2, _unescape(fields[4]), _unescape(fields[3])))
        elif fs_type == "cgroup" and "memory" in super_options:
            mounts.append(CgroupMount(1, _unescape(fields[4]), _unescape(fields[3])))
    return mounts


def parse_process_cgroups(text: str) -> dict[int, str]:
    """{1: path of the v1 memory cgroup, 2: path of the v2 cgroup}, whichever the file has."""
    paths = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            paths[2] = path
        elif "memory" in controllers.split(","):
            paths[1] = path
    return paths


def parse_limit(text: str) -> float | None:
    """memory.max or memory.limit_in_bytes in bytes; None for no limit."""
    value = text.strip()
    if value == "max":
        return None
    try:
        limit = int(value)
    except ValueError:
        raise ParseError(f"memory limit {value[:40]!r} is neither a number nor 'max'") from None
    return None if limit >= _NO_LIMIT_FROM_BYTES else float(limit)


def parse_inactive_file(memory_stat: str, version: int) -> float:
    wanted = "inactive_file" if version == 2 else "total_inactive_file"
    for line in memory_stat.splitlines():
        key, _, value = line.partition(" ")
        if key == wanted:
            try:
                return float(int(value))
            except ValueError:
                break
    raise ParseError(f"no readable {wanted} line in memory.stat")


def memory_bound(source: RawSource, mounts: list[CgroupMount], process_cgroups: dict[int, str]
                 ) -> CgroupMemoryBound | None:
    """The tightest memory limit on the process's cgroup path, or None when nothing limits it.

    OSError and ParseError reach the caller: a cgroup file that vanishes mid-read (the cgroup was
    removed with its last process) or reads oddly is for it to log.
    """
    tightest = None
    for mount in mounts:
        path = process_cgroups.get(mount.version)
        directory = _directory(mount, path) if path is not None else None
        if directory is None:
            continue
        for cgroup, at in _ancestors(directory, mount.mount_point, path or "/"):
            bound = _bound_at(source, at, mount.version, cgroup)
            if bound is not None and (tightest is None or bound.headroom_bytes < tightest.headroom_bytes):
                tightest = bound
    return tightest


def _bound_at(source: RawSource, directory: str, version: int, cgroup: str) -> CgroupMemoryBound | None:
    limit_file, usage_file = (("memory.max", "memory.current") if version == 2
                              else ("memory.limit_in_bytes", "memory.usage_in_bytes"))
    try:
        limit = parse_limit(source.read_text(os.path.join(directory, limit_file)))
    except FileNotFoundError:
        return None  # the root cgroup, and v2 trees without the memory controller, have none
    if limit is None:
        return None
    usage = float(int(source.read_text(os.path.join(directory, usage_file)).strip()))
    inactive = parse_inactive_file(source.read_text(os.path.join(directory, "memory.stat")), version)
    working_set = max(usage - inactive, 0.0)
    return CgroupMemoryBound(limit, limit - working_set, cgroup)


def oom_kill_files(mounts: list[CgroupMount], process_cgroups: dict[int, str]) -> list[str]:
    """Where the OOM kills of the process's own cgroup are counted, v2 first (memory.events, then
    v1's memory.oom_control): a hybrid host's unified tree has no memory controller, so its
    memory.events is absent and the v1 file answers. Empty when no mount shows its cgroup."""
    files = []
    for version in (2, 1):
        for mount in mounts:
            path = process_cgroups.get(version)
            directory = _directory(mount, path) if mount.version == version and path is not None else None
            if directory is not None:
                files.append(os.path.join(directory, "memory.events" if version == 2 else "memory.oom_control"))
    return files


def parse_oom_kill(text: str) -> int:
    """The `oom_kill N` line of memory.events (v2) or memory.oom_control (v1)."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            try:
                return int(value.strip())
            except ValueError:
                break
    raise ParseError(f"no readable oom_kill line in {text[:80]!r}")


def _directory(mount: CgroupMount, path: str) -> str | None:
    """The directory of the process's cgroup under the mount, None when the mount cannot show it.

    A mount shows the tree below its root; a process whose cgroup lies outside it (another cgroup
    namespace: its path starts with /..) cannot be read from here.
    """
    if ".." in path.split("/"):
        return None
    root = mount.root.rstrip("/")
    if root and not (path == root or path.startswith(root + "/")):
        return None
    relative = path[len(root):].lstrip("/")
    return os.path.join(mount.mount_point, relative) if relative else mount.mount_point


def _ancestors(directory: str, mount_point: str, path: str) -> list[tuple[str, str]]:
    """(cgroup path, directory) from the process's cgroup up to the mount point."""
    chain = []
    while True:
        chain.append((path, directory))
        if os.path.normpath(directory) == os.path.normpath(mount_point) or path in ("", "/"):
            return chain
        directory, path = os.path.dirname(directory), os.path.dirname(path) or "/"


def rebase(mount_point: str, sysfs: str) -> str:
    """A mount point under /sys, seen through a configured sysfs root (/host/sys in a container)."""
    if sysfs.rstrip("/") != "/sys" and (mount_point == "/sys" or mount_point.startswith("/sys/")):
        return sysfs.rstrip("/") + mount_point[len("/sys"):]
    return mount_point


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as three octal digits (\\040 ...)."""
    return _OCTAL_ESCAPE.sub(lambda match: chr(int(match.group(1), 8)), field)


_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")
