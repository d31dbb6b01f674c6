"""Direct pushes to Alertmanager's v2 API, for a single host with no Prometheus.

Like Prometheus, the agent re-sends every firing alert on an interval with endsAt a few intervals
ahead, so Alertmanager resolves it by itself if the agent dies, and sends a resolved alert with its
real endsAt a few times after it resolves. Failures are logged once per URL and counted; the queue
is the engine's state, so a long outage loses nothing that is still true.
"""
from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from typing import Callable
from urllib.parse import urlsplit

from agent.detectors.engine import Engine, FindingState
from agent.findings import finding_labels, iso_time, runbook_url
from exporters.base import LogOnce

log = logging.getLogger(__name__)
# endsAt of a firing alert: this many push intervals ahead (Prometheus uses 4 x its resend delay).
ENDS_AT_INTERVALS = 4


class AlertmanagerPusher:
    def __init__(
        self,
        engine: Engine,
        urls: list[str],
        runbook_base_url: str,
        interval_seconds: float = 30.0,
        timeout_seconds: float = 5.0,
        extra_labels: dict[str, str] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.engine = engine
        self.urls = [url.rstrip("/") + "/api/v2/alerts" for url in urls]
        self.runbook_base_url = runbook_base_url
        self.interval_seconds = interval_seconds
        self.timeout_seconds = timeout_seconds
        self.extra_labels = extra_labels or {}
        self.clock = clock or engine.clock
        self.pushes = 0
        self.errors: dict[str, int] = {self._name(url): 0 for url in self.urls}
        self._log_once = LogOnce(log)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        engine.on_change.append(lambda _state, _change: self._wake.set())

    @staticmethod
    def _name(url: str) -> str:
        """host:port only: a URL may carry credentials that must not reach labels or logs."""
        return urlsplit(url).netloc.rsplit("@", 1)[-1]

    def alerts(self, now: float) -> list[dict]:
        """The v2 payload: every firing finding, and every resolved one still retained."""
        payload = []
        for state in self.engine.firing() + self.engine.resolved():
            payload.append(self._alert(state, now))
        return payload

    def _alert(self, state: FindingState, now: float) -> dict:
        finding = state.finding
        ends_at = state.ends_at if state.ends_at is not None else now + ENDS_AT_INTERVALS * self.interval_seconds
        return {
            "labels": {**self.extra_labels, **finding_labels(state)},
            "annotations": {
                "summary": finding.summary,
                "description": finding.description,
                "runbook_url": runbook_url(self.runbook_base_url, finding.alertname),
            },
            "startsAt": iso_time(state.starts_at),
            "endsAt": iso_time(ends_at),
            "generatorURL": runbook_url(self.runbook_base_url, finding.alertname),
        }

    def push_once(self) -> int:
        """Send the current alerts to every URL; returns how many URLs accepted them."""
        alerts = self.alerts(self.clock())
        if not alerts:
            return 0
        body = json.dumps(alerts).encode()
        accepted = 0
        for url in self.urls:
            request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_seconds) as response:
                    response.read()
                accepted += 1
            except (urllib.error.URLError, OSError, ValueError) as error:
                name = self._name(url)
                self.errors[name] = self.errors.get(name, 0) + 1
                self._log_once(f"push:{name}", "cannot push alerts to Alertmanager at %s: %s (retrying every %.0f s; further failures are counted, not logged)", name, error, self.interval_seconds)
        self.pushes += 1
        return accepted

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="alertmanager-push", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.push_once()
            # A change (new firing or resolved finding) is pushed at once, the rest on the interval.
            self._wake.wait(self.interval_seconds)
            self._wake.clear()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_seconds + 1)
