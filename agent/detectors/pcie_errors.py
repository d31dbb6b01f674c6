"""PCIe errors and lost GPUs: replays above DCGM's bit-error-rate bound, AER error counters rising,
a GPU that NVML reports lost or whose PCI function left the bus."""
from __future__ import annotations

import math

from hybridmon.agent.detectors import common, windows
from hybridmon.agent.detectors.base import Finding, GpuLost, PcieErrors
from hybridmon.agent.detectors.pcie import GENERATION, LANE_LINE_RATE_BITS_PER_SECOND, WIDTH, link_name
from hybridmon.agent.history import History

REPLAYS = "hybridmon_gpu_pcie_replays_total"
AER_ERRORS = "hybridmon_pcie_aer_errors_total"
GPU_UP = "hybridmon_gpu_up"
DEVICE_PRESENT = "hybridmon_pcie_device_present"
GPU_INFO = "hybridmon_gpu_info"
UNCORRECTABLE = ("nonfatal", "fatal")


def replay_bound_per_minute(bit_error_rate: float, generation: float, lanes: float) -> float | None:
    """DCGM's PCIe health bound: ceil(BER x line rate x 60 x lanes) replays per minute
    (Gen4 x16 at 1e-12: 16/min). None for an unknown generation."""
    line_rate = LANE_LINE_RATE_BITS_PER_SECOND.get(int(round(generation)))
    if line_rate is None or lanes <= 0:
        return None
    return float(math.ceil(bit_error_rate * line_rate * 60 * lanes - 1e-9))


def gpus_by_bus_id(history: History) -> dict[str, dict[str, str]]:
    """pci_bus_id (lower case) -> gpu_info labels, from any time in history: a GPU that fell off
    the bus no longer reports its identity."""
    found: dict[str, tuple[float, dict[str, str]]] = {}
    for series in history.series(GPU_INFO):
        bus_id = series.labels.get("pci_bus_id", "").lower()
        seen = series.times[-1] if series.times else -math.inf
        if bus_id and (bus_id not in found or seen >= found[bus_id][0]):
            found[bus_id] = (seen, series.labels)
    return {bus_id: labels for bus_id, (_, labels) in found.items()}


class PcieErrorsDetector:
    """GpuPcieReplayErrors: replays per minute, rate over window_seconds, above the DCGM bound of
    the current link (current generation and width). PcieAerErrors: critical for any increase of
    a nonfatal or fatal AER counter over window_seconds (only when aer_uncorrectable_any, as in
    the generated rule), warning when correctable errors arrive faster than
    aer_correctable_per_hour (rate over window_seconds)."""

    name = "pcie_errors"
    alertnames = ("GpuPcieReplayErrors", "PcieAerErrors")

    def __init__(self, config: PcieErrors) -> None:
        self.config = config
        self.min_history_seconds = config.window_seconds

    def evaluate(self, history: History, now: float) -> list[Finding]:
        return self._replays(history, now) + self._aer(history, now)

    def _replays(self, history: History, now: float) -> list[Finding]:
        generation = common.gpu_latest(history, GENERATION, now)
        width = common.gpu_latest(history, WIDTH, now)
        findings = []
        series_by_gpu = windows.by_labels(history.series(REPLAYS), *common.GPU_LABELS)
        for key, series in sorted(series_by_gpu.items()):
            per_second = windows.rate(series, now, self.config.window_seconds)
            if per_second is None or key not in generation or key not in width:
                continue
            bound = replay_bound_per_minute(self.config.bit_error_rate, generation[key], width[key])
            per_minute = per_second * 60
            if bound is None or per_minute <= bound:
                continue
            link = link_name(generation[key], width[key])
            window = common.human_duration(self.config.window_seconds)
            findings.append(Finding(
                alertname="GpuPcieReplayErrors",
                severity="warning",
                labels=common.gpu_entity(key),
                value=per_minute,
                threshold=bound,
                unit="replays/min",
                summary=(f"GPU {key[0]} PCIe link resends {per_minute:.1f} packets/min, above the "
                         f"{bound:.0f}/min bound for {link}"),
                description=(
                    f"GPU {key[0]} ({key[1]}) replayed {per_minute:.1f} PCIe packets per minute "
                    f"over the last {window}, above DCGM's bound of {bound:.0f}/min for its "
                    f"current {link} link (bit error rate {self.config.bit_error_rate:g} x line "
                    f"rate x 60 s x lanes). Each replay is a corrupted transfer sent again: "
                    f"throughput drops and a marginal link can train down or drop the GPU off "
                    f"the bus. First: `nvidia-smi -q -d PCIE` (replay counter, link), "
                    f"`dmesg | grep -i -e aer -e xid`, then reseat the GPU or riser."),
                details={"link_generation": generation[key], "link_width_lanes": width[key],
                         "window_seconds": self.config.window_seconds},
            ))
        return findings

    def _aer(self, history: History, now: float) -> list[Finding]:
        gpus = gpus_by_bus_id(history)
        findings = []
        per_hour_limit = self.config.aer_correctable_per_hour
        window = common.human_duration(self.config.window_seconds)
        for series in sorted(history.series(AER_ERRORS),
                             key=lambda s: (s.labels["pci_bus_id"], s.labels["severity"])):
            bus_id, aer_class = series.labels["pci_bus_id"], series.labels["severity"]
            labels = {"pci_bus_id": bus_id, "aer_severity": aer_class}
            gpu = gpus.get(bus_id.lower(), {})
            device = f"{bus_id} (GPU {gpu['gpu']})" if gpu else bus_id
            details: dict[str, float | str] = {"window_seconds": self.config.window_seconds}
            if gpu:
                details.update(gpu=gpu["gpu"], uuid=gpu.get("uuid", ""))
            if aer_class in UNCORRECTABLE:
                if not self.config.aer_uncorrectable_any:
                    continue
                new = windows.increase(series, now, self.config.window_seconds)
                if new is None or new <= 0:
                    continue
                findings.append(Finding(
                    alertname="PcieAerErrors", severity="critical", labels=labels,
                    value=new, threshold=0.0, unit="errors",
                    summary=(f"PCIe device {device} reported {new:.0f} new {aer_class} AER "
                             f"error{'' if new == 1 else 's'}"),
                    description=(
                        f"PCIe device {device} reported {new:.0f} uncorrectable ({aer_class}) AER "
                        f"error(s) in the last {window}; any is too many. Uncorrectable errors lose "
                        f"transactions: the GPU may hang, report Xid errors or fall off the bus. "
                        f"First: `dmesg | grep -i aer` for the error type, `nvidia-smi -q -d PCIE`, "
                        f"and plan to drain the host and reseat or replace the GPU or riser."),
                    details=details,
                ))
                continue
            per_second = windows.rate(series, now, self.config.window_seconds)
            if per_second is None or per_second * 3600 <= per_hour_limit:
                continue
            per_hour = per_second * 3600
            findings.append(Finding(
                alertname="PcieAerErrors", severity="warning", labels=labels,
                value=per_hour, threshold=per_hour_limit, unit="errors/h",
                summary=(f"PCIe device {device} reports {per_hour:.0f} {aer_class} AER errors/h "
                         f"(more than {per_hour_limit:.0f}/h)"),
                description=(
                    f"PCIe device {device} reported {aer_class} AER errors at {per_hour:.0f} per "
                    f"hour over the last {window}, above {per_hour_limit:.0f}/h. Corrected errors "
                    f"cost replays and bandwidth and often come before the link trains down or "
                    f"fails. First: `dmesg | grep -i aer` (which device, which error), "
                    f"`lspci -vv -s {bus_id}` (LnkSta), and reseat the card or riser at the next "
                    f"maintenance window."),
                details=details,
            ))
        return findings


class GpuLostDetector:
    """GpuLost: hybridmon_gpu_up == 0 (NVML reports the GPU lost; labels gpu, uuid) or
    hybridmon_pcie_device_present == 0 (the PCI function left the bus; label pci_bus_id),
    current values."""

    name = "gpu_lost"
    alertnames = ("GpuLost",)
    min_history_seconds = 0.0

    def __init__(self, config: GpuLost) -> None:
        self.config = config

    def evaluate(self, history: History, now: float) -> list[Finding]:
        findings = []
        gpus = gpus_by_bus_id(history)
        bus_ids = {labels.get("uuid"): bus_id for bus_id, labels in gpus.items()}
        for key, up in sorted(common.gpu_latest(history, GPU_UP, now).items()):
            if up != 0:
                continue
            details = {"pci_bus_id": bus_ids[key[1]]} if key[1] in bus_ids else {}
            findings.append(self._finding(common.gpu_entity(key), f"GPU {key[0]} ({key[1]})",
                                          "NVML reports it lost (NVML_ERROR_GPU_IS_LOST)",
                                          "hybridmon_gpu_up", details))
        for series in sorted(history.series(DEVICE_PRESENT), key=lambda s: s.labels["pci_bus_id"]):
            if windows.latest(series, now) != 0:
                continue
            bus_id = series.labels["pci_bus_id"]
            gpu = gpus.get(bus_id.lower())
            device = f"GPU {gpu['gpu']} at {bus_id}" if gpu else f"GPU function {bus_id}"
            details = {"gpu": gpu["gpu"], "uuid": gpu.get("uuid", "")} if gpu else {}
            findings.append(self._finding({"pci_bus_id": bus_id}, device,
                                          "its PCI function has disappeared from the bus",
                                          "hybridmon_pcie_device_present", details))
        return findings

    def _finding(self, labels, device, what, metric, details) -> Finding:
        return Finding(
            alertname="GpuLost",
            severity="critical",
            labels=labels,
            value=0.0,
            threshold=1.0,
            unit="",
            for_seconds=self.config.for_seconds,
            summary=f"{device} is lost: {what}",
            description=(
                f"{device} is lost: {what} ({metric} = 0, expected 1). Everything running on it "
                f"has failed or will hang; it needs a GPU reset or a reboot. First: "
                f"`nvidia-smi` and `dmesg | grep -i -e xid -e 'fallen off' -e aer` for the "
                f"cause (Xid 79: fell off the bus), drain the host, then reset or reboot; "
                f"repeated losses mean the card, riser, power or cooling needs service."),
            details=details,
        )
