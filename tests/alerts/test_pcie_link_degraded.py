"""The tests of the pcie_link_degraded alert family (agent/alerts/pcie_link_degraded.py): its rule's promtool cases
(`promtool_cases`, written to rules/tests/generated_pcie_link_degraded.yml by `python -m tests.rules.generate`
and run by promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

from hybridmon.exporters.gpu import UTILIZATION

from tests.support.promtool_cases import (
    GPU0,
    GPU1,
    GPU2,
    GPU3,
    Test,
    above,
    firing,
    not_yet,
)
from tests.support.promtool_inputs import capacity, link


def promtool_cases(t, catalog) -> list[Test]:
    d = t.pcie_link_degraded
    rule = catalog.find("GpuPcieLinkDegraded")
    busy = above(d.busy_utilization_at_least)
    test = Test("PCIe link degraded under load: GPU 0 drops to Gen3, GPU 2 to x8; GPU 1 idles "
                "at Gen1 and GPU 3 runs Gen1 at idle, Gen4 when busy: both silent",
                firing(d.for_seconds) + 120, catalog)
    link(test, GPU0, (4, 3), 16)
    link(test, GPU1, 1, 16)
    link(test, GPU2, 4, (16, 8))
    link(test, GPU3, (1, 4), 16)
    for gpu, before, after in ((GPU0, busy, busy), (GPU1, 0, 0), (GPU2, busy, busy), (GPU3, 0, busy)):
        test.gauge(UTILIZATION.name, before, after, **gpu)
    test.expect(not_yet(d.for_seconds), rule.alert)
    test.expect(firing(d.for_seconds), rule.alert,
                test.alert(rule, GPU0, value=capacity(3, 16) / capacity(4, 16), gen=3, width=16,
                           max_gen=4, max_width=16, util=busy),
                test.alert(rule, GPU2, value=capacity(4, 8) / capacity(4, 16), gen=4, width=8,
                           max_gen=4, max_width=16, util=busy))
    return [test]
