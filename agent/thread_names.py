"""The daemon's threads carry their Python names in the kernel too, so `top -H -p <pid>`, `ps -L`
and /proc/<pid>/task/<tid>/comm say which one burns CPU (a PCIe sampler, a collector, the HTTP
server) instead of "python" for all of them.

Python 3.11 names a thread for Python only; 3.14 passes the name to the OS itself (CPython
gh-59705). Until then: threading.setprofile installs a hook in every thread started after it, and
the hook, on the thread's first Python call, copies threading.current_thread().name into the
kernel with prctl(PR_SET_NAME) (prctl(2): at most 15 bytes kept) and removes itself, so no later
call pays for it. "hybridmon-" is dropped first: a sampler thread is "pcie-gpu0" in `top`.
Linux only; elsewhere, or where prctl fails, nothing happens.
"""
from __future__ import annotations

import ctypes
import sys
import threading

PR_SET_NAME = 15          # <linux/prctl.h>
KERNEL_NAME_BYTES = 15    # TASK_COMM_LEN 16, the terminating NUL included

_prctl = None


def kernel_name(name: str) -> bytes:
    """The name as the kernel keeps it: "hybridmon-" dropped, ASCII, cut to 15 bytes."""
    short = name.removeprefix("hybridmon-")
    return short.encode("ascii", errors="replace")[:KERNEL_NAME_BYTES]


def name_this_thread(name: str) -> bool:
    """Give the calling thread `name` in the kernel; False where that cannot be done."""
    global _prctl
    if not sys.platform.startswith("linux"):
        return False
    try:
        if _prctl is None:
            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        return _prctl(PR_SET_NAME, ctypes.c_char_p(kernel_name(name)), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _name_on_first_call(_frame, _event, _argument) -> None:
    sys.setprofile(None)  # once per thread: every later call runs without a hook
    name_this_thread(threading.current_thread().name)


def name_threads_in_kernel() -> None:
    """Threads started from now on carry their names in the kernel; the calling thread is named
    "hybridmon" (the main thread's name, "MainThread", would say nothing in `top`)."""
    if name_this_thread("hybridmon"):
        threading.setprofile(_name_on_first_call)
