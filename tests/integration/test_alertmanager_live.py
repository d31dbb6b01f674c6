"""Alerts keep reaching a real Alertmanager while every kind of hostile one runs beside it
(issue 11, "Tests that keep it so"): refused, hung, 500, garbage, truncated, dripping and endless
answers, a bug injected into the push loop, and a hostile Alertmanager replaced by a real one."""
from __future__ import annotations

import threading
import time
from datetime import datetime

import psutil

from hybridmon.agent.publish.alertmanager import AlertmanagerPusher
from hybridmon.agent.detectors.engine import Engine
from hybridmon.agent.loop.history import History
from tests.support.alertmanager_helpers import Alertmanager, HostileAlertmanager, Switch, WebhookReceiver, refused_url, wait_until

INTERVAL = 1.0
# The reason each hostile Alertmanager's failures must be counted under.
EXPECTED_REASON = {"refused": "refused", "hang": "timeout", "http_500": "http_5xx", "garbage": "protocol", "truncated": "protocol",
                   "drip": "timeout", "endless": "too_large"}


class RssSampler:
    """This process's resident memory every 20 ms, in a thread, until stopped."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.baseline = self.process.memory_info().rss
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()



def gpus_in(alertmanager: Alertmanager) -> set[str]:
    return {alert["labels"]["gpu"] for alert in alertmanager.alerts()}


def test_alerts_reach_a_real_alertmanager_beside_hostile_ones(tmp_path):
    receiver = WebhookReceiver()
    (tmp_path / "real").mkdir()
    (tmp_path / "replacement").mkdir()
    real = Alertmanager(tmp_path / "real", receiver.url)
    hostile = {mode: HostileAlertmanager(mode) for mode in HostileAlertmanager.MODES}
    refused = refused_url()
    replacement = None
    pusher = None
    try:
        switch = Switch()
        engine = Engine([switch], History(60))
        pusher = AlertmanagerPusher(engine, [refused, *(h.url for h in hostile.values()), real.url],
                                    "http://agent:9787/runbooks", interval_seconds=INTERVAL)
        real_alerts = []

        def alerts_failing_once(now, clock_offset=0.0):  # a bug in the push loop, once
            real_alerts.append(now)
            if len(real_alerts) == 12:
                raise RuntimeError("injected: an exception the push loop did not expect")
            return pusher_alerts(now, clock_offset)

        pusher_alerts, pusher.alerts = pusher.alerts, alerts_failing_once
        rss = RssSampler()
        switch.on = True
        engine.evaluate(time.time())
        started = time.monotonic()
        pusher.start()
        wait_until(lambda: gpus_in(real) == {"0"}, INTERVAL + 1, "GPU 0's alert in the real Alertmanager")
        first_latency = time.monotonic() - started

        # A new finding mid-run reaches it within the push interval (a change wakes delivery).
        time.sleep(2)
        switch.gpus = ["0", "1"]
        changed = time.monotonic()
        engine.evaluate(time.time())
        wait_until(lambda: gpus_in(real) == {"0", "1"}, INTERVAL, "GPU 1's alert in the real Alertmanager")
        change_latency = time.monotonic() - changed

        # Pushes to the real one go on every interval: its last success is never older than that.
        largest_age = 0.0
        name = real.url.removeprefix("http://")
        watch_until = time.monotonic() + 3
        while time.monotonic() < watch_until:
            last = pusher.health()[name]["last_success"]
            age = time.time() - datetime.fromisoformat(last.replace("Z", "+00:00")).timestamp()
            largest_age = max(largest_age, age)
            time.sleep(0.05)
        rss.stop()
        health = pusher.health()

        # The garbage Alertmanager's port is taken over by a real one: alerts arrive there too.
        garbage = hostile.pop("garbage")
        garbage.close()
        replacement = Alertmanager(tmp_path / "replacement", receiver.url, port=garbage.port)
        wait_until(lambda: gpus_in(replacement) == {"0", "1"}, 2 * INTERVAL + 1,
                   "the alerts in the Alertmanager that replaced the garbage one")
        # Alertmanager holds the alerts a moment before the pusher has read its answer and
        # recorded the success: wait for the record rather than read it at once.
        replaced = f"127.0.0.1:{garbage.port}"
        wait_until(lambda: pusher.health()[replaced]["consecutive_failures"] == 0, INTERVAL,
                   "the pusher to record the replacement's first success")
        recovered = pusher.health()[replaced]
    finally:
        if pusher is not None:
            pusher.stop()
        for fake in hostile.values():
            fake.close()
        for alertmanager in (real, replacement):
            if alertmanager is not None:
                alertmanager.close()
        receiver.close()

    restarts = sum(record["restarts"] for record in health.values())
    growth = (rss.peak - rss.baseline) / 1e6
    endless_sent = hostile["endless"].bytes_sent / 1e6
    print(f"first alert in {first_latency * 1000:.0f} ms, new alert in {change_latency * 1000:.0f} ms, "
          f"largest age of the last success {largest_age:.2f} s; RSS +{growth:.1f} MB while the endless "
          f"fake sent {endless_sent:.1f} MB; {restarts} restart; failures "
          f"{ {n: r['failures_by_reason'] for n, r in health.items()} }")
    assert first_latency <= INTERVAL + 1 and change_latency <= INTERVAL
    assert largest_age <= 2 * INTERVAL
    assert health[name]["failures"] == 0 and health[name]["attempts"] >= 5
    ports = {"refused": refused.rsplit(":", 1)[1], **{mode: str(fake.port) for mode, fake in hostile.items()},
             "garbage": str(garbage.port)}
    for mode, port in ports.items():
        reasons = health[f"127.0.0.1:{port}"]["failures_by_reason"]
        expected = EXPECTED_REASON[mode]
        # On a loaded machine a push may also miss its 1 s deadline; nothing else may appear.
        assert max(reasons, key=reasons.get) == expected and set(reasons) <= {expected, "timeout"}, mode
    assert restarts == 1
    assert growth < 32, f"RSS grew {growth:.1f} MB"
    assert hostile["endless"].connections >= 3 and endless_sent > 0
    assert recovered["consecutive_failures"] == 0 and recovered["last_success"] is not None
