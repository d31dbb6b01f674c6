"""InferenceServerScrapeFailing: an inference server's /metrics (or Ollama's /api/ps) cannot be read,
so its tokens/s, latency and KV cache figures are missing from every finding and dashboard.
Runbook: InferenceServerScrapeFailing.md (the first check for each reason).
"""
from __future__ import annotations

from hybridmon.agent.alerts.family import AlertFamily, Section, finding
from hybridmon.agent.detectors import windows
from hybridmon.agent.detectors.base import DetectorBase, Finding, HistoryReader
from hybridmon.agent.loop.history import SeriesHistory
from hybridmon.exporters.inference_names import SCRAPE_ERROR, SCRAPE_REASONS, SCRAPE_SUCCESS
from hybridmon.rules import groups
from hybridmon.rules.model import Alert
from hybridmon.rules.promql import duration

INPUTS = (SCRAPE_SUCCESS, SCRAPE_ERROR)
# Why a scrape failed (the reason label of the scrape-error series), in words, and the first
# check; the status page prints the words, the runbook has the same table.
class Settings(Section):
    for_seconds: float


def alert(s: Settings) -> Alert:
    wait = duration(s.for_seconds)
    return Alert(
        "InferenceServerScrapeFailing",
        f"{SCRAPE_ERROR.name} > 0",
        s.for_seconds, "warning",
        "Inference server at <endpoint> on <instance> cannot be read: <reason>",
        f"Every scrape of the inference server at <endpoint> failed with reason <reason> for {wait} "
        f"(threshold: {wait}): timeout, refused, connection, http_status, too_large, not_prometheus "
        "(an HTML page), not_json, unknown_server or missing_families (its metric names changed). "
        "The server is down or failing, or its metrics are: its tokens/s, latency and KV cache "
        "figures are missing from every finding and dashboard until it answers. The runbook has "
        "the first check for each reason.",
    )


def _last_time(series: SeriesHistory, now: float) -> float | None:
    """Time of the series' last point at most a minute before `now`."""
    times, _ = windows.window(series, now, windows.INSTANT_LOOKBACK_SECONDS)
    return times[-1] if times else None


class Detector(DetectorBase):
    """InferenceServerScrapeFailing, per endpoint and reason, warning: the endpoint's last scrape
    failed (its scrape-error series is present in the collector's latest run)."""

    name = "inference_scrape"
    alertnames = ("InferenceServerScrapeFailing",)

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.alert = alert(config)

    def evaluate(self, history: HistoryReader, now: float) -> list[Finding]:
        last_scrape = {series.labels["endpoint"]: _last_time(series, now)
                       for series in history.series(SCRAPE_SUCCESS.name)}
        findings = []
        for series in sorted(history.series(SCRAPE_ERROR.name),
                             key=lambda s: (s.labels["endpoint"], s.labels["reason"])):
            endpoint, reason = series.labels["endpoint"], series.labels["reason"]
            # In the endpoint's latest scrape, as Prometheus sees a series until it goes stale.
            at = _last_time(series, now)
            if at is not None and last_scrape.get(endpoint) == at:
                meaning, first_check = SCRAPE_REASONS.get(reason, ("", ""))
                # What the reason means and the first thing to check: more than the one text can
                # say per reason (the runbook has the same table).
                findings.append(finding(self.alert, {"endpoint": endpoint, "reason": reason}, 1.0, 1.0,
                                        details={"reason": reason, "meaning": meaning,
                                                 "first_check": first_check}))
        return findings


FAMILY = AlertFamily(
    section="inference_scrape",
    settings=Settings,
    inputs=INPUTS,
    alertnames=Detector.alertnames,
    group=groups.INFERENCE,
    detector=Detector,
    alerts=lambda t: (alert(t.inference_scrape),),
    collectors=(),
    lookback_seconds=lambda settings: 0.0,
    scenario="inference_server_down",
)
