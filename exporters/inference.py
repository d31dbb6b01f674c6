"""Inference servers beside the host: load, tokens, latency, KV cache and KV offload, per server.

Which servers: the configured endpoints; with none, those found beside the watched processes
(process.py): every TCP port a watched process listens on is asked for /metrics (and Ollama's
/api/ps), and a port that answers as a known server is scraped from then on, labelled with the
process's pid. Where no watched process listens anywhere (or its fds cannot be read), the usual
ports on 127.0.0.1 are tried instead. Ports are looked up again every discovery interval.

Ollama runs each loaded model in a child (`ollama runner`, or upstream llama-server started by
ollama) on a random loopback port without --metrics. Such a child is not asked: its parent's
/api/ps reports the model, so the parent's ports are looked at in its place.

inference_formats.py turns each answer into one ServerStats per server and model;
inference_scrape.py makes the bounded GET and finds the listening ports.
"""
from __future__ import annotations

import hashlib
import ipaddress
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, field_validator

from hybridmon.exporters.sources import RawSource, ReplayedCallError
from hybridmon.exporters import inference_llamacpp, inference_scrape
from hybridmon.exporters.base import (MIN_DISCOVERY_SECONDS, MIN_HTTP_TIMEOUT_SECONDS, CollectorContext,
                                      CollectorRegistration, CollectorSettings, LogOnce, NoDataError, Samples)
from hybridmon.exporters.inference_formats import PERCENTILES, interpret, recent_quantile
from hybridmon.exporters.inference_stats import Histogram, ServerStats
from hybridmon.exporters.inference_names import (BY_FIELD, HISTOGRAM_SPECS, METRIC_SPECS, MODELS_LEFT_OUT, OFFLOAD_BYTES,
                                         OFFLOAD_DROPPED_TOKENS, OFFLOAD_SECONDARY_TIER_BYTES, OFFLOAD_SECONDS,
                                         OFFLOAD_TOKENS, SCRAPE_DURATION, SCRAPE_ERROR, SCRAPE_SUCCESS, SERVERS,
                                         USUAL_PORTS)

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# Models per endpoint whose series are kept (issue 30: a peer publishing 75,000 models in a 7.8 MB
# body made 150,000 series, 1.55 GB of history and a status page that never answered). A server
# serves one model, or a few: vLLM's served names and adapters, Ollama's loaded models (its
# OLLAMA_MAX_LOADED_MODELS defaults to 3 per GPU). 16 leaves room for a large multi-model server.
DEFAULT_MAX_MODELS_PER_ENDPOINT = 16
MODELS_READ_PER_CAP, MIN_MODELS_READ = 4, 64
# A model label, and a dropped-tokens reason, are what a peer writes: bounded in bytes, a long one
# keeps its start and a hash of the whole, so two long names stay apart.
LABEL_LIMIT = 128
# KV-offload drop reasons, and secondary tiers, per model kept (SGLang publishes two reasons,
# vLLM's tiering a tier or two).
MAX_REASONS = 8
# The ServerStats fields that map a peer-written label value (a reason, a tier) to a count.
_BY_LABEL_FIELDS = ("kv_offload_dropped_tokens", "kv_offload_secondary_store_bytes",
                    "kv_offload_secondary_load_bytes")
_MAX_PORTS_PER_PROCESS = 8  # vLLM and SGLang also listen on internal ports; the API port is one
_MAX_PARALLEL_SCRAPES = 8
_SERVER_ANSWERED = (None, "missing_families")  # a known server, even if some names changed


@dataclass
class Target:
    """One endpoint: configured, or found beside a watched process ("process") or on a usual port
    ("probe"). A found one is reported once it answered as a known server (confirmed)."""

    url: str
    server: str | None  # configured kind; None: detected from each answer
    pid: int | None
    origin: str
    confirmed: bool
    base: str = ""  # scheme://host:port of a found one


class InferenceCollector:
    """Scrapes inference servers and exports one normalised set of series per server and model."""

    name = "inference"
    default_interval_seconds = 5.0
    metric_specs = METRIC_SPECS

    def __init__(self, source: RawSource, procfs: str = "/proc",
                 endpoints: Iterable[tuple[str, str | None]] = (), discover: bool = True,
                 probe_ports: Iterable[int] = USUAL_PORTS,
                 watched: Callable[[], Mapping[int, str]] = lambda: {},
                 timeout_seconds: float = 2.0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 discovery_interval_seconds: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 fetch: Callable[[str, float, int], dict] = inference_scrape.fetch,
                 max_models_per_endpoint: int = DEFAULT_MAX_MODELS_PER_ENDPOINT) -> None:
        self._source = source
        self._max_models = max_models_per_endpoint
        # Models read of a body at most, the first ones: a server within the cap is read whole and
        # its busiest kept; one publishing past this many is a peer that should not (issue 30: the
        # models of a 7.9 MB body, read before they were left out, held ~50 MB at each scrape).
        self._models_read = max(MODELS_READ_PER_CAP * max_models_per_endpoint, MIN_MODELS_READ)
        self._procfs = procfs
        # llama-server's derived token counter can dip by a few tokens between scrapes (6-digit
        # printing): hold it so that rate() never sees a reset (inference_llamacpp.RisingCounter).
        self._rising_tokens = inference_llamacpp.RisingCounter()
        configured = {endpoint_url(url, server): server for url, server in endpoints}
        self._configured = [Target(url, server, None, "config", True) for url, server in configured.items()]
        self._discover = discover and not self._configured
        self._probe_ports = tuple(probe_ports)
        self._watched = watched
        self._timeout = timeout_seconds
        self._max_bytes = max_body_bytes
        self._discovery_interval = discovery_interval_seconds
        self._clock = clock
        self._fetch = fetch
        self._found: dict[str, Target] = {}  # base -> confirmed target, when discovering
        self._last_discovery: float | None = None
        self._searched = ""  # where the last discovery looked, for the no-data message
        self._previous: dict[tuple[str, str, str, str], Histogram] = {}
        self._log_once = LogOnce(logger)
        self._ollama_parent: dict[int, int | None] = {}  # watched pid -> its Ollama server if a runner
        self._lmcache_backend: dict[int, bool] = {}  # vLLM pid -> offloads through LMCache's server

    def collect(self) -> Samples:
        # The clock goes through the source so that a replay looks around on the same runs.
        now = self._source.call("inference.clock", self._clock)
        candidates: list[Target] = []
        if self._last_discovery is None or now - self._last_discovery >= self._discovery_interval:
            self._last_discovery = now
            candidates = self._look_around()
        known = self._configured + list(self._found.values())
        answers = self._get_all([t.url for t in known + candidates])
        targets = known + self._confirm(candidates, answers)
        if not targets:
            raise NoDataError(self._nothing_found())
        samples = Samples()
        for target in targets:
            one = Samples()
            try:
                self._add(one, target, answers[target.url])
            except Exception as error:  # noqa: BLE001 - a peer's body must not blind the others
                # the parsers raise only ParseError, caught in interpret(); this is a bug's net, so
                # that one endpoint's answer costs its own series only (issue 30)
                self._log_once(f"bug:{target.url}:{type(error).__name__}", "inference endpoint %s: its "
                               "answer could not be read (%s: %s); its series are left out",
                               target.url, type(error).__name__, error, level=logging.ERROR)
                one = Samples()
                one.add(SCRAPE_SUCCESS, 0.0, target.url)
                one.add(SCRAPE_ERROR, 1.0, target.url, "unreadable")
            samples.extend(one)
        return samples

    def _look_around(self) -> list[Target]:
        """Finds the pids of configured endpoints or, when discovering, the new candidates."""
        listeners = self._listeners()
        for target in self._configured:
            target.pid = _pid_listening_at(target.url, listeners)
        if not self._discover:
            return []
        candidates: dict[str, int | None] = {}
        for pid, sockets in listeners.items():
            usual_first = sorted(sockets, key=lambda s: (s[1] not in self._probe_ports, s[1]))
            for address, port in usual_first[:_MAX_PORTS_PER_PROCESS]:
                candidates[f"http://{inference_scrape.connect_host(address)}:{port}"] = int(pid)
        origin = "process" if candidates else "probe"
        if candidates:
            self._searched = "the watched processes' ports (" + ", ".join(
                f"{base.rsplit(':', 1)[1]} of pid {pid}" for base, pid in candidates.items()) + ")"
        else:
            candidates = {f"http://127.0.0.1:{port}": None for port in self._probe_ports}
            self._searched = (f"127.0.0.1 ports {', '.join(map(str, self._probe_ports))} (no watched "
                              "process listens on TCP, or its /proc/<pid>/fd cannot be read)")
        # A found server stays while its process still listens there; a new process is asked again.
        self._found = {base: target for base, target in self._found.items()
                       if base in candidates and candidates[base] == target.pid}
        kept_urls = {t.url for t in self._configured + list(self._found.values())}
        self._previous = {key: value for key, value in self._previous.items() if key[0] in kept_urls}
        return [Target(base + "/metrics", None, pid, origin, False, base)
                for base, pid in candidates.items() if base not in self._found]

    def _listeners(self) -> dict[str, list[list]]:
        try:
            pids = sorted(int(pid) for pid in self._watched())
        except Exception as error:  # the process collector's failure must not stop this one
            self._log_once("watched", "cannot get the watched processes: %s", error)
            pids = []
        if not pids:
            return {}
        pids = sorted(set(self._instead_of_ollama_runners(pids)))
        try:
            return self._source.call("inference.listeners", lambda: inference_scrape.find_listeners(
                self._source, self._procfs, pids))
        except (OSError, ReplayedCallError) as error:
            self._log_once("listeners", "cannot find the ports of the watched processes: %s", error)
            return {}

    def _instead_of_ollama_runners(self, pids: list[int]) -> list[int]:
        """The pids, each Ollama runner child replaced by its Ollama server. Each pid's command
        line is read once while it is watched."""
        self._ollama_parent = {pid: self._ollama_parent[pid] for pid in pids if pid in self._ollama_parent}
        replaced = []
        for pid in pids:
            if pid not in self._ollama_parent:
                self._ollama_parent[pid] = ollama_runner_parent(self._source, self._procfs, pid)
            parent = self._ollama_parent[pid]
            if parent is not None:
                self._log_once(f"ollama-runner:{pid}", "pid %s is an Ollama runner (child of pid %s): "
                               "read through Ollama's /api/ps, its own port is not asked", pid, parent,
                               level=logging.DEBUG)
            replaced.append(pid if parent is None else parent)
        return replaced

    def _get_all(self, urls: list[str]) -> dict[str, dict]:
        """Every URL at once, so that slow servers cost one timeout per run, not one each."""
        urls = list(dict.fromkeys(urls))
        if not urls:
            return {}
        if len(urls) == 1:  # in this thread: a pool would start a thread per run to wait on it
            return {urls[0]: self._get(urls[0])}
        with ThreadPoolExecutor(max_workers=min(len(urls), _MAX_PARALLEL_SCRAPES)) as pool:
            return dict(zip(urls, pool.map(self._get, urls)))

    def _get(self, url: str) -> dict:
        try:
            # llama-server without --metrics answers 501: say so (inference_llamacpp).
            return inference_llamacpp.with_metrics_hint(self._source.call(
                f"inference.get {url}", lambda: self._fetch(url, self._timeout, self._max_bytes)))
        except ReplayedCallError as error:  # a fetch that failed in an unforeseen way while recording
            return {"url": url, "error": "connection", "detail": str(error), "seconds": None}

    def _confirm(self, candidates: list[Target], answers: dict[str, dict]) -> list[Target]:
        """The candidates that answered as an inference server, kept from now on. Ollama answers
        on /api/ps, not /metrics, so an HTTP answer that is not metrics has that asked too."""
        readings = {id(t): interpret(answers[t.url], None, self._models_read) for t in candidates}
        ask_api_ps = [t for t in candidates if readings[id(t)].error not in _SERVER_ANSWERED
                      and answers[t.url].get("status") is not None]
        for target in ask_api_ps:
            target.url = target.base + "/api/ps"
        answers.update(self._get_all([t.url for t in ask_api_ps]))
        for target in ask_api_ps:
            readings[id(target)] = interpret(answers[target.url], None, self._models_read)
        confirmed = []
        for target in candidates:
            reading = readings[id(target)]
            if reading.error in _SERVER_ANSWERED:
                target.confirmed = True
                self._found[target.base] = target
                confirmed.append(target)
            elif target.origin == "process":
                self._log_once(f"not-a-server:{target.base}:{target.pid}",
                               "pid %s listens at %s, which does not answer as an inference server "
                               "(%s: %s)", target.pid, target.base, reading.error, reading.detail,
                               level=logging.INFO)
        return confirmed

    def _add(self, samples: Samples, target: Target, answer: dict) -> None:
        reading = interpret(answer, target.server, self._models_read)
        samples.add(SCRAPE_SUCCESS, 0.0 if reading.error else 1.0, target.url)
        samples.add(SCRAPE_DURATION, answer.get("seconds"), target.url)
        if reading.error:
            samples.add(SCRAPE_ERROR, 1.0, target.url, reading.error)
            self._log_once(f"error:{target.url}:{reading.error}", "inference endpoint %s: %s (%s)",
                           target.url, reading.error, reading.detail)
        for note in reading.notes:
            self._log_once(f"note:{target.url}:{note}", "inference endpoint %s: %s", target.url, note)
        pid = "" if target.pid is None else str(target.pid)
        kept = self._within_caps(target.url, reading.stats)
        samples.add(MODELS_LEFT_OUT, len(reading.stats) - len(kept), target.url)
        for stats in kept:
            if stats.server == "vllm" and target.pid is not None and self._offloads_to_lmcache(target.pid):
                stats.kv_offload_in_lmcache = 1.0
            self._add_stats(samples, target.url, pid, stats)

    def _within_caps(self, url: str, found: list[ServerStats]) -> list[ServerStats]:
        """The models of one answer the agent keeps: at most max_models_per_endpoint, the busiest
        by generated tokens (then running requests), their labels bounded (LABEL_LIMIT, MAX_REASONS).
        A peer over the cap is logged once, with what it costs and how to raise it."""
        if len(found) > self._max_models:
            self._log_once(f"models:{url}", "inference endpoint %s publishes %d models; the agent keeps "
                           "the %d busiest (by generated tokens) and leaves the rest out (%s): every "
                           "model is ~40 series in memory and in /metrics. Raise [inference] "
                           "max_models_per_endpoint if they are all real", url, len(found), self._max_models,
                           MODELS_LEFT_OUT.name)
            found = sorted(found, key=lambda s: (-(s.generated_tokens or 0.0), -(s.requests_running or 0.0),
                                                 s.server, s.model))[:self._max_models]
        for stats in found:
            stats.model = bounded_label(stats.model)
            for field_name in _BY_LABEL_FIELDS:
                if by_label := getattr(stats, field_name):
                    setattr(stats, field_name, {bounded_label(label): count for label, count in
                                                sorted(by_label.items())[:MAX_REASONS]})
        return found

    def _add_stats(self, samples: Samples, url: str, pid: str, stats: ServerStats) -> None:
        labels = (stats.server, url, stats.model, pid)
        if stats.server == "llamacpp":
            stats.generated_tokens = self._rising_tokens.keep(labels, stats.generated_tokens)
        for field_name, spec in BY_FIELD.items():
            samples.add(spec, getattr(stats, field_name), *labels)
        for reason, tokens in sorted((stats.kv_offload_dropped_tokens or {}).items()):
            samples.add(OFFLOAD_DROPPED_TOKENS, tokens, *labels, reason)
        for direction in ("store", "load"):
            samples.add(OFFLOAD_BYTES, getattr(stats, f"kv_offload_{direction}_bytes"), *labels, direction)
            samples.add(OFFLOAD_SECONDS, getattr(stats, f"kv_offload_{direction}_seconds"), *labels, direction)
            samples.add(OFFLOAD_TOKENS, getattr(stats, f"kv_offload_{direction}_tokens"), *labels, direction)
            for tier, tier_bytes in sorted((getattr(stats, f"kv_offload_secondary_{direction}_bytes") or {}).items()):
                samples.add(OFFLOAD_SECONDARY_TIER_BYTES, tier_bytes, *labels, tier, direction)
        for field_name, (percentile_spec, seconds_spec, count_spec) in HISTOGRAM_SPECS.items():
            histogram = getattr(stats, field_name)
            if histogram is None:
                continue
            samples.add(seconds_spec, histogram.sum, *labels)
            samples.add(count_spec, histogram.count, *labels)
            key = (url, stats.server, stats.model, field_name)
            previous, self._previous[key] = self._previous.get(key), histogram
            for percentile, quantile in PERCENTILES.items():
                samples.add(percentile_spec, recent_quantile(previous, histogram, quantile), *labels, percentile)

    def _offloads_to_lmcache(self, pid: int) -> bool:
        """Whether this vLLM's command line gives its KV offload to LMCache's multiprocess server
        (vllm/config/vllm.py: --kv-offloading-backend lmcache sets LMCacheMPConnector). Read once
        per pid; a pid that cannot be read counts as not."""
        if pid not in self._lmcache_backend:
            if len(self._lmcache_backend) > 1024:  # pids of servers long gone
                self._lmcache_backend.clear()
            self._lmcache_backend[pid] = offloads_to_lmcache(_argv(self._source, self._procfs, pid))
        return self._lmcache_backend[pid]

    def _nothing_found(self) -> str:
        if not self._discover:
            return "no inference endpoint is configured and discovery is off ([inference] discover)"
        return f"no inference server found: none answers on {self._searched}; name one in [inference] endpoints"

    def close(self) -> None:
        pass


def bounded_label(value: str) -> str:
    """`value` if within LABEL_LIMIT characters, else its start, "~" and 8 hex digits of its
    SHA-256: as long as LABEL_LIMIT, and two long values stay two labels."""
    if len(value) <= LABEL_LIMIT:
        return value
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{value[:LABEL_LIMIT - 9]}~{digest}"


def _argv(source: RawSource, procfs: str, pid: int) -> list[str]:
    try:
        return [arg for arg in source.read_text(f"{procfs}/{pid}/cmdline").split("\0") if arg]
    except (OSError, ReplayedCallError):
        return []


def offloads_to_lmcache(argv: list[str]) -> bool:
    """--kv-offloading-backend lmcache (or =lmcache), or a --kv-transfer-config naming
    LMCacheMPConnector: vLLM's KV offload then runs in LMCache's server, which vLLM does not count."""
    for position, arg in enumerate(argv):
        if arg == "--kv-offloading-backend" and argv[position + 1:position + 2] == ["lmcache"]:
            return True
        if arg == "--kv-offloading-backend=lmcache" or "LMCacheMPConnector" in arg:
            return True
    return False


def _is_ollama(argv: list[str]) -> bool:
    return bool(argv) and argv[0].rsplit("/", 1)[-1] == "ollama"


def ollama_runner_parent(source: RawSource, procfs: str, pid: int) -> int | None:
    """The pid of the Ollama server whose model runner `pid` is, else None: `ollama runner ...`
    (Ollama's own runner, its cmdline per process_cmdline.py), or llama-server whose parent
    (/proc/<pid>/stat field 4) is an `ollama` executable (the upstream runner newer Ollama starts
    on a random loopback port, without --metrics)."""
    argv = _argv(source, procfs, pid)
    runner = _is_ollama(argv) and argv[1:2] == ["runner"]
    if not runner and not (argv and argv[0].rsplit("/", 1)[-1].startswith("llama-server")):
        return None
    try:
        stat = source.read_text(f"{procfs}/{pid}/stat")
        parent = int(stat[stat.rindex(")") + 1:].split()[1])
    except (OSError, ReplayedCallError, ValueError, IndexError):
        return None
    if not _is_ollama(_argv(source, procfs, parent)):
        return None
    return parent


def endpoint_url(url: str, server: str | None) -> str:
    """A configured URL with its path filled in: /api/ps for Ollama, /metrics for the others."""
    parts = urlsplit(url)
    if parts.path not in ("", "/"):
        return url
    return urlunsplit(parts._replace(path="/api/ps" if server == "ollama" else "/metrics"))


def _pid_listening_at(url: str, listeners: Mapping[str, list[list]]) -> int | None:
    """The watched process whose socket a configured URL reaches (same port, a local address)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    for pid, sockets in listeners.items():
        for address, listening_port in sockets:
            if listening_port == port and _reaches(parts.hostname or "", address):
                return int(pid)
    return None


def _reaches(host: str, address: str) -> bool:
    """Whether a URL naming `host` reaches a socket bound to `address` on this host."""
    if host == address:
        return True
    ip = ipaddress.ip_address(address)
    local_name = host == "localhost" or host.startswith("127.") or host == "::1"
    return local_name and (ip.is_unspecified or ip.is_loopback)


class InferenceEndpoint(CollectorSettings):
    """One configured server: where its metrics are, and which kind it is when known."""

    url: str = Field(description="http(s)://HOST:PORT[/PATH]; no path: /metrics (/api/ps for Ollama)")
    server: str | None = Field(default=None, description="None: detected from the metric names")

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not re.fullmatch(r"https?://[^/\s?#]+(/\S*)?", url):
            raise ValueError(f"{url!r} is not an http(s) URL")
        if "@" in url.split("/")[2]:
            raise ValueError("a URL with credentials would show them in the endpoint label; not supported")
        return url

    @field_validator("server")
    @classmethod
    def _known_server(cls, server: str | None) -> str | None:
        if server is not None and server not in SERVERS:
            raise ValueError(f"unknown server {server!r}; known: {', '.join(SERVERS)}")
        return server


class InferenceSettings(CollectorSettings):
    """[inference]: which servers to scrape (or how to find them) and how long a scrape may take."""

    endpoints: tuple[InferenceEndpoint, ...] = Field(
        default=(), description="URLs, or tables {url, server}; none: look beside the watched processes"
    )
    discover: bool = Field(default=True, description="with no endpoints, find servers on the watched "
                           "processes' ports, else on probe_ports of 127.0.0.1")
    probe_ports: tuple[int, ...] = USUAL_PORTS
    timeout_seconds: float = Field(default=2.0, ge=MIN_HTTP_TIMEOUT_SECONDS, le=10, description="whole GET; keep it under the interval")
    max_body_bytes: int = Field(default=DEFAULT_MAX_BODY_BYTES, ge=4096, le=256 * 1024 * 1024)
    discovery_interval_seconds: float = Field(default=30.0, ge=MIN_DISCOVERY_SECONDS, le=3600)
    max_models_per_endpoint: int = Field(default=DEFAULT_MAX_MODELS_PER_ENDPOINT, ge=1, le=1024,
                                         description="models kept per endpoint, the busiest")

    @field_validator("endpoints", mode="before")
    @classmethod
    def _urls_as_tables(cls, endpoints: Any) -> Any:
        if isinstance(endpoints, (list, tuple)):
            return [{"url": e} if isinstance(e, str) else e for e in endpoints]
        return endpoints


def _inference_collector(context: CollectorContext) -> InferenceCollector:
    settings: InferenceSettings = context.settings
    return InferenceCollector(
        context.source, procfs=context.procfs, endpoints=[(e.url, e.server) for e in settings.endpoints],
        discover=settings.discover, probe_ports=settings.probe_ports, watched=context.watched_processes(),
        timeout_seconds=settings.timeout_seconds, max_body_bytes=settings.max_body_bytes,
        discovery_interval_seconds=settings.discovery_interval_seconds,
        max_models_per_endpoint=settings.max_models_per_endpoint)


# It looks for servers on the ports of the process collector's watch list, so it runs after it.
REGISTRATION = CollectorRegistration(InferenceCollector, _inference_collector, settings=InferenceSettings,
                                     runs_after=("process",))
