"""/metrics as scrapers ask for it: gzip, HEAD, OpenMetrics, and headers nobody should send.

One real `hybridmon run`, replaying a two-tick trace of the fixture host as fast as it can, so that
once the replay is over every body is the same and GET, HEAD, gzip and identity can be compared
byte for byte. Requests go through http.client, which adds no Accept-Encoding of its own (httpx
and requests do). Prometheus itself negotiating with the agent is checked in
test_live_alert_path.py (test_prometheus_scrapes_every_agent_in_openmetrics_and_gzip).
"""
from __future__ import annotations

import gzip
import http.client
import socket

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from hybridmon.agent.daemon import Agent
from hybridmon.agent.publish.exposition import accepts_gzip, choose_format
from hybridmon.agent.self_metrics import BUILD_INFO
from tests.support.agent_helpers import (
    FIXTURE_ENVIRONMENT, fixture_config, free_port, run_every_collector_once, start_daemon, stop_daemon, wait_for,
)

# What Prometheus 2.42 sends with every scrape (scrape/scrape.go acceptHeader; the string is in the
# installed `prometheus` binary), and the Accept-Encoding it adds ("gzip").
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
TEXT_TYPE = "text/plain; version=1.0.0; charset=utf-8"
OPENMETRICS_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"


@pytest.fixture(scope="module")
def port(tmp_path_factory):
    trace = tmp_path_factory.mktemp("negotiation") / "fixture.trace.gz"
    recorder = Agent(fixture_config(), record_to=trace)
    run_every_collector_once(recorder, 1_700_000_000.0)
    run_every_collector_once(recorder, 1_700_000_001.0)
    recorder.stop()
    port = free_port()
    process = start_daemon(["run", "--listen", f"127.0.0.1:{port}", "--replay", str(trace), "--speed", "0"],
                           FIXTURE_ENVIRONMENT)
    try:
        # The replay is over when two bodies in a row are the same.
        previous = [b""]

        def settled() -> bool:
            try:
                body = get(port)[2]
            except OSError:  # not listening yet
                return False
            same, previous[0] = body == previous[0], body
            return same and BUILD_INFO.name.encode() in body

        wait_for(settled, 20, "the replayed agent's /metrics to settle")
        yield port
    finally:
        code, log = stop_daemon(process)
        assert code == 0, log


def request(port: int, method: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request(method, "/metrics", headers=headers or {})
        response = connection.getresponse()
        body = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, body
    finally:
        connection.close()


def get(port: int, **headers: str) -> tuple[int, dict[str, str], bytes]:
    return request(port, "GET", {name.replace("_", "-"): value for name, value in headers.items()})


def names(families) -> set[str]:
    return {family.name for family in families}


def test_the_default_is_the_text_format_uncompressed(port):
    status, headers, body = get(port)
    assert status == 200
    assert headers["content-type"] == TEXT_TYPE
    assert "content-encoding" not in headers
    assert headers["vary"] == "Accept, Accept-Encoding"
    assert int(headers["content-length"]) == len(body)
    assert BUILD_INFO.name in names(parse_text(body.decode()))


def test_gzip_when_asked_with_the_same_body(port):
    _status, _headers, plain = get(port)
    status, headers, body = get(port, Accept_Encoding="gzip")
    assert status == 200 and headers["content-encoding"] == "gzip"
    assert int(headers["content-length"]) == len(body) < len(plain) / 2
    assert without_own_process(gzip.decompress(body)) == without_own_process(plain)


@pytest.mark.parametrize("accept_encoding, gzipped", [
    ("gzip", True),
    ("gzip, deflate, br", True),
    ("*", True),
    ("GZIP;q=0.5", True),
    ("x-gzip", True),
    ("gzip;q=0", False),             # refused explicitly
    ("*;q=1, gzip;q=0", False),      # the explicit refusal wins over the wildcard
    ("gzip;q=0.000", False),
    ("identity", False),
    ("br", False),
    ("", False),
    ("gzip;q=abc", False),           # a malformed weight: the item is ignored
    ("gzip;q=2", False),             # out of range: ignored
])
def test_accept_encoding_is_honoured_q_values_included(port, accept_encoding, gzipped):
    _status, headers, _body = get(port, Accept_Encoding=accept_encoding)
    assert (headers.get("content-encoding") == "gzip") is gzipped
    assert accepts_gzip(accept_encoding) is gzipped


def test_head_answers_gets_headers_without_a_body(port):
    for encoding in ("identity", "gzip"):
        _status, get_headers, get_body = get(port, Accept_Encoding=encoding)
        status, head_headers, head_body = request(port, "HEAD", {"Accept-Encoding": encoding})
        assert status == 200 and head_body == b""
        for name in ("content-type", "content-encoding", "vary"):
            assert head_headers.get(name) == get_headers.get(name), (encoding, name)
        # the same body but for the agent's own process_* values (CPU seconds, resident memory), whose
        # digits change from one request to the next: a few bytes either way, never a body
        assert abs(int(head_headers["content-length"]) - len(get_body)) <= 32, encoding
        assert int(get_headers["content-length"]) == len(get_body)


def without_own_process(body: bytes) -> bytes:
    """A /metrics body without the agent's own process_* lines (CPU seconds, resident memory):
    they change from one scrape to the next; everything else on the fixture host is fixed."""
    own = (b"process_", b"# HELP process_", b"# TYPE process_")
    return b"\n".join(line for line in body.split(b"\n") if not line.startswith(own))


def test_openmetrics_when_negotiated_and_it_parses(port):
    status, headers, body = get(port, Accept=PROMETHEUS_ACCEPT)
    assert status == 200 and headers["content-type"] == OPENMETRICS_TYPE
    text = body.decode()
    assert text.endswith("# EOF\n") and text.count("# EOF") == 1
    # The strict parser: one EOF at the end, no family twice, counters' samples named *_total.
    openmetrics_families = list(parse_openmetrics(text))
    plain = list(parse_text(get(port)[2].decode()))
    assert names(openmetrics_families) == names(plain)
    assert sum(len(f.samples) for f in openmetrics_families) == sum(len(f.samples) for f in plain)
    gzipped = get(port, Accept=PROMETHEUS_ACCEPT, Accept_Encoding="gzip")
    assert gzipped[1]["content-type"] == OPENMETRICS_TYPE
    assert without_own_process(gzip.decompress(gzipped[2])) == without_own_process(body)


@pytest.mark.parametrize("accept, chosen", [
    (PROMETHEUS_ACCEPT, "openmetrics"),
    ("application/openmetrics-text", "openmetrics"),
    ("text/plain;version=0.0.4;q=0.9,application/openmetrics-text;q=0.5", "text"),
    ("application/openmetrics-text;q=0", "text"),
    ("*/*", "text"),
    ("text/html", "text"),            # nothing we serve: the default, not 406 (a scrape must not fail)
    ("application/openmetrics-text;q=x", "text"),
    ("", "text"),
    (None, "text"),
])
def test_accept_chooses_openmetrics_only_when_preferred(accept, chosen):
    assert choose_format(accept) == chosen


def test_hostile_accept_headers_get_a_sane_answer(port):
    # Long but within the server's request-head limit: thousands of malformed items.
    junk = ",".join(["application/openmetrics-text;q=nope"] * 300)
    status, headers, body = get(port, Accept=junk, Accept_Encoding=",".join(["gzip;q=;;;="] * 300))
    assert status == 200 and headers["content-type"] == TEXT_TYPE and "content-encoding" not in headers
    assert BUILD_INFO.name in names(parse_text(body.decode()))
    # 100 KB of one token: h11 takes a head this size when it arrives whole (its 16 KiB limit is on
    # a head still incomplete), so the answer is the default format; or a 4xx for the request.
    # Either way an answer, at once, and the agent serves on.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAccept: " + b"a" * 100_000 + b"\r\n\r\n")
        answer = sock.recv(4096)
    assert answer.startswith((b"HTTP/1.1 200", b"HTTP/1.1 4")), answer[:200]
    if answer.startswith(b"HTTP/1.1 200"):
        assert f"content-type: {TEXT_TYPE}".encode() in answer.lower()
    # Not UTF-8, control characters: the header is read as Latin-1 and matches nothing.
    status, headers, _body = get(port, Accept="\xff\xfe;q=\x01, application/openmetrics-text")
    assert status == 200 and headers["content-type"] == OPENMETRICS_TYPE
    assert get(port)[0] == 200
