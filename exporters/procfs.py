"""Readings of /proc that more than one collector uses: CPU lists, /proc/<pid>/status, and reading
a /proc/<pid> file while its process may exit (process.py and numa.py)."""
from __future__ import annotations

import errno
import functools
import logging
import os
import re
from dataclasses import dataclass

from hybridmon.exporters.sources import RawSource
from hybridmon.exporters.base import LogOnce, ParseError

logger = logging.getLogger(__name__)

# A sanity bound so that a garbled list like "0-99999999999" cannot make us build a huge set.
MAX_CPU_OR_NODE_ID = 1 << 20
# Digit runs are bounded: int() refuses more than 4,300 digits with a ValueError, not a ParseError.
_RANGE = re.compile(r"([0-9]{1,20})(?:-([0-9]{1,20}))?")
_STATUS_BYTES = {"VmRSS": "resident_bytes", "VmSwap": "swap_bytes", "VmLck": "locked_bytes",
                 "VmPin": "pinned_bytes"}
_GONE_ERRNOS = (errno.ENOENT, errno.ESRCH)
# The lines of /proc/<pid>/status that parse_proc_status uses: "Key:" after a "\n" (one is put
# before the first line), the last one winning as in a dict of every line. A literal "\n" first
# lets re skip to each line start; "^...$" with re.MULTILINE tried every position, 5x slower.
_STATUS_FIELD = re.compile(r"\n(Name|VmRSS|VmSwap|VmLck|VmPin|Threads|Cpus_allowed_list):([^\n]*)")
# What str.splitlines splits ASCII lines at besides "\n" (outside ASCII: \x85, \u2028, \u2029).
_OTHER_ASCII_LINE_BREAKS = ("\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e")


def parse_cpu_list(text: str) -> frozenset[int]:
    """IDs in a kernel range list such as "0-3,8,10-11" (cpulist, online, Cpus_allowed_list).

    An empty list (a node without CPUs) gives an empty set.
    """
    ids: set[int] = set()
    stripped = text.strip()
    if not stripped:
        return frozenset()
    for part in stripped.split(","):
        match = _RANGE.fullmatch(part)
        if match is None:
            raise ParseError(f"bad range {part[:40]!r} in CPU/node list {text[:80]!r}")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first or last > MAX_CPU_OR_NODE_ID:
            raise ParseError(f"bad range {part[:40]!r} in CPU/node list {text[:80]!r}")
        ids.update(range(first, last + 1))
    return frozenset(ids)


# Cpus_allowed_list is read for every watched process every second and is the same text tick
# after tick (an affinity changes at a launcher's taskset or numactl, seldom after): parsed once
# per distinct text. The sets are frozen, so callers share them; a bad list raises each time.
_allowed_cpus = functools.lru_cache(maxsize=256)(parse_cpu_list)


@dataclass(frozen=True)
class ProcessStatus:
    """The fields of /proc/<pid>/status used here; None where the kernel left one out (zombies,
    kernel threads, old kernels)."""

    resident_bytes: int | None = None
    swap_bytes: int | None = None
    locked_bytes: int | None = None
    pinned_bytes: int | None = None
    threads: int | None = None
    allowed_cpus: frozenset[int] | None = None


def parse_proc_status(text: str) -> ProcessStatus:
    """/proc/<pid>/status: "Key:\\tvalue" lines; memory sizes are in kB."""
    if text.isascii() and not any(brk in text for brk in _OTHER_ASCII_LINE_BREAKS):
        # The 7 lines used of ~55, found by one scan in C: read every tick for every watched
        # process, splitting all lines in Python was most of the process collector's parsing.
        fields = {key: value.strip() for key, value in _STATUS_FIELD.findall("\n" + text)}
    else:  # non-ASCII (a comm), or other line breaks (a garbled file): every line, as splitlines splits
        fields = {}
        for line in text.splitlines():
            key, colon, value = line.partition(":")
            if colon:
                fields[key] = value.strip()
    if "Name" not in fields:
        raise ParseError("no Name: line, not a /proc/<pid>/status file")
    values: dict[str, object] = {}
    try:
        for key, attribute in _STATUS_BYTES.items():
            if key in fields:
                number, _, unit = fields[key].partition(" ")
                if unit != "kB":
                    raise ParseError(f"{key} of /proc/<pid>/status is {fields[key][:40]!r}, not kB")
                values[attribute] = int(number) * 1024
        if "Threads" in fields:
            values["threads"] = int(fields["Threads"])
    except ValueError:  # not a number, or more digits than int() accepts
        raise ParseError("non-numeric size or count in /proc/<pid>/status") from None
    if "Cpus_allowed_list" in fields:
        values["allowed_cpus"] = _allowed_cpus(fields["Cpus_allowed_list"])
    return ProcessStatus(**values)


class ProcessGone(Exception):
    """The process exited while it was being read."""


def read_process_file(source: RawSource, procfs: str, pid: int, name: str, log_once: LogOnce) -> str | None:
    """One /proc/<pid> file: its text, None when it cannot be read (logged once), ProcessGone when
    the process has exited.

    Not exporters.base.read_parsed: a process that exits is not a failure to log, and each caller
    reads all its files before it parses any, so that an exiting process leaves no partial series.
    """
    return read_process_path(source, os.path.join(procfs, str(pid), name), pid, log_once)


def read_process_path(source: RawSource, path: str, pid: int, log_once: LogOnce) -> str | None:
    """read_process_file of a path already joined: a caller reading the same files of hundreds of
    processes every second keeps their paths (os.path.join was a sixth of the process
    collector's CPU at 256 processes)."""
    try:
        return source.read_text(path)
    except OSError as error:
        if error.errno in _GONE_ERRNOS:
            logger.debug("process %s exited while reading %s", pid, path)
            raise ProcessGone(pid) from None
        if error.errno in (errno.EACCES, errno.EPERM):
            log_once(f"denied:{pid}", "cannot read %s (%s): reading another user's process needs root "
                     "or CAP_SYS_PTRACE; its series from that file are left out", path, error.strerror)
        else:
            log_once(f"error:{path}", "cannot read %s: %s; its series are left out", path, error)
        return None
