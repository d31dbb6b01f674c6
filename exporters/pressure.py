"""Pressure stall information (PSI): time tasks spent stalled waiting for memory, I/O or CPU.

Reads /proc/pressure/{memory,io,cpu}. Unlike swap or fault counters, PSI measures the cost the
workload actually paid: a decode loop stalled on reclaim or on swap-in shows up here first.
"""
from __future__ import annotations

import errno
import logging
import os
import re
from dataclasses import dataclass

from hybridmon.exporters.sources import RawSource
from hybridmon.exporters.base import (CollectorError, CollectorRegistration, LogOnce, MetricSpec, NoDataError,
                                      ParseError, Samples)

log = logging.getLogger(__name__)

STALLED_SECONDS = MetricSpec(
    "hybridmon_pressure_stalled_seconds_total",
    "Time since boot that tasks were stalled on a resource (seconds), by resource (memory, io, "
    "cpu) and scope: some (at least one task stalled) or full (all non-idle tasks stalled at "
    "once); total= in /proc/pressure/<resource>, microseconds converted. cpu has no full series: "
    "CPU full is undefined system-wide (the kernel defines it per cgroup), and the line "
    "/proc/pressure/cpu has printed since 5.13 is there for compatibility (zeros on current "
    "kernels).",
    "counter",
    ("resource", "scope"),
)

RESOURCES = ("memory", "io", "cpu")
SCOPES = ("some", "full")
# "CPU full is undefined at the system level, but has been reported since 5.13, so it is set to
# zero for backward compatibility" (Documentation/accounting/psi.rst, kernel commit 890d550d7dba
# "sched/psi: report zeroes for CPU full at the system level"; kernels from 5.13 without it count
# idle wake-up latency there). A series that is always 0, or noise, would only mislead.
UNDEFINED_SYSTEM_WIDE = frozenset({("cpu", "full")})
# Kernels without CONFIG_PSI lack the files; psi=0 (or CONFIG_PSI_DEFAULT_DISABLED without psi=1)
# leaves them absent or answering EOPNOTSUPP.
_PSI_OFF_ERRNOS = {errno.ENOENT, errno.EOPNOTSUPP, errno.ENOTSUP}

_SCOPE = re.compile(r"[a-z]+")
# Digit runs are bounded so that int() never sees more than 4,300 digits, which it refuses with a
# ValueError rather than a ParseError.
_FIELD = re.compile(r"([a-z0-9]+)=([0-9]{1,20}(?:\.[0-9]{1,20})?)")
_AVERAGES = ("avg10", "avg60", "avg300")


@dataclass(frozen=True, slots=True)
class PressureStall:
    """One line of a PSI file: stall share over the last 10/60/300 s (percent) and the total."""

    avg10_percent: float
    avg60_percent: float
    avg300_percent: float
    total_microseconds: int


def parse_pressure(text: str) -> dict[str, PressureStall]:
    """A /proc/pressure/<resource> file as {scope: PressureStall}.

    Each line is `<scope> avg10=<pct> avg60=<pct> avg300=<pct> total=<microseconds>`; scopes are
    some and full today, and a scope a later kernel adds is kept rather than rejected.
    """
    stalls: dict[str, PressureStall] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words:
            continue
        scope, pairs = words[0], words[1:]
        if _SCOPE.fullmatch(scope) is None:
            raise ParseError(f"pressure line {number} starts with {scope[:20]!r}, not a scope")
        if scope in stalls:
            raise ParseError(f"pressure scope {scope!r} appears twice")
        fields: dict[str, str] = {}
        for pair in pairs:
            match = _FIELD.fullmatch(pair)
            if match is None:
                raise ParseError(f"pressure line {number}: {pair[:40]!r} is not key=number")
            fields[match.group(1)] = match.group(2)
        missing = [key for key in (*_AVERAGES, "total") if key not in fields]
        if missing or "." in fields["total"]:
            raise ParseError(f"pressure line {number} lacks {missing or 'an integer total'}")
        averages = [float(fields[key]) for key in _AVERAGES]
        stalls[scope] = PressureStall(*averages, total_microseconds=int(fields["total"]))
    if "some" not in stalls:
        raise ParseError("pressure file lacks the `some` line")
    return stalls


class PressureCollector:
    name = "pressure"
    default_interval_seconds = 1.0
    metric_specs = (STALLED_SECONDS,)

    def __init__(self, source: RawSource, procfs: str = "/proc") -> None:
        self._source = source
        self._procfs = procfs
        self._log_once = LogOnce(log)

    def collect(self) -> Samples:
        samples = Samples()
        unreadable: dict[str, OSError] = {}
        for resource in RESOURCES:
            path = os.path.join(self._procfs, "pressure", resource)
            try:
                stalls = parse_pressure(self._source.read_text(path))
            except OSError as error:
                unreadable[path] = error
                continue
            except ParseError as error:
                self._log_once(f"parse:{path}", "%s has an unexpected format (%s): its series "
                               "are absent", path, error)
                continue
            for scope in SCOPES:
                stall = stalls.get(scope)
                if stall is not None and (resource, scope) not in UNDEFINED_SYSTEM_WIDE:
                    samples.add(STALLED_SECONDS, stall.total_microseconds / 1e6, resource, scope)
        if len(unreadable) == len(RESOURCES):
            path, error = next(iter(unreadable.items()))
            reason = error.strerror or str(error)
            if all(error.errno in _PSI_OFF_ERRNOS for error in unreadable.values()):
                raise NoDataError(
                    f"pressure stall information (PSI) is off: {path} cannot be read ({reason}). "
                    "It needs a kernel built with CONFIG_PSI=y; where the kernel has it but starts "
                    "it disabled (CONFIG_PSI_DEFAULT_DISABLED=y or psi=0 on the command line), "
                    "boot with psi=1."
                )
            raise CollectorError(f"cannot read {path} nor the other PSI files ({reason})")
        for path, error in unreadable.items():
            self._log_once(f"read:{path}", "cannot read %s (%s): its series are absent", path,
                           error.strerror or error)
        return samples

    def close(self) -> None:
        pass


# Essential (/proc/pressure), but its absence is a kernel setting, not a broken read: PSI is built
# but off by default on RHEL 8 and its rebuilds (psi=1 turns it on); swap_thrash, its one reader,
# judges major faults instead.
REGISTRATION = CollectorRegistration(
    PressureCollector,
    lambda context: PressureCollector(context.source, procfs=context.procfs),
    essential=True,
    may_have_no_data=True,
)
