"""Host memory: page faults, swap traffic, reclaim, OOM kills, memory sizes, memory sysctls, THP.

Reads /proc/vmstat (event counters), /proc/meminfo (sizes), five integer sysctls under /proc/sys,
and the transparent hugepage settings under /sys/kernel/mm/transparent_hugepage. On a hybrid
GPU/CPU inference host these say whether offloaded weights or KV blocks are being pushed to swap
or reclaimed from the page cache, which is what turns a fast host into a stalling one.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Callable, TypeVar

from agent.sources import RawSource
from exporters.base import CollectorError, LogOnce, MetricSpec, NoDataError, ParseError, Samples

log = logging.getLogger(__name__)
T = TypeVar("T")

PAGE_FAULTS = MetricSpec(
    "hybridmon_memory_page_faults_total",
    "Page faults, minor and major, since boot (count); pgfault in /proc/vmstat.",
    "counter",
)
MAJOR_PAGE_FAULTS = MetricSpec(
    "hybridmon_memory_major_page_faults_total",
    "Page faults that had to wait for disk or swap I/O, since boot (count); pgmajfault in "
    "/proc/vmstat.",
    "counter",
)
SWAP_IN_PAGES = MetricSpec(
    "hybridmon_swap_in_pages_total",
    "Pages read back in from swap since boot (pages); pswpin in /proc/vmstat.",
    "counter",
)
SWAP_OUT_PAGES = MetricSpec(
    "hybridmon_swap_out_pages_total",
    "Pages written out to swap since boot (pages); pswpout in /proc/vmstat.",
    "counter",
)
OOM_KILLS = MetricSpec(
    "hybridmon_memory_oom_kills_total",
    "Processes killed by the kernel OOM killer since boot (count); oom_kill in /proc/vmstat, "
    "absent on kernels before 4.13.",
    "counter",
)
RECLAIM_SCANNED_PAGES = MetricSpec(
    "hybridmon_memory_reclaim_scanned_pages_total",
    "Pages scanned by page reclaim since boot (pages), by reclaimer: kswapd (background), direct "
    "(an allocating task stalled to reclaim) or khugepaged; pgscan_<reclaimer> in /proc/vmstat, "
    "summed over the per-zone pgscan_<reclaimer>_<zone> fields on kernels before 4.8.",
    "counter",
    ("reclaimer",),
)
RECLAIM_STOLEN_PAGES = MetricSpec(
    "hybridmon_memory_reclaim_stolen_pages_total",
    "Pages actually freed by page reclaim since boot (pages), by reclaimer (kswapd, direct, "
    "khugepaged); pgsteal_<reclaimer> in /proc/vmstat, summed over the per-zone fields on kernels "
    "before 4.8.",
    "counter",
    ("reclaimer",),
)
MEMORY_TOTAL = MetricSpec(
    "hybridmon_memory_total_bytes",
    "Usable RAM, installed memory less what firmware and the kernel reserve (bytes); MemTotal in "
    "/proc/meminfo.",
    "gauge",
)
MEMORY_AVAILABLE = MetricSpec(
    "hybridmon_memory_available_bytes",
    "Memory the kernel estimates can be allocated without swapping (bytes); MemAvailable in "
    "/proc/meminfo, absent on kernels before 3.14.",
    "gauge",
)
SWAP_TOTAL = MetricSpec(
    "hybridmon_swap_total_bytes",
    "Swap space configured (bytes); SwapTotal in /proc/meminfo.",
    "gauge",
)
SWAP_FREE = MetricSpec(
    "hybridmon_swap_free_bytes",
    "Swap space unused (bytes); SwapFree in /proc/meminfo.",
    "gauge",
)
MEMORY_MLOCKED = MetricSpec(
    "hybridmon_memory_mlocked_bytes",
    "Memory locked in RAM with mlock(), which reclaim cannot touch (bytes); Mlocked in "
    "/proc/meminfo.",
    "gauge",
)
MEMORY_SHMEM = MetricSpec(
    "hybridmon_memory_shmem_bytes",
    "Shared memory and tmpfs contents, /dev/shm included (bytes); Shmem in /proc/meminfo.",
    "gauge",
)
MEMORY_DIRTY = MetricSpec(
    "hybridmon_memory_dirty_bytes",
    "Page cache modified and waiting to be written back to disk (bytes); Dirty in /proc/meminfo.",
    "gauge",
)
MEMORY_ANON_HUGEPAGES = MetricSpec(
    "hybridmon_memory_anon_hugepages_bytes",
    "Anonymous memory backed by transparent huge pages (bytes); AnonHugePages in /proc/meminfo, "
    "absent on kernels built without transparent huge pages.",
    "gauge",
)
SYSCTL_VALUE = MetricSpec(
    "hybridmon_sysctl_value",
    "Value of a memory-related kernel setting as the kernel reports it (vm.dirty_ratio is a "
    "percentage, the others are plain numbers or modes); the integer in /proc/sys/<sysctl with "
    "dots as slashes>, absent where the kernel lacks the setting.",
    "gauge",
    ("sysctl",),
)
TRANSPARENT_HUGEPAGE_MODE = MetricSpec(
    "hybridmon_transparent_hugepage_mode",
    "1 for the mode selected for a transparent huge page setting (enabled, defrag): the bracketed "
    "choice in /sys/kernel/mm/transparent_hugepage/<setting>; the modes not selected are absent.",
    "gauge",
    ("setting", "mode"),
)

_VMSTAT_COUNTERS = (
    (PAGE_FAULTS, "pgfault"),
    (MAJOR_PAGE_FAULTS, "pgmajfault"),
    (SWAP_IN_PAGES, "pswpin"),
    (SWAP_OUT_PAGES, "pswpout"),
    (OOM_KILLS, "oom_kill"),
)
_MEMINFO_GAUGES = (
    (MEMORY_TOTAL, "MemTotal"),
    (MEMORY_AVAILABLE, "MemAvailable"),
    (SWAP_TOTAL, "SwapTotal"),
    (SWAP_FREE, "SwapFree"),
    (MEMORY_MLOCKED, "Mlocked"),
    (MEMORY_SHMEM, "Shmem"),
    (MEMORY_DIRTY, "Dirty"),
    (MEMORY_ANON_HUGEPAGES, "AnonHugePages"),
)
RECLAIMERS = ("kswapd", "direct", "khugepaged")
# Zone suffixes of the pre-4.8 per-zone fields. Listed rather than matched by pattern because
# pgscan_direct_throttle shares the prefix and is not a zone.
_ZONES = ("dma", "dma32", "normal", "high", "movable", "device")
SYSCTLS = (
    "vm.swappiness",
    "vm.dirty_ratio",
    "vm.dirty_background_ratio",
    "vm.overcommit_memory",
    "kernel.numa_balancing",
)
THP_SETTINGS = ("enabled", "defrag")

_VMSTAT_LINE = re.compile(r"([a-z0-9_]+) +(-?[0-9]+)")
_MEMINFO_LINE = re.compile(r"([A-Za-z0-9_()]+):[ \t]*([0-9]+)(?: (kB))?")
_SELECTED_MODE = re.compile(r"\[([^\[\]\s]+)\]")
_SYSCTL_INT = re.compile(r"-?[0-9]+")


def parse_vmstat(text: str) -> dict[str, int]:
    """/proc/vmstat as {field: value}; every line is `name value`."""
    fields: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        match = _VMSTAT_LINE.fullmatch(line.strip())
        if match is None:
            raise ParseError(f"vmstat line {number} is not `name value`: {line[:80]!r}")
        fields[match.group(1)] = int(match.group(2))
    if not fields:
        raise ParseError("vmstat holds no fields")
    return fields


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo sizes as {field: bytes}; the file's `kB` means KiB.

    Fields printed without a unit (the HugePages_ page counts) are not sizes and are left out.
    """
    sizes: dict[str, int] = {}
    lines = 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        match = _MEMINFO_LINE.fullmatch(line.strip())
        if match is None:
            raise ParseError(f"meminfo line {number} is not `Name: value [kB]`: {line[:80]!r}")
        lines += 1
        name, value, unit = match.groups()
        if unit:
            sizes[name] = int(value) * 1024
    if not lines:
        raise ParseError("meminfo holds no fields")
    return sizes


def parse_selected_mode(text: str) -> str:
    """The bracketed choice of a sysfs mode file such as `always [madvise] never`."""
    choices = _SELECTED_MODE.findall(text)
    if len(choices) != 1:
        raise ParseError(f"expected one [selected] mode, found {len(choices)}: {text[:80]!r}")
    return choices[0]


def parse_sysctl_int(text: str) -> int:
    """A sysctl file holding one integer, such as /proc/sys/vm/swappiness."""
    match = _SYSCTL_INT.fullmatch(text.strip())
    if match is None:
        raise ParseError(f"sysctl value is not one integer: {text[:80]!r}")
    return int(match.group(0))


def reclaim_pages(vmstat: dict[str, int], kind: str) -> dict[str, int]:
    """Pages per reclaimer for kind `pgscan` or `pgsteal`; reclaimers the kernel lacks are left out.

    Kernels since 4.8 count per node (`pgscan_kswapd`); older ones per zone (`pgscan_kswapd_normal`,
    `pgscan_kswapd_dma32`, ...), which are summed.
    """
    pages: dict[str, int] = {}
    for reclaimer in RECLAIMERS:
        field = f"{kind}_{reclaimer}"
        if field in vmstat:
            pages[reclaimer] = vmstat[field]
            continue
        zoned = [vmstat[f"{field}_{zone}"] for zone in _ZONES if f"{field}_{zone}" in vmstat]
        if zoned:
            pages[reclaimer] = sum(zoned)
    return pages


class HostMemoryCollector:
    name = "host_memory"
    default_interval_seconds = 1.0
    metric_specs = (
        *(spec for spec, _ in _VMSTAT_COUNTERS),
        RECLAIM_SCANNED_PAGES,
        RECLAIM_STOLEN_PAGES,
        *(spec for spec, _ in _MEMINFO_GAUGES),
        SYSCTL_VALUE,
        TRANSPARENT_HUGEPAGE_MODE,
    )

    def __init__(self, source: RawSource, procfs: str = "/proc", sysfs: str = "/sys") -> None:
        self._source = source
        self._procfs = procfs
        self._sysfs = sysfs
        self._log_once = LogOnce(log)

    def collect(self) -> Samples:
        samples = Samples()
        vmstat_path = os.path.join(self._procfs, "vmstat")
        meminfo_path = os.path.join(self._procfs, "meminfo")
        vmstat, vmstat_error = self._read(vmstat_path, parse_vmstat)
        meminfo, meminfo_error = self._read(meminfo_path, parse_meminfo)
        if vmstat is None and meminfo is None:
            message = (
                f"cannot read {vmstat_path} ({_reason(vmstat_error)}) nor {meminfo_path} "
                f"({_reason(meminfo_error)})"
            )
            if isinstance(vmstat_error, OSError) and isinstance(meminfo_error, OSError):
                raise NoDataError(f"{message}: is procfs mounted at {self._procfs}?")
            raise CollectorError(message)
        if vmstat is not None:
            for spec, field in _VMSTAT_COUNTERS:
                samples.add(spec, vmstat.get(field))
            for reclaimer, pages in reclaim_pages(vmstat, "pgscan").items():
                samples.add(RECLAIM_SCANNED_PAGES, pages, reclaimer)
            for reclaimer, pages in reclaim_pages(vmstat, "pgsteal").items():
                samples.add(RECLAIM_STOLEN_PAGES, pages, reclaimer)
        if meminfo is not None:
            for spec, field in _MEMINFO_GAUGES:
                samples.add(spec, meminfo.get(field))
        for sysctl in SYSCTLS:
            path = os.path.join(self._procfs, "sys", *sysctl.split("."))
            value, _ = self._read(path, parse_sysctl_int, logging.INFO)
            samples.add(SYSCTL_VALUE, value, sysctl)
        for setting in THP_SETTINGS:
            path = os.path.join(self._sysfs, "kernel", "mm", "transparent_hugepage", setting)
            mode, _ = self._read(path, parse_selected_mode, logging.INFO)
            if mode is not None:
                samples.add(TRANSPARENT_HUGEPAGE_MODE, 1, setting, mode)
        return samples

    def close(self) -> None:
        pass

    def _read(
        self, path: str, parser: Callable[[str], T], missing_level: int = logging.WARNING
    ) -> tuple[T | None, Exception | None]:
        """(parsed, None), or (None, the OSError or ParseError) with the reason logged once.

        Optional files (numa_balancing without NUMA, THP settings without THP) pass a lower
        missing_level: their absence is normal, while garbage in any file is not.
        """
        try:
            return parser(self._source.read_text(path)), None
        except OSError as error:
            self._log_once(f"read:{path}", "cannot read %s (%s): its series are absent", path,
                           _reason(error), level=missing_level)
            return None, error
        except ParseError as error:
            self._log_once(f"parse:{path}", "%s has an unexpected format (%s): its series are "
                           "absent", path, error)
            return None, error


def _reason(error: Exception | None) -> str:
    return getattr(error, "strerror", None) or str(error)
