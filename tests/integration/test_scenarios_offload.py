"""The issue-15 scenarios (tests/support/scenarios/offload_library.py) tell their stories in the
trace, and each healthy one is a host the naive reading would flag: host->device bytes per token
without the server's KV loads taken off, a host tier against MemAvailable without what the process
already holds. Simulated figures, read back through the real collectors."""
from __future__ import annotations

import html
import re

import pytest

from hybridmon.agent.alerts.weight_offload import Detector as WeightOffloadDetector
from hybridmon.agent.alerts.weight_offload import gpu_shares, roots_of, tree_gpus
from hybridmon.agent.detectors.links import HOST_TO_DEVICE, UNATTRIBUTED, WEIGHTS
from hybridmon.agent.alerts.catalogue import load_thresholds
from hybridmon.agent.config import load_config
from hybridmon.agent.daemon import Agent
from hybridmon.agent.publish.findings import FindingsCollector
from hybridmon.agent.self_metrics import BUS_BYTES
from hybridmon.agent.status.page import render_status_page
from hybridmon.exporters.host_memory import MEMORY_AVAILABLE
from hybridmon.exporters.inference_names import BY_FIELD
from hybridmon.exporters.process import RESIDENT
from tests.support.scenario_traces import one, value_at
from tests.support.scenarios import SCENARIOS, START_TIME, history_seconds_for
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


def test_weights_crossing_bus_reads_what_its_offload_can_need_per_token(scenarios):
    history = scenarios.replayed("weights_crossing_bus").history
    after = gpu0_at(history, 340)
    assert after.kv_loads == 0   # no KV offload connector
    assert after.unexplained / after.tokens == pytest.approx(215e6, rel=0.1)
    assert after.unexplained / after.tokens < 12 * GIB / 55   # 12 GiB read once a step of 55
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


@pytest.mark.parametrize("name, lead", [
    ("healthy_kv_through_lmcache_cpu_tier", "LMCache runs in the engine"),
    ("healthy_kv_through_v0_swap_space", "12 requests' KV in its CPU swap space"),
    ("healthy_kv_connector_without_byte_counters", "publishes no byte counter"),
])
def test_kv_moved_without_byte_counters_is_unattributed_with_its_lead(scenarios, name, lead):
    """Over the weights bound per token, but no --cpu-offload-gb: the account leaves the bytes
    unattributed and says what would attribute them; the findings replayed hold no weights."""
    replayed = scenarios.replayed(name)
    history = replayed.history
    now = START_TIME + SCENARIOS[name].duration_seconds
    gpu0 = gpu0_at(history, SCENARIOS[name].duration_seconds)
    assert gpu0.unexplained / gpu0.tokens > PER_TOKEN                 # what issue 15 judged by
    detector = WeightOffloadDetector(THRESHOLDS.weight_offload)
    assert detector.evaluate(history, now) == []
    account = next(account for (gpu, _), account in detector.figures.items() if gpu == "0")
    assert account.causes[HOST_TO_DEVICE][WEIGHTS] == 0.0
    assert account.causes[HOST_TO_DEVICE][UNATTRIBUTED] == pytest.approx(gpu0.host_to_device)
    assert any(lead in text for text in account.leads), account.leads


def test_the_weights_claimed_are_those_the_command_line_offloads(scenarios):
    history = scenarios.replayed("weights_crossing_bus").history
    now = START_TIME + 340
    detector = WeightOffloadDetector(THRESHOLDS.weight_offload)
    (finding,) = detector.evaluate(history, now)
    assert finding.details["weights_offload_bytes_per_gpu"] == 12 * GIB
    account = next(account for (gpu, _), account in detector.figures.items() if gpu == "0")
    assert account.causes[HOST_TO_DEVICE][WEIGHTS] == pytest.approx(account.traffic[HOST_TO_DEVICE])


def test_the_account_reaches_the_status_page_and_metrics(scenarios, tmp_path):
    """The V0 swap-space host replayed by a whole agent: its GPU card says where the bus bytes
    went and what would attribute the rest; /metrics carries the same split."""
    name = "healthy_kv_through_v0_swap_space"
    overrides = {"history_seconds": history_seconds_for(SCENARIOS[name]), "state_dir": str(tmp_path / "state")}
    agent = Agent(load_config(environ={}, overrides=overrides), replay_from=scenarios.summary(name).path)
    try:
        agent.replay(speed=0)
        page = html.unescape(render_status_page(agent))
        assert re.search(r"Bus host → device</[^>]+>\s*<[^>]+>[0-9.]+ GB/s: unattributed [0-9.]+ GB/s", page), page
        assert "12 requests' KV in its CPU swap space" in page
        (bus,) = [family for family in FindingsCollector(agent.engine).collect()
                  if family.name == BUS_BYTES.name]
        by_cause = {(s.labels["gpu"], s.labels["direction"], s.labels["cause"]): s.value for s in bus.samples}
        assert by_cause[("0", HOST_TO_DEVICE, UNATTRIBUTED)] > 15e9
        assert by_cause[("0", HOST_TO_DEVICE, WEIGHTS)] == 0.0
    finally:
        agent.stop()
