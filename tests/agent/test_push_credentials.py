"""[alerting.http_config] (issue 32 part 4): Prometheus's validation rules, secrets in files only,
files read again when they change (a Kubernetes Secret's ..data symlink swap), an unreadable file
failing one push and never the agent, and no secret in errors, logs, /healthz, metrics or repr.
The pushes go to a local fake that records the Authorization header; the real Alertmanager's
answers are in tests/integration/test_alertmanager_auth_live.py."""
from __future__ import annotations

import base64
import logging
import os
import time

import pytest

from fastapi.testclient import TestClient

from hybridmon.agent.api.server import create_app
from hybridmon.agent.config import ConfigError, HttpConfig, load_config
from hybridmon.agent.daemon import Agent
from hybridmon.agent.publish.alertmanager import AlertmanagerCollector, AlertmanagerPusher
from hybridmon.agent.publish.push_credentials import PushCredentials
from tests.support import fake_nvml
from tests.support.agent_helpers import fixture_config, free_port
from tests.support.alertmanager_helpers import AcceptingAlertmanager, firing_engine
from tests.support.tls_files import make_tls_files

SECRET = "s3cr3t-Hunter2-do-not-show"


def config_error(tmp_path, toml: str) -> str:
    path = tmp_path / "hybridmon.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    return str(caught.value)


def basic_auth(password_file) -> HttpConfig:
    return HttpConfig.model_validate({"basic_auth": {"username": "agent", "password_file": str(password_file)}})


def expected_basic(password: str) -> str:
    return "Basic " + base64.b64encode(f"agent:{password}".encode()).decode()


@pytest.fixture(name="firing_engine")
def firing_engine_fixture():
    return firing_engine()


@pytest.fixture
def accepting():
    fake = AcceptingAlertmanager()
    yield fake
    fake.close()


@pytest.mark.parametrize("toml, says", [
    ('[alerting.http_config.basic_auth]\nusername = "a"\npassword_file = "/p"\n'
     '[alerting.http_config.authorization]\ncredentials_file = "/c"\n',
     "alerting.http_config: Value error, at most one of basic_auth and authorization"),
    ('[alerting.http_config.tls_config]\ncert_file = "/c"\n', "cert_file is set without key_file"),
    ('[alerting.http_config.tls_config]\nkey_file = "/k"\n', "key_file is set without cert_file"),
    ('[alerting.http_config.authorization]\ntype = " basic "\ncredentials_file = "/c"\n',
     'authorization type cannot be "basic"'),
    ('[alerting.http_config.tls_config]\nmin_version = "TLS14"\n', "unknown TLS version"),
    ('[alerting.http_config.basic_auth]\nusername = "a:b"\npassword_file = "/p"\n', "cannot contain ':'"),
])
def test_prometheus_validation_rules_name_the_key(tmp_path, toml, says):
    assert says in config_error(tmp_path, toml)


def test_authorization_type_defaults_to_bearer_as_in_prometheus():
    config = HttpConfig.model_validate({"authorization": {"type": "  ", "credentials_file": "/c"}})
    assert config.authorization.type == "Bearer"
    assert HttpConfig.model_validate({"authorization": {"credentials_file": "/c"}}).authorization.type == "Bearer"


@pytest.mark.parametrize("toml, file_key", [
    (f'[alerting.http_config.basic_auth]\nusername = "a"\npassword = "{SECRET}"\npassword_file = "/p"\n',
     "alerting.http_config.basic_auth.password_file"),
    (f'[alerting.http_config.authorization]\ncredentials = "{SECRET}"\ncredentials_file = "/c"\n',
     "alerting.http_config.authorization.credentials_file"),
    (f'[alerting.http_config]\nbearer_token = "{SECRET}"\n', "alerting.http_config.authorization.credentials_file"),
    (f'[alerting.http_config.tls_config]\nkey = "{SECRET}"\n', "alerting.http_config.tls_config.key_file"),
])
def test_inline_secrets_are_refused_without_repeating_them(tmp_path, toml, file_key):
    message = config_error(tmp_path, toml)
    assert "refused, secrets are read from files only" in message and f"set {file_key}" in message
    assert SECRET not in message


def test_secrets_in_the_wrong_place_are_not_repeated_either(tmp_path):
    for toml in (f'[alerting.http_config]\nbasic_auth = "agent:{SECRET}"\n',
                 f'[alerting]\nalertmanager_urls = ["http://agent:{SECRET}@127.0.0.1:9093", "ftp://x"]\n'):
        message = config_error(tmp_path, toml)
        assert SECRET not in message and "alerting." in message
    with pytest.raises(ConfigError) as caught:
        load_config(None, environ={"HYBRIDMON_ALERTING__HTTP_CONFIG__BASIC_AUTH__PASSWORD": SECRET})
    assert SECRET not in str(caught.value) and "basic_auth.password: refused" in str(caught.value)


def test_files_that_cannot_be_used_at_start_are_config_errors_naming_the_key(tmp_path):
    tls = make_tls_files(tmp_path / "tls")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    unreadable = tmp_path / "unreadable"
    unreadable.write_text(SECRET)
    unreadable.chmod(0)
    cases = [
        (basic_auth(tmp_path / "missing"), "basic_auth.password_file: ", "No such file or directory"),
        (basic_auth(empty), "basic_auth.password_file: ", "is empty"),
        (HttpConfig.model_validate({"tls_config": {"ca_file": str(empty)}}), "tls_config.ca_file: ",
         "cannot be used as PEM CA certificates"),
        (HttpConfig.model_validate({"tls_config": {"cert_file": str(tls.client_cert), "key_file": str(tls.server_key)}}),
         "tls_config.cert_file/key_file: ", "KEY_VALUES_MISMATCH"),
    ]
    if os.geteuid() != 0:  # root reads a file of mode 000 all the same
        cases.append((basic_auth(unreadable), "basic_auth.password_file: ", "Permission denied"))
    for http_config, key, why in cases:
        with pytest.raises(ConfigError) as caught:
            PushCredentials(http_config)
        assert f"alerting.http_config.{key}" in str(caught.value) and why in str(caught.value)


def test_the_cli_exits_78_when_a_credentials_file_is_missing(tmp_path, capsys):
    from hybridmon.agent.cli import EXIT_CONFIG, main

    config = tmp_path / "hybridmon.toml"
    config.write_text('[alerting]\nalertmanager_urls = ["http://127.0.0.1:9"]\n'
                      f'[alerting.http_config.authorization]\ncredentials_file = "{tmp_path / "token"}"\n')
    assert main(["run", "--config", str(config), "--listen", f"127.0.0.1:{free_port()}"]) == EXIT_CONFIG
    assert "alerting.http_config.authorization.credentials_file: " in capsys.readouterr().err


@pytest.mark.slow  # the local fake Alertmanager listens on a socket
def test_basic_auth_and_bearer_reach_alertmanager_from_their_files(tmp_path, firing_engine, accepting):
    password = tmp_path / "password"
    password.write_text(SECRET + "\n")  # the newline a shell's echo leaves is trimmed, as in Prometheus
    token = tmp_path / "token"
    token.write_text("tok-123\n")
    bearer = HttpConfig.model_validate({"authorization": {"credentials_file": str(token)}})
    for http_config, header in ((basic_auth(password), expected_basic(SECRET)), (bearer, "Bearer tok-123"),
                                (HttpConfig(), None)):
        pusher = AlertmanagerPusher(firing_engine, [accepting.url], "http://x/runbooks",
                                    credentials=PushCredentials(http_config))
        assert pusher.push_once() == 1
        assert accepting.authorizations[-1] == header


@pytest.mark.slow  # the local fake Alertmanager listens on a socket
def test_a_rotated_secret_is_used_from_the_next_push(tmp_path, firing_engine, accepting):
    """Kubernetes updates a Secret volume by writing a new timestamped directory and swapping the
    ..data symlink to it in one rename; the file the agent names is a symlink through ..data."""
    volume = tmp_path / "secret"
    volume.mkdir()

    def publish(version: str, password: str) -> None:
        (volume / version).mkdir()
        (volume / version / "password").write_text(password)
        (volume / "..data_tmp").symlink_to(version)
        os.replace(volume / "..data_tmp", volume / "..data")  # rename(2): atomic

    publish("..2026_11_28_1", "first-password")
    (volume / "password").symlink_to("..data/password")
    pusher = AlertmanagerPusher(firing_engine, [accepting.url], "http://x/runbooks",
                                credentials=PushCredentials(basic_auth(volume / "password")))
    assert pusher.push_once() == 1
    publish("..2026_11_28_2", "second-password")
    assert pusher.push_once() == 1
    assert accepting.authorizations == [expected_basic("first-password"), expected_basic("second-password")]


def test_an_unchanged_file_is_not_read_again(tmp_path, monkeypatch):
    password = tmp_path / "password"
    password.write_text(SECRET)
    credentials = PushCredentials(basic_auth(password))
    reads = []
    monkeypatch.setattr(credentials, "_read_secret", lambda key: reads.append(key) or "x")
    for _ in range(3):
        credentials.refresh()
    assert reads == []
    os.utime(password, ns=(0, 0))  # another mtime: read again
    credentials.refresh()
    assert reads == ["alerting.http_config.basic_auth.password_file"]


@pytest.mark.slow  # the local fake Alertmanager listens on a socket
def test_a_file_unreadable_later_fails_that_push_only_and_nothing_is_lost(tmp_path, firing_engine, accepting, caplog):
    password = tmp_path / "password"
    password.write_text(SECRET)
    pusher = AlertmanagerPusher(firing_engine, [accepting.url], "http://x/runbooks",
                                credentials=PushCredentials(basic_auth(password)))
    assert pusher.push_once() == 1
    password.unlink()  # a Secret deleted, a volume unmounted
    with caplog.at_level(logging.DEBUG):
        assert pusher.push_once() == 0
    record = pusher.health()[accepting.url.removeprefix("http://")]
    assert record["failures_by_reason"] == {"credentials": 1}
    assert "alerting.http_config.basic_auth.password_file" in record["last_error"]
    assert "No such file or directory" in caplog.text and "credentials" in caplog.text
    password.write_text("restored-password")
    assert pusher.push_once() == 1  # the same alerts, with the file's new content
    assert accepting.authorizations[-1] == expected_basic("restored-password")
    assert len(accepting.pushes[-1][1]) == len(accepting.pushes[0][1]) == 1


def test_a_changed_ca_replaces_the_delivery_client(tmp_path):
    tls = make_tls_files(tmp_path / "tls")
    credentials = PushCredentials(HttpConfig.model_validate({"tls_config": {"ca_file": str(tls.ca)}}))
    first, generation = credentials.ssl_context(), credentials.tls_generation
    credentials.refresh()
    assert credentials.ssl_context() is first and credentials.tls_generation == generation
    other = make_tls_files(tmp_path / "other")
    os.replace(other.ca, tls.ca)
    credentials.refresh()
    assert credentials.ssl_context() is not first and credentials.tls_generation == generation + 1


@pytest.mark.slow  # the local fake Alertmanager listens on a socket
def test_no_secret_in_repr_dumps_health_metrics_or_debug_logs(tmp_path, firing_engine, caplog):
    password = tmp_path / "password"
    password.write_text(SECRET)
    http_config = basic_auth(password)
    credentials = PushCredentials(http_config)
    refusing = AcceptingAlertmanager(status=401)
    try:
        pusher = AlertmanagerPusher(firing_engine, [refusing.url], "http://x/runbooks", credentials=credentials)
        with caplog.at_level(logging.DEBUG):
            assert pusher.push_once() == 0
    finally:
        refusing.close()
    record = pusher.health()[refusing.url.removeprefix("http://")]
    assert record["last_error"] == "http_4xx: HTTP 401: Alertmanager did not accept the credentials (alerting.http_config)"
    metrics = "".join(str(metric) for metric in AlertmanagerCollector(pusher).collect())
    encoded = base64.b64encode(f"agent:{SECRET}".encode()).decode()
    shown = [repr(credentials), repr(http_config), str(http_config.model_dump()), str(record), metrics, caplog.text,
             repr(load_config(None, environ={}, overrides={
                 "alerting.http_config.basic_auth.username": "agent",
                 "alerting.http_config.basic_auth.password_file": str(password)}))]
    for text in shown:
        assert SECRET not in text and encoded not in text
    assert "HTTP 401" in caplog.text



@pytest.mark.slow  # the local fake Alertmanager listens on a socket
def test_no_secret_on_any_page_the_agent_serves(tmp_path, caplog):
    """The status page, /healthz, the findings (HybridmonAlertDeliveryFailing's details carry the
    last error) and /metrics, with a push refused and a log at debug."""
    password = tmp_path / "password"
    password.write_text(SECRET)
    refusing = AcceptingAlertmanager(status=401)
    fake_nvml.reset()
    agent = Agent(fixture_config(**{"alerting.alertmanager_urls": [refusing.url], "log_level": "debug",
                                    "alerting.http_config.basic_auth.username": "agent",
                                    "alerting.http_config.basic_auth.password_file": str(password)}))
    try:
        with caplog.at_level(logging.DEBUG):
            assert agent.pusher.push_once() == 0
            now = time.time()
            agent.engine.evaluate(now)
            agent.engine.evaluate(now + agent.thresholds.alert_delivery.for_seconds + 1)
            client = TestClient(create_app(agent))
            pages = {path: client.get(path).text for path in ("/", "/healthz", "/api/v1/findings", "/metrics")}
    finally:
        agent.stop()
        refusing.close()
        fake_nvml.reset()
    assert refusing.authorizations == [expected_basic(SECRET)]  # it was sent, to Alertmanager only
    assert "did not accept the credentials" in pages["/api/v1/findings"]
    encoded = base64.b64encode(f"agent:{SECRET}".encode()).decode()
    for shown in (*pages.values(), caplog.text):
        assert SECRET not in shown and encoded not in shown
