import errno
import logging
import shutil
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridmon.exporters.sources import LiveSource, RecordingSource, ReplaySource
from hybridmon.exporters.base import CollectorError, NoDataError, ParseError
from hybridmon.exporters.pressure import PressureCollector, PressureStall, parse_pressure
from tests.support.paths import FIXTURE_HOST
from tests.support.parser_properties import each_number_made_huge
from tests.support.parser_properties import ParserRow, read

RESOURCES = ("memory", "io", "cpu")
STALLED = "hybridmon_pressure_stalled_seconds_total"
# /proc/pressure/cpu before kernel 5.13: no system-wide `full` line.
OLD_KERNEL_CPU = "some avg10=0.52 avg60=0.31 avg300=0.12 total=402311942\n"


def read_fixture(resource: str) -> str:
    return (FIXTURE_HOST / "proc" / "pressure" / resource).read_text()


@pytest.fixture
def procfs_copy(tmp_path: Path) -> Path:
    """The fixture's /proc/pressure, copied so a test can delete or garble files."""
    shutil.copytree(FIXTURE_HOST / "proc" / "pressure", tmp_path / "pressure")
    return tmp_path


def as_tuples(samples) -> list[tuple[str, tuple[str, ...], float]]:
    return [(s.spec.name, s.label_values, s.value) for s in samples]


def replay_of(readings: list) -> ReplaySource:
    replay = ReplaySource()
    replay.load(readings)
    return replay


def failed_reads(procfs: str, code: int) -> list:
    """Recorded readings in which every PSI file failed with errno `code`."""
    return [["text", f"{procfs}/pressure/{r}", False, {"errno": code, "message": "x"}]
            for r in RESOURCES]


def test_parse_pressure_fixture() -> None:
    assert parse_pressure(read_fixture("memory")) == {
        "some": PressureStall(18.42, 12.07, 6.31, 48213376512),
        "full": PressureStall(9.87, 6.54, 3.21, 21034567890),
    }
    assert parse_pressure(read_fixture("cpu"))["full"] == PressureStall(0.0, 0.0, 0.0, 0)


def test_parse_pressure_old_kernel_cpu_has_no_full() -> None:
    assert parse_pressure(OLD_KERNEL_CPU) == {"some": PressureStall(0.52, 0.31, 0.12, 402311942)}


@pytest.mark.parametrize("garbage", [
    "",
    "\n",
    "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",  # no `some`
    "some avg10=0.00 avg60=0.00 avg300=0.00\n",  # no total
    "some avg10=0.00 avg60=0.00 avg300=0.00 total=1.5\n",
    "some avg10=nan avg60=0.00 avg300=0.00 total=1\n",
    "some avg10=0.00 avg60=0.00 avg300=0.00 total=-1\n",
    "some avg10=0.00 avg60=0.00 avg300=0.00 total=1\nsome avg10=0 avg60=0 avg300=0 total=2\n",
    "Some avg10=0.00 avg60=0.00 avg300=0.00 total=1\n",
])
def test_parse_pressure_rejects_garbage(garbage: str) -> None:
    with pytest.raises(ParseError):
        parse_pressure(garbage)


def test_collector_on_fixture_host(fixture_procfs: str) -> None:
    collector = PressureCollector(LiveSource(), fixture_procfs)
    assert (collector.name, collector.default_interval_seconds) == ("pressure", 1.0)
    assert as_tuples(collector.collect()) == [
        (STALLED, ("memory", "some"), 48213.376512),
        (STALLED, ("memory", "full"), 21034.56789),
        (STALLED, ("io", "some"), 31234.56789),
        (STALLED, ("io", "full"), 24567.890123),
        (STALLED, ("cpu", "some"), 8765.432109),
    ]


def test_system_wide_cpu_full_is_never_exported(procfs_copy: Path) -> None:
    # Undefined system-wide: zeros on current kernels, idle wake-up latency on 5.13-era ones.
    (procfs_copy / "pressure" / "cpu").write_text(
        "some avg10=0.92 avg60=0.91 avg300=0.73 total=933490489\n"
        "full avg10=0.22 avg60=0.23 avg300=0.16 total=358783277\n")
    samples = PressureCollector(LiveSource(), str(procfs_copy)).collect()
    assert samples.value(STALLED, resource="cpu", scope="some") == 933.490489
    assert samples.find(STALLED, resource="cpu", scope="full") == []
    assert samples.value(STALLED, resource="memory", scope="full") == 21034.56789


def test_old_kernel_cpu_full_is_absent(procfs_copy: Path) -> None:
    (procfs_copy / "pressure" / "cpu").write_text(OLD_KERNEL_CPU)
    samples = PressureCollector(LiveSource(), str(procfs_copy)).collect()
    assert samples.value(STALLED, resource="cpu", scope="some") == 402.311942
    assert samples.find(STALLED, resource="cpu", scope="full") == []
    assert len(samples) == 5


def test_collector_on_this_host() -> None:
    try:
        Path("/proc/pressure/memory").read_text()
    except OSError:
        with pytest.raises(NoDataError, match="psi=1"):
            PressureCollector(LiveSource()).collect()
        return
    collector = PressureCollector(LiveSource())
    first = collector.collect()
    second = collector.collect()
    assert {s.label_values[0] for s in first} == set(RESOURCES)
    for resource in RESOURCES:
        for scope in ("some", "full"):
            before = first.value(STALLED, resource=resource, scope=scope)
            if (resource, scope) == ("cpu", "full"):
                assert before is None  # undefined system-wide
                continue
            assert 0 <= before <= second.value(STALLED, resource=resource, scope=scope)


def test_missing_pressure_directory_says_how_to_enable_psi(tmp_path: Path) -> None:
    with pytest.raises(NoDataError, match="PSI.*off.*psi=1"):
        PressureCollector(LiveSource(), str(tmp_path)).collect()


def test_psi_disabled_eopnotsupp_is_no_data() -> None:
    source = replay_of(failed_reads("/proc", errno.EOPNOTSUPP))
    with pytest.raises(NoDataError, match="psi=1"):
        PressureCollector(source).collect()


def test_unreadable_for_another_reason_is_a_collector_error() -> None:
    source = replay_of(failed_reads("/proc", errno.EACCES))
    with pytest.raises(CollectorError, match="/proc/pressure/memory"):
        PressureCollector(source).collect()


def test_one_file_missing_leaves_the_others(procfs_copy: Path, caplog) -> None:
    (procfs_copy / "pressure" / "io").unlink()
    collector = PressureCollector(LiveSource(), str(procfs_copy))
    with caplog.at_level(logging.WARNING, logger="hybridmon.exporters.pressure"):
        samples = collector.collect()
        collector.collect()
    assert {s.label_values[0] for s in samples} == {"memory", "cpu"}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "pressure/io" in warnings[0]


def test_garbled_file_leaves_the_others(procfs_copy: Path) -> None:
    (procfs_copy / "pressure" / "memory").write_text("some avg10=?? total=\n")
    samples = PressureCollector(LiveSource(), str(procfs_copy)).collect()
    assert {s.label_values[0] for s in samples} == {"io", "cpu"}
    assert samples.value(STALLED, resource="io", scope="full") == 24567.890123


@pytest.mark.parametrize(
    "procfs", [str(FIXTURE_HOST / "proc"), "/proc"], ids=["fixture", "this-host"]
)
def test_record_then_replay_gives_identical_samples(procfs: str) -> None:
    recording = RecordingSource()
    try:
        recorded = list(PressureCollector(recording, procfs).collect())
    except NoDataError:  # a host without PSI: the replay must say the same
        with pytest.raises(NoDataError):
            PressureCollector(replay_of(recording.take_readings()), procfs).collect()
        return
    replayed = PressureCollector(replay_of(recording.take_readings()), procfs).collect()
    assert list(replayed) == recorded


@pytest.mark.parametrize("resource", RESOURCES)
def test_parse_pressure_refuses_numbers_longer_than_int_accepts(resource: str) -> None:
    texts = list(each_number_made_huge(read_fixture(resource)))
    assert len(texts) >= 8  # avg10, avg60, avg300 and total, in two digit runs or one, per line
    for text in texts:
        with pytest.raises(ParseError):
            parse_pressure(text)


averages = st.decimals(0, 100, places=2).map(str)


@given(st.lists(st.tuples(averages, averages, averages, st.integers(0, 2**64 - 1)),
                min_size=1, max_size=2))
def test_parse_pressure_round_trip(lines: list) -> None:
    scopes = ("some", "full")[: len(lines)]
    text = "".join(f"{scope} avg10={a} avg60={b} avg300={c} total={t}\n"
                   for scope, (a, b, c, t) in zip(scopes, lines))
    parsed = parse_pressure(text)
    assert list(parsed) == list(scopes)
    for scope, (a, b, c, t) in zip(scopes, lines):
        assert parsed[scope] == PressureStall(float(a), float(b), float(c), t)


# This module's parsers, each with realistic samples, for tests/exporters/test_parsers_robustness.py
# (which holds every parse_* of exporters/ to its one promised error).
PARSER_ROWS = [ParserRow(parse_pressure, read(FIXTURE_HOST / "proc/pressure/memory",
                                               FIXTURE_HOST / "proc/pressure/io", FIXTURE_HOST / "proc/pressure/cpu"))]
