"""The agent's alerts reach a real Alertmanager (Debian's prometheus-alertmanager 0.25) that requires
basic auth through its --web.config.file, over plain HTTP and over HTTPS with a client certificate;
a wrong password is answered 401 and reported as a failed push without the password (issue 32
part 4). The certificates and the web config come from tests/support/tls_files.py."""
from __future__ import annotations

import logging
import os

import httpx

from hybridmon.agent.config import HttpConfig
from hybridmon.agent.publish.alertmanager import AlertmanagerCollector, AlertmanagerPusher
from hybridmon.agent.publish.push_credentials import PushCredentials
from tests.support.alertmanager_helpers import Alertmanager, WebhookReceiver, firing_engine, wait_until
from tests.support.tls_files import make_tls_files, write_web_config

USER = "hybridmon"
PASSWORD = "correct-horse-battery-staple"
WRONG = "wrong-password-never-shown"


def test_alerts_reach_an_alertmanager_requiring_basic_auth_and_a_wrong_password_is_a_counted_401(tmp_path, caplog):
    web_config = write_web_config(tmp_path / "web.yml", users={USER: PASSWORD})
    receiver = WebhookReceiver()
    alertmanager = Alertmanager(tmp_path, receiver.url, web_config=web_config, auth=(USER, PASSWORD))
    password = tmp_path / "password"
    try:
        # Without credentials the real Alertmanager refuses, as the pusher must see it.
        assert httpx.post(f"{alertmanager.url}/api/v2/alerts", json=[], timeout=2).status_code == 401
        password.write_text(WRONG + "\n")
        http_config = HttpConfig.model_validate({"basic_auth": {"username": USER, "password_file": str(password)}})
        pusher = AlertmanagerPusher(firing_engine(), [alertmanager.url], "http://agent:9787/runbooks",
                                    credentials=PushCredentials(http_config))
        with caplog.at_level(logging.DEBUG):
            assert pusher.push_once() == 0
        name = alertmanager.url.removeprefix("http://")
        refused = pusher.health()[name]
        samples = [sample for metric in AlertmanagerCollector(pusher).collect() for sample in metric.samples]

        password.write_text(PASSWORD + "\n")  # the operator fixes the file; no restart
        assert pusher.push_once() == 1
        alerts = wait_until(alertmanager.alerts, 5, "the alert in the real Alertmanager")
        notified = wait_until(lambda: receiver.notifications, 10, "the webhook notification")
    finally:
        alertmanager.close()
        receiver.close()
    assert refused["failures_by_reason"] == {"http_4xx": 1}
    assert refused["last_error"] == "http_4xx: HTTP 401: Alertmanager did not accept the credentials (alerting.http_config)"
    assert [(sample.labels, sample.value) for sample in samples
            if sample.name == "hybridmon_alertmanager_failures_total"] == [({"alertmanager": name, "reason": "http_4xx"}, 1)]
    assert "HTTP 401" in caplog.text
    for shown in (str(refused), str(samples), caplog.text):
        assert WRONG not in shown and PASSWORD not in shown
    assert [alert["labels"]["alertname"] for alert in alerts] == ["GpuPcieStarvation"]
    assert notified[0]["alerts"][0]["labels"]["gpu"] == "0"


def test_alerts_reach_an_alertmanager_over_https_with_basic_auth_and_a_client_certificate(tmp_path):
    tls = make_tls_files(tmp_path / "tls")
    web_config = write_web_config(tmp_path / "web.yml", tls=tls, users={USER: PASSWORD},
                                  client_auth_type="RequireAndVerifyClientCert")
    receiver = WebhookReceiver()
    alertmanager = Alertmanager(tmp_path, receiver.url, web_config=web_config, auth=(USER, PASSWORD), tls=tls)
    password = tmp_path / "password"
    password.write_text(PASSWORD)
    tls_config = {"ca_file": str(tls.ca), "cert_file": str(tls.client_cert), "key_file": str(tls.client_key),
                  "server_name": "localhost", "min_version": "TLS12"}
    try:
        def pusher(**tls_changes) -> AlertmanagerPusher:
            http_config = HttpConfig.model_validate({
                "basic_auth": {"username": USER, "password_file": str(password)},
                "tls_config": {**tls_config, **tls_changes}})
            return AlertmanagerPusher(firing_engine(), [alertmanager.url], "http://agent:9787/runbooks",
                                      timeout_seconds=5, credentials=PushCredentials(http_config))

        without_client_certificate = pusher(cert_file=None, key_file=None)
        assert without_client_certificate.push_once() == 0
        wrong_name = pusher(server_name="alertmanager.example.org")  # not in the certificate
        assert wrong_name.push_once() == 0
        accepted = pusher()
        assert accepted.push_once() == 1
        alerts = wait_until(alertmanager.alerts, 5, "the alert in the real Alertmanager over HTTPS")
    finally:
        alertmanager.close()
        receiver.close()
    name = alertmanager.url.removeprefix("https://")
    print("without a client certificate:", without_client_certificate.health()[name]["last_error"])
    print("wrong server_name:", wrong_name.health()[name]["last_error"])
    # The handshake fails in either case: the server wants a certificate, or the name is not the one signed.
    assert set(without_client_certificate.health()[name]["failures_by_reason"]) <= {"connect", "connection", "protocol"}
    assert wrong_name.health()[name]["failures_by_reason"] == {"connect": 1}
    assert "alertmanager.example.org" in wrong_name.health()[name]["last_error"]
    assert [alert["labels"]["alertname"] for alert in alerts] == ["GpuPcieStarvation"]


def test_a_running_pusher_takes_a_rotated_ca_and_insecure_skip_verify_skips_the_check(tmp_path):
    """The CA file first holds another CA (the handshake fails), then, swapped in by rename as a
    Secret volume is, the right one: the running delivery task replaces its client and delivers."""
    tls = make_tls_files(tmp_path / "tls")
    other = make_tls_files(tmp_path / "other")
    web_config = write_web_config(tmp_path / "web.yml", tls=tls, users={USER: PASSWORD})
    receiver = WebhookReceiver()
    alertmanager = Alertmanager(tmp_path, receiver.url, web_config=web_config, auth=(USER, PASSWORD), tls=tls)
    password = tmp_path / "password"
    password.write_text(PASSWORD)
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(other.ca.read_bytes())
    name = alertmanager.url.removeprefix("https://")

    def pusher(tls_config: dict) -> AlertmanagerPusher:
        http_config = HttpConfig.model_validate({"basic_auth": {"username": USER, "password_file": str(password)},
                                                 "tls_config": tls_config})
        return AlertmanagerPusher(firing_engine(), [alertmanager.url], "http://agent:9787/runbooks",
                                  interval_seconds=1, timeout_seconds=1, credentials=PushCredentials(http_config))

    rotating = pusher({"ca_file": str(ca_file)})
    try:
        rotating.start()
        wait_until(lambda: rotating.health()[name]["failures_by_reason"].get("connect"), 10,
                   "a failed handshake against the wrong CA")
        (tmp_path / "ca.new").write_bytes(tls.ca.read_bytes())
        os.replace(tmp_path / "ca.new", ca_file)
        wait_until(lambda: rotating.health()[name]["last_success"], 10, "a push once the right CA is in place")
        rotating.stop()
        unchecked = pusher({"insecure_skip_verify": True})  # no CA at all: the system's would refuse it
        assert unchecked.push_once() == 1
        alerts = wait_until(alertmanager.alerts, 5, "the alert in the real Alertmanager")
    finally:
        rotating.stop()
        alertmanager.close()
        receiver.close()
    assert "CERTIFICATE_VERIFY_FAILED" in rotating.health()[name]["last_error"]  # the last failure's
    assert rotating.health()[name]["restarts"] == 0
    assert [alert["labels"]["alertname"] for alert in alerts] == ["GpuPcieStarvation"]
