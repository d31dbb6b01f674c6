"""Detector evaluation at 10 minutes and at 2 hours of history, timed side by side (agent_bench.py).

Timed at two checkpoints an hour and fifty minutes apart, the two figures were taken in different
phases of a shared 2-vCPU VM, which runs the same Python up to 2.4x slower for minutes at a time:
the ratio moved from 1.37x to 2.43x on one run depending on how it was corrected. Here the history
as it was at 10 minutes is kept (pickled, so that it does not count in the RSS measured meanwhile),
and at the end one evaluation of it and one of the full history alternate, round after round, in
the same thread: both figures come from the same minutes of the machine.

Each round evaluates at `now` or one second before, alternately: the read plans (which ring
positions a read keeps) are remembered per tick, and the daemon's evaluations, 10 ticks apart, never
find them made; so none here does either. (An evaluation further back would read the points after
it too, which the daemon's never have: a history is read to its newest tick.)

Memory growth works out each process's trend at the first evaluation of a minute and reuses it for
the other five (agent/alerts/memory_growth/trend.py): every sixth round here makes it forget its
trends first, as a new minute does, and the figure is the mean of the rounds, not a median, which
would hide that round.
"""
from __future__ import annotations

import pickle
import statistics
import time
from pathlib import Path

from hybridmon.agent.alerts.catalogue import all_detectors
from hybridmon.agent.detectors.engine import Engine


def keep_history(agent, path: Path) -> None:
    """Writes the agent's history as it is now to `path`, streamed: a 5.5 MB pickle built in
    memory first raised the RSS measured at the end of the run by 3-6 MB."""
    with path.open("wb") as out:
        pickle.dump(agent.history, out, protocol=pickle.HIGHEST_PROTOCOL)


def evaluation_side_by_side(agent, kept: Path, kept_now: float, now: float, rounds: int = 24,
                            minute_every: int = 6) -> dict:
    """Mean ms of this thread's CPU per evaluation of every detector over the history kept at
    `kept_now` and over the agent's own at `now`, alternating for `rounds` rounds; every
    `minute_every`-th round is the first of a minute (the daemon evaluates every 10 s)."""
    earlier = Engine(all_detectors(agent.thresholds), pickle.loads(kept.read_bytes()),
                     lookback_seconds=agent.engine.lookback_seconds)
    for detector in earlier.detectors:
        attach = getattr(detector, "attach", None)
        if attach is not None:
            attach(agent)
    timings: dict[str, list[float]] = {"earlier": [], "full": []}
    for round_number in range(rounds + 1):
        back = round_number % 2
        for name, engine, at in (("earlier", earlier, kept_now), ("full", agent.engine, now)):
            if round_number % minute_every == 0:
                for detector in engine.detectors:
                    getattr(detector, "forget_trends", lambda: None)()
            started = time.thread_time()
            engine.evaluate(at - back)
            if round_number:   # the first round loads what the first evaluation loads (numpy)
                timings[name].append((time.thread_time() - started) * 1000)
    earlier_ms, full_ms = (statistics.mean(timings[name]) for name in ("earlier", "full"))
    return {"rounds": rounds, "earlier_ms": round(earlier_ms, 2), "full_ms": round(full_ms, 2),
            "ratio": round(full_ms / earlier_ms, 2)}
