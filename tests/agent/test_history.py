import math

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmon.agent.loop.history import History, _CollectorRing, _kept_by_bisection, _kept_by_walking
from hybridmon.exporters.base import MetricSpec, Samples

RESIDENT = MetricSpec("hybridmon_test_resident_bytes", "test", "gauge", ("pid",))


def batch(**values):
    samples = Samples()
    for pid, value in values.items():
        samples.add(RESIDENT, value, pid.lstrip("p"))
    return samples


def test_series_keep_order_and_leave_out_absent_ticks():
    history = History(retention_seconds=10)
    history.add_collector("process", 1.0)
    history.commit("process", 100.0, batch(p1=1.0, p2=5.0))
    history.commit("process", 101.0, batch(p1=2.0))
    history.commit("process", 102.0, batch(p1=3.0, p2=7.0))
    (one,) = history.series("hybridmon_test_resident_bytes", pid="1")
    assert list(one.times) == [100.0, 101.0, 102.0] and list(one.values) == [1.0, 2.0, 3.0]
    (two,) = history.series("hybridmon_test_resident_bytes", pid="2")
    assert list(two.times) == [100.0, 102.0] and list(two.values) == [5.0, 7.0]


def test_ring_keeps_only_the_retention_window():
    history = History(retention_seconds=5)
    history.add_collector("process", 1.0)
    for second in range(12):
        history.commit("process", float(second), batch(p1=float(second)))
    (series,) = history.series("hybridmon_test_resident_bytes")
    assert list(series.times) == [7.0, 8.0, 9.0, 10.0, 11.0]
    assert list(series.values) == list(series.times)


def test_a_series_absent_for_a_whole_window_is_dropped():
    history = History(retention_seconds=3)
    history.add_collector("process", 1.0)
    history.commit("process", 0.0, batch(p1=1.0, p2=1.0))
    for second in range(1, 4):
        history.commit("process", float(second), batch(p1=1.0))
    assert history.series_count() == 1
    assert history.series("hybridmon_test_resident_bytes", pid="2") == []


def test_the_series_count_follows_every_series_added_or_dropped_between_reads():
    # kept per collector between the commits that add or drop a series (every scrape reads it)
    history = History(retention_seconds=3)
    history.add_collector("process", 1.0)
    counts = []
    for second, values in enumerate(({"p1": 1.0}, {"p1": 1.0}, {"p1": 1.0, "p2": 1.0}, {"p2": 1.0},
                                     {"p2": 1.0}, {"p2": 1.0}, {"p2": 1.0, "p3": 1.0})):
        history.commit("process", float(second), batch(**values))
        counts.append(history.series_count())
    # p1 last seen at 2 s is dropped at 5 s, a whole window (3 ticks) later
    assert counts == [1, 1, 2, 2, 2, 1, 2]


def test_slow_collectors_get_a_smaller_ring():
    history = History(retention_seconds=7200)
    history.add_collector("fast", 1.0)
    history.add_collector("slow", 30.0)
    assert dict(history.capacities()) == {"fast": 7200, "slow": 240}


def test_latest_is_the_last_commit():
    history = History(retention_seconds=10)
    history.add_collector("process", 1.0)
    history.commit("process", 1.0, batch(p1=1.0))
    history.commit("process", 2.0, batch(p1=9.0))
    at, samples = history.latest()["process"]
    assert at == 2.0 and samples.value("hybridmon_test_resident_bytes", pid="1") == 9.0
    assert not math.isnan(samples.value("hybridmon_test_resident_bytes", pid="1"))


def test_series_since_leaves_out_older_points_and_name_can_be_a_label():
    spec = MetricSpec("hybridmon_test_threads", "test", "gauge", ("pid", "name"))
    history = History(retention_seconds=10)
    history.add_collector("process", 1.0)
    for second in range(5):
        samples = Samples()
        samples.add(spec, float(second), "1", "vllm")
        history.commit("process", float(second), samples)
    (series,) = history.series("hybridmon_test_threads", since=3.0, name="vllm")
    assert list(series.times) == [3.0, 4.0] and series.labels == {"pid": "1", "name": "vllm"}


def test_series_can_be_coarse_before_a_time_and_full_after_it():
    history = History(retention_seconds=100)
    history.add_collector("process", 1.0)
    for second in range(60):
        history.commit("process", float(second), batch(p1=float(second)))
    (series,) = history.series("hybridmon_test_resident_bytes", since=10.0, coarse_before=40.0, coarse_seconds=15.0)
    assert list(series.times) == [10.0, 25.0, 40.0] + [float(t) for t in range(41, 60)]


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(2, 40), ticks=st.integers(0, 120),
       steps=st.lists(st.sampled_from([0.5, 1.0, 1.0, 2.0, 7.0]), min_size=120, max_size=120),
       since=st.one_of(st.none(), st.floats(0, 200)), coarse_before=st.one_of(st.none(), st.floats(0, 200)),
       coarse_seconds=st.sampled_from([0.0, 1.0, 3.0, 15.0]))
def test_bisection_keeps_the_points_a_walk_keeps(capacity, ticks, steps, since, coarse_before,
                                                 coarse_seconds):
    """Issue 17: reads find their points by bisection on rising tick times; they must keep exactly
    what the walk over the whole ring kept, wrapped or not, thinned or not."""
    ring = _CollectorRing(capacity)
    at = 0.0
    for tick in range(ticks):
        at += steps[tick]
        ring.commit(at, Samples())
    assert ring.times_rise
    assert (list(_kept_by_bisection(ring, since, coarse_before, coarse_seconds))
            == _kept_by_walking(ring, since, coarse_before, coarse_seconds))


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(2, 40), ticks=st.integers(0, 120),
       gaps=st.lists(st.sampled_from([15.0, 15.0, 16.0, 30.0, 90.0]), min_size=120, max_size=120),
       since=st.one_of(st.none(), st.floats(0, 3000)), coarse_before=st.one_of(st.none(), st.floats(0, 3000)),
       coarse_seconds=st.sampled_from([1.0, 15.0, 16.0]))
def test_a_coarse_tier_keeps_the_points_a_walk_keeps(capacity, ticks, gaps, since, coarse_before,
                                                     coarse_seconds):
    """A coarse tier's ticks are at least its step apart (History commits one per step), so a read
    thinning it to one point per step or less keeps every tick, found without a bisection per
    point; what it keeps must still be what the walk keeps (gaps of 15 s against steps of 15 and
    16 s: all kept, or not)."""
    ring = _CollectorRing(capacity)
    at = 0.0
    for tick in range(ticks):
        at += gaps[tick]
        ring.commit(at, Samples())
    assert (list(_kept_by_bisection(ring, since, coarse_before, coarse_seconds))
            == _kept_by_walking(ring, since, coarse_before, coarse_seconds))


def test_series_every_reads_one_point_per_step_from_both_tiers():
    """memory_growth's trend: one point per 15 s over the whole span, the newest minutes too, so
    a window over them holds the same points whenever it is read (the coarse tier's)."""
    history = History(retention_seconds=3600, full_resolution_seconds=600)
    history.add_collector("process", 1.0)
    for second in range(2000):
        history.commit("process", float(second), batch(p1=float(second)))
    (series,) = history.series_every(RESIDENT.name, 15.0, since=1000.0)
    assert list(series.times) == [float(t) for t in range(1005, 2000, 15)]
    assert list(series.values) == list(series.times)
    # the same points an evaluation later: the tier does not move with the fine ring's start
    history.commit("process", 2000.0, batch(p1=2000.0))
    (later,) = history.series_every(RESIDENT.name, 15.0, since=1000.0)
    assert list(later.times) == list(series.times)
    # a single-tier collector is thinned to one point per step
    single = History(retention_seconds=100)
    single.add_collector("process", 1.0)
    for second in range(60):
        single.commit("process", float(second), batch(p1=1.0))
    assert [list(s.times) for s in single.series_every(RESIDENT.name, 15.0, since=10.0)] == [[10.0, 25.0, 40.0, 55.0]]


def test_a_clock_that_goes_back_falls_back_to_the_walk():
    history = History(retention_seconds=100)
    history.add_collector("c", 1.0)
    for at in (10.0, 11.0, 5.0, 6.0):
        history.commit("c", at, batch(p1=1.0))
    assert [list(s.times) for s in history.series(RESIDENT.name, since=5.5)] == [[10.0, 11.0, 6.0]]


@settings(max_examples=100, deadline=None)
@given(capacity=st.integers(2, 40), ticks=st.integers(0, 120),
       steps=st.lists(st.sampled_from([0.5, 1.0, 1.0, 2.0, 7.0]), min_size=120, max_size=120),
       values=st.lists(st.sampled_from([1.0, 2.5, -3.0, math.nan, math.inf, -math.inf]),
                       min_size=120, max_size=120),
       since=st.one_of(st.none(), st.floats(0, 200)), coarse_before=st.one_of(st.none(), st.floats(0, 200)),
       coarse_seconds=st.sampled_from([0.0, 1.0, 3.0, 15.0]),
       keep_from=st.one_of(st.none(), st.floats(0, 200)))
def test_a_read_copies_the_points_the_walk_keeps(capacity, ticks, steps, values, since, coarse_before,
                                                 coarse_seconds, keep_from):
    """Issue 17: a read copies its full-resolution part as slices of the ring (wrapped or not) and
    tells absent ticks by a NaN sum (inf - inf is one too); `keep_from` leaves out the points
    before it. Each point must be the one a walk over the ring picks, absent (NaN) ones left out."""
    history = History(retention_seconds=capacity)
    history.add_collector("process", 1.0)
    at, committed = 0.0, []
    for tick in range(ticks):
        at += steps[tick]
        # a NaN value stands for a tick where the series was absent: it is not committed
        history.commit("process", at, batch(p1=values[tick]) if values[tick] == values[tick] else batch())
        committed.append((at, values[tick]))
    ring = history._rings["process"]
    first = ticks - min(ticks, capacity)   # the oldest tick the ring holds; tick k is at k % capacity
    walked = [committed[first + (p - first) % capacity]
              for p in _kept_by_walking(ring, since, coarse_before, coarse_seconds)]
    expected = [(t, v) for t, v in walked if v == v and (keep_from is None or t >= keep_from)]
    found = history.series(RESIDENT.name, since=since, coarse_before=coarse_before,
                           coarse_seconds=coarse_seconds, keep_from=keep_from)
    points = [(t, v) for one in found for t, v in zip(one.times, one.values)]
    assert points == expected


class _ReferenceRing:
    """The commit of agent/loop/history_rings.py before issue 17's layout (as of commit 56c5f8d): every
    sample through the series dict, every series walked each tick. What the ring must still hold."""

    def __init__(self, capacity):
        self.capacity, self.ticks = capacity, 0
        self.series, self.last_seen = {}, {}

    def commit(self, samples):
        position = self.ticks % self.capacity
        present = set()
        for sample in samples:
            key = (sample.spec.name, sample.label_values)
            ring = self.series.setdefault(key, [math.nan] * self.capacity)
            ring[position] = sample.value
            self.last_seen[key] = self.ticks
            present.add(key)
        for key, ring in list(self.series.items()):
            if key not in present:
                ring[position] = math.nan
                if self.ticks - self.last_seen[key] >= self.capacity:
                    del self.series[key], self.last_seen[key]
        self.ticks += 1


def _nan_as_none(series):
    return {key: [None if math.isnan(v) else v for v in values] for key, values in series.items()}


OTHER = MetricSpec("hybridmon_test_other_bytes", "test", "gauge", ("pid",))
_SERIES = [(spec, pid) for spec in (RESIDENT, OTHER) for pid in ("1", "2", "3")]


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(2, 12),
       ticks=st.lists(st.one_of(st.just(None), st.lists(st.integers(0, len(_SERIES) - 1), max_size=8)),
                      max_size=80))
def test_commits_by_layout_hold_what_a_full_commit_holds(capacity, ticks):
    """Issue 17: a commit whose samples repeat the last one's series in the same order writes them
    by position (no per-sample dict work). Series appearing, going absent, coming back in another
    order, repeated within a batch, or absent for a whole ring (dropped) must leave the ring as
    the full commit did. None repeats the previous batch's series, as most ticks do."""
    ring, reference = _CollectorRing(capacity), _ReferenceRing(capacity)
    chosen: list[int] = []
    for tick, batch_series in enumerate(ticks):
        chosen = chosen if batch_series is None else batch_series
        samples = Samples()
        for number, index in enumerate(chosen):
            spec, pid = _SERIES[index]
            samples.add(spec, tick * 10 + number, pid)
        ring.commit(float(tick), samples)
        reference.commit(samples)
        assert _nan_as_none(ring.series) == _nan_as_none(reference.series)
        assert {(name, labels) for name, rings in ring.by_name.items() for labels in rings} == set(reference.series)


def test_repeated_batches_take_the_layout_path():
    """The layout is what makes a steady collector's commit cheap: it must be in use once a batch
    repeats, and dropped when the series change."""
    ring = _CollectorRing(5)
    ring.commit(1.0, batch(p1=1.0, p2=2.0))
    ring.commit(2.0, batch(p1=1.5, p2=2.5))
    assert ring._layout is not None and ring._layout_seen == 1
    ring.commit(3.0, batch(p1=1.0))
    assert ring._layout is None and math.isnan(ring.series[RESIDENT.name, ("2",)][2])


def test_add_many_adds_what_add_adds():
    """Samples.add_many (issue 17: one label tuple for a process's or GPU's series) must give
    the samples add() gives, in order, None left out, and refuse a wrong label count alike."""
    pairs = [(RESIDENT, 5), (OTHER, None), (OTHER, 2.5)]
    one_by_one, many = Samples(), Samples()
    for spec, value in pairs:
        one_by_one.add(spec, value, 42)
    many.add_many(pairs, 42)
    assert list(many) == list(one_by_one) == [(RESIDENT, ("42",), 5.0), (OTHER, ("42",), 2.5)]
    with pytest.raises(ValueError, match="takes labels"):
        many.add_many([(RESIDENT, 1)], 42, "extra")


def test_a_pickled_history_reads_the_same_and_takes_commits():
    """The benchmark keeps the history at 10 minutes to time it beside the one at 2 hours."""
    import pickle
    history = History(retention_seconds=100, full_resolution_seconds=10, coarse_step_seconds=5)
    history.add_collector("c", 1.0)
    for at in range(40):
        history.commit("c", float(at), batch(p1=float(at)))
    copy = pickle.loads(pickle.dumps(history))
    assert ([list(s.values) for s in copy.series(RESIDENT.name, coarse_before=30.0, coarse_seconds=5.0)]
            == [list(s.values) for s in history.series(RESIDENT.name, coarse_before=30.0, coarse_seconds=5.0)])
    copy.commit("c", 40.0, batch(p1=40.0))
    assert copy.series(RESIDENT.name)[0].values[-1] == 40.0
    assert history.series(RESIDENT.name)[0].values[-1] == 39.0


def test_a_ring_keeps_its_newest_read_plans(monkeypatch):
    """A replay or a benchmark evaluates one tick at many times: each read plan is worked out once
    per evaluation, the oldest plans making way (the memory holds a few per tick)."""
    from hybridmon.agent.loop import history_rings

    history = History(retention_seconds=100)
    history.add_collector("process", 1.0)
    for second in range(60):
        history.commit("process", float(second), batch(p1=1.0))
    worked_out = []
    real = history_rings._kept_split
    monkeypatch.setattr(history_rings, "_kept_split", lambda *a: worked_out.append(a[1:]) or real(*a))
    for since in range(10):   # more plans than the ring keeps
        for _ in range(3):    # each asked three times, as the metrics of one evaluation ask
            history.series(RESIDENT.name, since=float(since))
    assert len(worked_out) == 10
