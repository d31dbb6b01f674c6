"""The cgroup memory bound of a watched process: checked-in v2 trees for the layouts of Kubernetes
and systemd, and a real memory cgroup made on this machine (root), read through the collector."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from hybridmon.exporters.cgroup_memory import (CGROUP_MEMORY_HEADROOM, CGROUP_MEMORY_LIMIT, CgroupMount,
                                               memory_bound, parse_limit, parse_memory_mounts,
                                               parse_process_cgroups)
from hybridmon.exporters.base import ParseError
from hybridmon.exporters.process import ProcessCollector
from hybridmon.exporters.sources import LiveSource
import functools

from hybridmon.exporters.cgroup_memory import (oom_kill_files, parse_inactive_file, parse_oom_kill)
from tests.support.parser_properties import ParserRow, read
from tests.support.paths import FIXTURES

GIB = 2 ** 30
# Shapes from a kubelet's cgroup v2 tree (cgroupDriver systemd) and a Debian 12 host with the
# hybrid layout (this machine: memory controller on v1, the unified tree without it).
MOUNTINFO_V2 = "29 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
MOUNTINFO_HYBRID = (
    "31 23 0:28 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755\n"
    "32 31 0:29 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw\n"
    "36 31 0:33 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:17 - cgroup cgroup rw,memory\n"
    "37 31 0:34 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid,nodev,noexec,relatime shared:18 - cgroup cgroup rw,cpu,cpuacct\n")
POD = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234.slice"
CONTAINER = POD + "/cri-containerd-abcd.scope"


def _v2_cgroup(root, path: str, limit: str, current: int, inactive_file: int) -> None:
    directory = root / path.lstrip("/")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "memory.max").write_text(limit + "\n")
    (directory / "memory.current").write_text(f"{current}\n")
    (directory / "memory.stat").write_text(f"anon {current - inactive_file}\nfile {inactive_file}\n"
                                           f"active_file 0\ninactive_file {inactive_file}\n")


def test_the_ancestor_with_the_least_room_bounds_the_process(tmp_path):
    # The pod's limit (12 GiB, 11 GiB of working set) leaves less room than the container's own
    # (16 GiB): the pod bounds it. 3 GiB of inactive page cache does not count against it.
    _v2_cgroup(tmp_path, POD, str(12 * GIB), 14 * GIB, 3 * GIB)
    _v2_cgroup(tmp_path, CONTAINER, str(16 * GIB), 14 * GIB, 3 * GIB)
    _v2_cgroup(tmp_path, "/kubepods.slice", "max", 20 * GIB, 3 * GIB)
    mounts = [CgroupMount(2, str(tmp_path), "/")]
    bound = memory_bound(LiveSource(), mounts, parse_process_cgroups(f"0::{CONTAINER}\n"))
    assert bound is not None
    assert bound.limit_bytes == 12 * GIB and bound.headroom_bytes == 1 * GIB
    assert bound.cgroup == POD


def test_no_limit_anywhere_is_no_bound(tmp_path):
    _v2_cgroup(tmp_path, "/system.slice/vllm.service", "max", GIB, 0)
    mounts = [CgroupMount(2, str(tmp_path), "/")]
    assert memory_bound(LiveSource(), mounts, {2: "/system.slice/vllm.service"}) is None


def test_a_container_sees_only_the_tree_below_its_mount_root(tmp_path):
    # Inside a container the cgroup2 mount shows the container's own cgroup as its root: a
    # process's full path maps below it; one in another namespace (/..) cannot be read.
    _v2_cgroup(tmp_path, "/", str(8 * GIB), 2 * GIB, 0)
    mounts = [CgroupMount(2, str(tmp_path), CONTAINER)]
    bound = memory_bound(LiveSource(), mounts, {2: CONTAINER})
    assert bound is not None and bound.headroom_bytes == 6 * GIB
    assert memory_bound(LiveSource(), mounts, {2: "/../../other.scope"}) is None


def test_mountinfo_keeps_v2_and_the_v1_memory_hierarchy_only():
    assert parse_memory_mounts(MOUNTINFO_V2) == [CgroupMount(2, "/sys/fs/cgroup", "/")]
    assert parse_memory_mounts(MOUNTINFO_HYBRID) == [CgroupMount(2, "/sys/fs/cgroup/unified", "/"),
                                                     CgroupMount(1, "/sys/fs/cgroup/memory", "/")]
    cgroups = "12:cpu,cpuacct:/a\n4:memory:/process_api/f203\n0::/\n"
    assert parse_process_cgroups(cgroups) == {1: "/process_api/f203", 2: "/"}


def test_v1_no_limit_and_bad_values():
    assert parse_limit("9223372036854771712\n") is None  # PAGE_COUNTER_MAX on 4 KiB pages
    assert parse_limit("max\n") is None
    assert parse_limit("536870912\n") == 512 * 2 ** 20
    with pytest.raises(ParseError):
        parse_limit("lots")


def test_unreadable_cgroup_files_leave_the_series_out_and_the_rest(tmp_path):
    procfs = tmp_path / "proc"
    (procfs / "self").mkdir(parents=True)
    (procfs / "self" / "mountinfo").write_text(MOUNTINFO_V2.replace("/sys/fs/cgroup", str(tmp_path / "cg")))
    (procfs / "77").mkdir()
    (procfs / "77" / "stat").write_text("77 (vllm) S 1 77 77 0 -1 0 10 0 2 0 100 20 0 0 20 0 4 0 5 0 0\n")
    (procfs / "77" / "status").write_text("Name:\tvllm\nVmRSS:\t1024 kB\n")
    (procfs / "77" / "cmdline").write_text("vllm\0serve\0")
    (procfs / "77" / "cgroup").write_text("0::/system.slice/vllm.service\n")
    (tmp_path / "cg" / "system.slice" / "vllm.service").mkdir(parents=True)
    (tmp_path / "cg" / "system.slice" / "vllm.service" / "memory.max").write_text("1073741824\n")
    # memory.current is missing: a read error, logged; the process's other series stay.
    collector = ProcessCollector(LiveSource(), procfs=str(procfs), pids=[77], clock_ticks_per_second=100,
                                 detail_series=True)
    samples = collector.collect()
    names = {sample.spec.name for sample in samples}
    assert CGROUP_MEMORY_LIMIT.name not in names
    assert "hybridmon_process_resident_bytes" in names


def _memory_cgroup_root() -> tuple[int, str] | None:
    with open("/proc/self/mountinfo") as mountinfo:
        mounts = parse_memory_mounts(mountinfo.read())
    for mount in sorted(mounts, key=lambda m: m.version):
        if mount.root != "/":
            continue
        if mount.version == 1 or "memory" in open(os.path.join(mount.mount_point, "cgroup.controllers")).read():
            return mount.version, mount.mount_point
    return None


@pytest.mark.slow
def test_a_real_memory_cgroup_is_read_through_the_collector():
    """Makes a memory cgroup with a 256 MiB limit, puts a sleeping child in it, and reads it back."""
    found = _memory_cgroup_root() if os.geteuid() == 0 else None
    if found is None:
        message = "needs root and a writable memory cgroup hierarchy (cgroup v1 memory or v2)"
        if os.environ.get("CI") == "true":
            pytest.fail(message + ": the CI machine has both")
        pytest.skip(message)
    version, mount_point = found
    directory = os.path.join(mount_point, f"hybridmon-test-{os.getpid()}")
    limit = 256 * 2 ** 20
    os.mkdir(directory)
    child = subprocess.Popen(["sleep", "30"])
    try:
        with open(os.path.join(directory, "memory.max" if version == 2 else "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit))
        with open(os.path.join(directory, "cgroup.procs"), "w") as f:
            f.write(str(child.pid))
        collector = ProcessCollector(LiveSource(), pids=[child.pid], detail_series=True)
        by_name = {sample.spec.name: sample.value for sample in collector.collect()}
        assert by_name[CGROUP_MEMORY_LIMIT.name] == limit
        assert 0 < by_name[CGROUP_MEMORY_HEADROOM.name] <= limit
    finally:
        child.kill()
        child.wait()
        for _ in range(50):  # the cgroup can be removed once the kernel has reaped its last task
            try:
                os.rmdir(directory)
                break
            except OSError:
                time.sleep(0.1)


# This module's parsers, each with realistic samples, for tests/exporters/test_parsers_robustness.py
# (which holds every parse_* of exporters/ to its one promised error).
PARSER_ROWS = [
    ParserRow(parse_memory_mounts, read(FIXTURES / "cgroup/mountinfo-hybrid")),
    ParserRow(parse_process_cgroups, read(FIXTURES / "cgroup/cgroup-hybrid")),
    # limits only: "max" and v1's PAGE_COUNTER_MAX read as None (no limit), tested above
    ParserRow(parse_limit, ("268435456\n", "17179869184\n")),
    ParserRow(parse_inactive_file, read(FIXTURES / "cgroup/memory.stat-v1"),
              call=functools.partial(parse_inactive_file, version=1)),
    # v2 memory.events (Linux 6.1 prints these six keys), v1 memory.oom_control (oom_kill since 4.13)
    ParserRow(parse_oom_kill, read(FIXTURES / "cgroup/memory.events-v2") + read(FIXTURES / "cgroup/memory.oom_control-v1")),
]


def test_oom_kills_are_the_oom_kill_line_of_either_version():
    assert parse_oom_kill((FIXTURES / "cgroup/memory.events-v2").read_text()) == 2   # not oom_group_kill
    assert parse_oom_kill((FIXTURES / "cgroup/memory.oom_control-v1").read_text()) == 1  # not oom_kill_disable
    with pytest.raises(ParseError):
        parse_oom_kill("oom 3\noom_group_kill 1\n")


def test_oom_kills_are_read_from_the_processs_own_cgroup_v2_first():
    mounts = parse_memory_mounts(MOUNTINFO_HYBRID)
    cgroups = parse_process_cgroups("12:memory:/system.slice/vllm.service\n0::/system.slice/vllm.service\n")
    assert oom_kill_files(mounts, cgroups) == [
        "/sys/fs/cgroup/unified/system.slice/vllm.service/memory.events",
        "/sys/fs/cgroup/memory/system.slice/vllm.service/memory.oom_control"]
    assert oom_kill_files(mounts, {}) == []
