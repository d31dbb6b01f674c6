"""Direct pushes to Alertmanager's v2 API, for a single host with no Prometheus.

Like Prometheus, the agent re-sends every firing alert on an interval with endsAt a few intervals
ahead, so Alertmanager resolves it by itself if the agent dies, and sends a resolved alert with its
real endsAt a few times after it resolves. The queue is the engine's state, so a long outage loses
nothing that is still true.

Each Alertmanager is its own delivery task on one event loop (thread "alertmanager-push"), so a
slow, dripping or hostile one cannot delay the others:
- one deadline bounds a whole request (connect, send, headers and body), not each socket read;
- at most MAX_RESPONSE_BYTES of an answer are read (Alertmanager answers an empty body);
- every failure is caught, classified (REASONS) and counted, and retried with capped, jittered
  exponential backoff; the regular push resumes at the push interval after a success;
- a delivery task that raises anyway is restarted by its supervisor, and so is the event loop's
  thread, each restart counted (hybridmon_alertmanager_push_loop_restarts_total).
An empty alert list is pushed too: Alertmanager accepts it, and it shows a broken Alertmanager
before the first alert needs it.

Credentials and TLS come from [alerting.http_config] (agent/publish/push_credentials.py): each push
reads again the files that changed, a TLS change replaces the delivery task's HTTP client, and a
file that cannot be read fails that push only (reason "credentials").
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import threading
import time
from dataclasses import dataclass, field, replace
from email.utils import parsedate_to_datetime
from typing import Callable, Iterable
from urllib.parse import urlsplit

import httpx
from prometheus_client.core import Metric

from hybridmon.agent.detectors.engine import Engine, FindingState
from hybridmon.agent.config import HttpConfig
from hybridmon.agent.publish.findings import finding_labels, iso_time, runbook_url
from hybridmon.agent.publish.push_credentials import CredentialsUnreadable, PushCredentials
from hybridmon.agent.self_metrics import (ALERTMANAGER_ATTEMPTS, ALERTMANAGER_CONSECUTIVE_FAILURES,
                                          ALERTMANAGER_FAILURES, ALERTMANAGER_LAST_SUCCESS,
                                          ALERTMANAGER_LOOP_RESTARTS, families)
from hybridmon.exporters.base import Samples

log = logging.getLogger(__name__)
# endsAt of a firing alert: this many push intervals ahead (Prometheus uses 4 x its resend delay).
ENDS_AT_INTERVALS = 4
# Alertmanager answers a push with an empty body; anything longer than this is not its answer,
# and reading on would let an endless body fill the agent's memory.
MAX_RESPONSE_BYTES = 4096
# Retries after a failure wait 1 s, 2 s, 4 s ... (times a jitter factor in [0.5, 1)), at most one
# push interval, so an outage is retried promptly without hammering a struggling Alertmanager.
RETRY_FIRST_SECONDS = 1.0
# A supervisor that restarts a delivery task waits this long first, so a bug cannot spin a core.
RESTART_DELAY_SECONDS = 1.0
# An Alertmanager whose clock (its answer's Date header, whole seconds) differs from this host's by
# at least this much gets the alert times in its own clock: it judges endsAt by its clock, so an
# agent an hour behind sent alerts it resolved at once (issue 30). A skew smaller than this is
# harmless beside endsAt's ENDS_AT_INTERVALS push intervals; the Date header's own error is ~1 s.
CLOCK_SKEW_SECONDS = 30.0

# Failure reasons, the `reason` label of hybridmon_alertmanager_failures_total.
REASONS = {
    "refused": "the connection was refused (nothing listens on that port)",
    "connect": "the connection could not be made (DNS, no route, TLS handshake)",
    "timeout": "no complete answer within the request deadline (hung or dripping peer)",
    "connection": "the connection broke mid-request (reset, closed)",
    "protocol": "the answer was not valid HTTP or was cut short (garbage, truncated body)",
    "too_large": f"the answer's body was longer than {MAX_RESPONSE_BYTES} bytes (not an Alertmanager)",
    "credentials": "a file of alerting.http_config (password, token, certificate, key) cannot be read or used",
    "http_4xx": "Alertmanager refused the alerts (HTTP 4xx: bad payload, auth, wrong path)",
    "http_5xx": "Alertmanager failed (HTTP 5xx)",
    "http_other": "an unexpected HTTP status (1xx or 3xx redirect)",
    "unexpected": "an error the agent did not expect (logged with its traceback once)",
}


class PushFailed(Exception):
    """One push failed for `reason` (a key of REASONS); the message says what was seen."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class DeliveryState:
    """One Alertmanager's delivery record; read and written under AlertmanagerPusher._lock."""

    attempts: int = 0
    failures: int = 0
    failures_by_reason: dict[str, int] = field(default_factory=dict)
    consecutive_failures: int = 0
    last_success: float | None = None       # Unix time
    failing_since: float | None = None      # Unix time of the first failure after the last success
    last_error: str | None = None
    last_reason: str | None = None
    restarts: int = 0
    # seconds its clock is ahead of this host's, from its last answer's Date header; 0 until
    # one arrived, or while the skew is under CLOCK_SKEW_SECONDS
    clock_offset: float = 0.0


@dataclass(frozen=True)
class DeliveryFailure:
    """An Alertmanager the alerts are not reaching, for the HybridmonAlertDeliveryFailing detector."""

    alertmanager: str
    failing_since: float
    consecutive_failures: int
    reason: str
    error: str


class AlertmanagerPusher:
    """Pushes the engine's alerts to each Alertmanager on its own (see the module docstring) and
    keeps a delivery record per Alertmanager: health() for /healthz, failing() for the
    HybridmonAlertDeliveryFailing detector, AlertmanagerCollector for /metrics. Times in seconds."""

    def __init__(
        self,
        engine: Engine,
        urls: list[str],
        runbook_base_url: str,
        interval_seconds: float = 30.0,
        timeout_seconds: float = 10.0,
        extra_labels: dict[str, str] | None = None,
        clock: Callable[[], float] | None = None,
        credentials: PushCredentials | None = None,
    ) -> None:
        """`credentials`: from [alerting.http_config]; None: no authentication, the system's CAs."""
        self.engine = engine
        self.urls = [url.rstrip("/") + "/api/v2/alerts" for url in urls]
        self.runbook_base_url = runbook_base_url
        self.interval_seconds = interval_seconds
        # One deadline for a whole request; never longer than the interval it must fit in.
        self.timeout_seconds = min(timeout_seconds, interval_seconds)
        self.extra_labels = extra_labels or {}
        self.clock = clock or engine.clock
        self._lock = threading.Lock()
        self._states = {self._name(url): DeliveryState() for url in self.urls}
        self._unexpected_logged: set[str] = set()
        self.credentials = credentials or PushCredentials(HttpConfig())
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakes: dict[str, asyncio.Event] = {}
        self._stopped: asyncio.Event | None = None  # set in the loop's thread to end it
        self._thread: threading.Thread | None = None
        engine.on_change.append(lambda _state, _change: self._wake_all())

    @staticmethod
    def _name(url: str) -> str:
        """host:port only: a URL may carry credentials that must not reach labels or logs."""
        return urlsplit(url).netloc.rsplit("@", 1)[-1]

    # -- what is pushed ------------------------------------------------------------------------

    def alerts(self, now: float, clock_offset: float = 0.0) -> list[dict]:
        """The v2 payload: every firing finding, and every resolved one still retained; its times
        moved by `clock_offset` (the receiving Alertmanager's clock less this host's)."""
        return [self._alert(state, now, clock_offset) for state in self.engine.firing() + self.engine.resolved()]

    def _alert(self, state: FindingState, now: float, clock_offset: float = 0.0) -> dict:
        finding = state.finding
        # never after now, nor endsAt before startsAt: Alertmanager answers 400 to the whole push
        starts_at = min(state.starts_at if state.starts_at is not None else now, now)
        ends_at = state.ends_at if state.ends_at is not None else now + ENDS_AT_INTERVALS * self.interval_seconds
        ends_at = max(ends_at, starts_at)
        return {
            "labels": {**self.extra_labels, **finding_labels(state)},
            "annotations": {
                "summary": finding.summary,
                "description": finding.description,
                "runbook_url": runbook_url(self.runbook_base_url, finding.alertname),
            },
            "startsAt": iso_time(starts_at + clock_offset),
            "endsAt": iso_time(ends_at + clock_offset),
            "generatorURL": runbook_url(self.runbook_base_url, finding.alertname),
        }

    # -- what is known about delivery ------------------------------------------------------------

    def health(self) -> dict[str, dict]:
        """Per Alertmanager (host:port, never credentials): attempts, failures (total and by
        reason), consecutive failures, last success and the time failures began (ISO 8601 UTC or
        None), the last error and the delivery task's restarts. For /healthz."""
        with self._lock:
            return {name: {
                "attempts": s.attempts,
                "failures": s.failures,
                "failures_by_reason": dict(s.failures_by_reason),
                "consecutive_failures": s.consecutive_failures,
                "last_success": iso_time(s.last_success) if s.last_success is not None else None,
                "failing_since": iso_time(s.failing_since) if s.failing_since is not None else None,
                "last_error": s.last_error,
                "restarts": s.restarts,
                "clock_offset_seconds": s.clock_offset,
            } for name, s in self._states.items()}

    def delivery_records(self) -> list[tuple[str, DeliveryState]]:
        """A copy of each Alertmanager's delivery record, by host:port, for the self metrics."""
        with self._lock:
            return [(name, replace(state, failures_by_reason=dict(state.failures_by_reason)))
                    for name, state in sorted(self._states.items())]

    def failing(self) -> list[DeliveryFailure]:
        """The Alertmanagers whose latest push failed, for the HybridmonAlertDeliveryFailing detector."""
        with self._lock:
            return [DeliveryFailure(name, s.failing_since, s.consecutive_failures, s.last_reason or "unexpected",
                                    s.last_error or "")
                    for name, s in sorted(self._states.items())
                    if s.consecutive_failures > 0 and s.failing_since is not None]

    def _record_success(self, name: str) -> None:
        with self._lock:
            state = self._states[name]
            state.attempts += 1
            recovered_after = state.consecutive_failures
            state.consecutive_failures = 0
            state.failing_since = None
            state.last_success = time.time()
        if recovered_after:
            log.warning("alerts reach Alertmanager at %s again, after %d failed pushes", name, recovered_after)

    def _record_failure(self, name: str, failure: PushFailed) -> None:
        with self._lock:
            state = self._states[name]
            state.attempts += 1
            state.failures += 1
            state.failures_by_reason[failure.reason] = state.failures_by_reason.get(failure.reason, 0) + 1
            state.consecutive_failures += 1
            first_of_outage = state.failing_since is None
            if first_of_outage:
                state.failing_since = time.time()
            state.last_reason = failure.reason
            state.last_error = f"{failure.reason}: {failure}"
        # One line per outage, not per retry: a dead Alertmanager must not flood the log.
        if first_of_outage:
            log.warning("cannot push alerts to Alertmanager at %s: %s: %s (retrying with backoff up to "
                        "every %.0f s; further failures are counted in %s, not logged)",
                        name, failure.reason, failure, self.interval_seconds, ALERTMANAGER_FAILURES.name)

    def _record_restart(self, name: str) -> int:
        """Count a restart of the Alertmanager's delivery task; returns its restarts so far."""
        with self._lock:
            self._states[name].restarts += 1
            return self._states[name].restarts

    # -- one push ----------------------------------------------------------------------------------

    async def _exchange(self, client: httpx.AsyncClient, url: str, body: bytes) -> tuple[int, str | None]:
        """POST and read at most MAX_RESPONSE_BYTES of the answer; returns the HTTP status and
        the answer's Date header."""
        headers = {"Content-Type": "application/json"}
        authorization = self.credentials.authorization()
        if authorization is not None:
            headers["Authorization"] = authorization
        # tls_config.server_name: httpcore sends it as SNI and checks the certificate against it
        extensions = {"sni_hostname": self.credentials.server_name} if self.credentials.server_name else {}
        async with client.stream("POST", url, content=body, headers=headers, extensions=extensions) as response:
            received = 0
            # Raw bytes: a compressed answer is not inflated, so the bound holds.
            async for chunk in response.aiter_raw():
                received += len(chunk)
                if received > MAX_RESPONSE_BYTES:
                    raise PushFailed("too_large", f"HTTP {response.status_code} with a body longer "
                                     f"than {MAX_RESPONSE_BYTES} bytes")
            return response.status_code, response.headers.get("date")

    async def _post(self, connection: _Connection, url: str, body: bytes) -> None:
        """POST the alerts to one Alertmanager within the deadline, with the credentials as the
        files hold them now; raises PushFailed. An answer that carries a Date header tells its
        clock (_note_clock), accepted or not."""
        try:
            self.credentials.refresh()
        except CredentialsUnreadable as error:
            raise PushFailed("credentials", str(error)) from None
        client = await connection.client(self.credentials.tls_generation, self._client)
        try:
            # wait_for cancels the exchange at the deadline, wherever it is: connecting, sending,
            # waiting for headers or reading a body that drips.
            status, date = await asyncio.wait_for(self._exchange(client, url, body), self.timeout_seconds)
        except PushFailed:
            raise
        except (asyncio.TimeoutError, httpx.TimeoutException):
            raise PushFailed("timeout", f"no complete answer in {self.timeout_seconds:g} s") from None
        except httpx.ConnectError as error:
            refused = _caused_by(error, ConnectionRefusedError)
            message = "connection refused" if refused else (str(error) or type(error).__name__)
            raise PushFailed("refused" if refused else "connect", message) from None
        except (httpx.RemoteProtocolError, httpx.LocalProtocolError, httpx.DecodingError) as error:
            raise PushFailed("protocol", str(error) or type(error).__name__) from None
        except (httpx.TransportError, OSError) as error:
            raise PushFailed("connection", str(error) or type(error).__name__) from None
        self._note_clock(self._name(url), date)
        if 200 <= status < 300:
            return
        if status == 401:  # what an Alertmanager with --web.config.file answers a wrong password
            raise PushFailed("http_4xx", "HTTP 401: Alertmanager did not accept the credentials "
                             "(alerting.http_config)")
        if 400 <= status < 600:
            raise PushFailed(f"http_{status // 100}xx", f"HTTP {status}")
        raise PushFailed("http_other", f"HTTP {status}")

    async def _push(self, connection: _Connection, url: str, body: bytes) -> bool:
        """One push to one Alertmanager, recorded; True if it accepted the alerts."""
        name = self._name(url)
        try:
            await self._post(connection, url, body)
        except PushFailed as failure:
            self._record_failure(name, failure)
            return False
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - counted and logged; delivery must go on
            if name not in self._unexpected_logged:  # the traceback once; later ones are counted
                self._unexpected_logged.add(name)
                log.exception("unexpected error pushing alerts to Alertmanager at %s", name)
            self._record_failure(name, PushFailed("unexpected", f"{type(error).__name__}: {error}"))
            return False
        self._record_success(name)
        return True

    def _note_clock(self, name: str, date: str | None) -> None:
        """The Alertmanager's clock, from its answer's Date header: where it is CLOCK_SKEW_SECONDS
        or more off this host's, the alert times sent to it move by the difference (logged once
        each time the skew appears); a missing or malformed header changes nothing."""
        try:
            theirs = parsedate_to_datetime(date).timestamp() if date else None
        except (TypeError, ValueError, IndexError, OverflowError):
            theirs = None
        if theirs is None or not math.isfinite(theirs):
            return
        skew = theirs - self.clock()
        offset = skew if abs(skew) >= CLOCK_SKEW_SECONDS else 0.0
        with self._lock:
            state = self._states[name]
            appeared = offset and not state.clock_offset
            state.clock_offset = offset
        if appeared:
            log.warning("the clock of Alertmanager at %s is %.0f s %s this host's (its Date header): "
                        "alert times sent to it are moved to its clock; set both clocks right (NTP)",
                        name, abs(offset), "ahead of" if offset > 0 else "behind")

    def _body(self, name: str) -> bytes:
        with self._lock:
            offset = self._states[name].clock_offset
        return json.dumps(self.alerts(self.clock(), offset)).encode()

    def _client(self) -> httpx.AsyncClient:
        # The deadline in _post bounds the request; these bound each phase inside it. No
        # redirects: a 3xx is reported, not followed. No proxies from the environment: the agent
        # talks to the configured address. One TLS context for all, rebuilt only when its files
        # change: building one costs ~50 ms of CPU.
        return httpx.AsyncClient(timeout=httpx.Timeout(30.0), follow_redirects=False, trust_env=False,
                                 verify=self.credentials.ssl_context(),
                                 limits=httpx.Limits(max_connections=2, max_keepalive_connections=1))

    def push_once(self) -> int:
        """Send the current alerts to every URL at once; returns how many accepted them.
        For tests and one-off use; the running agent pushes from its own loop (start)."""
        async def push(url: str) -> bool:
            connection = _Connection()  # one client each: no shared connection pool
            try:
                return await self._push(connection, url, self._body(self._name(url)))
            finally:
                await connection.close()

        async def push_all() -> int:
            return sum(await asyncio.gather(*(push(url) for url in self.urls)))

        return asyncio.run(push_all())

    # -- the delivery loop -------------------------------------------------------------------------

    def retry_delay(self, consecutive_failures: int) -> float:
        """Seconds before the next try after `consecutive_failures` failures in a row (>= 1)."""
        backoff = min(self.interval_seconds, RETRY_FIRST_SECONDS * 2 ** min(consecutive_failures - 1, 30))
        return backoff * random.uniform(0.5, 1.0)

    async def _deliver_forever(self, url: str, wake: asyncio.Event) -> None:
        """Push to one Alertmanager every interval, at once on a change, sooner after a failure."""
        name = self._name(url)
        connection = _Connection()
        try:
            while not self._stop.is_set():
                wake.clear()
                accepted = await self._push(connection, url, self._body(name))
                with self._lock:
                    failures = self._states[name].consecutive_failures
                delay = self.interval_seconds if accepted else self.retry_delay(failures)
                try:
                    await asyncio.wait_for(wake.wait(), delay)
                except asyncio.TimeoutError:
                    pass
        finally:
            await connection.close()

    async def _supervise(self, url: str, wake: asyncio.Event) -> None:
        """Runs one Alertmanager's delivery task and restarts it whenever it raises."""
        name = self._name(url)
        while not self._stop.is_set():
            try:
                await self._deliver_forever(url, wake)
            except Exception:  # noqa: BLE001 - whatever it was, delivery must resume (not on cancel)
                if self._record_restart(name) == 1:  # the traceback once; later ones are counted
                    log.exception("alert delivery to Alertmanager at %s failed unexpectedly; restarting "
                                  "it (further restarts are counted in %s)", name, ALERTMANAGER_LOOP_RESTARTS.name)
                await asyncio.sleep(RESTART_DELAY_SECONDS)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wakes = {url: asyncio.Event() for url in self.urls}
        tasks = [asyncio.create_task(self._supervise(url, wake), name=f"alertmanager {self._name(url)}")
                 for url, wake in self._wakes.items()]
        self._stopped = asyncio.Event()
        try:
            # The event ends it at once; the check every second covers a stop() that came before
            # the event existed.
            while not self._stop.is_set():
                try:
                    await asyncio.wait_for(self._stopped.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _run(self) -> None:
        """The thread: the event loop, run again (and counted) if it ever ends by an error."""
        while not self._stop.is_set():
            try:
                asyncio.run(self._main())
            except Exception:  # noqa: BLE001 - the thread must outlive any bug
                for name in self._states:
                    self._record_restart(name)
                log.exception("the Alertmanager push loop failed; restarting it")
                self._stop.wait(RESTART_DELAY_SECONDS)

    def _wake_all(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        for wake in list(self._wakes.values()):
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop closed meanwhile
                return

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="alertmanager-push", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        loop, stopped = self._loop, self._stopped
        if loop is not None and stopped is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stopped.set)
            except RuntimeError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_seconds + 1)


class _Connection:
    """One Alertmanager's HTTP client, made on first use and made again when the TLS files changed:
    its pooled connections were opened with the old certificates."""

    def __init__(self) -> None:
        self._client: httpx.AsyncClient | None = None
        self._generation = -1

    async def client(self, tls_generation: int, make: Callable[[], httpx.AsyncClient]) -> httpx.AsyncClient:
        if self._client is None or self._generation != tls_generation:
            await self.close()
            self._client, self._generation = make(), tls_generation
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()


def _caused_by(error: BaseException, kind: type[BaseException]) -> bool:
    """Whether `kind` is in the chain of causes (httpx wraps anyio's error, which wraps the
    socket's OSError for each address tried)."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, kind):
            return True
        pending += [current.__cause__, current.__context__, *getattr(current, "exceptions", ())]
    return False


class AlertmanagerCollector:
    """hybridmon_alertmanager_* from the pusher's delivery records, for the agent's /metrics."""

    def __init__(self, pusher: AlertmanagerPusher) -> None:
        self._pusher = pusher

    def collect(self) -> Iterable[Metric]:
        samples = Samples()
        for name, state in self._pusher.delivery_records():
            samples.add(ALERTMANAGER_ATTEMPTS, state.attempts, name)
            for reason, count in sorted(state.failures_by_reason.items()):
                samples.add(ALERTMANAGER_FAILURES, count, name, reason)
            samples.add(ALERTMANAGER_CONSECUTIVE_FAILURES, state.consecutive_failures, name)
            samples.add(ALERTMANAGER_LAST_SUCCESS, state.last_success, name)
            samples.add(ALERTMANAGER_LOOP_RESTARTS, state.restarts, name)
        return families(samples, sort=False)
