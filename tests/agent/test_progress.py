"""`check` and `bench` show a live progress line on a terminal and nothing on a pipe (issue 16).

The terminal is a real pseudo-terminal (the `pty` module's os.openpty) on the command's stderr, so
`isatty()` answers as it does for an operator; stdout stays a pipe, as in `hybridmon check | less`.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import pytest

from hybridmon.agent.commands.progress import ERASE_LINE, LiveLine, Ticker
from tests.support.agent_helpers import FIXTURE_ENVIRONMENT, REPO
from tests.support.bench_helpers import BENCH_FIXTURES, fake_binary


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_live_line_rewrites_and_erases_on_a_terminal_and_is_silent_elsewhere():
    terminal, pipe = Terminal(), io.StringIO()
    for stream in (terminal, pipe):
        line = LiveLine(stream)
        line.show("step 1")
        line.show("step 2")
        line.clear()
    assert terminal.getvalue() == f"{ERASE_LINE}step 1{ERASE_LINE}step 2{ERASE_LINE}"
    assert pipe.getvalue() == ""


def test_ticker_shows_elapsed_time_while_its_block_runs_then_erases():
    terminal = Terminal()
    with Ticker(LiveLine(terminal), lambda seconds: f"building, {seconds:.1f} s", interval=0.01):
        time.sleep(0.05)
    text = terminal.getvalue()
    assert text.startswith(f"{ERASE_LINE}building, 0.0 s") and text.count("building") >= 2
    assert text.endswith(ERASE_LINE)
    quiet = io.StringIO()
    with Ticker(LiveLine(quiet), lambda seconds: "building"):
        pass
    assert quiet.getvalue() == ""


def hybridmon(*args: str, tty: bool, **env: str) -> tuple[int, str, str]:
    """Run the command with stderr on a pseudo-terminal (tty=True) or a pipe; returns
    (exit status, stdout, stderr as the terminal or pipe received it)."""
    environment = {**os.environ, **FIXTURE_ENVIRONMENT, "PYTHONPATH": str(REPO), **env}
    command = [sys.executable, "-m", "hybridmon.agent.cli", *args]
    if not tty:
        done = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=60, cwd=REPO)
        return done.returncode, done.stdout, done.stderr
    controller, terminal = os.openpty()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=terminal, env=environment, cwd=REPO)
    os.close(terminal)
    received = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # EIO: every writer of the terminal has closed it
            break
        if not chunk:
            break
        received += chunk
    os.close(controller)
    stdout = process.stdout.read().decode()
    return process.wait(timeout=60), stdout, received.decode()


@pytest.mark.slow
def test_check_shows_its_sampling_window_on_a_terminal_only():
    code, stdout, stderr = hybridmon("check", "--duration", "2", tty=True)
    assert code in (0, 1, 2, 3), stderr
    assert f"{ERASE_LINE}hybridmon check: sampling this host, 0 of 2 s" in stderr
    assert f"{ERASE_LINE}hybridmon check: judging{ERASE_LINE}" in stderr  # erased before the report
    assert "sampling" not in stdout and stdout.strip()
    code, stdout, stderr = hybridmon("check", "--duration", "1", tty=False)
    assert code in (0, 1, 2, 3) and "sampling" not in stderr and "\r" not in stderr


@pytest.mark.slow
def test_bench_shows_each_step_on_a_terminal_only(tmp_path):
    binary = str(fake_binary(tmp_path))
    arguments = ("bench", "--gpu", "0", "--binary", binary, "--force")
    code, stdout, stderr = hybridmon(*arguments, tty=True, HYBRIDMON_STATE_DIR=str(tmp_path / "state"))
    assert code == 0, stderr
    # one step per test of the fixture's report (version 3: each direction and size its own test)
    first = f"[ 1/{len(json.loads((BENCH_FIXTURES / 'report-gen4-local.json').read_text())['results'])}]"
    assert f"{ERASE_LINE}GPU 0 local: {first} host to device pinned 2 MiB" in stderr
    assert f"{ERASE_LINE}hybridmon bench: finding or building the benchmark" in stderr
    assert first not in stdout
    code, stdout, stderr = hybridmon(*arguments, tty=False, HYBRIDMON_STATE_DIR=str(tmp_path / "state2"))
    assert code == 0, stderr
    assert first not in stderr and "finding or building" not in stderr and "\r" not in stderr
