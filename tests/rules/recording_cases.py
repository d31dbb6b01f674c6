"""The promtool cases of the recording rules several alert families share (rules/recordings.py):
every generation's link capacity and DCGM replay bound."""
from __future__ import annotations

from hybridmon.pcie_rates import replay_bound_per_minute
from hybridmon.rules import pcie
from tests.support.promtool_cases import Test
from tests.support.promtool_inputs import capacity, link


def promtool_cases(thresholds, catalog) -> list[Test]:
    """promtool cases of the shared recording rules: every generation's capacity and replay bound."""
    test = Test("capacity and DCGM replay bound of every generation", 120, catalog)
    links = [(generation, 16) for generation in range(1, 7)] + [(3, 8), (4, 1)]
    gpus = []
    for index, (generation, width) in enumerate(links):
        gpu = {"gpu": str(index), "uuid": f"GPU-{index:08x}-0000-4000-8000-000000000000"}
        link(test, gpu, generation, width, 6, 16)
        gpus.append((gpu, generation, width))
    test.expect_samples(60, pcie.CAPACITY_THEORETICAL,
                        *((gpu, capacity(g, w)) for gpu, g, w in gpus))
    bit_error_rate = thresholds.pcie_errors.bit_error_rate
    test.expect_samples(60, pcie.REPLAY_BOUND, *(
        (gpu, float(replay_bound_per_minute(bit_error_rate, g, w))) for gpu, g, w in gpus))
    return [test]
