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

    def __init__(self, path: str | Path, config: dict[str, Any]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._records = 0
        self._file = gzip.open(self.path, "wt", encoding="utf-8")
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
        with self._lock:
            if self._file.closed:
                return
            self._write({"kind": "reading", "collector": collector, "time": at, "readings": readings})
            self._records += 1

    def close(self) -> None:
        with self._lock:
            if self._file.closed:
                return
            self._write({"kind": "end", "time": time.time(), "records": self._records})
            self._file.close()


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
            readings = line.get("readings")
            if not isinstance(line.get("collector"), str) or not isinstance(readings, list):
                raise TraceError(f"{self.path}: reading line lacks collector or readings")
            if not all(isinstance(r, list) and len(r) == 4 for r in readings):
                raise TraceError(f"{self.path}: a reading is not [kind, key, ok, payload]")
            yield TraceRecord(line["collector"], float(line["time"]), readings)
        self.truncated = True
        log.warning("%s ends without its end line: the recording was cut off; replaying what is there", self.path)

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
