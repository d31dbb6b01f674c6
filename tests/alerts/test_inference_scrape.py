"""The tests of the inference_scrape alert family (agent/alerts/inference_scrape.py): its detector, on
histories written sample by sample, and its rule's promtool cases (`promtool_cases`, written
to rules/tests/generated_inference_scrape.yml by `python -m tests.rules.generate` and run by
promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

from hybridmon.agent.alerts.inference_scrape import Detector as ScrapeFailingDetector
from hybridmon.exporters.inference_names import SCRAPE_ERROR, SCRAPE_SUCCESS
from tests.support.detector_history import (
    T0,
    THRESHOLDS,
    VLLM_ENDPOINT,
    Trace,
    inference_rows,
    scrape_error_rows,
)
from tests.support.promtool_cases import BEFORE_SAMPLES, Test, firing, not_yet
from tests.support.promtool_inputs import LLAMA_SERVER, VLLM_SERVER


def test_a_failing_scrape_is_reported_while_it_is_in_the_latest_scrape():
    detector = ScrapeFailingDetector(THRESHOLDS.inference_scrape)
    trace = Trace()
    other = "http://127.0.0.1:8080/metrics"
    now = trace.run(T0, T0 + 60, 5.0, inference=lambda t: (
        scrape_error_rows(reason="not_prometheus") + inference_rows(endpoint=other, server="llamacpp")))
    (finding,) = detector.evaluate(trace.history, now)
    assert finding.labels == {"endpoint": VLLM_ENDPOINT, "reason": "not_prometheus"}
    assert finding.for_seconds == THRESHOLDS.inference_scrape.for_seconds
    assert "HTML" in finding.description and VLLM_ENDPOINT in finding.summary
    assert finding.summary.endswith("cannot be read: not_prometheus")
    # The next scrape succeeds: the error is gone at once, as Prometheus marks it stale.
    now = trace.run(now + 5, now + 5, 5.0, inference=lambda t: inference_rows())
    assert detector.evaluate(trace.history, now) == []


# --- its rule's promtool cases ------------------------------------------------------------------


def promtool_cases(t, catalog) -> list[Test]:
    wait = t.inference_scrape.for_seconds
    rule = catalog.find("InferenceServerScrapeFailing")
    test = Test("scrape failing: vLLM's endpoint answers HTML from the onset; llama.cpp's times out "
                "once", firing(wait) + 120, catalog)
    vllm, llama = VLLM_SERVER["endpoint"], LLAMA_SERVER["endpoint"]
    test.gauge(SCRAPE_SUCCESS.name, 1, 0, endpoint=vllm)
    test.gauge(SCRAPE_ERROR.name, None, 1, endpoint=vllm, reason="not_prometheus")
    test.constant(SCRAPE_SUCCESS.name, 1, endpoint=llama)
    rest = test.samples - BEFORE_SAMPLES - 1
    test.add(SCRAPE_ERROR.name, f"_x{BEFORE_SAMPLES} 1 stale _x{rest - 1}",
             endpoint=llama, reason="timeout")
    test.expect(not_yet(wait), rule.alert)
    test.expect(firing(wait), rule.alert,
                test.alert(rule, {"endpoint": vllm, "reason": "not_prometheus"}))
    return [test]
