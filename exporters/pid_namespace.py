"""Whether the pids NVML reports can be looked up under the agent's procfs.

NVML names GPU processes by their pid in the host's (initial) pid namespace: the driver does not
translate them into a container's namespace, which is why nvidia-smi inside a container without
`--pid=host` lists no processes (NVIDIA/nvidia-docker#179, #1460). A procfs that shows a
container's own pid namespace has no entry for most of those pids, and the few it has belong to
unrelated processes of the container: watching them would report the wrong process's memory.

How the namespace is told apart, from files every Linux since 4.1 has:
- `NSpid:` of <procfs>/self/status lists the reader's pid in each namespace from the one that
  mounted this procfs down to the reader's own (proc(5)). Two or more entries: this procfs belongs
  to an ancestor namespace of the agent's, e.g. the host's /proc mounted at /host/proc, and shows
  host pids.
- One entry: the procfs is the agent's own namespace; it is the host's only if that namespace is
  the initial one, whose inode is PROC_PID_INIT_INO = 0xEFFFFFFC (include/linux/proc_ns.h, fixed
  since Linux 3.8): readlink <procfs>/self/ns/pid gives "pid:[4026531836]".
"""
from __future__ import annotations

import enum
import os

from hybridmon.exporters.base import ParseError
from hybridmon.exporters.sources import RawSource, ReplayedCallError, TraceMissError

INITIAL_PID_NAMESPACE_LINK = "pid:[4026531836]"


class PidView(enum.Enum):
    HOST = "host"            # NVML's pids are this procfs's pids
    CONTAINER = "container"  # this procfs is a child namespace: NVML's pids do not resolve here
    UNKNOWN = "unknown"      # the files needed to tell are missing (old kernel, restricted procfs)


MISMATCH_ADVICE = (
    "the agent's procfs ({procfs}) shows a container's pid namespace, but NVML reports GPU "
    "processes by their host pid: those pids are absent here or belong to unrelated processes, so "
    "the processes holding GPU memory are not watched (their GPU memory is still exported, by host "
    "pid). Run the agent in the host's pid namespace (Kubernetes: hostPID: true; docker/podman: "
    "--pid=host), or mount the host's /proc and point procfs at it")


def parse_nspid_depth(status_text: str) -> int:
    """How many pid namespaces the `NSpid:` line of /proc/<pid>/status lists."""
    for line in status_text.splitlines():
        if line.startswith("NSpid:"):
            entries = line[len("NSpid:"):].split()
            if not entries or not all(entry.isdigit() for entry in entries):
                raise ParseError(f"unreadable NSpid line {line[:80]!r}")
            return len(entries)
    raise ParseError("no NSpid line (kernel older than 4.1?)")


def pid_view(source: RawSource, procfs: str) -> PidView:
    """Whether pids in the host's pid namespace (NVML's) name the same processes under procfs."""
    # A trace recorded before this check holds neither reading: unknown, as on an old kernel.
    try:
        depth = parse_nspid_depth(source.read_text(os.path.join(procfs, "self", "status")))
    except (OSError, ParseError, TraceMissError):
        return PidView.UNKNOWN
    if depth >= 2:
        return PidView.HOST
    link_path = os.path.join(procfs, "self", "ns", "pid")
    try:
        link = source.call(f"os.readlink({link_path})", lambda: os.readlink(link_path))
    except (OSError, ReplayedCallError, TraceMissError):
        return PidView.UNKNOWN
    return PidView.HOST if link == INITIAL_PID_NAMESPACE_LINK else PidView.CONTAINER
