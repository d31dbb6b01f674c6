"""hybridmon/pcie_rates.py: every generation's capacity and DCGM replay bound, and what copies
achieve on a link against what a saturated copy engine shows."""
from __future__ import annotations

import pytest

from hybridmon.agent.alerts import pcie_errors
from hybridmon.pcie_rates import (
    LinkCapacity,
    achievable_capacity,
    bidirectional_capacity,
    effective_capacity,
    theoretical_capacity,
)
from tests.support.detector_history import THRESHOLDS

GEN4_X16 = 16 * 1969.2e6

GEN4_ACHIEVABLE = achievable_capacity(4, 16)

GEN4_BOTH_WAYS = bidirectional_capacity(4, 16)


def test_capacity_and_replay_bound_tables():
    assert theoretical_capacity(4, 16) == pytest.approx(31.5e9, rel=1e-3)
    assert theoretical_capacity(6, 16) == 16 * 7563e6
    assert theoretical_capacity(7, 16) is None
    assert pcie_errors.link_replay_bound(1e-12, 4, 16) == 16
    assert pcie_errors.link_replay_bound(1e-12, 5, 16) == 31
    assert pcie_errors.link_replay_bound(1e-12, 1, 1) == 1
    assert pcie_errors.link_replay_bound(1e-12, 7, 16) is None


def test_achievable_capacity_is_below_what_a_saturated_copy_engine_shows():
    assert GEN4_ACHIEVABLE == pytest.approx(0.81 * GEN4_X16) and GEN4_ACHIEVABLE <= 0.82 * GEN4_X16
    assert GEN4_BOTH_WAYS == pytest.approx(2 * 0.58 * GEN4_X16)
    assert achievable_capacity(1, 16) == pytest.approx(0.76 * 16 * 250e6)
    assert achievable_capacity(7, 16) is None and bidirectional_capacity(4, 0) is None
    assert effective_capacity(26e9, 4, 16) == LinkCapacity(26e9, "measured")
    assert effective_capacity(None, 4, 16) == LinkCapacity(GEN4_ACHIEVABLE, "achievable", "Gen4 x16")
    assert effective_capacity(None, 4, 16).described == "achievable on Gen4 x16"
    assert effective_capacity(26e9, 4, 16).described == "measured"
    share = THRESHOLDS.pcie_starvation.traffic_share_of_capacity
    # copy-engine saturation fires; 0.70 of the theoretical rate, one direction alone, does not
    assert 0.82 * GEN4_X16 / GEN4_ACHIEVABLE >= share > 0.70 * GEN4_X16 / GEN4_ACHIEVABLE
