"""A real Alertmanager (Debian's prometheus-alertmanager) and a webhook receiver, on loopback."""
from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from tests.agent_helpers import free_port


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
    """Starts prometheus-alertmanager routing everything to a webhook, fast group timers."""

    def __init__(self, directory: Path, webhook_url: str) -> None:
        binary = shutil.which("prometheus-alertmanager")
        assert binary, "scripts/test installs Debian's prometheus-alertmanager"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
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
             f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address="],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        self.close()
        raise AssertionError("Alertmanager did not become ready in 15 s")

    def alerts(self) -> list[dict]:
        return httpx.get(f"{self.url}/api/v2/alerts", timeout=2).json()

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
