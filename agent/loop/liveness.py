"""Is the agent alive: what /healthz answers 503 for, so a liveness probe restarts a stalled agent.

An HTTP server that answers is not enough: it runs in its own thread, and /metrics keeps serving
the last samples while the sampling loop, every collector or the detectors have stopped. Three
things must keep happening, each judged against a bound on the sampler's monotonic clock:

- the loop ticks: it starts the collectors (agent/loop/sampler.py run_forever);
- some collector finishes a run: one hung collector (NVML stuck on a lost GPU) is isolated and
  shown, not fatal, since a restart would not bring that GPU back and would blind every other
  signal of the host; all of them hung leaves nothing sampled;
- the detectors evaluate: they run after commits (daemon.Agent), so a stuck detector or no commit
  stops every finding and every push to Alertmanager.

Not judged in a replay (recorded time paces the collectors and the last state stays served after
the trace ends) nor before the loop starts.
"""
from __future__ import annotations

import time

# The bound on each gap: 10 ticks of the loop (or of the fastest collector), and never under a
# minute, so a scheduling hiccup, a slow first NVML initialisation or one swap-in stall does not
# count; the DaemonSet's probe then needs 3 failures 30 s apart before it restarts the agent.
STALL_INTERVALS = 10
STALL_FLOOR_SECONDS = 60.0


def stall_bound(interval_seconds: float) -> float:
    return max(STALL_FLOOR_SECONDS, STALL_INTERVALS * interval_seconds)


def problems(agent, wall_clock=time.time) -> list[str]:
    """Why the agent is not alive, one sentence each; [] when it is (or is not judged)."""
    sampler = agent.sampler
    loop = sampler.loop
    if loop.started_at is None:
        return []
    now = sampler.monotonic()
    found = []
    bound = stall_bound(sampler.interval_seconds)
    since_tick = now - (loop.last_tick_at if loop.last_tick_at is not None else loop.started_at)
    if since_tick > bound:
        found.append(f"the sampling loop has not ticked for {since_tick:.0f} s (bound {bound:.0f} s)")
    if sampler.scheduled:
        bound = stall_bound(min(item.interval_seconds for item in sampler.scheduled))
        since_commit = now - (loop.last_commit_at if loop.last_commit_at is not None else loop.started_at)
        if since_commit > bound:
            running = ", ".join(f"{item.collector.name} {now - item.state.running_since:.0f} s"
                                for item in sampler.scheduled if item.state.running_since is not None)
            found.append(f"no collector has finished a run for {since_commit:.0f} s (bound {bound:.0f} s); "
                         f"running: {running or 'none'}")
    if agent.config.detectors.enabled:
        # The engine evaluates at most once per evaluation interval of sample time.
        bound = max(stall_bound(sampler.interval_seconds),
                    2 * agent.config.detectors.evaluation_interval_seconds)
        evaluated = agent.engine.last_evaluated_at
        # Sample time is wall time in live and record mode; a wall clock stepped forward by more
        # than the bound reads as one stalled answer, gone at the next evaluation.
        since_evaluation = (wall_clock() - evaluated if evaluated is not None
                            else now - loop.started_at)
        if since_evaluation > bound:
            found.append(f"the detectors have not evaluated for {since_evaluation:.0f} s (bound {bound:.0f} s)")
    return found
