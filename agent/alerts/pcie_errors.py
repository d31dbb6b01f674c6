"""GpuPcieReplayErrors and PcieAerErrors: a PCIe link that corrupts packets. Replays above DCGM's
bit-error-rate bound for the current link, any new uncorrectable AER error (critical), or correctable
AER errors that keep coming (warning). A marginal slot, riser or card costs bandwidth now and often
ends in a downtrained link or a GPU lost from the bus. Runbooks: GpuPcieReplayErrors.md,
PcieAerErrors.md.
"""
from __future__ import annotations

from textwrap import dedent

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import common, windows
from hybridmon.agent.detectors.base import DetectorBase, Finding, HistoryReader
from hybridmon.exporters.gpu import GPU_INFO, PCIE_LINK_GENERATION, PCIE_LINK_WIDTH, PCIE_REPLAYS
from hybridmon.exporters.pcie import AER_ERRORS
from hybridmon.pcie_rates import LANE_LINE_RATE_BITS_PER_SECOND, replay_bound_per_minute
from hybridmon.rules import groups
from hybridmon.rules import pcie as recorded
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import duration, gpu_query, number
from hybridmon.rules.templates import humanize

INPUTS = (PCIE_REPLAYS, PCIE_LINK_GENERATION, PCIE_LINK_WIDTH, AER_ERRORS, GPU_INFO)
# AER severities that lose transactions; the kernel's third class, correctable, is retried.
UNCORRECTABLE = ("nonfatal", "fatal")
# The AER collector's `severity` label would clash with the alert's own severity: it is renamed.
AER_SEVERITY_LABEL = '"aer_severity", "$1", "severity", "(.*)"'


class Settings(Section):
    bit_error_rate: float
    window_seconds: float
    aer_correctable_per_hour: float
    aer_uncorrectable_any: bool


def replay_rate_record(e: Settings) -> str:
    """The group's shared recording of the replay rate over this section's window."""
    return recorded.replay_rate_record(e.window_seconds)


def link_replay_bound(bit_error_rate: float, generation: float, lanes: float) -> float | None:
    """DCGM's bound for the current link in replays per minute (hybridmon.pcie_rates, the number
    the rule's recording computes); None for a generation the tables lack or a link without lanes."""
    known = int(round(generation))
    if known not in LANE_LINE_RATE_BITS_PER_SECOND or lanes <= 0:
        return None
    return float(replay_bound_per_minute(bit_error_rate, known, lanes))  # type: ignore[arg-type]


def replay_alert(e: Settings) -> Alert:
    window = duration(e.window_seconds)
    return Alert(
        "GpuPcieReplayErrors",
        f"{replay_rate_record(e)} * 60 > {recorded.REPLAY_BOUND}",
        0, "warning",
        "GPU <gpu> on <instance>: <value|humanize> PCIe replays per minute, above DCGM's bound of "
        "<bound|humanize> for its Gen<gen> x<width> link",
        f"GPU <gpu> (<uuid>) resent <value|humanize> PCIe packets per minute over the last {window}. "
        "DCGM's health watch allows ceil(bit error rate x line rate x 60 x lanes) per minute; at a "
        f"bit error rate of {e.bit_error_rate!r} that threshold is <bound|humanize> per minute on "
        "its current Gen<gen> x<width> link. Each replay is a corrupted packet sent again: a marginal slot, "
        "riser or card that costs bandwidth now and often ends in a downtrained link or a GPU "
        "lost from the bus. Check the replay counter and link (nvidia-smi -q -d PCIE), the AER "
        "counters and the kernel log for the same device (dmesg | grep -i -e aer -e xid), then "
        "reseat the GPU or riser.",
        queries={
            "bound": gpu_query("{}", recorded.REPLAY_BOUND),
            "gen": gpu_query("{}", PCIE_LINK_GENERATION.name),
            "width": gpu_query("{}", PCIE_LINK_WIDTH.name),
        },
    )


def aer_uncorrectable_alert(e: Settings) -> Alert:
    window = duration(e.window_seconds)
    return Alert(
        "PcieAerErrors",
        dedent(f"""\
            label_replace(
              increase({AER_ERRORS.name}{{severity=~"{'|'.join(UNCORRECTABLE)}"}}[{window}]) > 0,
              {AER_SEVERITY_LABEL}
            )"""),
        0, "critical",
        "PCIe device <pci_bus_id> on <instance>: <value|humanize> new <aer_severity> AER errors",
        f"The PCIe function <pci_bus_id> reported <value|humanize> uncorrectable "
        f"(<aer_severity>) AER errors in the last {window} (threshold: any). Uncorrectable "
        "errors lose or corrupt transactions: the driver may reset the GPU, in-flight requests "
        "fail or hang, and a fatal error can take the device off the bus. Read the kernel log for "
        "this device's AER and Xid messages (dmesg | grep -i -e aer -e xid) and its link state "
        "(nvidia-smi -q -d PCIE), drain the host, and reseat or replace the riser or card.",
    )


def aer_correctable_alert(e: Settings) -> Alert:
    window = duration(e.window_seconds)
    return Alert(
        "PcieAerErrors",
        dedent(f"""\
            label_replace(
              rate({AER_ERRORS.name}{{severity="correctable"}}[{window}]) * 3600
                > {number(e.aer_correctable_per_hour)},
              {AER_SEVERITY_LABEL}
            )"""),
        0, "warning",
        "PCIe device <pci_bus_id> on <instance>: <value|humanize> correctable AER errors per hour",
        f"The PCIe function <pci_bus_id> reported correctable AER errors at <value|humanize> per "
        f"hour over the last {window} (threshold {humanize(e.aer_correctable_per_hour)} per hour). "
        "The link corrects them by retrying, but a steady stream means a marginal link that loses "
        "bandwidth and often goes on to downtrain or to raise uncorrectable errors. Check the "
        "link's state (lspci -vvv -s <pci_bus_id>: LnkSta) and the kernel log (dmesg | grep -i aer: "
        "which device, which error), and plan to reseat the card or riser at the next maintenance "
        "window.",
    )


def alerts(e: Settings) -> list[Alert]:
    """In the rule file's order; the critical AER rule only where any uncorrectable error counts."""
    return [replay_alert(e), *([aer_uncorrectable_alert(e)] if e.aer_uncorrectable_any else []),
            aer_correctable_alert(e)]


class Detector(DetectorBase):
    """GpuPcieReplayErrors: replays per minute, rate over window_seconds, above the DCGM bound of
    the current link (current generation and width). PcieAerErrors: critical for any increase of
    a nonfatal or fatal AER counter over window_seconds (only when aer_uncorrectable_any, as in
    the generated rule), warning when correctable errors arrive faster than
    aer_correctable_per_hour (rate over window_seconds)."""

    name = "pcie_errors"
    alertnames = ("GpuPcieReplayErrors", "PcieAerErrors")

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.min_history_seconds = config.window_seconds
        self.replays = replay_alert(config)
        self.uncorrectable = aer_uncorrectable_alert(config)
        self.correctable = aer_correctable_alert(config)

    def evaluate(self, history: HistoryReader, now: float) -> list[Finding]:
        return self._replays(history, now) + self._aer(history, now)

    def _replays(self, history: HistoryReader, now: float) -> list[Finding]:
        generation = common.gpu_latest(history, PCIE_LINK_GENERATION.name, now)
        width = common.gpu_latest(history, PCIE_LINK_WIDTH.name, now)
        findings = []
        series_by_gpu = windows.by_labels(history.series(PCIE_REPLAYS.name), *common.GPU_LABELS)
        for key, series in sorted(series_by_gpu.items()):
            per_second = windows.rate(series, now, self.config.window_seconds)
            if per_second is None or key not in generation or key not in width:
                continue
            bound = link_replay_bound(self.config.bit_error_rate, generation[key], width[key])
            per_minute = per_second * 60
            if bound is None or per_minute <= bound:
                continue
            findings.append(finding(
                self.replays, common.gpu_entity(key), per_minute, bound, unit="replays/min",
                values={"bound": bound, "gen": generation[key], "width": width[key]},
                details={"link_generation": generation[key], "link_width_lanes": width[key],
                         "window_seconds": self.config.window_seconds}))
        return findings

    def _aer(self, history: HistoryReader, now: float) -> list[Finding]:
        gpus = common.gpus_by_bus_id(history)
        findings = []
        per_hour_limit = self.config.aer_correctable_per_hour
        for series in sorted(history.series(AER_ERRORS.name),
                             key=lambda s: (s.labels["pci_bus_id"], s.labels["severity"])):
            bus_id, aer_class = series.labels["pci_bus_id"], series.labels["severity"]
            labels = {"pci_bus_id": bus_id, "aer_severity": aer_class}
            # The rule cannot name the GPU behind a bus id; the agent keeps it in the details.
            gpu = gpus.get(bus_id.lower(), {})
            details: dict[str, float | str] = {"window_seconds": self.config.window_seconds}
            if gpu:
                details.update(gpu=gpu["gpu"], uuid=gpu.get("uuid", ""))
            if aer_class in UNCORRECTABLE:
                if not self.config.aer_uncorrectable_any:
                    continue
                new = windows.increase(series, now, self.config.window_seconds)
                if new is None or new <= 0:
                    continue
                findings.append(finding(self.uncorrectable, labels, new, 0.0, unit="errors",
                                        details=details))
                continue
            per_second = windows.rate(series, now, self.config.window_seconds)
            if per_second is None or per_second * 3600 <= per_hour_limit:
                continue
            findings.append(finding(self.correctable, labels, per_second * 3600, per_hour_limit,
                                    unit="errors/h", details=details))
        return findings


FAMILY = AlertFamily(
    section="pcie_errors",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group=groups.PCIE,
    detector=Detector,
    alerts=lambda t: tuple(alerts(t.pcie_errors)),
    collectors=("gpu",),
    lookback_seconds=lambda settings: settings.window_seconds,
    scenario="pcie_errors",
)
