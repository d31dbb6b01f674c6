"""The sampling loop and record/replay plumbing, with small collectors that read through a source."""
import gzip
import json
import os
import threading
import time

import jsonschema
import pytest

from hybridmon.agent.publish.exposition import Exposition
from hybridmon.agent.loop.history import History
from hybridmon.agent.loop.sampler import Sampler, Scheduled
from hybridmon.exporters.sources import RecordingSource, ReplaySource
from hybridmon.agent.loop.trace import TraceError, TraceReader, TraceWriter
from hybridmon.exporters.base import MetricSpec, NoDataError, Samples

VALUE = MetricSpec("hybridmon_test_value", "A number read from a file.", "gauge", ("file",))
SCHEMA = json.loads(open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "trace-format.schema.json")).read())


class FileNumberCollector:
    name = "host_memory"
    default_interval_seconds = 1.0
    metric_specs = (VALUE,)

    def __init__(self, source, directory):
        self.source, self.directory = source, directory

    def collect(self):
        samples = Samples()
        for name in self.source.list_dir(self.directory):
            try:
                text = self.source.read_text(os.path.join(self.directory, name))
            except OSError:
                continue
            samples.add(VALUE, float(text), name)
        return samples

    def close(self):
        pass


class Broken:
    name = "pressure"
    default_interval_seconds = 1.0
    metric_specs = ()

    def __init__(self, error):
        self.error = error

    def collect(self):
        raise self.error

    def close(self):
        pass


def sampler_for(*collectors, recorder=None):
    scheduled = [Scheduled(c, 1.0, getattr(c, "source", None)) for c in collectors]
    history = History(60)
    return Sampler(scheduled, history, 1.0, recorder=recorder)


def test_a_failing_collector_is_counted_and_the_others_still_commit(tmp_path):
    (tmp_path / "a").write_text("1.5")
    good = FileNumberCollector(RecordingSource(), str(tmp_path))
    bad = Broken(RuntimeError("boom"))
    sampler = sampler_for(good, bad)
    for item in sampler.scheduled:
        sampler.run_collector(item, at=10.0)
    good_state, bad_state = (item.state for item in sampler.scheduled)
    assert good_state.last_success is True and bad_state.last_success is False
    assert bad_state.errors == 1 and bad_state.last_error == "RuntimeError: boom"
    text = Exposition(sampler.history, sampler, "live").render().decode()
    assert 'hybridmon_test_value{file="a"} 1.5' in text
    assert 'hybridmon_collector_success{collector="pressure"} 0.0' in text
    assert 'hybridmon_collector_last_error_timestamp_seconds{collector="pressure"} 10.0' in text
    assert 'hybridmon_collector_errors_total{collector="pressure"} 1.0' in text


def test_absent_source_is_success_with_no_data(tmp_path):
    sampler = sampler_for(Broken(NoDataError("no PSI here")))
    sampler.run_collector(sampler.scheduled[0], at=1.0)
    state = sampler.scheduled[0].state
    assert state.last_success is True and state.no_data_reason == "no PSI here" and state.errors == 0


def test_a_hung_collector_does_not_hold_up_the_tick():
    release = threading.Event()

    class Hung(Broken):
        def collect(self):
            release.wait(5)
            return Samples()

    sampler = sampler_for(Hung(None))
    sampler.tick()
    time.sleep(0.05)
    started = time.monotonic()
    sampler.tick()  # still running: skipped, not stacked
    assert time.monotonic() - started < 0.05
    text = Exposition(sampler.history, sampler, "live").render().decode()
    running = [l for l in text.splitlines() if l.startswith("hybridmon_collector_running_seconds")]
    assert running and float(running[0].split()[-1]) > 0.0
    release.set()
    assert sampler.stop(timeout=2) == []


def test_exposition_is_rerendered_after_each_commit(tmp_path):
    (tmp_path / "a").write_text("1")
    collector = FileNumberCollector(RecordingSource(), str(tmp_path))
    sampler = sampler_for(collector)
    exposition = Exposition(sampler.history, sampler, "live")
    sampler.run_collector(sampler.scheduled[0], at=1.0)
    assert b'hybridmon_test_value{file="a"} 1.0' in exposition.render()
    (tmp_path / "a").write_text("2")
    sampler.run_collector(sampler.scheduled[0], at=2.0)
    assert b'hybridmon_test_value{file="a"} 2.0' in exposition.render()


def test_record_then_replay_gives_the_same_samples_and_valid_lines(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    trace = tmp_path / "trace.jsonl.gz"
    writer = TraceWriter(trace, {"paths": {}, "process": {}, "gpu": {}, "pcie": {}, "collectors": {}})
    live = FileNumberCollector(RecordingSource(), str(data))
    sampler = sampler_for(live, recorder=writer)
    seen_live = []
    for tick, value in enumerate(["1", "2", "3"]):
        (data / "x").write_text(value)
        if tick == 1:
            (data / "y").write_text("7")
        if tick == 2:
            os.remove(data / "y")
        sampler.run_collector(sampler.scheduled[0], at=100.0 + tick)
        seen_live.append(sorted((s.label_values, s.value) for s in sampler.history.latest()["host_memory"][1]))
    writer.close()

    with gzip.open(trace, "rt") as handle:
        for line in handle:
            jsonschema.validate(json.loads(line), SCHEMA)

    reader = TraceReader(trace)
    replay_source = ReplaySource()
    replayed = FileNumberCollector(replay_source, str(data))
    seen_replay = []
    for record in reader.records():
        replay_source.load(record.readings)
        seen_replay.append(sorted((s.label_values, s.value) for s in replayed.collect()))
    assert seen_replay == seen_live
    assert not reader.truncated


def test_a_cut_off_trace_replays_what_is_complete(tmp_path):
    trace = tmp_path / "trace.jsonl.gz"
    writer = TraceWriter(trace, {"paths": {}})
    for second in range(50):
        writer.write("host_memory", float(second), [["text", "/proc/x", True, str(second) * 200]])
    writer.close()
    raw = trace.read_bytes()
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(raw[: len(raw) * 2 // 3])
    reader = TraceReader(cut)
    records = list(reader.records())
    assert 0 < len(records) < 50 and reader.truncated


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "not gzip-compressed|is empty"),
        (b"plain text\n", "not gzip-compressed"),
        (gzip.compress(b'{"kind": "header", "format": "other"}\n', mtime=0), "does not start with a hybridmon trace header"),
        (gzip.compress(b'{"kind": "header", "format": "hybridmon-trace", "version": 99, "config": {}}\n', mtime=0), "version 99"),
        (gzip.compress(b"not json\n", mtime=0), "line 1 is not JSON"),
    ],
)
def test_malformed_traces_are_refused_clearly(tmp_path, content, message):
    path = tmp_path / "bad.gz"
    path.write_bytes(content)
    with pytest.raises(TraceError, match=message):
        TraceReader(path)


def test_missing_trace_file_is_clear(tmp_path):
    with pytest.raises(TraceError, match="does not exist"):
        TraceReader(tmp_path / "nope.gz")


def test_replay_source_rebuilds_the_recorded_os_error():
    source = ReplaySource()
    source.load([["text", "/proc/1/stat", False, {"errno": 2, "message": "No such file or directory"}]])
    with pytest.raises(FileNotFoundError):
        source.read_text("/proc/1/stat")


def test_a_collector_waits_for_the_first_run_of_the_one_it_depends_on(tmp_path):
    (tmp_path / "a").write_text("1")
    first = FileNumberCollector(RecordingSource(), str(tmp_path))
    second = Broken(NoDataError("x"))
    history = History(60)
    scheduled = [Scheduled(second, 1.0, None, after=("host_memory",)), Scheduled(first, 1.0, first.source)]
    sampler = Sampler(scheduled, history, 1.0)
    sampler.tick()
    deadline = time.monotonic() + 2
    while scheduled[1].state.runs == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduled[0].state.runs == 0  # held back on the first tick
    scheduled[0].next_due = scheduled[1].next_due = 0.0
    sampler.tick()
    deadline = time.monotonic() + 2
    while scheduled[0].state.runs == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduled[0].state.runs == 1
    sampler.stop()


def test_reads_inside_a_call_are_not_recorded_and_replay_needs_only_the_result(tmp_path):
    (tmp_path / "a").write_text("1")
    recording = RecordingSource()

    def scan():
        return sorted(recording.list_dir(str(tmp_path)) + [recording.read_text(str(tmp_path / "a"))])

    assert recording.call("scan", scan) == ["1", "a"]
    assert recording.take_readings() == [["call", "scan", True, ["1", "a"]]]
    replay = ReplaySource()
    replay.load([["call", "scan", True, ["1", "a"]]])
    assert replay.call("scan", lambda: pytest.fail("a replay never runs the fetch")) == ["1", "a"]


class CountingClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_every_nominal_tick_runs_a_one_second_collector_despite_jitter(tmp_path):
    (tmp_path / "a").write_text("1")
    collector = FileNumberCollector(RecordingSource(), str(tmp_path))
    clock = CountingClock()
    sampler = Sampler([Scheduled(collector, 1.0, collector.source)], History(60), 1.0, monotonic=clock)
    submitted = []
    sampler._pool.submit = lambda fn, item: submitted.append(item)  # count starts, run nothing
    for tick in range(20):
        sampler.tick(1000.0 + tick)  # nominal times; the wake-up jitter no longer matters
    assert len(submitted) == 20
    sampler.stop()


def test_a_hung_dependency_holds_back_its_dependants_for_one_interval_only():
    clock = CountingClock()
    gpu = Broken(None)
    gpu.name = "gpu"
    process = Broken(NoDataError("x"))
    process.name = "process"
    scheduled = [Scheduled(gpu, 1.0, None), Scheduled(process, 1.0, None, after=("gpu",))]
    sampler = Sampler(scheduled, History(60), 1.0, monotonic=clock)
    started = []
    sampler._pool.submit = lambda fn, item: started.append(item.collector.name)
    sampler.tick(clock.now)
    assert started == ["gpu"]
    scheduled[0].state.running_since = clock.now  # the GPU collector hangs in its first run
    scheduled[0].lock.acquire()
    sampler.tick(clock.now + 0.5)
    assert started == ["gpu"]
    sampler.tick(clock.now + 1.5)
    assert started == ["gpu", "process"]
    scheduled[0].lock.release()
    sampler.stop()


def test_a_full_disk_stops_the_recording_not_the_sampling(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a").write_text("4")
    writer = TraceWriter(tmp_path / "t.jsonl.gz", {})

    def disk_full(_line):
        raise OSError(28, "No space left on device")

    writer._write = disk_full
    collector = FileNumberCollector(RecordingSource(), str(data))
    sampler = sampler_for(collector, recorder=writer)
    sampler.run_collector(sampler.scheduled[0], at=1.0)
    sampler.run_collector(sampler.scheduled[0], at=2.0)
    assert sampler.history.latest()["host_memory"][1].value("hybridmon_test_value", file="a") == 4.0
    assert sampler.scheduled[0].state.last_success is True
    assert "recording stopped after 0 records" in writer.error and "No space left" in writer.error


@pytest.mark.parametrize(
    "line, message",
    [
        ({"kind": "reading", "collector": "gpu", "readings": []}, "no numeric time"),
        ({"kind": "reading", "collector": "gpu", "time": "soon", "readings": []}, "no numeric time"),
        ({"kind": "reading", "collector": "gpu", "time": 1, "readings": [[["list"], "k", True, 1]]}, "is not \\[kind, key, ok, payload\\]"),
        ({"kind": "reading", "collector": "gpu", "time": 1, "readings": [["text", "/x", "yes", ""]]}, "is not \\[kind, key, ok, payload\\]"),
        ({"kind": "reading", "time": 1, "readings": []}, "lacks its collector"),
        ({"kind": "mystery"}, "unknown line kind"),
    ],
)
def test_malformed_trace_lines_are_trace_errors(tmp_path, line, message):
    path = tmp_path / "t.jsonl.gz"
    with gzip.open(path, "wt") as handle:
        handle.write(json.dumps({"kind": "header", "format": "hybridmon-trace", "version": 1, "config": {}}) + "\n")
        handle.write(json.dumps(line) + "\n")
    with pytest.raises(TraceError, match=message):
        list(TraceReader(path).records())
