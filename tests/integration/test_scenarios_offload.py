"""The issue-15 scenarios (tests/support/scenarios/offload_library.py) tell their stories in the
trace, and each healthy one is a host the naive reading would flag: host->device bytes per token
without the server's KV loads taken off, a host tier against MemAvailable without what the process
already holds. Simulated figures, read back through the real collectors."""
from __future__ import annotations

import pytest

from hybridmon.agent.alerts.weight_offload import gpu_shares, roots_of, tree_gpus
from hybridmon.agent.alerts.catalogue import load_thresholds
from hybridmon.exporters.host_memory import MEMORY_AVAILABLE
from hybridmon.exporters.inference_names import BY_FIELD
from hybridmon.exporters.process import RESIDENT
from tests.support.scenario_traces import one, value_at
from tests.support.scenarios import START_TIME
from tests.support.scenarios.host import GIB
from tests.support.scenarios.library import VLLM
from tests.support.scenarios.offload_library import PINNED_OVERHEAD

THRESHOLDS = load_thresholds()
PER_TOKEN = THRESHOLDS.weight_offload.unexplained_bytes_per_token_above


def gpu0_at(history, t: float):
    now = START_TIME + t
    roots = roots_of(history, now)
    shares = gpu_shares(history, now, roots, tree_gpus(history, now, roots))
    return next(share for (gpu, _), share in shares.items() if gpu == "0")


def test_weights_crossing_bus_goes_from_kv_sized_to_weight_sized_bytes_per_token(scenarios):
    history = scenarios.replayed("weights_crossing_bus").history
    before, after = gpu0_at(history, 55), gpu0_at(history, 340)
    assert before.kv_loads == after.kv_loads == 0   # no KV offload connector
    assert before.unexplained / before.tokens == pytest.approx(8.7e6, rel=0.1)
    assert after.unexplained / after.tokens == pytest.approx(215e6, rel=0.1)
    assert after.tokens == pytest.approx(120, rel=0.1)


def test_healthy_prefix_reload_would_fire_without_its_kv_loads_taken_off(scenarios):
    history = scenarios.replayed("healthy_kv_prefix_reload").history
    gpu0 = gpu0_at(history, 260)
    assert gpu0.kv_loads == pytest.approx(15e9, rel=0.05)
    assert gpu0.host_to_device / gpu0.tokens > PER_TOKEN            # the naive reading
    assert gpu0.unexplained / gpu0.tokens < PER_TOKEN / 3            # what is judged


def host_tier_figures(history, t: float) -> tuple[float, float, float]:
    tier = one(history, BY_FIELD["kv_offload_host_tier_bytes"].name, pid=str(VLLM))
    return (value_at(tier, t), value_at(one(history, MEMORY_AVAILABLE.name), t),
            value_at(one(history, RESIDENT.name, pid=str(VLLM)), t))


def test_the_host_tier_runs_short_once_a_neighbour_takes_memory(scenarios):
    history = scenarios.replayed("offload_host_memory_short").history
    share = THRESHOLDS.offload_host_memory.remaining_share_of_free_at_least
    for t, fits in ((50, True), (120, False)):
        tier, available, resident = host_tier_figures(history, t)
        assert tier == 120 * GIB
        assert ((tier * PINNED_OVERHEAD - resident) / available < share) == fits, t


def test_an_allocated_tier_would_look_short_against_memavailable_alone(scenarios):
    history = scenarios.replayed("healthy_host_tier_allocated").history
    tier, available, resident = host_tier_figures(history, 120)
    assert tier * PINNED_OVERHEAD / available > 2.5                  # the naive reading
    assert resident >= tier * PINNED_OVERHEAD                        # what is judged: nothing left
