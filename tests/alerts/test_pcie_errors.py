"""The tests of the pcie_errors alert family (agent/alerts/pcie_errors.py): its rule's promtool cases
(`promtool_cases`, written to rules/tests/generated_pcie_errors.yml by `python -m tests.rules.generate`
and run by promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

from hybridmon.exporters.gpu import PCIE_REPLAYS
from hybridmon.exporters.pcie import AER_ERRORS

from hybridmon.pcie_rates import replay_bound_per_minute
from tests.support.promtool_cases import (
    BUS0,
    BUS1,
    GPU0,
    GPU1,
    GPU2,
    ONSET,
    Test,
    firing,
    not_yet,
)
from tests.support.promtool_inputs import link


def replay_case(t, catalog) -> Test:
    e = t.pcie_errors
    rule = catalog.find("GpuPcieReplayErrors")
    gen4, gen5 = (replay_bound_per_minute(e.bit_error_rate, g, 16) for g in (4, 5))
    under_gen5 = gen5 - 1 if gen5 - 1 > gen4 else gen5 / 2  # too many for Gen4, fine for Gen5
    at = ONSET + int(e.window_seconds) + 60                  # the whole window after the onset
    test = Test("PCIe replays: GPU 0 (Gen4 x16) above its DCGM bound; GPU 1 (Gen5 x16) under its "
                "own bound; GPU 2's counter resets (driver reload) and stays silent", at + 120, catalog)
    link(test, GPU0, 4, 16)
    link(test, GPU1, 5, 16, 5)
    link(test, GPU2, 4, 16)
    test.counter(PCIE_REPLAYS.name, gen4 / 4 / 60, 2 * gen4 / 60, **GPU0)
    test.counter(PCIE_REPLAYS.name, under_gen5 / 60, under_gen5 / 60, **GPU1)
    per_step = gen4 / 2 / 60 * test.interval
    before = [1000 + per_step * i for i in range(9)]
    test.values(PCIE_REPLAYS.name,
                before + [per_step * i for i in range(test.samples - len(before))], **GPU2)
    test.expect(not_yet(0), rule.alert)
    test.expect(at, rule.alert, test.alert(rule, GPU0, value=2 * gen4, bound=gen4, gen=4, width=16))
    return test


def aer_uncorrectable_case(t, catalog) -> Test:
    rule = catalog.find("PcieAerErrors", "critical")
    test = Test("AER: one non-fatal error on 0000:17:00.0 is critical at once", ONSET + 360, catalog)
    test.gauge(AER_ERRORS.name, 0, 1, pci_bus_id=BUS0, severity="nonfatal")
    test.constant(AER_ERRORS.name, 0, pci_bus_id=BUS0, severity="fatal")
    test.constant(AER_ERRORS.name, 3, pci_bus_id=BUS1, severity="nonfatal")
    test.expect(not_yet(0), rule.alert)
    test.expect(firing(0), rule.alert, test.alert(rule, {"pci_bus_id": BUS0, "aer_severity": "nonfatal"},
                                                  value=1))
    return test


def aer_correctable_case(t, catalog) -> Test:
    e = t.pcie_errors
    rule = catalog.find("PcieAerErrors", "warning")
    per_hour = e.aer_correctable_per_hour
    at = ONSET + int(e.window_seconds) + 60
    test = Test("AER: a steady stream of correctable errors on 0000:ca:00.0 warns; half the "
                "rate on 0000:17:00.0 does not", at + 120, catalog)
    test.counter(AER_ERRORS.name, 0, 2 * per_hour / 3600, pci_bus_id=BUS1, severity="correctable")
    test.counter(AER_ERRORS.name, per_hour / 2 / 3600, per_hour / 2 / 3600,
                 pci_bus_id=BUS0, severity="correctable")
    test.expect(not_yet(0), rule.alert)
    test.expect(at, rule.alert, test.alert(rule, {"pci_bus_id": BUS1, "aer_severity": "correctable"},
                                           value=2 * per_hour))
    return test


def promtool_cases(t, catalog) -> list[Test]:
    return [replay_case(t, catalog),
            *([aer_uncorrectable_case(t, catalog)] if t.pcie_errors.aer_uncorrectable_any else []),
            aer_correctable_case(t, catalog)]
