"""--web-config-file: TLS and basic auth from prometheus/exporter-toolkit's web configuration file.

The file is the one node_exporter, Alertmanager and every exporter-toolkit server read
(docs/web-configuration.md there), taken unchanged, so one Secret serves them all. Its semantics are
exporter-toolkit's (web/tls_config.go, web/handler.go, web/cache.go at 19a7c2d), with these
differences, each stricter and each refused at start with a ConfigError rather than ignored:
- client_auth_type RequestClientCert / RequireAnyClientCert (and its old name RequireClientCert)
  accept a client certificate without verifying it; Python's ssl can only verify what it asks for.
  exporter-toolkit's own docs call them insecure: use VerifyClientCertIfGiven or
  RequireAndVerifyClientCert, which need client_ca_file (Go would fall back on the system's CAs).
- cert / key (inline PEM) are refused: Python's ssl loads a certificate chain from files only.
  client_ca (inline) works (load_verify_locations(cadata=...)).
- cipher_suites names TLS 1.2 suites only: TLS 1.3's are not configurable, in Go either.
- curve_preferences holds one curve: Python 3.11's ssl sets a single one (set_ecdh_curve).
- client_allowed_sans needs a verified client certificate (a verifying client_auth_type).
- a tls_server_config with neither cert_file nor key_file but other keys (min_version alone) is an
  error, where exporter-toolkit silently serves plain HTTP.
- rate_limit's burst must be at least 1 (Go's limiter with burst 0 refuses every request).
- a duplicated key is an error, as in Go's yaml.UnmarshalStrict.
Accepted, with less effect: http_server_config.http2 (the server speaks HTTP/1.1 only, h11, which
every Prometheus scrapes over), and min_version TLS10 or TLS11 (OpenSSL 3 at Python's security level
2 has no cipher for TLS 1.0/1.1, a TLS 1.0 client ends in NO_SHARED_CIPHER: TLS 1.2 is the real
minimum).

What changes while running, as exporter-toolkit re-reads the file per request and per handshake:
the file and every file it names are looked at (stat) on each request and TLS handshake and re-read
when one changed, so rotated certificates (cert-manager, a Kubernetes Secret) and changed users take
effect on the next connection without a restart. A file that turns bad fails closed, as in
exporter-toolkit: requests get 500 and handshakes an alert, until it is fixed. The TLS policy (client
auth type, versions, ciphers, curve, allowed SANs) is set on each connection from the context the
server started with, and rate_limit's limiter is made at start (as exporter-toolkit makes it); a
change to either is logged as needing a restart.
"""
from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import ipaddress
import logging
import os
import re
import secrets
import ssl
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.to_thread
import bcrypt
import yaml

from hybridmon.agent.config import ConfigError

log = logging.getLogger(__name__)

TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
# exporter-toolkit's defaults (getConfig): TLS 1.2 to 1.3.
DEFAULT_MIN_VERSION, DEFAULT_MAX_VERSION = "TLS12", "TLS13"
# The client auth types Python's ssl can honour, as Go's crypto/tls defines them.
CLIENT_AUTH_TYPES = {"NoClientCert": ssl.CERT_NONE, "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
                     "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}
UNVERIFIED_CLIENT_AUTH_TYPES = ("RequestClientCert", "RequireAnyClientCert", "RequireClientCert")
# Go's tls.CipherSuites() names for TLS 1.2 (IANA's) -> OpenSSL's, from `openssl ciphers -stdname`
# (OpenSSL 3.0). Go 1.22 moved the RSA key exchange suites to InsecureCipherSuites, which
# exporter-toolkit does not accept either.
CIPHER_SUITES = {
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
}
TLS13_CIPHER_SUITES = ("TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256")
# Go's curve names (exporter-toolkit's `curves`) -> OpenSSL's.
CURVES = {"CurveP256": "prime256v1", "CurveP384": "secp384r1", "CurveP521": "secp521r1", "X25519": "X25519"}
# exporter-toolkit's extraHTTPHeaders: the headers a file may set, and their allowed values (None: any).
SETTABLE_HEADERS = {"Strict-Transport-Security": None, "X-Content-Type-Options": ("nosniff",),
                    "X-Frame-Options": ("deny", "sameorigin"), "X-XSS-Protection": None,
                    "Content-Security-Policy": None}
TOP_KEYS = ("tls_server_config", "http_server_config", "basic_auth_users", "rate_limit")
RATE_LIMIT_KEYS = ("interval", "burst")
# Go's time.ParseDuration, which yaml.v2 reads a time.Duration with: "1s", "250ms", "1m30s".
GO_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
GO_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
TLS_KEYS = ("cert", "key", "client_ca", "cert_file", "key_file", "client_auth_type", "client_ca_file",
            "client_allowed_sans", "min_version", "max_version", "cipher_suites",
            "prefer_server_cipher_suites", "curve_preferences")
HTTP_KEYS = ("http2", "headers")
# A bcrypt hash as golang.org/x/crypto/bcrypt and pyca's bcrypt both read it: $2a$, $2b$ or $2y$
# (htpasswd -B writes 2y), a two-digit cost from 4 to 31, then 22 characters of salt and 31 of hash.
BCRYPT_HASH = re.compile(r"\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}")
MIN_BCRYPT_COST, MAX_BCRYPT_COST = 4, 31
# Verdicts remembered (exporter-toolkit's cacheSize): a few scrapers, each with one password.
VERDICT_CACHE_SIZE = 100


@dataclass(frozen=True)
class TlsPolicy:
    """What is set once per server (per connection, from the context it started with)."""

    client_auth_type: str = "NoClientCert"
    min_version: str = DEFAULT_MIN_VERSION
    max_version: str = DEFAULT_MAX_VERSION
    cipher_suites: tuple[str, ...] = ()
    prefer_server_cipher_suites: bool = True
    curve: str | None = None
    client_allowed_sans: tuple[str, ...] | None = None


@dataclass(frozen=True)
class TlsServerConfig:
    cert_file: Path
    key_file: Path
    client_ca_file: Path | None
    client_ca_text: str | None
    policy: TlsPolicy


@dataclass(frozen=True)
class WebConfig:
    """One reading of the file. users: name -> bcrypt hash (bytes)."""

    path: Path
    tls: TlsServerConfig | None = None
    headers: tuple[tuple[bytes, bytes], ...] = ()
    users: dict[str, bytes] = field(default_factory=dict)
    # rate_limit: (seconds between requests, burst); None: no limit (absent, or interval 0).
    rate_limit: tuple[float, int] | None = None

    def files(self) -> tuple[Path, ...]:
        """The file and the files it names: a change to any of them is a new reading."""
        named = () if self.tls is None else (self.tls.cert_file, self.tls.key_file, self.tls.client_ca_file)
        return (self.path, *(path for path in named if path is not None))


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader refusing a key given twice (Go's yaml.UnmarshalStrict does; PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _value in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_web_config(path: str | os.PathLike) -> WebConfig:
    """Read and check the file and the certificates it names; ConfigError naming the file and key."""
    return _load(Path(path))[0]


def _load(path: Path) -> tuple[WebConfig, ssl.SSLContext | None]:
    """The file's settings and, with TLS, the server context they make (loading it checks the files)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"web config file {path}: cannot read it: {error}") from None
    config = parse_web_config(text, path)
    return config, None if config.tls is None else build_ssl_context(config.tls, path)


def parse_web_config(text: str, path: Path) -> WebConfig:
    """The file's settings, every key checked; relative paths resolve against the file's folder."""
    def fail(key: str, problem: str) -> ConfigError:
        return ConfigError(f"web config file {path}: {key}: {problem}")

    try:
        document = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as error:
        raise ConfigError(f"web config file {path}: not valid YAML: {error}") from None
    document = {} if document is None else document
    _mapping(document, "(top level)", TOP_KEYS, fail)
    rate_limit = _rate_limit(_mapping(document.get("rate_limit"), "rate_limit", RATE_LIMIT_KEYS, fail), fail)
    headers = _headers(_mapping(document.get("http_server_config"), "http_server_config", HTTP_KEYS, fail), fail)
    users = _users(document.get("basic_auth_users"), fail)
    tls_section = _mapping(document.get("tls_server_config"), "tls_server_config", TLS_KEYS, fail)
    tls = _tls(tls_section, path.parent, fail) if tls_section else None
    return WebConfig(path=path, tls=tls, headers=headers, users=users, rate_limit=rate_limit)


def _mapping(value, key: str, known: tuple[str, ...], fail) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise fail(key, f"must be a mapping, not {value!r}")
    unknown = [name for name in value if name not in known]
    if unknown:
        raise fail(f"{key}.{unknown[0]}" if key != "(top level)" else str(unknown[0]),
                   f"unknown key; known: {', '.join(known)}")
    return value


def _rate_limit(section: dict, fail) -> tuple[float, int] | None:
    interval = section.get("interval", 0)
    if interval in (0, "0"):
        return None
    parts = GO_DURATION_PART.findall(interval) if isinstance(interval, str) else []
    if not parts or "".join(number + unit for number, unit in parts) != interval:
        raise fail("rate_limit.interval", f"{interval!r} is not a duration such as 1s, 250ms or 1m30s")
    seconds = sum(float(number) * GO_DURATION_UNITS[unit] for number, unit in parts)
    burst = section.get("burst", 0)
    if not isinstance(burst, int) or isinstance(burst, bool) or burst < 1:
        raise fail("rate_limit.burst", f"must be a whole number of requests, at least 1, not {burst!r} "
                   "(with 0 every request would be refused)")
    return (seconds, burst) if seconds > 0 else None


def _headers(section: dict, fail) -> tuple[tuple[bytes, bytes], ...]:
    if section.get("http2") not in (None, True, False):
        raise fail("http_server_config.http2", "must be true or false")
    headers = section.get("headers") or {}
    if not isinstance(headers, dict):
        raise fail("http_server_config.headers", "must be a mapping of header name to value")
    settable = []
    for name, value in headers.items():
        key = f"http_server_config.headers.{name}"
        if name not in SETTABLE_HEADERS:
            raise fail(key, f"this header can not be configured; these can: {', '.join(SETTABLE_HEADERS)}")
        if not isinstance(value, str) or "\n" in value or "\r" in value:
            raise fail(key, "must be a one-line string")
        allowed = SETTABLE_HEADERS[name]
        if allowed is not None and value not in allowed:
            raise fail(key, f"must be one of {', '.join(allowed)}, not {value!r}")
        if value:  # "Unset if blank"
            settable.append((name.lower().encode(), value.encode()))
    return tuple(settable)


def _users(section, fail) -> dict[str, bytes]:
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise fail("basic_auth_users", "must be a mapping of user name to bcrypt hash")
    users = {}
    for name, hashed in section.items():
        key = f"basic_auth_users.{name}"
        if not isinstance(name, str) or ":" in name:
            raise fail(key, "a user name is a string without ':' (basic auth splits at the first ':')")
        match = BCRYPT_HASH.fullmatch(hashed) if isinstance(hashed, str) else None
        if match is None or not MIN_BCRYPT_COST <= int(match.group(1)) <= MAX_BCRYPT_COST:
            raise fail(key, "not a bcrypt hash ($2a$, $2b$ or $2y$, cost 04-31; make one with "
                       "`htpasswd -nBC 10 \"\" | tr -d ':\\n'`)")
        users[name] = hashed.encode()
    return users


def _tls(section: dict, directory: Path, fail) -> TlsServerConfig:
    def text_list(key: str, known: dict | None = None) -> tuple[str, ...]:
        value = section.get(key) or []
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise fail(f"tls_server_config.{key}", "must be a list of strings")
        for item in value:
            if known is not None and item not in known:
                raise fail(f"tls_server_config.{key}", f"{item!r} is not one of {', '.join(known)}")
        return tuple(value)

    def file(key: str) -> Path | None:
        value = section.get(key)
        if value in (None, ""):
            return None
        if not isinstance(value, str):
            raise fail(f"tls_server_config.{key}", "must be a file name")
        return directory / value  # an absolute value stays itself (config_util.JoinDir does the same)

    for inline, instead in (("cert", "cert_file"), ("key", "key_file")):
        if section.get(inline):
            raise fail(f"tls_server_config.{inline}", f"inline PEM is not supported (Python's ssl loads a "
                       f"certificate chain from files); put it in a file and name it in {instead}")
    cert_file, key_file = file("cert_file"), file("key_file")
    if cert_file is None or key_file is None:
        raise fail("tls_server_config", "needs both cert_file and key_file (without them exporter-toolkit "
                   "would silently serve plain HTTP)")
    client_ca_file = file("client_ca_file")
    client_ca_text = section.get("client_ca") or None
    if client_ca_text is not None and not isinstance(client_ca_text, str):
        raise fail("tls_server_config.client_ca", "must be PEM text")
    if client_ca_file and client_ca_text:
        raise fail("tls_server_config.client_ca", "give client_ca or client_ca_file, not both")

    auth = section.get("client_auth_type") or "NoClientCert"
    if auth in UNVERIFIED_CLIENT_AUTH_TYPES:
        raise fail("tls_server_config.client_auth_type", f"{auth} accepts client certificates without "
                   "verifying them, which Python's ssl cannot do (exporter-toolkit's docs call it insecure); "
                   "use VerifyClientCertIfGiven or RequireAndVerifyClientCert with client_ca_file")
    if auth not in CLIENT_AUTH_TYPES:
        raise fail("tls_server_config.client_auth_type", f"{auth!r} is not one of {', '.join(CLIENT_AUTH_TYPES)}")
    has_ca = client_ca_file is not None or client_ca_text is not None
    if has_ca and auth == "NoClientCert":
        raise fail("tls_server_config.client_ca_file", "client CAs are configured without a client_auth_type "
                   "(as exporter-toolkit refuses)")
    if auth != "NoClientCert" and not has_ca:
        raise fail("tls_server_config.client_auth_type", f"{auth} needs client_ca_file: the CA client "
                   "certificates must chain to")

    versions = {}
    for key, default in (("min_version", DEFAULT_MIN_VERSION), ("max_version", DEFAULT_MAX_VERSION)):
        versions[key] = section.get(key) or default
        if versions[key] not in TLS_VERSIONS:
            raise fail(f"tls_server_config.{key}", f"{versions[key]!r} is not one of {', '.join(TLS_VERSIONS)}")
    if TLS_VERSIONS[versions["min_version"]] > TLS_VERSIONS[versions["max_version"]]:
        raise fail("tls_server_config.min_version", f"{versions['min_version']} is above max_version "
                   f"{versions['max_version']}")

    suites = text_list("cipher_suites")
    for suite in suites:
        if suite in TLS13_CIPHER_SUITES:
            raise fail("tls_server_config.cipher_suites", f"{suite} is a TLS 1.3 suite, which is not "
                       "configurable (in Go either); list TLS 1.2 suites only")
        if suite not in CIPHER_SUITES:
            raise fail("tls_server_config.cipher_suites", f"{suite!r} is not one of {', '.join(CIPHER_SUITES)}")
    curves = text_list("curve_preferences", CURVES)
    if len(curves) > 1:
        raise fail("tls_server_config.curve_preferences", "hybridmon can honour one curve only (Python 3.11's "
                   "ssl sets a single one); list just the one to use")
    prefer = section.get("prefer_server_cipher_suites", True)
    if not isinstance(prefer, bool):
        raise fail("tls_server_config.prefer_server_cipher_suites", "must be true or false")
    sans = text_list("client_allowed_sans") if "client_allowed_sans" in section else None
    if sans is not None and auth == "NoClientCert":
        raise fail("tls_server_config.client_allowed_sans", "needs a verified client certificate: set "
                   "client_auth_type to RequireAndVerifyClientCert (or VerifyClientCertIfGiven)")
    policy = TlsPolicy(client_auth_type=auth, min_version=versions["min_version"],
                       max_version=versions["max_version"], cipher_suites=suites,
                       prefer_server_cipher_suites=prefer, curve=curves[0] if curves else None,
                       client_allowed_sans=sans)
    return TlsServerConfig(cert_file, key_file, client_ca_file, client_ca_text, policy)


def build_ssl_context(tls: TlsServerConfig, path: Path) -> ssl.SSLContext:
    """A server context for `tls`; ConfigError naming the key whose file cannot be used."""
    def fail(key: str, problem: str) -> ConfigError:
        return ConfigError(f"web config file {path}: tls_server_config.{key}: {problem}")

    policy = tls.policy
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = TLS_VERSIONS[policy.min_version]
    context.maximum_version = TLS_VERSIONS[policy.max_version]
    for key, file, marker in (("cert_file", tls.cert_file, "CERTIFICATE-----"), ("key_file", tls.key_file, "PRIVATE KEY-----")):
        try:
            if marker not in file.read_text(errors="replace"):
                raise fail(key, f"{file} holds no PEM {'certificate' if key == 'cert_file' else 'private key'}")
        except OSError as error:
            raise fail(key, f"cannot read {file}: {error.strerror or error}") from None
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    except ssl.SSLError as error:
        if error.reason == "KEY_VALUES_MISMATCH":
            raise fail("key_file", f"{tls.key_file} is not the key of cert_file {tls.cert_file}") from None
        raise fail("cert_file", f"cannot load {tls.cert_file} with key_file {tls.key_file}: {error}") from None
    if policy.cipher_suites:
        context.set_ciphers(":".join(CIPHER_SUITES[suite] for suite in policy.cipher_suites))
    if policy.curve is not None:
        context.set_ecdh_curve(CURVES[policy.curve])
    if policy.prefer_server_cipher_suites:
        context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    else:
        context.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    context.verify_mode = CLIENT_AUTH_TYPES[policy.client_auth_type]
    try:
        if tls.client_ca_file is not None:
            context.load_verify_locations(cafile=tls.client_ca_file)
        elif tls.client_ca_text is not None:
            context.load_verify_locations(cadata=tls.client_ca_text)
    except (OSError, ssl.SSLError) as error:
        key = "client_ca_file" if tls.client_ca_file is not None else "client_ca"
        raise fail(key, f"cannot load the client CA: {error}") from None
    return context


def _signature(paths: tuple[Path, ...]) -> tuple:
    """What tells a changed file: a rotated Secret swaps a symlink (a new inode), cert-manager or an
    editor rewrites (new mtime or size)."""
    marks = []
    for path in paths:
        try:
            stat = path.stat()
            marks.append((stat.st_ino, stat.st_mtime_ns, stat.st_size))
        except OSError as error:
            marks.append(error.errno)
    return tuple(marks)


class WebConfigFile:
    """The web config file as it is now: re-read, and its TLS context rebuilt, when a file changed."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.config, self._context = _load(self.path)
        self._signature = _signature(self.config.files())
        self._broken: ConfigError | None = None
        self.started_policy = None if self.config.tls is None else self.config.tls.policy
        # Made once, as exporter-toolkit's Serve makes its limiter.
        self.limiter = None if self.config.rate_limit is None else TokenBucket(*self.config.rate_limit)
        if self.config.tls is None and not self.config.users:
            log.warning("web config file %s turns on neither TLS nor basic auth", self.path)

    @property
    def tls(self) -> bool:
        return self._context is not None

    def current(self) -> WebConfig:
        """The config now; ConfigError while the file (or a file it names) is bad."""
        signature = _signature(self.config.files())
        if signature != self._signature:
            self._reload(signature)
        if self._broken is not None:
            raise self._broken
        return self.config

    def _reload(self, signature: tuple) -> None:
        self._signature = signature
        try:
            config, context = _load(self.path)
        except ConfigError as error:
            self._broken = error
            log.error("%s; refusing requests until it is fixed", error)
            return
        self._broken = None
        self.config = config
        # The file may now name other files: watch those from here on.
        self._signature = _signature(config.files())
        policy = None if config.tls is None else config.tls.policy
        if policy != self.started_policy:
            log.warning("web config file %s changed its TLS settings (tls_server_config other than the "
                        "certificate, key and client CA): restart hybridmon to apply them", self.path)
        if config.rate_limit != (None if self.limiter is None else (self.limiter.interval, self.limiter.burst)):
            log.warning("web config file %s changed rate_limit: restart hybridmon to apply it", self.path)
        if context is not None and self._context is not None:
            self._context = context
        log.info("web config file %s re-read", self.path)

    def server_context(self) -> ssl.SSLContext | None:
        """The context the server listens with, None without TLS. Each handshake swaps in the
        current one (for its certificate and client CA), the policy stays this one's."""
        context = self._context
        if context is not None:
            context.sni_callback = self._on_handshake
        return context

    def _on_handshake(self, ssl_object: ssl.SSLObject, _server_name: str | None, _context) -> int | None:
        # OpenSSL calls this for every ClientHello, with or without SNI (None then).
        try:
            self.current()
        except ConfigError:
            return ssl.ALERT_DESCRIPTION_INTERNAL_ERROR
        if self._context is not None:
            ssl_object.context = self._context
        return None

    def peer_allowed(self, peer_certificate: dict | None) -> bool:
        """client_allowed_sans: the verified client certificate names one of them (exporter-toolkit's
        VerifyPeerCertificate: DNS, IP, e-mail or URI SANs, exact match). True without the setting."""
        allowed = self.started_policy.client_allowed_sans if self.started_policy else None
        if allowed is None:
            return True
        names = {_san_text(kind, value) for kind, value in (peer_certificate or {}).get("subjectAltName", ())}
        return any(_san_text("", name) in names for name in allowed)


def _san_text(kind: str, value: str) -> str:
    # Python writes IPv6 addresses uncompressed and upper case, Go compressed: compare parsed.
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        return value


class TokenBucket:
    """golang.org/x/time/rate's Limiter as exporter-toolkit uses it (Allow): a token every `interval`
    seconds, at most `burst` kept, full at start; a request without a token is answered 429."""

    def __init__(self, interval: float, burst: int, clock=time.monotonic) -> None:
        self.interval, self.burst, self.clock = interval, burst, clock
        self.tokens = float(burst)
        self.updated = clock()

    def allow(self) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.updated) / self.interval)
        self.updated = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class BasicAuth:
    """Checks basic auth passwords against bcrypt hashes as exporter-toolkit's webHandler does.

    - A user not in the file is checked against a hash of the same cost, so an answer's time does not
      tell which names exist (exporter-toolkit uses a fixed cost-10 hash; the configured cost is
      closer).
    - Verdicts are remembered (VERDICT_CACHE_SIZE), keyed by user, hash and password, so a scraper's
      repeated password costs one bcrypt, not one per scrape (a cost-10 check is ~70 ms of CPU). The
      key is an HMAC under a random per-process key, where exporter-toolkit keeps the plain text.
    - One bcrypt runs at a time (exporter-toolkit's bcryptMtx), in a worker thread, so that guesses
      queue up behind each other instead of taking every core or the event loop.
    """

    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)
        self._verdicts: OrderedDict[bytes, bool] = OrderedDict()
        self._one_at_a_time = anyio.Lock()

    async def allowed(self, users: dict[str, bytes], authorization: bytes | None) -> bool:
        credentials = _basic_credentials(authorization)
        if credentials is None:
            return False
        user, password = credentials
        stored = users.get(user)
        unknown_user_cost = max(_cost(hashed) for hashed in users.values())
        key = hmac.new(self._key, b"\0".join((user.encode(), stored or b"unknown", password)), hashlib.sha256).digest()
        verdict = self._verdicts.get(key)
        if verdict is None:
            async with self._one_at_a_time:
                verdict = await anyio.to_thread.run_sync(_password_matches, password, stored, unknown_user_cost)
            self._verdicts[key] = verdict
            while len(self._verdicts) > VERDICT_CACHE_SIZE:
                self._verdicts.popitem(last=False)
        return verdict and stored is not None


def _basic_credentials(authorization: bytes | None) -> tuple[str, bytes] | None:
    """(user, password) of an `Authorization: Basic` header, as Go's Request.BasicAuth reads it."""
    if not authorization or authorization[:6].lower() != b"basic ":
        return None
    try:
        decoded = base64.b64decode(authorization[6:], validate=True)
        user, colon, password = decoded.partition(b":")
        return (user.decode(), password) if colon else None
    except (binascii.Error, UnicodeDecodeError):
        return None


def _cost(hashed: bytes) -> int:
    return int(hashed[4:6])


@functools.lru_cache(maxsize=4)
def _unknown_user_hash(cost: int) -> bytes:
    return bcrypt.hashpw(secrets.token_bytes(16), bcrypt.gensalt(cost))


def _password_matches(password: bytes, hashed: bytes | None, unknown_user_cost: int) -> bool:
    """bcrypt's check, in a worker thread; for a user not in the file, against a hash made (once per
    cost) with the same cost as the file's, which takes as long."""
    try:
        return bcrypt.checkpw(password, hashed or _unknown_user_hash(unknown_user_cost))
    except ValueError:  # bcrypt 5 refuses passwords over 72 bytes; no stored password is one
        return False


UNAUTHORIZED = (401, b"Unauthorized\n", ((b"www-authenticate", b"Basic"),))
TOO_MANY = (429, b"Too Many Requests\n", ())
BROKEN = (500, b"Internal Server Error\n", ())


class WebConfigMiddleware:
    """ASGI middleware: every route behind basic auth (when the file has users), the file's headers on
    every answer. Plain ASGI, like ProtectiveHeaders (agent/api/server.py), which sits outside it so
    that a 401 carries the protective headers too."""

    def __init__(self, app, source: WebConfigFile) -> None:
        self.app = app
        self.source = source
        self.auth = BasicAuth()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            config = self.source.current()
        except ConfigError:
            await _answer(send, *BROKEN)
            return
        # exporter-toolkit's order: the limit before the headers and the password check.
        if self.source.limiter is not None and not self.source.limiter.allow():
            await _answer(send, *TOO_MANY)
            return
        if config.headers:
            send = _with_headers(send, config.headers)
        if config.users:
            authorization = next((value for name, value in scope["headers"] if name == b"authorization"), None)
            if not await self.auth.allowed(config.users, authorization):
                await _answer(send, *UNAUTHORIZED)
                return
        await self.app(scope, receive, send)


def _with_headers(send, headers: tuple[tuple[bytes, bytes], ...]):
    names = {name for name, _ in headers}

    async def send_with_headers(message) -> None:
        if message["type"] == "http.response.start":
            kept = [(name, value) for name, value in message.get("headers", ()) if name.lower() not in names]
            message = {**message, "headers": kept + list(headers)}
        await send(message)
    return send_with_headers


async def _answer(send, status: int, body: bytes, extra_headers: tuple) -> None:
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode()),
               *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
