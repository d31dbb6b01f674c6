"""Every `parse_*` in hybridmon.exporters, on any text, returns or raises the one error it documents
(ParseError; the benchmark readers' ReportError), and nothing else.

Why it matters: a collector catches that one error, logs it once and leaves the file's series out
(exporters/base.py: read_parsed). Anything else a parser lets escape (an IndexError from a short
line, the ValueError of int() on a 5000-digit number, a RecursionError from deep JSON) costs every
series of that collector and says nothing useful about the file.

The parsers are discovered, not listed, and so are their samples: the test module of each
collector lists its parsers as PARSER_ROWS (tests/support/parser_properties.ParserRow: the parser
and realistic texts it reads). A new `parse_*` without a row there fails
test_every_parser_in_exporters_has_a_row until it gets one.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import logging
import pkgutil
from typing import Any, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hybridmon.exporters
import tests.agent
import tests.exporters
from hybridmon.exporters.base import LogOnce, parse_logged
from hybridmon.exporters.host_memory import parse_meminfo
from tests.support.parser_properties import ParserRow, each_number_made_huge, only_parse_errors, read, texts_like
from tests.support.paths import FIXTURE_HOST

# The contract's own wrapper: parse_logged turns its parser's ParseError into None and must let
# nothing else through.
OWN_ROWS = [
    ParserRow(parse_logged, read(FIXTURE_HOST / "proc/meminfo"),
              call=functools.partial(parse_logged, parse_meminfo, path="/proc/meminfo",
                                     log_once=LogOnce(logging.getLogger(__name__)))),
]


def gathered_rows() -> list[ParserRow]:
    """The PARSER_ROWS of every test module of tests/exporters/ and tests/agent/, and OWN_ROWS."""
    rows = list(OWN_ROWS)
    for package in (tests.exporters, tests.agent):
        for module_info in pkgutil.iter_modules(package.__path__, f"{package.__name__}."):
            if module_info.name.rpartition(".")[2].startswith("test_") and module_info.name != __name__:
                rows += getattr(importlib.import_module(module_info.name), "PARSER_ROWS", [])
    return rows


ROWS = gathered_rows()
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


def refuses_only_as_promised(row: ParserRow, text: str) -> None:
    only_parse_errors(row.parse, text, refusal=row.refusal)


def test_every_parser_in_exporters_has_a_row():
    listed = {row.function for row in ROWS}
    discovered = discovered_parsers()
    assert len(listed) == len(ROWS), "a parser has two rows"
    missing = sorted(f"{f.__module__}.{f.__name__}" for f in discovered - listed)
    gone = sorted(f"{f.__module__}.{f.__name__}" for f in listed - discovered
                  if f.__name__.startswith("parse_"))
    assert not missing, (f"parse_* functions without a row (give each a real sample in PARSER_ROWS of "
                         f"its collector's test module): {missing}")
    assert not gone, f"rows for functions that are no longer an exporters parse_*: {gone}"


@each_row
def test_parses_its_samples(row: ParserRow):
    for sample in row.samples:
        assert row.parse(sample) is not None  # None: a parser's "nothing here", not a reading


@each_row
@settings(max_examples=60, deadline=None)  # per row: keeps the file well under 20 s on one core
@given(data=st.data())
def test_any_text_like_a_sample_is_read_or_refused_as_promised(row: ParserRow, data):
    sample = data.draw(st.sampled_from(row.samples))
    refuses_only_as_promised(row, data.draw(texts_like(sample)))


@each_row
def test_every_number_made_huge_is_read_or_refused_as_promised(row: ParserRow):
    for sample in row.samples:
        for text in each_number_made_huge(sample):
            refuses_only_as_promised(row, text)


@each_row
def test_other_files_are_read_or_refused_as_promised(row: ParserRow):
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
def test_garbage_is_read_or_refused_as_promised(row: ParserRow, garbage: str):
    refuses_only_as_promised(row, garbage)


@each_row
def test_nul_bytes_inside_a_real_file_are_read_or_refused_as_promised(row: ParserRow):
    for sample in row.samples:
        middle = len(sample) // 2
        refuses_only_as_promised(row, sample[:middle] + "\0" + sample[middle:])
        refuses_only_as_promised(row, sample.replace("\n", "\0\n"))
