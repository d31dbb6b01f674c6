"""The agent's log as an operator's tools read it: one format for every line, JSON when asked,
and a shutdown told in the order it happens (agent/logs.py, agent/api/httpserver.py).

The daemon runs for real on the fixture host: `hybridmon run` on a free loopback port, a few
scrapes and one malformed request (so that uvicorn's loggers write too), then SIGTERM.
"""
from __future__ import annotations

import io
import json
import logging
import re
import socket
import threading
import warnings
from datetime import datetime

import httpx
import pytest

from hybridmon.agent.config import ConfigError, load_config
from hybridmon.agent.logs import JsonFormatter, configure_logging
from tests.support.agent_helpers import FIXTURE_ENVIRONMENT, free_port, start_daemon, stop_daemon, wait_for

# `2026-11-25T09:43:24.951+00:00 INFO hybridmon: message`: RFC 3339 time with its offset.
TEXT_LINE = re.compile(
    r"(?P<time>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d) "
    r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<logger>[\w.]+): (?P<message>.*)")

# The shutdown after SIGTERM, in the order it must be told: the signal first, then uvicorn's
# lines, then the agent's last one (the collectors stop after the server).
SHUTDOWN = [("hybridmon", "received SIGTERM, stopping"), ("uvicorn.error", "Shutting down"),
            ("uvicorn.error", "Finished server process"), ("hybridmon.agent.daemon", "stopped")]


def run_and_stop(*flags: str) -> str:
    port = free_port()
    process = start_daemon(["run", "--listen", f"127.0.0.1:{port}", *flags], FIXTURE_ENVIRONMENT)
    try:
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).status_code == 200,
                 20, "the agent to serve /metrics")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"NOT HTTP\r\n\r\n")  # uvicorn: "Invalid HTTP request received."
            sock.recv(1024)
    finally:
        code, log = stop_daemon(process)
    assert code == 0, log
    return log


def parse_text(log: str) -> list[dict]:
    records = []
    for line in log.splitlines():
        match = TEXT_LINE.fullmatch(line)
        assert match, f"not in the log format: {line!r}"
        records.append(match.groupdict())
    return records


def parse_json(log: str) -> list[dict]:
    records = []
    for line in log.splitlines():
        record = json.loads(line)  # every line one object
        assert set(record) >= {"time", "level", "logger", "message"}, line
        records.append(record)
    return records


@pytest.mark.parametrize("flags, parse", [((), parse_text), (("--log-format", "json"), parse_json)],
                         ids=["text", "json"])
def test_every_line_in_one_format_and_the_shutdown_in_order(flags, parse):
    records = parse(run_and_stop(*flags))
    for record in records:
        assert datetime.fromisoformat(record["time"]).utcoffset() is not None, record
    loggers = {record["logger"] for record in records}
    assert {"hybridmon", "uvicorn.error"} <= loggers, loggers  # uvicorn's lines are in it
    assert any(r["message"] == "Invalid HTTP request received." and r["level"] == "WARNING" for r in records)
    assert any(r["message"].startswith("hybridmon ") and " serving http://127.0.0.1:" in r["message"] for r in records)

    def position(logger: str, message: str) -> int:
        found = [i for i, r in enumerate(records) if r["logger"] == logger and r["message"].startswith(message)]
        assert len(found) == 1, (logger, message, records[-8:])
        return found[0]

    positions = [position(logger, message) for logger, message in SHUTDOWN]
    assert positions == sorted(positions), [records[i] for i in positions]
    assert positions[-1] == len(records) - 1, records[positions[-1]:]  # "stopped" is the last line


def test_the_log_format_is_a_configuration_key_too():
    assert load_config(environ={"HYBRIDMON_LOG_FORMAT": "JSON"}).log_format == "json"
    with pytest.raises(ConfigError, match="log_format.*text or json"):
        load_config(environ={"HYBRIDMON_LOG_FORMAT": "yaml"})


@pytest.fixture
def own_root_logger():
    """configure_logging replaces the root logger's handlers and the thread hook: put back pytest's after."""
    root = logging.getLogger()
    saved, level, hook = list(root.handlers), root.level, threading.excepthook
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in saved:
        root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(False)
    threading.excepthook = hook


def test_json_lines_carry_the_traceback_and_warnings_go_through_the_same_handler(own_root_logger):
    stream = io.StringIO()
    configure_logging("info", "json", stream=stream, force=True)
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        logging.getLogger("hybridmon.test").exception("it failed: %s", "twice\nover")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("an old API", DeprecationWarning)
    def crash() -> None:
        raise RuntimeError("in a thread")

    thread = threading.Thread(target=crash, name="sampler")
    thread.start()
    thread.join()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3, lines  # newlines in the message and the traceback stay inside one line
    failure, warning, thread_end = (json.loads(line) for line in lines)
    assert thread_end["message"] == "thread sampler ended by an uncaught exception"
    assert "RuntimeError: in a thread" in thread_end["exception"]
    assert failure["message"] == "it failed: twice\nover" and failure["level"] == "ERROR"
    assert failure["exception"].startswith("Traceback") and "ValueError: bad\nvalue" in failure["exception"]
    assert warning["logger"] == "py.warnings" and "DeprecationWarning: an old API" in warning["message"]


def test_a_root_logger_configured_first_is_left_alone(own_root_logger):
    """As logging.basicConfig: a test calling the CLI in-process keeps pytest's capture."""
    assert logging.getLogger().handlers  # pytest's
    assert configure_logging("info", "json", stream=io.StringIO()) is None
    with pytest.raises(ValueError, match="text, json"):
        configure_logging("info", "xml", stream=io.StringIO(), force=True)
    assert JsonFormatter().format(logging.makeLogRecord({"msg": "x"}))  # renders a bare record


def test_each_request_httpx_makes_is_not_an_info_line(own_root_logger):
    """Issue 30: httpx logs every request at INFO, one line per push per Alertmanager (~2,880 a day
    at the 30 s resend). Requests made through a real httpx client to a local server: nothing at
    info, the request line again at debug."""
    import http.server

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass
    server = http.server.HTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/api/v2/alerts"
    try:
        for level, expected in (("info", 0), ("debug", 1)):
            stream = io.StringIO()
            configure_logging(level, "text", stream=stream, force=True)
            with httpx.Client() as client:
                client.post(url, json=[])
            assert stream.getvalue().count("HTTP Request: POST") == expected, stream.getvalue()
    finally:
        server.shutdown()
        server.server_close()
