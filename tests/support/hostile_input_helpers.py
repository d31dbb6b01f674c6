"""Running code that the old agent hung or blew up on, so that a regression fails a test instead of
hanging or swapping the suite: in a child interpreter, under a deadline and an address-space limit."""
from __future__ import annotations

import resource
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

from tests.support.agent_helpers import REPO, subprocess_environment

CHILD_ADDRESS_SPACE_BYTES = 2 * 1024**3
"""What a child may map: an interpreter with the agent imported needs about 300 MB of address
space; a parser that inflates a hostile input whole gets MemoryError here, not the machine's RAM."""


@dataclass(frozen=True)
class ChildResult:
    returncode: int | None  # None: killed at the deadline
    stdout: str
    stderr: str
    seconds: float


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_ADDRESS_SPACE_BYTES, CHILD_ADDRESS_SPACE_BYTES))


def run_python(code: str, deadline_seconds: float) -> ChildResult:
    """Runs `code` in a fresh interpreter at the repository root; kills it at the deadline."""
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                              env=subprocess_environment(), capture_output=True, text=True,
                              timeout=deadline_seconds, preexec_fn=_limit_address_space)
    except subprocess.TimeoutExpired as expired:  # subprocess.run has killed and reaped it
        return ChildResult(None, _text(expired.stdout), _text(expired.stderr),
                           time.monotonic() - started)
    return ChildResult(done.returncode, done.stdout, done.stderr, time.monotonic() - started)


def _text(output: str | bytes | None) -> str:
    if isinstance(output, bytes):
        return output.decode("utf-8", "replace")
    return output or ""
