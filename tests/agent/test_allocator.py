"""The daemon's malloc arena cap (agent/allocator.py), observed in fresh processes.

Each case runs in a subprocess: glibc settles arenas once per process, and pytest's own threads
would have theirs already. The arenas are counted in glibc's malloc_info(3) XML, one
<heap nr="..."> element per arena, after 8 threads have each allocated while all are alive.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hybridmon.agent import allocator

pytestmark = pytest.mark.skipif(allocator.glibc_version() is None, reason="glibc's arenas only")

CHILD = r"""
import ctypes, json, os, sys, tempfile, threading
from hybridmon.agent import allocator

outcome = allocator.cap_malloc_arenas() if sys.argv[1] == "cap" else None
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
libc.fclose.argtypes = [ctypes.c_void_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
all_alive = threading.Barrier(9)
counted = threading.Event()

def allocate():
    libc.malloc(4096)  # this thread's first malloc: glibc attaches it to an arena
    all_alive.wait()
    counted.wait()

threads = [threading.Thread(target=allocate) for _ in range(8)]
for thread in threads:
    thread.start()
all_alive.wait()
path = os.path.join(tempfile.mkdtemp(), "malloc_info.xml")
stream = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, stream)
libc.fclose(stream)
counted.set()
for thread in threads:
    thread.join()
print(json.dumps({"outcome": outcome, "arenas": open(path).read().count("<heap nr=")}))
"""


def run_child(mode: str, **environment: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES")}
    env.update(environment)
    completed = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                               env=env, timeout=60)
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout)


@pytest.mark.slow
def test_without_the_cap_each_thread_gets_an_arena_of_its_own():
    """The control: what the cap changes (glibc allows 8 per core, at least 8 arenas here)."""
    assert run_child("none")["arenas"] > allocator.DAEMON_ARENAS


@pytest.mark.slow
def test_the_cap_is_set_and_holds_for_threads_started_after_it():
    assert run_child("cap") == {"outcome": allocator.CAPPED, "arenas": allocator.DAEMON_ARENAS}


@pytest.mark.slow
def test_an_operators_malloc_arena_max_wins():
    assert run_child("cap", MALLOC_ARENA_MAX="4") == {"outcome": allocator.ENVIRONMENT, "arenas": 4}


@pytest.mark.slow
def test_an_operators_glibc_tunable_wins():
    found = run_child("cap", GLIBC_TUNABLES="glibc.malloc.arena_max=3")
    assert found == {"outcome": allocator.ENVIRONMENT, "arenas": 3}


def test_the_environment_is_looked_at_not_changed():
    environ = {"MALLOC_ARENA_MAX": "1"}
    assert allocator.cap_malloc_arenas(environ=environ) == allocator.ENVIRONMENT
    assert environ == {"MALLOC_ARENA_MAX": "1"}
    with pytest.raises(ValueError, match="at least 1"):
        allocator.cap_malloc_arenas(0, environ={})
