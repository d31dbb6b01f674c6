"""What one run of the per-process NUMA collector costs on the real /proc with many watched processes.

Starts `--processes` real child processes (`sleep`, one thread each) and `--threaded` Python
children with `--threads` threads each (an inference server has dozens), then runs
exporters/numa.ProcessNumaCollector over all of them through LiveSource, `--runs` times, its clock
advanced by the collector's interval between runs (as the sampler would), and reports the CPU
time (time.process_time: this process's user + system, the kernel's page-table walks for
numa_maps included) and wall time of each run. The NUMA nodes are the fixture host's two
(tests/fixtures/host-2node/sys, CPUs 0-7 and 8-15) unless --sysfs says otherwise: the collector
reads nothing per process on a host with one node, which most test machines are. Every child is killed when done, on error, and
exits on its own after --child-timeout seconds whatever happens.

    .venv/bin/python benchmarks/process_numa_cost.py [--processes 248] [--threaded 8] [--threads 128]
"""
from __future__ import annotations

import argparse
import inspect
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from hybridmon.exporters.numa import ProcessNumaCollector
from hybridmon.exporters.sources import LiveSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
from numa_maps_cost import add_child_timeout, kernel_has_numa_maps  # noqa: E402  (a script beside this one)

FIXTURE_SYSFS = Path(__file__).resolve().parents[1] / "tests/fixtures/host-2node/sys"
FIXTURE_GPU_BUS = "0000:17:00.0"

THREADED_CHILD = r"""
import sys, threading, time
threads, lifetime = int(sys.argv[1]), float(sys.argv[2])
for _ in range(threads - 1):
    threading.Thread(target=time.sleep, args=(lifetime,), daemon=True).start()
print("ready", flush=True)
time.sleep(lifetime)
"""


def start_children(args: argparse.Namespace) -> list[subprocess.Popen]:
    children = []
    for _ in range(args.processes):
        children.append(subprocess.Popen(["sleep", str(args.child_timeout)]))
    for _ in range(args.threaded):
        child = subprocess.Popen([sys.executable, "-c", THREADED_CHILD, str(args.threads),
                                  str(args.child_timeout)], stdout=subprocess.PIPE, text=True)
        children.append(child)
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError(f"a threaded child failed to start (exit status {child.wait(10)})")
    return children


def stop_children(children: list[subprocess.Popen]) -> None:
    for child in children:
        child.kill()
    for child in children:
        child.wait(10)


class SteppedClock:
    """The collector's clock, advanced by one interval per run as the sampler would space them."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def measure(children: list[subprocess.Popen], runs: int, sysfs: str) -> tuple[list[float], list[float], int]:
    watched = {child.pid: "sleep" if child.args[0] == "sleep" else "python3" for child in children}
    clock = SteppedClock()
    parameters = inspect.signature(ProcessNumaCollector).parameters
    options = {"clock": clock} if "clock" in parameters else {}
    if "gpu_buses" in parameters:
        # every child as if on the fixture's GPU 0 (its PCI device on node 0), as process_numa
        # places only processes that hold GPU memory: its CPU time and memory off that node
        options["gpu_buses"] = lambda: {pid: (FIXTURE_GPU_BUS,) for pid in watched}
    collector = ProcessNumaCollector(LiveSource(), sysfs=sysfs, watched=lambda: watched, **options)
    cpu, wall, series = [], [], 0
    for _ in range(runs):
        started_cpu, started_wall = time.process_time(), time.perf_counter()
        samples = collector.collect()
        cpu.append(time.process_time() - started_cpu)
        wall.append(time.perf_counter() - started_wall)
        series = len(list(samples))
        clock.now += ProcessNumaCollector.default_interval_seconds
    return cpu, wall, series


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=248, help="single-thread children (sleep)")
    parser.add_argument("--threaded", type=int, default=8, help="Python children with --threads threads")
    parser.add_argument("--threads", type=int, default=128, help="threads of each threaded child")
    parser.add_argument("--runs", type=int, default=10, help="collector runs, one interval apart")
    parser.add_argument("--sysfs", default=str(FIXTURE_SYSFS), help="where the NUMA nodes are read")
    add_child_timeout(parser)
    args = parser.parse_args()
    if not kernel_has_numa_maps():
        return 1
    children = []
    try:
        children = start_children(args)
        cpu, wall, series = measure(children, args.runs, args.sysfs)
    finally:
        stop_children(children)
    load = os.getloadavg()
    print(f"NUMA nodes of {args.sysfs}")
    print(f"{len(children)} watched processes ({args.processes} x 1 thread, {args.threaded} x "
          f"{args.threads} threads), {args.runs} runs {ProcessNumaCollector.default_interval_seconds:g} s "
          f"apart; {series} series on the last run; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, "
          f"{os.cpu_count()} CPUs")
    print(f"CPU per run  median {statistics.median(cpu) * 1e3:7.1f} ms  max {max(cpu) * 1e3:7.1f} ms  "
          f"first {cpu[0] * 1e3:7.1f} ms")
    print(f"wall per run median {statistics.median(wall) * 1e3:7.1f} ms  max {max(wall) * 1e3:7.1f} ms  "
          f"first {wall[0] * 1e3:7.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
