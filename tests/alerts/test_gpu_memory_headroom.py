"""The tests of the gpu_memory_headroom alert family (agent/alerts/gpu_memory_headroom.py): its rule's promtool cases
(`promtool_cases`, written to rules/tests/generated_gpu_memory_headroom.yml by `python -m tests.rules.generate`
and run by promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

import math

from hybridmon.exporters.gpu import MEMORY_TOTAL, MEMORY_USED
from hybridmon.rules import (
    pcie as recorded,  # its MEMORY_USED: the group's 1 min average of ours
)

from tests.support.promtool_cases import (
    GIB,
    GPU0,
    GPU1,
    GPU2,
    GPU3,
    MIB,
    Test,
    above,
    firing,
    not_yet,
    num,
)


def used_case(t, catalog) -> Test:
    h = t.gpu_memory_headroom
    rule = catalog.find("GpuMemoryHeadroomLow", reason="used")
    total = 24 * GIB
    full = above(h.used_share)
    test = Test("GPU memory: GPU 0 fills past the offload trigger; GPU 1 stays just under it",
                firing(h.for_seconds) + 120, catalog)
    for gpu, after in ((GPU0, full), (GPU1, 0.9 * h.used_share)):
        test.constant(MEMORY_TOTAL.name, total, **gpu)
        test.gauge(MEMORY_USED.name, 0.5 * total, after * total, **gpu)
    test.expect(not_yet(h.for_seconds), rule.alert)
    test.expect(firing(h.for_seconds), rule.alert,
                test.alert(rule, GPU0, value=full, used=full * total, total=total))
    return test


def forecast_case(t, catalog) -> Test:
    """GPU 0 fills at a steady rate from t=0: the rule judges once half the trend window has data
    and fires after forecast_for_seconds; its growth then stops and the forecast resolves as soon
    as the last local slope's span is flat (a window's median alone would keep it for minutes)."""
    h = t.gpu_memory_headroom
    rule = catalog.find("GpuMemoryHeadroomLow", reason="forecast")
    total, start = 24 * GIB + MIB, 12 * GIB
    local = recorded.local_slope_seconds(h.trend_window_seconds)
    active = int(math.ceil(h.trend_window_seconds / 2 / 60) * 60)
    at = active + math.ceil(h.forecast_for_seconds / 60) * 60 + 60
    left_at_eval = h.forecast_horizon_seconds / 2 + 0.5   # never a whole second: int() is safe
    rate = (total - start) / (at - 30 + left_at_eval)     # the 1 min average lags by 30 s
    if (total - start) / rate - (active - 30) > h.forecast_horizon_seconds:
        raise ValueError("forecast test: forecast_for_seconds too long for forecast_horizon_seconds")
    stop = at + 60                                         # growth stops here
    resolved = stop + int(math.ceil(local / 60) * 60)      # the last local slope's span is all flat
    test = Test("GPU memory forecast: GPU 0 fills within the horizon, then stops growing; GPU 1 "
                "rises too slowly, GPU 2 is flat, GPU 3 loads a model (one jump) just before the "
                "rule can judge", resolved + 120, catalog)
    for gpu in (GPU0, GPU1, GPU2, GPU3):
        test.constant(MEMORY_TOTAL.name, total, **gpu)
    test.values(MEMORY_USED.name, [start + rate * min(k * test.interval, stop) for k in range(test.samples)],
                **GPU0)
    slow = (total - start) / (4 * h.forecast_horizon_seconds) * test.interval
    test.add(MEMORY_USED.name, f"{start}+{slow!r}x{test.samples - 1}", **GPU1)
    test.constant(MEMORY_USED.name, 0.8 * total, **GPU2)
    jump = (active - 60) // test.interval   # samples before the jump
    test.add(MEMORY_USED.name,
             f"{num(0.1 * total)}x{jump - 1} {num(0.7 * total)}x{test.samples - jump - 1}", **GPU3)
    if h.forecast_for_seconds >= 60:
        test.expect(active + int(h.forecast_for_seconds) - 60, rule.alert)
    test.expect(at, rule.alert, test.alert(rule, GPU0, value=left_at_eval, per_hour=rate * 3600,
                                           free=rate * left_at_eval))
    test.expect(resolved, rule.alert)
    return test


def promtool_cases(t, catalog) -> list[Test]:
    return [used_case(t, catalog), forecast_case(t, catalog)]
