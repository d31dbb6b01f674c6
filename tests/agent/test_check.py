"""`hybridmon check` on this machine and on the fixture host, as a user runs it."""
import json
import shutil
import socket
import subprocess
import time
from datetime import datetime

import pytest

from hybridmon import __version__
from hybridmon.agent.alerts.catalogue import load_thresholds
from hybridmon.agent.commands import check
from hybridmon.agent.config import load_config
from tests.support.agent_helpers import FIXTURE_ENVIRONMENT, HYBRIDMON, REPO, subprocess_environment
from tests.support.paths import FIXTURE_HOST

SEVERITY_EXIT = {"critical": 2, "warning": 1}


def run_check(*args, environment=None):
    return subprocess.run(HYBRIDMON + ["check", "--log-level", "error", *args],
                          env=subprocess_environment(environment), cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def expected_exit(report):
    return max((SEVERITY_EXIT.get(f["severity"], 0) for f in report["findings"]), default=0)


@pytest.mark.slow
def test_check_on_this_machine_lists_gpu_checks_as_skipped_with_the_reason():
    result = run_check("--duration", "2", "--json")
    report = json.loads(result.stdout)
    assert result.returncode == report["exit_code"] == expected_exit(report), result.stderr
    assert report["could_not_read"] == {} and report["reason"] is None  # this host's /proc and /sys read
    skipped = {s["detector"]: s["reason"] for s in report["skipped"]}
    from tests.support.fake_nvml import real_nvml_library_loads

    if not real_nvml_library_loads():
        for detector in ("pcie_starvation", "pcie_link_degraded", "gpu_memory_headroom", "numa_misplacement"):
            assert "NVIDIA driver not found" in skipped[detector]
    needed = load_thresholds().memory_growth.min_window_seconds / 60
    assert f"needs {needed:.0f} min of history" in skipped["memory_growth"]


@pytest.mark.slow
def test_check_on_the_fixture_host_reports_its_problems_with_runbooks():
    result = run_check("--duration", "2", "--json", environment=FIXTURE_ENVIRONMENT)
    report = json.loads(result.stdout)
    found = {(f["alertname"], f["severity"]) for f in report["findings"]}
    assert {("GpuPcieLinkDegraded", "warning"), ("InferenceProcessNumaMisplaced", "warning"),
            ("HostSwappinessHigh", "info")} <= found
    # the fixture's vLLM has 4 GiB of VmPin past its 8 MiB memlock limit: CAP_IPC_LOCK, not a risk
    assert "InferenceProcessMemlockLow" not in {alertname for alertname, _ in found}
    assert result.returncode == 1 == report["exit_code"]
    # when, where and by which version (issue 32): reports from many hosts are told apart
    assert report["host"] == socket.gethostname() and report["version"] == __version__
    assert abs(datetime.fromisoformat(report["checked_at"].replace("Z", "+00:00")).timestamp() - time.time()) < 60
    # GPUs but no stored benchmark run: the bandwidth check says what to run instead of passing.
    skipped = {s["detector"]: s["reason"] for s in report["skipped"]}
    assert "run `hybridmon bench`" in skipped["pcie_bandwidth_low"]
    assert "pcie_starvation" not in skipped
    for finding in report["findings"]:
        assert finding["runbook"].endswith(f"runbooks/{finding['alertname']}.md")
        assert (REPO / "runbooks" / f"{finding['alertname']}.md").is_file()


@pytest.mark.slow
def test_check_table_and_strict_mode():
    table = run_check("--duration", "2", environment=FIXTURE_ENVIRONMENT)
    assert table.returncode == 1
    header = table.stdout.splitlines()[0].split()
    assert header == ["SEVERITY", "FINDING", "ENTITY", "VALUE", "THRESHOLD"]
    assert "HostSwappinessHigh" in table.stdout and "runbook:" in table.stdout
    healthy_but_misconfigured = run_check("--duration", "2", "--strict", environment={
        **FIXTURE_ENVIRONMENT, "HYBRIDMON_COLLECTORS__GPU__ENABLED": "false"})
    assert healthy_but_misconfigured.returncode == 1  # info findings count under --strict
    lenient = run_check("--duration", "2", environment={**FIXTURE_ENVIRONMENT, "HYBRIDMON_COLLECTORS__GPU__ENABLED": "false"})
    assert lenient.returncode == 0


@pytest.mark.slow
def test_check_that_cannot_read_the_host_exits_3(tmp_path):
    result = run_check("--duration", "1", "--procfs", str(tmp_path / "missing"), "--sysfs", str(tmp_path / "missing"))
    assert result.returncode == 3
    assert "could not read this host" in result.stderr


@pytest.mark.slow
def test_check_that_cannot_read_the_host_still_prints_json_with_the_reason(tmp_path):
    result = run_check("--duration", "1", "--json", "--procfs", str(tmp_path / "missing"),
                       "--sysfs", str(tmp_path / "missing"))
    report = json.loads(result.stdout)
    assert result.returncode == report["exit_code"] == 3
    assert {"host_memory", "numa"} <= set(report["could_not_read"])
    assert report["reason"].startswith("hybridmon check could not read this host")
    assert str(tmp_path / "missing") in report["reason"]


# The fixture host with files removed: each essential collector that cannot read its files turns
# the check into exit 3 naming it, even when the others read fine (the old rule needed both memory
# collectors unreadable, and exited 1 here on the fixture's findings).
@pytest.mark.parametrize("removed, unread", [
    (("proc/meminfo", "sys/devices/system/node"), {"host_memory": "meminfo", "numa": "node/online"}),
    (("proc/vmstat",), {"host_memory": "vmstat"}),
    (("sys/devices/system/node/online",), {"numa": "node/online"}),
], ids=["meminfo-and-numa", "vmstat", "numa-online"])
def test_check_names_each_essential_collector_it_could_not_read(tmp_path, capsys, removed, unread):
    host = tmp_path / "host"
    shutil.copytree(FIXTURE_HOST, host, symlinks=True)
    for relative in removed:
        target = host / relative
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    config = load_config(environ={**FIXTURE_ENVIRONMENT, "HYBRIDMON_LOG_LEVEL": "error",
                                  "HYBRIDMON_PATHS__PROCFS": str(host / "proc"),
                                  "HYBRIDMON_PATHS__SYSFS": str(host / "sys")})
    code = check.main(config, 1.0, as_json=True, strict=False)
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert code == report["exit_code"] == 3, report
    assert set(report["could_not_read"]) == set(unread)
    for collector, file in unread.items():
        assert file in report["could_not_read"][collector] and collector in err
    assert report["findings"], "what could be read is still judged and shown"


@pytest.mark.slow
def test_check_refuses_a_bad_duration():
    assert run_check("--duration", "0").returncode == 64


def test_a_clean_window_with_skipped_detectors_is_not_called_healthy_for_them():
    """Every collector runs once before the detectors judge (run_check gives a collector that had
    no turn one: the fixture check above, 2 s against host_memory's longer interval, still reports
    HostSwappinessHigh), so what a check cannot vouch for is the detectors it skips. Before issue
    14 the table said "nothing wrong was seen" above the skipped ones."""
    import io

    result = check.CheckResult([], [check.Skipped("memory_growth", "needs 30 min of history")], {}, 2.0, {})
    out = io.StringIO()
    check.render_table(result, out)
    assert "nothing wrong was seen" not in out.getvalue()
    assert "did not look" in out.getvalue() and "skipped memory_growth: needs 30 min" in out.getvalue()
    assert result.exit_code() == check.EXIT_HEALTHY  # the exit code judges findings only, as documented
    clean = io.StringIO()
    check.render_table(check.CheckResult([], [], {}, 2.0, {}), clean)
    assert "nothing wrong was seen in this window" in clean.getvalue()


CHECK_AND_LIST_MODULES = """
import sys
from hybridmon.agent.cli import main
code = main(["check", "--duration", "1", "--json", "--log-level", "error"])
loaded = sorted(name for name in sys.modules
                if name == "tests" or name.startswith("tests.") or "promtool" in name or "case_inputs" in name)
print("LOADED", loaded, file=sys.stderr)
"""


@pytest.mark.slow
def test_a_check_loads_no_promtool_case_builder_nor_any_test_module():
    """The promtool cases and their inputs are test code (tests/alerts/, tests/support/promtool_*):
    the running agent never imports them (issue 27). A check imports every alert family."""
    result = subprocess.run([HYBRIDMON[0], "-c", CHECK_AND_LIST_MODULES], env=subprocess_environment(),
                            cwd="/", capture_output=True, text=True, timeout=60)
    assert "LOADED []" in result.stderr, result.stderr[-2000:]


WEDGED_NVML = '''"""tests.support.fake_nvml, but its memory query blocks as every NVML call does on a wedged driver
(issue 30: with every call blocking 30 s, `check --duration 2` printed after ~12 s and never exited)."""
import time

from tests.support.fake_nvml import *  # noqa: F401,F403 - the fake's every function and constant


def nvmlDeviceGetMemoryInfo(*_args, **_kwargs):
    time.sleep(600)
'''


@pytest.mark.slow
def test_a_wedged_nvml_is_a_finding_and_the_check_still_exits(tmp_path):
    (tmp_path / "wedged_nvml.py").write_text(WEDGED_NVML)
    started = time.monotonic()
    result = run_check("--duration", "2", "--json", environment={
        **FIXTURE_ENVIRONMENT, "HYBRIDMON_GPU__NVML_MODULE": "wedged_nvml", "PYTHONPATH": f"{REPO}:{tmp_path}"})
    elapsed = time.monotonic() - started
    report = json.loads(result.stdout)
    [hung] = [f for f in report["findings"] if f["alertname"] == "HybridmonCollectorHung"]
    assert hung["labels"] == {"collector": "gpu"} and hung["severity"] == "warning"
    assert result.returncode == report["exit_code"] == 1, result.stderr
    # the window, the grace for the collectors still running, and the interpreter's start
    assert elapsed < 2 + check.HUNG_GRACE_SECONDS + 10, elapsed
