"""GpuDriverMissing: NVIDIA GPUs are on the PCI bus and NVML answers nothing: the driver is not
loaded, its user-space library (libnvidia-ml.so.1) is missing, or NVML fails to initialise.
Runbook: GpuDriverMissing.md.

Issue 30: on such a host `hybridmon check` skipped every GPU check and exited 0, where nvidia-smi
would have failed. The bus's view is sysfs (hybridmon_pcie_device_present: the NVIDIA display-class
functions the pcie collector finds, exporters/pcie.py); NVML's view is the gpu collector finding
nothing to read (hybridmon_collector_no_data{collector="gpu"}, the reason in the agent log and
/healthz). A host configured without the gpu collector has no such series and is not judged. NVML
that fails on every call after a good start is HybridmonCollectorFailing's, and a GPU NVML reports
lost is GpuLost's.
"""
from __future__ import annotations

from textwrap import dedent

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import windows
from hybridmon.agent.detectors.base import DetectorBase, Finding, HistoryReader, RunningAgent
from hybridmon.agent.self_metrics import COLLECTOR_NO_DATA
from hybridmon.exporters.pcie import DEVICE_PRESENT
from hybridmon.rules import groups
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import duration

ALERTNAME = "GpuDriverMissing"
INPUTS = (DEVICE_PRESENT, COLLECTOR_NO_DATA)
GPU_COLLECTOR = "gpu"


class Settings(Section):
    for_seconds: float


def alert(s: Settings) -> Alert:
    return Alert(
        ALERTNAME,
        dedent(f"""\
            # the NVIDIA GPUs sysfs shows on the bus...
            count by (job, instance) ({DEVICE_PRESENT.name} == 1)
            # ...while the gpu collector finds nothing to read through NVML
            and on (job, instance)
            {COLLECTOR_NO_DATA.name}{{collector="{GPU_COLLECTOR}"}} == 1"""),
        s.for_seconds, "warning",
        "<value|humanize> NVIDIA GPU(s) on the PCI bus of <instance>, and NVML answers nothing",
        "sysfs shows <value|humanize> NVIDIA GPU(s) on the PCI bus of <instance>, and for "
        f"{duration(s.for_seconds)} or more (threshold: {duration(s.for_seconds)}, any GPU on the bus) "
        "NVML has given the agent nothing to read: the NVIDIA "
        "driver is not loaded, its library libnvidia-ml.so.1 is missing, or NVML fails to "
        "initialise (the agent log and /healthz say which). nvidia-smi fails here too, and so does "
        "every CUDA program: an inference server on this host runs on the CPU or not at all, and "
        "every GPU alert (PCIe starvation, link, VRAM, GPU lost) is blind.",
    )


class Detector(DetectorBase):
    """Host-wide, warning: NVIDIA functions present on the bus (their latest
    hybridmon_pcie_device_present is 1) while the agent's gpu collector reports no data (its
    no_data_reason, what hybridmon_collector_no_data exports). Its value is the GPUs on the bus;
    the reason the gpu collector gave is in its details."""

    name = "gpu_driver_missing"
    alertnames = (ALERTNAME,)

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.alert = alert(config)
        self._gpu = None

    def attach(self, agent: RunningAgent) -> None:
        """Called once by the agent (daemon.Agent): its gpu collector's record, if it runs one."""
        self._gpu = next((item for item in agent.sampler.scheduled if item.collector.name == GPU_COLLECTOR), None)

    def evaluate(self, history: HistoryReader, now: float) -> list[Finding]:
        if self._gpu is None or not self._gpu.state.no_data_reason:
            return []
        present = windows.by_labels(history.series(DEVICE_PRESENT.name), "pci_bus_id")
        on_bus = sorted(address for (address,), series in present.items() if windows.latest(series, now) == 1)
        if not on_bus:
            return []
        return [finding(self.alert, {}, float(len(on_bus)), 1.0, unit="GPUs",
                        details={"pci_bus_ids": ", ".join(on_bus), "nvml": self._gpu.state.no_data_reason})]


FAMILY = AlertFamily(
    section="gpu_driver_missing",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group=groups.PCIE,
    detector=Detector,
    alerts=lambda t: (alert(t.gpu_driver_missing),),
    collectors=("pcie",),
    lookback_seconds=lambda settings: 0.0,
    no_scenario=("a synthetic host's GPUs answer through the fake NVML; tests/alerts/test_gpu_driver_missing.py "
                 "runs the agent on the fixture host without an NVML library, as a host without the driver is"),
)
