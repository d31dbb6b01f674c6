"""The tests of the pcie_bandwidth_low alert family (agent/alerts/pcie_bandwidth_low.py): its rule's promtool cases
(`promtool_cases`, written to rules/tests/generated_pcie_bandwidth_low.yml by `python -m tests.rules.generate`
and run by promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

from tests.support.promtool_cases import GPU0, GPU1, GPU2, GPU3, Test
from tests.support.promtool_inputs import capacity, link, measured


def promtool_cases(t, catalog) -> list[Test]:
    b = t.pcie_bandwidth_low
    rule = catalog.find("GpuPcieBandwidthLow")
    gen4, gen5 = capacity(4, 16), capacity(5, 16)
    test = Test("measured bandwidth: GPU 0 (Gen4 x16) at half its link and GPU 2 (Gen5 x16) just "
                "under its floor fire; GPU 1 healthy and GPU 3 never measured stay silent",
                240, catalog)
    slow, gen5_low = b.floor_share_gen4 / 2 * gen4, (b.floor_share_gen5 - 0.02) * gen5
    healthy4, healthy5 = (b.floor_share_gen4 + 0.02) * gen4, min(b.floor_share_gen5 + 0.05, 1) * gen5
    for gpu, max_generation in ((GPU0, 4), (GPU1, 4), (GPU2, 5), (GPU3, 4)):
        link(test, gpu, 1, 16, max_generation)  # idle: links downshift, the max is what counts
    measured(test, GPU0, slow, healthy4)
    measured(test, GPU1, healthy4, healthy4)
    measured(test, GPU2, healthy5, gen5_low)
    test.expect(120, rule.alert,
                test.alert(rule, GPU0, value=slow / gen4, measured=slow, best=gen4, max_gen=4, max_width=16),
                test.alert(rule, GPU2, value=gen5_low / gen5, measured=gen5_low, best=gen5, max_gen=5,
                           max_width=16))
    return [test]
