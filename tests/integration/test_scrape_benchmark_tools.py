"""The two tools docs/performance.md's "Scrapes under load" figures come from, besides
benchmarks/scrape_under_load.py itself: the frozen copy Prometheus scrapes to show its own share
of a scrape, and the process collector's same-run before/after cost."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from benchmarks.agent_bench import free_port

REPO = Path(__file__).resolve().parents[2]


def test_the_frozen_copy_passes_scrapes_on_until_told_then_serves_one_copy_in_the_negotiated_encoding():
    asked = []

    class Upstream(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            asked.append((self.headers["Accept"], self.headers["Accept-Encoding"]))
            body = f"hybridmon_test_value {len(asked)}\n".encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Encoding", "identity-for-the-test")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args) -> None:
            pass

    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    port = free_port()
    copy = subprocess.Popen([sys.executable, str(REPO / "benchmarks/frozen_copy_server.py"),
                             f"http://127.0.0.1:{upstream.server_port}/metrics", str(port)])
    try:
        headers = {"Accept": "text/plain;version=0.0.4", "Accept-Encoding": "gzip"}
        with httpx.Client(timeout=5) as client:
            deadline = time.monotonic() + 10
            while True:
                try:
                    first = client.get(f"http://127.0.0.1:{port}/metrics", headers=headers)
                    break
                except httpx.ConnectError:
                    assert time.monotonic() < deadline, "the frozen copy did not listen within 10 s"
                    time.sleep(0.05)
            copy.send_signal(signal.SIGUSR1)  # the warm-up is over: freeze at the next scrape
            time.sleep(0.2)
            frozen = [client.get(f"http://127.0.0.1:{port}/metrics", headers=headers) for _ in range(2)]
        assert asked == [("text/plain;version=0.0.4", "gzip")] * 2  # with the scraper's headers, once frozen
        for response in [first, *frozen]:
            assert response.content == f"hybridmon_test_value {1 if response is first else 2}\n".encode()
            assert response.headers["content-encoding"] == "identity-for-the-test"
            assert response.headers["content-type"] == "text/plain; version=0.0.4"
    finally:
        copy.terminate()
        copy.wait(5)
        upstream.shutdown()


def test_the_process_collector_cost_runs_this_tree_against_a_baseline_tree():
    finished = subprocess.run([sys.executable, str(REPO / "benchmarks/process_collector_cost.py"), "--processes", "3",
                               "--runs", "2", "--baseline-tree", str(REPO)],
                              capture_output=True, text=True, timeout=60, cwd=REPO)
    assert finished.returncode == 0, finished.stderr
    lines = finished.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["this", "baseline"]
    assert all("3 processes" in line and "(2 runs)" in line for line in lines)
