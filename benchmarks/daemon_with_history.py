"""`hybridmon run` with its history already holding `--history-seconds` (benchmark only).

A daemon's costs that grow with its history are the detectors' evaluations (their windows reach
back up to 2 h: agent/alerts/catalogue.py lookback_seconds) and anything that reads the rings; the
rings themselves are allocated full from the start (agent/loop/history_rings.py), so committing a
tick costs the same at 1 minute as at 2 hours. Running a daemon for 2 h before measuring it does
not fit a benchmark of minutes, so this fills the history first, through the daemon's own code:
before the agent's threads start, its own collectors run at back-dated sample times and commit
through its own History and Sampler, and its own detectors evaluate as each commit asks them to
(every 10 s of sample time). Only the ticks that 2 h of running would leave in the history are
taken: one every 15 s (the coarse tier's step) before the last 11 minutes, every tick of each
collector's own interval within them (FULL_RESOLUTION_SECONDS + LATE_EVALUATION_SECONDS). The
readings are the host's now, stamped with earlier times: the history holds what a steady host's
2 h would leave, not a recording of one.

    python benchmarks/daemon_with_history.py --history-seconds 7200 run --listen 127.0.0.1:9500

Everything after the wrapper's own option is `hybridmon`'s command line.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hybridmon.agent import cli, daemon  # noqa: E402
from hybridmon.agent.detectors.engine import COARSE_STEP_SECONDS, FULL_RESOLUTION_SECONDS  # noqa: E402

def fill_history(agent: daemon.Agent, seconds: float, now: float | None = None) -> int:
    """Runs the agent's collectors at back-dated times from `seconds` ago to now (module
    docstring); returns the collector runs made."""
    now = time.time() if now is None else now
    fine_from = now - (FULL_RESOLUTION_SECONDS + daemon.LATE_EVALUATION_SECONDS)
    due = {item.collector.name: now - seconds for item in agent.sampler.scheduled}
    runs = 0
    at = now - seconds
    while at <= now:
        for item in agent.sampler.scheduled:  # in the order the sampler starts them: dependencies first
            if at < due[item.collector.name]:
                continue
            agent.sampler.run_collector(item, at=at)
            runs += 1
            step = item.interval_seconds if at >= fine_from else max(item.interval_seconds, COARSE_STEP_SECONDS)
            due[item.collector.name] = at + step
        at = min(due.values())
    return runs


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--history-seconds", type=float, required=True,
                        help="history to fill before the daemon's threads start (0: none)")
    args, hybridmon_argv = parser.parse_known_args(argv)
    start = daemon.Agent.start

    def start_after_filling(agent: daemon.Agent, replay_speed: float = 1.0) -> None:
        if args.history_seconds > 0:
            began = time.monotonic()
            runs = fill_history(agent, args.history_seconds)
            print(f"benchmark: history filled with {args.history_seconds:g} s ({runs} collector runs, "
                  f"back-dated) in {time.monotonic() - began:.1f} s", file=sys.stderr, flush=True)
        start(agent, replay_speed)

    daemon.Agent.start = start_after_filling
    return cli.main(hybridmon_argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
