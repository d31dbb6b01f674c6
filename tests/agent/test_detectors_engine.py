import logging
import threading


from hybridmon.agent.detectors.base import DetectorBase, Finding
from hybridmon.agent.detectors.engine import Engine
from hybridmon.agent.loop.history import History


def finding(alertname="TestAlert", for_seconds=120.0, value=1.0, **labels):
    return Finding(alertname=alertname, severity="warning", labels=labels or {"gpu": "0"},
                   value=value, threshold=0.5, summary="s", description="d",
                   for_seconds=for_seconds)


class Scripted(DetectorBase):
    """A detector whose findings the test sets before each evaluation."""

    def __init__(self, name="scripted"):
        self.name = name
        self.alertnames = ("TestAlert",)
        self.findings = []
        self.calls = []

    def evaluate(self, history, now):
        self.calls.append(now)
        return list(self.findings)


class Broken(DetectorBase):
    name = "broken"
    alertnames = ("BrokenAlert",)

    def __init__(self):
        self.fail = True

    def evaluate(self, history, now):
        if self.fail:
            raise ZeroDivisionError("bad arithmetic")
        return [finding("BrokenAlert", for_seconds=0, node="0")]


def engine_with(*detectors, **kwargs):
    engine = Engine(list(detectors), History(60), **kwargs)
    changes = []
    engine.on_change.append(lambda state, change: changes.append((change, state.key, state)))
    return engine, changes


def test_pending_fires_after_for_seconds():
    detector = Scripted()
    engine, changes = engine_with(detector)
    detector.findings = [finding(for_seconds=120)]
    for now in (1000, 1060, 1119):
        assert engine.evaluate(now) == []
        (pending,) = engine.pending()
        assert pending.pending_since == 1000 and pending.state == "pending"
        assert pending.starts_at is None
    assert changes == []
    (firing,) = engine.evaluate(1120)
    assert firing.state == "firing" and firing.starts_at == 1120 and firing.ends_at is None
    assert engine.pending() == [] and engine.firing() == [firing]
    assert [c[0] for c in changes] == ["firing"]
    engine.evaluate(1180)
    assert len(changes) == 1, "a finding that keeps firing is announced once"
    assert engine.evaluations == 5


def test_zero_for_fires_on_the_first_evaluation():
    detector = Scripted()
    engine, changes = engine_with(detector)
    detector.findings = [finding(for_seconds=0)]
    (firing,) = engine.evaluate(5)
    assert firing.firing_since == 5 and firing.pending_since == 5
    assert changes[0][0] == "firing"


def test_resolution_sets_ends_at_and_is_kept_for_the_retention():
    detector = Scripted()
    engine, changes = engine_with(detector, resolved_retention_seconds=900)
    detector.findings = [finding(for_seconds=0, value=3.0)]
    engine.evaluate(100)
    detector.findings = [finding(for_seconds=0, value=7.0)]
    (firing,) = engine.evaluate(110)
    assert firing.finding.value == 7.0 and firing.starts_at == 100
    detector.findings = []
    assert engine.evaluate(200) == []
    (resolved,) = engine.resolved()
    assert resolved.state == "resolved"
    assert (resolved.starts_at, resolved.ends_at) == (100, 200)
    assert resolved.finding.value == 7.0
    assert [c[0] for c in changes] == ["firing", "resolved"]
    assert changes[1][2] == resolved
    engine.evaluate(1100)
    assert engine.resolved() == [resolved]
    engine.evaluate(1101)
    assert engine.resolved() == [] and engine.states() == []


def test_a_resolved_finding_that_comes_back_is_new():
    detector = Scripted()
    engine, changes = engine_with(detector)
    detector.findings = [finding(for_seconds=60)]
    engine.evaluate(0)
    engine.evaluate(60)
    detector.findings = []
    engine.evaluate(70)
    detector.findings = [finding(for_seconds=60)]
    engine.evaluate(80)
    (pending,) = engine.pending()
    assert pending.pending_since == 80 and pending.firing_since is None
    assert engine.resolved() == []
    (firing,) = engine.evaluate(140)
    assert firing.starts_at == 140
    assert [c[0] for c in changes] == ["firing", "resolved", "firing"]


def test_a_pending_finding_whose_condition_stops_is_dropped_silently():
    detector = Scripted()
    engine, changes = engine_with(detector)
    detector.findings = [finding(for_seconds=120)]
    engine.evaluate(0)
    engine.evaluate(60)
    detector.findings = []
    engine.evaluate(90)
    assert engine.pending() == [] and engine.resolved() == [] and engine.firing() == []
    assert changes == []
    detector.findings = [finding(for_seconds=120)]
    engine.evaluate(100)
    engine.evaluate(200)
    assert engine.firing() == [], "the for clock starts again"
    assert engine.evaluate(220) != []


def test_findings_are_keyed_by_alertname_and_labels():
    detector = Scripted()
    engine, _ = engine_with(detector)
    detector.findings = [finding(for_seconds=0, gpu="0"), finding(for_seconds=0, gpu="1")]
    engine.evaluate(0)
    detector.findings = [finding(for_seconds=0, gpu="1")]
    engine.evaluate(10)
    assert [s.finding.labels for s in engine.firing()] == [{"gpu": "1"}]
    assert [s.finding.labels for s in engine.resolved()] == [{"gpu": "0"}]


def test_a_raising_detector_is_isolated_counted_and_logged_once(caplog):
    good = Scripted("good")
    broken = Broken()
    engine, _ = engine_with(broken, good)
    good.findings = [finding(for_seconds=0)]
    with caplog.at_level(logging.ERROR, logger="hybridmon.agent.detectors.engine"):
        engine.evaluate(0)
        engine.evaluate(10)
    assert good.calls == [0, 10]
    assert [s.detector for s in engine.firing()] == ["good"]
    assert engine.detector_errors == {"broken": 2, "good": 0}
    failures = [r for r in caplog.records if "broken" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is not None


def test_a_failing_detector_keeps_its_findings_as_they_were():
    broken = Broken()
    broken.fail = False
    engine, changes = engine_with(broken)
    engine.evaluate(0)
    assert len(engine.firing()) == 1
    broken.fail = True
    engine.evaluate(10)
    assert len(engine.firing()) == 1 and engine.resolved() == []
    broken.fail = False
    engine.evaluate(20)
    (state,) = engine.firing()
    assert state.starts_at == 0 and [c[0] for c in changes] == ["firing"]


def test_a_raising_callback_does_not_stop_evaluation():
    detector = Scripted()
    engine, changes = engine_with(detector)
    engine.on_change.insert(0, lambda state, change: 1 / 0)
    detector.findings = [finding(for_seconds=0)]
    assert len(engine.evaluate(0)) == 1
    assert len(changes) == 1


def test_the_clock_supplies_now():
    detector = Scripted()
    engine = Engine([detector], History(60), clock=lambda: 1234.5)
    detector.findings = [finding(for_seconds=0)]
    (state,) = engine.evaluate()
    assert detector.calls == [1234.5] and state.starts_at == 1234.5
    assert engine.last_evaluated_at == 1234.5


def test_readers_on_another_thread_see_consistent_snapshots():
    detector = Scripted()
    engine = Engine([detector], History(60))
    stop = threading.Event()
    problems = []

    def read():
        while not stop.is_set():
            try:
                for state in engine.firing():
                    assert state.state == "firing" and state.starts_at is not None
                for state in engine.resolved():
                    assert state.ends_at is not None
            except Exception as error:  # pragma: no cover - reported below
                problems.append(error)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for step in range(2000):
            detector.findings = [finding(for_seconds=0, gpu=str(g)) for g in range(step % 7)]
            engine.evaluate(float(step))
    finally:
        stop.set()
        reader.join()
    assert problems == []
    assert engine.evaluations == 2000


# --- warming up (issue 14, item 9) ---------------------------------------------------------------

class _State:
    def __init__(self, runs=0, last_success=None, no_data_reason=None):
        self.runs, self.last_success, self.no_data_reason = runs, last_success, no_data_reason


class _Collector:
    def __init__(self, name, *specs):
        self.name, self.metric_specs = name, specs


class _Scheduled:
    def __init__(self, collector, state):
        self.collector, self.state = collector, state


def test_a_detector_warms_up_until_its_history_and_its_collectors_first_report():
    """host_config (min_history 0) reads host_memory's sysctls; swap_thrash needs a 1 min average.
    Before issue 14 the engine kept no record of either, so its silence read as health."""
    from hybridmon.agent.warmup import warming_up
    from hybridmon.exporters.base import Samples
    from hybridmon.exporters.host_memory import SYSCTL_VALUE, SWAP_IN_BYTES

    host_config, swap_thrash = Scripted("host_config"), Scripted("swap_thrash")
    swap_thrash.min_history_seconds = 60.0
    history = History(600)
    history.add_collector("gpu", 1.0)
    history.add_collector("host_memory", 10.0)
    engine = Engine([host_config, swap_thrash], history)
    state = _State()
    scheduled = [_Scheduled(_Collector("gpu"), _State(runs=1, last_success=True)),
                 _Scheduled(_Collector("host_memory", SYSCTL_VALUE, SWAP_IN_BYTES), state)]
    # Before the first evaluation nobody has judged.
    assert {w.detector for w in warming_up(engine, scheduled)} == {"host_config", "swap_thrash"}

    history.commit("gpu", 1000, Samples())
    engine.evaluate(1000)
    assert engine.first_evaluated_at == 1000 and engine.collectors_seen == {"gpu"}
    warming = {w.detector: w for w in warming_up(engine, scheduled)}
    assert warming["host_config"].waiting_for == ("host_memory",) and warming["host_config"].seconds_left == 0
    assert warming["swap_thrash"].seconds_left == 60

    # host_memory commits after that evaluation: waited for until an evaluation has read it.
    state.runs, state.last_success = 1, True
    history.commit("host_memory", 1001, Samples())
    assert "host_config" in {w.detector for w in warming_up(engine, scheduled)}
    engine.evaluate(1015)
    warming = {w.detector: w for w in warming_up(engine, scheduled)}
    assert set(warming) == {"swap_thrash"} and warming["swap_thrash"].seconds_left == 45
    engine.evaluate(1060)
    assert warming_up(engine, scheduled) == []


def test_a_collector_that_failed_or_has_nothing_to_read_is_not_waited_for():
    """Waiting for it would say "warming up" forever; its failure is reported on its own."""
    from hybridmon.agent.warmup import warming_up
    from hybridmon.exporters.host_memory import SYSCTL_VALUE

    engine = Engine([Scripted("host_config")], History(60))
    engine.evaluate(1000)
    for state in (_State(runs=3, last_success=False), _State(runs=1, last_success=True, no_data_reason="none")):
        assert warming_up(engine, [_Scheduled(_Collector("host_memory", SYSCTL_VALUE), state)]) == []
    waiting = _State(runs=0)
    assert [w.waiting_for for w in warming_up(engine, [_Scheduled(_Collector("host_memory", SYSCTL_VALUE),
                                                                  waiting)])] == [("host_memory",)]


def test_each_detector_reads_its_own_span_and_the_same_points_in_it():
    """Issue 17: a detector of 1-minute windows copies 10 minutes of points whatever the history
    holds, the same points (thinned as before) a reader of the whole lookback gets in them; one
    without a declared span reads the whole lookback; label filters give what filtering gives."""
    from hybridmon.agent.detectors.engine import FULL_RESOLUTION_SECONDS
    from hybridmon.exporters.base import MetricSpec, Samples

    spec = MetricSpec("hybridmon_test_resident_bytes", "test", "gauge", ("pid", "process_name"))
    history = History(7200)
    history.add_collector("process", 1.0)
    for second in range(7200):
        samples = Samples()
        for pid in range(20):
            samples.add(spec, float(second * pid), str(pid), "vllm" if pid % 2 else "sglang")
        history.commit("process", float(second), samples)

    class Reader(Scripted):
        def evaluate(self, history, now):
            self.seen = {
                "all": history.series(spec.name),
                "pid 7": history.series(spec.name, pid="7"),
                "vllm": history.series(spec.name, process_name="vllm"),
                "pid 8 vllm": history.series(spec.name, pid="8", process_name="vllm"),
            }
            return []

    short, whole = Reader("short"), Reader("whole")
    short.lookback_seconds = 120.0   # as AlertFamily.build_detector sets it; `whole` keeps inf
    engine = Engine([short, whole], history, lookback_seconds=7260.0)
    engine.evaluate(7199.0)
    (series,) = short.seen["pid 7"]
    assert series.times[0] == 7199.0 - FULL_RESOLUTION_SECONDS and len(series.times) == 601
    (full,) = whole.seen["pid 7"]
    assert full.times[0] == 0.0 and list(full.times[-601:]) == list(series.times)
    assert list(full.values[-601:]) == list(series.values)
    for reader in (short, whole):
        everything = reader.seen["all"]
        assert len(everything) == 20
        assert [s.labels for s in reader.seen["vllm"]] == [s.labels for s in everything
                                                          if s.labels["process_name"] == "vllm"]
        assert reader.seen["pid 8 vllm"] == []


def test_a_metric_read_over_several_spans_is_read_once_and_cut_to_the_same_points():
    """Memory growth reads the process series an hour back, most detectors ten minutes: after one
    evaluation has shown that, the view reads each such metric once, over the hour, and cuts the
    shorter spans from it. A cut gives exactly what a read of its own span gives, on both tiers,
    with a process that came and went (absent ticks) and one that stayed."""
    from hybridmon.agent.detectors.engine import FULL_RESOLUTION_SECONDS, EvaluationView
    from tests.agent.test_history_tiers import RESIDENT, filled

    start = 1_800_000_000.0
    history = filled(7200, start, absent=lambda tick: 3000 <= tick < 3100 or tick % 997 == 0)
    now, lookback = start + 7199, 3660.0
    reads = []
    real_series = history.series

    def counted(name, /, **kwargs):
        reads.append(kwargs.get("keep_from"))
        return real_series(name, **kwargs)

    history.series = counted

    def view(widest=None):
        return EvaluationView(history, now - lookback, coarse_before=now - FULL_RESOLUTION_SECONDS, now=now,
                              widest_reads=widest)

    first = view()
    hour = first.reading_back(3600).series(RESIDENT.name)
    ten_minutes = first.reading_back(600).series(RESIDENT.name)
    assert len(reads) == 2 and first.reads_back[RESIDENT.name] == 3600
    reads.clear()
    second = view(first.reads_back)
    cut = second.reading_back(600).series(RESIDENT.name, pid="1")
    assert len(reads) == 1 and reads[0] == now - 3600   # the hour, read once for both spans
    assert [(list(s.times), list(s.values)) for s in cut] == [(list(s.times), list(s.values)) for s in ten_minutes]
    assert [list(s.times) for s in second.reading_back(3600).series(RESIDENT.name)] == [list(s.times) for s in hour]
    assert len(reads) == 1
    assert min(cut[0].times) >= now - FULL_RESOLUTION_SECONDS and len(cut[0].times) < len(hour[0].times)
