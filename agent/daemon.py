"""The agent assembled: collectors, history, sampler and exposition, in one of three modes.

live:   collectors read the host.
record: the same, and every reading goes to a trace file.
replay: collectors read a trace instead of the host; after its last record the state stays served.
"""
from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path

from pydantic import ValidationError

from hybridmon.agent.publish.alertmanager import AlertmanagerCollector, AlertmanagerPusher
from hybridmon.agent.publish.push_credentials import PushCredentials
from hybridmon.agent.config import AgentConfig, parse_listen
from hybridmon.agent.alerts.catalogue import load_thresholds
from hybridmon.agent.detectors.engine import COARSE_STEP_SECONDS, FULL_RESOLUTION_SECONDS, Engine
from hybridmon.agent.alerts.catalogue import all_detectors, lookback_seconds
from hybridmon.agent.publish.exposition import Exposition
from hybridmon.agent.publish.findings import FindingsCollector
from hybridmon.agent.loop.history import History
from hybridmon.agent.loop.sampler import Sampler
from hybridmon.exporters.sources import LiveSource, RecordingSource, ReplaySource
from hybridmon.agent.loop.trace import TraceError, TraceReader, TraceWriter
from hybridmon.agent.loop.wiring import build_collectors
from hybridmon.exporters.base import LogOnce

LATE_EVALUATION_SECONDS = 60.0
log = logging.getLogger(__name__)
# Longest pause between two trace records that a replay waits out (recorded seconds).
MAX_REPLAY_GAP_SECONDS = 60.0


class Agent:
    def __init__(
        self,
        config: AgentConfig,
        record_to: str | Path | None = None,
        replay_from: str | Path | None = None,
        every_tick_history: bool = False,
        serves_https: bool = False,
    ) -> None:
        """`every_tick_history`: keep every tick for the whole of history_seconds instead of the
        two tiers the detectors need (agent/loop/history.py), for a replay read as a record of what was
        sampled (the scenario tests); 2 h at 1 s of an 8-GPU host then takes ~6x the memory.
        `serves_https`: the web config file turns TLS on, so the agent's own runbook links say https."""
        if record_to and replay_from:
            raise ValueError("record and replay cannot be combined")
        self.config = config
        self.replay_finished = threading.Event()
        self._recorder: TraceWriter | None = None
        self._reader: TraceReader | None = None
        if replay_from:
            self.mode = "replay"
            self._reader = TraceReader(replay_from)
            collector_config = _config_from_trace(self._reader, config)
            scheduled = build_collectors(collector_config, lambda _name: ReplaySource(), replay=True)
        elif record_to:
            self.mode = "record"
            scheduled = build_collectors(config, lambda _name: RecordingSource())
            # Alerting settings name credential files and are not needed to replay.
            self._recorder = TraceWriter(record_to, config.model_dump(mode="json", exclude={"alerting"}))
        else:
            self.mode = "live"
            live = LiveSource()
            scheduled = build_collectors(config, lambda _name: live)
        # Every tick for what the detectors read at full resolution, plus a minute for an
        # evaluation that runs late; one per coarse step, as they read it, before that.
        self.history = History(config.history_seconds,
                               None if every_tick_history else FULL_RESOLUTION_SECONDS + LATE_EVALUATION_SECONDS,
                               COARSE_STEP_SECONDS)
        self.sampler = Sampler(scheduled, self.history, config.interval_seconds, recorder=self._recorder)
        self.exposition = Exposition(self.history, self.sampler, self.mode)
        self.thresholds = load_thresholds(config.detectors.thresholds_file)
        self.exposition.hung_seconds = self.thresholds.collector_failing.hung_seconds
        self.engine = Engine(all_detectors(self.thresholds), self.history,
                             lookback_seconds=lookback_seconds(self.thresholds))
        self.exposition.health_registry.register(FindingsCollector(self.engine))
        self.runbook_base_url = config.alerting.runbook_base_url or default_runbook_base_url(
            config.listen, "https" if serves_https else "http")
        self._last_evaluation: float | None = None
        self._evaluation_lock = threading.Lock()
        if config.detectors.enabled:
            self.sampler.on_commit.append(self._maybe_evaluate)
            self.sampler.on_clock_step.append(self._follow_clock_step)
        self.pusher: AlertmanagerPusher | None = None
        if config.alerting.alertmanager_urls and self.mode != "record":
            self.pusher = AlertmanagerPusher(
                self.engine, list(config.alerting.alertmanager_urls), self.runbook_base_url,
                interval_seconds=config.alerting.push_interval_seconds,
                timeout_seconds=config.alerting.push_timeout_seconds,
                extra_labels={"host": socket.gethostname(), **config.alerting.labels},
                # the files are read here, at start: one that cannot be used is a ConfigError (exit 78)
                credentials=PushCredentials(config.alerting.http_config),
            )
            self.exposition.health_registry.register(AlertmanagerCollector(self.pusher))
        # Detectors that judge the agent itself (its alert delivery, its collectors) read its parts,
        # not the host's history: each is handed the agent once, here.
        for detector in self.engine.detectors:
            detector.attach(self)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _maybe_evaluate(self, at: float) -> None:
        """Evaluate the detectors at most once per evaluation interval of sample time (recorded
        time in a replay, so a replayed incident raises its findings at the recorded moments)."""
        if not self._evaluation_lock.acquire(blocking=False):
            return
        try:
            interval = self.config.detectors.evaluation_interval_seconds
            if self._last_evaluation is not None and at - self._last_evaluation < interval:
                return
            self._last_evaluation = at
            self.engine.evaluate(at)
            # The findings change here only: rendered now, in this thread, not by the next scrape.
            self.exposition.prepare()
        finally:
            self._evaluation_lock.release()

    def _follow_clock_step(self, step: float) -> None:
        """The wall clock stepped by `step` seconds (the sampler saw it, and moved the history):
        the findings' times and the last evaluation's move too, so a pending finding waits its
        `for` from when it began, and evaluations go on at once after a step back."""
        with self._evaluation_lock:
            self.engine.move_times(step)
            if self._last_evaluation is not None:
                self._last_evaluation += step

    def start(self, replay_speed: float = 1.0) -> None:
        """Start sampling (or replaying) in a background thread."""
        if self._reader is not None:
            target, args = self.replay, (replay_speed,)
        else:
            target, args = self.sampler.run_forever, ()
        self._thread = threading.Thread(target=target, args=args, name="sampler", daemon=True)
        self._thread.start()
        if self.pusher is not None:
            self.pusher.start()

    def replay(self, speed: float = 1.0) -> int:
        """Feed the trace's records through the collectors, pacing by recorded time / speed.

        speed 0 means as fast as possible. Returns the number of records replayed.
        """
        assert self._reader is not None
        by_name = {item.collector.name: item for item in self.sampler.scheduled}
        warn_once = LogOnce(log)
        previous_time = None
        replayed = 0
        try:
            for record in self._reader.records():
                if self._stop.is_set():
                    break
                item = by_name.get(record.collector)
                if item is None:
                    warn_once(record.collector, "trace has readings of collector %r, which this replay does not run", record.collector)
                    continue
                if speed > 0 and previous_time is not None and record.time > previous_time:
                    gap = record.time - previous_time
                    if gap > MAX_REPLAY_GAP_SECONDS:
                        # A recording never pauses that long (collectors run every few seconds):
                        # a trace that says so would make the replay sleep for years.
                        warn_once("gap", "trace jumps %.0f s ahead at %.0f; replaying such gaps as %.0f s",
                                  gap, record.time, MAX_REPLAY_GAP_SECONDS)
                        gap = MAX_REPLAY_GAP_SECONDS
                    if self._stop.wait(gap / speed):
                        break
                previous_time = record.time
                item.source.load(record.readings)
                self.sampler.run_collector(item, at=record.time)
                replayed += 1
        except TraceError as error:
            log.error("replay stopped: %s", error)
        log.info("replay finished after %d records; serving the last state until stopped", replayed)
        self.replay_finished.set()
        return replayed

    def stop(self, timeout: float = 5.0) -> list[str]:
        """Stop sampling and close what can be closed; returns the collectors that hung.

        A hung collector's thread cannot be interrupted (e.g. inside an NVML call); the caller
        should then leave the process with os._exit, since Python would wait for that thread.
        """
        self._stop.set()
        if self.pusher is not None:
            self.pusher.stop()
        hung = self.sampler.stop(timeout)
        if hung:
            log.warning("collectors still running at shutdown, abandoned: %s", ", ".join(hung))
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        self.sampler.close_collectors(skip=hung)
        if self._recorder is not None:
            self._recorder.close()
        # The last line of a shutdown: after the server's lines and the collectors'.
        log.info("stopped%s", f" ({len(hung)} hung collectors abandoned)" if hung else "")
        return hung

    @property
    def recording_error(self) -> str | None:
        return self._recorder.error if self._recorder is not None else None


def default_runbook_base_url(listen: str, scheme: str = "http") -> str:
    """This agent's own /runbooks. A wildcard listen address (0.0.0.0, ::) is no place a reader
    of an alert can open, so the host's name stands in for it."""
    host, port = parse_listen(listen)
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn() or socket.gethostname()
    elif ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}/runbooks"


def _config_from_trace(reader: TraceReader, current: AgentConfig) -> AgentConfig:
    """The collectors are rebuilt exactly as recorded; listening and logging stay as given now."""
    recorded = dict(reader.config)
    recorded.update(
        listen=current.listen, log_level=current.log_level, log_format=current.log_format,
        history_seconds=current.history_seconds,
        detectors=current.detectors.model_dump(), alerting=current.alerting.model_dump(),
    )
    try:
        return AgentConfig.model_validate(recorded)
    except ValidationError as error:
        raise TraceError(f"{reader.path}: the recorded configuration is not valid: {error}") from None
