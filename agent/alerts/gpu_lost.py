"""GpuLost: NVML reports a GPU lost, or its PCI function has left the bus. Everything running on it
has failed or will; it does not come back without a GPU reset or a reboot. Runbook: GpuLost.md.
"""
from __future__ import annotations

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import common, windows
from hybridmon.agent.detectors.base import Finding
from hybridmon.agent.history import History
from hybridmon.exporters.gpu import GPU_INFO, GPU_UP
from hybridmon.exporters.pcie import DEVICE_PRESENT
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import duration
from hybridmon.rules.promtool_cases import BUS0, BUS1, GPU0, GPU1, Test, firing, not_yet

INPUTS = (GPU_UP, DEVICE_PRESENT, GPU_INFO)


class Settings(Section):
    for_seconds: float


def alert(settings: Settings) -> Alert:
    wait = settings.for_seconds
    when = "at once" if wait == 0 else f"after {duration(wait)}"
    return Alert(
        "GpuLost",
        "# NVML reports the GPU lost (labels gpu, uuid)...\n"
        f"{GPU_UP.name} == 0\n"
        "# ...or its PCI function has left the bus (label pci_bus_id)\n"
        "or\n"
        f"{DEVICE_PRESENT.name} == 0",
        wait, "critical",
        "<if gpu>GPU <gpu> on <instance> is lost: NVML reports it gone"
        "<else>GPU PCI function <pci_bus_id> on <instance> has left the PCI bus<end>",
        f"<if gpu>NVML reports GPU <gpu> (<uuid>) lost ({GPU_UP.name} <value>): it fell off the "
        "bus or stopped answering.<else>The NVIDIA PCI function <pci_bus_id> was on the bus earlier "
        f"and is gone from sysfs now ({DEVICE_PRESENT.name} <value>): the GPU fell off the "
        f"bus or was removed.<end> Threshold: any loss, alerting {when}. Every process using it "
        "has failed or will, and it does not come back without a GPU reset or a reboot. Drain the "
        "host, read the kernel log for Xid 79 (fallen off the bus), AER and pciehp messages "
        "(dmesg | grep -i -e xid -e aer -e pciehp), then reset the GPU (nvidia-smi -r) or reboot; "
        "if it happens again, reseat or replace the riser or card and check its power and cooling.",
    )


class Detector:
    """GpuLost: GPU_UP == 0 (NVML reports the GPU lost; labels gpu, uuid) or DEVICE_PRESENT == 0
    (the PCI function left the bus; label pci_bus_id), current values. The details name the
    other half of the GPU's identity where gpu_info ever reported it (bus id, or gpu and uuid)."""

    name = "gpu_lost"
    alertnames = ("GpuLost",)
    min_history_seconds = 0.0

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.alert = alert(config)

    def evaluate(self, history: History, now: float) -> list[Finding]:
        findings = []
        gpus = common.gpus_by_bus_id(history)
        bus_ids = {labels.get("uuid"): bus_id for bus_id, labels in gpus.items()}
        for key, up in sorted(common.gpu_latest(history, GPU_UP.name, now).items()):
            if up != 0:
                continue
            details = {"pci_bus_id": bus_ids[key[1]]} if key[1] in bus_ids else {}
            findings.append(finding(self.alert, common.gpu_entity(key), 0.0, 1.0, details=details))
        for series in sorted(history.series(DEVICE_PRESENT.name), key=lambda s: s.labels["pci_bus_id"]):
            if windows.latest(series, now) != 0:
                continue
            bus_id = series.labels["pci_bus_id"]
            gpu = gpus.get(bus_id.lower())
            details = {"gpu": gpu["gpu"], "uuid": gpu.get("uuid", "")} if gpu else {}
            findings.append(finding(self.alert, {"pci_bus_id": bus_id}, 0.0, 1.0, details=details))
        return findings


def cases(t, catalog) -> list[Test]:
    wait = t.gpu_lost.for_seconds
    rule = catalog.find("GpuLost")
    test = Test("GPU lost: NVML loses GPU 1 and its PCI function leaves the bus; GPU 0 stays",
                firing(wait) + 120, catalog)
    test.constant(GPU_UP.name, 1, **GPU0)
    test.gauge(GPU_UP.name, 1, 0, **GPU1)
    test.constant(DEVICE_PRESENT.name, 1, pci_bus_id=BUS0)
    test.gauge(DEVICE_PRESENT.name, 1, 0, pci_bus_id=BUS1)
    test.expect(not_yet(wait), rule.alert)
    test.expect(firing(wait), rule.alert, test.alert(rule, GPU1, value=0),
                test.alert(rule, {"pci_bus_id": BUS1}, value=0))
    return [test]


FAMILY = AlertFamily(
    section="gpu_lost",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group="hybridmon-pcie",
    detector=Detector,
    alerts=lambda t: (alert(t.gpu_lost),),
    cases=cases,
    collectors=("gpu",),
    lookback_seconds=lambda settings: 0.0,
)
