"""A leak that goes on keeps its alert firing: InferenceProcessMemoryGrowth, once it fires on a
scenario whose leak lasts to the end, must not resolve and fire again (an alert that flaps pages
again and again, each time as new). Before its trend was judged over whole minutes at one point
per 15 s (59c2981), it resolved at 2330 s and 2390 s of memory_leak_big_process and fired again
10 s later each time. Issue 28: with load noise, what is left after the load's part hovered at the
threshold and it fired and resolved 3-4 times an hour (memory_leak_noisy_load); and each leak
fired ~32 min after it began."""
from __future__ import annotations

import pytest

from tests.support.scenario_traces import replay_changes
from tests.support.scenarios import SCENARIOS

# Scenarios whose leak runs from its onset to the end of the trace (tests/support/scenarios/).
LEAKS_TO_THE_END = ("memory_growth", "memory_growth_vllm_v1_engine_leak", "memory_leak_big_process",
                    "memory_leak_noisy_load")
# Issue 28: each of these leaks grows at or above the absolute growth_bytes_per_hour and must first
# fire within 30 min of its onset (a 30 min minimum window and the load's lead-in fired at ~32 min).
# memory_leak_noisy_load too: its bursty CPU moves the estimate of the load's rise over the halves
# of the first 43 min by ~1 %/h, x2 x 12 GiB = ~250 MiB/h against a 32 MiB/h margin; judged against
# the part of the load's rise beyond its noise, it fires once the window is long enough (26 min).
QUIET_LEAKS = ("memory_growth", "memory_growth_vllm_v1_engine_leak", "memory_leak_big_process",
               "memory_leak_noisy_load")
FIRST_FIRING_WITHIN_SECONDS = 1800


def changes(path, scenario) -> list[tuple[str, float, dict]]:
    """(firing or resolved, seconds from the start, labels) of every memory-growth alert change."""
    return [(c.change, c.at, dict(c.finding.labels)) for c in replay_changes(path, scenario.name, 10)
            if c.finding.alertname == "InferenceProcessMemoryGrowth"]


@pytest.mark.parametrize("name", LEAKS_TO_THE_END)
def test_a_leak_that_goes_on_keeps_its_alert_firing(name, scenarios):
    scenario = SCENARIOS[name]
    seen = changes(scenarios.summary(name).path, scenario)
    for _, expected in scenario.expected:
        mine = [(change, at) for change, at, labels in seen if set(expected.items()) <= set(labels.items())]
        assert mine and mine[0][0] == "firing", f"{name}: {expected} never fired"
        assert mine == mine[:1], f"{name}: {expected} fired at {mine[0][1]:.0f} s, then {mine[1:]}"


@pytest.mark.parametrize("name", QUIET_LEAKS)
def test_a_leak_at_the_absolute_rate_fires_within_30_minutes(name, scenarios):
    scenario = SCENARIOS[name]
    seen = changes(scenarios.summary(name).path, scenario)
    for _, expected in scenario.expected:
        first = min(at for change, at, labels in seen
                    if change == "firing" and set(expected.items()) <= set(labels.items()))
        print(f"{name} {expected}: first fired {first - scenario.onset_seconds:.0f} s after onset")
        assert first - scenario.onset_seconds <= FIRST_FIRING_WITHIN_SECONDS
