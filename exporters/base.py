"""The contract every collector keeps.

A collector turns raw readings (file contents, NVML answers, udev events) into samples. It never
touches the host directly: every read goes through the RawSource it was given, so the same parsing
code runs live, while recording a trace, and while replaying one (exporters/sources.py).

Rules for collectors:
- The constructor stores its arguments and reads nothing. One-time discovery happens on the first
  collect() and is cached, so that a replayed trace contains every read the collector made.
- collect() returns a Samples batch. A source that is absent on this host (no NVML, no
  /proc/pressure) raises NoDataError: not a failure, the series are simply absent. Anything else
  that stops the whole collector raises CollectorError (or lets the exception out; the sampler
  catches all of them).
- A part that fails (one process gone, one GPU's call unsupported) leaves its series out and the
  rest of the batch stands. An unsupported value is absent, never 0 or NaN.
- Values are in base units: bytes, seconds, ratios 0-1, transfers per second.
- read_parsed reads and parses one file, leaving its series out with the reason logged once.
- Its module declares it once, as a CollectorRegistration beside it (REGISTRATION), listed in
  exporters/registry.py: that is how the agent knows it exists, builds it and configures it.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Literal, Mapping, NamedTuple, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from hybridmon.exporters.sources import RawSource

MetricKind = Literal["gauge", "counter"]
T = TypeVar("T")


class NoDataError(Exception):
    """The source this collector reads does not exist on this host; the message says why."""


class CollectorError(Exception):
    """The collector could not produce anything this time; the message says why."""


class ParseError(ValueError):
    """A raw reading did not have the expected format. Parsers raise only this."""


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric family: its full name, help text, kind and label names.

    Counter names end in `_total`; the name given here is the exposed one.
    """

    name: str
    documentation: str
    kind: MetricKind
    label_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name.startswith("hybridmon_"):
            raise ValueError(f"metric {self.name!r} lacks the hybridmon_ prefix")
        if (self.kind == "counter") != self.name.endswith("_total"):
            raise ValueError(f"metric {self.name!r}: only counters end in _total")


class Sample(NamedTuple):
    """One series' value. A NamedTuple, not a frozen dataclass: built ~460 times a tick on the
    8-GPU host, and a frozen dataclass sets each field through object.__setattr__ (twice the
    cost)."""

    spec: MetricSpec
    label_values: tuple[str, ...]
    value: float


_new_tuple = tuple.__new__


class Samples:
    """The samples of one collect() call, in the order they were added."""

    def __init__(self) -> None:
        self._samples: list[Sample] = []

    def add(self, spec: MetricSpec, value: float | int | None, *label_values: object) -> None:
        """Add one sample; a value of None means unsupported here, so the series stays absent."""
        if value is None:
            return
        if len(label_values) != len(spec.label_names):
            raise ValueError(
                f"{spec.name} takes labels {spec.label_names}, got {len(label_values)} values"
            )
        # map, not a generator expression, and tuple.__new__, not Sample(): the NamedTuple's own
        # __new__ is a Python function, and ~500 samples a tick on the 8-GPU host pass through here.
        self._samples.append(_new_tuple(Sample, (spec, tuple(map(str, label_values)), float(value))))

    def add_many(self, pairs: Iterable[tuple[MetricSpec, float | int | None]], *label_values: object) -> None:
        """add() of each (spec, value) with the same label values, made strings once: one
        process's ten series, one GPU's dozen. The label tuple was most of add()'s cost (0.7 of
        1.6 us on a 2-vCPU VM, ~500 samples a tick on the 8-GPU host)."""
        labels = tuple(map(str, label_values))
        count, append = len(labels), self._samples.append
        for spec, value in pairs:
            if value is None:
                continue
            if len(spec.label_names) != count:
                raise ValueError(f"{spec.name} takes labels {spec.label_names}, got {count} values")
            append(_new_tuple(Sample, (spec, labels, float(value))))

    def extend(self, other: "Samples") -> None:
        self._samples.extend(other._samples)

    def __iter__(self) -> Iterator[Sample]:
        return iter(self._samples)

    def __len__(self) -> int:
        return len(self._samples)

    def find(self, name: str, /, **labels: str) -> list[Sample]:
        """Samples of one metric whose labels include `labels`: for tests and detectors."""
        found = []
        for sample in self._samples:
            if sample.spec.name != name:
                continue
            have = dict(zip(sample.spec.label_names, sample.label_values))
            if all(have.get(key) == value for key, value in labels.items()):
                found.append(sample)
        return found

    def value(self, name: str, /, **labels: str) -> float | None:
        """The value of the one sample matching name and labels, or None if absent."""
        found = self.find(name, **labels)
        if len(found) > 1:
            raise LookupError(f"{len(found)} samples of {name} match {labels}")
        return found[0].value if found else None


class Collector(Protocol):
    name: str
    """Short stable name, used in self metrics, config sections and traces."""

    default_interval_seconds: float
    """How often the agent samples it unless configured otherwise."""

    metric_specs: tuple[MetricSpec, ...]
    """Every family it can emit, for documentation and the series-count benchmark."""

    def collect(self) -> Samples: ...

    def close(self) -> None: ...


# A discovery pass lists every /proc/<pid> (cmdline, comm) or probes TCP ports on 127.0.0.1; new
# inference processes and servers appear on a scale of seconds (a model takes longer to load).
MIN_DISCOVERY_SECONDS = 1.0
# A loopback GET of an inference server's /metrics takes a few ms; under 100 ms a busy server's
# answer (Python, GIL-bound) is cut off every time.
MIN_HTTP_TIMEOUT_SECONDS = 0.1


class CollectorSettings(BaseModel):
    """A collector's own settings: the configuration's top-level table named like the collector
    ([gpu], [process], ...), beside the agent's [collectors.<name>] enabled/interval_seconds.
    Unknown keys are refused, so a typo is an error instead of a silently ignored setting."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class CollectorContext:
    """What the agent hands a collector's factory: the things the agent owns, nothing more."""

    source: "RawSource"
    """The raw source this collector reads through (live, recording or replaying)."""
    settings: Any
    """This collector's CollectorSettings as configured; None for a collector without settings."""
    procfs: str = "/proc"
    sysfs: str = "/sys"
    state_dir: str = ""
    """Where `hybridmon bench` keeps its results (AgentConfig.resolved_state_dir())."""
    replay: bool = False
    """A trace answers every read: load no library (NVML), the recording has its answers."""
    earlier: Mapping[str, Collector] = field(default_factory=dict)
    """The enabled collectors built before this one, by name; a disabled one is absent."""

    def gpu_processes(self) -> Callable[[], dict[int, str]]:
        """pid -> name of the compute processes on the GPUs at the gpu collector's last run, read
        through this collector's source; always empty while the gpu collector is disabled."""
        gpu = self.earlier.get("gpu")
        if gpu is None:
            return dict
        return lambda: self._recorded_processes("agent.gpu_processes", gpu.gpu_processes)

    def gpu_buses_of_processes(self) -> Callable[[], dict[int, tuple[str, ...]]]:
        """pid -> the PCI bus ids of the GPUs it held memory on at the gpu collector's last run,
        read through this collector's source; always empty while the gpu collector is disabled."""
        gpu = self.earlier.get("gpu")
        if gpu is None:
            return dict

        def recorded() -> dict[int, tuple[str, ...]]:
            # JSON keys are strings and its arrays lists: a replay gives back what was recorded
            found = self.source.call("agent.gpu_buses_of_processes",
                                     lambda: {str(pid): list(buses) for pid, buses in gpu.gpu_buses_of_processes().items()})
            return {int(pid): tuple(buses) for pid, buses in found.items()}
        return recorded

    def watched_processes(self) -> Callable[[], dict[int, str]]:
        """pid -> name of the processes the process collector read on its last run, read through
        this collector's source; empty while the process collector is disabled."""
        process = self.earlier.get("process")
        read = process.watched if process is not None else dict
        return lambda: self._recorded_processes("agent.watched_processes", read)

    def _recorded_processes(self, key: str, read: Callable[[], Mapping[int, str]]) -> dict[int, str]:
        # Through this collector's own source, so that a replay sees exactly what the recording saw
        # (JSON keys are strings).
        recorded = self.source.call(key, lambda: {str(pid): name for pid, name in read().items()})
        return {int(pid): name for pid, name in recorded.items()}


@dataclass(frozen=True)
class CollectorRegistration:
    """One collector, declared once beside its code (node_exporter's registerCollector): how the
    agent builds it, configures it, orders its first run and judges it in `hybridmon check`.
    exporters/registry.py lists them all; the configuration, the wiring, the metrics reference and
    the check derive from that list."""

    collector: type
    """The collector class: its name, default_interval_seconds and metric_specs are the registration's."""
    factory: Callable[[CollectorContext], Collector]
    settings: type[CollectorSettings] | None = None
    """Its own settings, read from the configuration's top-level table named like the collector."""
    runs_after: tuple[str, ...] = ()
    """Collectors whose first run this one waits for: the ones it takes a watch list from. They
    come before it in the registry, so its factory finds them built (CollectorContext.earlier)."""
    essential: bool = False
    """Every Linux host can be read by it: when it fails, finds nothing or never runs, `hybridmon
    check` cannot vouch for the host and exits 3 naming it."""
    may_have_no_data: bool = False
    """An essential collector whose source may be absent by a kernel setting, not a broken read."""
    essential_series: tuple[tuple[MetricSpec, str], ...] = ()
    """(series, file under procfs): a check needs each series, else it names the file it could not read."""

    def __post_init__(self) -> None:
        if (self.may_have_no_data or self.essential_series) and not self.essential:
            raise ValueError(f"collector {self.name!r}: may_have_no_data and essential_series are about "
                             "an essential collector; set essential=True")

    @property
    def name(self) -> str:
        return self.collector.name

    @property
    def default_interval_seconds(self) -> float:
        return self.collector.default_interval_seconds

    @property
    def metric_specs(self) -> tuple[MetricSpec, ...]:
        return self.collector.metric_specs


class LogOnce:
    """Logs a message the first time its key is seen, so a failing source says why exactly once."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, key: str, message: str, *args: object, level: int = logging.WARNING) -> None:
        with self._lock:
            if key in self._seen:
                return
            self._seen.add(key)
        self._logger.log(level, message, *args)


def parse_logged(parse: Callable[[str], T], text: str | None, path: str,
                 log_once: LogOnce) -> T | None:
    """parse(text) of the file at `path`, or None when there is no text or it does not parse
    (logged once): for callers that read several files before parsing any."""
    if text is None:
        return None
    try:
        return parse(text)
    except ParseError as error:
        _log_parse_error(log_once, path, path, error)
        return None


def read_parsed(source: "RawSource", path: str, parse: Callable[[str], T], log_once: LogOnce, *,
                missing_is_normal: str | None = None, log_key: str | None = None,
                failures: dict[str, Exception] | None = None) -> T | None:
    """One file read through `source` and parsed, or None with the reason logged once.

    A missing file is a warning, unless `missing_is_normal` says why it may be missing here (a
    kernel without the setting, a device without AER): then it is logged at INFO with that reason.
    Files that fail together can share one `log_key` so that they say so once. Where `failures`
    is given, the OSError or ParseError of a failed file is stored in it under the path.
    """
    key = log_key or path
    try:
        text = source.read_text(path)
    except OSError as error:
        reason = error.strerror or str(error)
        if missing_is_normal is not None and isinstance(error, FileNotFoundError):
            log_once(f"read:{key}", "%s does not exist (%s): its series are absent", path,
                     missing_is_normal, level=logging.INFO)
        else:
            log_once(f"read:{key}", "cannot read %s (%s): its series are absent", path, reason)
        if failures is not None:
            failures[path] = error
        return None
    try:
        return parse(text)
    except ParseError as error:
        _log_parse_error(log_once, key, path, error)
        if failures is not None:
            failures[path] = error
        return None


def _log_parse_error(log_once: LogOnce, key: str, path: str, error: ParseError) -> None:
    log_once(f"parse:{key}", "%s has an unexpected format (%s): its series are absent", path, error)
