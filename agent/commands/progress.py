"""A live progress line for the commands that make an operator wait (`check`, `bench`).

On a terminal the line is rewritten in place (carriage return, then ANSI "erase to end of line",
ECMA-48 EL: `ESC [ K`) and erased when the work ends, so the command's real output starts on a
clean line. Anywhere else (a pipe, a file, journald, CI logs) it writes nothing: a log of
"3 s of 10" lines helps nobody, and a script reading stderr sees only errors and warnings.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO

ERASE_LINE = "\r\033[K"


class LiveLine:
    """One status line on `stream` while it is a terminal; a no-op otherwise."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        try:
            self.interactive = stream.isatty()
        except (AttributeError, ValueError):  # a closed or file-less stream: not a terminal
            self.interactive = False
        self._shown = False

    def show(self, text: str) -> None:
        if not self.interactive:
            return
        self.stream.write(ERASE_LINE + text)
        self.stream.flush()
        self._shown = True

    def clear(self) -> None:
        if self._shown:
            self.stream.write(ERASE_LINE)
            self.stream.flush()
            self._shown = False

    @contextlib.contextmanager
    def apart_from_logs(self) -> Iterator[LiveLine]:
        """While inside, a log record written by the root logger's handlers erases the line first,
        so the record starts at the left margin instead of after the progress text; the next
        show() draws the line again below it."""
        line = self

        class EraseFirst(logging.Filter):
            def filter(self, record: logging.LogRecord) -> bool:
                line.clear()
                return True

        handlers = logging.getLogger().handlers if self.interactive else []
        erase = EraseFirst()
        for handler in handlers:
            handler.addFilter(erase)
        try:
            yield self
        finally:
            for handler in handlers:
                handler.removeFilter(erase)
            self.clear()


class Ticker:
    """Shows `describe(elapsed_seconds)` on a LiveLine every `interval` seconds while a block runs
    (work with no progress of its own to report, such as an nvcc build)."""

    def __init__(self, line: LiveLine, describe: Callable[[float], str], interval: float = 0.5) -> None:
        self.line, self.describe, self.interval = line, describe, interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Ticker:
        if self.line.interactive:
            started = time.monotonic()

            def tick() -> None:
                while True:
                    self.line.show(self.describe(time.monotonic() - started))
                    if self._stop.wait(self.interval):
                        return

            self._thread = threading.Thread(target=tick, name="progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.line.clear()
