"""What one run of the process collector costs on the real /proc with many watched processes.

Starts `--processes` real children (benchmarks/daemon_long_run.py's watched child, a socket and a
sleep each), runs exporters/process.ProcessCollector over them through LiveSource `--runs` times
and reports the CPU time of each run (time.thread_time: this thread's user + system, the kernel's
/proc reads included). With `--baseline-tree DIR` (another checkout of this repository, e.g. an
earlier commit's `git archive`), that tree's exporters/process.py and procfs.py run too, on the
same children, alternating run by run with this tree's: a same-run before/after pair, as figures
on a shared machine need (issue 33). Every child is stopped when done, on error and on Ctrl-C.

    .venv/bin/python benchmarks/process_collector_cost.py --processes 256 [--baseline-tree /tmp/old]
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.agent_bench import stop_process  # noqa: E402
from benchmarks.daemon_long_run import start_watched  # noqa: E402
from hybridmon.exporters import procfs  # noqa: E402
from hybridmon.exporters.process import ProcessCollector  # noqa: E402
from hybridmon.exporters.sources import LiveSource  # noqa: E402


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def baseline_collector_class(tree: Path) -> type:
    """ProcessCollector of `tree`, with that tree's procfs.py under it (the rest is this tree's)."""
    baseline_procfs = _load("baseline_procfs", tree / "exporters/procfs.py")
    sys.modules["hybridmon.exporters.procfs"] = baseline_procfs
    try:
        return _load("baseline_process", tree / "exporters/process.py").ProcessCollector
    finally:
        sys.modules["hybridmon.exporters.procfs"] = procfs


def cpu_ms_per_run(collector, runs: list[float]) -> None:
    started = time.thread_time()
    collector.collect()
    runs.append((time.thread_time() - started) * 1000)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=256, help="watched children (default 256)")
    parser.add_argument("--runs", type=int, default=40, help="runs of each collector (default 40)")
    parser.add_argument("--baseline-tree", type=Path, help="another checkout, run alternately with this one")
    args = parser.parse_args()
    classes = {"this tree": ProcessCollector}
    if args.baseline_tree is not None:
        classes["baseline"] = baseline_collector_class(args.baseline_tree.resolve())
    children = start_watched(args.processes)
    try:
        pids = [child.pid for child in children]
        collectors = {name: cls(LiveSource(), pids=pids, cmdline_patterns=()) for name, cls in classes.items()}
        for collector in collectors.values():
            collector.collect()  # the first run reads every command line and limit; not measured
        runs: dict[str, list[float]] = {name: [] for name in collectors}
        for _ in range(args.runs):
            for name, collector in collectors.items():
                cpu_ms_per_run(collector, runs[name])
        for name, figures in runs.items():
            series = len(collectors[name].collect())
            print(f"{name:<10} {args.processes} processes, {series} series: CPU per run median "
                  f"{statistics.median(figures):.2f} ms, min {min(figures):.2f}, max {max(figures):.2f} "
                  f"({len(figures)} runs)")
    finally:
        for child in children:
            stop_process(child)
    return 0


if __name__ == "__main__":
    sys.exit(main())
