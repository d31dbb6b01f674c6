"""NVML's host pids against the agent's procfs: a container's pid namespace, and an outer container's
seen from a nested one (kind, docker-in-docker), are told apart from the host's, said once, and
their unrelated processes are not watched in place of the GPU's (issue 13, NVML item 4)."""
import logging
import os
import shutil
import subprocess
import sys

import pytest

from hybridmon.exporters.base import ParseError
from hybridmon.exporters.pid_namespace import PidView, parse_nspid_depth, pid_view
from hybridmon.exporters.process import ProcessCollector
from hybridmon.exporters.sources import LiveSource, ReplaySource
from tests.support.paths import FIXTURE_HOST, FIXTURES
from tests.support.parser_properties import ParserRow, read

# The fixture tree's llama-server: in a container without the host's pids, 5151 is some process of
# the container's own, not the one NVML means by host pid 5151.
FOREIGN_PID = 5151


def procfs_seen_from(tmp_path, nspid: str | None, namespace_link: str | None, init_link: str | None = None):
    """The fixture procfs with a self/ as the agent would see it: its NSpid line and ns/pid link,
    and its pid 1's ns/pid link (`init_link`; the tree's pid 1 has none unless given)."""
    procfs = tmp_path / "proc"
    shutil.copytree(FIXTURE_HOST / "proc", procfs, symlinks=True)
    (procfs / "self" / "ns").mkdir(parents=True)
    status = "Name:\thybridmon\n" + (f"NSpid:\t{nspid}\n" if nspid is not None else "")
    (procfs / "self" / "status").write_text(status)
    for owner, link in (("self", namespace_link), ("1", init_link)):
        if link is not None:
            (procfs / owner / "ns").mkdir(exist_ok=True)
            os.symlink(link, procfs / owner / "ns" / "pid")  # dangling, as readlink needs
    return str(procfs)


# Checked-in trees (tests/fixtures/pid-namespaces/README.md): the agent's self/status and ns links
# and pid 1's ns link, as each placement shows them.
@pytest.mark.parametrize("tree, view", [
    ("host-own", PidView.HOST),                                  # hostPID: true
    ("host-mounted-in-container", PidView.HOST),                 # the host's /proc at /host/proc
    ("host-mounted-in-docker-in-docker", PidView.HOST),          # the same, two containers deep
    ("container-own", PidView.CONTAINER),                        # a container's own /proc
    ("kind-node-mounted-in-pod", PidView.NESTED),                # "the host's" /proc is a kind node's
])
def test_pid_view_of_each_placement(tree, view):
    assert pid_view(LiveSource(), str(FIXTURES / "pid-namespaces" / tree / "proc")) is view


@pytest.mark.parametrize("nspid, link, init_link, view", [
    ("7", None, None, PidView.UNKNOWN),                          # the agent's ns link unreadable
    ("81234 7", "pid:[4026532511]", None, PidView.UNKNOWN),      # pid 1's refused (ptrace check)
    (None, "pid:[4026532511]", "pid:[4026531836]", PidView.UNKNOWN),  # kernel before 4.1: no NSpid
])
def test_pid_view_unknown_where_a_reading_is_missing(tmp_path, nspid, link, init_link, view):
    assert pid_view(LiveSource(), procfs_seen_from(tmp_path, nspid, link, init_link)) is view


def test_a_container_procfs_does_not_watch_nvmls_pids_and_says_why_once(tmp_path, caplog):
    procfs = procfs_seen_from(tmp_path, "7", "pid:[4026532511]")
    collector = ProcessCollector(LiveSource(), procfs=procfs, clock_ticks_per_second=100,
                                 gpu_processes=lambda: {FOREIGN_PID: "llama-server"})
    with caplog.at_level(logging.WARNING, logger="hybridmon.exporters.process"):
        first, second = collector.collect(), collector.collect()
    assert first.find("hybridmon_process_info") == second.find("hybridmon_process_info") == []
    advice = [r.getMessage() for r in caplog.records if "pid namespace" in r.getMessage()]
    assert len(advice) == 1 and "hostPID: true" in advice[0] and "--pid=host" in advice[0]


def test_a_nested_containers_procfs_does_not_watch_nvmls_pids_and_says_why_once(tmp_path, caplog):
    """A kind node's /proc mounted into the agent's pod: an ancestor of the agent's namespace, so
    NSpid lists two pids, yet not the host's, whose pids NVML reports (before issue 29 this read as
    the host's and watched the node's unrelated process 5151 as the GPU's)."""
    procfs = procfs_seen_from(tmp_path, "3412 7", "pid:[4026532511]", "pid:[4026532290]")
    collector = ProcessCollector(LiveSource(), procfs=procfs, clock_ticks_per_second=100,
                                 gpu_processes=lambda: {FOREIGN_PID: "llama-server"})
    with caplog.at_level(logging.WARNING, logger="hybridmon.exporters.process"):
        first, second = collector.collect(), collector.collect()
    assert first.find("hybridmon_process_info") == second.find("hybridmon_process_info") == []
    assert collector.watched() == {}
    advice = [r.getMessage() for r in caplog.records if "pid namespace" in r.getMessage()]
    assert len(advice) == 1 and "outer container" in advice[0] and "real host's /proc" in advice[0]


def test_configured_pids_stay_watched_in_a_container(tmp_path):
    procfs = procfs_seen_from(tmp_path, "7", "pid:[4026532511]")
    collector = ProcessCollector(LiveSource(), procfs=procfs, clock_ticks_per_second=100, pids=[FOREIGN_PID],
                                 gpu_processes=lambda: {FOREIGN_PID: "llama-server"})
    collector.collect()
    assert collector.watched() == {FOREIGN_PID: "llama-server"}


def test_the_hosts_procfs_watches_nvmls_pids(tmp_path):
    procfs = procfs_seen_from(tmp_path, "81234 7", "pid:[4026532511]", "pid:[4026531836]")
    collector = ProcessCollector(LiveSource(), procfs=procfs, clock_ticks_per_second=100,
                                 gpu_processes=lambda: {FOREIGN_PID: "llama-server"})
    collector.collect()
    assert collector.watched() == {FOREIGN_PID: "llama-server"}


def test_a_trace_recorded_before_the_check_replays_as_unknown():
    assert pid_view(ReplaySource(), "/proc") is PidView.UNKNOWN


@pytest.mark.parametrize("text", ["Name:\tx\n", "NSpid:\n", "NSpid:\t12 x\n"])
def test_unreadable_nspid_is_a_parse_error(text):
    with pytest.raises(ParseError):
        parse_nspid_depth(text)


PROBE = ("from hybridmon.exporters.pid_namespace import pid_view;"
         "from hybridmon.exporters.sources import LiveSource;"
         "print(pid_view(LiveSource(), '/proc').value)")


@pytest.mark.slow
def test_this_machines_proc_and_real_new_pid_namespaces():
    """The real kernel: this test's own /proc; `unshare --pid --mount-proc` (a container's view);
    and a second `unshare --pid` inside that one without a procfs of its own, which sees the
    first's /proc from a namespace below it (a nested container's view of its outer one). The
    last two need root or unprivileged user namespaces, which this project's CI has."""
    here = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    with open("/proc/self/status") as status:
        depth = parse_nspid_depth(status.read())
    shown = os.readlink("/proc/self/ns/pid" if depth == 1 else "/proc/1/ns/pid")
    expected_here = ("host" if shown == "pid:[4026531836]" else "container" if depth == 1 else "nested")
    assert here.stdout.strip() == expected_here
    unshare = ["unshare", "--pid", "--fork", "--mount-proc"]
    if os.geteuid() != 0:
        unshare[1:1] = ["--user", "--map-root-user"]
    inside = subprocess.run([*unshare, sys.executable, "-c", PROBE], capture_output=True, text=True)
    if inside.returncode != 0 and os.environ.get("CI") != "true":
        pytest.skip(f"cannot create a pid namespace here: {inside.stderr.strip()[:200]}")
    assert inside.returncode == 0, inside.stderr
    assert inside.stdout.strip() == "container"
    nested = subprocess.run([*unshare, "unshare", "--pid", "--fork", sys.executable, "-c", PROBE],
                            capture_output=True, text=True)
    assert nested.returncode == 0, nested.stderr
    assert nested.stdout.strip() == "nested"


# This module's parsers, each with realistic samples, for tests/exporters/test_parsers_robustness.py
# (which holds every parse_* of exporters/ to its one promised error).
PARSER_ROWS = [ParserRow(parse_nspid_depth, read(FIXTURE_HOST / "proc/4242/status") + ("NSpid:\t81234\t7\n",))]
