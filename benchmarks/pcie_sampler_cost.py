"""Where the PCIe sampler threads' CPU goes: 8 of them in this process, one variant at a time.

Each variant runs 8 ThroughputSamplers (exporters/pcie_traffic.py) for `--seconds` and reports the
process's CPU (time.process_time) in ms per second of wall time; the variants differ only in what
one sample reads:
- sleep: two time.sleep(0.02), the 20 ms windows and nothing else: the threads' own cost, i.e.
  waking three times a sample (its random moment, each window's return) and the bookkeeping;
- lean: exporters/nvml.py PcieThroughputReader over the fake NVML (which sleeps 20 ms a call);
- full: Nvml.pcie_throughput_bytes_per_second over the same fake, the sampler's path before
  issue 33 (init check, key, source.call, error handling, answer count per call).
- paced: lean, paced as the daemon paces it (AdaptivePacing at the link's maximum generation and
  width, the rate given being the full pace): the fake's links are light (about 1.2 GB/s on
  Gen4 x16), so this is the floor's cost plus the pacing's own arithmetic; a link near the
  starvation threshold costs what `lean` does at the full pace.
lean less sleep is the fake's own Python plus the lean path's; full less lean is what the retry
layers cost. Variants and rates alternate over `--repeats` rounds so that a busy machine's load
falls on all of them alike; the medians are printed.

    .venv/bin/python benchmarks/pcie_sampler_cost.py --rates 1,5 --repeats 2 --seconds 8
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hybridmon.exporters.nvml import Nvml, PcieThroughputReader  # noqa: E402
from hybridmon.exporters.pcie_traffic import (PAIR_SECONDS, SAMPLE_WINDOW_SECONDS, ThroughputSampler,  # noqa: E402
                                              link_pacing)
from hybridmon.exporters.sources import LiveSource  # noqa: E402
from tests.support.fake_nvml import FakeNvml, default_gpus  # noqa: E402

GPUS = 8
VARIANTS = ("sleep", "lean", "full", "paced")


def sleep_pair() -> tuple[int, int]:
    time.sleep(SAMPLE_WINDOW_SECONDS)
    time.sleep(SAMPLE_WINDOW_SECONDS)
    return 0, 0


def cpu_ms_per_second(variant: str, rate: float, seconds: float) -> float:
    fake = FakeNvml((default_gpus() * GPUS)[:GPUS], throughput_delay_seconds=SAMPLE_WINDOW_SECONDS)
    nvml = Nvml(LiveSource(), fake)
    lean = lambda gpu: PcieThroughputReader(nvml, gpu).read_pair  # noqa: E731
    reader = {"sleep": lambda gpu: sleep_pair, "lean": lean, "paced": lean,
              "full": lambda gpu: lambda: nvml.pcie_throughput_bytes_per_second(gpu)}[variant]

    def pacing(gpu: int):
        if variant != "paced":
            return None
        return link_pacing(rate, nvml.pcie_link_max_generation(gpu), nvml.pcie_link_max_width_lanes(gpu))

    samplers = [ThroughputSampler(reader(gpu), rate, pacing=pacing(gpu), name=f"gpu{gpu}")
                for gpu in range(GPUS)]
    for sampler in samplers:
        sampler.start()
    try:
        time.sleep(1 + PAIR_SECONDS)  # past each thread's first sample (and the lean path's resolve)
        wall, cpu = time.monotonic(), time.process_time()
        time.sleep(seconds)
        return (time.process_time() - cpu) / (time.monotonic() - wall) * 1000
    finally:
        for sampler in samplers:
            sampler.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="5,10", help="sample pairs a second per GPU, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="measured per variant and round")
    args = parser.parse_args()
    rates = [float(rate) for rate in args.rates.split(",")]
    runs: dict[tuple[str, float], list[float]] = {}
    load_start = os.getloadavg()
    for _ in range(args.repeats):
        for variant in VARIANTS:
            for rate in rates:
                runs.setdefault((variant, rate), []).append(cpu_ms_per_second(variant, rate, args.seconds))
    print(f"{GPUS} sampler threads, {args.seconds:g} s x {args.repeats} per variant; load "
          f"{load_start[0]:.2f} -> {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    for (variant, rate), values in runs.items():
        median = statistics.median(values)
        # A paced variant's rate is its full pace; on the fake's light links it runs at the floor.
        per_pair = ("at the floor pace" if variant == "paced"
                    else f"{median / (GPUS * rate) * 1000:4.0f} µs a pair")
        print(f"  {variant:5s} {rate:4g}/s  {median:6.2f} ms/s  ({per_pair})"
              f"  runs: {', '.join(f'{value:.1f}' for value in values)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
