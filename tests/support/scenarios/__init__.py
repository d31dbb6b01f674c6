"""Synthetic traces of incidents and of healthy hosts, recorded by the real collectors.

A scenario (library.py) is a timeline of host states. `write_trace` copies the 2-node fixture host
(tests/fixtures/host-2node) to a temporary directory, and for each simulated tick sets the state,
rewrites the procfs/sysfs files, the fake NVML and vLLM's /metrics answer from it (host.py,
inference.py; loopback.py serves that answer over HTTP meanwhile), and runs every due collector of
a recording hybridmon.agent.daemon.Agent once, in the agent's own order, at the simulated time. The trace
therefore holds exactly the readings those states produce, in the trace format of
docs/trace-format.md, and replays without the temporary directory. docs/scenarios.md lists the
scenarios.

The scenarios are a development tool, run from a source checkout (`python -m tests.support.scenarios`):
the GPU side is tests/support/fake_nvml.py, which the recording agent
loads as its NVML module ("tests.support.fake_nvml") and which this package drives through its module-level
DEFAULT library. Generation holds a lock for that, so traces are written one at a time per process.

    >>> from tests.support.scenarios import SCENARIOS, write_trace
    >>> summary = write_trace("pcie_starvation", "/tmp/pcie_starvation.jsonl.gz")
"""
from __future__ import annotations

import contextlib
import math
import os
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from hybridmon.agent.daemon import Agent
from tests.support.scenarios.host import SyntheticHost
from tests.support.scenarios.library import SCENARIOS, Scenario
from tests.support.scenarios import inference_library  # noqa: F401 (registers its scenarios)
from tests.support.scenarios import offload_library  # noqa: F401 (registers its scenarios)
from tests.support.scenarios import gpu_blip_library  # noqa: F401 (registers its scenarios)
from tests.support.scenarios import crash_library  # noqa: F401 (registers its scenarios)
from tests.support.scenarios import swap_library  # noqa: F401 (registers its scenarios)
from tests.support.scenarios import leak_library  # noqa: F401 (registers its scenarios)
from tests.support.scenarios import topology_library  # noqa: F401 (registers its scenarios)
from tests.support.scenarios import c2c_library  # noqa: F401 (registers its scenarios)
from tests.support.scenarios import kv_tier_library  # noqa: F401 (registers its scenarios)
from tests.support.scenarios.loopback import LoopbackServer
from tests.support import fake_nvml

__all__ = ["SCENARIOS", "Scenario", "ScenarioError", "TraceSummary", "write_trace", "START_TIME"]

# Simulated time of every scenario's first tick: 2025-11-24 16:00 UTC, 2.3 days after the fixture
# host's boot (btime 1763800000), so its processes' start times lie in the past.
START_TIME = 1_764_000_000.0

# The fake NVML the recording agent loads is one module-level library: one generation at a time.
_NVML_LOCK = threading.Lock()


class ScenarioError(Exception):
    """A scenario could not be generated (a collector failed on the synthetic host)."""


@dataclass(frozen=True)
class TraceSummary:
    name: str
    path: Path
    records: int             # reading lines (collector runs)
    ticks: int
    duration_seconds: float  # simulated: from the first tick to the last
    wall_seconds: float      # real time it took to generate
    size_bytes: int


def history_seconds_for(scenario: Scenario) -> float:
    """History an agent needs to hold a whole scenario (at least the agent's default 2 h)."""
    return max(7200.0, math.ceil(scenario.duration_seconds + 10 * scenario.tick_seconds))


def write_trace(name: str, path: str | Path, start: float = START_TIME) -> TraceSummary:
    """Generate scenario `name` into the trace file `path` (gzip JSON lines); see the module doc."""
    scenario = SCENARIOS[name]
    path = Path(path)
    began = time.perf_counter()
    with _NVML_LOCK, tempfile.TemporaryDirectory(prefix=f"hybridmon-scenario-{name}-", dir=_scratch_dir()) as workdir:
        host = SyntheticHost.from_fixture(Path(workdir) / "host", seed=zlib.crc32(name.encode()))
        step = scenario.build(host)
        fake_nvml.reset()
        agent = Agent(host.agent_config(scenario.tick_seconds, history_seconds_for(scenario)), record_to=path)
        try:
            with contextlib.ExitStack() as servers:
                for endpoint, inference in host.inference_servers().items():
                    _route_inference(agent, servers.enter_context(LoopbackServer(inference, endpoint)))
                tick = _TickClock()
                _simulated_clock(agent, tick)
                records = _drive(scenario, step, host, agent, start, tick)
        finally:
            agent.stop()
            fake_nvml.reset()
        failed = {item.collector.name: item.state.last_error for item in agent.sampler.scheduled if item.state.errors}
        if failed:
            raise ScenarioError(f"scenario {name}: collectors failed on the synthetic host: {failed}")
        if agent.recording_error:
            raise ScenarioError(f"scenario {name}: {agent.recording_error}")
    return TraceSummary(name, path, records, scenario.ticks, scenario.duration_seconds,
                        time.perf_counter() - began, path.stat().st_size)


def _route_inference(agent: Agent, server: LoopbackServer) -> None:
    """The recording inference collector's HTTP for `server`'s endpoint goes to it (see
    LoopbackServer); each server's route wraps the previous ones.
    Its fetch is the constructor's injection point for exactly this; it is replaced afterwards
    because the agent builds its collectors from the configuration."""
    for item in agent.sampler.scheduled:
        if item.collector.name == "inference":
            item.collector._fetch = server.route(item.collector._fetch)


class _TickClock:
    """The simulated time of the tick being run (_drive sets it before the tick's collectors)."""

    now = 0.0

    def __call__(self) -> float:
        return self.now


def _simulated_clock(agent: Agent, tick: _TickClock) -> None:
    """faulting_processes turns counters into rates over its own clock (time.monotonic live),
    recorded through its source; here ticks run faster than real time, so it is given the tick's
    simulated time: that of host_memory's last commit, which runs before it on every tick. GPM
    likewise: the agent's Nvml takes a sample only 100 ms after the last (nvml.h) and the fake
    counts the bytes between samples, both on the tick's time, which the gpu collector (first of
    every tick) is about to commit: the sampler's last tick start. process_numa reads each
    process's numa_maps at most once a minute of its clock: the tick's time too."""
    for item in agent.sampler.scheduled:
        if item.collector.name == "faulting_processes":
            item.collector._clock = lambda: agent.history.latest()["host_memory"][0]
        if item.collector.name == "process_numa":
            item.collector._clock = tick
    for item in agent.sampler.scheduled:
        if item.collector.name == "gpu":
            item.collector._nvml._clock = tick
    fake_nvml.DEFAULT.gpm_clock = tick


def _scratch_dir() -> str | None:
    """Where the synthetic host lives while it is generated: tmpfs when there is one. Rewriting a
    small file costs ~7 us on tmpfs and ~150 us on ext4, and a tick rewrites about ten."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None


def _drive(scenario: Scenario, step, host: SyntheticHost, agent: Agent, start: float, tick_clock: _TickClock) -> int:
    """Each tick: the state at t, counters advanced over the tick, files written, due collectors run.

    A collector runs on the ticks where it is due by its own interval (process_numa every 30 s),
    never more often than the tick."""
    records = 0
    next_due = {item.collector.name: 0.0 for item in agent.sampler.scheduled}
    for tick in range(scenario.ticks):
        t = tick * scenario.tick_seconds
        step(t)
        if tick:
            host.advance(scenario.tick_seconds)
        host.write(fake_nvml.DEFAULT, threads=t + 1e-9 >= next_due.get("process_numa", 0.0))
        tick_clock.now = start + t
        for item in agent.sampler.scheduled:  # the agent's order: gpu first, process after it
            name = item.collector.name
            if t + 1e-9 >= next_due[name]:
                agent.sampler.run_collector(item, at=start + t)
                next_due[name] = t + item.interval_seconds
                records += 1
    return records
