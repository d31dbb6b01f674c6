"""Every command in the ```sh blocks of README.md and docs/quickstart.md runs as written, from a
fresh copy of this checkout, after the README's set-up command.

The copy holds the tracked and untracked (not ignored) files, so work not yet committed is tested
too. The README's set-up command runs once per module, exactly as written: it builds .venv with
`pip install .` (a real install, dependencies from the index or pip's cache) and starts the agent,
which is probed and stopped. Then each block's commands run in order, by bash, from the copy:

- a command that serves (`hybridmon run`, `prometheus-alertmanager`) is started, probed until it
  answers over HTTP, and left running for the block's next commands (the `curl` beside it); it is
  stopped with SIGTERM when the next serving command starts or the block ends, and must then exit
  0 (SIGTERM is how systemd and Kubernetes stop it);
- `hybridmon record` (it runs for its --duration) is stopped after a few seconds the same way and
  must have written its trace, which the next command replays;
- every other command must end within COMMAND_TIMEOUT_S with its documented status: 0, except
  `hybridmon check` (0-3, what it found) and `hybridmon bench` on a host without a GPU (3, and the
  message that says so: README.md, docs/offload-bench.md);
- `./scripts/test` is this suite itself: it is not re-run, only required to be executable.

A new command in those blocks is tested without touching this file. Each block runs in a network
namespace of its own (`unshare --net`), so the commands keep their documented ports (9787, 9093)
without colliding with an agent or a test running beside them; where namespaces are not allowed,
the block runs in the host's network and a taken port fails it loudly.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = ("README.md", "docs/quickstart.md")
SET_UP = "python3 -m venv .venv && .venv/bin/pip install . && .venv/bin/hybridmon run"
SUITE = "./scripts/test"
COMMAND_TIMEOUT_S = 60
SET_UP_TIMEOUT_S = 600           # pip install . in a fresh venv: ~20 s with a warm cache, 2 cores
READY_TIMEOUT_S = 30
RECORD_SECONDS = 3.0
SERVES = re.compile(r"\bhybridmon run\b|^prometheus-alertmanager\b")
RECORDS = re.compile(r"\bhybridmon record\b")
HTTP_PROBE = {  # a serving command -> the path that answers once it is ready
    "hybridmon": "/metrics",
    "prometheus-alertmanager": "/-/ready",
}


def sh_blocks(document: str) -> list[tuple[int, list[str]]]:
    """(line number, commands) of every ```sh block: continuation lines joined, comment-only
    lines dropped (a trailing comment stays: bash ignores it)."""
    blocks, lines = [], (REPO / document).read_text().splitlines()
    number = 0
    while number < len(lines):
        if lines[number].strip() == "```sh":
            start, commands, pending = number + 1, [], ""
            number += 1
            while lines[number].strip() != "```":
                line = lines[number]
                pending += line[:-1] + " " if line.endswith("\\") else line
                if not line.endswith("\\"):
                    if pending.strip() and not pending.lstrip().startswith("#"):
                        commands.append(pending.strip())
                    pending = ""
                number += 1
            blocks.append((start, commands))
        number += 1
    return blocks


BLOCKS = [(document, line, commands) for document in DOCUMENTS for line, commands in sh_blocks(document)]


def test_the_blocks_are_found_and_the_set_up_command_is_the_readmes():
    readme = [commands for document, _line, commands in BLOCKS if document == "README.md"]
    assert readme[0] == [SET_UP] and readme[1] == [SUITE]
    assert sum(len(commands) for _document, _line, commands in BLOCKS) >= 15


# --- the fresh copy and its set-up ------------------------------------------------------------------

def copy_checkout(destination: Path) -> None:
    """The files `git clone` of this working tree would give, with uncommitted work included."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, check=True, capture_output=True, timeout=60).stdout
    for name in sorted(set(filter(None, listed.decode().split("\0")))):
        source, target = REPO / name, destination / name
        if not source.exists() and not source.is_symlink():  # deleted in the working tree
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():  # fixture trees hold /proc-like links: copy the link, not its target
            os.symlink(os.readlink(source), target)
        else:
            shutil.copy2(source, target)


def environment(state: Path) -> dict[str, str]:
    """The caller's environment, less what would import this checkout instead of the install, and
    a state directory of the test's own (a benchmark stored on this machine would change `budget`)."""
    kept = {key: value for key, value in os.environ.items()
            if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not key.startswith("HYBRIDMON_")}
    return {**kept, "HYBRIDMON_STATE_DIR": str(state)}


class Namespace:
    """A network namespace (with its own loopback) held open by a sleeping process; commands enter
    it with nsenter. Without permission for namespaces, commands run in the host's network."""

    def __init__(self) -> None:
        self.holder = None
        if shutil.which("unshare") and shutil.which("nsenter"):
            self.holder = subprocess.Popen(["unshare", "--user", "--map-root-user", "--net", "sh", "-c",
                                            "ip link set lo up 2>/dev/null || ifconfig lo up; exec sleep 3600"],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.holder.poll() is None:
                probe = subprocess.run([*self.prefix(), "cat", "/sys/class/net/lo/operstate"],
                                       capture_output=True, text=True)
                if probe.returncode == 0 and probe.stdout.strip() in ("unknown", "up"):
                    break
                time.sleep(0.1)
            if self.holder.poll() is not None:
                self.holder = None

    def prefix(self) -> list[str]:
        if self.holder is None:
            return []
        return ["nsenter", "--target", str(self.holder.pid), "--user", "--net", "--preserve-credentials"]

    def close(self) -> None:
        if self.holder is not None:
            self.holder.kill()
            self.holder.wait()


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """A fresh copy after the README's set-up command; yields (copy, environment)."""
    root = tmp_path_factory.mktemp("clone")
    copy = root / "hybridmon"
    copy_checkout(copy)
    env = environment(root / "state")
    # The set-up command must reach the index (pip), so it runs in the host's network; its agent
    # listens on a free port through HYBRIDMON_LISTEN so that it cannot collide with another.
    env_set_up = {**env, "HYBRIDMON_LISTEN": f"127.0.0.1:{free_port()}"}
    started = time.monotonic()
    server = Serving(SET_UP, copy, env_set_up, [], ready_timeout=SET_UP_TIMEOUT_S)
    server.wait_ready(f"http://{env_set_up['HYBRIDMON_LISTEN']}/metrics")
    assert server.stop() == 0, server.output()
    print(f"set-up command: {time.monotonic() - started:.1f} s")
    return copy, env


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Serving:
    """A command that runs until stopped, in its own process group (bash execs the last command)."""

    def __init__(self, command: str, cwd: Path, env: dict[str, str], prefix: list[str],
                 ready_timeout: float = READY_TIMEOUT_S) -> None:
        self.command, self.prefix, self.ready_timeout = command, prefix, ready_timeout
        self.log = (cwd.parent / f"serving-{time.monotonic_ns()}.log").open("w+")
        self.process = subprocess.Popen([*prefix, "bash", "-c", command], cwd=cwd, env=env,
                                        stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, url: str) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"{self.command!r} ended early ({self.process.returncode}):\n{self.output()}"
            if subprocess.run([*self.prefix, "curl", "-sf", "-o", "/dev/null", url], timeout=10).returncode == 0:
                return
            time.sleep(0.3)
        self.stop()
        pytest.fail(f"{self.command!r} did not answer {url} within {self.ready_timeout:g} s:\n{self.output()}")

    def stop(self) -> int:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
                pytest.fail(f"{self.command!r} did not stop within 30 s of SIGTERM:\n{self.output()}")
        return self.process.returncode

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]


def probe_url(command: str) -> str:
    """Where a serving command answers: its listen flag, else its documented default."""
    words = shlex.split(command, comments=True)
    if words[0] == "prometheus-alertmanager":
        listen = next((w.split("=", 1)[1] for w in words if w.startswith("--web.listen-address=")), ":9093")
        return f"http://{listen.replace('0.0.0.0', '127.0.0.1') if listen[0] != ':' else '127.0.0.1' + listen}/-/ready"
    listen = words[words.index("--listen") + 1] if "--listen" in words else "127.0.0.1:9787"
    return f"http://{listen.replace('0.0.0.0', '127.0.0.1')}/metrics"


def has_nvidia_gpu() -> bool:
    return Path("/dev/nvidia0").exists() or Path("/proc/driver/nvidia/gpus").is_dir()


def assert_documented_status(command: str, result: subprocess.CompletedProcess) -> None:
    shown = f"{command!r} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    if re.search(r"\bhybridmon check\b", command):
        # 0 healthy, 1 warning, 2 critical, 3 could not read the host: what this host is, not the test.
        assert result.returncode in (0, 1, 2, 3), shown
        assert result.stdout.strip(), shown
        if "--json" in shlex.split(command, comments=True):
            assert json.loads(result.stdout)["exit_code"] == result.returncode
        assert "\r" not in result.stderr, "a progress line on a pipe"
    elif re.search(r"\bhybridmon bench\b", command) and not has_nvidia_gpu():
        assert result.returncode == 3, shown
        assert "hybridmon: no NVIDIA GPU to benchmark" in result.stderr, shown
    else:
        assert result.returncode == 0, shown


@pytest.mark.parametrize(("document", "line", "commands"), BLOCKS,
                         ids=[f"{document}:{line}" for document, line, _commands in BLOCKS])
def test_block_runs_as_written(clone, document, line, commands):
    copy, env = clone
    if commands == [SET_UP]:
        return  # the clone fixture ran it
    if commands == [SUITE]:
        assert os.access(copy / "scripts" / "test", os.X_OK)  # this suite is what it runs
        return
    if document != "README.md" and SET_UP.startswith(commands[0] + " && "):
        commands = commands[1:]  # quickstart's install: the README's set-up command without `run`
    namespace = Namespace()
    serving: list[Serving] = []
    try:
        for command in commands:
            if SERVES.search(command) or RECORDS.search(command):
                for earlier in serving:  # one serving command at a time: they share the port
                    assert earlier.stop() == 0, f"{earlier.command!r} on SIGTERM:\n{earlier.output()}"
                serving = [Serving(command, copy, env, namespace.prefix())]
                if RECORDS.search(command):
                    time.sleep(RECORD_SECONDS)
                    assert serving[0].stop() == 0, serving[0].output()
                    words = shlex.split(command, comments=True)
                    output = words[words.index("--output") + 1]
                    assert (copy / output).stat().st_size > 0, serving[0].output()
                    serving = []
                else:
                    serving[0].wait_ready(probe_url(command))
                continue
            result = subprocess.run([*namespace.prefix(), "bash", "-c", command], cwd=copy, env=env,
                                    capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
            assert_documented_status(command, result)
        for server in serving:
            code = server.stop()
            # SIGTERM is a unit's or a pod's ordinary stop: not a failure (Alertmanager ends 0 too).
            assert code == 0, f"{server.command!r} exited {code} on SIGTERM:\n{server.output()}"
    finally:
        for server in serving:
            if server.process.poll() is None:
                os.killpg(server.process.pid, signal.SIGKILL)
                server.process.wait()
        namespace.close()
