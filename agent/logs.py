"""The agent's log lines: one format for every logger, and repeated lines aggregated.

Format. configure_logging() puts one handler on the root logger, and every line the process writes
goes through it: the agent's own loggers, uvicorn's (uvicorn.Config(log_config=None) in
agent/api/httpserver.py leaves uvicorn's loggers without handlers of their own, so they propagate
here), asyncio's, warnings.warn (logging.captureWarnings) and exceptions that end a thread. "text" is one line per record:
`2026-11-25T09:43:24.951+00:00 INFO hybridmon: serving ...`; "json" is one JSON object per line,
{"time", "level", "logger", "message"} plus "exception" when there is a traceback, for journald
(`journalctl -o cat`) and Kubernetes log pipelines. Times are RFC 3339 with the local offset.

Repeats: a hostile client must not be able to fill the disk through us. A message that repeats (uvicorn's "Invalid HTTP request received." once per bad request, asyncio's
"socket.accept() out of system resource" once per failed accept) is logged the first time; its
repeats within the window are counted instead of written, and one summary line per window says
how many there were. Messages are told apart by logger, level and format string (not the
arguments), so "bad request from 10.0.0.1" and "... from 10.0.0.2" count as one message.
"""
from __future__ import annotations

import json
import logging
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Callable, TextIO

LOG_FORMATS = ("text", "json")

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


def rfc3339(created: float) -> str:
    """A record's time (Unix seconds) as RFC 3339 with the local UTC offset, to the millisecond."""
    return datetime.fromtimestamp(created).astimezone().isoformat(timespec="milliseconds")


class TextFormatter(logging.Formatter):
    """`<RFC 3339 time> <LEVEL> <logger>: <message>`, a traceback on the lines after it."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        return rfc3339(record.created)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (a message's own newlines are escaped by json)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": rfc3339(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def formatter_for(log_format: str) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter()
    if log_format == "text":
        return TextFormatter()
    raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {log_format!r}")


# Libraries whose INFO lines tell of every request the agent makes.
QUIET_LIBRARY_LOGGERS = ("httpx", "httpcore")


def configure_logging(level: str, log_format: str = "text", stream: TextIO | None = None,
                      force: bool = False) -> logging.Handler | None:
    """The process's one log handler on the root logger (stderr by default); returns it.

    `level` is debug, info, warning or error. Like logging.basicConfig, it leaves alone a root
    logger that something else configured first (pytest's capture, when a test calls the CLI
    in-process) and returns None, unless `force`; one it installed itself is replaced.
    """
    formatter = formatter_for(log_format)  # a bad format fails before anything is changed
    root = logging.getLogger()
    others = [h for h in root.handlers if not getattr(h, "installed_by_configure_logging", False)]
    if others and not force:
        return None
    for old in list(root.handlers):
        root.removeHandler(old)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.installed_by_configure_logging = True  # type: ignore[attr-defined]
    handler.setFormatter(formatter)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # httpx logs every request at INFO ("HTTP Request: POST ... 200 OK"): one line per push per
    # Alertmanager, ~2,880 a day at the 30 s resend (issue 30). A failed push is logged by the
    # pusher (agent/publish/alertmanager.py) with what went wrong; at debug both are kept.
    for chatty in QUIET_LIBRARY_LOGGERS:
        logging.getLogger(chatty).setLevel(logging.NOTSET if root.level <= logging.DEBUG else logging.WARNING)
    # warnings.warn (a library's DeprecationWarning, ResourceWarning) as records of "py.warnings",
    # in the same format, rather than Python's two-line stderr text.
    logging.captureWarnings(True)
    # An exception that ends a thread (the sampler's, the Alertmanager pusher's) as a record too:
    # Python's default hook prints a bare traceback that a JSON log reader cannot parse.
    threading.excepthook = _log_thread_exception
    return handler


def _log_thread_exception(args: threading.ExceptHookArgs) -> None:
    if issubclass(args.exc_type, SystemExit):
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("hybridmon").error("thread %s ended by an uncaught exception", name,
                                         exc_info=(args.exc_type, args.exc_value, args.exc_traceback))
