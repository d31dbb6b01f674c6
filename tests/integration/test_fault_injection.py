"""Real fault injection: real swap thrash on this machine, and the live agent must name it.

As root: a 1 GiB swap area, vm.swappiness=100, a cgroup-v1 memory cgroup limited to 96 MiB, and
a child in it that fills 400 MiB with random data and keeps writing to random pages. With three
quarters of its memory forced out to swap, nearly every touch is a major fault that swaps a page
in and another out. An Agent on the real /proc and /sys, watching the child's pid, must raise a
FIRING critical HostSwapThrash naming that process. Everything is undone afterwards (swapoff, the
file, the cgroup, the sysctl), and the test checks that it was.

What the child produced on the 2-core, 24 GB Debian VM this was written on (kernel 6.18, swapfile
on ext4), per second, measured from /proc over the seconds before the finding fired, over ~20 runs:
6,200-10,700 pages swapped in and as many out (25-44 MB/s each way), as many host major faults,
nearly all of them the child's own; VmSwap ~305 MiB; PSI memory "some" 0.086-0.125.
Every shipped threshold is crossed by a wide margin (1 MiB/s each way, 50 major faults/s, 10
process major faults/s, 64 MiB VmSwap; PSI 0.10 is an alternative to the major faults and is not
needed), so all of them stay as shipped; only `for_seconds` is lowered (see `thresholds_file`).
The finding fires about 7-9 s after the thrash starts: ~2-3 s until the agent has two samples
and a rate, then the 5 s `for`.

It skips only where it cannot run at all: not root, no cgroup-v1 memory controller, or swapon
refused for lack of privilege. CI runs as root on a machine like this one, so it runs there.
"""
from __future__ import annotations

import re
import time
from contextlib import ExitStack
from pathlib import Path

from hybridmon.agent.config import load_config
from hybridmon.agent.daemon import Agent
from hybridmon.agent.alerts.catalogue import DEFAULT_THRESHOLDS_FILE, load_thresholds
from tests.support import fault_helpers as fault
from tests.support.fault_helpers import MIB

SWAP_BYTES = 1024 * MIB
CGROUP_LIMIT_BYTES = 96 * MIB
THRASH_BYTES = 400 * MIB
THRASH_SECONDS = 80          # the child stops by itself after this, even if nothing kills it
CHILD_NAME = "hm-thrash"     # its comm, which the finding must name
FOR_SECONDS = 5
FIRE_TIMEOUT_SECONDS = 60


def thresholds_file(directory: Path) -> Path:
    """The shipped thresholds with [swap_thrash] for_seconds lowered from 120 s to FOR_SECONDS:
    120 s of sustained thrash is right for a production alert but would make this test take
    minutes. The rate and size thresholds are not touched: the real thrash here crosses them."""
    shipped = DEFAULT_THRESHOLDS_FILE.read_text()
    section = re.search(r"(?ms)^\[swap_thrash\]\n.*?(?=^\[|\Z)", shipped)
    assert section, "no [swap_thrash] section in the shipped thresholds"
    lowered, count = re.subn(r"(?m)^for_seconds\s*=\s*\S+", f"for_seconds = {FOR_SECONDS}",
                             section.group(0))
    assert count == 1
    path = directory / "thresholds.toml"
    path.write_text(shipped[:section.start()] + lowered + shipped[section.end():])
    return path


def agent_config(pid: int, thresholds: Path):
    return load_config(environ={
        "HYBRIDMON_PATHS__PROCFS": "/proc",
        "HYBRIDMON_PATHS__SYSFS": "/sys",
        "HYBRIDMON_COLLECTORS__GPU__ENABLED": "false",
        "HYBRIDMON_PCIE__UDEV": "false",
        "HYBRIDMON_PROCESS__PIDS": f"[{pid}]",
        "HYBRIDMON_INTERVAL_SECONDS": "1",
        "HYBRIDMON_DETECTORS__THRESHOLDS_FILE": str(thresholds),
        "HYBRIDMON_DETECTORS__EVALUATION_INTERVAL_SECONDS": "1",
    })


def wait_for_critical_finding(agent: Agent, pid: int, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for state in agent.engine.firing():
            finding = state.finding
            if (finding.alertname == "HostSwapThrash" and finding.severity == "critical"
                    and finding.labels.get("pid") == str(pid)):
                return state
        time.sleep(0.2)
    return None


class Measured:
    """Host and process counters read directly from /proc, independently of the agent."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.time, self.vmstat = time.monotonic(), fault.vmstat()
        self.faults = fault.process_major_faults(pid)
        self.pressure = fault.pressure_some_total_us()

    def rates_until(self, later: "Measured") -> dict[str, float]:
        seconds = later.time - self.time
        page = 4096

        def per_second(name: str) -> float:
            return (later.vmstat.get(name, 0) - self.vmstat.get(name, 0)) / seconds

        rates = {
            "seconds": seconds,
            "swap_in_bytes_per_second": per_second("pswpin") * page,
            "swap_out_bytes_per_second": per_second("pswpout") * page,
            "major_faults_per_second": per_second("pgmajfault"),
        }
        if self.faults is not None and later.faults is not None:
            rates["process_major_faults_per_second"] = (later.faults - self.faults) / seconds
        if self.pressure is not None and later.pressure is not None:
            rates["memory_pressure_some_ratio"] = (later.pressure - self.pressure) / 1e6 / seconds
        return rates


def test_real_swap_thrash_fires_host_swap_thrash_naming_the_process(tmp_path):
    fault.skip_unless_root_with_cgroup_v1_memory()
    thresholds = thresholds_file(tmp_path)
    shipped = load_thresholds().swap_thrash
    used = load_thresholds(thresholds).swap_thrash
    assert used == shipped.model_copy(update={"for_seconds": FOR_SECONDS})
    swappiness_before = Path("/proc/sys/vm/swappiness").read_text().strip()
    started = time.monotonic()

    with ExitStack() as cleanup:   # exits in reverse: agent, child, cgroup, sysctl, swap
        swap = cleanup.enter_context(fault.swap_space([tmp_path, Path("/var/tmp")], SWAP_BYTES))
        cleanup.enter_context(fault.sysctl("vm.swappiness", 100))
        cgroup = cleanup.enter_context(fault.memory_cgroup(CGROUP_LIMIT_BYTES, swappiness=100))
        child = cleanup.enter_context(
            fault.thrasher(cgroup, CHILD_NAME, THRASH_BYTES, THRASH_SECONDS))
        thrash_started = Measured(child.pid)
        dirty_ratio = float(Path("/proc/sys/vm/dirty_ratio").read_text())

        agent = Agent(agent_config(child.pid, thresholds))
        cleanup.callback(agent.stop)
        agent.start()
        state = wait_for_critical_finding(agent, child.pid, FIRE_TIMEOUT_SECONDS)
        fired = Measured(child.pid)
        measured = fault.process_swap_bytes(child.pid)
        rates = thrash_started.rates_until(fired)
        assert child.poll() is None, "the thrasher exited before the finding fired"
        assert state is not None, (
            f"no firing critical HostSwapThrash for pid {child.pid} after "
            f"{FIRE_TIMEOUT_SECONDS} s; measured {rates}; engine states: "
            f"{[(s.finding.alertname, s.finding.severity, s.finding.labels, s.state) for s in agent.engine.states()]}")

        finding = state.finding
        # The whole finding, for whoever runs this with -s.
        print(f"\nHostSwapThrash fired {fired.time - thrash_started.time:.1f} s after the thrash "
              f"started ({state.firing_since - state.pending_since:.1f} s pending); measured from "
              f"/proc: {rates}; VmSwap {measured}; finding: {finding.summary}; {finding.details}")

        assert finding.labels == {"pid": str(child.pid), "process_name": CHILD_NAME}
        assert state.firing_since - state.pending_since >= FOR_SECONDS
        details = finding.details
        assert details["vm_swappiness"] == 100           # what the test set, read live
        assert details["vm_dirty_ratio"] == dirty_ratio
        # Three quarters of 400 MiB cannot fit under the 96 MiB limit: most of it is in swap.
        assert details["process_swap_bytes"] >= 200 * MIB
        assert details["process_swap_bytes"] <= THRASH_BYTES + 64 * MIB
        assert details["swap_in_bytes_per_second"] >= shipped.swap_in_bytes_per_second
        assert details["swap_out_bytes_per_second"] >= shipped.swap_out_bytes_per_second
        assert details["major_faults_per_second"] >= shipped.major_faults_per_second
        assert details["process_major_faults_per_second"] >= shipped.process_major_faults_per_second
        if finding.unit == "bytes":     # by VmSwap, in swap and growing
            assert finding.threshold == shipped.process_swap_bytes
            assert finding.value == details["process_swap_bytes"]
        else:                           # by the process's own major faults
            assert finding.unit == "faults/s"
            assert finding.threshold == shipped.process_major_faults_per_second
            assert finding.value == details["process_major_faults_per_second"]
        assert finding.value >= finding.threshold
        assert finding.for_seconds == FOR_SECONDS
        assert f"pid {child.pid}" in finding.summary and CHILD_NAME in finding.summary
        # The host-wide warning fires alongside, naming the same process as the worst swapper.
        host = [s.finding for s in agent.engine.firing()
                if s.finding.alertname == "HostSwapThrash" and s.finding.severity == "warning"]
        assert host and host[0].details["pid"] == str(child.pid)
        assert host[0].details["process_name"] == CHILD_NAME
        # The agent's rates and ours, read from /proc over about the same time, agree in size.
        assert details["swap_in_bytes_per_second"] >= rates["swap_in_bytes_per_second"] / 10

    # Everything undone.
    assert swap not in fault.active_swaps()
    if not swap.startswith("/dev/"):  # a swapfile, not a loop device
        assert not Path(swap).exists()
    assert not cgroup.path.exists()
    assert not [p for p in fault.CGROUP_V1_MEMORY.iterdir() if p.name == cgroup.path.name]
    assert Path("/proc/sys/vm/swappiness").read_text().strip() == swappiness_before
    assert child.returncode is not None
    assert time.monotonic() - started < 90
