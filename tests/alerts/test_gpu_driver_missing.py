"""The tests of the gpu_driver_missing alert family (agent/alerts/gpu_driver_missing.py): its
detector on the fixture host run without an NVML library, as a host without the driver is, and its
rule's promtool cases (`promtool_cases`, run by promtool in tests/rules/test_rules.py)."""
from __future__ import annotations

import json
import subprocess

import pytest

from hybridmon.agent.alerts import gpu_driver_missing
from hybridmon.agent.alerts.gpu_driver_missing import ALERTNAME
from hybridmon.agent.config import load_config
from hybridmon.agent.daemon import Agent
from hybridmon.agent.self_metrics import COLLECTOR_NO_DATA
from hybridmon.exporters.pcie import DEVICE_PRESENT
from tests.support.agent_helpers import FIXTURE_ENVIRONMENT, HYBRIDMON, REPO, run_every_collector_once, subprocess_environment
from tests.support.detector_history import assert_says_its_rules_words
from tests.support.promtool_cases import ONSET, Test, firing, not_yet

T0 = 1_700_000_000.0
# A module that is not there: NVML's library missing, as pynvml's import of libnvidia-ml fails
NO_NVML = {"gpu.nvml_module": "hybridmon_no_such_nvml_module"}


def agent_on_fixture_host(tmp_path, fixture_procfs, fixture_sysfs, **overrides) -> Agent:
    return Agent(load_config(environ={}, overrides={
        "paths.procfs": fixture_procfs, "paths.sysfs": fixture_sysfs, "state_dir": str(tmp_path),
        "pcie.udev": False, **overrides}))


def detector_of(agent: Agent) -> gpu_driver_missing.Detector:
    return next(d for d in agent.engine.detectors if isinstance(d, gpu_driver_missing.Detector))


def test_gpus_on_the_bus_without_nvml_are_found_with_the_reason(tmp_path, fixture_procfs, fixture_sysfs):
    agent = agent_on_fixture_host(tmp_path, fixture_procfs, fixture_sysfs, **NO_NVML)
    try:
        run_every_collector_once(agent, T0)
        (finding,) = detector_of(agent).evaluate(agent.history, T0)
    finally:
        agent.stop()
    # the fixture host's two NVIDIA functions (host-2node/sys/bus/pci/devices)
    assert finding.alertname == ALERTNAME and finding.labels == {} and finding.value == 2
    assert finding.details["pci_bus_ids"] == "0000:17:00.0, 0000:ca:00.0"
    assert finding.details["nvml"]
    assert_says_its_rules_words(finding)
    assert "2 NVIDIA GPU(s) on the PCI bus" in finding.summary


@pytest.mark.parametrize("overrides", [{}, {"collectors.gpu.enabled": False}], ids=["nvml", "gpu collector off"])
def test_nvml_answering_or_no_gpu_collector_is_silent(tmp_path, fixture_procfs, fixture_sysfs, overrides):
    settings = {"gpu.nvml_module": "tests.support.fake_nvml", **overrides} if not overrides else {**NO_NVML, **overrides}
    agent = agent_on_fixture_host(tmp_path, fixture_procfs, fixture_sysfs, **settings)
    try:
        run_every_collector_once(agent, T0)
        assert detector_of(agent).evaluate(agent.history, T0) == []
    finally:
        agent.stop()


@pytest.mark.slow
def test_check_on_a_gpu_host_without_its_driver_is_not_healthy():
    """Issue 30: `check` exited 0 with every GPU check skipped on a host whose driver failed to
    load; nvidia-smi would have failed there."""
    result = subprocess.run(HYBRIDMON + ["check", "--log-level", "error", "--duration", "2", "--json"],
                            env=subprocess_environment({**FIXTURE_ENVIRONMENT,
                                                        "HYBRIDMON_GPU__NVML_MODULE": "hybridmon_no_such_nvml_module"}),
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    report = json.loads(result.stdout)
    [missing] = [f for f in report["findings"] if f["alertname"] == ALERTNAME]
    assert missing["value"] == 2 and result.returncode == report["exit_code"] == 1, result.stderr


# --- its rule's promtool cases ------------------------------------------------------------------


def promtool_cases(t, catalog) -> list[Test]:
    """Two NVIDIA functions on the bus while the gpu collector has no data from the onset: fires
    after `for`; the same with the gpu collector reading NVML (no_data 0): silent (a second host)."""
    wait = t.gpu_driver_missing.for_seconds
    rule = catalog.find(ALERTNAME)
    test = Test("gpu driver missing: GPUs on the bus and NVML answering nothing fires; NVML "
                "answering stays silent", firing(wait) + 60, catalog)
    for host, no_data in (("gpu-host-1:9787", 1), ("gpu-host-2:9787", 0)):
        for address in ("0000:17:00.0", "0000:ca:00.0"):
            test.constant(DEVICE_PRESENT.name, 1, instance=host, pci_bus_id=address)
        test.gauge(COLLECTOR_NO_DATA.name, 0, no_data, instance=host, collector="gpu")
    test.expect(ONSET, rule.alert)
    test.expect(not_yet(wait), rule.alert)
    test.expect(firing(wait), rule.alert, test.alert(rule, {}, value=2.0))
    return [test]
