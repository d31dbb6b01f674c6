"""Where collectors get their raw readings: the live host, the live host while recording, or a trace.

Collectors call only read_text, list_dir and call. Swapping the source is the whole difference
between live, record and replay, so a replay runs the collectors' real parsing on real readings.
The agent picks the source (agent/daemon.py, agent/loop/trace.py); the collectors only read through it,
which is why this module sits beside them, below the agent.
"""
from __future__ import annotations

import errno as errno_codes
import os
import threading
from collections import deque
from typing import Any, Callable, Protocol, TypeVar

from hybridmon.exporters.process_cmdline import redact

T = TypeVar("T")

# A reading is [kind, key, ok, payload]; see docs/trace-format.md.
Reading = list


class RawSource(Protocol):
    def read_text(self, path: str) -> str:
        """The whole file as text (undecodable bytes replaced); OSError when it cannot be read."""

    def list_dir(self, path: str) -> list[str]:
        """Entry names of a directory, sorted; OSError when it cannot be listed."""

    def call(self, key: str, fetch: Callable[[], T]) -> T:
        """A reading that is not a file (an NVML call, udev events, a whole /proc scan).

        `key` names the reading uniquely within one collect(); `fetch` returns plain JSON data.
        Only that result is recorded: reads `fetch` makes through this source are not, and a replay
        never runs `fetch`. So a scan of every process can be one reading of the matches alone.
        """


class LiveSource:
    """Reads the host."""

    def read_text(self, path: str) -> str:
        # os.open/os.read rather than open(): a tick reads ~190 small files (8 GPUs, 16 processes)
        # and open() builds a FileIO and a BufferedReader for each, twice the cost of the read.
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as error:
            raise _with_path(error, path) from None
        try:
            # Until end of file: a short read is not one (procfs and sysfs files have no size).
            chunks = []
            while chunk := os.read(fd, _READ_CHUNK):
                chunks.append(chunk)
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        except OSError as error:  # EISDIR, EIO, a process exiting under /proc/<pid>
            raise _with_path(error, path) from None
        finally:
            os.close(fd)
        return data.decode("utf-8", errors="replace")

    def list_dir(self, path: str) -> list[str]:
        return sorted(os.listdir(path))

    def call(self, key: str, fetch: Callable[[], T]) -> T:
        return fetch()


# Most files read are under 4 KiB; numa_maps and smaps of a large process run to megabytes.
_READ_CHUNK = 64 * 1024


def _with_path(error: OSError, path: str) -> OSError:
    """The error as open() raises it: the same OSError subclass, naming the file."""
    if error.filename is not None or error.errno is None:
        return error
    return OSError(error.errno, error.strerror, path)


class RecordingSource:
    """Reads the host through a LiveSource and keeps every reading of the current collect()."""

    def __init__(self, live: RawSource | None = None) -> None:
        self._live = live or LiveSource()
        self._readings: list[Reading] = []
        self._lock = threading.Lock()
        self._inside_call = threading.local()

    def take_readings(self) -> list[Reading]:
        """The readings since the last call, in the order they were made."""
        with self._lock:
            readings, self._readings = self._readings, []
        return readings

    def _keep(self, reading: Reading) -> None:
        if getattr(self._inside_call, "depth", 0):
            return  # part of a call's fetch: only the call's result is a reading
        with self._lock:
            self._readings.append(reading)

    def read_text(self, path: str) -> str:
        try:
            text = self._live.read_text(path)
        except OSError as error:
            self._keep(["text", path, False, _describe_os_error(error)])
            raise
        self._keep(["text", path, True, _recordable(path, text)])
        return text

    def list_dir(self, path: str) -> list[str]:
        try:
            names = self._live.list_dir(path)
        except OSError as error:
            self._keep(["dir", path, False, _describe_os_error(error)])
            raise
        self._keep(["dir", path, True, names])
        return names

    def call(self, key: str, fetch: Callable[[], T]) -> T:
        depth = getattr(self._inside_call, "depth", 0)
        self._inside_call.depth = depth + 1
        try:
            value = self._live.call(key, fetch)
        except Exception as error:
            self._inside_call.depth = depth
            self._keep(["call", key, False, {"type": type(error).__name__, "detail": _detail(error)}])
            raise
        self._inside_call.depth = depth
        self._keep(["call", key, True, value])
        return value


class TraceMissError(RuntimeError):
    """A replayed collector asked for a reading the trace does not hold."""


class ReplayedCallError(Exception):
    """A call that failed while recording; `type_name` is the original exception's class name."""

    def __init__(self, type_name: str, detail: Any) -> None:
        super().__init__(f"{type_name}: {detail}")
        self.type_name = type_name
        self.detail = detail


class ReplaySource:
    """Answers reads from the readings of one recorded collect(), loaded before each replayed run."""

    def __init__(self) -> None:
        self._pending: dict[tuple[str, str], deque] = {}
        self._lock = threading.Lock()

    def load(self, readings: list[Reading]) -> None:
        pending: dict[tuple[str, str], deque] = {}
        for kind, key, ok, payload in readings:
            pending.setdefault((kind, key), deque()).append((ok, payload))
        with self._lock:
            self._pending = pending

    def _next(self, kind: str, key: str) -> tuple[bool, Any]:
        with self._lock:
            queue = self._pending.get((kind, key))
            if not queue:
                raise TraceMissError(
                    f"the trace holds no {kind} reading of {key!r} here: it was recorded by another "
                    "hybridmon version or configuration"
                )
            return queue.popleft()

    def read_text(self, path: str) -> str:
        ok, payload = self._next("text", path)
        if not ok:
            raise _rebuild_os_error(payload, path)
        return payload

    def list_dir(self, path: str) -> list[str]:
        ok, payload = self._next("dir", path)
        if not ok:
            raise _rebuild_os_error(payload, path)
        return list(payload)

    def call(self, key: str, fetch: Callable[[], T]) -> T:
        ok, payload = self._next("call", key)
        if not ok:
            raise ReplayedCallError(payload.get("type", "Exception"), payload.get("detail"))
        return payload


def _recordable(path: str, text: str) -> str:
    """What a trace keeps of a reading. Traces are handed around (an incident replayed on a laptop),
    so a command line is kept with its secrets redacted (exporters/process_cmdline.redact): the
    replay still finds the process and its server, executable and model, never its API key."""
    if not path.endswith("/cmdline"):
        return text
    arguments = [argument for argument in text.split("\0") if argument]
    return "".join(word + "\0" for word in redact(arguments))


def _describe_os_error(error: OSError) -> dict:
    return {"errno": error.errno, "message": error.strerror or str(error)}


def _rebuild_os_error(payload: dict, path: str) -> OSError:
    code = payload.get("errno") or errno_codes.EIO
    # OSError(errno, ...) picks the matching subclass, e.g. FileNotFoundError for ENOENT.
    return OSError(code, payload.get("message") or os.strerror(code), path)


def _detail(error: Exception) -> Any:
    value = getattr(error, "value", None)  # pynvml errors carry their NVML return code here
    if isinstance(value, (int, str)):
        return value
    return str(error)
