"""Trace files: what the collectors read, per run, as gzip-compressed JSON lines.

Line 1 is a header (format, version, the configuration the collectors were built from), then one
`reading` line per collector run, then an `end` line. The format is in docs/trace-format.md and
docs/trace-format.schema.json.
"""
from __future__ import annotations

import gzip
import json
import logging
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from hybridmon import __version__
from hybridmon.exporters.base import LogOnce
from hybridmon.exporters.jsonsafe import loads_bounded

FORMAT_NAME = "hybridmon-trace"
# Flush the gzip stream this often, so a recorder that is killed loses at most this much.
FLUSH_EVERY_SECONDS = 5.0
FORMAT_VERSION = 1
MAX_LINE_BYTES = 32 * 1024 * 1024
"""Longest line read or written. One collector run is one line; the largest are the inference
collector's, at most 8 MiB of body per endpoint (exporters/inference.py), and a big server's
numa_maps, under 1 MiB. Reading a line allocates several times its length, so without a bound a
1 MB gzip member that inflates to one 1 GB line would take gigabytes before it could be refused."""
EARLIEST_TIME, LATEST_TIME = 0.0, 1e10
"""Reading times accepted, in Unix seconds: 1970 to 2286. Recorders write time.time() (tests use
small times from 0); anything past 1e10 comes from no clock, and near 1e16 subtracting a minute
no longer changes a float, which would stall every window computed from it."""

log = logging.getLogger(__name__)


class TraceError(Exception):
    """The trace cannot be used; the message says why."""


class LineTooLong(ValueError):
    """A line the writer refuses: longer than MAX_LINE_BYTES."""


@dataclass(frozen=True)
class TraceRecord:
    collector: str
    time: float
    readings: list


class TraceWriter:
    """Writes a trace; safe to call from several collector threads."""

    def __init__(self, path: str | Path, config: dict[str, Any], clock=time.monotonic) -> None:
        self.path = Path(path)
        self.error: str | None = None
        self._lock = threading.Lock()
        self._records = 0
        self.skipped = 0  # runs too large to record
        self._log_once = LogOnce(log)
        self._clock = clock
        self._last_flush = clock()
        try:
            self._file = gzip.open(self.path, "wt", encoding="utf-8")
        except OSError as error:
            # the system refused (a missing directory, a read-only file system): an OSError, which
            # `hybridmon record` answers with EX_IOERR, not the EX_DATAERR of a bad trace to read
            raise OSError(f"cannot write trace {self.path}: {error.strerror}") from None
        self._write({
            "kind": "header",
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "created": time.time(),
            "hybridmon_version": __version__,
            "config": config,
        })

    def _write(self, line: dict) -> None:
        text = json.dumps(line, separators=(",", ":"))  # ASCII only: a character is a byte
        if len(text) >= MAX_LINE_BYTES:
            # What the reader would refuse is never written: the trace stays replayable.
            raise LineTooLong(f"a {line.get('kind')} line of {line.get('collector', 'the trace')} is "
                              f"{len(text):,} bytes, over the {MAX_LINE_BYTES:,} a trace line may hold")
        self._file.write(text + "\n")

    def write(self, collector: str, at: float, readings: list) -> None:
        """Append one collector run; a write error (disk full) ends the recording, logged once."""
        with self._lock:
            if self._file.closed:
                return
            try:
                self._write({"kind": "reading", "collector": collector, "time": at, "readings": readings})
                self._records += 1
                if self._clock() - self._last_flush >= FLUSH_EVERY_SECONDS:
                    self._file.flush()
                    self._last_flush = self._clock()
            except LineTooLong as error:
                self.skipped += 1
                self._log_once(collector, "a run is left out of the recording: %s", error)
            except (OSError, ValueError) as error:
                self.error = f"recording stopped after {self._records} records: cannot write {self.path}: {error}"
                log.error("%s", self.error)
                self._close_quietly()

    def close(self) -> None:
        with self._lock:
            if self._file.closed:
                return
            try:
                self._write({"kind": "end", "time": time.time(), "records": self._records})
                self._file.close()
            except OSError as error:
                self.error = self.error or f"cannot finish {self.path}: {error}"
                log.error("%s", self.error)
                self._close_quietly()

    def _close_quietly(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass


class TraceReader:
    """Reads a trace written by TraceWriter, checking its header; tolerates a cut-off end.

    Every line is checked before use: at most MAX_LINE_BYTES long, JSON nested at most
    DEFAULT_MAX_DEPTH deep, times finite and within [EARLIEST_TIME, LATEST_TIME]; anything else is
    a TraceError naming the line. A collector's run older than its previous one is skipped and
    counted in `skipped_backwards` (logged once per collector): the windows the detectors compute
    assume each series' times ascend, and a live collector never runs back in time.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.truncated = False
        self.skipped_backwards: dict[str, int] = {}
        lines = self._lines()
        try:
            _number, header = next(lines)
        except StopIteration:
            raise TraceError(f"{self.path} is empty: not a hybridmon trace") from None
        finally:
            lines.close()
        if header.get("kind") != "header" or header.get("format") != FORMAT_NAME:
            raise TraceError(f"{self.path} does not start with a hybridmon trace header")
        if header.get("version") != FORMAT_VERSION:
            raise TraceError(
                f"{self.path} is trace format version {str(header.get('version'))[:40]}; "
                f"this hybridmon reads version {FORMAT_VERSION}"
            )
        if not isinstance(header.get("config"), dict):
            raise TraceError(f"{self.path}: header has no config object")
        self.header = header

    @property
    def config(self) -> dict[str, Any]:
        return self.header["config"]

    def records(self) -> Iterator[TraceRecord]:
        self.skipped_backwards = {}
        last_time: dict[str, float] = {}
        lines = self._lines()
        if next(lines, None) is None:
            return
        for number, line in lines:
            if line.get("kind") == "end":
                return
            if line.get("kind") != "reading":
                raise TraceError(f"{self.path} line {number}: unknown line kind {str(line.get('kind'))[:40]!r}")
            record = self._checked_record(number, line)
            if record.time < last_time.get(record.collector, EARLIEST_TIME):
                skipped = self.skipped_backwards[record.collector] = (
                    self.skipped_backwards.get(record.collector, 0) + 1)
                if skipped == 1:
                    log.warning("%s line %d: a run of %s at %r is older than its previous one at %r; "
                                "skipping such runs", self.path, number, record.collector, record.time,
                                last_time[record.collector])
                continue
            last_time[record.collector] = record.time
            yield record
        self.truncated = True
        log.warning("%s ends without its end line: the recording was cut off; replaying what is there", self.path)

    def _checked_record(self, number: int, line: dict) -> TraceRecord:
        where = f"{self.path} line {number}"
        collector, at, readings = line.get("collector"), line.get("time"), line.get("readings")
        if not isinstance(collector, str) or not isinstance(readings, list):
            raise TraceError(f"{where}: a reading line lacks its collector or readings")
        if isinstance(at, bool) or not isinstance(at, (int, float)):
            raise TraceError(f"{where}: a reading line of {collector[:40]} has no numeric time")
        if not EARLIEST_TIME <= at <= LATEST_TIME:  # also false for NaN
            raise TraceError(f"{where}: a reading line of {collector[:40]} has time {at!r}, outside the "
                             f"Unix times {EARLIEST_TIME:g} to {LATEST_TIME:g} a recorder writes")
        for reading in readings:
            if not (
                isinstance(reading, list) and len(reading) == 4
                and reading[0] in ("text", "dir", "call") and isinstance(reading[1], str)
                and isinstance(reading[2], bool)
            ):
                raise TraceError(f"{where}: a reading of {collector[:40]} is not [kind, key, ok, payload]: {str(reading)[:80]}")
        return TraceRecord(collector, float(at), readings)

    def _lines(self) -> Iterator[tuple[int, dict]]:
        """(line number, object) per complete line; stops quietly at a cut-off end."""
        try:
            with gzip.open(self.path, "rb") as handle:
                number = 0
                while True:
                    try:
                        # One byte more than a line may hold tells it is too long without
                        # inflating the rest of it.
                        data = handle.readline(MAX_LINE_BYTES + 1)
                    except (EOFError, zlib.error):
                        return  # cut off mid-stream: keep what was complete
                    if not data:
                        return
                    number += 1
                    if len(data) > MAX_LINE_BYTES:
                        raise TraceError(f"{self.path} line {number} is longer than {MAX_LINE_BYTES:,} "
                                         "bytes: not a line a recorder writes")
                    if not data.endswith(b"\n"):
                        return  # last line cut off
                    try:
                        line = loads_bounded(data.decode("utf-8"), MAX_LINE_BYTES)
                    except UnicodeDecodeError as error:
                        raise TraceError(f"{self.path} line {number} is not UTF-8: {error.reason} at "
                                         f"byte {error.start}") from None
                    except ValueError as error:
                        raise TraceError(f"{self.path} line {number} is not JSON: {error}") from None
                    if not isinstance(line, dict):
                        raise TraceError(f"{self.path} line {number} is not a JSON object")
                    yield number, line
        except FileNotFoundError:
            raise TraceError(f"trace file {self.path} does not exist") from None
        except gzip.BadGzipFile:
            raise TraceError(f"{self.path} is not gzip-compressed: not a hybridmon trace") from None
        except OSError as error:
            raise TraceError(f"{self.path} cannot be read: {error}") from None
