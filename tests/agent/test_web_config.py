"""--web-config-file (issue 32, part 1): exporter-toolkit's web configuration read strictly, every bad
file a ConfigError (exit 78) naming the file and the key, basic auth as exporter-toolkit checks it,
and files re-read when they change. The server over real sockets: tests/integration/test_web_config_live.py."""
from __future__ import annotations

import base64
import os
import socket
import ssl
import threading
from pathlib import Path

import anyio
import httpx
import pytest
import yaml

from hybridmon.agent import cli
from hybridmon.agent.api import web_config
from hybridmon.agent.api.web_config import BasicAuth, TokenBucket, WebConfigFile, WebConfigMiddleware, load_web_config
from hybridmon.agent.config import ConfigError, load_config
from tests.support.tls_files import bcrypt_hash, make_tls_files, write_web_config


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return make_tls_files(tmp_path_factory.mktemp("tls"))


def write(path: Path, document: dict | str) -> Path:
    path.write_text(document if isinstance(document, str) else yaml.safe_dump(document))
    return path


def server(tls, **extra) -> dict:
    return {"tls_server_config": {"cert_file": str(tls.server_cert), "key_file": str(tls.server_key), **extra}}


# (file content, the key the error names, what it says). Each from exporter-toolkit's rules
# (web/tls_config.go, web/handler.go) or from what Python's ssl cannot honour (web_config.py's docstring).
def bad_files(tls) -> list[tuple[object, str, str]]:
    return [
        ("tls_server_config: [unclosed", "not valid YAML", ""),
        ({"tls_server_config": {}, "basic_auth_user": {}}, "basic_auth_user", "unknown key"),
        (server(tls, cert_fil="x"), "tls_server_config.cert_fil", "unknown key"),
        ({"http_server_config": {"http3": True}}, "http_server_config.http3", "unknown key"),
        ("basic_auth_users:\n  a: $2y$04$aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\n"
         "  a: $2y$04$aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\n", "not valid YAML", "given twice"),
        ({"basic_auth_users": {"prometheus": "secret"}}, "basic_auth_users.prometheus", "not a bcrypt hash"),
        ({"basic_auth_users": {"prometheus": "$2y$03$" + "a" * 53}}, "basic_auth_users.prometheus", "cost 04-31"),
        ({"basic_auth_users": ["prometheus"]}, "basic_auth_users", "must be a mapping"),
        (server(tls, min_version="TLS14"), "tls_server_config.min_version", "'TLS14' is not one of TLS10"),
        (server(tls, min_version="TLS13", max_version="TLS12"), "tls_server_config.min_version", "above max_version"),
        (server(tls, client_auth_type="RequireAndVerify"), "tls_server_config.client_auth_type", "is not one of"),
        (server(tls, client_auth_type="RequireAnyClientCert", client_ca_file=str(tls.ca)),
         "tls_server_config.client_auth_type", "without verifying them"),
        (server(tls, client_auth_type="RequireAndVerifyClientCert"), "tls_server_config.client_auth_type",
         "needs client_ca_file"),
        (server(tls, client_ca_file=str(tls.ca)), "tls_server_config.client_ca_file", "without a client_auth_type"),
        (server(tls, client_allowed_sans=["a"]), "tls_server_config.client_allowed_sans", "verified client certificate"),
        (server(tls, cipher_suites=["TLS_AES_128_GCM_SHA256"]), "tls_server_config.cipher_suites", "TLS 1.3 suite"),
        (server(tls, cipher_suites=["TLS_RSA_WITH_RC4_128_SHA"]), "tls_server_config.cipher_suites", "is not one of"),
        (server(tls, curve_preferences=["X25519", "CurveP256"]), "tls_server_config.curve_preferences", "one curve only"),
        (server(tls, curve_preferences=["P256"]), "tls_server_config.curve_preferences", "is not one of"),
        ({"tls_server_config": {"min_version": "TLS13"}}, "tls_server_config", "needs both cert_file and key_file"),
        ({"tls_server_config": {"cert": "PEM", "key": "PEM"}}, "tls_server_config.cert", "inline PEM is not supported"),
        (server(tls, cert_file="missing.pem"), "tls_server_config.cert_file", "cannot read"),
        (server(tls, cert_file=str(tls.server_key)), "tls_server_config.cert_file", "holds no PEM certificate"),
        (server(tls, key_file=str(tls.client_key)), "tls_server_config.key_file", "is not the key of cert_file"),
        ({"http_server_config": {"headers": {"Server": "x"}}}, "http_server_config.headers.Server", "can not be configured"),
        ({"http_server_config": {"headers": {"X-Frame-Options": "allow"}}}, "http_server_config.headers.X-Frame-Options",
         "must be one of deny, sameorigin"),
        ({"rate_limit": {"interval": "1 second", "burst": 5}}, "rate_limit.interval", "is not a duration"),
        ({"rate_limit": {"interval": 5, "burst": 5}}, "rate_limit.interval", "is not a duration"),
        ({"rate_limit": {"interval": "1s"}}, "rate_limit.burst", "at least 1"),
        ({"rate_limit": {"interval": "1s", "burst": 2, "per": "client"}}, "rate_limit.per", "unknown key"),
    ]


def test_every_bad_file_is_a_config_error_naming_the_file_and_the_key(tmp_path, tls):
    for number, (content, key, problem) in enumerate(bad_files(tls)):
        path = write(tmp_path / f"web-{number}.yml", content)
        with pytest.raises(ConfigError) as raised:
            load_web_config(path)
        message = str(raised.value)
        assert message.startswith(f"web config file {path}: "), message
        assert key in message and problem in message, message


def test_a_missing_file_names_it(tmp_path):
    with pytest.raises(ConfigError, match=f"web config file {tmp_path}/absent.yml: cannot read it"):
        load_web_config(tmp_path / "absent.yml")


def test_run_exits_78_on_a_bad_file_before_starting_anything(tmp_path, tls, capsys, monkeypatch):
    for name in [n for n in os.environ if n.startswith("HYBRIDMON_")]:
        monkeypatch.delenv(name)
    path = write(tmp_path / "web.yml", server(tls, min_version="TLS9"))
    assert cli.main(["run", "--listen", "127.0.0.1:1", "--web-config-file", str(path)]) == cli.EXIT_CONFIG == 78
    assert f"hybridmon: web config file {path}: tls_server_config.min_version: 'TLS9'" in capsys.readouterr().err


def test_the_key_comes_from_the_flag_the_environment_or_the_file():
    assert load_config(environ={"HYBRIDMON_WEB_CONFIG_FILE": "/etc/hybridmon/web.yml"}).web_config_file == "/etc/hybridmon/web.yml"
    assert load_config(environ={}, overrides={"web_config_file": "w.yml"}).web_config_file == "w.yml"
    assert load_config(environ={}).web_config_file is None


def test_relative_paths_resolve_against_the_files_folder(tmp_path, tls):
    folder = tmp_path / "etc"
    folder.mkdir()
    for source, name in ((tls.server_cert, "cert.pem"), (tls.server_key, "key.pem"), (tls.ca, "ca.pem")):
        (folder / name).write_bytes(source.read_bytes())
    path = write(folder / "web.yml", {"tls_server_config": {
        "cert_file": "cert.pem", "key_file": "key.pem", "client_ca_file": "ca.pem",
        "client_auth_type": "RequireAndVerifyClientCert"}})
    config = load_web_config(path)
    assert (config.tls.cert_file, config.tls.client_ca_file) == (folder / "cert.pem", folder / "ca.pem")


def test_the_policy_reaches_the_ssl_context(tmp_path, tls):
    path = write(tmp_path / "web.yml", server(
        tls, client_auth_type="RequireAndVerifyClientCert", client_ca_file=str(tls.ca), min_version="TLS13",
        cipher_suites=["TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256"], prefer_server_cipher_suites=False))
    context = WebConfigFile(path).server_context()
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert (context.minimum_version, context.maximum_version) == (ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_3)
    tls12_suites = [c["name"] for c in context.get_ciphers() if c["protocol"] == "TLSv1.2"]
    assert tls12_suites == ["ECDHE-RSA-AES128-GCM-SHA256"]
    assert not context.options & ssl.OP_CIPHER_SERVER_PREFERENCE
    assert len(context.get_ca_certs()) == 1


def test_exporter_toolkits_defaults_tls12_to_13_and_server_preference(tmp_path, tls):
    context = WebConfigFile(write(tmp_path / "web.yml", server(tls))).server_context()
    assert (context.minimum_version, context.maximum_version) == (ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3)
    assert context.verify_mode == ssl.CERT_NONE and context.options & ssl.OP_CIPHER_SERVER_PREFERENCE


def test_headers_are_kept_as_allowed_and_blank_means_unset(tmp_path):
    config = load_web_config(write(tmp_path / "web.yml", {"http_server_config": {"http2": False, "headers": {
        "X-Frame-Options": "sameorigin", "Strict-Transport-Security": "max-age=31536000", "X-XSS-Protection": ""}}}))
    assert set(config.headers) == {(b"x-frame-options", b"sameorigin"), (b"strict-transport-security", b"max-age=31536000")}


def basic(user: str, password: str) -> bytes:
    return b"Basic " + base64.b64encode(f"{user}:{password}".encode())


@pytest.fixture
def bcrypt_calls(monkeypatch):
    """Every bcrypt check BasicAuth runs: (password, hash)."""
    calls = []
    real = web_config.bcrypt.checkpw

    def counted(password, hashed):
        calls.append((password, hashed))
        return real(password, hashed)
    monkeypatch.setattr(web_config.bcrypt, "checkpw", counted)
    return calls


def check(auth: BasicAuth, users: dict, authorization: bytes | None) -> bool:
    return anyio.run(auth.allowed, users, authorization)


def test_basic_auth_accepts_only_the_right_password_of_a_known_user(bcrypt_calls):
    users = {"prometheus": bcrypt_hash("s3cret").encode()}
    auth = BasicAuth()
    assert check(auth, users, basic("prometheus", "s3cret"))
    for authorization in (basic("prometheus", "wrong"), basic("nobody", "s3cret"), basic("prometheus", ""),
                          b"Basic !!!", b"Bearer x", None, b"Basic " + base64.b64encode(b"no-colon"),
                          basic("prometheus", "x" * 100)):
        assert not check(auth, users, authorization), authorization


def test_a_repeated_password_costs_one_bcrypt_and_a_changed_hash_another(bcrypt_calls):
    users = {"prometheus": bcrypt_hash("s3cret").encode()}
    auth = BasicAuth()
    for _ in range(5):
        assert check(auth, users, basic("prometheus", "s3cret"))
        assert not check(auth, users, basic("prometheus", "wrong"))
    assert len(bcrypt_calls) == 2
    rotated = {"prometheus": bcrypt_hash("s3cret").encode()}  # a new salt: a new hash
    assert check(auth, rotated, basic("prometheus", "s3cret")) and len(bcrypt_calls) == 3
    assert not check(auth, {"other": rotated["prometheus"]}, basic("prometheus", "s3cret"))


def test_an_unknown_user_costs_a_bcrypt_of_the_configured_cost(bcrypt_calls):
    """Against user enumeration by timing (exporter-toolkit's fixed "fakepassword" hash)."""
    users = {"prometheus": bcrypt_hash("s3cret", rounds=5).encode()}
    assert not check(BasicAuth(), users, basic("nobody", "s3cret"))
    [(password, hashed)] = bcrypt_calls
    assert password == b"s3cret" and hashed != users["prometheus"] and hashed.startswith(b"$2b$05$")


def test_the_cache_keeps_no_password_in_plain_text(bcrypt_calls):
    auth = BasicAuth()
    check(auth, {"prometheus": bcrypt_hash("s3cret").encode()}, basic("prometheus", "s3cret"))
    assert all(b"s3cret" not in key for key in auth._verdicts)


def test_changed_users_and_certificates_are_read_again_and_a_broken_file_fails_closed(tmp_path, tls):
    path = write_web_config(tmp_path / "web.yml", tls=tls, users={"prometheus": "one"})
    source = WebConfigFile(path)
    started = source.server_context()
    first_users = source.current().users
    write_web_config(path, tls=tls, users={"prometheus": "two", "grafana": "three"})
    os.utime(path, ns=(0, 1))  # a new mtime however fast the rewrite was
    assert source.current().users.keys() == {"prometheus", "grafana"} and source.current().users != first_users
    assert source.server_context() is not started  # a new context for the next handshakes

    path.write_text("basic_auth_users: [")
    with pytest.raises(ConfigError, match="not valid YAML"):
        source.current()
    write_web_config(path, tls=tls, users={"prometheus": "four"})
    assert set(source.current().users) == {"prometheus"}


def test_client_allowed_sans_match_dns_ip_email_or_uri_exactly(tmp_path, tls):
    path = write(tmp_path / "web.yml", server(tls, client_auth_type="RequireAndVerifyClientCert",
                                              client_ca_file=str(tls.ca),
                                              client_allowed_sans=["client@hybridmon.test", "2001:db8::1"]))
    source = WebConfigFile(path)
    assert source.peer_allowed({"subjectAltName": (("email", "client@hybridmon.test"),)})
    assert source.peer_allowed({"subjectAltName": (("IP Address", "2001:DB8:0:0:0:0:0:1"),)})
    assert not source.peer_allowed({"subjectAltName": (("DNS", "client.hybridmon.test"),)})
    assert not source.peer_allowed(None)


def handshake(server_context: ssl.SSLContext, client_context: ssl.SSLContext) -> str | None:
    """One TLS handshake over a socket pair: None when it succeeded, else the server's error."""
    server_side, client_side = socket.socketpair()
    failures = []

    def serve():
        try:
            with server_context.wrap_socket(server_side, server_side=True) as tls_server:
                tls_server.recv(1)
        except (ssl.SSLError, OSError) as error:
            failures.append(str(error))
    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with client_context.wrap_socket(client_side, server_hostname="127.0.0.1") as tls_client:
            tls_client.send(b"x")
    except (ssl.SSLError, OSError):
        pass
    thread.join(10)
    return failures[0] if failures else None


def test_curve_preferences_limit_the_key_exchange_to_that_curve(tmp_path, tls):
    """Python 3.11 on OpenSSL 3 sets the one curve as the only group (set_ecdh_curve)."""
    server_context = WebConfigFile(write(tmp_path / "web.yml", server(tls, curve_preferences=["X25519"]))).server_context()
    for client_curve, fails in (("X25519", False), ("prime256v1", True)):
        client = ssl.create_default_context(cafile=tls.ca)
        client.set_ecdh_curve(client_curve)
        error = handshake(server_context, client)
        assert (error is not None) == fails, (client_curve, error)


async def plain_route(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"x-frame-options", b"DENY")]})
    await send({"type": "http.response.body", "body": b"ok"})


def get(app, path: str = "/metrics", auth: tuple[str, str] | None = None) -> httpx.Response:
    async def request() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://agent") as client:
            return await client.get(path, auth=auth)
    return anyio.run(request)


def test_the_middleware_sets_the_files_headers_guards_every_path_and_fails_closed(tmp_path):
    path = write(tmp_path / "web.yml", {
        "http_server_config": {"headers": {"X-Frame-Options": "sameorigin", "Strict-Transport-Security": "max-age=60"}},
        "basic_auth_users": {"prometheus": bcrypt_hash("s3cret")}})
    app = WebConfigMiddleware(plain_route, WebConfigFile(path))
    answer = get(app, auth=("prometheus", "s3cret"))
    assert answer.status_code == 200 and answer.headers.get_list("x-frame-options") == ["sameorigin"]
    assert answer.headers["strict-transport-security"] == "max-age=60"
    for route in ("/metrics", "/healthz", "/", "/runbooks/HybridmonAgentDown"):
        refused = get(app, route, auth=("prometheus", "guess"))
        assert (refused.status_code, refused.text, refused.headers["www-authenticate"]) == (401, "Unauthorized\n", "Basic")
    path.write_text("basic_auth_users: {prometheus: not-a-hash}\n")
    broken = get(app, auth=("prometheus", "s3cret"))
    assert (broken.status_code, broken.text) == (500, "Internal Server Error\n")  # the file's problem goes to the log only


def test_rate_limit_reads_go_durations_and_interval_zero_turns_it_off(tmp_path):
    def rate_limit(section: dict):
        return load_web_config(write(tmp_path / "web.yml", {"rate_limit": section})).rate_limit
    assert rate_limit({"interval": "1m30s", "burst": 3}) == (90.0, 3)
    assert rate_limit({"interval": "250ms", "burst": 1}) == (0.25, 1)
    assert rate_limit({"interval": "0", "burst": 0}) is None and rate_limit({}) is None


def test_the_token_bucket_starts_full_and_refills_one_token_per_interval():
    now = [100.0]
    bucket = TokenBucket(interval=2.0, burst=3, clock=lambda: now[0])
    assert [bucket.allow() for _ in range(4)] == [True, True, True, False]
    now[0] += 1.0
    assert not bucket.allow()
    now[0] += 1.0
    assert [bucket.allow(), bucket.allow()] == [True, False]
    now[0] += 60.0  # no more than the burst is saved up
    assert [bucket.allow() for _ in range(4)] == [True, True, True, False]


def test_a_request_past_the_rate_limit_is_429_before_any_password_is_checked(tmp_path, bcrypt_calls):
    path = write(tmp_path / "web.yml", {"rate_limit": {"interval": "1h", "burst": 2},
                                        "basic_auth_users": {"prometheus": bcrypt_hash("s3cret")}})
    app = WebConfigMiddleware(plain_route, WebConfigFile(path))
    assert [get(app, auth=("prometheus", "s3cret")).status_code for _ in range(2)] == [200, 200]
    limited = get(app, auth=("prometheus", "guess"))
    assert (limited.status_code, limited.text) == (429, "Too Many Requests\n") and len(bcrypt_calls) == 1
