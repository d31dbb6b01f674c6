"""find_listeners reads each network namespace's TCP tables once, not once per watched process.

The fixture trees mirror procfs as the kernel lays it out (proc(5), namespaces(7)):
- /proc/<pid>/ns/net is a symlink whose target is "net:[<inode>]", the nsfs inode naming the
  namespace; readlink needs ptrace-mode read access, so for another user's process it fails (EACCES)
  for an agent that is not root, and the pid then reads its own table.
- /proc/<pid>/net/tcp shows the table of the pid's network namespace: every pid of one namespace
  sees the same lines, so the fixture writes the same text under each of them.
- /proc/<pid>/fd/<n> of a socket links "socket:[<inode>]", the inode column of net/tcp.
"""
from __future__ import annotations

import os
import socket
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from hybridmon.exporters.inference_scrape import find_listeners
from hybridmon.exporters.sources import LiveSource

HOST_NAMESPACE = "net:[4026531840]"  # the initial network namespace's nsfs inode on many kernels
CONTAINER_NAMESPACE = "net:[4026532712]"
HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def tcp_line(slot: int, port: int, inode: int, state: str = "0A") -> str:
    """One /proc/net/tcp line for 127.0.0.1:<port> (little-endian host-order hex, as x86 prints it)."""
    return (f"  {slot:2d}: 0100007F:{port:04X} 00000000:0000 {state} 00000000:00000000 00:00000000 00000000"
            f"     0        0 {inode} 1 0000000000000000 100 0 0 10 0\n")


def process(procfs: Path, pid: int, socket_inodes: list[int], table: str, namespace: str | None) -> None:
    base = procfs / str(pid)
    (base / "fd").mkdir(parents=True)
    (base / "net").mkdir()
    os.symlink("/dev/null", base / "fd" / "0")
    for number, inode in enumerate(socket_inodes, start=3):
        os.symlink(f"socket:[{inode}]", base / "fd" / str(number))
    (base / "net" / "tcp").write_text(table)
    if namespace is not None:
        (base / "ns").mkdir()
        os.symlink(namespace, base / "ns" / "net")  # dangling, as a readlink sees the real one


class CountingSource(LiveSource):
    """Reads the tree and counts each path read. A failed open (no tcp6 in the tree, as on a kernel
    without IPv6) is not counted: it costs no walk of the connection table."""

    def __init__(self) -> None:
        self.reads: Counter[str] = Counter()

    def read_text(self, path: str) -> str:
        text = super().read_text(path)
        self.reads[path] += 1
        return text

    def table_reads(self) -> Counter[str]:
        return Counter({path: count for path, count in self.reads.items() if "/net/tcp" in path})


def shared_host(procfs: Path) -> None:
    """pids 100, 101, 102 in the host namespace (vLLM on 8000, SGLang on 30000, a client socket
    that listens on nothing), 200 in a container's namespace (port 8000 again, its own table),
    300 whose ns link cannot be read (no ns/ here), 400 without any socket."""
    host_table = HEADER + tcp_line(0, 8000, 9100) + tcp_line(1, 30000, 9101) + tcp_line(2, 22, 9999) \
        + tcp_line(3, 41000, 9102, state="01")
    process(procfs, 100, [9100], host_table, HOST_NAMESPACE)
    process(procfs, 101, [9101], host_table, HOST_NAMESPACE)
    process(procfs, 102, [9102], host_table, HOST_NAMESPACE)
    process(procfs, 200, [9200], HEADER + tcp_line(0, 8000, 9200), CONTAINER_NAMESPACE)
    process(procfs, 300, [9300], HEADER + tcp_line(0, 8080, 9300), None)
    process(procfs, 400, [], host_table, HOST_NAMESPACE)


def test_one_table_read_per_namespace_and_each_pid_still_gets_its_own_ports(tmp_path):
    shared_host(tmp_path)
    source = CountingSource()
    found = find_listeners(source, str(tmp_path), [100, 101, 102, 200, 300, 400])
    assert found == {"100": [["127.0.0.1", 8000]], "101": [["127.0.0.1", 30000]],
                     "200": [["127.0.0.1", 8000]], "300": [["127.0.0.1", 8080]]}
    # The host namespace through its first pid only; the container's and the unreadable link's own.
    assert source.table_reads() == Counter({f"{tmp_path}/100/net/tcp": 1, f"{tmp_path}/200/net/tcp": 1,
                                            f"{tmp_path}/300/net/tcp": 1})


def test_tcp6_is_also_read_once_per_namespace(tmp_path):
    shared_host(tmp_path)
    tcp6 = HEADER + ("   0: 00000000000000000000000001000000:2328 00000000000000000000000000000000:0000 0A "
                     "00000000:00000000 00:00000000 00000000     0        0 9103 1 0000000000000000 100 0 0 10 0\n")
    for pid in (100, 101, 102):
        (tmp_path / str(pid) / "net" / "tcp6").write_text(tcp6)
    os.symlink("socket:[9103]", tmp_path / "101" / "fd" / "9")
    source = CountingSource()
    found = find_listeners(source, str(tmp_path), [100, 101, 102])
    assert found == {"100": [["127.0.0.1", 8000]], "101": [["::1", 9000], ["127.0.0.1", 30000]]}
    assert source.reads[f"{tmp_path}/100/net/tcp6"] == 1
    assert source.reads[f"{tmp_path}/101/net/tcp6"] == 0


def test_a_namespace_whose_first_pid_cannot_be_read_is_read_through_the_next(tmp_path):
    """The first pid exited between the fd listing and the table read: the namespace is not taken
    as empty, its next pid reads it."""
    shared_host(tmp_path)
    (tmp_path / "100" / "net" / "tcp").unlink()
    source = CountingSource()
    found = find_listeners(source, str(tmp_path), [100, 101, 102])
    assert found == {"101": [["127.0.0.1", 30000]]}
    assert source.table_reads() == Counter({f"{tmp_path}/101/net/tcp": 1})


@pytest.mark.slow
def test_real_proc_two_processes_of_this_namespace_read_the_table_once():
    """This process and a `sleep` child holding the same listening socket (inherited fd): both
    are found on the real /proc, through one read of net/tcp."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        child = subprocess.Popen(["sleep", "30"], pass_fds=[listening.fileno()])
        try:
            source = CountingSource()
            found = find_listeners(source, "/proc", [os.getpid(), child.pid])
            namespaces = {os.readlink(f"/proc/{pid}/ns/net") for pid in (os.getpid(), child.pid)}
        finally:
            child.kill()
            child.wait()
    assert ["127.0.0.1", port] in found[str(os.getpid())]
    assert ["127.0.0.1", port] in found[str(child.pid)]
    assert len(namespaces) == 1  # a child shares its parent's network namespace
    assert sum(source.table_reads().values()) <= 2  # tcp and tcp6 of the namespace, once each
    assert not any(path.startswith(f"/proc/{child.pid}/") for path in source.table_reads())
