"""GpuMemoryHeadroomLow: a GPU whose memory is nearly full, or will be within the horizon."""
from __future__ import annotations

from hybridmon.agent.detectors import common, windows
from hybridmon.agent.detectors.base import Finding, GpuMemoryHeadroom
from hybridmon.agent.detectors.memory import GPU_MEMORY_TOTAL, GPU_MEMORY_USED, GROWTH_TREND_POINTS
from hybridmon.agent.history import History


class GpuMemoryHeadroomDetector:
    """GpuMemoryHeadroomLow per GPU: reason=used when used/total (avg 1m each) >= used_share;
    reason=forecast when the Theil-Sen slope of used memory over trend_window_seconds (with at
    least half that window of data) is positive and reaches total within
    forecast_horizon_seconds. Both must hold for for_seconds."""

    name = "gpu_memory_headroom"
    alertnames = ("GpuMemoryHeadroomLow",)

    def __init__(self, config: GpuMemoryHeadroom) -> None:
        self.config = config
        # The 'used' half judges a minute; the forecast half checks its own span of data, so a
        # short `hybridmon check` still reports a full GPU.
        self.min_history_seconds = windows.AVERAGE_SECONDS

    def evaluate(self, history: History, now: float) -> list[Finding]:
        config = self.config
        totals = common.gpu_averages(history, GPU_MEMORY_TOTAL, now)
        used_series = windows.by_labels(history.series(GPU_MEMORY_USED), *common.GPU_LABELS)
        findings = []
        for key, series in sorted(used_series.items()):
            used = windows.avg_over_time(series, now)
            total = totals.get(key)
            if used is None or not total:
                continue
            share = used / total
            base = {"used_bytes": used, "total_bytes": total, "used_share": share}
            if share >= config.used_share:
                findings.append(self._finding(
                    key, "used", share, config.used_share, "ratio", base,
                    summary=f"GPU {key[0]} memory {common.percent(share)} full "
                            f"({common.human_bytes(used)} of {common.human_bytes(total)})",
                    seen=(f"GPU {key[0]} ({key[1]}) has {common.human_bytes(used)} of "
                          f"{common.human_bytes(total)} in use ({common.percent(share)}, last "
                          f"minute), at or above {common.percent(config.used_share)}.")))
            times, values = windows.window(series, now, config.trend_window_seconds)
            if len(times) < 2 or times[-1] - times[0] < config.trend_window_seconds / 2:
                continue
            slope = windows.theil_sen_slope(times, values, GROWTH_TREND_POINTS)
            if slope is None or slope <= 0:
                continue
            full_in = windows.seconds_until(used, slope, total)
            if full_in > config.forecast_horizon_seconds:
                continue
            details = dict(base, slope_bytes_per_second=slope, forecast_seconds_to_full=full_in)
            findings.append(self._finding(
                key, "forecast", full_in, config.forecast_horizon_seconds, "s", details,
                summary=f"GPU {key[0]} memory forecast full in {common.human_duration(full_in)} "
                        f"(growing {common.human_bytes(slope * 3600)}/h)",
                seen=(f"GPU {key[0]} ({key[1]}) memory grows by {common.human_bytes(slope * 3600)} "
                      f"per hour (Theil-Sen slope over the last "
                      f"{common.human_duration(times[-1] - times[0])}); at "
                      f"{common.human_bytes(used)} of {common.human_bytes(total)} it is full in "
                      f"{common.human_duration(full_in)}, within the "
                      f"{common.human_duration(config.forecast_horizon_seconds)} horizon.")))
        return findings

    def _finding(self, key, reason, value, threshold, unit, details, summary, seen) -> Finding:
        return Finding(
            alertname="GpuMemoryHeadroomLow",
            severity="warning",
            labels={**common.gpu_entity(key), "reason": reason},
            value=value,
            threshold=threshold,
            unit=unit,
            for_seconds=self.config.for_seconds,
            summary=summary,
            description=(
                f"{seen} A full GPU cannot grow the KV cache: requests are preempted, contexts "
                f"cut or the server fails allocations (CUDA out of memory). This is the point to "
                f"offload: move older KV blocks to host memory in tiers (quantized offload costs "
                f"accuracy, weight offload costs latency). First: `nvidia-smi "
                f"--query-compute-apps=pid,used_memory --format=csv` to see who holds it."),
            details=details,
        )
