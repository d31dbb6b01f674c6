"""The tests of the inference_scrape alert family (agent/alerts/inference_scrape.py): its rule's promtool cases
(`promtool_cases`, written to rules/tests/generated_inference_scrape.yml by `python -m tests.rules.generate`
and run by promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

from hybridmon.exporters.inference_names import SCRAPE_ERROR, SCRAPE_SUCCESS

from tests.support.promtool_cases import BEFORE_SAMPLES, Test, firing, not_yet
from tests.support.promtool_inputs import LLAMA_SERVER, VLLM_SERVER


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
