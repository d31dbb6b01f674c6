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

from hybridmon.exporters.sources import RawSource
from hybridmon.exporters.base import (CollectorError, CollectorRegistration, LogOnce, MetricSpec, NoDataError,
                                      ParseError, Samples, read_parsed)

log = logging.getLogger(__name__)

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
SWAP_IN_BYTES = MetricSpec(
    "hybridmon_swap_in_bytes_total",
    "Memory read back in from swap since boot (bytes); pswpin in /proc/vmstat, a count of pages, "
    "times the page size (sysconf(_SC_PAGE_SIZE): 4 KiB on x86-64, up to 64 KiB on arm64).",
    "counter",
)
SWAP_OUT_BYTES = MetricSpec(
    "hybridmon_swap_out_bytes_total",
    "Memory written out to swap since boot (bytes); pswpout in /proc/vmstat, a count of pages, "
    "times the page size (sysconf(_SC_PAGE_SIZE)).",
    "counter",
)
# zswap (Documentation/admin-guide/mm/zswap.rst) compresses pages on their way to swap into a
# RAM pool. A page it stores is not written to the swap device and a page it serves back is not
# read from it (mm/page_io.c: swap_writepage and swap_read_folio return before counting pswpout
# and pswpin), so a host thrashing through zswap shows pswpin/pswpout near zero. zswpin and zswpout
# (pages) exist from Linux 5.19 (commit f6498b776d28, "mm: zswap: add basic meminfo and vmstat
# coverage") in kernels built with CONFIG_ZSWAP (the #ifdef around them in mm/vmstat.c's
# vmstat_text); a page zswap later writes back to the device counts in zswpwb and pswpout too.
ZSWAP_IN_BYTES = MetricSpec(
    "hybridmon_zswap_in_bytes_total",
    "Memory loaded back from zswap's compressed RAM pool since boot (bytes), which pswpin does not "
    "count; zswpin in /proc/vmstat, a count of pages, times the page size (sysconf(_SC_PAGE_SIZE)). "
    "Absent on kernels before 5.19 or built without CONFIG_ZSWAP.",
    "counter",
)
ZSWAP_OUT_BYTES = MetricSpec(
    "hybridmon_zswap_out_bytes_total",
    "Memory compressed into zswap's RAM pool on its way to swap since boot (bytes), which pswpout "
    "does not count; zswpout in /proc/vmstat, a count of pages, times the page size "
    "(sysconf(_SC_PAGE_SIZE)). Absent on kernels before 5.19 or built without CONFIG_ZSWAP.",
    "counter",
)
OOM_KILLS = MetricSpec(
    "hybridmon_memory_oom_kills_total",
    "Processes killed by the kernel OOM killer since boot (count); oom_kill in /proc/vmstat, "
    "absent on kernels before 4.13.",
    "counter",
)
RECLAIM_SCANNED_BYTES = MetricSpec(
    "hybridmon_memory_reclaim_scanned_bytes_total",
    "Memory scanned by page reclaim since boot (bytes), by reclaimer: kswapd (background), direct "
    "(an allocating task stalled to reclaim) or khugepaged; pgscan_<reclaimer> in /proc/vmstat "
    "(summed over the per-zone pgscan_<reclaimer>_<zone> fields on kernels before 4.8), a count "
    "of pages, times the page size (sysconf(_SC_PAGE_SIZE)).",
    "counter",
    ("reclaimer",),
)
RECLAIM_STOLEN_BYTES = MetricSpec(
    "hybridmon_memory_reclaim_stolen_bytes_total",
    "Memory actually freed by page reclaim since boot (bytes), by reclaimer (kswapd, direct, "
    "khugepaged); pgsteal_<reclaimer> in /proc/vmstat (summed over the per-zone fields on kernels "
    "before 4.8), a count of pages, times the page size (sysconf(_SC_PAGE_SIZE)).",
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
ZSWAP_POOL = MetricSpec(
    "hybridmon_zswap_pool_bytes",
    "RAM taken by zswap's compressed pool (bytes); Zswap in /proc/meminfo, absent on kernels before "
    "5.19 or built without CONFIG_ZSWAP.",
    "gauge",
)
ZSWAP_STORED = MetricSpec(
    "hybridmon_zswap_stored_bytes",
    "Memory swapped out into zswap's pool, at its uncompressed size (bytes); Zswapped in "
    "/proc/meminfo, absent on kernels before 5.19 or built without CONFIG_ZSWAP.",
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
    (OOM_KILLS, "oom_kill"),
)
_VMSTAT_PAGE_COUNTERS = (
    (SWAP_IN_BYTES, "pswpin"),
    (SWAP_OUT_BYTES, "pswpout"),
    (ZSWAP_IN_BYTES, "zswpin"),
    (ZSWAP_OUT_BYTES, "zswpout"),
)
# Pages read back into memory from swap, from the device and from zswap's pool: what the
# faulting_processes collector's scan waits for (swap_in_bytes()).
_SWAP_IN_FIELDS = ("pswpin", "zswpin")
_MEMINFO_GAUGES = (
    (MEMORY_TOTAL, "MemTotal"),
    (MEMORY_AVAILABLE, "MemAvailable"),
    (SWAP_TOTAL, "SwapTotal"),
    (SWAP_FREE, "SwapFree"),
    (MEMORY_MLOCKED, "Mlocked"),
    (MEMORY_SHMEM, "Shmem"),
    (MEMORY_DIRTY, "Dirty"),
    (MEMORY_ANON_HUGEPAGES, "AnonHugePages"),
    (ZSWAP_POOL, "Zswap"),
    (ZSWAP_STORED, "Zswapped"),
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
SETTINGS_EVERY_COLLECTIONS = 30
"""The sysctls and transparent hugepage modes are read at the first collection and at every 30th
after it (30 s at the default 1 s), their last reading given in between: they change only when an
operator or a tuning daemon writes them, and what judges them (host_config's static checks) has
no use for the second. Counted in collections, not seconds, so a replay reads them on the same
ticks as the recording. Seven of the collector's nine file reads a tick (issue 33)."""

# Digit runs are bounded ({1,20}: a u64 has 20 digits) so that int() never sees more than 4,300
# digits, which it refuses with a ValueError rather than a ParseError.
_VMSTAT_LINE = re.compile(r"([a-z0-9_]+) +(-?[0-9]{1,20})")
_MEMINFO_LINE = re.compile(r"([A-Za-z0-9_()]+):[ \t]*([0-9]{1,20})(?: (kB))?")
_SELECTED_MODE = re.compile(r"\[([^\[\]\s]+)\]")
_SYSCTL_INT = re.compile(r"-?[0-9]{1,20}")


# Issue 17: /proc/vmstat's ~190 lines and /proc/meminfo's ~55 are read every second; matched
# all at once in C instead of line by line in Python (320 us and 100 us a tick before). Used only
# where every line holding anything but spaces and tabs matches: no character the patterns allow
# is one that str.strip() or str.splitlines() treats apart, so those lines are exactly what the
# line-by-line parse reads. Anything else is parsed line by line, which says which line is wrong.
_VMSTAT_LINES = re.compile(r"^[ \t]*([a-z0-9_]+) +(-?[0-9]{1,20})[ \t]*$", re.MULTILINE)
_MEMINFO_LINES = re.compile(r"^[ \t]*([A-Za-z0-9_()]+):[ \t]*([0-9]{1,20})(?: (kB))?[ \t]*$", re.MULTILINE)
_NON_BLANK_LINE = re.compile(r"^[ \t]*[^ \t\n]", re.MULTILINE)


# Issue 33: /proc/vmstat as the kernel prints it (vmstat_show: "%s %lu\n" a line), checked in one
# pass that never backtracks; its fields are then the text's words, name and value by turns. Half
# the CPU of the multi-line match (~130 against ~50 us for 192 lines on the 2-vCPU VM), and it is
# parsed twice a tick: host_memory's counters and the process collector's oom_kill. Any other
# layout (blank lines, padding, a sign) takes the multi-line match and gives the same fields.
_VMSTAT_AS_PRINTED = re.compile(r"(?:[a-z0-9_]+ -?[0-9]{1,20}\n)+")


def _every_line(pattern: re.Pattern, text: str) -> list | None:
    """pattern's matches, one per line, when every non-blank line matches; None otherwise."""
    matches = pattern.findall(text)
    if not matches:
        return None
    # The patterns are anchored at both ends of a line and match no newline, so a line holds one
    # match at most: as many matches as lines is every line matched (a blank one cannot be), said
    # by counting newlines instead of a second pass of a multi-line pattern (a third of the parse).
    if len(matches) == text.count("\n") + (not text.endswith("\n")):
        return matches
    return matches if len(matches) == len(_NON_BLANK_LINE.findall(text)) else None


def parse_vmstat(text: str) -> dict[str, int]:
    """/proc/vmstat as {field: value}; every line is `name value`."""
    if _VMSTAT_AS_PRINTED.fullmatch(text):
        words = iter(text.split())
        return dict(zip(words, map(int, words)))
    matched = _every_line(_VMSTAT_LINES, text)
    if matched is not None:
        return {name: int(value) for name, value in matched}
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
    matched = _every_line(_MEMINFO_LINES, text)
    if matched is not None:
        return {name: int(value) * 1024 for name, value, unit in matched if unit}
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
        *(spec for spec, _ in _VMSTAT_PAGE_COUNTERS),
        RECLAIM_SCANNED_BYTES,
        RECLAIM_STOLEN_BYTES,
        *(spec for spec, _ in _MEMINFO_GAUGES),
        SYSCTL_VALUE,
        TRANSPARENT_HUGEPAGE_MODE,
    )

    def __init__(self, source: RawSource, procfs: str = "/proc", sysfs: str = "/sys",
                 page_size_bytes: int | None = None) -> None:
        self._source = source
        self._procfs = procfs
        self._sysfs = sysfs
        self._page_size = page_size_bytes
        self._log_once = LogOnce(log)
        self._swap_in_bytes: int | None = None
        self._settings: Samples | None = None  # the last reading of the sysctls and THP modes
        self._collections_since_settings = 0

    def swap_in_bytes(self) -> int | None:
        """Bytes read back from swap since boot (pswpin + zswpin, pages times the page size) at
        the last collection; None before one read /proc/vmstat or where it lacks pswpin."""
        return self._swap_in_bytes

    def collect(self) -> Samples:
        samples = Samples()
        vmstat_path = os.path.join(self._procfs, "vmstat")
        meminfo_path = os.path.join(self._procfs, "meminfo")
        failures: dict[str, Exception] = {}
        vmstat = read_parsed(self._source, vmstat_path, parse_vmstat, self._log_once,
                             failures=failures)
        meminfo = read_parsed(self._source, meminfo_path, parse_meminfo, self._log_once,
                              failures=failures)
        if vmstat is None and meminfo is None:
            vmstat_error, meminfo_error = failures[vmstat_path], failures[meminfo_path]
            message = (
                f"cannot read {vmstat_path} ({_reason(vmstat_error)}) nor {meminfo_path} "
                f"({_reason(meminfo_error)})"
            )
            if isinstance(vmstat_error, OSError) and isinstance(meminfo_error, OSError):
                raise NoDataError(f"{message}: is procfs mounted at {self._procfs}?")
            raise CollectorError(message)
        if vmstat is not None:
            self._add_vmstat(samples, vmstat)
        if meminfo is not None:
            for spec, field in _MEMINFO_GAUGES:
                samples.add(spec, meminfo.get(field))
        if self._settings is None or self._collections_since_settings >= SETTINGS_EVERY_COLLECTIONS:
            self._settings, self._collections_since_settings = self._read_settings(), 0
        self._collections_since_settings += 1
        samples.extend(self._settings)
        return samples

    def _read_settings(self) -> Samples:
        settings = Samples()
        for sysctl in SYSCTLS:
            path = os.path.join(self._procfs, "sys", *sysctl.split("."))
            value = read_parsed(self._source, path, parse_sysctl_int, self._log_once,
                                missing_is_normal=f"this kernel has no {sysctl}")
            settings.add(SYSCTL_VALUE, value, sysctl)
        for setting in THP_SETTINGS:
            path = os.path.join(self._sysfs, "kernel", "mm", "transparent_hugepage", setting)
            mode = read_parsed(self._source, path, parse_selected_mode, self._log_once,
                               missing_is_normal="a kernel without transparent huge pages")
            if mode is not None:
                settings.add(TRANSPARENT_HUGEPAGE_MODE, 1, setting, mode)
        return settings

    def close(self) -> None:
        pass

    def _add_vmstat(self, samples: Samples, vmstat: dict[str, int]) -> None:
        for spec, field in _VMSTAT_COUNTERS:
            samples.add(spec, vmstat.get(field))
        page = self._page_size_bytes()
        for spec, field in _VMSTAT_PAGE_COUNTERS:
            pages = vmstat.get(field)
            samples.add(spec, None if pages is None else pages * page)
        self._swap_in_bytes = (None if "pswpin" not in vmstat
                               else sum(vmstat.get(field, 0) for field in _SWAP_IN_FIELDS) * page)
        for reclaimer, pages in reclaim_pages(vmstat, "pgscan").items():
            samples.add(RECLAIM_SCANNED_BYTES, pages * page, reclaimer)
        for reclaimer, pages in reclaim_pages(vmstat, "pgsteal").items():
            samples.add(RECLAIM_STOLEN_BYTES, pages * page, reclaimer)

    def _page_size_bytes(self) -> int:
        # Read once, through the source, so that a replay converts with the recorded host's page
        # size (4 KiB on x86-64, 16 or 64 KiB on some arm64 kernels), not the replaying host's.
        if self._page_size is None:
            self._page_size = int(self._source.call("os.sysconf(SC_PAGE_SIZE)",
                                                    lambda: os.sysconf("SC_PAGE_SIZE")))
        return self._page_size


def _reason(error: Exception) -> str:
    return getattr(error, "strerror", None) or str(error)


# Essential: every Linux host has /proc/meminfo and /proc/vmstat (memory and swap); a check needs
# MemTotal and pgfault from them, as the collector succeeds on part of its files.
REGISTRATION = CollectorRegistration(
    HostMemoryCollector,
    lambda context: HostMemoryCollector(context.source, procfs=context.procfs, sysfs=context.sysfs),
    essential=True,
    essential_series=((MEMORY_TOTAL, "meminfo"), (PAGE_FAULTS, "vmstat")),
)
