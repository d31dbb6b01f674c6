"""Serves one frozen copy of an exporter's /metrics: what a scraper itself costs for that body.

    python benchmarks/frozen_copy_server.py UPSTREAM_URL PORT

Until it gets SIGUSR1 it passes each request on to UPSTREAM_URL (a proxy: the exporter's body
grows while it warms up, its findings fire). At the first request after SIGUSR1 it fetches
UPSTREAM_URL once more, with that request's Accept and Accept-Encoding headers (so the copy is in
the format and encoding the scraper negotiates), and answers every request after with the same
status, Content-Type, Content-Encoding and bytes, doing nothing else.
benchmarks/scrape_under_load.py --frozen-copy has Prometheus scrape it beside the exporter: its
scrape_duration_seconds is Prometheus's own share (the request, decompressing, parsing and storing
every sample) plus this server's ~0.3 ms of Python, the floor that no work in the exporter can go
under. Listens on 127.0.0.1 only; HTTP/1.1 with keep-alive, as Prometheus scrapes.
"""
from __future__ import annotations

import signal
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COPIED_HEADERS = ("Content-Type", "Content-Encoding")


def serve(upstream: str, port: int) -> None:
    frozen: list[tuple[int, list[tuple[str, str]], bytes]] = []
    fetching = threading.Lock()
    freeze = threading.Event()
    signal.signal(signal.SIGUSR1, lambda _signum, _frame: freeze.set())

    class FrozenCopy(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 - BaseHTTPRequestHandler's name
            with fetching:
                if frozen:
                    status, headers, body = frozen[0]
                else:
                    request = urllib.request.Request(upstream, headers={
                        name: self.headers[name] for name in ("Accept", "Accept-Encoding") if self.headers[name]})
                    with urllib.request.urlopen(request, timeout=10) as response:
                        status, body = response.status, response.read()
                        headers = [(name, response.headers[name]) for name in COPIED_HEADERS if response.headers[name]]
                    if freeze.is_set():
                        frozen.append((status, headers, body))
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args) -> None:
            pass

    ThreadingHTTPServer(("127.0.0.1", port), FrozenCopy).serve_forever()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
