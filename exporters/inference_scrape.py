"""Reaching an inference server: the TCP ports a watched process listens on, and one bounded GET.

Both run inside RawSource.call, so a trace keeps their results (the listening ports, the answer of
each GET) and a replay never touches the network, /proc/<pid>/fd or /proc/<pid>/ns.
"""
from __future__ import annotations

import http.client
import ipaddress
import os
import re
import socket
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Iterable

from hybridmon.exporters.sources import RawSource
from hybridmon.exporters.base import ParseError
from hybridmon.exporters.inference_formats import keep_known_families

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column
_SOCKET_LINK = re.compile(r"socket:\[([0-9]{1,20})\]")
_HEX_PORT = re.compile(r"[0-9A-Fa-f]{4}")
_ACCEPT = "text/plain;version=0.0.4;q=0.9,application/json;q=0.5,*/*;q=0.1"
USER_AGENT = "hybridmon"


@dataclass(frozen=True)
class Listener:
    address: str
    port: int
    inode: int


def parse_proc_net_tcp(text: str, byteorder: str = sys.byteorder) -> list[Listener]:
    """The listening sockets of /proc/<pid>/net/tcp or tcp6 (the same format; the address is the
    kernel's __be32 words printed as host-order hex, so each word's bytes are reversed on a
    little-endian host)."""
    lines = text.splitlines()
    if not lines or not lines[0].lstrip().startswith("sl"):
        raise ParseError("no 'sl local_address ...' header: not /proc/net/tcp")
    listeners = []
    for line in lines[1:]:
        columns = line.split()
        if not columns:
            continue
        if len(columns) < 10:
            raise ParseError(f"short /proc/net/tcp line {line[:80]!r}")
        address_hex, _, port_hex = columns[1].partition(":")
        if columns[3] != _LISTEN:
            continue
        if not _HEX_PORT.fullmatch(port_hex) or not columns[9].isdigit() or len(columns[9]) > 20:
            raise ParseError(f"bad port or inode in /proc/net/tcp line {line[:80]!r}")
        listeners.append(Listener(_address(address_hex, byteorder), int(port_hex, 16), int(columns[9])))
    return listeners


def _address(hex_text: str, byteorder: str) -> str:
    if len(hex_text) not in (8, 32) or not re.fullmatch(r"[0-9A-Fa-f]+", hex_text):
        raise ParseError(f"bad address {hex_text[:40]!r} in /proc/net/tcp")
    words = [bytes.fromhex(hex_text[i:i + 8]) for i in range(0, len(hex_text), 8)]
    if byteorder == "little":
        words = [word[::-1] for word in words]
    return str(ipaddress.ip_address(b"".join(words)))


def find_listeners(source: RawSource, procfs: str, pids: Iterable[int]) -> dict[str, list[list]]:
    """{pid: [[address, port], ...]} of the TCP sockets each process listens on: the listening
    sockets of its network namespace (net/tcp, net/tcp6) whose inode one of its fds holds.
    A process whose fds cannot be read (it exited, or it belongs to another user and the agent is
    not root) is left out, and so is one without a socket: its table is not read at all.

    Each read of /proc/<pid>/net/tcp makes the kernel walk its whole connection hash (sized by RAM,
    ~3.3 ms of kernel time on a 2-core VM even when nearly empty), and every process of one network
    namespace sees the same table; so each namespace's tables are read once per call, through the
    first pid of it whose table can be read. A pid whose /proc/<pid>/ns/net link cannot be read
    (ptrace-mode access: another user's process to an agent that is not root) reads its own."""
    found: dict[str, list[list]] = {}
    tables = _NamespaceTables(source)
    for pid in pids:
        base = os.path.join(procfs, str(pid))
        try:
            inodes = {int(match.group(1)) for entry in source.list_dir(os.path.join(base, "fd"))
                      if (match := _SOCKET_LINK.fullmatch(_readlink(os.path.join(base, "fd", entry))))}
        except OSError:
            continue
        if not inodes:
            continue  # no socket, so nothing it could listen on
        listening = tables.listening(base)
        ports = {listening[inode] for inode in inodes if inode in listening}
        if ports:
            found[str(pid)] = [[address, port] for address, port in sorted(ports, key=lambda p: (p[1], p[0]))]
    return found


class _NamespaceTables:
    """The listening sockets of each network namespace met in one find_listeners call, keyed by
    the namespace's /proc/<pid>/ns/net link ("net:[4026531840]", the nsfs inode that identifies
    it host-wide); a pid whose link cannot be read is a namespace of its own."""

    def __init__(self, source: RawSource) -> None:
        self._source = source
        self._read: dict[tuple[str, str], dict[int, tuple[str, int]]] = {}

    def listening(self, base: str) -> dict[int, tuple[str, int]]:
        """{inode: (address, port)} of the listening sockets in net/tcp and net/tcp6 of the
        namespace of the process at `base` (/proc/<pid>)."""
        namespace = _readlink(os.path.join(base, "ns", "net")) or "own:" + base
        listening: dict[int, tuple[str, int]] = {}
        for table in ("tcp", "tcp6"):
            key = (namespace, table)
            if key not in self._read:
                try:
                    listeners = parse_proc_net_tcp(self._source.read_text(os.path.join(base, "net", table)))
                except (OSError, ParseError):
                    # No IPv6 in this kernel, or a table we cannot read (the pid exited since its fds
                    # were listed): not kept, so the namespace's next pid tries its own path.
                    continue
                self._read[key] = {entry.inode: (entry.address, entry.port) for entry in listeners}
            listening.update(self._read[key])
        return listening


def _readlink(path: str) -> str:
    # RawSource has no readlink; this runs only inside a call's fetch, whose result is the reading.
    try:
        return os.readlink(path)
    except OSError:
        return ""  # the fd was closed since the listing, the pid exited, or ns/ is not ours to read


def connect_host(address: str) -> str:
    """The host part of a URL that reaches a socket bound to `address` from this host."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    if ip.is_unspecified:
        return "127.0.0.1" if ip.version == 4 else "[::1]"
    return str(ip) if ip.version == 4 else f"[{ip}]"


class _TooLarge(Exception):
    pass


def fetch(url: str, timeout_seconds: float, max_bytes: int) -> dict:
    """GET url, as JSON data: url, status, content_type, body, error, detail, seconds.

    error is None, timeout, refused, connection, http_status is left to the caller (status says
    it), too_large. The whole exchange, not each read, is bounded by timeout_seconds: a watchdog
    shuts the socket at the deadline, so a server that trickles bytes cannot hold the collector.
    At most max_bytes of body are read. Only the lines of known servers' families are kept.
    """
    started = time.monotonic()
    answer: dict = {"url": url, "status": None, "content_type": None, "body": None, "error": None,
                    "detail": ""}
    cut = threading.Event()
    try:
        _get(url, timeout_seconds, max_bytes, answer, started + timeout_seconds, cut)
    except _TooLarge as error:
        answer.update(error="too_large", detail=str(error), body=None)
    except ConnectionRefusedError:
        answer.update(error="refused", detail="connection refused")
    except (OSError, http.client.HTTPException, ValueError) as error:
        if cut.is_set() or isinstance(error, TimeoutError):
            answer.update(error="timeout", detail=f"no complete answer within {timeout_seconds:g} s",
                          body=None)
        else:
            answer.update(error="connection", detail=f"{type(error).__name__}: {error}"[:200], body=None)
    answer["seconds"] = round(time.monotonic() - started, 6)
    return answer


def _get(url: str, timeout: float, max_bytes: int, answer: dict, deadline: float,
         cut: threading.Event) -> None:
    parts = urllib.parse.urlsplit(url)
    https = parts.scheme == "https"
    host, port = parts.hostname or "", parts.port or (443 if https else 80)
    _resolve_within(host, port, deadline)
    connection_class = http.client.HTTPSConnection if https else http.client.HTTPConnection
    connection = connection_class(host, port, timeout=timeout)
    try:
        connection.connect()
        watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), _shut, (connection.sock, cut))
        watchdog.daemon = True
        watchdog.start()
        try:
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            connection.request("GET", path, headers={"Accept": _ACCEPT, "User-Agent": USER_AGENT})
            response = connection.getresponse()
            answer.update(status=response.status, content_type=response.getheader("Content-Type"))
            if response.status == 200:
                answer["body"] = keep_known_families(_read_body(response, max_bytes).decode("utf-8", "replace"))
            if cut.is_set():
                raise TimeoutError("deadline")
        finally:
            watchdog.cancel()
    finally:
        connection.close()


def _resolve_within(host: str, port: int, deadline: float) -> None:
    """Looks a host name up in a thread of its own: the resolver ignores socket timeouts, and a
    hung DNS server must cost this scrape its timeout, not the resolver's (often 30 s)."""
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    outcome: list[BaseException] = []

    def look_up() -> None:
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as error:
            outcome.append(error)

    resolver = threading.Thread(target=look_up, name=f"resolve {host}", daemon=True)
    resolver.start()
    resolver.join(max(0.0, deadline - time.monotonic()))
    if resolver.is_alive():
        raise TimeoutError(f"the name lookup of {host} did not finish in time")
    if outcome:
        raise outcome[0]


def _read_body(response: http.client.HTTPResponse, max_bytes: int) -> bytearray:
    length = response.getheader("Content-Length") or ""
    if length.isdigit() and int(length) > max_bytes:
        raise _TooLarge(f"Content-Length {length} is over the {max_bytes} byte limit")
    body = bytearray()
    while chunk := response.read(min(1 << 16, max_bytes + 1 - len(body))):
        body += chunk
        if len(body) > max_bytes:
            raise _TooLarge(f"the body is over the {max_bytes} byte limit; stopped reading there")
    return body   # decoded as it is: a bytes copy would hold another max_bytes


def _shut(sock, cut: threading.Event) -> None:
    cut.set()
    try:
        sock.shutdown(2)  # SHUT_RDWR: the blocked read returns at once
    except (OSError, AttributeError):
        pass
