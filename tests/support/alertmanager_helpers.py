"""Alertmanagers for tests on loopback: the real one (Debian's prometheus-alertmanager) with a webhook
receiver, a well-behaved stand-in, and hostile fakes that misbehave in every way issue 11 lists."""
from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from hybridmon.agent.detectors.base import DetectorBase, Finding
from hybridmon.agent.detectors.engine import Engine
from hybridmon.agent.loop.history import History
from tests.support.agent_helpers import free_port
from tests.support.tls_files import TlsFiles


class Switch(DetectorBase):
    """A detector whose finding, one per GPU in `gpus`, is on or off."""

    name = "test"
    alertnames = ("GpuPcieStarvation",)

    def __init__(self, for_seconds: float = 0.0) -> None:
        self.on = False
        self.gpus = ["0"]
        self.for_seconds = for_seconds

    def evaluate(self, _history, _now):
        if not self.on:
            return []
        return [Finding(
            alertname="GpuPcieStarvation", severity="warning", labels={"gpu": gpu, "uuid": f"GPU-x{gpu}"},
            value=29.1e9, threshold=26.8e9, summary=f"GPU {gpu} starved", description="link pinned",
            for_seconds=self.for_seconds, unit="B/s",
        ) for gpu in self.gpus]


def firing_engine() -> Engine:
    """An engine whose Switch fires on GPU 0, evaluated once: one alert to push."""
    switch = Switch()
    engine = Engine([switch], History(60))
    switch.on = True
    engine.evaluate(time.time())
    return engine


class WebhookReceiver:
    """Collects the notification bodies Alertmanager posts to it."""

    def __init__(self) -> None:
        self.notifications: list[dict] = []
        # (time.time() at arrival, body) of each notification, for delivery latencies.
        self.deliveries: list[tuple[float, dict]] = []
        received, delivered = self.notifications, self.deliveries

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the http.server API
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length))
                delivered.append((time.time(), body))
                received.append(body)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *_args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Alertmanager:
    """Starts prometheus-alertmanager routing everything to a webhook, fast group timers. With
    `web_config` (an exporter-toolkit file, tests/support/tls_files.py) it requires what that file
    says; `auth` (user, password) and `tls` (https, the client certificate) are what this helper's
    own requests use."""

    def __init__(self, directory: Path, webhook_url: str, port: int | None = None, web_config: Path | None = None,
                 auth: tuple[str, str] | None = None, tls: TlsFiles | None = None) -> None:
        binary = shutil.which("prometheus-alertmanager")
        assert binary, "scripts/test installs Debian's prometheus-alertmanager"
        self.port = port or free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        verify: ssl.SSLContext | bool = True
        if tls is not None:  # trust the test CA, and show the client certificate should it ask
            verify = ssl.create_default_context(cafile=str(tls.ca))
            verify.load_cert_chain(tls.client_cert, tls.client_key)
        self._client_options = {"auth": auth, "verify": verify}
        config = directory / "alertmanager.yml"
        config.write_text(
            "route:\n"
            "  receiver: webhook\n"
            "  group_by: [alertname]\n"
            "  group_wait: 1s\n"
            "  group_interval: 1s\n"
            "  repeat_interval: 1h\n"
            "receivers:\n"
            "  - name: webhook\n"
            "    webhook_configs:\n"
            f"      - url: {webhook_url}\n"
            "        send_resolved: true\n"
        )
        (directory / "data").mkdir(exist_ok=True)
        self.process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.path={directory / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address=",
             *([f"--web.config.file={web_config}"] if web_config else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1, **self._client_options).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        self.close()
        raise AssertionError("Alertmanager did not become ready in 15 s")

    def alerts(self) -> list[dict]:
        return httpx.get(f"{self.url}/api/v2/alerts", timeout=2, **self._client_options).json()

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class HostileAlertmanager:
    """A fake Alertmanager on 127.0.0.1 that misbehaves in one way (MODES), one thread per
    connection. The modes are the failures issue 11 reproduced against the old pusher (a non-HTTP
    answer, a body cut short, a peer dripping a byte a second, an endless 200), plus a hang and a
    500; no real Alertmanager behaves so, which is why the live test pairs them with a real one. Everything it does is bounded: the endless body stops at ENDLESS_CAP_BYTES, the
    drip after DRIP_SECONDS, a hung connection when the fake closes."""

    MODES = ("hang", "http_500", "garbage", "truncated", "drip", "endless")
    ENDLESS_CAP_BYTES = 128 * 1024 * 1024
    DRIP_SECONDS = 30
    CHUNK = 64 * 1024

    def __init__(self, mode: str, port: int = 0) -> None:
        assert mode in self.MODES, mode
        self.mode = mode
        self.server = socket.create_server(("127.0.0.1", port))
        self.server.settimeout(0.1)
        self.port = self.server.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.connections = 0
        self.bytes_sent = 0
        self._closed = threading.Event()
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._accept, daemon=True, name=f"hostile-{mode}")
        self.thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                connection, _ = self.server.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            with self._lock:
                self.connections += 1
                self._open.append(connection)
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _send(self, connection: socket.socket, data: bytes) -> None:
        connection.sendall(data)
        with self._lock:
            self.bytes_sent += len(data)

    def _serve(self, connection: socket.socket) -> None:
        try:
            connection.settimeout(5)
            self._read_request(connection)
            if self.mode == "hang":
                self._closed.wait(60)
            elif self.mode == "http_500":
                self._send(connection, b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 5\r\n"
                                       b"Connection: close\r\n\r\noops\n")
            elif self.mode == "garbage":
                self._send(connection, b"SSH-2.0-OpenSSH_9.2p1 this is not HTTP\r\n\r\n")
            elif self.mode == "truncated":
                self._send(connection, b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{\"partial\":")
            elif self.mode == "drip":
                self._drip(connection, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            elif self.mode == "endless":
                self._send(connection, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n")
                chunk = b"[" + b" " * (self.CHUNK - 1)
                sent = 0
                while sent < self.ENDLESS_CAP_BYTES and not self._closed.is_set():
                    self._send(connection, chunk)
                    sent += len(chunk)
        except OSError:
            pass  # the client gave up, as it should
        finally:
            connection.close()

    @staticmethod
    def _read_request(connection: socket.socket) -> None:
        """The whole request, so that closing afterwards is a clean close, not a reset."""
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = connection.recv(65536)
            if not chunk:
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        while len(body) < length:
            chunk = connection.recv(65536)
            if not chunk:
                return
            body += chunk

    def _drip(self, connection: socket.socket, answer: bytes) -> None:
        """One byte a second: each read succeeds, the whole answer takes len(answer) seconds."""
        deadline = time.monotonic() + self.DRIP_SECONDS
        for byte in answer:
            if self._closed.wait(1.0) or time.monotonic() > deadline:
                return
            self._send(connection, bytes([byte]))

    def close(self) -> None:
        self._closed.set()
        self.server.close()
        self.thread.join(timeout=2)
        with self._lock:
            for connection in self._open:
                try:
                    connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                connection.close()


def refused_url() -> str:
    """An address on which nothing listens: connections are refused."""
    return f"http://127.0.0.1:{free_port()}"


class AcceptingAlertmanager:
    """A well-behaved stand-in for Alertmanager's POST /api/v2/alerts: answers 200 with an empty
    body at once and keeps (time.monotonic() at arrival, alerts) of every push. The empty 200 is
    what Debian's prometheus-alertmanager 0.25 answers (its api/v2 postAlerts returns no payload);
    tests/integration/test_alertmanager_live.py runs the same delivery against that real binary.
    `status` 401 stands for one that does not accept the credentials (as exporter-toolkit answers)."""

    def __init__(self, status: int = 200) -> None:
        self.pushes: list[tuple[float, list[dict]]] = []
        self.authorizations: list[str | None] = []  # each push's Authorization header
        pushes, authorizations = self.pushes, self.authorizations

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):  # noqa: N802 - the http.server API
                length = int(self.headers.get("Content-Length", 0))
                pushes.append((time.monotonic(), json.loads(self.rfile.read(length))))
                authorizations.append(self.headers.get("Authorization"))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def wait_until(condition, timeout: float, what: str, poll_seconds: float = 0.05):
    """condition()'s first truthy result within `timeout` seconds; fails the test naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(poll_seconds)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
