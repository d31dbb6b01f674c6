"""PCIe traffic per GPU: exact from NVML's byte counters, else sampled often enough to bound the error.

NVML offers two readings (docs/nvml-cost.md):
- nvmlDeviceGetFieldValues NVML_FI_DEV_PCIE_COUNT_RX/TX_BYTES (driver R555+): cumulative byte
  counters with NVML's timestamp. One call, no blocking; the bytes between two readings over the
  time between them is the exact average, however bursty the traffic.
- nvmlDeviceGetPcieThroughput: the bytes of one 20 ms window in KB/s, blocking for that window.
  Read once per 1 s tick, a 1 min average sees 60 windows (1.2 s of the minute): for on/off
  traffic at 50 % duty its standard error is sqrt(0.25 / 60) = 6.5 % of the burst rate, 13 % of
  the mean; a 15 s Prometheus scrape keeps 4 windows a minute, 50 %.

So `PcieTraffic.read` uses the counters where the GPU has them. Where it does not (or they keep
failing: exporters/nvml.py gives them up after a few reads in a row and asks again now and then),
a GPU with GPM (Hopper and later) is read from its GPM PCIe metrics: NVML's bytes between two
samples a tick apart, MiB/s, no blocking and, like the counters, the exact average of the interval.
Elsewhere a
`ThroughputSampler` thread per GPU takes window pairs (RX then TX), one at a uniformly random
moment in each slot (stratified sampling: unbiased for any traffic, however periodic, and no
noisier than independent samples), and each tick publishes their mean since the last tick and a
running estimate of the bytes moved. Its pace is `samples_per_second` near the starvation
threshold and down to FLOOR_SAMPLES_PER_SECOND far below it (AdaptivePacing: the same 2-sigma
guarantee relative to the distance to the threshold).

Error bound of the sampled reading. A 20 ms window's average of traffic that is between 0 and its
burst rate B, on for a share d of the time, has variance at most d(1 - d)B^2 (a value in [0, 1]
with mean d varies at most as a 0/1 one does); n samples at independent uniformly random times
average with standard error at most

    sigma = B sqrt(d (1 - d) / n)

and stratified sampling does no worse. Assumptions: the traffic's phase is not locked to the
sampling (the random place in each slot makes this so); samples that overlap the same burst are
the stratified case, not a violation. At the default 5 samples/s, the agent's 1 min window holds
n = 300: sigma <= 2.9 % of B at d = 0.5 (2 sigma 5.8 %), 1.7 % at d = 0.9 (2 sigma 3.5 %, inside
the starvation alert's 4 % margin: DEFAULT_SAMPLES_PER_SECOND, the full pace, which
AdaptivePacing keeps near the threshold); a Prometheus rate() over the
sampled byte estimate uses the same 300 samples whatever its scrape interval. The
simulation in tests/exporters/test_pcie_traffic.py measures it; docs/nvml-cost.md has the figures.
"""
from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from hybridmon.exporters.base import LogOnce
from hybridmon.exporters.nvml import GpuLostError, Nvml, PcieByteCount, PcieThroughputReader
from hybridmon.pcie_rates import achievable_capacity, bidirectional_capacity, theoretical_capacity
from hybridmon.exporters.nvml_answers import (NVML_GPM_METRIC_PCIE_RX_PER_SEC,
                                              NVML_GPM_METRIC_PCIE_TX_PER_SEC)

log = logging.getLogger(__name__)

SAMPLE_WINDOW_SECONDS = 0.020
"""nvmlDeviceGetPcieThroughput's window (nvml.h: "querying a byte counter over a 20ms interval")."""
PAIR_SECONDS = 2 * SAMPLE_WINDOW_SECONDS
"""One sample of both directions: two calls, each blocking for its window."""
DEFAULT_SAMPLES_PER_SECOND = 5.0
"""Sample pairs per second per GPU without counters near the starvation threshold (the full pace;
AdaptivePacing takes fewer far below it): n = 300 a minute (module docstring), the sampler thread
blocked in NVML 20 % of the time. 25 is the most (back-to-back windows).

The bound kept: the starvation alert's margin is 4 % of capacity (it fires at 90 %, traffic
clearly under it sits at 86 %: docs/nvml-cost.md), and with bursts at capacity near it (d = 0.9)
n = 300 give a 2-sigma bound of 2 sqrt(0.09 / 300) = 3.5 % of the burst rate, inside the margin
(n >= 225, 3.75 a second, is the least that is). 10 a second (2.4 %) cost twice the CPU for a
margin already kept: each sample wakes its thread three times (its random moment, then each 20 ms
window's return), and on the bench host those wake-ups, not NVML's Python, were most of the
daemon's CPU (issue 33)."""
MAX_SAMPLES_PER_SECOND = 1 / PAIR_SECONDS
WRAP_MARGIN_BYTES = 2**44
"""A counter that drops from within this of 2**width_bits wrapped; from lower it restarted (a
driver reload or GPU reset), read as Prometheus reads a counter reset. 16 TiB: more than a Gen6
x16 link (~121 GB/s) carries in two minutes, far more than one tick's traffic."""
DIRECTIONS = ("host_to_device", "device_to_host")
MIB = 2**20
GPM_GIVE_UP_MISSES = 4
"""GPM reads in a row without PCIe metrics before GPM is given up for the GPU's traffic: the first
read has no interval by design, then three failures, as for the counters (exporters/nvml.py
PCIE_COUNTER_FAILURES_TO_GIVE_UP)."""
METHODS = ("counters", "gpm", "sampled")
"""How a GPU's traffic is read (hybridmon_gpu_pcie_traffic_method): its byte counters, its GPM
PCIe metrics, or 20 ms nvmlDeviceGetPcieThroughput windows (sampled, or one a tick)."""


def counter_increase(previous: int, current: int, width_bits: int) -> int:
    """Bytes counted between two readings of a counter that wraps at 2**width_bits; never negative."""
    if current >= previous:
        return current - previous
    modulus = 1 << width_bits
    if modulus - previous <= WRAP_MARGIN_BYTES:
        return current + modulus - previous
    return current


def share_standard_error(duty: float, samples: int) -> float:
    """Upper bound on the standard error of on/off traffic's estimated share (in units of its burst
    rate) from `samples` 20 ms windows at random moments, at duty `duty` (module docstring)."""
    return math.sqrt(duty * (1 - duty) / samples)


@dataclass
class TrafficReading:
    """One GPU's PCIe traffic in one tick, per direction (host_to_device, device_to_host).

    bytes_per_second: the gauge, the average since the previous reading (method "counters", "gpm"
    or "samples"), or one 20 ms window ("window": the first tick, or samples_per_second 0).
    counted_bytes: NVML's cumulative counters, None without them. sampled_bytes: the sampler's
    running estimate of the bytes moved, None without a sampler."""

    bytes_per_second: tuple[float | None, float | None] = (None, None)
    counted_bytes: tuple[int, int] | None = None
    sampled_bytes: tuple[float, float] | None = None
    method: str = "window"
    source: str = "sampled"  # one of METHODS: how the GPU's traffic is read, this tick's window aside


FLOOR_SAMPLES_PER_SECOND = 0.25
"""AdaptivePacing's least pace, one sample in 4 s. The 2-sigma guarantee against the starvation
threshold comes from the pacing rule at any pace; the floor only bounds how long a link that
looked idle waits to be looked at again. A burst starting on an idle link is seen within 4 s and
brings the full pace back within RECENT_SAMPLES more slots (about 7 s in all, test), against the
starvation alert's 2 min `for` on a 1 min reading (thresholds.toml [pcie_starvation]); the 1 min
reading stays unbiased meanwhile (each sample stands for its slot). What the floor gives up is
precision far below the threshold: n = 15 a minute, 2 sigma at most 2 sqrt(m (C - m) / 15), 26 %
of C at m = C / 2, which the rule only allows where m is further than that below T. At 1 a second
the 8 sampler threads of the benchmark host's light links cost 2.9-3.5 ms of CPU a second, a third
of the daemon's 1 % budget (issue 33; docs/performance.md): each sample wakes its thread three
times, which no pace-independent change removes."""
STARVATION_SHARE = 0.90
"""The starvation alert's share of capacity (agent/alerts/thresholds.toml [pcie_starvation]
traffic_share_of_capacity; tests/exporters/test_pcie_traffic.py holds them equal)."""
PACING_WINDOW_SECONDS = 60.0
"""The window the alert judges: rate() of the sampled bytes over 1 min."""


class AdaptivePacing:
    """How many samples a second one GPU's link needs: the full pace near the starvation
    threshold, fewer far below it, never under FLOOR_SAMPLES_PER_SECOND.

    Derivation (docs/performance.md, "The sampler path"). A 20 ms window's reading lies in [0, C],
    C the link's theoretical rate (no window carries more), so a window at a random moment, with
    the link's mean rate m over the minute, has variance at most m (C - m) (a value in [0, C] with
    mean m varies at most as a 0/C one does: the binomial on/off model, d = m / C). r samples a
    second over the W = 60 s window estimate m with standard error at most
    sqrt(m (C - m) / (r W)), and stratified slots do no worse. The reading cannot cross the
    threshold by error, at the same 2 sigma the full pace keeps near it, while

        2 sqrt(m (C - m) / (r W)) <= T - m,   i.e.   r >= 4 m (C - m) / (W (T - m)^2)

    with T the least rate the alert can fire at on this link. T: the alert fires at
    STARVATION_SHARE of what the link carries; one direction alone is judged against the
    achievable rate, both together against the bidirectional one (pcie_rates), and two directions
    whose sum crosses STARVATION_SHARE x bidirectional have one at or past half of it. So T =
    STARVATION_SHARE x min(achievable, bidirectional / 2): 0.52 C on Gen4. Assumed: a capacity
    measured by `hybridmon bench` is not below that bidirectional figure (the pacing does not read
    it); where it is, the far-from-threshold pace keeps its 2 sigma against the lower threshold
    only once m is under it by the margin the formula gives (module docstring for n = 60: 13 % of
    C at d = 0.5).

    m is not known: each decision uses an upper bound on it, the larger of the last
    RECENT_SAMPLES samples' mean (so a burst brings the full pace back within a sample or two)
    and the minute's mean plus its own 2 sigma. At or past T: the full pace. Without a known
    link (generation or width unknown): the full pace always."""

    RECENT_SAMPLES = 3

    def __init__(self, full_per_second: float, near_bytes_per_second: float | None,
                 ceiling_bytes_per_second: float | None,
                 floor_per_second: float = FLOOR_SAMPLES_PER_SECOND,
                 window_seconds: float = PACING_WINDOW_SECONDS) -> None:
        self.full = full_per_second
        self.floor = min(floor_per_second, full_per_second)
        self._near = near_bytes_per_second
        self._ceiling = ceiling_bytes_per_second
        self._window = window_seconds
        self._samples: list[deque] = [deque(), deque()]  # per direction: (moment, bytes/s)
        self._totals = [0.0, 0.0]  # per direction: the sum of the window's values, kept running
        # (each decision is O(1): 40 decisions a second at the full pace on 8 GPUs)

    def samples_per_second(self, now: float, pair: tuple[float | None, float | None]) -> float:
        """The pace for the next slot, given the sample just taken at about `now`."""
        if not self._near or not self._ceiling:
            return self.full
        pace = self.floor
        for direction, value in enumerate(pair):
            samples = self._samples[direction]
            if value is not None:
                samples.append((now, float(value)))
                self._totals[direction] += value
            while samples and samples[0][0] < now - self._window:
                self._totals[direction] -= samples.popleft()[1]
            if samples:
                pace = max(pace, self._needed(samples, self._totals[direction]))
            else:
                self._totals[direction] = 0.0  # no drift carried into the next window
        return min(pace, self.full)

    def _needed(self, samples: deque, total: float) -> float:
        ceiling, n = self._ceiling, len(samples)
        mean = min(max(total / n, 0.0), ceiling)
        recent = min(n, self.RECENT_SAMPLES)
        recent_mean = sum(samples[-i][1] for i in range(1, recent + 1)) / recent
        upper = max(recent_mean, mean + 2 * math.sqrt(mean * (ceiling - mean) / n))
        if upper >= self._near:
            return math.inf
        return 4 * upper * (ceiling - upper) / (self._window * (self._near - upper) ** 2)


def link_pacing(full_per_second: float, generation: float | None, lanes: float | None) -> AdaptivePacing:
    """AdaptivePacing for a link at its maximum generation and width (NVML's; the current ones
    drop at idle): the threshold and the ceiling of its docstring from pcie_rates."""
    if not generation or not lanes:
        return AdaptivePacing(full_per_second, None, None)
    achievable = achievable_capacity(generation, lanes)
    bidirectional = bidirectional_capacity(generation, lanes)
    near = (None if achievable is None or bidirectional is None
            else STARVATION_SHARE * min(achievable, bidirectional / 2))
    return AdaptivePacing(full_per_second, near, theoretical_capacity(generation, lanes))


class ThroughputSampler:
    """Samples one GPU's nvmlDeviceGetPcieThroughput pairs, one at a random moment in each slot.

    read_pair() returns (host_to_device, device_to_host) bytes/s, either None when it failed.
    `sample_slot` is one step; `start` runs it on a daemon thread until `stop`. clock, wait and
    rng are injected so a simulation runs the same steps on simulated time."""

    def __init__(self, read_pair: Callable[[], tuple[float | None, float | None]],
                 samples_per_second: float = DEFAULT_SAMPLES_PER_SECOND, *,
                 pacing: AdaptivePacing | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wait: Callable[[float], Any] | None = None,
                 rng: random.Random | None = None, name: str = "gpu") -> None:
        if not 0 < samples_per_second <= MAX_SAMPLES_PER_SECOND:
            raise ValueError(f"samples_per_second must be in (0, {MAX_SAMPLES_PER_SECOND:g}]: "
                             f"each sample blocks {PAIR_SECONDS * 1000:g} ms")
        self._read_pair = read_pair
        self._slot_seconds = 1.0 / samples_per_second  # the next slot's length; pacing may change it
        self._pacing = pacing
        self._clock = clock
        self._stop = threading.Event()
        # Held until stop(): the sampler waits for its next moment by a timed acquire of it, one C
        # call where Event.wait runs a Condition's Python (a wait per sample, 80 a second on 8
        # GPUs: 8 samplers of sleep-only reads cost 19-20 ms/s of CPU waiting this way, 23-25
        # with Event.wait, on the 2-vCPU VM of docs/nvml-cost.md).
        self._running = threading.Lock()
        self._running.acquire()
        self._wait = wait or self._wait_unless_stopped
        self._rng = rng or random.Random()
        self._name = name
        self._lock = threading.Lock()
        self._slot_start: float | None = None  # where the next sample's slot begins
        self._covered_until: float | None = None  # the byte estimate covers up to here
        self._sums = [0.0, 0.0]  # each sample x its slot's seconds, so a slower pace weighs more
        self._weights = [0.0, 0.0]
        self._counts = [0, 0]
        self._estimated_bytes = [0.0, 0.0]
        self._thread: threading.Thread | None = None
        self._log_once = LogOnce(log)

    def sample_slot(self) -> None:
        """Take the next slot's sample at a uniformly random moment in it (or as soon as the
        previous sample ends, if that is later); slots already past are skipped, not caught up.

        Each sample stands for the time since the previous one's slot ended: its slot and the
        slots skipped before it (the byte estimate's weight). Slots tile time and each moment is
        uniform in its slot whatever the pace chose for its length from earlier samples, so the
        estimate stays unbiased under AdaptivePacing (its docstring)."""
        now = self._clock()
        if self._slot_start is None:
            self._slot_start = self._covered_until = now
        if now >= self._slot_start + self._slot_seconds:  # late: into the slot `now` falls in
            self._slot_start += math.floor((now - self._slot_start) / self._slot_seconds) * self._slot_seconds
        at = self._slot_start + self._rng.random() * self._slot_seconds
        if at > now and self._wait(at - now):
            return  # stopped
        pair = self._read_pair()
        slot_end = self._slot_start + self._slot_seconds
        weight = slot_end - self._covered_until
        with self._lock:
            for direction, value in enumerate(pair):
                if value is not None:
                    self._sums[direction] += value * weight
                    self._weights[direction] += weight
                    self._counts[direction] += 1
                    self._estimated_bytes[direction] += value * weight
        self._covered_until = self._slot_start = slot_end
        if self._pacing is not None:
            self._slot_seconds = 1.0 / self._pacing.samples_per_second(slot_end, pair)

    @property
    def samples_per_second(self) -> float:
        """The pace of the next slot."""
        return 1.0 / self._slot_seconds

    def take(self) -> dict:
        """Per direction since the previous take: samples, their mean bytes/s (None without any),
        and the running byte estimate. Plain JSON, so a trace records it."""
        with self._lock:
            taken = {direction: {"samples": self._counts[i],
                                 "mean_bytes_per_second": (self._sums[i] / self._weights[i]
                                                           if self._counts[i] else None),
                                 "estimated_bytes": self._estimated_bytes[i]}
                     for i, direction in enumerate(DIRECTIONS)}
            self._sums, self._weights, self._counts = [0.0, 0.0], [0.0, 0.0], [0, 0]
        return taken

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"hybridmon-pcie-{self._name}")
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample_slot()
            except Exception as error:  # a sampler must outlive one bad answer; the tick reports
                self._log_once(type(error).__name__, "PCIe sampler for %s: %s", self._name, error)
                self._wait_unless_stopped(self._slot_seconds)

    def _wait_unless_stopped(self, seconds: float) -> bool:
        """Waits `seconds`, or until stop(); True when stopped (as Event.wait)."""
        if self._running.acquire(timeout=max(seconds, 0.0)):
            self._running.release()   # left released: every later wait returns at once
            return True
        return False

    def stop(self, timeout: float = 1.0) -> None:
        """Stop the thread; one stuck in an NVML call is left (it is a daemon) after `timeout`."""
        with self._lock:
            stopping = not self._stop.is_set()
            self._stop.set()
        if stopping:
            self._running.release()
        if self._thread is not None:
            self._thread.join(timeout)


class PcieTraffic:
    """The GPU collector's PCIe traffic reading, per GPU (see the module docstring).

    nvml: the collector's gate (its calls are recorded). sampler_nvml: a second gate on the same
    library for the sampler threads, on a LiveSource: thousands of samples a minute are not
    recorded, only each tick's summary (source.call "pcie_traffic.samples(<gpu>)"); None when
    replaying or with samples_per_second 0, where each tick reads one 20 ms window pair instead."""

    def __init__(self, nvml: Nvml, source: Any, sampler_nvml: Nvml | None,
                 samples_per_second: float = DEFAULT_SAMPLES_PER_SECOND, *,
                 replaying: bool = False) -> None:
        self._nvml = nvml
        self._source = source
        self._sampler_nvml = sampler_nvml
        self._samples_per_second = samples_per_second
        self._replaying = replaying
        self._previous: dict[int, PcieByteCount] = {}
        self._samplers: dict[int, ThroughputSampler] = {}
        self._gpm_misses: dict[int, int] = {}  # gpu -> GPM reads in a row without PCIe metrics
        self._held_means: dict[int, list] = {}  # gpu -> the sampled means last published
        self._lock = threading.Lock()

    def read(self, gpu: int, gpm: Callable[[], dict[int, float] | None] = lambda: None) -> TrafficReading:
        """gpm: the GPU's GPM metrics this tick (Nvml.gpm_metrics, read at most once a tick by
        the caller, as C2C shares the sample pair); asked only where GPM is the method."""
        counted = self._nvml.pcie_byte_counters(gpu)
        if counted is not None:
            self._stop_sampler(gpu)  # counters back after a retry: the samples are not needed
            return self._from_counters(gpu, counted)
        self._previous.pop(gpu, None)  # a gap: the next rate starts afresh
        if self._nvml.pcie_byte_counters_usable(gpu) is False:
            if self._gpm_misses.get(gpu, 0) < GPM_GIVE_UP_MISSES and self._nvml.gpm_supported(gpu):
                reading = self._from_gpm(gpu, gpm())
                if reading is not None:
                    return reading
            if self._samples_per_second > 0 and (self._replaying or self._sampler_nvml is not None):
                return self._from_samples(gpu)
        return TrafficReading(self._nvml.pcie_throughput_bytes_per_second(gpu))

    def _from_gpm(self, gpu: int, metrics: dict[int, float] | None) -> TrafficReading | None:
        """The GPM PCIe metrics as a reading: a window this tick where they gave no interval yet
        (first read) or failed, None once GPM is given up for the GPU (GPM_GIVE_UP_MISSES)."""
        ids = (NVML_GPM_METRIC_PCIE_RX_PER_SEC, NVML_GPM_METRIC_PCIE_TX_PER_SEC)
        if metrics is not None and all(metric in metrics for metric in ids):
            self._gpm_misses[gpu] = 0
            self._stop_sampler(gpu)  # one started while GPM's support was not known yet
            return TrafficReading(tuple(metrics[metric] * MIB for metric in ids), method="gpm",
                                  source="gpm")
        misses = self._gpm_misses[gpu] = self._gpm_misses.get(gpu, 0) + 1
        if misses >= GPM_GIVE_UP_MISSES or metrics is not None:
            # Answered without the PCIe metrics: the GPU does not measure them; asking is futile.
            self._gpm_misses[gpu] = GPM_GIVE_UP_MISSES
            log.warning("GPU %d: GPM gave no PCIe metrics (%s): its PCIe traffic is sampled with "
                        "nvmlDeviceGetPcieThroughput instead", gpu,
                        "failed %d times in a row" % misses if metrics is None else
                        "answered without them")
            return None
        return TrafficReading(self._nvml.pcie_throughput_bytes_per_second(gpu), source="gpm")

    def _from_counters(self, gpu: int, counted: PcieByteCount) -> TrafficReading:
        totals = (counted.host_to_device_bytes, counted.device_to_host_bytes)
        previous = self._previous.get(gpu)
        self._previous[gpu] = counted
        elapsed = None if previous is None else counted.timestamp_seconds - previous.timestamp_seconds
        if previous is None or elapsed <= 0:
            # No interval yet (first tick): one 20 ms window, so the gauge is there from the start.
            return TrafficReading(self._nvml.pcie_throughput_bytes_per_second(gpu), totals,
                                  source="counters")
        before = (previous.host_to_device_bytes, previous.device_to_host_bytes)
        rates = tuple(counter_increase(old, new, counted.width_bits) / elapsed
                      for old, new in zip(before, totals))
        return TrafficReading(rates, totals, method="counters", source="counters")

    def _from_samples(self, gpu: int) -> TrafficReading:
        def take() -> dict:
            return self._sampler(gpu).take()

        taken = self._source.call(f"pcie_traffic.samples({gpu})", take)
        means = [taken[d]["mean_bytes_per_second"] for d in DIRECTIONS]
        sampled = tuple(float(taken[d]["estimated_bytes"]) for d in DIRECTIONS)
        held = self._held_means.get(gpu)
        if None in means and held is not None:
            # No sample since the last tick: at a slow pace (AdaptivePacing, one in 4 s at the
            # least) most 1 s ticks hold none. The gauge holds the last mean; the byte
            # estimate the alert reads covers the gap already.
            means = [h if m is None else m for m, h in zip(means, held)]
        if None in means:
            # No sample yet (the sampler just started): one window now.
            window = self._nvml.pcie_throughput_bytes_per_second(gpu)
            means = [w if m is None else m for m, w in zip(means, window)]
            return TrafficReading(tuple(means), None, sampled, method="window")
        self._held_means[gpu] = means
        return TrafficReading(tuple(means), None, sampled, method="samples")

    def _sampler(self, gpu: int) -> ThroughputSampler:
        with self._lock:
            sampler = self._samplers.get(gpu)
            if sampler is None:
                reader = PcieThroughputReader(self._sampler_nvml, gpu)  # lean: no retry layers

                def read_pair() -> tuple[int | None, int | None]:
                    try:
                        return reader.read_pair()
                    except GpuLostError:
                        return None, None  # the collector's own calls report the loss

                # The sampler's own gate: the collector's calls are recorded, and this runs
                # inside its recorded pcie_traffic.samples call.
                pacing = link_pacing(self._samples_per_second,
                                     self._sampler_nvml.pcie_link_max_generation(gpu),
                                     self._sampler_nvml.pcie_link_max_width_lanes(gpu))
                sampler = self._samplers[gpu] = ThroughputSampler(
                    read_pair, self._samples_per_second, pacing=pacing, name=f"gpu{gpu}")
                sampler.start()
                log.info("GPU %d: sampling PCIe throughput %g to %g times a second, by the distance "
                         "to the starvation threshold (no byte counters; docs/performance.md)",
                         gpu, pacing.floor, pacing.full)
        return sampler

    def _stop_sampler(self, gpu: int) -> None:
        with self._lock:
            sampler = self._samplers.pop(gpu, None)
            self._held_means.pop(gpu, None)
        if sampler is not None:
            sampler.stop()

    def close(self) -> None:
        with self._lock:
            samplers, self._samplers = list(self._samplers.values()), {}
        for sampler in samplers:
            sampler.stop()
        if self._sampler_nvml is not None:
            self._sampler_nvml.close()
