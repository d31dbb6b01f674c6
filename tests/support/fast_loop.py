"""The two speeds of the suite, as a pytest plugin (tests/conftest.py loads it).

`./scripts/test` runs everything. `./scripts/test --fast` (pytest --fast) runs the unit and
structural tests alone: no subprocess, no server listening on a socket, no replayed scenario. A
test is slow when it lives in tests/integration/ or is marked `slow`; in --fast mode a test that
is neither and still starts a process or listens on a socket (itself, or through a fixture of any
scope it is the first to need) fails at once, saying so, so the inner loop stays under a minute.
tests/structure/test_fast_loop.py checks this plugin on a suite of its own.
"""
from __future__ import annotations

import socket
import subprocess

import pytest

INTEGRATION = "tests/integration/"
SLOW_REASON = ("starts a process, a server or a replay: mark it @pytest.mark.slow or move it to "
               "tests/integration/ (./scripts/test --fast runs neither)")
# A test may be slow for another reason: real time waited out, or a fuzzing budget of seconds; it
# says which beside its marker.


def pytest_addoption(parser):
    parser.addoption(
        "--fast", action="store_true",
        help="unit and structural tests only: leave out tests/integration/ and tests marked slow",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", f"slow: {SLOW_REASON.split(':')[0]}; left out by --fast")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(INTEGRATION):
            item.add_marker(pytest.mark.slow)
    if config.getoption("--fast"):
        kept = [item for item in items if item.get_closest_marker("slow") is None]
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Patched around each test only: pytest-xdist starts its workers with subprocesses of its own."""
    if not item.config.getoption("--fast"):
        yield
        return

    def refuse(*_args, **_kwargs):
        raise AssertionError(f"{item.nodeid} {SLOW_REASON}")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", refuse)
        patch.setattr(socket.socket, "listen", refuse)
        yield
