"""Repeated log lines, aggregated: a hostile client must not be able to fill the disk through us.

A message that repeats (uvicorn's "Invalid HTTP request received." once per bad request, asyncio's
"socket.accept() out of system resource" once per failed accept) is logged the first time; its
repeats within the window are counted instead of written, and one summary line per window says
how many there were. Messages are told apart by logger, level and format string (not the
arguments), so "bad request from 10.0.0.1" and "... from 10.0.0.2" count as one message.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

# A format string built from data (an f-string) would make every line a new message; past this
# many distinct messages in one window the filter stops tracking new ones and lets them through.
MAX_TRACKED_MESSAGES = 256


@dataclass
class _Tracked:
    logger_name: str
    level: int
    message: str  # the first occurrence, formatted, for the summary line
    window_started: float  # clock seconds
    repeats: int = 0


class RepeatedMessageFilter(logging.Filter):
    """Lets a message through once per `window_seconds` and counts the repeats it holds back.

    Attach it to the loggers that hostile input can make chatty (logger.addFilter). Call flush()
    now and then (the HTTP server does, once a second): it writes "N more like this in the last
    60 s" for each message whose window has ended with repeats held back.
    """

    def __init__(self, window_seconds: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window_seconds = window_seconds
        self._clock = clock
        self._tracked: dict[tuple[str, int, str], _Tracked] = {}
        self._lock = threading.Lock()
        self.suppressed_total = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "aggregated_summary", False):
            return True
        key = (record.name, record.levelno, str(record.msg))
        now = self._clock()
        summary = None
        with self._lock:
            tracked = self._tracked.get(key)
            if tracked is not None and now - tracked.window_started < self.window_seconds:
                tracked.repeats += 1
                self.suppressed_total += 1
                return False
            if tracked is not None:
                summary = self._pop_summary(key, now)
            if len(self._tracked) < MAX_TRACKED_MESSAGES:
                self._tracked[key] = _Tracked(record.name, record.levelno, _first_line(record), now)
        if summary:
            _emit(*summary)
        return True

    def flush(self) -> None:
        """Write the summary of every message whose window has ended; forget those messages."""
        now = self._clock()
        with self._lock:
            ended = [key for key, tracked in self._tracked.items()
                     if now - tracked.window_started >= self.window_seconds]
            summaries = [self._pop_summary(key, now) for key in ended]
        for summary in summaries:
            if summary:
                _emit(*summary)

    def _pop_summary(self, key: tuple[str, int, str], now: float) -> tuple[str, int, str, int, float] | None:
        tracked = self._tracked.pop(key)
        if not tracked.repeats:
            return None
        return tracked.logger_name, tracked.level, tracked.message, tracked.repeats, now - tracked.window_started


def _first_line(record: logging.LogRecord) -> str:
    try:
        text = record.getMessage()
    except Exception:  # a broken format string: the handler will report it, keep the template
        text = str(record.msg)
    return text.splitlines()[0] if text else text


def _emit(logger_name: str, level: int, message: str, repeats: int, seconds: float) -> None:
    logging.getLogger(logger_name).log(
        level, "%s (repeated %d more times in the last %.0f s, not shown)", message, repeats, seconds,
        extra={"aggregated_summary": True},
    )


def aggregate_repeats(logger_names: tuple[str, ...], window_seconds: float = 60.0) -> RepeatedMessageFilter:
    """One filter attached to each named logger; returns it so that the caller can flush it."""
    repeats = RepeatedMessageFilter(window_seconds)
    for name in logger_names:
        logging.getLogger(name).addFilter(repeats)
    return repeats


def remove_filter(repeats: RepeatedMessageFilter, logger_names: tuple[str, ...]) -> None:
    for name in logger_names:
        logging.getLogger(name).removeFilter(repeats)
