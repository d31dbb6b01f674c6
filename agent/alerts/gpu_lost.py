"""GpuLost: NVML reports a GPU lost, or its PCI function has left the bus. Everything running on it
has failed or will; it does not come back without a GPU reset or a reboot. Runbook: GpuLost.md.

One lost GPU is one alert. NVML's view (hybridmon_gpu_up, labels gpu and uuid) and the bus's view
(hybridmon_pcie_device_present, label pci_bus_id) of the same GPU both fire when it falls off the
bus; each is named with the other half of the identity the GPU reported in hybridmon_gpu_info while
it still answered (within IDENTITY_LOOKBACK_SECONDS), so both carry gpu, uuid AND pci_bus_id, and
the bus's view of an address NVML's view already names is dropped: the same labels, one alert, one
Alertmanager group. Where the identity is not known (the agent started after the loss, or the loss
is older than the lookback) the two views stay separate alerts; Alertmanager's GpuLost route groups
by machine (deploy/alertmanager/alertmanager.yml), so they still make one notification.

NVML's view pages only once confirmed: the GPU down at `confirm_readings` (2) collections in a row
(hybridmon_gpu_down_consecutive_readings, counted by the agent at every collection, 1 s by default,
which Prometheus' 15 s scrapes cannot see), because NVML_ERROR_GPU_IS_LOST lasts until the GPU is
reset (nvml.h: "The GPU has fallen off the bus or has otherwise become inaccessible"; Xid 79 in
NVIDIA's Xid catalogue needs a reset or reboot); a GPU that answers at the next collection was not
lost. The bus's view is confirmation of its own: a PCI function leaves sysfs only when the kernel
removes it (surprise link-down, hot-unplug, fatal AER recovery), and it comes back only with a
rescan. A down reading that did not hold is counted (hybridmon_gpu_down_blips_total) and logged
by the GPU collector, and raises no finding: one unrepeated reading calls for no action, and a GPU
that blips often shows on the counter (the runbook's query). Xid 79 itself is in the kernel log,
which no collector reads, so it confirms nothing here.
"""
from __future__ import annotations

from bisect import bisect_right

from pydantic import Field

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import common, windows
from hybridmon.agent.detectors.base import DetectorBase, Finding, HistoryReader
from hybridmon.exporters.gpu import DOWN_READINGS, GPU_INFO, GPU_UP
from hybridmon.exporters.pcie import DEVICE_PRESENT
from hybridmon.rules import groups
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import duration

INPUTS = (GPU_UP, DOWN_READINGS, DEVICE_PRESENT, GPU_INFO)
# How far back a GPU's identity (gpu_info: index, UUID, PCI address) is looked up. A lost GPU stops
# reporting gpu_info at once (exporters/gpu.py), and Prometheus marks the series stale at the next
# scrape, so the rule reads last_over_time over this window. An hour covers the time an on-call
# engineer takes to drain and reset the host, while keeping the range read small on a large fleet
# (8 gpu_info series per host, 240 samples each at a 15 s scrape). Past it the views fall apart into
# two alerts, which Alertmanager's per-machine GpuLost grouping still keeps in one notification.
IDENTITY_LOOKBACK_SECONDS = 3600.0


class Settings(Section):
    for_seconds: float
    confirm_readings: int = Field(ge=1)  # collections in a row NVML's view must hold down


def _identity(lookback: str, keep: str) -> str:
    """One gpu_info identity per entity: `keep` the labels the join adds; `topk` keeps a single
    series per entity even if the lookback saw two (a GPU replaced in the same slot), where a
    duplicate on the `one` side of group_left would fail the whole rule."""
    return (f"topk without ({keep}) (1,\n"
            f"  max without (name, driver_version) (last_over_time({GPU_INFO.name}[{lookback}]))\n"
            ")")


def _confirmed_down(settings: Settings) -> str:
    """NVML's view, confirmed: down now and at the collections before (same labels: plain `and`)."""
    return f"({GPU_UP.name} == 0 and {DOWN_READINGS.name} >= {settings.confirm_readings})"


def alert(settings: Settings) -> Alert:
    wait = settings.for_seconds
    when = "at once" if wait == 0 else f"after {duration(wait)}"
    lookback = duration(IDENTITY_LOOKBACK_SECONDS)
    readings = settings.confirm_readings
    held = "at its last collection" if readings == 1 else f"at {readings} collections in a row"
    nvml_down = _confirmed_down(settings)
    return Alert(
        "GpuLost",
        f"# NVML reports the GPU lost or silent {held} (labels gpu, uuid; one reading that\n"
        f"# does not hold is not a loss), named with the PCI address its gpu_info gave while it\n"
        f"# answered ({lookback}), so both views of one GPU carry the same labels...\n"
        "(\n"
        f"    {nvml_down}\n"
        "  * ignoring (pci_bus_id) group_left (pci_bus_id)\n"
        f"    {_identity(lookback, 'pci_bus_id')}\n"
        "  or ignoring (pci_bus_id)\n"
        f"    {nvml_down}\n"
        ")\n"
        "# ...or its PCI function has left the bus (label pci_bus_id), named with the GPU that had\n"
        "# that address; an address NVML's view already names is the same GPU: one alert\n"
        "or ignoring (gpu, uuid)\n"
        "(\n"
        f"    ({DEVICE_PRESENT.name} == 0)\n"
        "  * ignoring (gpu, uuid) group_left (gpu, uuid)\n"
        f"    {_identity(lookback, 'gpu, uuid')}\n"
        "  or ignoring (gpu, uuid)\n"
        f"    ({DEVICE_PRESENT.name} == 0)\n"
        ")",
        wait, "critical",
        "<if gpu>GPU <gpu> on <instance> is lost: NVML reports it gone or it left the PCI bus"
        "<else>GPU PCI function <pci_bus_id> on <instance> has left the PCI bus<end>",
        f"<if gpu>GPU <gpu> (<uuid>) is lost: NVML reports it lost or silent {held} "
        f"({GPU_UP.name} 0, {DOWN_READINGS.name}) or its PCI function has left the bus "
        f"({DEVICE_PRESENT.name} 0); it fell off the bus or stopped answering.<else>The NVIDIA PCI function <pci_bus_id> was on the bus earlier and is gone "
        f"from sysfs now ({DEVICE_PRESENT.name} <value>): the GPU fell off the bus or was "
        f"removed.<end> <if pci_bus_id>PCI address <pci_bus_id>.<else>No PCI address: it reported "
        f"no gpu_info in the last {lookback}.<end> Threshold: down {held} in NVML, or gone from "
        f"the bus, alerting {when}. "
        "Every process using it has failed or will, and it does not come back without a GPU reset "
        "or a reboot. Drain the host, read the kernel log for Xid 79 (fallen off the bus), AER and "
        "pciehp messages (dmesg | grep -i -e xid -e aer -e pciehp), then reset the GPU "
        "(nvidia-smi -r) or reboot; if it happens again, reseat or replace the riser or card and "
        "check its power and cooling.",
    )


def identities(history: HistoryReader, now: float) -> tuple[dict[tuple[str, str], str],
                                                             dict[str, tuple[str, str]],
                                                             dict[tuple[str, str], dict[str, str]]]:
    """((gpu, uuid) -> pci_bus_id, pci_bus_id -> (gpu, uuid), (gpu, uuid) -> its gpu_info labels)
    from the gpu_info series with a point in the last IDENTITY_LOOKBACK_SECONDS, as the rule's
    last_over_time reads them; where two compete, the one seen last wins (the rule's topk keeps
    either: they differ only for a GPU moved or replaced within the hour)."""
    seen = []
    for series in history.series(GPU_INFO.name):
        end = bisect_right(series.times, now)
        if end and now - series.times[end - 1] <= IDENTITY_LOOKBACK_SECONDS:
            seen.append((series.times[end - 1], series.labels))
    by_gpu: dict[tuple[str, str], str] = {}
    by_bus: dict[str, tuple[str, str]] = {}
    reported: dict[tuple[str, str], dict[str, str]] = {}
    for _, labels in sorted(seen, key=lambda pair: pair[0]):
        gpu, bus_id = (labels["gpu"], labels["uuid"]), labels.get("pci_bus_id", "")
        reported[gpu] = labels
        if bus_id:
            by_gpu[gpu] = bus_id
            by_bus[bus_id] = gpu
    return by_gpu, by_bus, reported


class Detector(DetectorBase):
    """GpuLost: GPU_UP == 0 with DOWN_READINGS >= confirm_readings (NVML reports the GPU lost or
    silent, and did at the collections before) or DEVICE_PRESENT == 0 (the PCI function left the
    bus), current values, each labelled with gpu, uuid and pci_bus_id where gpu_info gave
    the GPU's identity in the last hour; one finding per GPU, as the rule's `or` merges them. Its
    figures: each GPU down now (confirmed or not) or gone from the bus, with its last gpu_info
    labels within that hour (its name, its address), by (gpu, uuid), which a down GPU no longer
    reports and the status page names it by."""

    name = "gpu_lost"
    alertnames = ("GpuLost",)

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.alert = alert(config)

    def evaluate(self, history: HistoryReader, now: float) -> list[Finding]:
        findings = []
        bus_of, gpu_at, reported = identities(history, now)
        named_buses = set()
        lost: dict[tuple[str, ...], dict[str, str]] = {}
        down_readings = common.gpu_latest(history, DOWN_READINGS.name, now)
        for key, up in sorted(common.gpu_latest(history, GPU_UP.name, now).items()):
            if up != 0:
                continue
            # the status page names every GPU down now, confirmed or not, by its last identity
            lost[key] = reported.get((key[0], key[1]), {})
            # a reading that may not hold: the rule's `and` drops it too (absent: not confirmed)
            if down_readings.get(key, 0) < self.config.confirm_readings:
                continue
            labels = common.gpu_entity(key)
            bus_id = bus_of.get((key[0], key[1]))
            if bus_id:
                labels["pci_bus_id"] = bus_id
                named_buses.add(bus_id)
            findings.append(finding(self.alert, labels, 0.0, 1.0))
        for series in sorted(history.series(DEVICE_PRESENT.name), key=lambda s: s.labels["pci_bus_id"]):
            bus_id = series.labels["pci_bus_id"]
            if windows.latest(series, now) != 0 or bus_id in named_buses:
                continue
            labels = {"pci_bus_id": bus_id}
            if bus_id in gpu_at:
                labels.update(common.gpu_entity(gpu_at[bus_id]))
                lost[gpu_at[bus_id]] = reported[gpu_at[bus_id]]
            findings.append(finding(self.alert, labels, 0.0, 1.0))
        self.figures = lost
        return findings


FAMILY = AlertFamily(
    section="gpu_lost",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group=groups.PCIE,
    detector=Detector,
    alerts=lambda t: (alert(t.gpu_lost),),
    collectors=("gpu",),
    lookback_seconds=lambda settings: IDENTITY_LOOKBACK_SECONDS,
    scenario="gpu_lost",
)
