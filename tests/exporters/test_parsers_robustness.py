"""Every `parse_*` in hybridmon.exporters, on any text, returns or raises the one error it documents
(ParseError; the benchmark readers' ReportError), and nothing else.

Why it matters: a collector catches that one error, logs it once and leaves the file's series out
(exporters/base.py: read_parsed). Anything else a parser lets escape (an IndexError from a short
line, the ValueError of int() on a 5000-digit number, a RecursionError from deep JSON) costs every
series of that collector and says nothing useful about the file.

The parsers are discovered, not listed: a new `parse_*` without a row in PARSERS fails
test_every_parser_in_exporters_has_a_row until it gets a realistic sample there.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import logging
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hybridmon.exporters
from hybridmon.exporters.base import LogOnce, ParseError, parse_logged
from hybridmon.exporters.bench_report import ReportError, parse_error, parse_progress, parse_report
from hybridmon.exporters.bench_runs import parse_stored_run
from hybridmon.exporters.cgroup_memory import (parse_inactive_file, parse_limit, parse_memory_mounts,
                                               parse_process_cgroups)
from hybridmon.exporters.host_memory import parse_meminfo, parse_selected_mode, parse_sysctl_int, parse_vmstat
from hybridmon.exporters.inference_formats import parse_ollama_ps, parse_prometheus, parse_with_prometheus_client
from hybridmon.exporters.inference_scrape import parse_proc_net_tcp
from hybridmon.exporters.numa import parse_node_meminfo, parse_numa_maps, parse_numastat, parse_task_stat
from hybridmon.exporters.nvml import normalize_pci_bus_id
from hybridmon.exporters.pcie import (parse_aer_counters, parse_hex_id, parse_link_speed, parse_link_width,
                                      parse_numa_node)
from hybridmon.exporters.pid_namespace import parse_nspid_depth
from hybridmon.exporters.pressure import parse_pressure
from hybridmon.exporters.process import parse_boot_time, parse_memlock_limit, parse_proc_stat
from hybridmon.exporters.procfs import parse_cpu_list, parse_proc_status
from tests.support.paths import FIXTURE_HOST, FIXTURES
from tests.support.bench_helpers import stored_run_text
from tests.support.aer_texts import OLD_KERNEL_AER, UNNAMED_BIT_AER
from tests.support.parser_properties import each_number_made_huge, only_parse_errors, texts_like

PROC = FIXTURE_HOST / "proc"
NODES = FIXTURE_HOST / "sys/devices/system/node"
GPU0 = FIXTURE_HOST / "sys/bus/pci/devices/0000:17:00.0"
GPU1 = FIXTURE_HOST / "sys/bus/pci/devices/0000:ca:00.0"
THP = FIXTURE_HOST / "sys/kernel/mm/transparent_hugepage"
INFERENCE = FIXTURES / "inference"
CGROUP = FIXTURES / "cgroup"
BENCH = FIXTURES / "bench"

PROGRESS_LINE = ('{"progress": {"step": 3, "steps": 20, "direction": "h2d", "memory": "pinned", '
                 '"bytes": 2097152}}')


@dataclass(frozen=True)
class Row:
    """One parser, the real texts it reads, and how a test calls it on a text."""

    function: Callable[..., Any]
    samples: tuple[str, ...]
    refusal: type[Exception] = ParseError
    """The one error its docstring promises for text it cannot read."""
    call: Callable[[str], Any] | None = None
    """For a parser with more arguments than the text: the text in, the other arguments fixed."""

    def parse(self, text: str) -> Any:
        return (self.call or self.function)(text)

    @property
    def id(self) -> str:
        return f"{self.function.__module__.rsplit('.', 1)[-1]}.{self.function.__name__}"


def read(*paths) -> tuple[str, ...]:
    return tuple(path.read_text() for path in paths)


PARSERS = [
    Row(parse_vmstat, read(PROC / "vmstat")),
    Row(parse_meminfo, read(PROC / "meminfo")),
    Row(parse_selected_mode, read(THP / "enabled", THP / "defrag")),
    Row(parse_sysctl_int, read(PROC / "sys/vm/swappiness")),
    Row(parse_node_meminfo, read(NODES / "node0/meminfo")),
    Row(parse_numastat, read(NODES / "node1/numastat")),
    Row(parse_numa_maps, read(PROC / "4242/numa_maps", PROC / "5151/numa_maps")),
    Row(parse_cpu_list, ("0-3,8,10-11\n",) + read(NODES / "node1/cpulist", NODES / "online")),
    Row(parse_proc_status, read(PROC / "4242/status")),
    Row(parse_proc_stat, read(PROC / "4242/stat")),
    # a thread's stat has the process stat's layout (proc(5)): the fixture's stat is a real sample
    Row(parse_task_stat, read(PROC / "4242/stat", PROC / "5151/stat")),
    Row(parse_nspid_depth, read(PROC / "4242/status") + ("NSpid:\t81234\t7\n",)),
    Row(parse_boot_time, read(PROC / "stat")),
    Row(parse_memlock_limit, read(PROC / "4242/limits")),
    Row(parse_memory_mounts, read(CGROUP / "mountinfo-hybrid")),
    Row(parse_process_cgroups, read(CGROUP / "cgroup-hybrid")),
    # limits only: "max" and v1's PAGE_COUNTER_MAX read as None (no limit), tested in test_cgroup_memory
    Row(parse_limit, ("268435456\n", "17179869184\n")),
    Row(parse_inactive_file, read(CGROUP / "memory.stat-v1"),
        call=functools.partial(parse_inactive_file, version=1)),
    Row(parse_link_speed, read(GPU0 / "current_link_speed", GPU1 / "current_link_speed")),
    Row(parse_link_width, read(GPU0 / "current_link_width", GPU1 / "current_link_width")),
    Row(parse_hex_id, read(GPU0 / "vendor", GPU0 / "device", GPU0 / "class")),
    Row(parse_numa_node, read(GPU0 / "numa_node", GPU1 / "numa_node")),
    Row(parse_aer_counters, read(GPU0 / "aer_dev_correctable", GPU0 / "aer_dev_nonfatal",
                                 GPU0 / "aer_dev_fatal") + (OLD_KERNEL_AER, UNNAMED_BIT_AER)),
    Row(parse_pressure, read(PROC / "pressure/memory", PROC / "pressure/io", PROC / "pressure/cpu")),
    Row(parse_prometheus, read(INFERENCE / "vllm-v1-names.1.prom", INFERENCE / "llamacpp.1.prom",
                               INFERENCE / "tgi.1.prom")),
    # parse_prometheus's fallback for bodies its fast path does not read (and the tests' reference)
    Row(parse_with_prometheus_client, read(INFERENCE / "vllm-v1-names.1.prom", INFERENCE / "llamacpp.1.prom",
                                           INFERENCE / "tgi.1.prom")),
    Row(parse_ollama_ps, read(INFERENCE / "ollama-ps.1.json")),
    # The fixture was written on (and the addresses are words of) a little-endian host.
    Row(parse_proc_net_tcp, read(PROC / "4242/net/tcp", PROC / "4242/net/tcp6"),
        call=functools.partial(parse_proc_net_tcp, byteorder="little")),
    Row(parse_report, read(BENCH / "report-gen4-local.json"), ReportError),
    Row(parse_error, read(BENCH / "error-no-device.json"), ReportError),
    # Anything that is not a progress line (a driver warning) is None, so it refuses nothing.
    Row(parse_progress, (PROGRESS_LINE,), ReportError),
    Row(parse_stored_run, (stored_run_text(),), ReportError),
    # parse_logged turns its parser's ParseError into None: it must let nothing else through.
    Row(parse_logged, read(PROC / "meminfo"),
        call=functools.partial(parse_logged, parse_meminfo, path="/proc/meminfo",
                               log_once=LogOnce(logging.getLogger(__name__)))),
]
# Readers under the same contract that are not named parse_*.
OTHER_READERS = [
    Row(normalize_pci_bus_id, ("00000000:17:00.0", "00000000:CA:00.0", "00010000:01:00.0")),
]
ROWS = PARSERS + OTHER_READERS
ALL_SAMPLES = [sample for row in ROWS for sample in row.samples]
each_row = pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])


def discovered_parsers() -> set[Callable[..., Any]]:
    """Every public function named parse_* defined (not just imported) in a hybridmon.exporters module."""
    found = set()
    for module_info in pkgutil.iter_modules(hybridmon.exporters.__path__, "hybridmon.exporters."):
        module = importlib.import_module(module_info.name)
        found.update(function for name, function in inspect.getmembers(module, inspect.isfunction)
                     if name.startswith("parse_") and function.__module__ == module.__name__)
    return found


def refuses_only_as_promised(row: Row, text: str) -> None:
    only_parse_errors(row.parse, text, refusal=row.refusal)


def test_every_parser_in_exporters_has_a_row():
    listed = {row.function for row in PARSERS}
    discovered = discovered_parsers()
    assert len(listed) == len(PARSERS), "a parser has two rows"
    missing = sorted(f"{f.__module__}.{f.__name__}" for f in discovered - listed)
    gone = sorted(f"{f.__module__}.{f.__name__}" for f in listed - discovered)
    assert not missing, f"parse_* functions without a row in PARSERS (give each a real sample): {missing}"
    assert not gone, f"rows in PARSERS for functions that are no longer an exporters parse_*: {gone}"


@each_row
def test_parses_its_samples(row: Row):
    for sample in row.samples:
        assert row.parse(sample) is not None  # None: a parser's "nothing here", not a reading


@each_row
@settings(max_examples=60, deadline=None)  # per row: keeps the file well under 20 s on one core
@given(data=st.data())
def test_any_text_like_a_sample_is_read_or_refused_as_promised(row: Row, data):
    sample = data.draw(st.sampled_from(row.samples))
    refuses_only_as_promised(row, data.draw(texts_like(sample)))


@each_row
def test_every_number_made_huge_is_read_or_refused_as_promised(row: Row):
    for sample in row.samples:
        for text in each_number_made_huge(sample):
            refuses_only_as_promised(row, text)


@each_row
def test_other_files_are_read_or_refused_as_promised(row: Row):
    """Another file's text in this parser: what a wrong path or a moved kernel file gives it."""
    for text in ALL_SAMPLES:
        refuses_only_as_promised(row, text)


MEGABYTE = 1024 * 1024
DIGITS = "9" * 5000  # more than int() converts (4300 digits)
GARBAGE = {
    "empty": "",
    "newline": "\n",
    "blank lines": " \n\t\n\r\n",
    "nul": "\0",
    "nul bytes": "\0" * 4096,
    "binary as utf-8": bytes(range(256)).decode("utf-8", errors="replace") * 8,
    "binary as latin-1": bytes(range(256)).decode("latin-1") * 8,
    "lone surrogate": "\ud800 \udcff\n",
    "byte order mark": "\ufeff1\n",
    "one megabyte line": "x" * MEGABYTE,
    "one megabyte of digits": "1" * MEGABYTE,
    "one megabyte of fields": "a 1 " * (MEGABYTE // 4),
    "one megabyte of separators": ": = , - [ ] ( )" * (MEGABYTE // 16),
    "json nested deeper than python recurses": "[" * 100_000,
    "json objects nested 3000 deep": '{"a":' * 3000 + "1" + "}" * 3000,
    "json number too long": DIGITS,
    "vmstat field too long": f"pgfault {DIGITS}\n",
    "meminfo field too long": f"MemTotal: {DIGITS} kB\n",
    "node meminfo field too long": f"Node 0 MemTotal: {DIGITS} kB\n",
    "numastat field too long": f"numa_hit {DIGITS}\n",
    "cpu range too long": f"0-{DIGITS}",
    "status cpu list too long": f"Name:\tx\nCpus_allowed_list:\t0-{DIGITS}\n",
}


@each_row
@pytest.mark.parametrize("garbage", GARBAGE.values(), ids=GARBAGE.keys())
def test_garbage_is_read_or_refused_as_promised(row: Row, garbage: str):
    refuses_only_as_promised(row, garbage)


@each_row
def test_nul_bytes_inside_a_real_file_are_read_or_refused_as_promised(row: Row):
    for sample in row.samples:
        middle = len(sample) // 2
        refuses_only_as_promised(row, sample[:middle] + "\0" + sample[middle:])
        refuses_only_as_promised(row, sample.replace("\n", "\0\n"))
