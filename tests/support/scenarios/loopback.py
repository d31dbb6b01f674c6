"""The synthetic vLLMs' endpoints on loopback while a trace is generated (see inference.py)."""
from __future__ import annotations

import http.server
import socket
import threading
from typing import Callable
from urllib.parse import urlsplit, urlunsplit

from tests.support.scenarios.inference import ENDPOINT, InferenceServer


class LoopbackServer:
    """Serves an InferenceServer's published answer over HTTP on 127.0.0.1 while a trace is made.

    It listens on a free port, not on its endpoint's (ENDPOINT's 18000, which another program, or
    another generation running beside this one, may hold): `route(fetch)` takes the endpoint's URLs
    to that port and gives the answer back under the URL asked for, so the trace records the
    endpoint. While the
    answer is "down" the port is held by a socket that does not listen: connections are refused.
    """

    def __init__(self, server: InferenceServer, endpoint: str = ENDPOINT) -> None:
        self.server = server
        self.endpoint = endpoint
        self._lock = threading.Lock()
        self._http: http.server.HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._placeholder: socket.socket | None = None
        self.port = 0

    def __enter__(self) -> "LoopbackServer":
        self._listen()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def route(self, fetch: Callable[[str, float, int], dict]) -> Callable[[str, float, int], dict]:
        """`fetch` (exporters.inference_scrape.fetch) that reaches this server for its endpoint's URLs."""
        configured = urlsplit(self.endpoint)

        def routed(url: str, timeout_seconds: float, max_bytes: int) -> dict:
            parts = urlsplit(url)
            if parts.netloc != configured.netloc:
                return fetch(url, timeout_seconds, max_bytes)
            self._follow_answer()
            answer = fetch(urlunsplit(parts._replace(netloc=f"127.0.0.1:{self.port}")), timeout_seconds, max_bytes)
            return {**answer, "url": url}
        return routed

    def _follow_answer(self) -> None:
        down = self.server.published()[0] == "down"
        with self._lock:
            if down and self._http is not None:
                self._stop_listening(hold_port=True)
            elif not down and self._http is None:
                self._listen()

    def _listen(self) -> None:
        if self._placeholder is not None:
            self._placeholder.close()
            self._placeholder = None
        # One request at a time (the collector's), answered in the serving thread itself.
        self._http = http.server.HTTPServer(("127.0.0.1", self.port), _handler_for(self.server, urlsplit(self.endpoint).path))
        self.port = self._http.server_address[1]
        self._thread = threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="scenario-inference-server", daemon=True)
        self._thread.start()

    def _stop_listening(self, hold_port: bool) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if hold_port:
            self._placeholder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._placeholder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._placeholder.bind(("127.0.0.1", self.port))

    def close(self) -> None:
        with self._lock:
            self._stop_listening(hold_port=False)
            if self._placeholder is not None:
                self._placeholder.close()
                self._placeholder = None


def _handler_for(server: InferenceServer, path: str) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
            answer, body = server.published()
            if self.path != path:
                status, content_type, body = 404, "text/plain; charset=utf-8", "Not Found\n"
            elif answer == "html":
                status, content_type = 200, "text/html; charset=utf-8"
            elif answer == "unavailable":
                status, content_type, body = 503, "text/plain; charset=utf-8", "Service Unavailable\n"
            else:
                status, content_type = 200, "text/plain; version=0.0.4; charset=utf-8"
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass  # a request per scrape: not worth a line each
    return Handler
