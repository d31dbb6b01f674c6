"""The agent's configuration: one TOML file, then HYBRIDMON_* environment variables, then flags.

Every layer is optional; with none at all the agent runs on its defaults. Validation errors name the
key, the bad value and where it came from.

Why not pydantic-settings for the file + environment overlay (tried, 2.16): it merges the sources
before validating, so an error can no longer say whether the bad value came from the file, the
environment or a flag; it silently ignores a HYBRIDMON_* variable that matches no key (a typo such
as HYBRIDMON_INTERVL_SECONDS would be lost, here it is refused); and `HYBRIDMON_PATHS=x` beside
`HYBRIDMON_PATHS__PROCFS` ends in its SettingsError "error parsing value for field paths", which
names neither variable. The overlay below is short and keeps those guarantees.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator
from pydantic_core import PydanticCustomError

from hybridmon.exporters.base import MIN_HTTP_TIMEOUT_SECONDS, CollectorSettings
from hybridmon.exporters.registry import COLLECTORS, NAMES as COLLECTOR_NAMES, registration
from hybridmon.rules.runbook_links import runbook_base_url

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

ENV_PREFIX = "HYBRIDMON_"
TEST_DOUBLE_PREFIXES = (ENV_PREFIX + "FAKE_", ENV_PREFIX + "STUB_")
DEFAULT_LISTEN = "127.0.0.1:9787"

# Lower bounds of the intervals and timeouts: below these the agent only burns a core (a tick of
# 1e-9 s is a busy loop) without seeing anything more. Each says what the source can do. The bounds
# of the collectors' own settings (discovery, scrape timeout) are in exporters/base.py.
# A tick reads NVML's PCIe throughput counters, each "querying a byte counter over a 20ms interval",
# two per GPU, so a GPU costs ~40 ms per tick (docs/nvml-cost.md); /proc and sysfs reads take a few
# ms more. Under 100 ms a tick cannot finish before the next one is due.
MIN_TICK_SECONDS = 0.1
# The detectors judge windows of 1 min and more, sampled at the tick: evaluating them more than once
# a second finds nothing new.
MIN_EVALUATION_SECONDS = 1.0
# Alertmanager groups alerts over group_wait (30 s by default); a push is one HTTP request per URL.
MIN_PUSH_SECONDS = 1.0
# The benchmark creates a CUDA context (hundreds of ms) and times copies of up to 256 MiB.
MIN_BENCH_SECONDS = 1.0


class ConfigError(Exception):
    """The configuration is not usable; the message says which key and why."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PathsConfig(_Strict):
    procfs: str = "/proc"
    sysfs: str = "/sys"


class CollectorConfig(_Strict):
    enabled: bool = True
    interval_seconds: float | None = Field(
        default=None, ge=MIN_TICK_SECONDS, le=3600, description="None: the collector's own default"
    )


class DetectorsConfig(_Strict):
    enabled: bool = True
    thresholds_file: str | None = Field(
        default=None, description="None: the thresholds.toml shipped with hybridmon"
    )
    # 15 s: the evaluation_interval of the Prometheus the project ships (deploy/prometheus) and of
    # its rule tests, so the findings move in step with the rules; every alert waits a `for` of a
    # minute or more. Evaluations were a sixth of the daemon's CPU (issue 33): 10 s cost 0.6 ms/s more.
    evaluation_interval_seconds: float = Field(default=15.0, ge=MIN_EVALUATION_SECONDS, le=600)


# The error type of a secret written into the configuration itself: its message says where to put
# it instead, and _describe never repeats the value.
INLINE_SECRET = "inline_secret"
# Keys under [alerting.http_config] that Prometheus's http_config accepts with the secret inline
# (prometheus/common config/http_config.go: BasicAuth.Password, Authorization.Credentials,
# TLSConfig.Key, the deprecated bearer_token), and the file key the agent takes instead.
INLINE_SECRET_KEYS = {
    "basic_auth.password": "basic_auth.password_file",
    "authorization.credentials": "authorization.credentials_file",
    "bearer_token": "authorization.credentials_file",
    "tls_config.key": "tls_config.key_file",
}
HTTP_CONFIG_KEY = "alerting.http_config"
# Why the agent refuses what Prometheus allows: the TOML file is world-readable on most hosts
# (deploy/README.md installs it 0644), a HYBRIDMON_* variable is in /proc/<pid>/environ and in the
# pod spec, and a Kubernetes Secret or systemd's LoadCredential= hand a secret over as a file anyway.
WHY_FILES_ONLY = ("secrets are read from files only: the configuration file and HYBRIDMON_* variables "
                  "are readable by more people than the secret should be")
# TLS versions as Prometheus's tls_config names them (TLSVersions in config/http_config.go).
TLS_VERSIONS = ("TLS10", "TLS11", "TLS12", "TLS13")


class BasicAuthConfig(_Strict):
    """[alerting.http_config.basic_auth], as Prometheus's <basic_auth> less the inline password."""

    username: str = Field(description="the basic-auth user name (not a secret: it is in the configuration)")
    password_file: str = Field(description="file holding the password (surrounding whitespace is trimmed, "
                               "as Prometheus does); read again when it changes")

    @field_validator("username")
    @classmethod
    def _no_colon(cls, username: str) -> str:
        if ":" in username:  # RFC 7617 section 2: the user-id cannot contain a colon
            raise ValueError("a basic-auth user name cannot contain ':' (RFC 7617)")
        return username


class AuthorizationConfig(_Strict):
    """[alerting.http_config.authorization], as Prometheus's <authorization> less inline credentials:
    each push sends `Authorization: <type> <credentials>`."""

    type: str = Field(default="Bearer", description="the scheme; 'Basic' is refused, use basic_auth")
    credentials_file: str = Field(description="file holding the credentials (a token); read again when it changes")

    @field_validator("type")
    @classmethod
    def _scheme(cls, scheme: str) -> str:
        scheme = scheme.strip() or "Bearer"  # Prometheus trims it and defaults an empty one
        if scheme.lower() == "basic":
            raise ValueError('authorization type cannot be "basic", use [alerting.http_config.basic_auth]')
        if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", scheme):  # an RFC 9110 token
            raise ValueError("must be one word (an HTTP auth scheme such as Bearer)")
        return scheme


class TlsClientConfig(_Strict):
    """[alerting.http_config.tls_config], as Prometheus's <tls_config> with files only."""

    ca_file: str | None = Field(default=None, description="CA certificate(s) that sign Alertmanager's certificate, "
                                "instead of the system's trust store")
    cert_file: str | None = Field(default=None, description="client certificate (needs key_file)")
    key_file: str | None = Field(default=None, description="the client certificate's private key (needs cert_file)")
    server_name: str | None = Field(default=None, description="the name sent (SNI) and checked in Alertmanager's "
                                    "certificate; None: the URL's host")
    insecure_skip_verify: bool = Field(default=False, description="do not check Alertmanager's certificate at all")
    min_version: str | None = Field(default=None, description=f"one of {', '.join(TLS_VERSIONS)}; None: TLS12, "
                                    "Python's and Prometheus's default")

    @field_validator("min_version")
    @classmethod
    def _known_version(cls, version: str | None) -> str | None:
        if version is not None and version not in TLS_VERSIONS:
            raise ValueError(f"unknown TLS version; one of {', '.join(TLS_VERSIONS)}")
        return version

    @model_validator(mode="after")
    def _certificate_with_key(self) -> "TlsClientConfig":
        # Prometheus's TLSConfig.Validate: a client certificate is useless without its key and back.
        if self.cert_file and not self.key_file:
            raise ValueError("cert_file is set without key_file: a client certificate needs its private key")
        if self.key_file and not self.cert_file:
            raise ValueError("key_file is set without cert_file: a client key needs its certificate")
        return self


class HttpConfig(_Strict):
    """[alerting.http_config]: how the pushes authenticate, in the shape of Prometheus's
    alertmanager_config http_config (<basic_auth>, <authorization>, <tls_config>), secrets in files
    only (WHY_FILES_ONLY). The files are checked when the agent starts and read again when they
    change (agent/publish/push_credentials.py)."""

    basic_auth: BasicAuthConfig | None = None
    authorization: AuthorizationConfig | None = None
    tls_config: TlsClientConfig = TlsClientConfig()

    @model_validator(mode="after")
    def _one_scheme(self) -> "HttpConfig":
        # Prometheus's HTTPClientConfig.Validate: both would set the one Authorization header.
        if self.basic_auth is not None and self.authorization is not None:
            raise ValueError("at most one of basic_auth and authorization can be configured "
                             "(both would set the Authorization header)")
        return self


class AlertingConfig(_Strict):
    alertmanager_urls: tuple[str, ...] = Field(
        default=(), description="Alertmanager base URLs to push findings to directly (no Prometheus needed)"
    )
    push_interval_seconds: float = Field(default=30.0, ge=MIN_PUSH_SECONDS, le=3600)
    push_timeout_seconds: float = Field(
        default=10.0, ge=MIN_HTTP_TIMEOUT_SECONDS, le=300, description="deadline for one whole push to one Alertmanager "
        "(connect, send, answer); at most push_interval_seconds is used"
    )
    runbook_base_url: str | None = Field(
        default=None, description="None: http://<listen>/runbooks, served by this agent (a wildcard "
        "listen address is replaced by the host's fully qualified name)"
    )
    labels: dict[str, str] = Field(
        default={}, description="added to every pushed alert; 'host' defaults to the hostname"
    )
    http_config: HttpConfig = HttpConfig()

    @field_validator("alertmanager_urls")
    @classmethod
    def _http_urls(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        # Credentials first, and without the URL in the message: the error is printed.
        for number, url in enumerate(urls, 1):
            if "@" in urlsplit(url.strip()).netloc:
                raise PydanticCustomError(INLINE_SECRET, f"URL {number} carries credentials (user:password@); "
                                          f"{WHY_FILES_ONLY}: set [alerting.http_config.basic_auth]")
        for url in urls:
            if not re.match(r"https?://[^/\s]+", url):
                raise ValueError(f"{url!r} is not an http(s) URL")
        return urls

    @field_validator("runbook_base_url")
    @classmethod
    def _runbook_base(cls, base: str | None) -> str | None:
        # The check `hybridmon rules --runbook-url-base` makes, so one base gives both doors one link.
        return None if base is None else runbook_base_url(base)


class BenchConfig(_Strict):
    api_token_file: str | None = Field(
        default=None,
        description="file holding the bearer token for POST /api/v1/bench; None: the endpoint is off",
    )
    binary: str | None = Field(
        default=None, description="a prebuilt offload_bench (hosts with the driver but no CUDA toolkit)"
    )
    max_seconds: float = Field(default=120.0, ge=MIN_BENCH_SECONDS, le=3600, description="time limit per NUMA placement")
    repeat: int = Field(default=10, ge=1, le=1000)
    busy_utilization_at_least: float = Field(
        default=0.05, ge=0, le=1,
        description="a GPU this busy (1 min average), or running compute processes, counts as in use",
    )


class _AgentSettings(_Strict):
    """The agent's own settings; AgentConfig adds each collector's table from the registry."""


    listen: str = DEFAULT_LISTEN
    interval_seconds: float = Field(default=1.0, ge=MIN_TICK_SECONDS, le=60)
    history_seconds: float = Field(default=7200.0, ge=60, le=7 * 86400)
    log_level: str = "info"
    log_format: str = Field(
        default="text",
        description="text: one line per record; json: one JSON object per line (time, level, logger, "
        "message, exception), for journald and Kubernetes log pipelines (agent/logs.py)",
    )
    state_dir: str | None = Field(
        default=None,
        description="where benchmark results are kept; None: $STATE_DIRECTORY (systemd), else "
        "/var/lib/hybridmon as root, else $XDG_STATE_HOME/hybridmon or ~/.local/state/hybridmon",
    )
    paths: PathsConfig = PathsConfig()
    web_config_file: str | None = Field(
        default=None, description="prometheus/exporter-toolkit's web configuration (TLS, basic auth), the "
        "file node_exporter's --web.config.file reads; None: plain HTTP, no auth (agent/api/web_config.py)",
    )
    # [collectors.<name>] turns a collector on or off and sets its interval; a collector's own
    # settings are in the table named like it ([gpu], [process], ...), added below from the
    # registry (exporters/registry.py), each modelled beside its collector.
    collectors: dict[str, CollectorConfig] = {}
    detectors: DetectorsConfig = DetectorsConfig()
    alerting: AlertingConfig = AlertingConfig()
    bench: BenchConfig = BenchConfig()  # the benchmark's; the bench collector has no settings

    @field_validator("listen")
    @classmethod
    def _listen_is_host_port(cls, listen: str) -> str:
        parse_listen(listen)
        return listen

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, level: str) -> str:
        if level.lower() not in {"debug", "info", "warning", "error"}:
            raise ValueError("must be one of debug, info, warning, error")
        return level.lower()

    @field_validator("log_format")
    @classmethod
    def _known_format(cls, log_format: str) -> str:
        if log_format.lower() not in {"text", "json"}:
            raise ValueError("must be text or json")
        return log_format.lower()

    @field_validator("collectors")
    @classmethod
    def _known_collectors(cls, collectors: dict[str, CollectorConfig]) -> dict[str, CollectorConfig]:
        unknown = sorted(set(collectors) - set(COLLECTOR_NAMES))
        if unknown:
            raise ValueError(f"unknown collector {', '.join(unknown)}; known: {', '.join(COLLECTOR_NAMES)}")
        return collectors

    def collector(self, name: str) -> CollectorConfig:
        """[collectors.<name>]: whether collector `name` runs, and how often."""
        return self.collectors.get(name, CollectorConfig())

    def collector_settings(self, name: str) -> CollectorSettings | None:
        """Collector `name`'s own settings ([gpu] for gpu), None for a collector that has none."""
        return getattr(self, name) if registration(name).settings is not None else None

    def resolved_state_dir(self, environ: Mapping[str, str] | None = None) -> Path:
        """The state directory this agent uses (it may not exist yet)."""
        if self.state_dir:
            return Path(self.state_dir)
        environ = os.environ if environ is None else environ
        if environ.get("STATE_DIRECTORY"):
            # systemd's StateDirectory= may list several, colon-separated; the first is ours.
            return Path(environ["STATE_DIRECTORY"].split(":")[0])
        if os.geteuid() == 0:
            return Path("/var/lib/hybridmon")
        base = environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
        return Path(base) / "hybridmon"



def _collector_tables() -> dict[str, tuple]:
    tables = {}
    for declared in COLLECTORS:
        if declared.settings is None:
            continue
        if declared.name in _AgentSettings.model_fields:
            raise ValueError(f"collector {declared.name!r} would shadow the agent's own [{declared.name}]")
        tables[declared.name] = (declared.settings, declared.settings())
    return tables


# The whole configuration: the agent's settings and one table per collector that has settings.
AgentConfig = create_model("AgentConfig", __base__=_AgentSettings, **_collector_tables())  # type: ignore[call-overload]

def parse_listen(listen: str) -> tuple[str, int]:
    """'HOST:PORT' or '[IPv6]:PORT' -> (host, port)."""
    match = re.fullmatch(r"\[([0-9a-fA-F:.]+)\]:(\d+)|([^:\[\]]+):(\d+)", listen.strip())
    if not match:
        raise ValueError(f"{listen!r} is not HOST:PORT (e.g. {DEFAULT_LISTEN} or [::1]:9787)")
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4))
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is outside 1-65535")
    return host, port


def load_config(
    path: str | os.PathLike | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> AgentConfig:
    """File, then environment, then flags (`overrides`, dotted keys like 'paths.procfs').

    Every problem is a ConfigError that names the key and where it came from, and the outcome does
    not depend on the order of the environment.
    """
    layers: list[tuple[str, dict]] = []
    if path is not None:
        layers.append((str(path), _read_toml(Path(path))))
    environ = os.environ if environ is None else environ
    layers.append(("environment", _from_environment(environ)))
    flags = {key: (key, value) for key, value in (overrides or {}).items() if value is not None}
    layers.append(("command line", _nest(flags, "command line")))
    merged: dict = {}
    origin: dict[str, str] = {}
    for name, layer in layers:
        _merge(merged, layer, origin, name)
    try:
        return AgentConfig.model_validate(merged)
    except ValidationError as error:
        raise ConfigError(_describe(error, origin)) from None
    except RecursionError:
        raise ConfigError("invalid configuration: a value is nested too deeply") from None


def _read_toml(path: Path) -> dict:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory") from None
    except OSError as error:
        raise ConfigError(f"config file {path} cannot be read: {error.strerror}") from None
    except UnicodeDecodeError as error:
        line = error.object.count(b"\n", 0, error.start) + 1
        column = error.start - (error.object.rfind(b"\n", 0, error.start) + 1) + 1
        raise ConfigError(
            f"config file {path} is not UTF-8 text, which TOML requires: byte 0x{error.object[error.start]:02x} "
            f"at line {line}, column {column}"
        ) from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file {path} is not valid TOML: {error}") from None
    except RecursionError:
        raise ConfigError(f"config file {path} nests arrays or tables too deeply") from None


def _from_environment(environ: Mapping[str, str]) -> dict:
    """HYBRIDMON_PATHS__PROCFS=/host/proc -> {'paths': {'procfs': '/host/proc'}}."""
    flat: dict[str, tuple[str, Any]] = {}
    # Sorted, so that what is reported first does not depend on the order of the environment.
    for name, raw in sorted(environ.items()):
        # Not settings: the test doubles' own (the fake NVML's layout, and the stub
        # libnvidia-ml's, which the library reads at init: tests/support/stub_nvml).
        if not name.startswith(ENV_PREFIX) or name.startswith(TEST_DOUBLE_PREFIXES):
            continue
        parts = name[len(ENV_PREFIX):].lower().split("__")
        if not all(parts):
            raise ConfigError(f"environment variable {name}: not HYBRIDMON_<KEY>, nested keys joined "
                              "by a double underscore (HYBRIDMON_PATHS__PROCFS)")
        key = ".".join(parts)
        if key in flat:
            # Names differ in case only: which one wins would depend on the environment's order.
            raise ConfigError(f"environment variables {flat[key][0]} and {name} both set {key}")
        try:
            # JSON lets lists and numbers through; anything else stays a string.
            value = json.loads(raw)
        except ValueError:
            value = raw
        except RecursionError:
            raise ConfigError(f"environment variable {name}: its JSON value is nested too deeply") from None
        flat[key] = (name, value)
    return _nest(flat, "environment")


def _nest(flat: Mapping[str, tuple[str, Any]], source: str) -> dict:
    """{'paths.procfs': (name, value)} -> {'paths': {'procfs': value}}; `name` is what the user
    wrote (an environment variable, a flag), for the error when a key is both a value and a table."""
    nested: dict = {}
    table_set_by: dict[str, str] = {}   # dotted table -> the first name that made it a table
    value_set_by: dict[str, str] = {}   # dotted key -> the name that gave it a plain value
    for dotted, (name, value) in sorted(flat.items()):
        node = nested
        *parents, leaf = dotted.split(".")
        for depth, part in enumerate(parents):
            table = ".".join(parents[: depth + 1])
            if table in value_set_by:
                raise _both_value_and_table(source, table, value_set_by[table], name)
            table_set_by.setdefault(table, name)
            node = node.setdefault(part, {})
        if dotted in table_set_by:
            raise _both_value_and_table(source, dotted, name, table_set_by[dotted])
        value_set_by[dotted] = name
        node[leaf] = value
    return nested


def _both_value_and_table(source: str, key: str, value_name: str, table_name: str) -> ConfigError:
    return ConfigError(f"{source}: {value_name} gives {key} a value while {table_name} sets a key "
                       f"inside it; {key} is either a value or a table, set one of them")


def _merge(into: dict, layer: dict, origin: dict[str, str], source: str, prefix: str = "") -> None:
    for key, value in layer.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value, origin, source, dotted + ".")
        else:
            into[key] = value
        origin[dotted] = source


def _describe(error: ValidationError, origin: dict[str, str]) -> str:
    lines = ["invalid configuration:"]
    for problem in error.errors():
        key = ".".join(str(part) for part in problem["loc"])
        where = next(
            (origin[k] for k in _prefixes(key) if k in origin), "defaults"
        )
        inline_secret = _inline_secret_key(key)
        if problem["type"] == "extra_forbidden" and inline_secret:
            lines.append(f"  {key}: refused, {WHY_FILES_ONLY}; set {inline_secret} (from {where})")
        elif problem["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key (from {where})")
        elif problem["type"] == INLINE_SECRET or key.startswith(HTTP_CONFIG_KEY):
            # never the value: it may be a secret in the wrong place (basic_auth = "user:password")
            lines.append(f"  {key}: {problem['msg']} (from {where})")
        else:
            lines.append(f"  {key} = {_shorten(repr(problem.get('input')))}: {problem['msg']} (from {where})")
    return "\n".join(lines)


def _inline_secret_key(dotted: str) -> str | None:
    """The file key to use instead, where `dotted` is a secret written inline in http_config."""
    inside = dotted.removeprefix(HTTP_CONFIG_KEY + ".")
    if inside == dotted or inside not in INLINE_SECRET_KEYS:
        return None
    return f"{HTTP_CONFIG_KEY}.{INLINE_SECRET_KEYS[inside]}"


def _prefixes(dotted: str) -> list[str]:
    parts = dotted.split(".")
    return [".".join(parts[:n]) for n in range(len(parts), 0, -1)]


def _shorten(text: str, limit: int = 120) -> str:
    """A bad value in an error message, cut so a megabyte of input does not flood the log."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
