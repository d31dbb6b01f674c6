"""Both doors on the scenarios that tell hour-long trends (10 s ticks: memory growth, throughput
decay), compared as tests/integration/test_rules_vs_detectors.py compares the rest (its docstring
says how and with which tolerance). A module of their own: they are the costliest replays, and the
test workers take one module each at a time."""
from __future__ import annotations

import pytest

from tests.support.both_doors import (assert_fire_within_the_tolerance,
                                      assert_nothing_unexpected, doors, expected_cases, long_trends,
                                      silence_cases)
from tests.support.scenarios import SCENARIOS

__all__ = ["doors"]  # the module-scoped fixture, one cache of replays per test module

TRENDS = [name for name in SCENARIOS if long_trends(name)]


@pytest.mark.parametrize("name, expectation", list(expected_cases(TRENDS)))
def test_rule_and_detector_fire_within_the_tolerance(name, expectation, doors):
    assert_fire_within_the_tolerance(name, expectation, doors(name))


@pytest.mark.parametrize("name, door", list(silence_cases(TRENDS)))
def test_nothing_fires_that_the_scenario_does_not_expect_or_allow(name, door, doors):
    assert_nothing_unexpected(name, door, doors(name))


# --- a leak is one episode (issue 28, class 3) -----------------------------------------------------

@pytest.mark.parametrize("name", ["memory_leak_noisy_load", "memory_leak_big_process",
                                  "memory_growth_vllm_v1_engine_leak"])
def test_a_leak_that_goes_on_is_one_episode_through_the_rules_too(name, doors):
    """The rule's hysteresis (it reads its own ALERTS series) holds as the detector's does: every
    evaluation from its first firing to the end fires (tests/integration/test_detection_steady.py
    checks the detector's side)."""
    seen = doors(name)
    for expectation in seen.scenario.expected:
        (firing,) = seen.rules_matching(expectation)
        every = round((firing.last - firing.first) / seen.rule_step) + 1
        print(f"{name} {expectation}: the rule fired at {firing.first:g} s, {firing.evaluations} of "
              f"{every} evaluations to {firing.last:g} s")
        assert firing.last >= seen.end and firing.evaluations == every
