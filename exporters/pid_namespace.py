"""Whether the pids NVML reports can be looked up under the agent's procfs.

NVML names GPU processes by their pid in the host's (initial) pid namespace: the driver does not
translate them into a container's namespace, which is why nvidia-smi inside a container without
`--pid=host` lists no processes (NVIDIA/nvidia-docker#179, #1460). A procfs that shows a
container's own pid namespace has no entry for most of those pids, and the few it has belong to
unrelated processes of the container: watching them would report the wrong process's memory.

How the namespace is told apart, from files every Linux since 4.1 has (proc(5)):
- `NSpid:` of <procfs>/self/status lists the reader's pid in each namespace from the one that
  mounted this procfs down to the reader's own. One entry: the procfs is the agent's own
  namespace. Two or more: it belongs to an ancestor namespace of the agent's, e.g. a /proc
  mounted at /host/proc. An ancestor is not necessarily the host: in a nested container (a kind
  node's pod, docker-in-docker) the /proc mounted from "the host" is the outer container's.
- So the namespace the procfs shows is then named, and compared with the initial one, whose
  inode is PROC_PID_INIT_INO = 0xEFFFFFFC (include/linux/proc_ns.h, fixed since Linux 3.8):
  readlink of <procfs>/self/ns/pid (one entry: the agent's namespace is the procfs's) or of
  <procfs>/1/ns/pid (two or more: pid 1 of a procfs is the init of the namespace that mounted
  it) gives "pid:[4026531836]" for the host's. Reading another process's ns links passes a
  ptrace access check (PTRACE_MODE_READ_FSCREDS, proc(5) /proc/pid/ns/): where it is refused
  the view is UNKNOWN, not guessed.
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
    NESTED = "nested"        # an ancestor's procfs, itself a container's (kind, docker-in-docker):
                             # NVML's pids do not resolve here either
    UNKNOWN = "unknown"      # the files needed to tell are missing (old kernel, restricted procfs)


MISMATCH_ADVICE = (
    "the agent's procfs ({procfs}) shows a container's pid namespace, but NVML reports GPU "
    "processes by their host pid: those pids are absent here or belong to unrelated processes, so "
    "the processes holding GPU memory are not watched (their GPU memory is still exported, by host "
    "pid). Run the agent in the host's pid namespace (Kubernetes: hostPID: true; docker/podman: "
    "--pid=host), or mount the host's /proc and point procfs at it")
NESTED_ADVICE = (
    "the agent's procfs ({procfs}) shows an outer container's pid namespace, not the host's (a "
    "nested container: a kind node, docker-in-docker), but NVML reports GPU processes by their "
    "pid on the host: those pids are absent here or belong to unrelated processes, so the "
    "processes holding GPU memory are not watched (their GPU memory is still exported, by host "
    "pid). hostPID: true or --pid=host inside the outer container gives its namespace, not the "
    "host's: run the agent on the host itself, or mount the real host's /proc (from outside the "
    "outer container) and point procfs at it")


def advice(view: "PidView", procfs: str) -> str | None:
    """What to tell the operator, once, when NVML's pids do not resolve under procfs; else None."""
    if view is PidView.CONTAINER:
        return MISMATCH_ADVICE.format(procfs=procfs)
    if view is PidView.NESTED:
        return NESTED_ADVICE.format(procfs=procfs)
    return None


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
    # The namespace this procfs shows: the agent's own (one entry), else its pid 1's.
    owner = "self" if depth == 1 else "1"
    link_path = os.path.join(procfs, owner, "ns", "pid")
    try:
        link = source.call(f"os.readlink({link_path})", lambda: os.readlink(link_path))
    except (OSError, ReplayedCallError, TraceMissError):
        return PidView.UNKNOWN
    if link == INITIAL_PID_NAMESPACE_LINK:
        return PidView.HOST
    return PidView.CONTAINER if depth == 1 else PidView.NESTED
