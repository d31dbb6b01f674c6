"""/metrics prepared at the commit (agent/publish/exposition.py): what a commit renders and compresses
in its own thread is what a scrape would have rendered, and a gzipped body joined from per-collector
deflate runs is one valid gzip member holding exactly the identity body."""
from __future__ import annotations

import gzip
import threading
import zlib

import pytest

from hybridmon.agent.loop.history import History
from hybridmon.agent.loop.sampler import Sampler, Scheduled
from hybridmon.agent.publish.exposition import OPENMETRICS, TEXT, Exposition
from hybridmon.exporters.base import MetricSpec, Samples

VALUE = MetricSpec("hybridmon_test_value", "A number set by the test.", "gauge", ("series",))


class Numbers:
    """A collector returning what the test put in `values`: series name -> value."""

    default_interval_seconds = 1.0
    metric_specs = (VALUE,)

    def __init__(self, name: str, values: dict[str, float]) -> None:
        self.name, self.values = name, values

    def collect(self) -> Samples:
        samples = Samples()
        for series, value in self.values.items():
            samples.add(VALUE, value, series)
        return samples

    def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def agent_parts(*collectors: Numbers, clock: Clock | None = None) -> tuple[Sampler, Exposition]:
    sampler = Sampler([Scheduled(c, 1.0, None) for c in collectors], History(60), 1.0,
                      monotonic=clock or Clock())
    return sampler, Exposition(sampler.history, sampler, "live")


def without_own_process(body: bytes) -> bytes:
    """process_* (the test process's own CPU seconds, fds ...) move between two renders."""
    return b"\n".join(line for line in body.split(b"\n") if not line.startswith((b"process_", b"# HELP process_",
                                                                                  b"# TYPE process_")))


@pytest.mark.parametrize("exposition_format", [TEXT, OPENMETRICS])
def test_gzipped_is_one_member_holding_the_identity_body_commit_after_commit(exposition_format):
    # Many series that repeat: compressed runs of their own would show any byte out of place.
    big = Numbers("gpu", {f"s{n}": float(n) for n in range(2000)})
    small = Numbers("pressure", {"cpu": 0.5})
    empty = Numbers("numa", {})  # a part with no text
    sampler, exposition = agent_parts(big, small, empty)
    for tick in range(4):
        big.values["s7"] = tick + 0.25
        small.values["cpu"] = -tick
        for item in sampler.scheduled:
            sampler.run_collector(item, at=float(tick))
        gzipped = exposition.render(exposition_format, gzipped=True)
        plain = exposition.render(exposition_format)
        # One member: zlib in gzip mode stops at the end of the first member and leaves the rest.
        reader = zlib.decompressobj(zlib.MAX_WBITS | 16)
        unpacked = reader.decompress(gzipped)
        assert reader.eof and reader.unused_data == b""
        assert without_own_process(unpacked) == without_own_process(plain)
        assert gzip.decompress(gzipped) == unpacked  # the trailer's CRC-32 and length are checked here
        assert f'hybridmon_test_value{{series="s7"}} {tick + 0.25}'.encode() in unpacked
        assert len(gzipped) < len(plain) / 5


def test_a_commit_renders_and_compresses_in_its_own_thread_what_is_scraped_every_second():
    clock = Clock()
    collector = Numbers("gpu", {"a": 1.0})
    sampler, exposition = agent_parts(collector, clock=clock)
    sampler.run_collector(sampler.scheduled[0], at=1.0)
    assert exposition._parts == {}  # nothing is rendered before a scrape asks
    for _ in range(2):  # Prometheus at 1 s
        clock.now += 1.0
        exposition.render(OPENMETRICS, gzipped=True)

    collector.values["a"] = 2.0
    committed = threading.Thread(target=sampler.run_collector, args=(sampler.scheduled[0], 2.0))
    committed.start()
    committed.join()
    prepared = exposition._parts[(OPENMETRICS, "gpu")]
    assert prepared.samples is sampler.history.latest()["gpu"][1]
    assert b'hybridmon_test_value{series="a"} 2.0' in prepared.text and prepared.deflated is not None
    assert (TEXT, "gpu") not in exposition._parts  # a format nobody asked for is not rendered
    assert b'hybridmon_test_value{series="a"} 2.0' in gzip.decompress(exposition.render(OPENMETRICS, gzipped=True))


def test_a_format_scraped_every_15_s_is_rendered_at_the_scrape_not_at_each_commit():
    clock = Clock()
    collector = Numbers("gpu", {"a": 1.0})
    sampler, exposition = agent_parts(collector, clock=clock)
    for second in range(31):
        collector.values["a"] = float(second)
        sampler.run_collector(sampler.scheduled[0], at=float(second))
        if second % 15 == 0:
            exposition.render(TEXT)
        clock.now += 1.0
    # The last scrape was at second 30: the commit of second 30 came before it, none after.
    collector.values["a"] = 31.0
    sampler.run_collector(sampler.scheduled[0], at=31.0)
    assert exposition._parts[(TEXT, "gpu")].samples is not sampler.history.latest()["gpu"][1]
    assert b'hybridmon_test_value{series="a"} 31.0' in exposition.render(TEXT)


def test_a_failing_render_at_the_commit_leaves_the_commit_and_its_other_hooks_alone(monkeypatch):
    collector = Numbers("gpu", {"a": 1.0})
    sampler, exposition = agent_parts(collector)
    sampler.run_collector(sampler.scheduled[0], at=1.0)
    exposition.render(TEXT)
    exposition.render(TEXT)  # scraped often: commits prepare it
    after, failed = [], []
    sampler.on_commit.append(after.append)

    class Broken:
        def render(self, *_args, **_kwargs):
            failed.append(True)
            raise AssertionError("unexpected rendering")
    monkeypatch.setattr(exposition, "_line_cache", lambda *_args: Broken())
    collector.values["a"] = 2.0
    sampler.run_collector(sampler.scheduled[0], at=2.0)
    assert failed and after == [2.0] and sampler.history.latest()["gpu"][0] == 2.0
    with pytest.raises(AssertionError, match="unexpected rendering"):  # the scrape answers for it (HTTP 500)
        exposition.render(TEXT)


def test_a_withheld_collector_is_left_out_of_both_bodies():
    stuck, live = Numbers("gpu", {"a": 1.0}), Numbers("pressure", {"b": 2.0})
    sampler, exposition = agent_parts(stuck, live)
    for item in sampler.scheduled:
        sampler.run_collector(item, at=1.0)
    exposition.hung_seconds = 5.0
    sampler.scheduled[0].state.running_since = sampler.monotonic() - 6.0  # as a hung run leaves it
    plain = exposition.render(TEXT)
    assert b'series="a"' not in plain and b'series="b"' in plain
    gzipped = gzip.decompress(exposition.render(TEXT, gzipped=True))
    assert b'series="a"' not in gzipped and b'series="b"' in gzipped
    sampler.scheduled[0].state.running_since = None
    assert b'series="a"' in gzip.decompress(exposition.render(TEXT, gzipped=True))


def test_process_metrics_are_read_by_the_commits_and_never_served_older_than_one_interval(monkeypatch):
    clock = Clock()
    collector = Numbers("gpu", {"a": 1.0})
    sampler, exposition = agent_parts(collector, clock=clock)
    reads = []
    collect = exposition._own_process.collect
    monkeypatch.setattr(exposition._own_process, "collect", lambda: reads.append(clock.now) or collect())
    sampler.run_collector(sampler.scheduled[0], at=1.0)
    for second in range(5):  # scraped every second, a commit every second half-way between scrapes
        assert b"process_cpu_seconds_total" in exposition.render(TEXT)
        clock.now += 0.5
        sampler.run_collector(sampler.scheduled[0], at=2.0 + second)
        clock.now += 0.5
    assert reads[0] == 1000.0 and reads[1:] == [1000.5 + second for second in range(1, 5)]  # by the commits
    clock.now += 1.01  # no commit for longer than an interval: the scrape reads it itself
    exposition.render(TEXT)
    assert reads[-1] == clock.now


class Findings:
    """A health_registry collector with a version(), as FindingsCollector: `version` changes when
    what collect() yields may; counts its collects."""

    def __init__(self) -> None:
        self.version_number, self.value, self.collects = 0, 1.0, 0

    def version(self) -> int:
        return self.version_number

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily
        self.collects += 1
        yield GaugeMetricFamily("hybridmon_test_finding", "A finding set by the test.", value=self.value)


def test_a_versioned_part_is_not_collected_by_scrapes_and_is_rendered_by_whoever_changed_it():
    clock = Clock()
    sampler, exposition = agent_parts(Numbers("gpu", {"a": 1.0}), clock=clock)
    findings = Findings()
    exposition.health_registry.register(findings)
    for _ in range(3):  # Prometheus at 1 s: the first scrape renders it, the others serve that text
        clock.now += 1.0
        assert b"hybridmon_test_finding 1.0" in exposition.render(TEXT)
    assert findings.collects == 1
    findings.value, findings.version_number = 2.0, 1  # an evaluation changed the findings
    evaluated = threading.Thread(target=exposition.prepare)  # agent/daemon.py calls it after evaluating
    evaluated.start()
    evaluated.join()
    assert findings.collects == 2
    clock.now += 1.0
    assert b"hybridmon_test_finding 2.0" in exposition.render(TEXT) and findings.collects == 2


def test_a_scrape_serves_the_last_text_of_a_part_another_thread_is_rendering_and_never_waits_for_it():
    sampler, exposition = agent_parts(Numbers("gpu", {"a": 1.0}))
    findings = Findings()
    exposition.health_registry.register(findings)
    assert b"hybridmon_test_finding 1.0" in exposition.render(TEXT)
    findings.value, findings.version_number = 2.0, 1
    with exposition._registry_lock:  # an evaluation's thread is rendering the new findings
        assert b"hybridmon_test_finding 1.0" in exposition.render(TEXT)
    assert b"hybridmon_test_finding 2.0" in exposition.render(TEXT)  # rendered by the scrape itself, at worst


def test_a_part_without_a_version_is_compared_by_its_samples_at_every_scrape():
    sampler, exposition = agent_parts(Numbers("gpu", {"a": 1.0}))
    findings = Findings()
    findings.version = None  # as AlertmanagerCollector: no version(), a few series
    exposition.health_registry.register(findings)
    assert b"hybridmon_test_finding 1.0" in exposition.render(TEXT)
    findings.value = 3.0
    assert b"hybridmon_test_finding 3.0" in exposition.render(TEXT) and findings.collects == 2


class RenderingCommit:
    """A commit in another thread held inside its prepare (the render of its part) until released."""

    def __init__(self, sampler: Sampler, exposition: Exposition, at: float) -> None:
        self.rendering, self.release = threading.Event(), threading.Event()
        prepare = exposition.prepare

        def held_prepare() -> None:
            self.rendering.set()
            self.release.wait(5)
            prepare()
        exposition.prepare = held_prepare
        self.thread = threading.Thread(target=sampler.run_collector, args=(sampler.scheduled[0], at))
        self.thread.start()
        assert self.rendering.wait(5)
        exposition.prepare = prepare

    def finish(self) -> None:
        self.release.set()
        self.thread.join(5)


@pytest.mark.parametrize("gzipped", [False, True])
def test_a_scrape_during_a_commits_render_serves_the_scrape_before_and_the_next_gets_the_commit(gzipped):
    clock = Clock()
    collector = Numbers("gpu", {"a": 1.0})
    sampler, exposition = agent_parts(collector, clock=clock)
    sampler.run_collector(sampler.scheduled[0], at=1.0)

    def scrape() -> bytes:
        clock.now += 1.0  # Prometheus at 1 s
        body = exposition.render(TEXT, gzipped=gzipped)
        return gzip.decompress(body) if gzipped else body
    scrape()
    collector.values["a"] = 2.0
    commit = RenderingCommit(sampler, exposition, 2.0)
    assert b'series="a"} 1.0' in scrape()  # not waiting for the commit's render, not rendering its part
    commit.finish()
    assert b'series="a"} 2.0' in scrape()


def test_the_last_body_is_never_served_to_a_scraper_that_comes_seldom_nor_once_older_than_the_window():
    clock = Clock()
    collector = Numbers("gpu", {"a": 0.0})
    sampler, exposition = agent_parts(collector, clock=clock)
    sampler.run_collector(sampler.scheduled[0], at=1.0)
    exposition.render(TEXT)
    clock.now += 15.0  # a scraper every 15 s: the commits do not prepare for it
    collector.values["a"] = 1.0
    commit = RenderingCommit(sampler, exposition, 2.0)
    assert b'series="a"} 1.0' in exposition.render(TEXT)
    commit.finish()
    # Scraped every second from here, each scrape landing in a commit's render: the body joined at
    # second 15 is served while it is at most 2.5 s old, then the scrape joins the parts itself.
    served = []
    for second in range(2, 6):
        clock.now += 1.0
        collector.values["a"] = float(second)
        commit = RenderingCommit(sampler, exposition, float(second + 1))
        served.append(exposition.render(TEXT).split(b'series="a"} ')[1].split(b"\n")[0])
        commit.finish()
    assert served == [b"1.0", b"1.0", b"4.0", b"4.0"]
