"""For each scenario, the Prometheus rules and the in-agent detectors fire at about the same time.

Each scenario's trace (docs/scenarios.md) is replayed once into an Agent with its detectors on,
evaluating every 15 s of recorded time; the engine's on_change callbacks give each finding's first
firing and its resolution. During the same replay `tests.promtool_replay.Scraper` keeps, every
15 s of recorded time, what the agent's /metrics served then (the latest commit of every
collector), as a Prometheus scrape would. Those scrapes become one promtool unit test: every
series, with instance="scenario-host:9787" and job="hybridmon", one sample per 15 s in promtool's
expanding notation, `_` where absent and `stale` where a series stops (a lost GPU's metrics, a
removed PCI function), over rules/hybridmon.rules.yml. Its two expression tests, at the end of the
scenario, ask for min_over_time and max_over_time of timestamp(ALERTS{alertstate="firing"}) over
the whole run on the evaluation grid: the first and last evaluation at which each alert fired.
Their expectations are empty, so promtool prints what it got and the test parses that (checked on a
known case below). One promtool run per scenario.

promtool's evaluation_interval is 15 s, not the generated tests' 1 m: the detectors evaluate every
15 s here too, so both doors judge on the same grid, and 1 m would round every rule firing up to
the minute (up to 45 s) for nothing. 15 s is also the usual scrape and evaluation interval. The
stories told on 10 s ticks (hour-long trends) are replayed in test_rules_vs_detectors_trends.py,
through promtool every 30 s (both_doors.rule_evaluation_seconds): their rules move once a minute,
and their 2 h replays were most of the suite's time.

Tolerance, |t_rule - t_agent| for the first firing (and for the resolution, where the agent
resolves before the scenario ends), the sum of three terms:

- scrape, 15 s: Prometheus sees a change at its next scrape, the agent at its next tick (1 s, or
  10 s in memory_growth and healthy_growth_with_load).
- evaluation, 15 s or 20 s: each door fires at its first evaluation after the condition has held
  for `for`. promtool evaluates every 15 s; the agent every 15 s of recorded time on its own ticks,
  which is every 15 s with 1 s ticks and every 20 s with 10 s ticks. The agent also evaluates right
  after the first collector of a tick commits (gpu), so it sees the other collectors one tick
  late: its static host alerts fire at 15 s where the rules fire at 0 s.
- window, 15 s or 60 s: a 1 m average or rate over 15 s scrapes holds 4-5 samples against the
  agent's 60 (or 6), so it moves in steps of one scrape and crosses a threshold up to 15 s off the
  agent's. Trends the rules compute on a 1 m subquery grid (`[1h:1m]`: InferenceProcessMemoryGrowth;
  `[10m:1m]`: GpuMemoryHeadroomLow's forecast) change only once a minute: 60 s.

So 15 + 15 + 15 = 45 s for every alert on a 1 s scenario and 15 + 20 + 60 = 95 s for
InferenceProcessMemoryGrowth on memory_growth. Measured (detector / rule, seconds from the start):
pcie_starvation 240/240; pcie_link_degraded 390/390; GpuPcieReplayErrors 120/120; PcieAerErrors
nonfatal 105/90, correctable 195/180; gpu_lost and gpu_lost_and_reset 75/75 (confirmed at
the second collection, 61 s: the next evaluation of each); swap_thrash 195/195;
memory_growth 1800/1860 and 1820/1860 (the rule's median of 10 m slopes reaches 5 %/h at the first
1 m step after the detector's Theil-Sen); numa_misplacement 435/450 (cpus: CPU time over 2 min)
and 465/465; numa_unpinned_memory_remote 315/300;
gpu_memory_headroom 645/645; static info alerts 15/0 (the agent evaluates right after the GPU
collector's commit, so it sees the host collectors one tick late); throughput_decay 7420/7410;
kv_cache_full 285/285; kv_offload_link 255/255; inference_server_down 195/180;
pcie_uplink_starvation 255/255.

The inference alerts need no tolerance of their own. InferenceThroughputDecay compares 10 min
with 30 min means as PromQL's rate() computes them (windows.rate), so both doors underestimate a
baseline window the history does not fully cover yet in the same way, and both cross the
threshold as that window fills, 2 h into the trace. Its scenario (2 h 15 min, 10 s ticks) is the
longest replayed here: ~6 s of replay and ~4 s of promtool at the 15 s scrape step, about what
memory_growth costs, so it keeps the step every other scenario uses rather than a coarser one
that would widen every tolerance.

Two disagreements this test found were fixed at their source: the detectors' counter rates now
follow PromQL's rate() (extrapolated to the window's edges, over the whole window) instead of
dividing by the span the points cover, which made a 5 m AER or replay rate fire early on a short
history; and the rule's "page faults rising" branch now judges faults per CPU second, as the
detector does, instead of the raw fault rate, which fired InferenceProcessMemoryGrowth on the
healthy growth-with-load host.
"""
from __future__ import annotations

import math

import pytest
import yaml

from tests.support.both_doors import (AGENT_EVALUATION_SECONDS, RULE_EVALUATION_SECONDS, SCRAPE_SECONDS, AgentFiring,
                                      Doors, assert_fire_within_the_tolerance, assert_nothing_unexpected,
                                      doors, expected_cases, long_trends, silence_cases)
from tests.support.promtool_replay import (INSTANCE, JOB, first_and_last_firing, input_series, parse_samples,
                                           promtool_test, series_values)
from tests.support.scenarios import SCENARIOS

__all__ = ["doors"]  # the module-scoped fixture, one cache of replays per test module


# --- the probe itself, on a case whose answer is known -------------------------------------------

def test_series_values_use_expanding_notation_blanks_and_stale_markers():
    assert series_values([1, 1, 1, None, None, 2.5, math.inf, math.inf, None, 3]) == \
        "1x2 stale _x1 2.5 +Inf +Inf stale 3"
    assert series_values([None, None, 0, 0]) == "_x2 0x1"


def test_parse_samples_reads_labels_with_quotes_commas_and_braces():
    text = '{alertname="A", k="a,b} \\"c\\""} 1.5E+02, {alertname="B"} 30'
    assert parse_samples(text) == [({"alertname": "A", "k": 'a,b} "c"'}, 150.0), ({"alertname": "B"}, 30.0)]
    assert parse_samples("nil") == []


def test_the_probe_finds_first_and_last_firing_on_a_known_case(tmp_path):
    """A rule with `for: 30s` over a series that is 2 from 120 s to 225 s (active at 120, fires at
    150, last fires at 225) and one that is 2 until 45 s and then goes stale (fires at 30 and 45).
    promtool's own alert_rule_test, in the same file, must agree at the edges."""
    rules = tmp_path / "probe.rules.yml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "probe", "rules": [
        {"alert": "ProbeHigh", "expr": "probe_value > 1", "for": "30s", "labels": {"severity": "warning"}},
    ]}]}))
    odd = 'a,b} "c"'
    series = input_series([
        {("probe_value", (("k", odd),)): v, **({("probe_value", (("k", "gone"),)): 2} if t < 60 else {})}
        for t, v in ((t, 2 if 120 <= t <= 225 else 0) for t in range(0, 361, 15))
    ])
    values = {item["series"]: item["values"] for item in series}
    assert values[f'probe_value{{instance="{INSTANCE}", job="{JOB}", k="a,b}} \\"c\\""}}'] == "0x7 2x7 0x8"
    assert values[f'probe_value{{instance="{INSTANCE}", job="{JOB}", k="gone"}}'] == "2x3 stale _x20"
    document = promtool_test(series, 360, name="probe", rule_files=[rules])
    labels = {"alertname": "ProbeHigh", "severity": "warning", "instance": INSTANCE, "job": JOB}
    document["tests"][0]["alert_rule_test"] = [
        {"eval_time": "15s", "alertname": "ProbeHigh", "exp_alerts": []},
        {"eval_time": "30s", "alertname": "ProbeHigh", "exp_alerts": [{"exp_labels": {**labels, "k": "gone"}}]},
        {"eval_time": "60s", "alertname": "ProbeHigh", "exp_alerts": []},
        {"eval_time": "135s", "alertname": "ProbeHigh", "exp_alerts": []},
        {"eval_time": "150s", "alertname": "ProbeHigh", "exp_alerts": [{"exp_labels": {**labels, "k": odd}}]},
        {"eval_time": "225s", "alertname": "ProbeHigh", "exp_alerts": [{"exp_labels": {**labels, "k": odd}}]},
        {"eval_time": "240s", "alertname": "ProbeHigh", "exp_alerts": []},
    ]
    firings, output = first_and_last_firing(document, tmp_path, "probe")
    assert "alertname: ProbeHigh" not in output, output  # promtool's own checks passed
    found = {f.labels["k"]: (f.first, f.last) for f in firings}
    assert found == {"gone": (30.0, 45.0), odd: (150.0, 225.0)}
    assert all(f.alertname == "ProbeHigh" and f.labels["severity"] == "warning"
               and f.labels["instance"] == INSTANCE for f in firings)


# --- every scenario but the long trends (test_rules_vs_detectors_trends.py) --------------------------

SHORT = [name for name in SCENARIOS if not long_trends(name)]


@pytest.mark.parametrize("name, expectation", list(expected_cases(SHORT)))
def test_rule_and_detector_fire_within_the_tolerance(name, expectation, doors):
    assert_fire_within_the_tolerance(name, expectation, doors(name))


@pytest.mark.parametrize("name, door", list(silence_cases(SHORT)))
def test_nothing_fires_that_the_scenario_does_not_expect_or_allow(name, door, doors):
    assert_nothing_unexpected(name, door, doors(name))


def forecast_and_used(seen: Doors, door: str) -> tuple[list, list]:
    """(forecast firings, used firings) of GPU 0 through one door."""
    def of(reason: str) -> list:
        expectation = ("GpuMemoryHeadroomLow", {"gpu": "0", "reason": reason})
        return seen.agent_matching(expectation) if door == "detectors" else seen.rules_matching(expectation)
    return of("forecast"), of("used")


def resolved_at(seen: Doors, firing) -> float | None:
    return firing.resolved if isinstance(firing, AgentFiring) else seen.rule_resolved(firing)


@pytest.mark.parametrize("door", ["detectors", "rules"])
def test_gpu_memory_forecast_comes_before_used_and_ends_with_the_growth(door, doors):
    """gpu_memory_fills: the forecast fires before `used` and resolves once the growth stops (the
    GPU stays full: `used` goes on). gpu_memory_ramp_stops: it resolves within the last local
    slope's span plus a scrape and an evaluation of the stop, in both doors. A 30 min trend fired
    after `used` and lingered for 15 min."""
    from tests.support.scenarios.library import FILLS_GROWTH_STOPS, RAMP_STOPS_GROWTH_STOPS
    from hybridmon.rules.pcie import local_slope_seconds
    from hybridmon.agent.alerts.catalogue import load_thresholds
    local = local_slope_seconds(load_thresholds().gpu_memory_headroom.trend_window_seconds)
    bound = local + SCRAPE_SECONDS + RULE_EVALUATION_SECONDS + AGENT_EVALUATION_SECONDS
    fills = doors("gpu_memory_fills")
    (forecast,), (used,) = forecast_and_used(fills, door)
    lead = used.first - forecast.first
    print(f"{door}: gpu_memory_fills forecast at {forecast.first:g} s, used at {used.first:g} s "
          f"(lead {lead:g} s); forecast resolved {resolved_at(fills, forecast) - FILLS_GROWTH_STOPS:g} s "
          "after growth stopped")
    assert lead > 0
    assert resolved_at(fills, used) is None
    assert 0 < resolved_at(fills, forecast) - FILLS_GROWTH_STOPS <= bound
    stops = doors("gpu_memory_ramp_stops")
    (forecast,), used = forecast_and_used(stops, door)
    after = resolved_at(stops, forecast) - RAMP_STOPS_GROWTH_STOPS
    print(f"{door}: gpu_memory_ramp_stops forecast at {forecast.first:g} s, resolved {after:g} s "
          "after growth stopped")
    assert used == [] and forecast.first < RAMP_STOPS_GROWTH_STOPS and 0 < after <= bound


