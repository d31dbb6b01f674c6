"""The Prometheus rules: generated from the thresholds, current, valid, tested by promtool.

promtool comes from Debian's `prometheus` package, which scripts/test installs; these tests fail
(not skip) without it, because CI always has it.
"""
from __future__ import annotations

import re
import tomllib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hybridmon.exporters.registry import COLLECTORS
from hybridmon.agent.alerts.catalogue import DEFAULT_THRESHOLDS_FILE, load_thresholds
from hybridmon.agent.self_metrics import SELF_METRICS
from hybridmon.agent.alerts import catalogue
from hybridmon.rules import generate
from hybridmon.pcie_rates import replay_bound_per_minute
from hybridmon.rules.templates import humanize, humanize1024, humanize_duration, humanize_percentage

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "rules"
RULES_FILE = RULES / "hybridmon.rules.yml"
# Alerts on a state, whose value (0 or 1) says nothing more than the alert itself.
STATE_ALERTS = {"GpuLost", "HostTransparentHugepageAlways", "InferenceServerScrapeFailing", "HybridmonAgentDown",
                "GpuC2cTrafficUnreadable"}
RECORD_NAME = re.compile(r"(gpu|instance|process|server|uplink):hybridmon_[a-z0-9_]+:[a-z0-9_]+")
DURATION = re.compile(r"([0-9]+(ms|s|m|h|d))+")
# Other values for the thresholds; sections and keys left out keep thresholds.toml's defaults.
OTHER_THRESHOLD_OVERRIDES = """\
[pcie_starvation]
traffic_share_of_capacity = 0.7
gpu_utilization_at_most = 0.4
for_seconds = 180
[pcie_link_degraded]
busy_utilization_at_least = 0.5
for_seconds = 120
[pcie_errors]
bit_error_rate = 1e-11
window_seconds = 600
aer_correctable_per_hour = 30
aer_uncorrectable_any = false
[gpu_lost]
for_seconds = 60
[swap_thrash]
swap_in_bytes_per_second = 4194304
swap_out_bytes_per_second = 2097152
major_faults_per_second = 20
memory_pressure_some_ratio = 0.2
for_seconds = 300
process_swap_bytes = 134217728
process_major_faults_per_second = 5
[memory_growth]
window_seconds = 7200
min_window_seconds = 3600
growth_per_hour_share = 0.1
growth_bytes_per_hour = 268435456
load_following_factor = 2.0
exhaustion_horizon_seconds = 3600
[numa_misplacement]
share_off_gpu_node = 0.6
for_seconds = 120
[gpu_memory_headroom]
used_share = 0.9
for_seconds = 120
forecast_horizon_seconds = 7200
trend_window_seconds = 3600
[host_config]
max_swappiness_with_swap = 20
max_dirty_ratio = 10
locked_share_of_memlock_limit = 0.8
min_available_share_without_swap = 0.2

[pcie_bandwidth_low]
floor_share_gen4 = 0.6
floor_share_gen5 = 0.9
floor_share_other = 0.5

[throughput_decay]
decay_share = 0.5
window_seconds = 10800
baseline_seconds = 3600
recent_seconds = 900
min_requests_running = 2
load_kept_share = 0.7
host_signal_moved_share = 0.3
for_seconds = 600

[kv_offload_pressure]
kv_cache_usage_at_least = 0.9
preemptions_per_second_above = 0.5
offload_load_share_of_capacity = 0.7
for_seconds = 300

[inference_scrape]
for_seconds = 300

[alert_delivery]
for_seconds = 240
"""


def other_thresholds() -> str:
    """thresholds.toml with OTHER_THRESHOLD_OVERRIDES applied, as a TOML text."""
    merged = tomllib.loads(DEFAULT_THRESHOLDS_FILE.read_text())
    for section, values in tomllib.loads(OTHER_THRESHOLD_OVERRIDES).items():
        merged[section].update(values)
    return "\n".join(f"[{section}]\n" + "".join(f"{key} = {str(value).lower() if isinstance(value, bool) else value!r}\n"
                                                for key, value in values.items())
                     for section, values in merged.items())


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is missing: install Debian's `prometheus` package (scripts/test does, as root)"
    return path


def run(*argv: str | Path, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=300)


def rule_groups(path: Path = RULES_FILE) -> list[dict]:
    return yaml.safe_load(path.read_text())["groups"]


def alert_rules(path: Path = RULES_FILE) -> list[dict]:
    return [rule for group in rule_groups(path) for rule in group["rules"] if "alert" in rule]


def recording_rules(path: Path = RULES_FILE) -> list[dict]:
    return [rule for group in rule_groups(path) for rule in group["rules"] if "record" in rule]


@pytest.mark.slow
def test_generated_files_are_current():
    result = run(sys.executable, "-m", "hybridmon.rules.generate", "--check")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_generated_promtool_tests_are_current():
    result = run(sys.executable, "-m", "tests.rules.generate", "--check")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_check_shows_a_diff_and_fails_when_a_generated_file_was_edited(tmp_path):
    assert run(sys.executable, "-m", "hybridmon.rules.generate", "--output-dir", tmp_path).returncode == 0
    rules = tmp_path / "hybridmon.rules.yml"
    rules.write_text(rules.read_text().replace(">= 0.85", ">= 0.8", 1))
    result = run(sys.executable, "-m", "hybridmon.rules.generate", "--check", "--output-dir", tmp_path)
    assert result.returncode == 1
    assert re.search(r"^-\s+>= 0\.8$", result.stdout, re.M)
    assert re.search(r"^\+\s+>= 0\.85$", result.stdout, re.M)


@pytest.mark.slow
def test_test_check_names_a_generated_test_no_longer_produced(tmp_path):
    assert run(sys.executable, "-m", "tests.rules.generate", "--output-dir", tmp_path).returncode == 0
    (tmp_path / "tests" / "generated_leftover.yml").write_text("tests: []\n")
    result = run(sys.executable, "-m", "tests.rules.generate", "--check", "--output-dir", tmp_path)
    assert result.returncode == 1
    assert "tests/generated_leftover.yml: generated earlier, no longer produced" in result.stdout


def test_generation_is_deterministic():
    thresholds = load_thresholds()
    assert generate.render(thresholds) == generate.render(thresholds)


@pytest.mark.slow
def test_promtool_check_rules_passes():
    result = run(promtool(), "check", "rules", RULES_FILE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.slow
def test_promtool_unit_tests_pass():
    tests = sorted((RULES / "tests").glob("*.yml"))
    assert {p.name for p in tests} >= {f"generated_{n}.yml" for n in
                                        ("recordings", *(f.section for f in catalogue.FAMILIES))}
    result = run(promtool(), "test", "rules", *tests)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(tests)


@pytest.mark.slow
def test_other_thresholds_give_other_rules_whose_generated_tests_pass(tmp_path):
    """Tests are generated, not hand-written: new thresholds bring their own passing tests."""
    thresholds = tmp_path / "thresholds.toml"
    thresholds.write_text(other_thresholds())
    out = tmp_path / "rules"
    for generator in ("hybridmon.rules.generate", "tests.rules.generate"):
        result = run(sys.executable, "-m", generator, "--thresholds", thresholds,
                     "--runbook-base-url", "https://runbooks.example.com/hybridmon/", "--output-dir", out)
        assert result.returncode == 0, result.stderr
    text = (out / "hybridmon.rules.yml").read_text()
    assert ">= 0.7\n" in text and "<= 0.4\n" in text and "for: 3m" in text
    assert "runbook_url: https://runbooks.example.com/hybridmon/GpuPcieStarvation" in text
    assert "1e-11 * 60 * hybridmon_gpu_pcie_link_width_lanes" in text
    assert not any(r["alert"] == "PcieAerErrors" and r["labels"]["severity"] == "critical"
                   for r in alert_rules(out / "hybridmon.rules.yml")), "aer_uncorrectable_any = false"
    checked = run(promtool(), "check", "rules", out / "hybridmon.rules.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = run(promtool(), "test", "rules", *sorted((out / "tests").glob("*.yml")))
    assert tested.returncode == 0, tested.stdout + tested.stderr


@pytest.mark.slow
def test_bad_thresholds_file_is_refused_with_its_name(tmp_path):
    thresholds = tmp_path / "thresholds.toml"
    thresholds.write_text(other_thresholds().replace("for_seconds = 180", "for_seconds = 'soon'"))
    result = run(sys.executable, "-m", "hybridmon.rules.generate", "--check", "--thresholds", thresholds)
    assert result.returncode == 2
    assert str(thresholds) in result.stderr and "pcie_starvation.for_seconds" in result.stderr


def test_every_alert_of_the_brief_has_its_rules_and_nothing_else():
    assert {rule["alert"] for rule in alert_rules()} == set(catalogue.all_alertnames())


def test_rules_sharing_an_alertname_differ_by_severity_or_reason():
    seen: dict[tuple, int] = {}
    for rule in alert_rules():
        key = (rule["alert"], tuple(sorted(rule["labels"].items())))
        seen[key] = seen.get(key, 0) + 1
    assert [key for key, count in seen.items() if count > 1] == []


def test_every_alert_rule_has_for_severity_summary_description_and_runbook():
    for rule in alert_rules():
        name, annotations = rule["alert"], rule["annotations"]
        assert DURATION.fullmatch(rule["for"]), name
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}, name
        assert set(annotations) == {"summary", "description", "runbook_url"}, name
        if not rule["expr"].lstrip().startswith("absent("):  # absent() has no labels to name
            assert "$labels." in annotations["summary"], name
        assert "threshold" in annotations["description"].lower(), name
        if name not in STATE_ALERTS:
            assert "$value" in annotations["summary"] + annotations["description"], name
        assert annotations["runbook_url"].endswith(f"/{name}") and "/runbooks" in annotations["runbook_url"], name


def test_rule_for_durations_come_from_the_thresholds():
    t = load_thresholds()
    durations = {(r["alert"], r["labels"].get("reason", "")): r["for"] for r in alert_rules()}
    assert durations[("GpuPcieStarvation", "")] == "2m" and t.pcie_starvation.for_seconds == 120
    assert durations[("GpuPcieLinkDegraded", "")] == "5m" and t.pcie_link_degraded.for_seconds == 300
    assert durations[("InferenceProcessNumaMisplaced", "cpus")] == "5m"
    assert durations[("GpuMemoryHeadroomLow", "forecast")] == "2m" and t.gpu_memory_headroom.forecast_for_seconds == 120
    assert durations[("GpuMemoryHeadroomLow", "used")] == "5m" and t.gpu_memory_headroom.for_seconds == 300
    assert durations[("GpuLost", "")] == "0s"


def test_recording_rule_names_are_level_metric_operation():
    names = [rule["record"] for rule in recording_rules()]
    assert len(names) == len(set(names))
    for name in names:
        assert RECORD_NAME.fullmatch(name), name
    assert {
        "gpu:hybridmon_gpu_pcie_link_capacity_bytes_per_second:theoretical",
        "gpu:hybridmon_gpu_pcie_traffic_bytes_per_second:avg1m",
        "gpu:hybridmon_gpu_pcie_capacity_bytes_per_second:effective",
        "instance:hybridmon_swap_in_bytes:rate1m",
        "gpu:hybridmon_gpu_pcie_replays_per_minute:dcgm_bound",
    } <= set(names)


def exported_metrics() -> dict[str, tuple[str, ...]]:
    specs = [spec for registration in COLLECTORS for spec in registration.metric_specs]
    return {spec.name: spec.label_names for spec in [*specs, *SELF_METRICS]}


def test_rules_read_only_metrics_the_agent_exports():
    known = exported_metrics()
    records = {rule["record"] for rule in recording_rules()}
    for rule in [*recording_rules(), *alert_rules()]:
        expr = re.sub(r"#[^\n]*", "", rule["expr"])
        for name in re.findall(r"(?<![:\w])hybridmon_[a-z0-9_]+(?![:\w])", expr):
            assert name in known or name in records, f"{rule.get('alert') or rule['record']}: {name}"


def test_generated_test_inputs_have_the_exported_labels():
    """The promtool tests feed series shaped exactly as the agent exports them (plus job, instance),
    and Prometheus's own `up`, which it writes for every target on every scrape."""
    known = {**exported_metrics(), "up": ()}
    series = [s["series"] for path in (RULES / "tests").glob("generated_*.yml")
              for test in yaml.safe_load(path.read_text())["tests"] for s in test["input_series"]]
    assert series
    for text in series:
        name, labels = re.fullmatch(r"([a-z_:0-9]+)\{(.*)\}", text).groups()
        names = {pair.split("=")[0].strip() for pair in labels.split(", ")}
        assert name in known, text
        assert names == {"job", "instance", *known[name]}, text


@pytest.mark.parametrize(("generation", "lanes", "bound"), [(4, 16, 16), (5, 16, 31), (3, 8, 4), (1, 1, 1)])
def test_dcgm_replay_bound(generation, lanes, bound):
    assert replay_bound_per_minute(1e-12, generation, lanes) == bound


@pytest.mark.parametrize(("function", "value", "text"), [
    (humanize, 31507200000.0, "31.51G"), (humanize, 0.25, "250m"), (humanize, 0, "0"), (humanize, 16, "16"),
    (humanize1024, 2097152, "2Mi"), (humanize1024, 1, "1"), (humanize1024, 1536, "1.5ki"),
    (humanize_percentage, 0.925, "92.5%"), (humanize_duration, 1800.5, "30m 0s"),
    (humanize_duration, 90061, "1d 1h 1m 1s"), (humanize_duration, 42.5, "42.5s"),
    (humanize_duration, 0.25, "250ms"),
])
def test_template_functions_format_like_prometheus(function, value, text):
    assert function(value) == text


def test_a_clause_on_a_query_is_left_out_when_the_query_finds_nothing():
    """`<if name>` on a query name tests whether the query found anything (0 counts as found), in
    Go (an empty query result is false) and in Python alike; on a label, whether it is set."""
    from hybridmon.rules.templates import expected_text, go_template
    queries = {"free": ('min_over_time(x{job=%q,instance=%q}[5m])', ("job", "instance"))}
    text = "killed<if free>, <free|humanize1024>B free before<else><end>.<if gpu> GPU <gpu>.<else><end>"
    assert go_template(text, queries) == (
        "killed{{ if printf `min_over_time(x{job=%q,instance=%q}[5m])` $labels.job $labels.instance | query }}, "
        "{{ with printf `min_over_time(x{job=%q,instance=%q}[5m])` $labels.job $labels.instance | query }}"
        "{{ . | first | value | humanize1024 }}{{ else }}unknown{{ end }}B free before{{ else }}{{ end }}."
        "{{ if $labels.gpu }} GPU {{ $labels.gpu }}.{{ else }}{{ end }}")
    assert expected_text(text, {"free": None, "gpu": ""}) == "killed."
    assert expected_text(text, {"free": 0.0, "gpu": "1"}) == "killed, 0B free before. GPU 1."
