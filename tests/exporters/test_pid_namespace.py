"""NVML's host pids against the agent's procfs: a container's pid namespace is told apart, said once,
and its unrelated processes are not watched in place of the GPU's (issue 13, NVML item 4)."""
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
from tests.support.paths import FIXTURE_HOST
from tests.support.parser_properties import ParserRow, read

# The fixture tree's llama-server: in a container without the host's pids, 5151 is some process of
# the container's own, not the one NVML means by host pid 5151.
FOREIGN_PID = 5151


def procfs_seen_from(tmp_path, nspid: str | None, namespace_link: str | None):
    """The fixture procfs with a self/ as the agent would see it: its NSpid line and ns/pid link."""
    procfs = tmp_path / "proc"
    shutil.copytree(FIXTURE_HOST / "proc", procfs, symlinks=True)
    (procfs / "self" / "ns").mkdir(parents=True)
    status = "Name:\thybridmon\n" + (f"NSpid:\t{nspid}\n" if nspid is not None else "")
    (procfs / "self" / "status").write_text(status)
    if namespace_link is not None:
        os.symlink(namespace_link, procfs / "self" / "ns" / "pid")  # dangling, as readlink needs
    return str(procfs)


@pytest.mark.parametrize("nspid, link, view", [
    ("9497", "pid:[4026531836]", PidView.HOST),        # the host's own /proc (hostPID: true)
    ("81234 7", "pid:[4026532511]", PidView.HOST),     # the host's /proc mounted into a container
    ("7", "pid:[4026532511]", PidView.CONTAINER),      # a container's own /proc
    ("7", None, PidView.UNKNOWN),                      # ns link unreadable
    (None, "pid:[4026532511]", PidView.UNKNOWN),       # kernel before 4.1: no NSpid
])
def test_pid_view_from_nspid_depth_and_the_initial_namespace_inode(tmp_path, nspid, link, view):
    assert pid_view(LiveSource(), procfs_seen_from(tmp_path, nspid, link)) is view


def test_a_container_procfs_does_not_watch_nvmls_pids_and_says_why_once(tmp_path, caplog):
    procfs = procfs_seen_from(tmp_path, "7", "pid:[4026532511]")
    collector = ProcessCollector(LiveSource(), procfs=procfs, clock_ticks_per_second=100,
                                 gpu_processes=lambda: {FOREIGN_PID: "llama-server"})
    with caplog.at_level(logging.WARNING, logger="hybridmon.exporters.process"):
        first, second = collector.collect(), collector.collect()
    assert first.find("hybridmon_process_info") == second.find("hybridmon_process_info") == []
    advice = [r.getMessage() for r in caplog.records if "pid namespace" in r.getMessage()]
    assert len(advice) == 1 and "hostPID: true" in advice[0] and "--pid=host" in advice[0]


def test_configured_pids_stay_watched_in_a_container(tmp_path):
    procfs = procfs_seen_from(tmp_path, "7", "pid:[4026532511]")
    collector = ProcessCollector(LiveSource(), procfs=procfs, clock_ticks_per_second=100, pids=[FOREIGN_PID],
                                 gpu_processes=lambda: {FOREIGN_PID: "llama-server"})
    collector.collect()
    assert collector.watched() == {FOREIGN_PID: "llama-server"}


def test_the_hosts_procfs_watches_nvmls_pids(tmp_path):
    procfs = procfs_seen_from(tmp_path, "81234 7", "pid:[4026532511]")
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
def test_this_machines_proc_and_a_real_new_pid_namespace():
    """The real kernel: this test's own /proc, and `unshare --pid --mount-proc` (a container's view).
    The second needs root or unprivileged user namespaces, which this project's CI has."""
    here = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    with open("/proc/self/status") as status:
        expected_here = "host" if parse_nspid_depth(status.read()) >= 2 or \
            os.readlink("/proc/self/ns/pid") == "pid:[4026531836]" else "container"
    assert here.stdout.strip() == expected_here
    unshare = ["unshare", "--pid", "--fork", "--mount-proc"]
    if os.geteuid() != 0:
        unshare[1:1] = ["--user", "--map-root-user"]
    inside = subprocess.run([*unshare, sys.executable, "-c", PROBE], capture_output=True, text=True)
    if inside.returncode != 0 and os.environ.get("CI") != "true":
        pytest.skip(f"cannot create a pid namespace here: {inside.stderr.strip()[:200]}")
    assert inside.returncode == 0, inside.stderr
    assert inside.stdout.strip() == "container"


# This module's parsers, each with realistic samples, for tests/exporters/test_parsers_robustness.py
# (which holds every parse_* of exporters/ to its one promised error).
PARSER_ROWS = [ParserRow(parse_nspid_depth, read(FIXTURE_HOST / "proc/4242/status") + ("NSpid:\t81234\t7\n",))]
