"""The recording rules each rule group's alerts share, by group (agent/alerts/catalogue.GROUPS).

Recording rules are shared vocabulary (a link's capacity, 1 min averages, robust slopes): several
alert families read them, so they live here rather than in one family.
"""
from __future__ import annotations

from hybridmon.rules import host as _host
from hybridmon.rules import inference as _inference
from hybridmon.rules import pcie as _pcie
from hybridmon.rules import process as _process
from hybridmon.pcie_rates import replay_bound_per_minute
from hybridmon.rules.case_inputs import capacity, link
from hybridmon.rules.model import Recording
from hybridmon.rules.promtool_cases import Test


def none(thresholds) -> tuple[Recording, ...]:
    return ()


def pcie(thresholds) -> tuple[Recording, ...]:
    return _pcie.recordings(thresholds)


def gpu_memory(thresholds) -> tuple[Recording, ...]:
    return _pcie.memory_recordings(thresholds)


def host_memory(thresholds) -> tuple[Recording, ...]:
    return _host.recordings()


def process(thresholds) -> tuple[Recording, ...]:
    return _process.recordings(thresholds)


def inference(thresholds) -> tuple[Recording, ...]:
    return _inference.recordings(thresholds)


def cases(thresholds, catalog) -> list[Test]:
    """promtool cases of the shared recording rules: every generation's capacity and replay bound."""
    test = Test("capacity and DCGM replay bound of every generation", 120, catalog)
    links = [(generation, 16) for generation in range(1, 7)] + [(3, 8), (4, 1)]
    gpus = []
    for index, (generation, width) in enumerate(links):
        gpu = {"gpu": str(index), "uuid": f"GPU-{index:08x}-0000-4000-8000-000000000000"}
        link(test, gpu, generation, width, 6, 16)
        gpus.append((gpu, generation, width))
    test.expect_samples(60, _pcie.CAPACITY_THEORETICAL,
                        *((gpu, capacity(g, w)) for gpu, g, w in gpus))
    bit_error_rate = thresholds.pcie_errors.bit_error_rate
    test.expect_samples(60, _pcie.REPLAY_BOUND, *(
        (gpu, float(replay_bound_per_minute(bit_error_rate, g, w))) for gpu, g, w in gpus))
    return [test]
