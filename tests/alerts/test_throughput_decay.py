"""The tests of the throughput_decay alert family (agent/alerts/throughput_decay.py): its rule's promtool cases
(`promtool_cases`, written to rules/tests/generated_throughput_decay.yml by `python -m tests.rules.generate`
and run by promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

from hybridmon.agent.alerts.throughput_decay import GENERATED_TOKENS, REQUESTS_RUNNING

from tests.support.promtool_cases import Test, above
from tests.support.promtool_inputs import (
    LLAMA,
    LLAMA_SERVER,
    SGLANG_SERVER,
    VLLM,
    VLLM_SERVER,
    served,
    stepped,
    stepped_counter,
)


def promtool_cases(t, catalog) -> list[Test]:
    """vLLM's speed per request falls by more than the share at `change` with the same load and
    fires; SGLang's falls as much while its running requests halve (load fell), llama.cpp's falls
    by half the share: both silent. The baseline is the first baseline_seconds of the window."""
    d = t.throughput_decay
    rule = catalog.find("InferenceThroughputDecay")
    recent, window = int(d.recent_seconds), int(d.window_seconds)
    change = window   # from here on the baseline window, [now - window, ...], holds only "before"
    decay = above(d.decay_share)
    active = next(s for s in range(0, recent + 60, 60) if decay * s / recent >= d.decay_share)
    at = change + max(recent, active + int(d.for_seconds)) + 300
    test = Test("throughput decay: vLLM slows per request under the same load; SGLang slows as its "
                "load falls; llama.cpp slows a little: only vLLM fires", at + 60, catalog)
    test.interval = 60
    load, speed = 8.0, 60.0
    for labels, after, running_after in (
            (served(VLLM_SERVER, VLLM["pid"]), 1 - decay, load),
            (served(SGLANG_SERVER, "6161"), 1 - decay, load / 2),
            (served(LLAMA_SERVER, LLAMA["pid"]), 1 - d.decay_share / 2, load)):
        test.values(GENERATED_TOKENS.name, stepped_counter(test, change, speed * load,
                                                           speed * after * running_after), **labels)
        test.values(REQUESTS_RUNNING.name, stepped(test, change, load, running_after), **labels)
    test.expect(change + active + int(d.for_seconds) - 120, rule.alert)
    test.expect(at, rule.alert, test.alert(
        rule, VLLM_SERVER, value=decay, after=speed * (1 - decay), before=speed,
        running_now=load, running_then=load))
    return [test]
