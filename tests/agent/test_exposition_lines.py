"""agent/publish/exposition_lines.py renders exactly what prometheus_client renders, in both formats,
however often the same series come back with new values."""
from __future__ import annotations

import math

import pytest

from hybridmon.agent.publish.exposition import OPENMETRICS, TEXT, _render
from hybridmon.agent.self_metrics import families
from hybridmon.agent.publish.exposition_lines import LineCache
from hybridmon.exporters.base import MetricSpec, Samples

# Help text and label values with everything either format escapes (backslash, newline, quote)
# and non-ASCII; label names out of alphabetical order; a counter, whose `_total` each format
# places differently; a family without labels.
GAUGE = MetricSpec("hybridmon_test_gauge_bytes", 'help with \\ a backslash,\na newline, "quotes" and ü',
                   "gauge", ("zone", "area"))
COUNTER = MetricSpec("hybridmon_test_events_total", "a counter", "counter", ("pid",))
BARE = MetricSpec("hybridmon_test_bare", "no labels", "gauge")
VALUES = (1.0, -0.0, 0.0, 7, -7.25, math.inf, -math.inf, math.nan, 1e22, 123456789.0, 1.5e-300, 2 ** 53 + 1)


class _Families:
    """What the exposition rendered before the line cache: prometheus_client's families."""

    def __init__(self, samples: Samples, sort: bool = True) -> None:
        self._samples, self._sort = samples, sort

    def collect(self):
        return families(self._samples, sort=self._sort)


def batch(shift: float) -> Samples:
    samples = Samples()
    samples.add(BARE, 42 + shift)
    for number, value in enumerate(VALUES):
        samples.add(GAUGE, value + shift, 'q"\\\n', f"v{number}")
    samples.add(GAUGE, 3 + shift, "z", "a")
    samples.add(GAUGE, 4 + shift, "a", "z")
    samples.add(GAUGE, 5 + shift, "a", "z")  # the same labels twice keep their order
    samples.add(COUNTER, 10 + shift, 22)
    samples.add(COUNTER, 11.5 + shift, 1)
    return samples


@pytest.mark.parametrize("exposition_format", [TEXT, OPENMETRICS])
def test_the_bytes_are_prometheus_clients(exposition_format):
    lines = LineCache(lambda registry: _render(registry, exposition_format))
    for shift in (0.0, 0.5, 0.0, 1e9):  # cached prefixes, new values
        samples = batch(shift)
        assert lines.render(samples) == _render(_Families(samples), exposition_format)


@pytest.mark.parametrize("exposition_format", [TEXT, OPENMETRICS])
def test_unsorted_the_order_added_is_kept_as_prometheus_client_keeps_it(exposition_format):
    """The agent's own health metrics are rendered in the order added (families(sort=False))."""
    lines = LineCache(lambda registry: _render(registry, exposition_format))
    for shift in (0.0, 2.0):
        samples = batch(shift)
        samples.add(BARE, 1)  # a family seen before, again after others
        assert lines.render(samples, sort=False) == _render(_Families(samples, sort=False), exposition_format)


def test_a_series_that_is_gone_leaves_the_cache():
    """Pids come and go: the prefixes of series no longer rendered do not pile up."""
    lines = LineCache(lambda registry: _render(registry, TEXT))
    for pid in range(2000):
        samples = Samples()
        samples.add(COUNTER, 1, pid)
        lines.render(samples)
    assert len(lines._prefixes) <= 1 + 256 + 2


@pytest.mark.parametrize("exposition_format", [TEXT, OPENMETRICS])
def test_a_line_is_reused_only_for_the_same_value_zero_sign_included(exposition_format):
    """An unchanged value reuses its line; 0.0 and -0.0 compare equal but are written apart."""
    lines = LineCache(lambda registry: _render(registry, exposition_format))
    for value in (0.0, -0.0, -0.0, 0.0, 5.0, 5.0, math.nan, math.nan, math.inf, 5):
        samples = Samples()
        samples.add(GAUGE, value, "a", "b")
        assert lines.render(samples) == _render(_Families(samples), exposition_format)
