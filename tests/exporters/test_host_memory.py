import logging
import re
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmon.exporters.sources import LiveSource, RecordingSource, ReplaySource
from hybridmon.exporters.base import CollectorError, NoDataError, ParseError
from hybridmon.exporters.host_memory import (
    SETTINGS_EVERY_COLLECTIONS,
    HostMemoryCollector,
    parse_meminfo,
    parse_selected_mode,
    parse_sysctl_int,
    parse_vmstat,
    reclaim_pages,
)
from tests.support.paths import FIXTURE_HOST
from tests.support.parser_properties import ParserRow, read

GIB = 1024**3
KIB = 1024
PAGE = 4096  # the page size the fixture collectors are given
MY_FILES = (
    "proc/vmstat",
    "proc/meminfo",
    "proc/sys/vm/swappiness",
    "proc/sys/vm/dirty_ratio",
    "proc/sys/vm/dirty_background_ratio",
    "proc/sys/vm/overcommit_memory",
    "proc/sys/kernel/numa_balancing",
    "sys/kernel/mm/transparent_hugepage/enabled",
    "sys/kernel/mm/transparent_hugepage/defrag",
)

# /proc/vmstat of a 4.4 kernel (excerpt, real field order): reclaim counted per zone, with
# pgscan_direct_throttle sharing the prefix without being a zone, and no oom_kill field yet.
OLD_KERNEL_VMSTAT = """\
nr_free_pages 1931586
nr_alloc_batch 3179
nr_inactive_anon 209846
nr_active_anon 1530128
nr_dirty 1253
nr_anon_transparent_hugepages 1024
pgpgin 218451733
pgpgout 335427652
pswpin 120311
pswpout 301242
pgalloc_dma 3
pgalloc_dma32 40345821
pgalloc_normal 1632455218
pgalloc_movable 0
pgfree 1691438112
pgfault 2147835521
pgmajfault 421233
pgrefill_dma 0
pgrefill_dma32 145033
pgrefill_normal 3520321
pgrefill_movable 0
pgsteal_kswapd_dma 0
pgsteal_kswapd_dma32 254412
pgsteal_kswapd_normal 6102345
pgsteal_kswapd_movable 0
pgsteal_direct_dma 0
pgsteal_direct_dma32 1021
pgsteal_direct_normal 90344
pgsteal_direct_movable 0
pgscan_kswapd_dma 0
pgscan_kswapd_dma32 301220
pgscan_kswapd_normal 7344129
pgscan_kswapd_movable 0
pgscan_direct_dma 0
pgscan_direct_dma32 2048
pgscan_direct_normal 130512
pgscan_direct_movable 0
pgscan_direct_throttle 12
zone_reclaim_failed 0
pginodesteal 0
slabs_scanned 5734400
kswapd_inodesteal 412
compact_stall 311
thp_fault_alloc 28412
"""
# /proc/meminfo of a 3.10 kernel built without THP: no MemAvailable (3.14+), no AnonHugePages.
OLD_KERNEL_MEMINFO = """\
MemTotal:       16318588 kB
MemFree:         7726480 kB
Buffers:          190252 kB
Cached:          5303532 kB
SwapCached:          124 kB
Mlocked:               0 kB
SwapTotal:       8257532 kB
SwapFree:        8257020 kB
Dirty:               248 kB
Shmem:            279740 kB
HugePages_Total:       0
Hugepagesize:       2048 kB
"""


def read_fixture(relative: str) -> str:
    return (FIXTURE_HOST / relative).read_text()


@pytest.fixture
def host_copy(tmp_path: Path) -> Path:
    """My part of the fixture host, copied so a test can delete or garble files."""
    for relative in MY_FILES:
        target = tmp_path / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(FIXTURE_HOST / relative, target)
    return tmp_path


def collector_at(root: Path, source=None, page_size_bytes=PAGE) -> HostMemoryCollector:
    return HostMemoryCollector(source or LiveSource(), str(root / "proc"), str(root / "sys"),
                               page_size_bytes=page_size_bytes)


class PageSizeSource(LiveSource):
    """The host, except that sysconf(SC_PAGE_SIZE) answers `page_size` (an arm64 64 KiB kernel)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size

    def call(self, key, fetch):
        return self.page_size if key == "os.sysconf(SC_PAGE_SIZE)" else fetch()


def as_tuples(samples) -> list[tuple[str, tuple[str, ...], float]]:
    return [(s.spec.name, s.label_values, s.value) for s in samples]


# Parsers on fixture text.


def test_parse_vmstat_fixture() -> None:
    vmstat = parse_vmstat(read_fixture("proc/vmstat"))
    assert vmstat["pgfault"] == 52873640192
    assert vmstat["pgmajfault"] == 9842317
    assert vmstat["pswpin"] == 48213376
    assert vmstat["pswpout"] == 57386112
    assert vmstat["oom_kill"] == 3
    assert vmstat["pgscan_direct_throttle"] == 17
    assert reclaim_pages(vmstat, "pgscan") == {
        "kswapd": 598765432, "direct": 41234567, "khugepaged": 23456}
    assert reclaim_pages(vmstat, "pgsteal") == {
        "kswapd": 412345678, "direct": 23456789, "khugepaged": 12345}


def test_old_kernel_vmstat_sums_zones_and_skips_throttle() -> None:
    vmstat = parse_vmstat(OLD_KERNEL_VMSTAT)
    assert reclaim_pages(vmstat, "pgscan") == {"kswapd": 301220 + 7344129, "direct": 2048 + 130512}
    assert reclaim_pages(vmstat, "pgsteal") == {"kswapd": 254412 + 6102345, "direct": 1021 + 90344}
    assert "oom_kill" not in vmstat


def test_parse_meminfo_fixture() -> None:
    meminfo = parse_meminfo(read_fixture("proc/meminfo"))
    assert meminfo["MemTotal"] == 527988412 * KIB
    assert meminfo["MemAvailable"] == 6 * GIB
    assert meminfo["SwapTotal"] == 67108860 * KIB
    assert meminfo["SwapFree"] == 42569724 * KIB
    assert meminfo["Active(anon)"] == 245311380 * KIB
    assert meminfo["VmallocTotal"] == 34359738367 * KIB
    assert meminfo["Hugepagesize"] == 2 * 1024 * KIB
    assert "HugePages_Total" not in meminfo  # a page count, not a size


def test_parse_selected_mode() -> None:
    enabled = read_fixture("sys/kernel/mm/transparent_hugepage/enabled")
    assert parse_selected_mode(enabled) == "always"
    defrag = "always defer defer+madvise [defer+madvise] never\n"
    assert parse_selected_mode(defrag) == "defer+madvise"
    for garbage in ("always madvise never\n", "[always] [madvise]\n", "[]\n", ""):
        with pytest.raises(ParseError):
            parse_selected_mode(garbage)


def test_parse_sysctl_int() -> None:
    assert parse_sysctl_int("60\n") == 60
    assert parse_sysctl_int("-1\n") == -1
    for garbage in ("", "\n", "4\t4\t1\t7\n", "sixty\n", "1.5\n"):
        with pytest.raises(ParseError):
            parse_sysctl_int(garbage)


def test_parsers_reject_garbage() -> None:
    for parser in (parse_vmstat, parse_meminfo):
        for garbage in ("", "\n\n", "pgfault\n", "MemTotal: lots kB\n", "pgfault 12 34\n"):
            with pytest.raises(ParseError):
                parser(garbage)
    with pytest.raises(ParseError):
        parse_meminfo("MemTotal:       16318588 MB\n")


# The collector on the fixture host.


def test_collector_on_fixture_host(fixture_procfs: str, fixture_sysfs: str) -> None:
    collector = HostMemoryCollector(PageSizeSource(PAGE), fixture_procfs, fixture_sysfs)
    assert (collector.name, collector.default_interval_seconds) == ("host_memory", 1.0)
    samples = collector.collect()
    assert as_tuples(samples) == [
        ("hybridmon_memory_page_faults_total", (), 52873640192),
        ("hybridmon_memory_major_page_faults_total", (), 9842317),
        ("hybridmon_memory_oom_kills_total", (), 3),
        ("hybridmon_swap_in_bytes_total", (), 48213376 * PAGE),
        ("hybridmon_swap_out_bytes_total", (), 57386112 * PAGE),
        ("hybridmon_zswap_in_bytes_total", (), 0),
        ("hybridmon_zswap_out_bytes_total", (), 0),
        ("hybridmon_memory_reclaim_scanned_bytes_total", ("kswapd",), 598765432 * PAGE),
        ("hybridmon_memory_reclaim_scanned_bytes_total", ("direct",), 41234567 * PAGE),
        ("hybridmon_memory_reclaim_scanned_bytes_total", ("khugepaged",), 23456 * PAGE),
        ("hybridmon_memory_reclaim_stolen_bytes_total", ("kswapd",), 412345678 * PAGE),
        ("hybridmon_memory_reclaim_stolen_bytes_total", ("direct",), 23456789 * PAGE),
        ("hybridmon_memory_reclaim_stolen_bytes_total", ("khugepaged",), 12345 * PAGE),
        ("hybridmon_memory_total_bytes", (), 527988412 * KIB),
        ("hybridmon_memory_available_bytes", (), 6 * GIB),
        ("hybridmon_swap_total_bytes", (), 67108860 * KIB),
        ("hybridmon_swap_free_bytes", (), 42569724 * KIB),
        ("hybridmon_memory_mlocked_bytes", (), 16 * GIB),
        ("hybridmon_memory_shmem_bytes", (), 8 * GIB),
        ("hybridmon_memory_dirty_bytes", (), 180 * 1024 * KIB),
        ("hybridmon_memory_anon_hugepages_bytes", (), 192 * GIB),
        ("hybridmon_zswap_pool_bytes", (), 0),
        ("hybridmon_zswap_stored_bytes", (), 0),
        ("hybridmon_sysctl_value", ("vm.swappiness",), 60),
        ("hybridmon_sysctl_value", ("vm.dirty_ratio",), 20),
        ("hybridmon_sysctl_value", ("vm.dirty_background_ratio",), 10),
        ("hybridmon_sysctl_value", ("vm.overcommit_memory",), 0),
        ("hybridmon_sysctl_value", ("kernel.numa_balancing",), 1),
        ("hybridmon_transparent_hugepage_mode", ("enabled", "always"), 1),
        ("hybridmon_transparent_hugepage_mode", ("defrag", "madvise"), 1),
    ]
    assert {s.spec for s in samples} == set(collector.metric_specs)


def test_collector_on_old_kernel(host_copy: Path) -> None:
    (host_copy / "proc/vmstat").write_text(OLD_KERNEL_VMSTAT)
    (host_copy / "proc/meminfo").write_text(OLD_KERNEL_MEMINFO)
    (host_copy / "proc/sys/kernel/numa_balancing").unlink()
    shutil.rmtree(host_copy / "sys/kernel/mm/transparent_hugepage")
    samples = collector_at(host_copy).collect()
    scanned = "hybridmon_memory_reclaim_scanned_bytes_total"
    stolen = "hybridmon_memory_reclaim_stolen_bytes_total"
    assert samples.value(scanned, reclaimer="kswapd") == 7645349 * PAGE
    assert samples.value(stolen, reclaimer="direct") == 91365 * PAGE
    assert samples.find(scanned, reclaimer="khugepaged") == []
    assert samples.value("hybridmon_swap_in_bytes_total") == 120311 * PAGE
    assert samples.value("hybridmon_swap_free_bytes") == 8257020 * KIB
    for absent in ("hybridmon_memory_oom_kills_total", "hybridmon_memory_available_bytes",
                   "hybridmon_memory_anon_hugepages_bytes", "hybridmon_transparent_hugepage_mode",
                   # zswap's counters and sizes came in 5.19: absent, not 0, before
                   "hybridmon_zswap_in_bytes_total", "hybridmon_zswap_out_bytes_total",
                   "hybridmon_zswap_pool_bytes", "hybridmon_zswap_stored_bytes"):
        assert samples.find(absent) == []
    assert samples.find("hybridmon_sysctl_value", sysctl="kernel.numa_balancing") == []
    assert samples.value("hybridmon_sysctl_value", sysctl="vm.swappiness") == 60


def test_zswap_traffic_and_pool(host_copy: Path) -> None:
    """A 6.8 kernel with zswap on: zswpin/zswpout (pages, mm/vmstat.c under CONFIG_ZSWAP) are
    exported apart from pswpin/pswpout, which do not count them, and swap_in_bytes() hands the
    faulting_processes collector both; Zswap and Zswapped (kB) are the pool and what it holds."""
    vmstat = read_fixture("proc/vmstat")
    vmstat = re.sub(r"^zswpin 0$", "zswpin 7324", vmstat, flags=re.M)
    vmstat = re.sub(r"^zswpout 0$", "zswpout 7411", vmstat, flags=re.M)
    (host_copy / "proc/vmstat").write_text(vmstat)
    meminfo = read_fixture("proc/meminfo").replace("Zswap:                 0 kB", "Zswap:           1048576 kB")
    (host_copy / "proc/meminfo").write_text(meminfo.replace("Zswapped:              0 kB",
                                                            "Zswapped:        3145728 kB"))
    collector = collector_at(host_copy)
    assert collector.swap_in_bytes() is None  # nothing read yet
    samples = collector.collect()
    assert samples.value("hybridmon_zswap_in_bytes_total") == 7324 * PAGE
    assert samples.value("hybridmon_zswap_out_bytes_total") == 7411 * PAGE
    assert samples.value("hybridmon_swap_in_bytes_total") == 48213376 * PAGE
    assert samples.value("hybridmon_zswap_pool_bytes") == GIB
    assert samples.value("hybridmon_zswap_stored_bytes") == 3 * GIB
    assert collector.swap_in_bytes() == (48213376 + 7324) * PAGE


def test_swap_in_bytes_without_zswap_and_without_pswpin(host_copy: Path) -> None:
    (host_copy / "proc/vmstat").write_text(OLD_KERNEL_VMSTAT)
    collector = collector_at(host_copy)
    collector.collect()
    assert collector.swap_in_bytes() == 120311 * PAGE  # the device alone: no zswpin field
    (host_copy / "proc/vmstat").write_text("pgfault 12\npgmajfault 3\n")
    collector.collect()
    assert collector.swap_in_bytes() is None  # a vmstat without pswpin says nothing of swap


# The collector on this machine.


def test_collector_on_this_host() -> None:
    samples = HostMemoryCollector(LiveSource()).collect()
    total = samples.value("hybridmon_memory_total_bytes")
    assert total is not None and total > 0
    available = samples.value("hybridmon_memory_available_bytes")
    assert available is None or 0 <= available <= total
    swap_total = samples.value("hybridmon_swap_total_bytes")
    assert 0 <= samples.value("hybridmon_swap_free_bytes") <= swap_total
    assert samples.value("hybridmon_memory_page_faults_total") > 0
    for sysctl in ("vm.swappiness", "vm.dirty_ratio", "kernel.numa_balancing"):
        path = "/proc/sys/" + sysctl.replace(".", "/")
        expected = int(Path(path).read_text()) if os.path.exists(path) else None
        assert samples.value("hybridmon_sysctl_value", sysctl=sysctl) == expected
    for setting in ("enabled", "defrag"):
        modes = samples.find("hybridmon_transparent_hugepage_mode", setting=setting)
        path = Path("/sys/kernel/mm/transparent_hugepage") / setting
        if path.exists():
            assert [s.label_values[1] for s in modes] == [parse_selected_mode(path.read_text())]
        else:
            assert modes == []


def test_counters_do_not_go_backwards_on_this_host() -> None:
    collector = HostMemoryCollector(LiveSource())
    first, second = collector.collect(), collector.collect()
    assert second.value("hybridmon_memory_page_faults_total") >= first.value(
        "hybridmon_memory_page_faults_total")


# Missing and garbled files.


def test_vmstat_missing_leaves_meminfo_series(host_copy: Path, caplog) -> None:
    (host_copy / "proc/vmstat").unlink()
    collector = collector_at(host_copy)
    with caplog.at_level(logging.WARNING, logger="hybridmon.exporters.host_memory"):
        samples = collector.collect()
        collector.collect()
    assert samples.find("hybridmon_memory_page_faults_total") == []
    assert samples.find("hybridmon_memory_reclaim_stolen_bytes_total") == []
    assert samples.value("hybridmon_memory_total_bytes") == 527988412 * KIB
    assert samples.value("hybridmon_sysctl_value", sysctl="vm.swappiness") == 60
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "vmstat" in warnings[0]


def test_meminfo_missing_leaves_vmstat_series(host_copy: Path) -> None:
    (host_copy / "proc/meminfo").unlink()
    samples = collector_at(host_copy).collect()
    assert samples.find("hybridmon_memory_total_bytes") == []
    assert samples.value("hybridmon_memory_major_page_faults_total") == 9842317


def test_both_missing_is_no_data(host_copy: Path) -> None:
    (host_copy / "proc/vmstat").unlink()
    (host_copy / "proc/meminfo").unlink()
    with pytest.raises(NoDataError, match="vmstat.*meminfo"):
        collector_at(host_copy).collect()


def test_both_garbled_is_a_collector_error(host_copy: Path) -> None:
    (host_copy / "proc/vmstat").write_text("not vmstat at all\n")
    (host_copy / "proc/meminfo").write_text("")
    with pytest.raises(CollectorError, match="vmstat"):
        collector_at(host_copy).collect()


def test_garbled_files_leave_only_their_series_out(host_copy: Path) -> None:
    (host_copy / "proc/vmstat").write_text(read_fixture("proc/vmstat") + "\x00\x01garbage\n")
    (host_copy / "proc/sys/vm/swappiness").write_text("sixty\n")
    (host_copy / "sys/kernel/mm/transparent_hugepage/enabled").write_text("always madvise never\n")
    samples = collector_at(host_copy).collect()
    assert samples.find("hybridmon_memory_page_faults_total") == []
    assert samples.find("hybridmon_sysctl_value", sysctl="vm.swappiness") == []
    assert samples.value("hybridmon_sysctl_value", sysctl="vm.dirty_ratio") == 20
    assert samples.find("hybridmon_transparent_hugepage_mode", setting="enabled") == []
    thp_mode = "hybridmon_transparent_hugepage_mode"
    assert samples.value(thp_mode, setting="defrag", mode="madvise") == 1
    assert samples.value("hybridmon_swap_total_bytes") == 67108860 * KIB


# Record and replay.


@pytest.mark.parametrize("root", [FIXTURE_HOST, Path("/")], ids=["fixture", "this-host"])
def test_record_then_replay_gives_identical_samples(root: Path) -> None:
    recording = RecordingSource()
    recorded = collector_at(root, recording, page_size_bytes=None).collect()
    replay = ReplaySource()
    replay.load(recording.take_readings())
    assert list(collector_at(root, replay, page_size_bytes=None).collect()) == list(recorded)


# The page size: pages become bytes with the recorded host's page size, read once.


def test_page_counts_become_bytes_with_the_hosts_page_size(fixture_procfs, fixture_sysfs) -> None:
    samples = HostMemoryCollector(PageSizeSource(65536), fixture_procfs, fixture_sysfs).collect()
    assert samples.value("hybridmon_swap_out_bytes_total") == 57386112 * 65536
    assert samples.value("hybridmon_memory_reclaim_stolen_bytes_total",
                         reclaimer="direct") == 23456789 * 65536
    assert samples.value("hybridmon_memory_page_faults_total") == 52873640192  # a count


def test_collector_on_this_host_uses_its_page_size() -> None:
    pswpout = parse_vmstat(Path("/proc/vmstat").read_text())["pswpout"]
    samples = HostMemoryCollector(LiveSource()).collect()
    swapped_out = samples.value("hybridmon_swap_out_bytes_total")
    assert swapped_out % os.sysconf("SC_PAGE_SIZE") == 0
    assert pswpout * os.sysconf("SC_PAGE_SIZE") <= swapped_out  # the counter only grows


def test_page_size_is_read_once_and_replayed_as_recorded(fixture_procfs, fixture_sysfs) -> None:
    recording = RecordingSource(PageSizeSource(65536))
    recorder = HostMemoryCollector(recording, fixture_procfs, fixture_sysfs)
    replay = ReplaySource()
    replayer = HostMemoryCollector(replay, fixture_procfs, fixture_sysfs)
    for tick in range(2):
        recorded = recorder.collect()
        readings = recording.take_readings()
        calls = [reading[1] for reading in readings if reading[0] == "call"]
        assert calls == (["os.sysconf(SC_PAGE_SIZE)"] if tick == 0 else [])
        replay.load(readings)
        assert list(replayer.collect()) == list(recorded)  # 64 KiB pages, on this host too
        assert recorded.value("hybridmon_swap_in_bytes_total") == 48213376 * 65536


# Property tests (that any text raises only ParseError: tests/exporters/test_parsers_robustness.py).


names = st.text("abcdefghijklmnopqrstuvwxyz0123456789_", min_size=1, max_size=30)


@given(st.dictionaries(names, st.integers(0, 2**64 - 1), min_size=1))
def test_parse_vmstat_round_trip(fields: dict[str, int]) -> None:
    assert parse_vmstat("".join(f"{k} {v}\n" for k, v in fields.items())) == fields


@given(st.dictionaries(names, st.integers(0, 2**50), min_size=1))
def test_parse_meminfo_round_trip_in_bytes(fields: dict[str, int]) -> None:
    text = "".join(f"{(k + ':').ljust(16)}{v:>8} kB\n" for k, v in fields.items())
    assert parse_meminfo(text) == {k: v * KIB for k, v in fields.items()}


@given(st.lists(st.from_regex(r"[a-z+]{1,15}", fullmatch=True), min_size=1, max_size=6), st.data())
def test_parse_selected_mode_finds_the_bracketed_choice(modes: list[str], data) -> None:
    chosen = data.draw(st.integers(0, len(modes) - 1))
    text = " ".join(f"[{m}]" if i == chosen else m for i, m in enumerate(modes)) + "\n"
    assert parse_selected_mode(text) == modes[chosen]


@given(st.integers(-(2**63), 2**63 - 1))
def test_parse_sysctl_int_round_trip(value: int) -> None:
    assert parse_sysctl_int(f"{value}\n") == value


def _line_by_line(text: str, pattern: str, meminfo: bool):
    """parse_vmstat and parse_meminfo as they were before issue 17's whole-text match (commit
    56c5f8d): the reference their fast path must agree with, errors included."""
    fields, lines = {}, 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        match = re.fullmatch(pattern, line.strip())
        if match is None:
            return "ParseError"
        lines += 1
        if not meminfo:
            fields[match.group(1)] = int(match.group(2))
        elif match.group(3):
            fields[match.group(1)] = int(match.group(2)) * 1024
    return fields if lines else "ParseError"


_PIECES = ["nr_free_pages 5", "pswpout 12", "pswpout  -3", "MemTotal:  16 kB", "HugePages_Total: 4",
           "Mem(x): 7 kB", "MemFree:7kB", "bad line", "", "  ", "\t", "x 1\r", "x\x0b1", "\x1fx 1",
           "é 1", "x 1 kB", "Cached:       0 kB  ", "a 99999999999999999999999", "\xa0x 1", "\x1c",
           "x 1\u2028y 2"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=8), st.sampled_from(["\n", "\r\n", "\n\n", "\x1c", "\x85"]))
def test_whole_text_matching_reads_what_line_by_line_reads(pieces, newline):
    text = newline.join(pieces) + newline
    for parse, pattern, meminfo in (
            (parse_vmstat, r"([a-z0-9_]+) +(-?[0-9]{1,20})", False),
            (parse_meminfo, r"([A-Za-z0-9_()]+):[ \t]*([0-9]{1,20})(?: (kB))?", True)):
        try:
            got = parse(text)
        except ParseError:
            got = "ParseError"
        assert got == _line_by_line(text, pattern, meminfo)


# This module's parsers, each with realistic samples, for tests/exporters/test_parsers_robustness.py
# (which holds every parse_* of exporters/ to its one promised error).
PARSER_ROWS = [
    ParserRow(parse_vmstat, read(FIXTURE_HOST / "proc/vmstat")),
    ParserRow(parse_meminfo, read(FIXTURE_HOST / "proc/meminfo")),
    ParserRow(parse_selected_mode, read(FIXTURE_HOST / "sys/kernel/mm/transparent_hugepage/enabled",
                                        FIXTURE_HOST / "sys/kernel/mm/transparent_hugepage/defrag")),
    ParserRow(parse_sysctl_int, read(FIXTURE_HOST / "proc/sys/vm/swappiness")),
]


# Issue 33: the kernel's own layout of /proc/vmstat is parsed by a one-pass check and a split, any
# other by the multi-line match; both must give the same fields, and a bad line the same error.
LAYOUTS = {
    "as printed": lambda k, v: f"{k} {v}\n",
    "padded": lambda k, v: f"  {k}   {v}\t\n",
    "blank lines between": lambda k, v: f"{k} {v}\n\n",
}


@settings(max_examples=60)
@given(st.dictionaries(names, st.integers(-2**63, 2**64 - 1), min_size=1, max_size=40),
       st.sampled_from(sorted(LAYOUTS)), st.booleans())
def test_parse_vmstat_gives_the_same_fields_in_every_layout(fields: dict[str, int], layout: str,
                                                           final_newline: bool) -> None:
    text = "".join(LAYOUTS[layout](k, v) for k, v in fields.items())
    assert parse_vmstat(text if final_newline else text.rstrip("\n")) == fields


@pytest.mark.parametrize("text", ["pgfault 12\nnot a line\npgmajfault 3\n", "pgfault 12\npgmajfault 3\nx\n"])
def test_parse_vmstat_names_the_bad_line_whatever_the_layout_around_it(text: str) -> None:
    with pytest.raises(ParseError, match="vmstat line 2 is not|vmstat line 3 is not"):
        parse_vmstat(text)


def test_meminfo_with_a_blank_line_parses_as_without_it() -> None:
    text = read_fixture("proc/meminfo")
    lines = text.splitlines(keepends=True)
    with_blank = "".join(lines[:3] + ["\n"] + lines[3:])
    assert parse_meminfo(with_blank) == parse_meminfo(text)


class CountingSource(LiveSource):
    """The host, counting each file read."""

    def __init__(self) -> None:
        self.reads: list[str] = []

    def read_text(self, path: str) -> str:
        self.reads.append(path)
        return super().read_text(path)


def test_settings_are_read_every_30th_collection_and_given_in_between(host_copy: Path) -> None:
    source = CountingSource()
    collector = collector_at(host_copy, source)
    swappiness = host_copy / "proc/sys/vm/swappiness"
    seen = []
    for collection in range(2 * SETTINGS_EVERY_COLLECTIONS + 1):
        if collection == 1:
            swappiness.write_text("10\n")  # an operator's fix, just after the first collection
        seen.append(collector.collect().value("hybridmon_sysctl_value", sysctl="vm.swappiness"))
    # the fix shows at the next reading, SETTINGS_EVERY_COLLECTIONS after the first, and every
    # collection in between gives the last one (the series never goes absent)
    assert seen == [60] * SETTINGS_EVERY_COLLECTIONS + [10] * (SETTINGS_EVERY_COLLECTIONS + 1)
    assert source.reads.count(str(swappiness)) == 3
    assert source.reads.count(str(host_copy / "proc/vmstat")) == 2 * SETTINGS_EVERY_COLLECTIONS + 1
