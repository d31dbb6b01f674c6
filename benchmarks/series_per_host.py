"""The series a host exports on /metrics, by metric and by collector: the cardinality a fleet pays per host.

Builds the scaled host (benchmarks/agent_bench_curve.build_sized_host: the fixture host with
`--gpus` NVIDIA GPUs on two NUMA nodes and `--processes` watched vLLM processes, 2 on each GPU) with
`--servers` fake vLLM servers answering the fixture's /metrics (tests/fixtures/inference/
vllm-v1-names.1.prom), runs every collector until the per-process NUMA collector has read every
process, and counts the series of the samples exposition (the agent's own health series, which
no history keeps, are counted apart). Simulated host, fake NVML: the counts are what this code
exports for such a host, not a measurement of a real one.

    .venv/bin/python benchmarks/series_per_host.py [--gpus 8] [--processes 16] [--servers 2] [--detail-series]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `tests` (the fake NVML, the fixture host) is not installed

from benchmarks.agent_bench_curve import build_sized_host  # noqa: E402
from hybridmon.agent.config import load_config  # noqa: E402
from hybridmon.agent.daemon import Agent  # noqa: E402
from hybridmon.exporters import numa  # noqa: E402
from hybridmon.exporters.registry import COLLECTORS  # noqa: E402
from tests.support import fake_nvml  # noqa: E402
from tests.support.fake_inference_server import FakeInferenceServer  # noqa: E402
from tests.support.scaled_host import load_fake_nvml  # noqa: E402

SERIES_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", re.MULTILINE)
PID_SERIES_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)\{(?:[^}]*,)?pid="([0-9]+)"', re.MULTILINE)
VLLM_METRICS = REPO / "tests/fixtures/inference/vllm-v1-names.1.prom"


def series_by_metric(root: Path, gpus: int, processes: int, detail_series: bool = False,
                     inference_urls: tuple[str, ...] = ()) -> tuple[Counter, Counter]:
    """(samples exposition, health) series by metric name on the sized host."""
    samples, health = expositions(root, gpus, processes, detail_series, inference_urls)
    return Counter(SERIES_LINE.findall(samples)), Counter(SERIES_LINE.findall(health))


def series_by_pid(samples: str) -> dict[str, Counter]:
    """pid -> its series by metric name, in a samples exposition (series with a pid label)."""
    found: dict[str, Counter] = {}
    for metric, pid in PID_SERIES_LINE.findall(samples):
        found.setdefault(pid, Counter())[metric] += 1
    return found


def expositions(root: Path, gpus: int, processes: int, detail_series: bool = False,
                inference_urls: tuple[str, ...] = ()) -> tuple[str, str]:
    """(samples exposition, health) text of the sized host."""
    host = build_sized_host(root, gpus, processes)
    load_fake_nvml(host, 0.0)
    environment = {**host.environment(), "HYBRIDMON_PROCESS__DETAIL_SERIES": json.dumps(detail_series),
                   "HYBRIDMON_INFERENCE__ENDPOINTS": json.dumps(list(inference_urls))}
    agent = Agent(load_config(environ=environment))
    try:
        runs = math.ceil(processes / numa.NUMA_MAPS_READS_PER_RUN)  # one numa_maps read each
        for run in range(runs):
            for item in agent.sampler.scheduled:
                agent.sampler.run_collector(item, at=1_800_000_000.0 + 30 * run)
        samples = agent.exposition.samples_text()
        health = agent.exposition.render()[len(samples):]
        return samples.decode(), health.decode()
    finally:
        agent.stop()
        fake_nvml.reset()


def collector_of(metric: str) -> str:
    for registration in COLLECTORS:
        if any(metric == spec.name for spec in registration.collector.metric_specs):
            return registration.name
    return "inference" if metric.startswith("hybridmon_inference_") else "other"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--processes", type=int, default=16)
    parser.add_argument("--servers", type=int, default=2, help="fake vLLM servers scraped")
    parser.add_argument("--detail-series", action="store_true", help="[process] detail_series = true")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="hybridmon-series-") as tmp:
        servers = [stack.enter_context(FakeInferenceServer({"/metrics": [VLLM_METRICS.read_text()]}))
                   for _ in range(args.servers)]
        samples, health = series_by_metric(Path(tmp), args.gpus, args.processes, args.detail_series,
                                           tuple(server.url() for server in servers))
    by_collector = Counter()
    for metric, count in samples.items():
        by_collector[collector_of(metric)] += count
    print(f"{args.gpus} GPUs, {args.processes} watched processes, {args.servers} vLLM servers, "
          f"detail_series {'on' if args.detail_series else 'off'}")
    print(f"samples exposition: {sum(samples.values())} series in {len(samples)} metrics; "
          f"agent health: {sum(health.values())} series")
    print("\n| collector | series |\n|---|---:|")
    for name, count in by_collector.most_common():
        print(f"| {name} | {count} |")
    print("\n| metric | collector | series |\n|---|---|---:|")
    for metric, count in sorted(samples.items(), key=lambda item: (-item[1], item[0])):
        print(f"| `{metric}` | {collector_of(metric)} | {count} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
