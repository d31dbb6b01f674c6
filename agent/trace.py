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

from agent import __version__

FORMAT_NAME = "hybridmon-trace"
# Flush the gzip stream this often, so a recorder that is killed loses at most this much.
FLUSH_EVERY_SECONDS = 5.0
FORMAT_VERSION = 1

log = logging.getLogger(__name__)


class TraceError(Exception):
    """The trace cannot be used; the message says why."""


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
        self._clock = clock
        self._last_flush = clock()
        try:
            self._file = gzip.open(self.path, "wt", encoding="utf-8")
        except OSError as error:
            raise TraceError(f"cannot write trace {self.path}: {error.strerror}") from None
        self._write({
            "kind": "header",
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "created": time.time(),
            "hybridmon_version": __version__,
            "config": config,
        })

    def _write(self, line: dict) -> None:
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

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
    """Reads a trace written by TraceWriter, checking its header; tolerates a cut-off end."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.truncated = False
        lines = self._lines()
        try:
            header = next(lines)
        except StopIteration:
            raise TraceError(f"{self.path} is empty: not a hybridmon trace") from None
        if header.get("kind") != "header" or header.get("format") != FORMAT_NAME:
            raise TraceError(f"{self.path} does not start with a hybridmon trace header")
        if header.get("version") != FORMAT_VERSION:
            raise TraceError(
                f"{self.path} is trace format version {header.get('version')}; "
                f"this hybridmon reads version {FORMAT_VERSION}"
            )
        if not isinstance(header.get("config"), dict):
            raise TraceError(f"{self.path}: header has no config object")
        self.header = header

    @property
    def config(self) -> dict[str, Any]:
        return self.header["config"]

    def records(self) -> Iterator[TraceRecord]:
        lines = self._lines()
        next(lines)
        for line in lines:
            if line.get("kind") == "end":
                return
            if line.get("kind") != "reading":
                raise TraceError(f"{self.path}: unknown line kind {line.get('kind')!r}")
            yield self._checked_record(line)
        self.truncated = True
        log.warning("%s ends without its end line: the recording was cut off; replaying what is there", self.path)

    def _checked_record(self, line: dict) -> TraceRecord:
        collector, at, readings = line.get("collector"), line.get("time"), line.get("readings")
        if not isinstance(collector, str) or not isinstance(readings, list):
            raise TraceError(f"{self.path}: a reading line lacks its collector or readings")
        if isinstance(at, bool) or not isinstance(at, (int, float)):
            raise TraceError(f"{self.path}: a reading line of {collector} has no numeric time")
        for reading in readings:
            if not (
                isinstance(reading, list) and len(reading) == 4
                and reading[0] in ("text", "dir", "call") and isinstance(reading[1], str)
                and isinstance(reading[2], bool)
            ):
                raise TraceError(f"{self.path}: a reading of {collector} is not [kind, key, ok, payload]: {str(reading)[:80]}")
        return TraceRecord(collector, float(at), readings)

    def _lines(self) -> Iterator[dict]:
        try:
            with gzip.open(self.path, "rt", encoding="utf-8") as handle:
                number = 0
                while True:
                    try:
                        text = handle.readline()
                    except (EOFError, zlib.error):
                        return  # cut off mid-stream: keep what was complete
                    if not text:
                        return
                    number += 1
                    if not text.endswith("\n"):
                        return  # last line cut off
                    try:
                        line = json.loads(text)
                    except ValueError as error:
                        raise TraceError(f"{self.path} line {number} is not JSON: {error}") from None
                    if not isinstance(line, dict):
                        raise TraceError(f"{self.path} line {number} is not a JSON object")
                    yield line
        except FileNotFoundError:
            raise TraceError(f"trace file {self.path} does not exist") from None
        except gzip.BadGzipFile:
            raise TraceError(f"{self.path} is not gzip-compressed: not a hybridmon trace") from None
        except OSError as error:
            raise TraceError(f"{self.path} cannot be read: {error}") from None
