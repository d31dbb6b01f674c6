"""The hardened HTTP server in-process, with short limits: cap, write stall, log aggregation."""
from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time

import pytest

from hybridmon.agent.api.httpserver import ServerLimits, build_server, stop_aggregating
from hybridmon.agent.logs import RepeatedMessageFilter

BIG_BODY = b"x" * (8 << 20)  # more than every socket buffer between the server and a non-reader


async def small_or_big_app(scope, receive, send):
    """ASGI: /big answers 8 MiB, anything else 2 bytes."""
    if scope["type"] != "http":
        return
    body = BIG_BODY if scope["path"] == "/big" else b"ok"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def running_server(limits: ServerLimits):
    """The agent's server on 127.0.0.1 in a thread (uvicorn leaves signals alone off the main thread)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = build_server(small_or_big_app, limits, "warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        yield server, sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        stop_aggregating(server)
        sock.close()
    assert not thread.is_alive()


def get(port: int, path: str = "/") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=3) as conn:
        conn.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        chunks = []
        while chunk := conn.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def wait_until(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.mark.slow
def test_past_the_cap_the_oldest_idle_connection_makes_room_for_a_request():
    with running_server(ServerLimits(max_connections=4, request_timeout_seconds=30)) as (server, port):
        idle = [socket.create_connection(("127.0.0.1", port), timeout=3) for _ in range(10)]
        try:
            assert wait_until(lambda: server.guard.evicted >= 6, 3), server.guard.evicted
            assert len(server.guard.open) <= 4
            assert get(port).endswith(b"\r\n\r\nok")
            # The newest idle connections survived, the oldest were closed.
            assert [conn.recv(1) for conn in idle[:6]] == [b""] * 6
        finally:
            for conn in idle:
                conn.close()


@pytest.mark.slow
def test_a_client_that_does_not_read_its_response_is_cut_off_after_the_stall_limit():
    limits = ServerLimits(write_stall_timeout_seconds=0.5, request_timeout_seconds=30)
    with running_server(limits) as (server, port):
        stuck = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            stuck.connect(("127.0.0.1", port))
            stuck.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            started = time.monotonic()
            assert wait_until(lambda: server.guard.write_stalls == 1, 5)
            assert time.monotonic() - started < 3
            assert wait_until(lambda: not server.server_state.connections, 2)
            assert get(port).endswith(b"ok")  # and the server goes on
        finally:
            stuck.close()


@pytest.mark.slow
def test_a_request_that_does_not_arrive_in_time_is_closed_even_while_bytes_drip():
    with running_server(ServerLimits(request_timeout_seconds=0.5)) as (server, port):
        with socket.create_connection(("127.0.0.1", port), timeout=3) as conn:
            conn.sendall(b"GET / HTTP/1.1\r\n")
            started = time.monotonic()
            with pytest.raises(OSError):
                for _ in range(40):  # 4 s of dripped header bytes, unless the server closes first
                    conn.sendall(b"X-Drip: 1\r\n")
                    time.sleep(0.1)
            closed_after = time.monotonic() - started
        assert server.guard.request_timeouts == 1
        assert closed_after < 2, closed_after


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_repeated_warnings_make_one_line_and_one_summary_per_window(caplog):
    clock = FakeClock()
    repeats = RepeatedMessageFilter(window_seconds=60, clock=clock)
    logger = logging.getLogger("tests.chatty")
    logger.addFilter(repeats)
    try:
        with caplog.at_level(logging.WARNING, logger="tests.chatty"):
            for client in range(1000):
                logger.warning("Invalid HTTP request received from %s.", f"10.0.0.{client % 250}")
            logger.warning("another message")
            clock.now += 30
            repeats.flush()  # the window has not ended: nothing yet
            clock.now += 31
            repeats.flush()
            logger.warning("Invalid HTTP request received from %s.", "10.0.0.1")
    finally:
        logger.removeFilter(repeats)
    lines = [record.getMessage() for record in caplog.records]
    assert lines == [
        "Invalid HTTP request received from 10.0.0.0.",
        "another message",
        "Invalid HTTP request received from 10.0.0.0. (repeated 999 more times in the last 61 s, not shown)",
        "Invalid HTTP request received from 10.0.0.1.",
    ]
    assert repeats.suppressed_total == 999


@pytest.mark.slow
def test_accept_failing_for_lack_of_fds_sheds_idle_connections_and_logs_once(caplog):
    with running_server(ServerLimits(request_timeout_seconds=30)) as (server, port):
        idle = [socket.create_connection(("127.0.0.1", port), timeout=3) for _ in range(6)]
        try:
            assert wait_until(lambda: len(server.guard.open) == 6, 3)
            loop = server.servers[0].get_loop()
            context = {"message": "socket.accept() out of system resource",
                       "exception": OSError(24, "Too many open files")}
            with caplog.at_level(logging.WARNING, logger="hybridmon.agent.api.httpserver"):
                for _ in range(50):  # what asyncio's accept loop reports in one batch
                    loop.call_soon_threadsafe(server._loop_exception, loop, context)
                assert wait_until(lambda: server.guard.accept_failures == 50, 3)
            assert len(server.guard.open) == 3  # half the idle ones closed, once per retry
            assert [r.getMessage().startswith("cannot accept connections") for r in caplog.records] == [True]
        finally:
            for conn in idle:
                conn.close()


@pytest.mark.slow
def test_the_main_loop_wakes_once_a_second_and_at_once_when_told_to_exit(monkeypatch):
    """uvicorn's own loop wakes ten times a second (issue 33: 1.7 ms/s of an idle daemon's CPU)."""
    from hybridmon.agent.api import httpserver

    ticks = []
    real_on_tick = httpserver.AgentServer.on_tick

    async def counted(self, counter):
        ticks.append(time.monotonic())
        return await real_on_tick(self, counter)
    monkeypatch.setattr(httpserver.AgentServer, "on_tick", counted)
    with running_server(ServerLimits()) as (server, port):
        assert get(port).endswith(b"ok")
        ticks.clear()
        time.sleep(2.5)
        # 0.1 s ticks would be 25 here; the Date header and the warning summaries still refresh each second
        assert 2 <= len(ticks) <= 3, ticks
        told, before = time.monotonic(), len(ticks)
        server.should_exit = True  # from this thread, as the fixture's teardown does too
        assert wait_until(lambda: len(ticks) > before, 0.5)
        assert ticks[-1] - told < 0.5
