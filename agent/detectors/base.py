"""What a detector is, what it returns, and the thresholds it reads.

A detector is a pure function of the agent's history at a moment: `evaluate(history, now)` returns
the findings whose condition holds *now*, each with the `for_seconds` it must hold before it fires.
The engine (engine.py) keeps them pending and fires them, exactly as Prometheus handles an alert
rule's `for`, so an in-agent finding and its Prometheus rule fire at about the same time.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from hybridmon.agent.history import History

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

Severity = Literal["info", "warning", "critical"]
DEFAULT_THRESHOLDS_FILE = Path(__file__).with_name("thresholds.toml")


@dataclass(frozen=True)
class Finding:
    """One thing wrong with the host, about one entity (a GPU, a process, the host)."""

    alertname: str
    severity: Severity
    labels: dict[str, str]          # the entity: gpu, uuid, pid, process_name, pci_bus_id, node...
    value: float                    # the measured value the threshold was compared with
    threshold: float
    summary: str                    # one line, value and entity filled in
    description: str                # why it matters and what was seen, value and threshold filled in
    for_seconds: float = 0.0        # how long the condition must hold before the finding fires
    unit: str = ""                  # unit of value and threshold, for display ("B/s", "ratio", "s")
    details: dict[str, float | str] = field(default_factory=dict)  # extra figures (slope, forecast)
    # What filled the summary's and description's markers (labels, value, the rule's query names):
    # the same text rendered by Prometheus from the same values reads the same (agent/alerts).
    values: dict[str, float | str] = field(default_factory=dict, compare=False)

    @property
    def key(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        return self.alertname, tuple(sorted(self.labels.items()))


class Detector(Protocol):
    name: str                       # section name in thresholds.toml
    alertnames: tuple[str, ...]     # every alertname it can return (one runbook each)

    def evaluate(self, history: History, now: float) -> list[Finding]: ...


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PcieStarvation(_Section):
    traffic_share_of_capacity: float
    gpu_utilization_at_most: float
    for_seconds: float


class PcieLinkDegraded(_Section):
    busy_utilization_at_least: float
    for_seconds: float


class PcieErrors(_Section):
    bit_error_rate: float
    window_seconds: float
    aer_correctable_per_hour: float
    aer_uncorrectable_any: bool


class GpuLost(_Section):
    for_seconds: float


class SwapThrash(_Section):
    swap_in_bytes_per_second: float
    swap_out_bytes_per_second: float
    major_faults_per_second: float
    memory_pressure_some_ratio: float
    for_seconds: float
    process_swap_bytes: float
    process_major_faults_per_second: float


class MemoryGrowth(_Section):
    window_seconds: float
    min_window_seconds: float
    growth_per_hour_share: float
    load_flat_per_hour_share: float
    exhaustion_horizon_seconds: float


class NumaMisplacement(_Section):
    share_off_gpu_node: float
    for_seconds: float


class GpuMemoryHeadroom(_Section):
    used_share: float
    for_seconds: float
    forecast_horizon_seconds: float
    trend_window_seconds: float


class PcieBandwidthLow(_Section):
    floor_share_gen4: float
    floor_share_gen5: float
    floor_share_other: float

    def floor_share(self, generation: float) -> float:
        """The share of the theoretical rate below which a measurement counts as low."""
        return {4: self.floor_share_gen4, 5: self.floor_share_gen5}.get(
            int(round(generation)), self.floor_share_other)


class ThroughputDecay(_Section):
    decay_share: float
    window_seconds: float
    baseline_seconds: float
    recent_seconds: float
    min_requests_running: float
    load_kept_share: float
    host_signal_moved_share: float
    for_seconds: float

    @model_validator(mode="after")
    def _windows_apart(self) -> "ThroughputDecay":
        if self.baseline_seconds + self.recent_seconds > self.window_seconds:
            raise ValueError("baseline_seconds + recent_seconds must fit in window_seconds: the "
                             "baseline and the recent window must not overlap")
        return self

    @property
    def baseline_offset_seconds(self) -> float:
        """How far back the baseline window ends: it is the earliest part of the long window."""
        return self.window_seconds - self.baseline_seconds


class KvOffloadPressure(_Section):
    kv_cache_usage_at_least: float
    preemptions_per_second_above: float
    offload_load_share_of_capacity: float
    for_seconds: float


class InferenceScrape(_Section):
    for_seconds: float


class AlertDelivery(_Section):
    for_seconds: float


class HostConfig(_Section):
    max_swappiness_with_swap: int
    max_dirty_ratio: int
    min_memlock_bytes: float
    min_available_share_without_swap: float


class Thresholds(_Section):
    pcie_starvation: PcieStarvation
    pcie_link_degraded: PcieLinkDegraded
    pcie_errors: PcieErrors
    gpu_lost: GpuLost
    swap_thrash: SwapThrash
    memory_growth: MemoryGrowth
    numa_misplacement: NumaMisplacement
    gpu_memory_headroom: GpuMemoryHeadroom
    host_config: HostConfig
    pcie_bandwidth_low: PcieBandwidthLow
    throughput_decay: ThroughputDecay
    kv_offload_pressure: KvOffloadPressure
    inference_scrape: InferenceScrape
    alert_delivery: AlertDelivery


class ThresholdsError(Exception):
    """The thresholds file is unusable; the message names the file and key."""


def load_thresholds(path: str | Path | None = None) -> Thresholds:
    path = Path(path) if path else DEFAULT_THRESHOLDS_FILE
    try:
        with path.open("rb") as handle:
            raw = tomllib.load(handle)
    except OSError as error:
        raise ThresholdsError(f"thresholds file {path} cannot be read: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ThresholdsError(f"thresholds file {path} is not valid TOML: {error}") from None
    try:
        return Thresholds.model_validate(raw)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()
        )
        raise ThresholdsError(f"thresholds file {path}: {problems}") from None
