"""One collector's samples as exposition text, re-formatting only the values.

After a commit the exposition re-renders the committing collector's part (agent/publish/exposition.py).
Going through prometheus_client's families (generate_latest) builds a Metric and a Sample object,
a labels dict and an escaped, sorted label string for every series on every render: 3.5 ms at
927 series on the 8-GPU host, paid by the first scrape after each tick, which is every Prometheus
scrape. A series' text before its value (`name{label="value",...} `) and a family's HELP and TYPE
lines only change with the series' labels, so they are cached here and each render formats the
values alone.

The cached text is produced by prometheus_client itself, from a one-sample family rendered once
per series (and per format), so the bytes stay exactly prometheus_client's: label names sorted,
label values escaped, counters' `_total` handled per format, HELP escaping per format. Values use
its floatToGoString, as both of its formats do (prometheus_client 0.26.0, exposition.py and
openmetrics/exposition.py).
"""
from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from hybridmon.exporters.base import MetricSpec, Sample

# A cache holding more entries than this many times the series of the last render (plus slack)
# is cut back to those series: pids and models come and go, their lines must not pile up.
_PRUNE_FACTOR = 2
_PRUNE_SLACK = 256
# The value of the one sample rendered to learn a series' prefix; the prefix is what precedes it.
_PROBE_VALUE = 0.0
_PROBE_TEXT = " " + floatToGoString(_PROBE_VALUE) + "\n"


class _OneFamily:
    """A registry-like object holding one family, for prometheus_client's generate_latest."""

    def __init__(self, family: Metric) -> None:
        self._family = family

    def collect(self) -> Iterable[Metric]:
        return [self._family]


def _family(spec: MetricSpec) -> Metric:
    kind = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
    return kind(spec.name, spec.documentation, labels=spec.label_names)


class LineCache:
    """Cached exposition text of one collector in one format: HELP/TYPE lines per family and the
    prefix of each series' line. `generate` is the format's generate_latest, its closing text
    (OpenMetrics' "# EOF") removed."""

    def __init__(self, generate: Callable[[object], bytes]) -> None:
        self._generate = generate
        self._headers: dict[str, str] = {}
        # (name, label values) -> [the line's text before the value, the value last written, that
        # line]: a series whose value did not change since the last render (an info series, a
        # link speed, a limit: about half of them) reuses its line.
        self._prefixes: dict[tuple[str, tuple[str, ...]], list] = {}

    def _learn(self, spec: MetricSpec, label_values: tuple[str, ...]) -> list:
        family = _family(spec)
        family.add_metric(label_values, _PROBE_VALUE)
        text = self._generate(_OneFamily(family)).decode("utf-8")
        # HELP, TYPE and the sample: escaping keeps each on one line ("\n" is written "\\n").
        help_line, type_line, sample_line, *rest = text.split("\n")
        sample_line += "\n"
        if rest != [""] or not sample_line.endswith(_PROBE_TEXT):
            raise AssertionError(f"unexpected rendering of {spec.name}: {text[:200]!r}")
        self._headers.setdefault(spec.name, f"{help_line}\n{type_line}\n")
        prefix = sample_line[:-len(_PROBE_TEXT) + 1]  # keeps the space before the value
        entry = self._prefixes[(spec.name, label_values)] = [prefix, None, ""]
        return entry

    def render(self, samples: Iterable[Sample], sort: bool = True) -> bytes:
        """The families sorted by name, each one's series by label values, as exposition.families
        gives them to prometheus_client with sort=True; with sort=False, in the order added,
        each family where its first sample was. A name's first spec is its family's."""
        by_name: dict[str, tuple[MetricSpec, list[Sample]]] = {}
        for sample in samples:
            group = by_name.get(sample.spec.name)
            if group is None:
                by_name[sample.spec.name] = (sample.spec, [sample])
            else:
                group[1].append(sample)
        prefixes, headers = self._prefixes, self._headers
        out: list[str] = []
        series = 0
        for name in sorted(by_name) if sort else by_name:
            spec, members = by_name[name]
            if sort:
                members.sort(key=_label_values)  # stable: repeated labels keep their order, as there
            series += len(members)
            header = headers.get(name)
            if header is None:
                self._learn(spec, members[0].label_values)
                header = headers[name]
            out.append(header)
            for sample in members:
                entry = prefixes.get((name, sample.label_values))
                if entry is None:
                    entry = self._learn(spec, sample.label_values)
                value, last = sample.value, entry[1]
                # 0.0 == -0.0, but they are written differently
                if value == last and (value != 0.0 or str(value) == str(last)):
                    out.append(entry[2])
                else:
                    entry[1], entry[2] = value, entry[0] + floatToGoString(value) + "\n"
                    out.append(entry[2])
        if len(prefixes) > _PRUNE_FACTOR * series + _PRUNE_SLACK:
            self._prune(by_name)
        return "".join(out).encode("utf-8")

    def _prune(self, by_name: dict[str, tuple[MetricSpec, list[Sample]]]) -> None:
        self._prefixes = {(name, s.label_values): self._prefixes[(name, s.label_values)]
                          for name, (_spec, members) in by_name.items() for s in members}
        self._headers = {name: self._headers[name] for name in by_name}


def _label_values(sample: Sample) -> tuple[str, ...]:
    return sample.label_values
