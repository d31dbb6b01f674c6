"""Where the daemon's collector threads spend their CPU: per collector run, per History commit,
per detector evaluation (benchmark only, a profiling tool beside daemon_long_run.py).

The daemon of daemon_long_run.py (`hybridmon run` on the scaled host, its history filled first by
benchmarks/daemon_with_history.py), with every collector's collect(), every History commit, every
on_commit callback and every detector's evaluate() timed by the CPU clock of the thread that runs
it (time.thread_time: the fake NVML's blocking sleeps and other threads' work do not count). After
`--warmup-seconds` the sums are reset; after `--minutes` they are printed as ms of CPU per second
of wall time beside the CPU of each thread group (/proc/self/task), so what is left of the
`collector_*` group outside the timed parts (the pool's wake-ups, the GIL) shows too.

    .venv/bin/python benchmarks/daemon_cost_split.py --minutes 3 --pcie-path counters

The timing wraps cost about a microsecond a call: a few hundred calls a second, well under the
figures it splits.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import daemon_long_run  # noqa: E402

SPLIT_ENV = "BENCH_COST_SPLIT"   # where the daemon writes its split (JSON), and when


class CpuSplit:
    """Sums of thread CPU seconds and calls, by part ("collect gpu", "detector swap_thrash"...);
    with `profile_dir`, the parts that call no other timed part are also run under cProfile (its
    overhead then inflates the sums: read the profiles for shares, not the figures)."""

    def __init__(self, profile_dir: Path | None = None) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self.profile_dir = profile_dir
        self.profiles: dict[str, cProfile.Profile] = {}
        self._lock = threading.Lock()

    def timed(self, part: str, function, leaf: bool = True):
        profile = None
        if self.profile_dir is not None and leaf:
            profile = self.profiles[part] = cProfile.Profile(time.thread_time)
        def wrapper(*args, **kwargs):
            started = time.thread_time()
            try:
                if profile is not None:
                    return profile.runcall(function, *args, **kwargs)
                return function(*args, **kwargs)
            finally:
                spent = time.thread_time() - started
                with self._lock:
                    self.seconds[part] += spent
                    self.calls[part] += 1
        return wrapper

    def reset(self) -> None:
        with self._lock:
            self.seconds.clear()
            self.calls.clear()
            for profile in self.profiles.values():
                profile.clear()

    def dump_profiles(self) -> None:
        for part, profile in self.profiles.items():
            profile.dump_stats(self.profile_dir / (part.replace(" ", "_") + ".prof"))

    def snapshot(self) -> dict[str, tuple[float, int]]:
        with self._lock:
            return {part: (self.seconds[part], self.calls[part]) for part in self.seconds}


def thread_groups() -> dict[str, float]:
    return daemon_long_run.cpu_by_thread_group(os.getpid())


def instrument(agent, split: CpuSplit) -> None:
    """Wraps the parts named in the module docstring, on this agent's instances only."""
    for item in agent.sampler.scheduled:
        item.collector.collect = split.timed(f"collect {item.collector.name}", item.collector.collect)
    commit = agent.history.commit
    commits = {item.collector.name: split.timed(f"commit {item.collector.name}", commit)
               for item in agent.sampler.scheduled}
    agent.history.commit = lambda name, at, samples: commits[name](name, at, samples)
    agent.sampler.on_commit[:] = [split.timed(f"on_commit {getattr(callback, '__name__', callback)}", callback,
                                              leaf=False)
                                  for callback in agent.sampler.on_commit]
    for detector in agent.engine.detectors:
        detector.evaluate = split.timed(f"detector {detector.name}", detector.evaluate)
    if agent.engine.correlate is not None:
        agent.engine.correlate = split.timed("correlate (all findings)", agent.engine.correlate)


def sequential_ticks(sampler) -> None:
    """EXPERIMENT: the due collectors of a tick run one after the other in one pool task."""
    def tick(now=None):
        now = sampler._monotonic() if now is None else now
        due = []
        for item in sampler.scheduled:
            if not sampler._dependencies_ready(item, now):
                continue
            if now >= item.next_due and not item.lock.locked():
                item.next_due += item.interval_seconds
                if item.next_due <= now:
                    item.next_due = now + item.interval_seconds
                due.append(item)
        if due and not sampler._stop.is_set():
            sampler._pool.submit(lambda: [sampler.run_collector(item) for item in due])
        sampler.loop.ticks += 1
        sampler.loop.last_tick_at = sampler._monotonic()
    sampler.tick = tick


def report_when_asked(split: CpuSplit, warmup_seconds: float, minutes: float, out: Path) -> None:
    time.sleep(warmup_seconds)
    split.reset()
    groups_before, began = thread_groups(), time.monotonic()
    time.sleep(minutes * 60)
    elapsed = time.monotonic() - began
    groups_after = thread_groups()
    if split.profile_dir is not None:
        split.dump_profiles()
    parts = {part: {"ms_per_second": round(seconds / elapsed * 1000, 3), "calls": calls,
                    "ms_per_call": round(seconds / calls * 1000, 3) if calls else None}
             for part, (seconds, calls) in sorted(split.snapshot().items(), key=lambda item: -item[1][0])}
    out.write_text(json.dumps({
        "measured_seconds": round(elapsed, 1),
        "thread_groups_ms_per_second": {group: round((seconds - groups_before.get(group, 0.0)) / elapsed * 1000, 2)
                                        for group, seconds in sorted(groups_after.items(), key=lambda g: -g[1])},
        "parts": parts}, indent=2) + "\n")


def daemon_main(argv: list[str]) -> int:
    """Inside the daemon: daemon_with_history's wrapper, with the parts timed once the history is
    filled (the filling's own runs are not measured)."""
    from benchmarks import daemon_with_history
    from hybridmon.agent import daemon

    out, warmup, minutes, profile_dir = os.environ[SPLIT_ENV].split(":")
    split = CpuSplit(Path(profile_dir) if profile_dir else None)
    start = daemon.Agent.start

    def start_instrumented(agent, replay_speed: float = 1.0) -> None:
        instrument(agent, split)
        if os.environ.get("BENCH_SEQUENTIAL"):
            sequential_ticks(agent.sampler)
        threading.Thread(target=report_when_asked, args=(split, float(warmup), float(minutes), Path(out)),
                         name="cost-split", daemon=True).start()
        start(agent, replay_speed)

    daemon.Agent.start = start_instrumented
    return daemon_with_history.main(argv)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0, help="measured after the warm-up (default 3)")
    parser.add_argument("--warmup-seconds", type=float, default=30.0, help="after /metrics answers (default 30)")
    parser.add_argument("--pcie-path", choices=daemon_long_run.PCIE_PATHS, default="counters")
    parser.add_argument("--history-minutes", type=float, default=120.0)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--processes", type=int, default=16)
    parser.add_argument("--json-out", metavar="FILE")
    parser.add_argument("--profile-dir", metavar="DIR", help="also write a cProfile file per part here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hybridmon-cost-split-") as tmp:
        out = Path(tmp) / "split.json"
        profile_dir = str(Path(args.profile_dir).resolve()) if args.profile_dir else ""
        if profile_dir:
            Path(profile_dir).mkdir(parents=True, exist_ok=True)
        os.environ[SPLIT_ENV] = f"{out}:{args.warmup_seconds}:{args.minutes}:{profile_dir}"
        daemon_long_run.WITH_HISTORY = [sys.executable, str(Path(__file__).resolve()), "--in-daemon"]
        with contextlib.ExitStack() as stack:
            stack.enter_context(daemon_long_run.daemon_on_scaled_host(
                Path(tmp), args.gpus, args.processes, args.pcie_path, args.history_minutes))
            deadline = time.monotonic() + args.warmup_seconds + args.minutes * 60 + 60
            while not out.exists() and time.monotonic() < deadline:
                time.sleep(1.0)
        if not out.exists():
            print("the daemon wrote no split", file=sys.stderr)
            return 1
        result = json.loads(out.read_text())
    result["load_average_at_end"] = os.getloadavg()
    result["command"] = " ".join(["daemon_cost_split.py", *(argv if argv is not None else sys.argv[1:])])
    print(f"thread groups (ms/s): {result['thread_groups_ms_per_second']}")
    print(f"{'part':52} {'ms/s':>8} {'calls':>7} {'ms/call':>8}")
    for part, figures in result["parts"].items():
        print(f"{part:52} {figures['ms_per_second']:8.3f} {figures['calls']:7d} {figures['ms_per_call'] or 0:8.3f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--in-daemon"]:
        sys.exit(daemon_main(sys.argv[2:]))
    sys.exit(main())
