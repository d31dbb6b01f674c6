import itertools
import logging
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridmon.exporters import numa
from hybridmon.exporters.sources import LiveSource, RecordingSource, ReplaySource
from hybridmon.exporters.base import CollectorContext, CollectorError, NoDataError, ParseError
from hybridmon.exporters.numa import (
    NumaCollector,
    ProcessNumaCollector,
    parse_node_meminfo,
    parse_numa_maps,
    parse_numastat,
)
from hybridmon.exporters.process import ProcessCollector
from hybridmon.exporters.procfs import parse_cpu_list
from tests.support.paths import FIXTURE_HOST
from hybridmon.exporters.numa import parse_task_stat
from tests.support.parser_properties import ParserRow, read

KIB = 1024
REPO = Path(__file__).resolve().parents[2]
NODE_DIR = FIXTURE_HOST / "sys/devices/system/node"
VLLM_NUMA_MAPS = (FIXTURE_HOST / "proc/4242/numa_maps").read_text()
LLAMA_NUMA_MAPS = (FIXTURE_HOST / "proc/5151/numa_maps").read_text()
NODE0_MEMINFO = (NODE_DIR / "node0/meminfo").read_text()
NODE1_NUMASTAT = (NODE_DIR / "node1/numastat").read_text()

# Pages of the fixture processes per node, as written in their numa_maps (see
# tests/fixtures/host-2node/README-process-numa.md).
VLLM_NODE0_BYTES = (143 + 651 + 121 + 10 + 131072 + 65536 + 34) * 4 * KIB
VLLM_NODE1_BYTES = (131072 + 5963732 + 1047661) * 4 * KIB
LLAMA_NODE1_BYTES = (300 + 1500 + 200 + 8 + 131072 + 1146880 + 65536 + 33) * 4 * KIB
FIXTURE_WATCHED = {4242: "python3", 5151: "llama-server"}
# The fixture's GPUs (tests/support/fake_nvml.py): vLLM on GPU 0 (0000:17:00.0, sysfs numa_node 0),
# llama-server on GPU 1 (0000:ca:00.0, node 1).
FIXTURE_GPU_BUSES = {4242: ("0000:17:00.0",), 5151: ("0000:ca:00.0",)}
CPU_OFF = numa.PROCESS_CPU_SECONDS_OFF_GPU_NODE.name
RESIDENT_OFF = numa.PROCESS_RESIDENT_OFF_GPU_NODE.name


def as_tuples(samples):
    return [(s.spec.name, s.label_values, s.value) for s in samples]


def fake_timer(step=0.25):
    ticks = itertools.count()
    return lambda: next(ticks) * step


@pytest.fixture
def host_copy(tmp_path) -> Path:
    """A private copy of the fixture host to delete and garble files in."""
    shutil.copytree(FIXTURE_HOST, tmp_path / "host", symlinks=True)
    return tmp_path / "host"


# --- parsers ---------------------------------------------------------------------------------

def test_parse_cpu_list_ranges_and_singles():
    assert parse_cpu_list("0-3,8,10-11\n") == frozenset({0, 1, 2, 3, 8, 10, 11})
    assert parse_cpu_list((NODE_DIR / "node1/cpulist").read_text()) == frozenset(range(8, 16))
    assert parse_cpu_list((NODE_DIR / "online").read_text()) == frozenset({0, 1})
    assert parse_cpu_list("5") == frozenset({5})


def test_parse_cpu_list_empty_is_a_node_without_cpus():
    assert parse_cpu_list("\n") == frozenset()


@pytest.mark.parametrize("text", ["3-1", "a", "0-", "1,,2", "-1", "0-3:2", "0-99999999999", "1 2"])
def test_parse_cpu_list_rejects_garbage(text):
    with pytest.raises(ParseError):
        parse_cpu_list(text)


def test_parse_node_meminfo_fixture():
    fields = parse_node_meminfo(NODE0_MEMINFO)
    assert fields["MemTotal"] == 263994206 * KIB
    assert fields["MemFree"] == 1048576 * KIB
    assert fields["HugePages_Total"] == 0
    assert len(fields) == 36
    assert parse_node_meminfo("Node 1 HugePages_Total:  1024\n") == {"HugePages_Total": 1024}  # a count


@pytest.mark.parametrize("text", ["", "MemTotal: 5 kB", "Node 0 MemTotal: lots kB", "Node 0 MemTotal: 5 MB"])
def test_parse_node_meminfo_rejects_garbage(text):
    with pytest.raises(ParseError):
        parse_node_meminfo(text)


def test_parse_numastat_fixture():
    assert parse_numastat(NODE1_NUMASTAT) == {
        "numa_hit": 823456789, "numa_miss": 45678901, "numa_foreign": 1234567,
        "interleave_hit": 33190, "local_node": 800000000, "other_node": 69135690,
    }


@pytest.mark.parametrize("text", ["", "numa_hit", "numa_hit -1", "numa_hit 1 2"])
def test_parse_numastat_rejects_garbage(text):
    with pytest.raises(ParseError):
        parse_numastat(text)


def test_parse_numa_maps_sums_pages_per_node_with_each_mappings_page_size():
    assert parse_numa_maps(VLLM_NUMA_MAPS) == {0: VLLM_NODE0_BYTES, 1: VLLM_NODE1_BYTES}
    assert parse_numa_maps(LLAMA_NUMA_MAPS) == {1: LLAMA_NODE1_BYTES}


def test_parse_numa_maps_hugetlb_pages_count_their_own_size():
    line = r"7f1c00000000 default file=/anon_hugepage\040(deleted) huge anon=1024 dirty=1024 N1=1024 kernelpagesize_kB=2048"
    assert parse_numa_maps(line + "\n" + LLAMA_NUMA_MAPS) == {1: 2 * 1024**3 + LLAMA_NODE1_BYTES}


def test_parse_numa_maps_line_without_page_size_counts_4_kib():
    assert parse_numa_maps("7f0000000000 default anon=3 dirty=3 N0=2 N1=1\n") == {0: 8192, 1: 4096}


def test_parse_numa_maps_escaped_file_names_are_not_page_counts():
    # The kernel escapes space as \040 and '=' as \075 in file names.
    line = r"7f0000000000 default file=/models/a\040N1\0759 mapped=2 N0=2 kernelpagesize_kB=4"
    assert parse_numa_maps(line) == {0: 8192}


def test_parse_numa_maps_of_mappings_without_pages():
    assert parse_numa_maps("7f2500000000 default\n7f2500002000 bind:1\n\n") == {}
    assert parse_numa_maps("") == {}


@pytest.mark.parametrize("text", ["garbage here", "7f25", "N0=5 default"])
def test_parse_numa_maps_rejects_garbage(text):
    with pytest.raises(ParseError):
        parse_numa_maps(text)


# That any text raises only ParseError: tests/exporters/test_parsers_robustness.py. Here, that these do.
@pytest.mark.parametrize("parse, text", [
    (parse_cpu_list, "0-" + "9" * 5000),
    (parse_cpu_list, "9" * 5000),
    (parse_node_meminfo, "Node 0 MemTotal: " + "9" * 5000 + " kB\n"),
    (parse_numastat, "numa_hit " + "9" * 5000 + "\n"),
])
def test_huge_numbers_are_parse_errors(parse, text):
    with pytest.raises(ParseError):
        parse(text)


# --- NumaCollector ---------------------------------------------------------------------------

def test_numa_collector_on_fixture_host(live_source, fixture_sysfs):
    samples = NumaCollector(live_source, sysfs=fixture_sysfs).collect()
    expected = []
    for node, total_kib, free_kib, stat in (
        ("0", 263994206, 1048576, (912345678, 1234567, 45678901, 33211, 912300000, 1280245)),
        ("1", 263994206, 209712, (823456789, 45678901, 1234567, 33190, 800000000, 69135690)),
    ):
        expected += [
            ("hybridmon_numa_node_memory_total_bytes", (node,), total_kib * KIB),
            ("hybridmon_numa_node_memory_free_bytes", (node,), free_kib * KIB),
            ("hybridmon_numa_node_cpus", (node,), 8),
        ]
        outcomes = ("hit", "miss", "foreign", "interleave_hit", "local_node", "other_node")
        expected += [("hybridmon_numa_node_allocations_total", (node, o), v) for o, v in zip(outcomes, stat)]
    assert as_tuples(samples) == expected
    assert {s.spec for s in samples} <= set(NumaCollector.metric_specs)


def test_numa_collector_on_this_host():
    collector = NumaCollector(LiveSource())
    if not os.path.isdir("/sys/devices/system/node"):
        with pytest.raises(NoDataError, match="NUMA"):
            collector.collect()
        return
    samples = collector.collect()
    online = sorted(parse_cpu_list(Path("/sys/devices/system/node/online").read_text()))
    assert samples.value("hybridmon_numa_node_memory_total_bytes", node=str(online[0])) > 0
    free = samples.value("hybridmon_numa_node_memory_free_bytes", node=str(online[0]))
    assert 0 < free <= samples.value("hybridmon_numa_node_memory_total_bytes", node=str(online[0]))
    cpus = sum(s.value for s in samples.find("hybridmon_numa_node_cpus"))
    # Every online CPU belongs to exactly one node.
    assert cpus == len(parse_cpu_list(Path("/sys/devices/system/cpu/online").read_text()))
    assert samples.value("hybridmon_numa_node_allocations_total", node=str(online[0]), outcome="hit") > 0


def test_numa_collector_without_node_directory_has_no_data(host_copy):
    shutil.rmtree(host_copy / "sys/devices/system/node")
    with pytest.raises(NoDataError, match="devices/system/node/online does not exist.*no NUMA support"):
        NumaCollector(LiveSource(), sysfs=str(host_copy / "sys")).collect()


def test_numa_collector_with_garbled_online_list_fails_saying_why(host_copy):
    (host_copy / "sys/devices/system/node/online").write_text("zero\n")
    collector = NumaCollector(LiveSource(), sysfs=str(host_copy / "sys"))
    with pytest.raises(CollectorError, match="online is not a node list"):
        collector.collect()
    (host_copy / "sys/devices/system/node/online").write_text("0-1\n")  # retried, not cached
    assert collector.collect().value("hybridmon_numa_node_cpus", node="1") == 8


def test_numa_collector_leaves_out_only_the_broken_parts(host_copy, caplog):
    nodes = host_copy / "sys/devices/system/node"
    (nodes / "node1/numastat").unlink()
    (nodes / "node0/meminfo").write_text("this is not meminfo\n")
    (nodes / "node1/cpulist").unlink()
    collector = NumaCollector(LiveSource(), sysfs=str(host_copy / "sys"))
    with caplog.at_level(logging.WARNING, logger="hybridmon.exporters.numa"):
        samples = collector.collect()
        collector.collect()
    assert samples.find("hybridmon_numa_node_allocations_total", node="1") == []
    assert len(samples.find("hybridmon_numa_node_allocations_total", node="0")) == 6
    assert samples.value("hybridmon_numa_node_memory_total_bytes", node="0") is None
    assert samples.value("hybridmon_numa_node_memory_total_bytes", node="1") == 263994206 * KIB
    assert samples.value("hybridmon_numa_node_cpus", node="1") is None
    assert samples.value("hybridmon_numa_node_cpus", node="0") == 8
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3  # once each, not again on the second collect
    assert any("node1/numastat" in m for m in messages)
    assert any("node0/meminfo" in m for m in messages)


def test_numa_collector_discovers_nodes_once(live_source, fixture_sysfs):
    source = RecordingSource(live_source)
    collector = NumaCollector(source, sysfs=fixture_sysfs)
    collector.collect()
    assert any(r[1].endswith("node/online") for r in source.take_readings())
    collector.collect()
    assert not any(r[1].endswith("node/online") for r in source.take_readings())


def test_numa_collector_record_then_replay_gives_identical_samples(fixture_sysfs):
    recording = RecordingSource(LiveSource())
    recorder = NumaCollector(recording, sysfs=fixture_sysfs)
    replay = ReplaySource()
    replayer = NumaCollector(replay, sysfs=fixture_sysfs)
    for _ in range(2):
        recorded = as_tuples(recorder.collect())
        replay.load(recording.take_readings())
        assert as_tuples(replayer.collect()) == recorded
        assert recorded


# --- ProcessNumaCollector --------------------------------------------------------------------

def test_process_numa_on_fixture_host(live_source, fixture_procfs, fixture_sysfs):
    collector = ProcessNumaCollector(live_source, procfs=fixture_procfs, sysfs=fixture_sysfs,
                                     watched=lambda: FIXTURE_WATCHED, gpu_buses=lambda: FIXTURE_GPU_BUSES,
                                     timer=fake_timer(), detail_series=True)
    samples = collector.collect()
    # the first reading of each thread's CPU time is the counters' baseline: 0 on the thread's node
    # and off its GPU's node
    assert [(s.label_values, s.value) for s in samples.find(CPU_OFF)] == [
        (("4242", "python3", "0"), 0.0), (("5151", "llama-server", "1"), 0.0)]
    on_node = [t for t in as_tuples(samples) if t[0] in ("hybridmon_process_cpu_seconds_on_node_total", CPU_OFF)]
    assert [(labels, value) for _, labels, value in on_node] == [
        (("4242", "python3", "0"), 0.0), (("4242", "python3", "0"), 0.0), (("4242", "python3", "1"), 0.0),
        (("5151", "llama-server", "1"), 0.0),
        (("5151", "llama-server", "0"), 0.0), (("5151", "llama-server", "1"), 0.0)]
    assert [t for t in as_tuples(samples) if t not in on_node] == [
        (RESIDENT_OFF, ("4242", "python3", "0"), VLLM_NODE1_BYTES),   # its GPU is on node 0
        ("hybridmon_process_allowed_cpus_on_node", ("4242", "python3", "0"), 8),
        ("hybridmon_process_allowed_cpus_on_node", ("4242", "python3", "1"), 0),
        ("hybridmon_process_numa_resident_bytes", ("4242", "python3", "0"), VLLM_NODE0_BYTES),
        ("hybridmon_process_numa_resident_bytes", ("4242", "python3", "1"), VLLM_NODE1_BYTES),
        ("hybridmon_process_numa_maps_read_seconds", ("4242", "python3"), 0.25),
        (RESIDENT_OFF, ("5151", "llama-server", "1"), 0),               # its GPU and memory on node 1
        ("hybridmon_process_allowed_cpus_on_node", ("5151", "llama-server", "0"), 0),
        ("hybridmon_process_allowed_cpus_on_node", ("5151", "llama-server", "1"), 8),
        ("hybridmon_process_numa_resident_bytes", ("5151", "llama-server", "0"), 0),
        ("hybridmon_process_numa_resident_bytes", ("5151", "llama-server", "1"), LLAMA_NODE1_BYTES),
        ("hybridmon_process_numa_maps_read_seconds", ("5151", "llama-server"), 0.25),
    ]
    assert {s.spec for s in samples} <= set(ProcessNumaCollector.metric_specs)


def test_process_numa_by_default_leaves_out_what_nothing_reads(live_source, fixture_procfs, fixture_sysfs):
    # [process] detail_series off: per process and GPU node, its CPU time and resident memory off
    # that node, what InferenceProcessNumaMisplaced, the dashboards and the status page read
    collector = ProcessNumaCollector(live_source, procfs=fixture_procfs, sysfs=fixture_sysfs,
                                     watched=lambda: FIXTURE_WATCHED, gpu_buses=lambda: FIXTURE_GPU_BUSES)
    samples = collector.collect()
    assert sorted({s.spec.name for s in samples}) == [CPU_OFF, RESIDENT_OFF]
    for pid, gpu_node in (("4242", "0"), ("5151", "1")):
        assert [s.label_values for s in samples.find(CPU_OFF, pid=pid)] == [(pid, FIXTURE_WATCHED[int(pid)], gpu_node)]
        assert len(samples.find(RESIDENT_OFF, pid=pid)) == 1


def test_process_numa_follows_the_process_collectors_watch_list(live_source, fixture_procfs, fixture_sysfs):
    processes = ProcessCollector(live_source, procfs=fixture_procfs, cmdline_patterns=[r"vllm\.entrypoints"],
                                 clock_ticks_per_second=100)
    placement = ProcessNumaCollector(live_source, procfs=fixture_procfs, sysfs=fixture_sysfs,
                                     watched=processes.watched, gpu_buses=lambda: FIXTURE_GPU_BUSES,
                                     timer=fake_timer())
    assert len(placement.collect()) == 0  # nothing watched before the first process collection
    processes.collect()
    samples = placement.collect()
    assert {s.label_values[0] for s in samples} == {"4242"}
    assert samples.value(RESIDENT_OFF, pid="4242", gpu_node="0") == VLLM_NODE1_BYTES


class Listing:
    """A collector as the agent hands it to the collectors after it: the process collector's
    watch list (watched) or the pids NVML lists on the GPUs (gpu_processes) and the PCI bus ids of
    their GPUs (gpu_buses_of_processes)."""

    def __init__(self, pids: dict[int, str]) -> None:
        self.pids = pids

    def watched(self) -> dict[int, str]:
        return dict(self.pids)

    gpu_processes = watched

    def gpu_buses_of_processes(self) -> dict[int, tuple[str, ...]]:
        return {pid: FIXTURE_GPU_BUSES.get(pid, ("0000:17:00.0",)) for pid in self.pids}


def test_the_agent_places_only_the_watched_processes_on_gpus(live_source, fixture_procfs, fixture_sysfs):
    """InferenceProcessNumaMisplaced judges a process against the node of a GPU it holds memory on:
    a watched process on no GPU (vLLM's API server) costs no placement series (issue 33's budget)."""
    processes = Listing({4242: "python3", 5151: "llama-server"})
    gpu = Listing({5151: "llama-server", 7777: "not watched"})
    paths = {"procfs": fixture_procfs, "sysfs": fixture_sysfs}
    placement = numa.PROCESS_NUMA_REGISTRATION.factory(CollectorContext(
        live_source, None, **paths, earlier={"process": processes, "gpu": gpu}))
    without_gpus = numa.PROCESS_NUMA_REGISTRATION.factory(CollectorContext(
        live_source, None, **paths, earlier={"process": processes}))
    samples = placement.collect()
    assert {s.label_values for s in samples} == {("5151", "llama-server", "1")}
    assert len(samples) == 2  # its CPU time and resident memory off its GPU's node
    gpu.pids = {4242: "python3"}  # vLLM took GPU memory; llama-server's GPU fell off the bus
    samples = placement.collect()
    # placed while it is watched, against the node its GPU had
    assert {s.label_values for s in samples} == {("4242", "python3", "0"), ("5151", "llama-server", "1")}
    assert samples.value(RESIDENT_OFF, pid="4242", gpu_node="0") == VLLM_NODE1_BYTES
    processes.pids = {4242: "python3"}  # llama-server exited
    assert {s.label_values[0] for s in placement.collect()} == {"4242"}
    assert len(without_gpus.collect()) == 0  # gpu collector disabled: no process can be judged


def test_process_numa_skips_a_process_that_is_gone(live_source, fixture_procfs, fixture_sysfs):
    collector = ProcessNumaCollector(live_source, procfs=fixture_procfs, sysfs=fixture_sysfs,
                                     watched=lambda: {99999: "ghost", 5151: "llama-server"},
                                     gpu_buses=lambda: {99999: ("0000:17:00.0",), **FIXTURE_GPU_BUSES})
    samples = collector.collect()
    assert {s.label_values[0] for s in samples} == {"5151"}


class DenyingSource(LiveSource):
    """Answers like /proc does for another user's process without CAP_SYS_PTRACE."""

    def __init__(self, denied_suffix: str) -> None:
        self.denied_suffix = denied_suffix

    def read_text(self, path: str) -> str:
        if path.endswith(self.denied_suffix):
            raise PermissionError(13, "Permission denied", path)
        return super().read_text(path)


def test_process_numa_without_permission_for_numa_maps(fixture_procfs, fixture_sysfs, caplog):
    collector = ProcessNumaCollector(DenyingSource("4242/numa_maps"), procfs=fixture_procfs,
                                     sysfs=fixture_sysfs, watched=lambda: FIXTURE_WATCHED,
                                     gpu_buses=lambda: FIXTURE_GPU_BUSES, detail_series=True)
    with caplog.at_level(logging.WARNING, logger="hybridmon.exporters.process"):
        collector.collect()
        samples = collector.collect()
    assert samples.find("hybridmon_process_numa_resident_bytes", pid="4242") == []
    assert samples.find(RESIDENT_OFF, pid="4242") == []
    assert samples.find("hybridmon_process_numa_maps_read_seconds", pid="4242") == []
    assert samples.value(CPU_OFF, pid="4242", gpu_node="0") == 0
    assert samples.value("hybridmon_process_numa_resident_bytes", pid="5151", node="1") == LLAMA_NODE1_BYTES
    denied = [r.getMessage() for r in caplog.records if "CAP_SYS_PTRACE" in r.getMessage()]
    assert len(denied) == 1 and "4242/numa_maps" in denied[0]


def test_process_numa_with_garbled_numa_maps_keeps_the_cpu_series(host_copy, caplog):
    (host_copy / "proc/4242/numa_maps").write_text("not numa maps at all\n")
    collector = ProcessNumaCollector(LiveSource(), procfs=str(host_copy / "proc"),
                                     sysfs=str(host_copy / "sys"), watched=lambda: FIXTURE_WATCHED,
                                     gpu_buses=lambda: FIXTURE_GPU_BUSES)
    with caplog.at_level(logging.WARNING):
        collector.collect()
        samples = collector.collect()
    assert samples.find(RESIDENT_OFF, pid="4242") == []
    assert samples.value(CPU_OFF, pid="4242", gpu_node="0") == 0
    assert any("4242/numa_maps" in r.getMessage() for r in caplog.records)


def test_process_numa_without_node_directory_has_no_data(host_copy):
    shutil.rmtree(host_copy / "sys/devices/system/node")
    collector = ProcessNumaCollector(LiveSource(), procfs=str(host_copy / "proc"),
                                     sysfs=str(host_copy / "sys"), watched=lambda: FIXTURE_WATCHED)
    with pytest.raises(NoDataError):
        collector.collect()


def test_process_numa_on_this_host(fixture_sysfs):
    # This host's /proc with the fixture's two NUMA nodes (CPUs 0-7 and 8-15): the per-process
    # series exist only where there are two nodes or more, and a CI machine may have one.
    me = os.getpid()
    collector = ProcessNumaCollector(LiveSource(), sysfs=fixture_sysfs, watched=lambda: {me: "pytest"},
                                     detail_series=True)
    if not os.path.exists("/proc/self/numa_maps"):
        with pytest.raises(NoDataError):
            ProcessNumaCollector(LiveSource(), watched=lambda: {me: "pytest"}).collect()
        return
    samples = collector.collect()
    resident = sum(s.value for s in samples.find("hybridmon_process_numa_resident_bytes", pid=str(me)))
    assert resident > 1 << 20  # a Python interpreter running pytest maps well over 1 MiB
    allowed = sum(s.value for s in samples.find("hybridmon_process_allowed_cpus_on_node", pid=str(me)))
    assert allowed == len(os.sched_getaffinity(0) & set(range(16)))
    assert 0 < samples.value("hybridmon_process_numa_maps_read_seconds", pid=str(me)) < 5


def test_process_numa_on_one_node_reads_nothing(host_copy):
    # one node holds every CPU and page: there is no placement to tell, so no process file is read
    nodes = host_copy / "sys/devices/system/node"
    (nodes / "online").write_text("0\n")
    shutil.rmtree(nodes / "node1")
    source = RecordingSource(LiveSource())
    collector = ProcessNumaCollector(source, procfs=str(host_copy / "proc"), sysfs=str(host_copy / "sys"),
                                     watched=lambda: FIXTURE_WATCHED)
    assert len(collector.collect()) == 0
    assert not [r for r in source.take_readings() if "/proc/" in str(r[1])]


def test_process_numa_record_then_replay_gives_identical_samples(fixture_procfs, fixture_sysfs):
    # The real timer: the replay must report the recorded cost, not time its own reads.
    recording = RecordingSource(LiveSource())
    recorder = ProcessNumaCollector(recording, procfs=fixture_procfs, sysfs=fixture_sysfs,
                                    watched=lambda: FIXTURE_WATCHED, gpu_buses=lambda: FIXTURE_GPU_BUSES,
                                    detail_series=True)
    replay = ReplaySource()
    replayer = ProcessNumaCollector(replay, procfs=fixture_procfs, sysfs=fixture_sysfs,
                                    watched=lambda: FIXTURE_WATCHED, gpu_buses=lambda: FIXTURE_GPU_BUSES,
                                    detail_series=True)
    for _ in range(2):
        recorded = as_tuples(recorder.collect())
        replay.load(recording.take_readings())
        assert as_tuples(replayer.collect()) == recorded
        # 10 detail series, CPU time on each of 2 nodes for each of 2 processes, and each
        # process's CPU time and resident memory off its GPU's node
        assert len(recorded) == 18


@pytest.mark.slow
def test_numa_and_process_modules_do_not_import_each_other(fixture_procfs, fixture_sysfs):
    loaded = "print(sorted(m for m in sys.modules if m in ('hybridmon.exporters.numa', 'hybridmon.exporters.process')))"
    scripts = {
        "process": f"import sys, hybridmon.exporters.process; {loaded}",
        "numa": ("import sys; from hybridmon.exporters.sources import LiveSource; "
                 "from hybridmon.exporters.numa import ProcessNumaCollector; "
                 f"ProcessNumaCollector(LiveSource(), {fixture_procfs!r}, {fixture_sysfs!r}, "
                 f"watched=lambda: {{4242: 'python3'}}).collect(); {loaded}"),
    }
    for module, script in scripts.items():
        result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == [f"['hybridmon.exporters.{module}']"]


# --- where the threads run: /proc/<pid>/task/<tid>/stat ------------------------------------------

# A thread's stat line as a 6.x kernel prints it (proc(5); copied from /proc/self/task/<tid>/stat
# with the numbers changed): utime 14 = 300, stime 15 = 20, processor 39 = 9. The comm holds a
# space and a ")" as thread names may ("pt_main_thread" and friends are set with prctl).
TASK_STAT = ("4243 (VLLM::Engine) x) S 4200 4200 4200 0 -1 4194560 1523 0 89 0 300 20 0 0 20 0 "
             "64 0 1234500 60129542144 7340032 18446744073709551615 94869763698688 94869763718569 "
             "140722159901680 0 0 0 0 4096 17642 1 0 0 17 9 0 0 0 0 0 94869763734576 94869763736192 "
             "94870318735360 140722159909603 140722159909623 140722159909623 140722159910891 0\n")


def test_parse_task_stat_reads_cpu_ticks_and_the_cpu_it_last_ran_on():
    from hybridmon.exporters.numa import parse_task_stat
    assert parse_task_stat(TASK_STAT) == (320, 9)


@pytest.mark.parametrize("text", ["", "4243 (python3) S 1 2 3\n", TASK_STAT.replace(" 17 9 ", " 17 x ")])
def test_parse_task_stat_rejects_garbage(text):
    from hybridmon.exporters.numa import parse_task_stat
    with pytest.raises(ParseError):
        parse_task_stat(text)


def write_threads(host: Path, pid: int, threads: dict[int, tuple[int, int]]) -> None:
    """/proc/<pid>/task/<tid>/stat for each tid -> (CPU ticks, CPU it last ran on)."""
    task = host / "proc" / str(pid) / "task"
    shutil.rmtree(task, ignore_errors=True)
    for tid, (ticks, cpu) in threads.items():
        (task / str(tid)).mkdir(parents=True)
        line = TASK_STAT.replace("4243 (VLLM::Engine) x)", f"{tid} (python3)")
        line = line.replace(" 300 20 ", f" {ticks} 0 ").replace(" 17 9 ", f" 17 {cpu} ")
        (task / str(tid) / "stat").write_text(line)


def test_process_numa_counts_cpu_seconds_on_the_node_each_thread_runs_on(host_copy):
    # vLLM (pid 4242) may run on node 0's CPUs only in the fixture; its threads are put where the
    # scheduler would put an unpinned process: one on CPU 2 (node 0), two on CPUs 9 and 12 (node 1).
    write_threads(host_copy, 4242, {4242: (1000, 2), 4250: (500, 9), 4251: (700, 12)})
    collector = ProcessNumaCollector(LiveSource(), procfs=str(host_copy / "proc"),
                                     sysfs=str(host_copy / "sys"), watched=lambda: {4242: "python3"},
                                     clock_ticks_per_second=100, detail_series=True)
    first = collector.collect()   # the baseline: what ran before the agent looked is not counted
    assert [(s.label_values, s.value) for s in first.find("hybridmon_process_cpu_seconds_on_node_total")] == [
        (("4242", "python3", "0"), 0.0), (("4242", "python3", "1"), 0.0)]
    # 30 s later: the main thread ran 3 s on node 0, a worker 6 s on node 1, one thread moved to
    # CPU 3 (node 0) after 1 s more, and a new thread (born since) ran 2 s on CPU 10.
    write_threads(host_copy, 4242, {4242: (1300, 2), 4250: (1100, 9), 4251: (800, 3), 4260: (200, 10)})
    second = collector.collect()
    assert second.value("hybridmon_process_cpu_seconds_on_node_total", pid="4242", node="0") == pytest.approx(4.0)
    assert second.value("hybridmon_process_cpu_seconds_on_node_total", pid="4242", node="1") == pytest.approx(8.0)
    # a thread that exited, and one idle since: the counters only keep what was counted
    write_threads(host_copy, 4242, {4242: (1300, 2), 4260: (200, 10)})
    third = collector.collect()
    assert third.value("hybridmon_process_cpu_seconds_on_node_total", pid="4242", node="0") == pytest.approx(4.0)
    assert third.value("hybridmon_process_cpu_seconds_on_node_total", pid="4242", node="1") == pytest.approx(8.0)


def write_process_ticks(host: Path, pid: int, ticks: int) -> None:
    """utime + stime (fields 14-15) of /proc/<pid>/stat: the whole process's CPU ticks."""
    path = host / "proc" / str(pid) / "stat"
    fields = path.read_text().split(" ")
    fields[13:15] = [str(ticks), "0"]
    path.write_text(" ".join(fields))


def test_process_numa_splits_the_process_cpu_time_off_each_gpu_node_as_its_threads_ran(host_copy):
    # vLLM on GPU 0 (node 0) and, say, GPU 1 (node 1). Its threads run a third of their counted time
    # on node 0 and two thirds on node 1; the process as a whole (/proc/<pid>/stat, with threads
    # not read this run and exited ones) gained 12 s: 8 of them off node 0, 4 off node 1.
    buses = {4242: ("0000:17:00.0", "0000:ca:00.0")}
    collector = ProcessNumaCollector(LiveSource(), procfs=str(host_copy / "proc"), sysfs=str(host_copy / "sys"),
                                     watched=lambda: {4242: "python3"}, gpu_buses=lambda: buses,
                                     clock_ticks_per_second=100)
    write_threads(host_copy, 4242, {4242: (1000, 2), 4250: (500, 9)})
    write_process_ticks(host_copy, 4242, 5000)
    assert [s.value for s in collector.collect().find(CPU_OFF)] == [0, 0]   # the baseline
    write_threads(host_copy, 4242, {4242: (1300, 2), 4250: (1100, 9)})
    write_process_ticks(host_copy, 4242, 6200)
    second = collector.collect()
    assert second.value(CPU_OFF, pid="4242", gpu_node="0") == pytest.approx(8.0)
    assert second.value(CPU_OFF, pid="4242", gpu_node="1") == pytest.approx(4.0)
    # no thread read ran since, yet the process did (a thread that exited, one not read this run):
    # split as last known, the counter follows the process's own CPU time without a lump later
    write_process_ticks(host_copy, 4242, 6500)
    third = collector.collect()
    assert third.value(CPU_OFF, pid="4242", gpu_node="0") == pytest.approx(10.0)
    assert third.value(CPU_OFF, pid="4242", gpu_node="1") == pytest.approx(5.0)
    assert third.find("hybridmon_process_cpu_seconds_on_node_total") == []   # [process] detail_series only


def test_process_numa_judges_no_gpu_without_a_numa_node(host_copy):
    # a GPU whose PCI device has no node (-1: no affinity known) gives nothing to judge against
    (host_copy / "sys/bus/pci/devices/0000:17:00.0/numa_node").write_text("-1\n")
    collector = ProcessNumaCollector(LiveSource(), procfs=str(host_copy / "proc"), sysfs=str(host_copy / "sys"),
                                     watched=lambda: FIXTURE_WATCHED, gpu_buses=lambda: FIXTURE_GPU_BUSES)
    collector.collect()
    assert {s.label_values[0] for s in collector.collect()} == {"5151"}


def test_process_numa_without_a_task_directory_keeps_the_other_series(host_copy, caplog):
    # processes without a task/ directory (the fixture's have one: taken away here): said once,
    # the rest is reported
    for pid in ("4242", "5151"):
        shutil.rmtree(host_copy / "proc" / pid / "task")
    collector = ProcessNumaCollector(LiveSource(), procfs=str(host_copy / "proc"),
                                     sysfs=str(host_copy / "sys"), watched=lambda: FIXTURE_WATCHED,
                                     gpu_buses=lambda: FIXTURE_GPU_BUSES, detail_series=True)
    with caplog.at_level(logging.WARNING):
        collector.collect()
        samples = collector.collect()
    assert samples.find("hybridmon_process_cpu_seconds_on_node_total") == []
    assert samples.find(CPU_OFF) == []   # where its CPU time ran is unknown: absent, not 0
    assert samples.value(RESIDENT_OFF, pid="4242", gpu_node="0") == VLLM_NODE1_BYTES
    assert samples.value("hybridmon_process_numa_resident_bytes", pid="4242", node="1") == VLLM_NODE1_BYTES
    assert any("4242/task" in r.getMessage() for r in caplog.records)


def test_process_numa_counts_this_processs_own_cpu_time(fixture_sysfs):
    # this host's /proc, the fixture's two nodes: the CPUs this one has are among theirs (0-15)
    me = os.getpid()
    collector = ProcessNumaCollector(LiveSource(), sysfs=fixture_sysfs, watched=lambda: {me: "pytest"},
                                     detail_series=True)
    collector.collect()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:   # burn 0.3 s of CPU on whatever node we are on
        pass
    counted = collector.collect().find("hybridmon_process_cpu_seconds_on_node_total", pid=str(me))
    assert 0.2 <= sum(s.value for s in counted) <= 5


def test_process_numa_record_then_replay_counts_cpu_time_alike(host_copy):
    write_threads(host_copy, 4242, {4242: (1000, 2), 4250: (500, 9)})
    paths = dict(procfs=str(host_copy / "proc"), sysfs=str(host_copy / "sys"), watched=lambda: {4242: "python3"},
                 gpu_buses=lambda: FIXTURE_GPU_BUSES, detail_series=True)
    recording, replay = RecordingSource(LiveSource()), ReplaySource()
    recorder, replayer = ProcessNumaCollector(recording, **paths), ProcessNumaCollector(replay, **paths)
    for ticks in (1000, 1600, 1900):
        write_threads(host_copy, 4242, {4242: (ticks, 2), 4250: (500, 9)})
        write_process_ticks(host_copy, 4242, ticks + 500)
        recorded = as_tuples(recorder.collect())
        replay.load(recording.take_readings())
        assert as_tuples(replayer.collect()) == recorded
    assert sum(value for name, _, value in recorded if name.endswith("cpu_seconds_on_node_total")) > 0
    assert [value for name, _, value in recorded if name == CPU_OFF] == [0]   # all of it on its GPU's node


# This module's parsers, each with realistic samples, for tests/exporters/test_parsers_robustness.py
# (which holds every parse_* of exporters/ to its one promised error).
_NODES = FIXTURE_HOST / "sys/devices/system/node"
PARSER_ROWS = [
    ParserRow(parse_node_meminfo, read(_NODES / "node0/meminfo")),
    ParserRow(parse_numastat, read(_NODES / "node1/numastat")),
    ParserRow(parse_numa_maps, read(FIXTURE_HOST / "proc/4242/numa_maps", FIXTURE_HOST / "proc/5151/numa_maps")),
    ParserRow(parse_cpu_list, ("0-3,8,10-11\n",) + read(_NODES / "node1/cpulist", _NODES / "online")),
    # a thread's stat has the process stat's layout (proc(5)): the fixture's stat is a real sample
    ParserRow(parse_task_stat, read(FIXTURE_HOST / "proc/4242/stat", FIXTURE_HOST / "proc/5151/stat")),
]


# --- what one run may read (issue 33) ------------------------------------------------------------

class SteppedClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def copies_of_vllm(host: Path, count: int) -> dict[int, str]:
    """`count` watched processes: vLLM's /proc/4242 copied to pids 6000, 6001, ..."""
    for pid in range(6000, 6000 + count):
        shutil.copytree(host / "proc/4242", host / "proc" / str(pid), symlinks=True)
    return {pid: "python3" for pid in range(6000, 6000 + count)}


def reads_of(source: RecordingSource, name: str) -> list[int]:
    """The pids whose /proc/<pid>/.../<name> the collector read since the last call (a thread's
    stat: /proc/<pid>/task/<tid>/stat)."""
    return [int(str(r[1]).split("/proc/")[1].split("/")[0]) for r in source.take_readings()
            if str(r[1]).endswith("/" + name) and "/proc/" in str(r[1])]


def thread_reads_of(source: RecordingSource) -> list[int]:
    """The pids of the thread stats (/proc/<pid>/task/<tid>/stat) read since the last call."""
    return [int(str(r[1]).split("/proc/")[1].split("/")[0]) for r in source.take_readings()
            if "/task/" in str(r[1]) and str(r[1]).endswith("/stat")]


def test_process_numa_reads_each_numa_maps_at_most_once_a_minute_and_a_few_a_run(host_copy):
    watched = copies_of_vllm(host_copy, 12)
    source, clock = RecordingSource(LiveSource()), SteppedClock()
    collector = ProcessNumaCollector(source, procfs=str(host_copy / "proc"), sysfs=str(host_copy / "sys"),
                                     watched=lambda: watched, clock=clock, detail_series=True)
    per_run, last_read = [], {}
    for run in range(6):   # the collector's 30 s apart
        samples = collector.collect()
        read = reads_of(source, "numa_maps")
        per_run.append(len(read))
        for pid in read:
            assert clock.now - last_read.get(pid, -math.inf) >= numa.NUMA_MAPS_MIN_AGE_SECONDS
            last_read[pid] = clock.now
        # every process read so far keeps its series between its reads
        assert {int(s.label_values[0]) for s in samples.find("hybridmon_process_numa_resident_bytes")} == set(last_read)
        clock.now += ProcessNumaCollector.default_interval_seconds
    # 8 a run: the first 8, the other 4, then (a minute after the first read) the first 8 again...
    assert per_run == [8, 4, 8, 4, 8, 4]
    assert set(last_read) == set(watched)


def test_process_numa_reads_a_bounded_number_of_threads_in_turn(host_copy, monkeypatch):
    monkeypatch.setattr(numa, "THREAD_READS_PER_RUN", 6)
    monkeypatch.setattr(numa, "THREAD_READS_PER_PROCESS", 4)
    watched = {4242: "python3", 5151: "llama-server"}
    write_threads(host_copy, 4242, {tid: (100, 9) for tid in range(7000, 7012)})   # 12 threads, node 1
    write_threads(host_copy, 5151, {tid: (100, 2) for tid in range(8000, 8012)})   # 12 threads, node 0
    source = RecordingSource(LiveSource())
    collector = ProcessNumaCollector(source, procfs=str(host_copy / "proc"), sysfs=str(host_copy / "sys"),
                                     watched=lambda: watched, clock_ticks_per_second=100, detail_series=True)
    read_per_run = []
    for _ in range(8):   # 6 reads a run: 4 of 4242's threads, then 2 of 5151's, each in turn
        collector.collect()
        read_per_run.append(thread_reads_of(source))
    assert all(len(read) == 6 for read in read_per_run)
    assert all(read.count(4242) <= 4 and read.count(5151) <= 4 for read in read_per_run)
    assert {pid for read in read_per_run for pid in read} == {4242, 5151}
    # each thread now gains 1 s on its node; after each is read once more, all of it is counted
    write_threads(host_copy, 4242, {tid: (200, 9) for tid in range(7000, 7012)})
    write_threads(host_copy, 5151, {tid: (200, 2) for tid in range(8000, 8012)})
    for _ in range(12):   # 5151's 12 threads, 2 a run, each read again the run after it ran
        samples = collector.collect()
    assert samples.value("hybridmon_process_cpu_seconds_on_node_total", pid="4242", node="1") == pytest.approx(12.0)
    assert samples.value("hybridmon_process_cpu_seconds_on_node_total", pid="5151", node="0") == pytest.approx(12.0)
    assert samples.value("hybridmon_process_cpu_seconds_on_node_total", pid="4242", node="0") == 0


def test_process_numa_reads_the_threads_that_ran_on_every_run(host_copy, monkeypatch):
    # 12 threads, 4 read a run: the busy one is read on every run once it is seen running, so the
    # process's CPU time is counted as it goes, not in lumps every 3 runs
    monkeypatch.setattr(numa, "THREAD_READS_PER_PROCESS", 4)
    threads = {tid: (100, 2) for tid in range(7000, 7012)}
    write_threads(host_copy, 4242, threads)
    collector = ProcessNumaCollector(LiveSource(), procfs=str(host_copy / "proc"), sysfs=str(host_copy / "sys"),
                                     watched=lambda: {4242: "python3"}, clock_ticks_per_second=100,
                                     detail_series=True)
    counted = []
    for run in range(10):
        threads[7005] = (100 + 50 * run, 9)   # half a second of CPU on node 1 between runs
        write_threads(host_copy, 4242, threads)
        counted.append(collector.collect().value("hybridmon_process_cpu_seconds_on_node_total",
                                                 pid="4242", node="1"))
    # 7005 is first read at run 1 (its baseline), then at run 4 (in turn), then on every run
    assert counted[:4] == [0, 0, 0, 0]
    assert counted[4:] == pytest.approx([1.5, 2.0, 2.5, 3.0, 3.5, 4.0])
