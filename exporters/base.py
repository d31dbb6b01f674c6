"""The contract every collector keeps.

A collector turns raw readings (file contents, NVML answers, udev events) into samples. It never
touches the host directly: every read goes through the RawSource it was given, so the same parsing
code runs live, while recording a trace, and while replaying one (agent/sources.py).

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
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Iterator, Literal, Protocol

MetricKind = Literal["gauge", "counter"]


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


@dataclass(frozen=True, slots=True)
class Sample:
    spec: MetricSpec
    label_values: tuple[str, ...]
    value: float


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
        self._samples.append(Sample(spec, tuple(str(v) for v in label_values), float(value)))

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
