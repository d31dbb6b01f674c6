"""The C allocator's arena count for the daemon: glibc malloc's arenas capped before threads start.

Why: glibc gives each thread that allocates an arena of its own, up to 8 per core on 64-bit
(mallopt(3), M_ARENA_MAX), and memory freed in one arena is not reused by the others. The daemon's collector pool, HTTP server and pushers are such threads: a real daemon on an
8-GPU host grew to 110 MB RSS in 45 minutes with the default arenas and stayed at 87 MB with
MALLOC_ARENA_MAX=1 (issue 17), while the single-threaded simulation of the same history never grew.
Python holds the GIL around nearly all allocation, so a second arena is plenty: two arenas rather
than one leave the C code that runs without the GIL (NVML, compression, sockets) its own.

A thread keeps the arena it got on its first allocation, and glibc settles its limit for good
once 8 arenas exist (malloc/arena.c, arena_get2), so this runs before the first thread starts. An operator's MALLOC_ARENA_MAX (or
GLIBC_TUNABLES=glibc.malloc.arena_max=...) wins: glibc has read it at start and it is left alone.
Other C libraries (musl) have no arenas to cap: nothing is done.
"""
from __future__ import annotations

import ctypes
import logging
import os
from typing import Mapping

log = logging.getLogger(__name__)

DAEMON_ARENAS = 2
# <malloc.h>: #define M_ARENA_MAX -8 (glibc 2.10 and later).
M_ARENA_MAX = -8

CAPPED = "capped"            # mallopt(M_ARENA_MAX, n) returned 1
ENVIRONMENT = "environment"  # the operator set the limit: theirs is kept
NOT_GLIBC = "not_glibc"      # another C library, or no mallopt to call
REFUSED = "refused"          # mallopt returned 0


def glibc_version() -> str | None:
    """"2.39" on glibc (confstr _CS_GNU_LIBC_VERSION), None on any other C library."""
    try:
        text = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError):
        return None
    if not text or not text.startswith("glibc "):
        return None
    return text.split()[1]


def cap_malloc_arenas(arenas: int = DAEMON_ARENAS, environ: Mapping[str, str] = os.environ) -> str:
    """Caps glibc's malloc arenas at `arenas`, unless the environment already sets a limit.

    Returns CAPPED, ENVIRONMENT, NOT_GLIBC or REFUSED; never raises (the daemon runs either way).
    """
    if arenas < 1:
        raise ValueError(f"an arena count is at least 1, not {arenas}")
    if "MALLOC_ARENA_MAX" in environ or "glibc.malloc.arena_max" in environ.get("GLIBC_TUNABLES", ""):
        log.debug("malloc arenas: the environment's limit is kept")
        return ENVIRONMENT
    if glibc_version() is None:
        return NOT_GLIBC
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return NOT_GLIBC
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    if mallopt(M_ARENA_MAX, arenas) != 1:
        log.warning("mallopt(M_ARENA_MAX, %d) failed: glibc keeps its default malloc arenas "
                    "(up to 8 per core), so RSS may grow with the threads", arenas)
        return REFUSED
    log.debug("malloc arenas capped at %d", arenas)
    return CAPPED
