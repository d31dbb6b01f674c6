"""The faulting_processes collector: every process's major faults, read only while the host swaps in.

Its procfs is a copy of the fixture host's processes (systemd, vLLM as python3 4242, llama-server
5151) plus an unwatched batch job; each test rewrites majflt (field 12 of /proc/<pid>/stat, the
10th field after the comm) as the kernel would count it. Its parser is process.parse_proc_stat,
whose PARSER_ROWS are in test_process.py: this collector has no parser of its own.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from hybridmon.exporters import registry
from hybridmon.exporters.base import CollectorContext
from hybridmon.exporters.faulting_processes import (FaultingProcessesCollector, FaultingProcessesSettings,
                                                    MAJOR_FAULT_RATE)
from hybridmon.exporters.sources import LiveSource, RecordingSource, ReplaySource
from tests.support.paths import FIXTURE_HOST

MIB = 1024 ** 2
BATCH = 7001  # an unwatched batch job; its stat line is the fixture vLLM's with another comm
PIDS = (1, 4242, 5151, BATCH)


class CountingSource(LiveSource):
    """Reads the tree and counts every file read and directory listing, by path."""

    def __init__(self) -> None:
        self.reads: Counter[str] = Counter()

    def read_text(self, path: str) -> str:
        self.reads[path] += 1
        return super().read_text(path)

    def list_dir(self, path: str) -> list[str]:
        self.reads[path + "/"] += 1
        return super().list_dir(path)


class Host:
    """A procfs of four processes whose majflt counters the test moves, and the host's swap-in
    counter (pswpin + zswpin, bytes) as host_memory's swap_in_bytes() would hand it over."""

    def __init__(self, root: Path) -> None:
        self.procfs = root / "proc"
        self.lines: dict[int, list[str]] = {}
        for pid in PIDS:
            text = (FIXTURE_HOST / "proc" / str(4242 if pid == BATCH else pid) / "stat").read_text()
            comm = "batch_job" if pid == BATCH else text[text.find("(") + 1:text.rfind(")")]
            self.lines[pid] = [str(pid), f"({comm})", *text[text.rfind(")") + 1:].split()]
        self.majflt = {pid: 1000 for pid in PIDS}
        self.swap_in = 0
        self.now = 0.0
        (self.procfs / "self").mkdir(parents=True)  # not a pid: skipped
        self.write()

    def write(self) -> None:
        for pid, fields in self.lines.items():
            fields = list(fields)
            fields[11] = str(self.majflt[pid])  # field 12 of /proc/<pid>/stat: majflt
            (self.procfs / str(pid)).mkdir(exist_ok=True)
            (self.procfs / str(pid) / "stat").write_text(" ".join(fields) + "\n")

    def tick(self, seconds: float, swap_in_bytes_per_second: float, faults_per_second: dict[int, float]) -> None:
        self.now += seconds
        self.swap_in += int(swap_in_bytes_per_second * seconds)
        for pid, rate in faults_per_second.items():
            self.majflt[pid] += int(rate * seconds)
        self.write()

    def collector(self, source=None, **options) -> FaultingProcessesCollector:
        return FaultingProcessesCollector(source or LiveSource(), lambda: self.swap_in, procfs=str(self.procfs),
                                          clock=lambda: self.now, **options)


def rates(samples) -> dict[tuple[str, ...], float]:
    return {s.label_values: s.value for s in samples if s.spec is MAJOR_FAULT_RATE}


@pytest.fixture
def host(tmp_path: Path) -> Host:
    return Host(tmp_path)


def test_quiet_host_reads_no_process(host: Host) -> None:
    """A host that swaps in below the gate (here 0.5 MiB/s, with vLLM taking 150 major faults/s
    of file reads) pays nothing: no /proc listing, no /proc/<pid>/stat read, in 20 collections."""
    source = CountingSource()
    collector = host.collector(source)
    for _ in range(20):
        assert rates(collector.collect()) == {}
        host.tick(5, 0.5 * MIB, {4242: 150})
    assert source.reads == Counter()


def test_thrash_names_the_faulting_processes_watched_or_not(host: Host) -> None:
    """Swap-in at 30 MB/s (zswap): the first scan is a baseline, the second names the batch job
    (7,400 major faults/s) and vLLM (150/s); systemd and llama-server, not faulting, are not named."""
    collector = host.collector()
    collector.collect()  # the gate needs a rate: two readings of the swap-in counter
    host.tick(5, 30e6, {BATCH: 7400, 4242: 150})
    assert rates(collector.collect()) == {}  # the first scan: a baseline
    host.tick(5, 30e6, {BATCH: 7400, 4242: 150})
    assert rates(collector.collect()) == {(str(BATCH), "batch_job"): 7400.0, ("4242", "python3"): 150.0}


def test_floor_and_cap(host: Host) -> None:
    """Below the floor (10/s by default) a process is never named; above it only the `top`
    busiest are, busiest first (a tie goes to the lower pid)."""
    collector = host.collector(top=2)
    collector.collect()
    for _ in range(2):
        host.tick(5, 30e6, {BATCH: 7400, 4242: 150, 5151: 40, 1: 9.8})
        samples = collector.collect()
    assert list(rates(samples)) == [(str(BATCH), "batch_job"), ("4242", "python3")]
    collector = host.collector(top=5)
    collector.collect()
    for _ in range(2):
        host.tick(5, 30e6, {BATCH: 7400, 4242: 150, 5151: 40, 1: 9.8})
        samples = collector.collect()
    assert rates(samples) == {(str(BATCH), "batch_job"): 7400.0, ("4242", "python3"): 150.0,
                              ("5151", "llama-server"): 40.0}  # systemd's 9.8/s is under the floor


def test_scan_stops_when_swap_in_stops(host: Host) -> None:
    """The gate drops: nothing is read or named; when it rises again the first scan is a new
    baseline, not a rate over the quiet minutes between."""
    source = CountingSource()
    collector = host.collector(source)
    collector.collect()
    host.tick(5, 30e6, {BATCH: 7400})
    collector.collect()
    host.tick(5, 30e6, {BATCH: 7400})
    assert rates(collector.collect())
    before = sum(source.reads.values())
    for _ in range(12):
        host.tick(5, 0, {BATCH: 3})
        assert rates(collector.collect()) == {}
    assert sum(source.reads.values()) == before
    host.tick(5, 30e6, {BATCH: 20})
    assert rates(collector.collect()) == {}  # a baseline again
    host.tick(5, 30e6, {BATCH: 20})
    assert rates(collector.collect()) == {(str(BATCH), "batch_job"): 20.0}


def test_a_reused_pid_is_not_given_the_old_process_faults(host: Host) -> None:
    collector = host.collector()
    collector.collect()
    host.tick(5, 30e6, {BATCH: 7400})
    collector.collect()
    host.lines[BATCH][21] = str(int(host.lines[BATCH][21]) + 500)  # starttime: another process
    host.majflt[BATCH] = 5_000_000
    host.tick(5, 30e6, {})
    assert rates(collector.collect()) == {}


def test_exited_and_garbled_processes_are_skipped(host: Host) -> None:
    collector = host.collector()
    collector.collect()
    host.tick(5, 30e6, {BATCH: 7400, 4242: 150})
    collector.collect()
    host.tick(5, 30e6, {BATCH: 7400, 4242: 150})
    (host.procfs / "5151" / "stat").unlink()
    (host.procfs / "1" / "stat").write_text("1 (systemd\n")
    assert rates(collector.collect()) == {(str(BATCH), "batch_job"): 7400.0, ("4242", "python3"): 150.0}


def test_unknown_swap_in_scans_nothing(host: Host) -> None:
    source = CountingSource()
    collector = FaultingProcessesCollector(source, lambda: None, procfs=str(host.procfs), clock=lambda: host.now)
    for _ in range(3):
        host.tick(5, 30e6, {BATCH: 7400})
        assert rates(collector.collect()) == {}
    assert source.reads == Counter()


def test_recorded_scan_replays(host: Host) -> None:
    """Every read goes through the source, the host's swap-in counter too (the agent's factory
    passes it through the collector's source as here): a replay of the recording gives the same
    series with the tree deleted."""
    recording = RecordingSource()
    collector = FaultingProcessesCollector(
        recording, lambda: recording.call("agent.host_swap_in_bytes", lambda: host.swap_in),
        procfs=str(host.procfs), clock=lambda: host.now)
    readings, expected = [], []
    for _ in range(4):
        host.tick(5, 30e6, {BATCH: 7400, 4242: 150})
        expected.append(rates(collector.collect()))
        readings.append(recording.take_readings())
    assert expected[-1] == {(str(BATCH), "batch_job"): 7400.0, ("4242", "python3"): 150.0}
    for path in sorted(host.procfs.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    replay = ReplaySource()
    replayed = FaultingProcessesCollector(
        replay, lambda: replay.call("agent.host_swap_in_bytes", lambda: None), procfs=str(host.procfs),
        clock=lambda: 0.0)
    got = []
    for recorded in readings:
        replay.load(recorded)
        got.append(rates(replayed.collect()))
    assert got == expected


def test_bad_settings_are_refused(host: Host) -> None:
    with pytest.raises(ValueError, match="top must be at least 1"):
        host.collector(top=0)
    with pytest.raises(ValueError, match="must be above 0"):
        host.collector(min_major_faults_per_second=0)
    with pytest.raises(ValueError):
        FaultingProcessesSettings(top=0)


def test_registered_after_host_memory() -> None:
    names = registry.NAMES
    assert names.index("faulting_processes") > names.index("host_memory")
    assert registry.registration("faulting_processes").runs_after == ("host_memory",)


def test_factory_reads_host_memory_through_its_own_source(host: Host) -> None:
    """The agent's wiring: the gate's counter is host_memory's swap_in_bytes(), recorded as a
    call of this collector's source; without host_memory the collector reads nothing."""

    class HostMemory:
        def swap_in_bytes(self) -> int:
            return host.swap_in

    registration = registry.registration("faulting_processes")
    recording = RecordingSource()
    context = CollectorContext(recording, FaultingProcessesSettings(), procfs=str(host.procfs),
                               earlier={"host_memory": HostMemory()})
    collector = registration.factory(context)
    host.swap_in = 123
    collector.collect()
    calls = [(kind, key, payload) for kind, key, _, payload in recording.take_readings() if kind == "call"]
    assert ("call", "agent.host_swap_in_bytes", 123) in calls
    source = CountingSource()
    alone = registration.factory(CollectorContext(source, FaultingProcessesSettings(), procfs=str(host.procfs)))
    for _ in range(3):
        host.tick(5, 30e6, {BATCH: 7400})
        assert rates(alone.collect()) == {}
    assert source.reads == Counter()
