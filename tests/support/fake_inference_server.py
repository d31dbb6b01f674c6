"""A stand-in inference server on 127.0.0.1 for the tests: serves fixture bodies, and misbehaves on
request (HTML, slow, trickling, a 100 MB body, HTTP 500, down).

    with FakeInferenceServer({"/metrics": [body1, body2]}) as server:
        server.url("/metrics"); server.next_body(); server.mode = "html"; server.down(); server.up()
"""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Mapping, Sequence

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
HTML_PAGE = b"<!DOCTYPE html><html><head><title>Login</title></head><body>Sign in</body></html>\n"
HUGE_BYTES = 100 * 1024 * 1024
MODES = ("serve", "html", "slow", "trickle", "huge", "huge_declared", "status_500")


class FakeInferenceServer:
    """Bodies per path; each path serves its current body until next_body() moves every path on.

    mode: serve (the current body), html (a login page, text/html), slow (answers after
    slow_seconds), trickle (headers, then one byte every 0.2 s until the client gives up), huge
    (100 MB without Content-Length, streamed), huge_declared (Content-Length of 100 MB), status_500.
    A path without bodies answers 404, as Ollama does for /metrics.
    """

    def __init__(self, bodies: Mapping[str, Sequence[str]], content_types: Mapping[str, str] | None = None,
                 slow_seconds: float = 3.0) -> None:
        self.bodies = {path: list(texts) for path, texts in bodies.items()}
        self.content_types = dict(content_types or {})
        self.slow_seconds = slow_seconds
        self.mode = "serve"
        self.position = 0
        self.requests: list[str] = []
        self.bytes_sent = 0
        self._stopping = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    def __enter__(self) -> "FakeInferenceServer":
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def url(self, path: str = "/metrics") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def next_body(self) -> None:
        self.position += 1

    def up(self) -> None:
        """Listen (again, on the same port after down())."""
        self._stopping.clear()
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), _handler_for(self))
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="fake-inference",
                                        daemon=True)
        self._thread.start()

    def down(self) -> None:
        """Stop listening: connections are refused until up()."""
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)

    stop = down

    def current(self, path: str) -> str | None:
        texts = self.bodies.get(path)
        if not texts:
            return None
        return texts[min(self.position, len(texts) - 1)]


def _handler_for(fake: FakeInferenceServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            fake.requests.append(self.path)
            try:
                self._answer()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up, as it should on huge and trickling answers

        def _answer(self) -> None:
            mode = fake.mode
            if mode == "slow" and fake._stopping.wait(fake.slow_seconds):
                return
            if mode == "status_500":
                return self._send(500, b"internal error\n", "text/plain")
            if mode == "html":
                return self._send(200, HTML_PAGE, "text/html; charset=utf-8")
            if mode in ("huge", "huge_declared"):
                return self._huge(declared=mode == "huge_declared")
            body = fake.current(self.path)
            if body is None:
                return self._send(404, b"404 page not found\n", "text/plain")
            content_type = fake.content_types.get(self.path, PROMETHEUS_TEXT)
            if mode == "trickle":
                return self._trickle(body.encode(), content_type)
            self._send(200, body.encode(), content_type)

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            fake.bytes_sent += len(body)

        def _huge(self, declared: bool) -> None:
            self.send_response(200)
            self.send_header("Content-Type", PROMETHEUS_TEXT)
            if declared:
                self.send_header("Content-Length", str(HUGE_BYTES))
            self.end_headers()
            line = b'vllm:num_requests_running{model_name="m"} 1.0\n'
            chunk = line * (65536 // len(line))
            sent = 0
            while sent < HUGE_BYTES and not fake._stopping.is_set():
                self.wfile.write(chunk)
                sent += len(chunk)
                fake.bytes_sent += len(chunk)

        def _trickle(self, body: bytes, content_type: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            for byte in body:
                if fake._stopping.wait(0.2):
                    return
                self.wfile.write(bytes([byte]))
                self.wfile.flush()

    return Handler


def vllm_with_models(count: int, name: str = "hostile/model-{}") -> str:
    """A vLLM V1 body (its families as vllm/v1/metrics/loggers.py names them) publishing `count`
    models, three series each, model i having generated i tokens: what a peer that publishes
    thousands of models sends (issue 30: 75,000 in a 7.8 MB body)."""
    lines = ["# TYPE vllm:num_requests_running gauge", "# TYPE vllm:generation_tokens_total counter",
             "# TYPE vllm:kv_cache_usage_perc gauge"]
    for i in range(count):
        model = name.format(i)
        lines += [f'vllm:num_requests_running{{engine="0",model_name="{model}"}} 1.0',
                  f'vllm:generation_tokens_total{{engine="0",model_name="{model}"}} {float(i)}',
                  f'vllm:kv_cache_usage_perc{{engine="0",model_name="{model}"}} 0.5']
    return "\n".join(lines) + "\n"
