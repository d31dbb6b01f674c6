"""llama.cpp's llama-server read right (exporters/inference_llamacpp.py), from a body of the real
server (tests/fixtures/inference/llamacpp-b11434.prom, captured from llama-server b11434) and
bodies printed the way that server prints."""
from __future__ import annotations

import logging
import re

import pytest

from hybridmon.exporters.base import NoDataError
from hybridmon.exporters.inference import InferenceCollector
from hybridmon.exporters.inference_formats import interpret, normalise, parse_prometheus
from hybridmon.exporters.inference_llamacpp import (BUSY_SLOTS_PER_DECODE, METRICS_OFF_HINT, N_DECODE,
                                                    PROMPT_TOKENS, PROMPT_TOKENS_CACHED, RELATIVE_RESOLUTION,
                                                    TOKENS_PREDICTED, RisingCounter, decoded_tokens,
                                                    with_metrics_hint)
from hybridmon.exporters.inference_names import BY_FIELD, SCRAPE_ERROR
from hybridmon.exporters.sources import LiveSource
from tests.support.paths import FIXTURE_HOST, FIXTURES

REAL_BODY = (FIXTURES / "inference" / "llamacpp-b11434.prom").read_text()


def printed(value: float) -> str:
    """A value as llama-server prints it: `prometheus << item.value` on a std::stringstream
    (server-task.cpp to_metrics()), default precision 6 and no floatfield, which is printf's %g."""
    return format(value, "g")


def with_values(body: str, **values: float) -> str:
    """The body with some llamacpp: samples replaced (names without the prefix), printed as the
    server prints them."""
    for name, value in values.items():
        body, found = re.subn(rf"^(llamacpp:{name}) \S+$", rf"\g<1> {printed(value)}", body, flags=re.M)
        assert found == 1, name
    return body


def sample(body: str, name: str) -> float:
    return parse_prometheus(body)[name][0][1]


def stats_of(body: str):
    reading = interpret({"status": 200, "body": body, "content_type": "text/plain; version=0.0.4"}, "llamacpp")
    assert reading.error is None, reading.detail
    (stats,) = reading.stats
    return stats


def test_the_real_body_gives_every_field():
    stats = stats_of(REAL_BODY)
    decodes, busy = sample(REAL_BODY, N_DECODE), sample(REAL_BODY, BUSY_SLOTS_PER_DECODE)
    assert stats.generated_tokens == round(decodes * busy) >= sample(REAL_BODY, TOKENS_PREDICTED)
    assert stats.prompt_tokens == sample(REAL_BODY, PROMPT_TOKENS)
    assert stats.prefix_cache_hit_tokens == sample(REAL_BODY, PROMPT_TOKENS_CACHED) > 0
    assert stats.prefix_cache_queried_tokens == stats.prompt_tokens + stats.prefix_cache_hit_tokens
    assert stats.requests_running == 0 and stats.requests_waiting == 0
    assert stats.inter_token_latency.count == sample(REAL_BODY, TOKENS_PREDICTED)


def test_generated_tokens_rise_while_a_request_runs():
    """500 decodes of one busy slot since the real body, no request finished: tokens_predicted_total
    has not moved (the old reading: a rate of 0), the derived counter rose by 500."""
    decodes, busy = sample(REAL_BODY, N_DECODE), sample(REAL_BODY, BUSY_SLOTS_PER_DECODE)
    slot_decodes = round(decodes * busy)
    later = with_values(REAL_BODY, n_decode_total=decodes + 500,
                        n_busy_slots_per_decode=(slot_decodes + 500) / (decodes + 500), requests_processing=1)
    assert sample(later, TOKENS_PREDICTED) == sample(REAL_BODY, TOKENS_PREDICTED)
    assert stats_of(later).generated_tokens - stats_of(REAL_BODY).generated_tokens == 500


def test_bodies_without_the_decode_families_keep_tokens_predicted():
    """Builds before n_busy_slots_per_decode (the hand-written llamacpp.1.prom): unchanged."""
    body = (FIXTURES / "inference" / "llamacpp.1.prom").read_text()
    assert decoded_tokens(parse_prometheus(body)) is None
    assert normalise("llamacpp", parse_prometheus(body))[0].generated_tokens == sample(body, TOKENS_PREDICTED)


def _simulated_scrapes(decodes_per_scrape: list[int], busy_slots: list[int], slot_decodes: int = 1_301_234):
    """(true slot-decodes, body) per scrape of a server past a million decodes, printed with 6
    significant digits as the real one prints."""
    decodes = 1_234_567
    for count, busy in zip(decodes_per_scrape, busy_slots):
        decodes += count
        slot_decodes += count * busy
        yield slot_decodes, with_values(REAL_BODY, n_decode_total=decodes,
                                        n_busy_slots_per_decode=slot_decodes / decodes)


def test_six_significant_digits_past_a_million_decodes():
    """9,000 decodes (1,800 tokens/s over 5 s) a scrape: the derived counter is within its stated
    resolution of the truth and every interval's rate within two resolutions of the true one
    (no 0 then a spike); idle scrapes read exactly the same."""
    counts = [9000, 9000, 4000, 0, 0, 9000, 9000, 2500, 9000]
    busy = [1, 2, 2, 1, 1, 1, 2, 1, 2]
    truth, derived = [], []
    for true, body in _simulated_scrapes(counts, busy):
        assert printed(sample(body, N_DECODE)).endswith("e+06")  # the server's 6 digits
        truth.append(true)
        derived.append(stats_of(body).generated_tokens)
    for true, value in zip(truth, derived):
        assert abs(value - true) <= RELATIVE_RESOLUTION * true
    for i in range(1, len(truth)):
        true_increase, increase = truth[i] - truth[i - 1], derived[i] - derived[i - 1]
        assert abs(increase - true_increase) <= 2 * RELATIVE_RESOLUTION * truth[i]
        if true_increase == 0:
            assert increase == 0
        else:
            assert increase > 0


def test_a_fall_within_the_resolution_is_held_and_a_restart_passes():
    """A few decodes between scrapes can print a product a few tokens lower: without the guard a
    rate() would read that as a reset. Held, it reads unchanged; a real restart still resets."""
    # Two slots busy so far (1.86 per decode), then a few decodes of one slot per scrape: the
    # ratio falls by less than its printed step most scrapes, then by a whole step (1e-5 x 1.2e6).
    counts, busy = [1, 2, 3, 4, 5] * 8, [1] * 40
    values = [stats_of(body).generated_tokens
              for _, body in _simulated_scrapes(counts, busy, slot_decodes=2_301_234)]
    assert any(b < a for a, b in zip(values, values[1:])), "the jitter this guards against"
    guard = RisingCounter()
    key = ("llamacpp", "http://x/metrics", "", "")
    kept = [guard.keep(key, value) for value in values]
    assert all(b >= a for a, b in zip(kept, kept[1:]))
    assert all(abs(k - v) <= 2 * RELATIVE_RESOLUTION * v + 1 for k, v in zip(kept, values))
    assert guard.keep(key, 120.0) == 120.0  # the server restarted: counters start again


def _answer(url: str, status: int) -> dict:
    return {"url": url, "status": status, "content_type": "application/json; charset=utf-8",
            "body": None, "error": None, "detail": "", "seconds": 0.001}


def test_a_501_says_start_it_with_metrics():
    reading = interpret(with_metrics_hint(_answer("http://h:8080/metrics", 501)), "llamacpp")
    assert reading.error == "http_status" and METRICS_OFF_HINT in reading.detail
    other = _answer("http://h:8080/metrics", 503)
    assert with_metrics_hint(other) is other


def test_discovery_keeps_the_501_hint_instead_of_the_api_ps_404(caplog):
    """A watched llama-server without --metrics: /metrics answers 501 and /api/ps would answer 404.
    Before, discovery asked /api/ps and logged its 404; now it logs the hint and asks nothing else."""
    asked = []

    def fetch(url, timeout, max_bytes):
        asked.append(url)
        return _answer(url, 501 if url.endswith("/metrics") else 404)

    # The fixture host's pid 4242 listens on 0.0.0.0:18000 and 127.0.0.1:29500 (fixtures README).
    collector = InferenceCollector(LiveSource(), procfs=str(FIXTURE_HOST / "proc"), fetch=fetch,
                                   watched=lambda: {4242: "llama-server"})
    with caplog.at_level(logging.INFO, logger="hybridmon.exporters.inference"), pytest.raises(NoDataError):
        collector.collect()
    assert sorted(asked) == ["http://127.0.0.1:18000/metrics", "http://127.0.0.1:29500/metrics"]
    assert METRICS_OFF_HINT in caplog.text and "404" not in caplog.text


def test_a_configured_endpoint_without_metrics_reports_the_hint(caplog):
    url = "http://h:8080/metrics"
    collector = InferenceCollector(LiveSource(), endpoints=[(url, "llamacpp")], discover=False,
                                   fetch=lambda u, t, m: _answer(u, 501))
    with caplog.at_level(logging.WARNING, logger="hybridmon.exporters.inference"):
        samples = collector.collect()
    assert samples.value(SCRAPE_ERROR.name, endpoint=url, reason="http_status") == 1.0
    assert METRICS_OFF_HINT in caplog.text


def test_the_collector_never_lets_the_derived_counter_fall():
    """The guard is wired in: the collector's generated-token series from bodies whose product dips
    (the jitter of the test above) never falls, so rate() sees no reset."""
    counts, busy = [1, 2, 3, 4, 5] * 8, [1] * 40
    bodies = iter([body for _, body in _simulated_scrapes(counts, busy, slot_decodes=2_301_234)])
    url = "http://h:8080/metrics"
    collector = InferenceCollector(
        LiveSource(), endpoints=[(url, "llamacpp")], discover=False,
        fetch=lambda u, t, m: {**_answer(u, 200), "content_type": "text/plain; version=0.0.4",
                               "body": next(bodies)})
    series = [collector.collect().value(BY_FIELD["generated_tokens"].name, endpoint=url)
              for _ in range(len(counts))]
    assert all(b >= a for a, b in zip(series, series[1:]))
