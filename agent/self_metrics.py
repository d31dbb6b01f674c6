"""The agent's own series, declared in one place: its sampling loop and collectors, its history,
its build, its Alertmanager delivery and its findings. The exposition (agent/publish/exposition.py),
the Alertmanager pusher, the findings collector, the alert families that judge the agent itself,
the dashboards and docs/metrics.md all read them from here, so none of those imports another for
a name.
"""
from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from hybridmon.exporters.base import MetricSpec, Samples


def _spec(name: str, kind: str, documentation: str, *labels: str) -> MetricSpec:
    return MetricSpec(name, documentation, kind, labels)


# --- the sampling loop, its collectors and its history (agent/loop/) ---------------------------------
COLLECTOR_SUCCESS = _spec("hybridmon_collector_success", "gauge", "1 if the collector's last run succeeded (a source absent on this host counts as success).", "collector")
COLLECTOR_NO_DATA = _spec("hybridmon_collector_no_data", "gauge", "1 if the collector's source does not exist on this host; the agent log says why, once.", "collector")
COLLECTOR_DURATION = _spec("hybridmon_collector_duration_seconds", "gauge", "Wall time of the collector's last run, in seconds.", "collector")
COLLECTOR_RUNNING = _spec("hybridmon_collector_running_seconds", "gauge", "How long the collector's current run has taken so far, in seconds; 0 when idle. A growing value means a hung source (e.g. NVML after a GPU fell off the bus).", "collector")
COLLECTOR_LAST_ERROR = _spec("hybridmon_collector_last_error_timestamp_seconds", "gauge", "Unix time of the collector's last failure; absent if it never failed.", "collector")
COLLECTOR_ERRORS = _spec("hybridmon_collector_errors_total", "counter", "Failed runs of the collector since the agent started.", "collector")
COLLECTOR_RUNS = _spec("hybridmon_collector_runs_total", "counter", "Runs of the collector since the agent started.", "collector")
LOOP_LAG = _spec("hybridmon_loop_lag_seconds", "gauge", "How late the sampling loop's last tick started, in seconds.")
LOOP_MAX_LAG = _spec("hybridmon_loop_max_lag_seconds", "gauge", "The largest tick lag since the agent started, in seconds.")
LOOP_TICKS = _spec("hybridmon_loop_ticks_total", "counter", "Ticks of the sampling loop since the agent started.")
LOOP_SKIPPED = _spec("hybridmon_loop_skipped_ticks_total", "counter", "Ticks skipped because the loop fell a whole interval behind (an overloaded host).")
LOOP_SCHEDULED = _spec("hybridmon_loop_scheduled_ticks_total", "counter", "Ticks the loop's interval has scheduled since the loop started (seconds since then / interval_seconds, read at scrape time); absent in a replay and before the loop starts. rate(hybridmon_loop_ticks_total) / rate(this) is the share of its ticks the loop ran.")
HISTORY_SERIES = _spec("hybridmon_history_series", "gauge", "Series held in the in-memory history.")
BUILD_INFO = _spec("hybridmon_build_info", "gauge", "hybridmon's version and mode (live, record or replay); always 1.", "version", "mode")

# --- Alertmanager delivery (agent/publish/alertmanager.py) ----------------------------------------
ALERTMANAGER_ATTEMPTS = _spec("hybridmon_alertmanager_attempts_total", "counter", "Pushes of the current alerts to the Alertmanager (alerting.alertmanager_urls), retries included, since the agent started.", "alertmanager")
ALERTMANAGER_FAILURES = _spec("hybridmon_alertmanager_failures_total", "counter", "Failed pushes to the Alertmanager by reason: refused, connect, timeout, connection, protocol, too_large, http_4xx, http_5xx, http_other, unexpected. A reason appears at its first failure.", "alertmanager", "reason")
ALERTMANAGER_CONSECUTIVE_FAILURES = _spec("hybridmon_alertmanager_consecutive_failures", "gauge", "Pushes to the Alertmanager that failed since its last success; 0 while alerts reach it.", "alertmanager")
ALERTMANAGER_LAST_SUCCESS = _spec("hybridmon_alertmanager_last_success_timestamp_seconds", "gauge", "Unix time of the last push the Alertmanager accepted; absent until one is.", "alertmanager")
ALERTMANAGER_LOOP_RESTARTS = _spec("hybridmon_alertmanager_push_loop_restarts_total", "counter", "Restarts of the Alertmanager's delivery task after it raised (a bug: the agent log has the traceback).", "alertmanager")
ALERTMANAGER_METRICS = (ALERTMANAGER_ATTEMPTS, ALERTMANAGER_FAILURES, ALERTMANAGER_CONSECUTIVE_FAILURES, ALERTMANAGER_LAST_SUCCESS, ALERTMANAGER_LOOP_RESTARTS)

# --- findings and the detectors behind them (agent/publish/findings.py) ----------------------------
_ENTITY = "alertname, severity, and the entity: gpu, uuid, pid, process_name, pci_bus_id, ..."
FINDING_ACTIVE = MetricSpec("hybridmon_finding_active", f"1 for each finding firing now. Labels: {_ENTITY}.", "gauge")
FINDING_VALUE = MetricSpec("hybridmon_finding_value", "The measured value of each firing finding, in the unit of its threshold.", "gauge")
FINDING_THRESHOLD = MetricSpec("hybridmon_finding_threshold", "The threshold each firing finding's value was compared with.", "gauge")
DETECTOR_ERRORS = MetricSpec("hybridmon_detector_errors_total", "Evaluations in which the detector raised; its findings keep their state meanwhile.", "counter", ("detector",))
DETECTOR_EVALUATIONS = MetricSpec("hybridmon_detector_evaluations_total", "Evaluations of all detectors since the agent started.", "counter")
DETECTOR_DURATION = MetricSpec("hybridmon_detector_evaluation_duration_seconds", "Wall time of the last evaluation of all detectors.", "gauge")
# The account of the bus InferenceWeightsCrossingBus keeps (agent/alerts/weight_offload.py).
BUS_BYTES = MetricSpec(
    "hybridmon_pcie_bus_bytes_per_second",
    "Where each GPU's host<->device bytes went over the last minute, as the detectors attribute "
    "them (NVML's PCIe bytes by direction, split by cause): kv_offload (the KV bytes the servers "
    "on the GPU report moving: vLLM's offload connector, SGLang's HiCache, vLLM's HiSparse), "
    "weights (host-resident weights a server's command line configures, --cpu-offload-gb, at most "
    "what its forward passes read) and unattributed (the rest, never guessed; the status page "
    "lists what would attribute it). The causes of a direction add up to its traffic. Absent "
    "before the detectors' first evaluation and with them off.",
    "gauge", ("gpu", "uuid", "direction", "cause"))
FINDING_METRICS = (FINDING_ACTIVE, FINDING_VALUE, FINDING_THRESHOLD, DETECTOR_ERRORS, DETECTOR_EVALUATIONS,
                   DETECTOR_DURATION, BUS_BYTES)

# The agent itself, as docs/metrics.md lists it (the findings have their own section there).
SELF_METRICS = (
    COLLECTOR_SUCCESS, COLLECTOR_NO_DATA, COLLECTOR_DURATION, COLLECTOR_RUNNING, COLLECTOR_LAST_ERROR,
    COLLECTOR_ERRORS, COLLECTOR_RUNS, LOOP_LAG, LOOP_MAX_LAG, LOOP_TICKS, LOOP_SKIPPED, LOOP_SCHEDULED, HISTORY_SERIES,
    BUILD_INFO, *ALERTMANAGER_METRICS,
)


def families(samples: Samples, sort: bool) -> Iterator[Metric]:
    """Prometheus metric families from samples; sorted by name and labels when `sort`."""
    by_name: dict[str, Metric] = {}
    for sample in samples:
        spec = sample.spec
        family = by_name.get(spec.name)
        if family is None:
            kind = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
            family = by_name[spec.name] = kind(spec.name, spec.documentation, labels=spec.label_names)
        family.add_metric(sample.label_values, sample.value)
    names = sorted(by_name) if sort else list(by_name)
    for name in names:
        family = by_name[name]
        if sort:
            family.samples.sort(key=lambda s: tuple(s.labels.values()))
        yield family
