"""Real fault injection on the live host (root only): swap space, a cgroup-v1 memory cgroup, a sysctl
set for the test, and a child process that thrashes swap. Each is a context manager that undoes
itself on exit, whether or not the test (or a later setup step) failed, so that an ExitStack of them
leaves the host as it was.

Used by tests/integration/test_fault_injection.py; see there for what is measured and asserted.
"""
from __future__ import annotations

import errno
import os
import secrets
import select
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

MIB = 1024 * 1024
CGROUP_V1_MEMORY = Path("/sys/fs/cgroup/memory")
CGROUP_PREFIX = "hybridmon-test-"
SWAPFILE_NAME = "hybridmon-test.swap"
# Filesystems on which the kernel cannot swap to a file directly; a loop device over a file
# there still works.
NO_SWAPFILE_FILESYSTEMS = {"tmpfs", "overlay", "nfs", "nfs4", "cifs", "fuse", "9p", "ramfs",
                           "squashfs", "zfs", "virtiofs"}


def cannot_inject(reason: str) -> None:
    """Skip on a developer's machine that lacks root, cgroup v1 or swapon; fail in CI, whose
    machines have all three, so a lost install step or privilege can never hide as a skip."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"fault injection must run in CI: {reason}")
    pytest.skip(reason)


def skip_unless_root_with_cgroup_v1_memory() -> None:
    """The only reasons the fault injection test may skip (besides swapon not being permitted,
    found out when trying it): not root, or no cgroup-v1 memory controller."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        cannot_inject("real fault injection needs root (swapon, sysctl, cgroups)")
    if not (CGROUP_V1_MEMORY / "memory.limit_in_bytes").is_file():
        cannot_inject(f"no cgroup-v1 memory controller mounted at {CGROUP_V1_MEMORY}")


# ---------------------------------------------------------------------------------------------
# Reading the host

def active_swaps() -> list[str]:
    """The swap areas in use (/proc/swaps, first column; the kernel escapes a space as \\040)."""
    lines = Path("/proc/swaps").read_text().splitlines()[1:]
    return [line.split()[0].replace("\\040", " ") for line in lines if line.strip()]


def vmstat() -> dict[str, int]:
    counters = {}
    for line in Path("/proc/vmstat").read_text().splitlines():
        name, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            counters[name] = int(value)
    return counters


def pressure_some_total_us(resource: str = "memory") -> int | None:
    try:
        first = Path(f"/proc/pressure/{resource}").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    return int(first.rsplit("total=", 1)[1])


def process_major_faults(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2:].split()[9])   # field 12, majflt


def process_swap_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmSwap:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding `path` (longest matching mount in mountinfo)."""
    target = os.path.realpath(path)
    best, best_type = "", "unknown"
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, _, after = line.partition(" - ")
        mount_point = before.split()[4].replace("\\040", " ")
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, best_type = mount_point, after.split()[0]
    return best_type


def _run(command: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def _error_text(result: subprocess.CompletedProcess) -> str:
    return (result.stderr or result.stdout).strip() or f"exit status {result.returncode}"


# ---------------------------------------------------------------------------------------------
# Swap space

class SwapNotPermitted(Exception):
    """swapon was refused for lack of privilege (e.g. a container without CAP_SYS_ADMIN)."""


def _allocate(path: Path, size: int) -> None:
    """A fully allocated file (no holes: swapon refuses those) of `size` bytes, mode 600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    os.chmod(path, 0o600)
    if filesystem_type(path) == "btrfs":
        # btrfs swaps only to a no-copy-on-write file; the flag must be set while it is empty.
        _run(["chattr", "+C", str(path)])
    if _run(["fallocate", "-l", str(size), str(path)]).returncode == 0:
        return
    # Filesystems without fallocate (or where a fallocated file is refused): write zeros.
    result = _run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={size // MIB}",
                   "conv=fsync", "status=none"], timeout=300)
    if result.returncode != 0:
        raise OSError(f"cannot allocate {path}: {_error_text(result)}")


def _enable(device: str) -> None:
    result = _run(["mkswap", device])
    if result.returncode != 0:
        raise OSError(f"mkswap {device}: {_error_text(result)}")
    result = _run(["swapon", device])
    if result.returncode != 0:
        text = _error_text(result)
        if "not permitted" in text.lower():
            raise SwapNotPermitted(f"swapon {device}: {text}")
        raise OSError(f"swapon {device}: {text}")


def _disable(device: str) -> None:
    """swapoff, retried a little: it fails with ENOMEM if the swapped pages cannot come back yet."""
    for attempt in range(5):
        if device not in active_swaps():
            return
        result = _run(["swapoff", device], timeout=120)
        if result.returncode == 0:
            return
        time.sleep(1 + attempt)
    raise OSError(f"swapoff {device}: {_error_text(result)}")


@contextmanager
def swap_space(directories: list[Path], size: int) -> Iterator[str]:
    """A swap area of `size` bytes, active until exit; yields its name as /proc/swaps lists it.

    Tries a swapfile in each directory in turn (skipping filesystems that cannot hold one), then
    a loop device over a file in the first directory. pytest.skip only when swapon is refused
    for lack of privilege; any other failure everywhere fails the test with every reason.
    """
    attempts: list[str] = []
    for directory in directories:
        fs_type = filesystem_type(directory)
        if fs_type in NO_SWAPFILE_FILESYSTEMS:
            attempts.append(f"{directory}: {fs_type} cannot hold a swapfile")
            continue
        workdir = Path(directory) / f"hybridmon-swap-{secrets.token_hex(4)}"
        path = workdir / SWAPFILE_NAME
        try:
            workdir.mkdir(mode=0o700)
            try:
                _allocate(path, size)
                _enable(str(path))
            except BaseException:
                _remove_file(path, workdir)
                raise
        except SwapNotPermitted as refused:
            cannot_inject(f"swapon is not permitted here: {refused}")
        except OSError as error:
            attempts.append(f"{directory} ({fs_type}): {error}")
            continue
        name = os.path.realpath(path)
        try:
            yield name
        finally:
            try:
                _disable(name)
            finally:
                _remove_file(path, workdir)
        return
    with _loop_swap(Path(directories[0]), size, attempts) as name:
        yield name


@contextmanager
def _loop_swap(directory: Path, size: int, attempts: list[str]) -> Iterator[str]:
    workdir = directory / f"hybridmon-swap-{secrets.token_hex(4)}"
    path = workdir / SWAPFILE_NAME
    device = None
    try:
        workdir.mkdir(mode=0o700)
        _allocate(path, size)
        result = _run(["losetup", "--find", "--show", str(path)])
        if result.returncode != 0:
            raise OSError(f"losetup {path}: {_error_text(result)}")
        device = result.stdout.strip()
        _enable(device)
    except SwapNotPermitted as refused:
        _detach_and_remove(device, path, workdir)
        cannot_inject(f"swapon is not permitted here: {refused}")
    except OSError as error:
        _detach_and_remove(device, path, workdir)
        attempts.append(f"loop device over {path}: {error}")
        pytest.fail("cannot set up swap for the fault injection test:\n  " + "\n  ".join(attempts))
    try:
        yield device
    finally:
        try:
            _disable(device)
        finally:
            _detach_and_remove(device, path, workdir)


def _detach_and_remove(device: str | None, path: Path, workdir: Path) -> None:
    try:
        if device:
            _run(["losetup", "-d", device])
    finally:
        _remove_file(path, workdir)


def _remove_file(path: Path, workdir: Path) -> None:
    path.unlink(missing_ok=True)
    try:
        workdir.rmdir()
    except FileNotFoundError:
        pass


# ---------------------------------------------------------------------------------------------
# sysctl and cgroup

@contextmanager
def sysctl(name: str, value: int) -> Iterator[str]:
    """Set a sysctl (through /proc/sys) until exit; yields the old value, restored on exit."""
    path = Path("/proc/sys") / name.replace(".", "/")
    old = path.read_text().strip()
    path.write_text(f"{value}\n")
    try:
        yield old
    finally:
        path.write_text(f"{old}\n")


class MemoryCgroup:
    def __init__(self, path: Path) -> None:
        self.path = path

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(f"{pid}\n")

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def remove(self, timeout: float = 10.0) -> None:
        """Move whatever is left to the root cgroup, then rmdir (retried while the kernel still
        counts an exiting task in it)."""
        deadline = time.monotonic() + timeout
        while True:
            for pid in self.pids():
                try:
                    (CGROUP_V1_MEMORY / "cgroup.procs").write_text(f"{pid}\n")
                except ProcessLookupError:
                    pass
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as error:
                if error.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


@contextmanager
def memory_cgroup(limit_bytes: int, swappiness: int) -> Iterator[MemoryCgroup]:
    """A fresh cgroup-v1 memory cgroup with this limit (and swappiness, where the kernel has the
    knob), removed on exit. Skips where cgroups cannot be created (read-only cgroupfs)."""
    path = CGROUP_V1_MEMORY / f"{CGROUP_PREFIX}{secrets.token_hex(4)}"
    try:
        path.mkdir()
    except OSError as error:
        if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            cannot_inject(f"cannot create a memory cgroup under {CGROUP_V1_MEMORY}: {error}")
        raise
    cgroup = MemoryCgroup(path)
    try:
        (path / "memory.limit_in_bytes").write_text(f"{limit_bytes}\n")
        if (path / "memory.swappiness").exists():
            (path / "memory.swappiness").write_text(f"{swappiness}\n")
        yield cgroup
    finally:
        cgroup.remove()


# ---------------------------------------------------------------------------------------------
# The thrashing child

THRASHER = r"""
import os, random, sys, time
if not sys.stdin.buffer.read(1):   # the parent went away before moving us into the cgroup
    sys.exit(0)
with open("/proc/self/comm", "w") as comm:
    comm.write(sys.argv[1])
size, seconds = int(sys.argv[2]), float(sys.argv[3])
page = os.sysconf("SC_PAGE_SIZE")
pages = size // page
parent = os.getppid()
rng = random.Random(1)
buf = bytearray(size)
# Random contents: zero-filled pages are not written to swap (swpout_zero) and zswap would
# keep compressible ones in RAM; either would hide the swap I/O this is meant to produce.
chunk = 1 << 20
for offset in range(0, size, chunk):
    buf[offset:offset + chunk] = rng.randbytes(min(chunk, size - offset))
sys.stdout.write("ready\n")
sys.stdout.flush()
deadline = time.monotonic() + seconds
while time.monotonic() < deadline and os.getppid() == parent:
    for _ in range(512):
        buf[rng.randrange(pages) * page] ^= 0xFF
"""


@contextmanager
def thrasher(cgroup: MemoryCgroup, name: str, size: int, seconds: float,
             ready_timeout: float = 30.0) -> Iterator[subprocess.Popen]:
    """A child that joins `cgroup` before allocating anything, fills `size` bytes with random
    data and then writes one byte of a random page in a loop, for `seconds` (or until its parent
    dies), so that with a cgroup limit below `size` it swaps in and out continuously. Its comm
    is `name`. Killed on exit."""
    child = subprocess.Popen(
        [sys.executable, "-c", THRASHER, name, str(size), str(seconds)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        cgroup.add(child.pid)
        assert child.pid in cgroup.pids(), f"child {child.pid} did not join {cgroup.path}"
        child.stdin.write(b"x")
        child.stdin.flush()
        readable, _, _ = select.select([child.stdout], [], [], ready_timeout)
        line = child.stdout.readline() if readable else b""
        if line.strip() != b"ready":
            child.kill()
            _, errors = child.communicate(timeout=10)
            raise AssertionError(
                f"thrasher did not get ready in {ready_timeout:.0f} s (exit {child.returncode}): "
                f"{errors.decode(errors='replace')[-2000:]}")
        yield child
    finally:
        if child.poll() is None:
            child.kill()
        try:
            child.wait(timeout=30)
        finally:
            for stream in (child.stdin, child.stdout, child.stderr):
                try:
                    stream.close()
                except OSError:
                    pass
