"""exporters/pcie_traffic.py: PCIe traffic exact from NVML's byte counters, else sampled with a
bounded error; driven through the real collector and the fake NVML's bursty traffic model."""
from __future__ import annotations

import logging
import math
import random
import statistics
import time
import tomllib
from pathlib import Path

import pytest

from hybridmon.exporters.gpu import (PCIE_BYTES, PCIE_SAMPLED_BYTES, PCIE_THROUGHPUT,
                                     PCIE_TRAFFIC_METHOD, GpuCollector)
from hybridmon.exporters.nvml import Nvml
from hybridmon.exporters.pcie_traffic import (DEFAULT_SAMPLES_PER_SECOND, FLOOR_SAMPLES_PER_SECOND,
                                              STARVATION_SHARE, ThroughputSampler, counter_increase,
                                              link_pacing, share_standard_error)
from hybridmon.pcie_rates import theoretical_capacity
from hybridmon.exporters.sources import LiveSource, RecordingSource, ReplaySource
from tests.support.fake_nvml import (NVML_VALUE_TYPE_UNSIGNED_INT, FakeNvml, default_gpus,
                                     grace_hopper_gpu, pcie_on_seconds)

KIB = 1024
BURST_KILOBYTES_PER_SECOND = 1_000_000  # ~1 GB/s while a burst is on
REPO = Path(__file__).resolve().parents[2]
COUNTING_DRIVER = "560.35.03"  # R555 or later: fields 197/198 exist


class SimClock:
    """Simulated seconds: the fake's 20 ms windows and the sampler's waits advance it."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> bool:
        self.now += seconds
        return False  # "not stopped", as threading.Event.wait answers on a timeout


def bursty_gpu(duty: float, period: float, seed: int):
    gpu = default_gpus()[0]
    gpu.pcie_rx_kilobytes_per_second = BURST_KILOBYTES_PER_SECOND
    gpu.pcie_tx_kilobytes_per_second = BURST_KILOBYTES_PER_SECOND // 4
    gpu.pcie_duty, gpu.pcie_period_seconds, gpu.pcie_traffic_seed = duty, period, seed
    return gpu


def simulated_fake(gpus, seed: int = 0, **settings) -> tuple[FakeNvml, SimClock]:
    fake = FakeNvml(gpus, throughput_delay_seconds=0.020, **settings)
    clock = SimClock(1_700_000_000.0 + random.Random(seed).uniform(0, 1000))
    fake.use_clock(clock, clock.advance)
    return fake, clock


def values(samples, spec, direction="host_to_device", gpu="0"):
    found = [s.value for s in samples
             if s.spec is spec and s.label_values[0] == gpu and s.label_values[-1] == direction]
    return found[0] if found else None


# --- counters ------------------------------------------------------------------------------------
def test_counters_give_the_exact_rate_over_bursty_traffic():
    gpu = bursty_gpu(duty=0.5, period=0.3, seed=7)
    fake, clock = simulated_fake([gpu])
    fake.configure(driver_version=COUNTING_DRIVER)
    collector = GpuCollector(LiveSource(), fake)
    try:
        read_at = clock()  # the counters are read first in a tick, before any 20 ms window
        first = collector.collect()
        counted = [values(first, PCIE_BYTES)]
        for _ in range(60):
            clock.advance(1.0)
            before, read_at = read_at, clock()
            samples = collector.collect()
            exact = (BURST_KILOBYTES_PER_SECOND * KIB * pcie_on_seconds(gpu, before, read_at)
                     / (read_at - before))
            assert values(samples, PCIE_THROUGHPUT) == pytest.approx(exact, rel=1e-5, abs=1)
            counted.append(values(samples, PCIE_BYTES))
    finally:
        collector.close()
    assert all(b > a for a, b in zip(counted, counted[1:]))
    # No blocking windows after the first tick: the counters replace them.
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 2
    assert fake.calls["nvmlDeviceGetFieldValues"] == 61


def test_counters_wrap_and_restart_without_negative_rates():
    assert counter_increase(100, 250, 64) == 150
    assert counter_increase(2**64 - 10, 5, 64) == 15  # wrapped past the top
    assert counter_increase(5_000_000, 1_000, 64) == 1_000  # restarted (driver reload): reset

    gpu = bursty_gpu(duty=1.0, period=0.5, seed=1)
    gpu.pcie_counter_start_bytes = 2**64 - 3 * BURST_KILOBYTES_PER_SECOND * KIB
    fake, clock = simulated_fake([gpu])
    fake.configure(driver_version=COUNTING_DRIVER)
    collector = GpuCollector(LiveSource(), fake)
    try:
        collector.collect()
        seen = []
        for _ in range(6):  # the counter passes 2**64 in the fourth second
            clock.advance(1.0)
            samples = collector.collect()
            seen.append((values(samples, PCIE_BYTES), values(samples, PCIE_THROUGHPUT)))
    finally:
        collector.close()
    assert any(b < a for (a, _), (b, _) in zip(seen, seen[1:]))  # it did wrap
    assert all(rate == pytest.approx(BURST_KILOBYTES_PER_SECOND * KIB) for _, rate in seen)


def test_32_bit_counters_are_not_trusted():
    gpu = bursty_gpu(duty=1.0, period=0.5, seed=1)
    gpu.pcie_counter_value_type = NVML_VALUE_TYPE_UNSIGNED_INT
    fake = FakeNvml([gpu], driver_version=COUNTING_DRIVER)
    nvml = Nvml(LiveSource(), fake)
    assert nvml.pcie_byte_counters(0) is None
    assert nvml.pcie_byte_counters_usable(0) is False


# --- fallback: sampling -------------------------------------------------------------------------
def test_unsupported_fields_fall_back_to_sampling_decided_once(caplog):
    caplog.set_level(logging.INFO)
    fake = FakeNvml()  # driver 550: fields 197/198 answer NOT_SUPPORTED per field
    collector = GpuCollector(LiveSource(), fake, pcie_samples_per_second=25)
    try:
        first = collector.collect()
        assert values(first, PCIE_THROUGHPUT) == 1_200_000 * KIB  # one window the first tick
        assert values(first, PCIE_BYTES) is None
        deadline = time.monotonic() + 5
        while fake.calls["nvmlDeviceGetPcieThroughput"] < 4 + 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        later = collector.collect()
    finally:
        collector.close()
    assert values(later, PCIE_THROUGHPUT) == 1_200_000 * KIB  # the samples' mean
    assert values(later, PCIE_THROUGHPUT, "device_to_host", gpu="1") == 80_000 * KIB
    assert values(later, PCIE_SAMPLED_BYTES) > 0
    assert values(later, PCIE_BYTES) is None
    assert fake.calls["nvmlDeviceGetFieldValues"] == 2  # decided once per GPU
    assert sum("no usable PCIe byte counters" in r.getMessage() for r in caplog.records) == 2


def test_sampled_reading_records_and_replays():
    fake = FakeNvml()
    recording = RecordingSource(LiveSource())
    live = GpuCollector(recording, fake, pcie_samples_per_second=25)
    ticks = []
    try:
        for _ in range(3):
            samples = live.collect()
            ticks.append((sorted((s.spec.name, s.label_values, s.value) for s in samples),
                          recording.take_readings()))
            time.sleep(0.1)
    finally:
        live.close()
    assert any(key.startswith("pcie_traffic.samples(") for _, readings in ticks
               for _, key, _, _ in readings)
    source = ReplaySource()
    replay = GpuCollector(source, None, pcie_samples_per_second=25)
    for expected, readings in ticks:
        source.load(readings)
        assert sorted((s.spec.name, s.label_values, s.value) for s in replay.collect()) == expected


# --- the error bound, simulated ------------------------------------------------------------------
def sampled_error(duty: float, seed: int, samples_per_second: float | None,
                  seconds: float = 60.0) -> float:
    """Estimated minus true share of a burst rate over one averaging window, on simulated time:
    samples_per_second None reads one window pair per 1 s tick, as the agent did before."""
    rng = random.Random(seed)
    gpu = bursty_gpu(duty, period=rng.uniform(0.1, 1.0), seed=seed)
    fake, clock = simulated_fake([gpu], seed)
    nvml = Nvml(LiveSource(), fake)
    start = clock()
    if samples_per_second is None:
        windows = []
        for tick in range(int(seconds)):
            clock.now = start + tick
            windows.append(nvml.pcie_throughput_bytes_per_second(0)[0])
        estimate, end = sum(windows) / len(windows), start + seconds
    else:
        sampler = ThroughputSampler(lambda: nvml.pcie_throughput_bytes_per_second(0),
                                    samples_per_second, clock=clock, wait=clock.advance, rng=rng)
        while clock() < start + seconds:
            sampler.sample_slot()
        estimate, end = sampler.take()["host_to_device"]["mean_bytes_per_second"], clock()
    burst = BURST_KILOBYTES_PER_SECOND * KIB
    return estimate / burst - pcie_on_seconds(gpu, start, end) / (end - start)


def rms(errors: list[float]) -> float:
    return math.sqrt(sum(e * e for e in errors) / len(errors))


def test_one_window_per_tick_misses_by_about_13_percent_at_half_duty():
    """The issue's figure: 60 windows a minute, sqrt(0.25 / 60) = 6.5 % of the burst rate, 13 %
    of the 50 % mean (somewhat less here: windows across a burst's edge read part of it)."""
    errors = [sampled_error(0.5, seed, None) for seed in range(300)]
    assert 0.09 <= rms(errors) / 0.5 <= 0.15
    assert rms(errors) <= share_standard_error(0.5, 60) * 1.05


@pytest.mark.slow  # real time sampled: seconds per case
@pytest.mark.parametrize("duty", [0.5, 0.9])
def test_sampling_stays_within_the_documented_bound(duty):
    samples_per_second = DEFAULT_SAMPLES_PER_SECOND  # 5 since issue 33: n = 300 in the 1 min window
    bound = share_standard_error(duty, round(60 * samples_per_second))
    errors = [sampled_error(duty, 1000 + seed, samples_per_second) for seed in range(80)]
    assert rms(errors) <= bound
    assert sum(abs(e) <= 2 * bound for e in errors) >= 0.95 * len(errors)
    assert abs(sum(errors) / len(errors)) <= 2 * bound / math.sqrt(len(errors))  # unbiased
    if duty == 0.5:
        old = [sampled_error(duty, seed, None) for seed in range(80)]
        assert rms(errors) < rms(old) / 3


def test_stop_wakes_a_sampler_waiting_for_its_next_moment():
    """A sampler waits for its next sample's moment by a timed lock acquire; stop() must end
    that wait at once (one sample every 20 s here), and a second stop() is harmless."""
    samples = []
    sampler = ThroughputSampler(lambda: samples.append(time.monotonic()) or (1.0, 2.0), 0.05,
                                name="waiting")
    sampler.start()
    time.sleep(0.2)   # waiting now: for the random moment of its 20 s slot, or for the next slot
    asked = time.monotonic()
    sampler.stop(timeout=5.0)
    assert time.monotonic() - asked < 1.0
    assert not sampler._thread.is_alive()
    sampler.stop()
    assert sampler.take()["host_to_device"]["samples"] == len(samples) <= 1


# --- counters that fail whole (issue 29) -----------------------------------------------------------
def method_of(samples, gpu="0") -> list[str]:
    return [s.label_values[-1] for s in samples
            if s.spec is PCIE_TRAFFIC_METHOD and s.label_values[0] == gpu]


def test_counters_failing_whole_give_way_to_gpm_and_come_back_on_a_retry(caplog):
    gpu = default_gpus()[0]
    gpu.gpm_supported, gpu.pcie_byte_counters = True, True  # a Hopper-class GPU with counters
    fake, clock = simulated_fake([gpu], driver_version=COUNTING_DRIVER)
    # nvml.h promises SUCCESS only "if any values were populated": a driver may fail it whole.
    fake.fail("nvmlDeviceGetFieldValues", "NVMLError_InvalidArgument", gpu=0)
    collector = GpuCollector(LiveSource(), fake, clock=clock)
    methods, rates = [], []
    try:
        for tick in range(1, 66):
            clock.now += 1.0
            if tick == 62:
                fake.heal()  # the driver recovers; the next retry (the 63rd read) finds out
            samples = collector.collect()
            methods.append(method_of(samples))
            rates.append(values(samples, PCIE_THROUGHPUT))
    finally:
        collector.close()
    # Two failed reads (a window each); the third gives the counters up and GPM takes over: its
    # first sample has no interval (a window), from the second on NVML's bytes between samples.
    assert methods[:2] == [["sampled"]] * 2
    assert methods[2:62] == [["gpm"]] * 60
    assert fake.calls["nvmlGpmMetricsGet"] == 60 - 1
    assert rates[4] == pytest.approx(1_200_000 * KIB)
    # Given up, the counters were asked only on the retry: 3 failures, then the 63rd read.
    assert methods[62:] == [["counters"]] * 3
    assert fake.calls["nvmlDeviceGetFieldValues"] == 3 + 3
    assert values(samples, PCIE_BYTES) is not None
    assert "gave no PCIe byte counters 3 times in a row" in caplog.text
    assert "answer again" in caplog.text


def test_counters_failing_whole_without_gpm_are_sampled_not_asked_every_tick():
    gpu = default_gpus()[0]
    gpu.pcie_byte_counters = True  # an Ada GPU: no GPM (nvml.h: Hopper and newer)
    fake, clock = simulated_fake([gpu], driver_version=COUNTING_DRIVER)
    fake.fail("nvmlDeviceGetFieldValues", "NVMLError_Unknown", gpu=0)
    collector = GpuCollector(LiveSource(), fake, clock=clock)
    try:
        for _ in range(20):
            clock.now += 1.0
            samples = collector.collect()
    finally:
        collector.close()
    assert method_of(samples) == ["sampled"]
    assert values(samples, PCIE_THROUGHPUT) == 1_200_000 * KIB
    assert fake.calls["nvmlDeviceGetFieldValues"] == 3
    assert fake.calls["nvmlGpmSampleGet"] == 0


def test_gpm_traffic_and_c2c_record_and_replay():
    fake, clock = simulated_fake([grace_hopper_gpu()])
    recording = RecordingSource(LiveSource())
    live = GpuCollector(recording, fake, clock=clock)
    ticks = []
    try:
        for _ in range(4):
            clock.now += 1.0
            samples = live.collect()
            ticks.append((sorted((s.spec.name, s.label_values, s.value) for s in samples),
                          recording.take_readings()))
    finally:
        live.close()
    assert method_of(samples) == ["gpm"]
    assert fake.calls["nvmlGpmSampleGet"] == 4  # one sample a tick serves PCIe and C2C
    assert all(sample.freed for sample in fake.gpm_samples)
    source = ReplaySource()
    replay = GpuCollector(source, None)
    for expected, readings in ticks:
        source.load(readings)
        assert sorted((s.spec.name, s.label_values, s.value) for s in replay.collect()) == expected


# --- the adaptive pace (AdaptivePacing): the bound kept relative to the distance to the threshold --
GEN4_X16 = (4, 16)
LINE_RATE = theoretical_capacity(*GEN4_X16)  # bursts at the link's own rate: the widest spread
NEAR_SHARE = link_pacing(DEFAULT_SAMPLES_PER_SECOND, *GEN4_X16)._near / LINE_RATE  # 0.52 on Gen4


class OnOffTrace:
    """Synthetic on/off traffic at the line rate: on for `duty` of each `period`, from `phase`;
    read_pair answers the 20 ms window at the simulated clock's now, then advances it."""

    def __init__(self, clock: SimClock, duty: float, period: float, phase: float) -> None:
        self.clock, self.duty, self.period, self.phase = clock, duty, period, phase

    def on_seconds(self, start: float, end: float) -> float:
        def on_until(t: float) -> float:  # on-time in [phase, t)
            cycles, into = divmod(t - self.phase, self.period)
            return cycles * self.duty * self.period + min(into, self.duty * self.period)
        return on_until(end) - on_until(start)

    def read_pair(self) -> tuple[float, float]:
        start = self.clock()
        self.clock.advance(0.040)  # two 20 ms windows, as the real pair blocks
        value = LINE_RATE * self.on_seconds(start, start + 0.020) / 0.020
        return value, 0.0


def paced_error(duty: float, seed: int, seconds: float = 60.0) -> tuple[float, float]:
    """(estimated minus true mean over one minute, in units of the line rate; mean pace)."""
    rng = random.Random(seed)
    clock = SimClock(1000.0)
    trace = OnOffTrace(clock, duty, period=rng.uniform(0.1, 3.0), phase=rng.uniform(0, 3))
    sampler = ThroughputSampler(trace.read_pair, DEFAULT_SAMPLES_PER_SECOND,
                                pacing=link_pacing(DEFAULT_SAMPLES_PER_SECOND, *GEN4_X16),
                                clock=clock, wait=clock.advance, rng=rng)
    warm_until = clock() + seconds  # the pace settles on the first minute; the second is judged
    while clock() < warm_until:
        sampler.sample_slot()
    start, estimated = sampler._covered_until, sampler._estimated_bytes[0]
    taken = 0
    while clock() < start + seconds:
        sampler.sample_slot()
        taken += 1
    end = sampler._covered_until
    estimate = (sampler._estimated_bytes[0] - estimated) / (end - start) / LINE_RATE
    return estimate - trace.on_seconds(start, end) / (end - start), taken / (end - start)


@pytest.mark.parametrize("duty", [0.1, 0.3, 0.45, 0.6, 0.95])
def test_the_adaptive_pace_keeps_two_sigma_inside_the_distance_to_the_threshold(duty):
    """On bursty line-rate traffic, 10-95 % duty: the minute's estimate stays within 2 sigma of
    the truth, sigma no larger than what keeps the reading off the threshold's other side (T - m)
    / 2 far from it, and no larger than the full pace's near it; unbiased; and far from the
    threshold it takes fewer samples than the full pace."""
    runs = [paced_error(duty, 7000 + seed) for seed in range(40)]
    errors, paces = [e for e, _ in runs], [p for _, p in runs]
    full_bound = share_standard_error(duty, round(60 * DEFAULT_SAMPLES_PER_SECOND))
    allowed = max(full_bound, (NEAR_SHARE - duty) / 2)
    assert rms(errors) <= allowed
    assert abs(sum(errors) / len(errors)) <= 3 * allowed / math.sqrt(len(errors))  # unbiased
    if duty <= 0.3:
        assert statistics.mean(paces) < DEFAULT_SAMPLES_PER_SECOND / 2  # the saving
    if duty >= NEAR_SHARE:
        assert min(paces) >= DEFAULT_SAMPLES_PER_SECOND * 0.9  # near or past it: the full pace


def test_the_pace_falls_to_the_floor_on_an_idle_link_and_returns_at_once_on_a_burst():
    clock = SimClock(1000.0)
    trace = OnOffTrace(clock, duty=0.0, period=1.0, phase=0.0)
    sampler = ThroughputSampler(trace.read_pair, DEFAULT_SAMPLES_PER_SECOND,
                                pacing=link_pacing(DEFAULT_SAMPLES_PER_SECOND, *GEN4_X16),
                                clock=clock, wait=clock.advance, rng=random.Random(3))
    for _ in range(5):
        sampler.sample_slot()
    assert sampler.samples_per_second == FLOOR_SAMPLES_PER_SECOND
    trace.duty = 1.0  # a copy fills the link from now on
    burst_start = clock()
    while sampler.samples_per_second < DEFAULT_SAMPLES_PER_SECOND:
        sampler.sample_slot()
    assert clock() - burst_start <= 3.5 / FLOOR_SAMPLES_PER_SECOND  # the RECENT_SAMPLES at the floor


def test_an_unknown_link_is_sampled_at_the_full_pace():
    pacing = link_pacing(DEFAULT_SAMPLES_PER_SECOND, None, 16)
    assert pacing.samples_per_second(0.0, (0.0, 0.0)) == DEFAULT_SAMPLES_PER_SECOND


def test_the_pace_reads_the_starvation_alerts_share():
    thresholds = tomllib.loads((REPO / "agent/alerts/thresholds.toml").read_text())
    assert STARVATION_SHARE == thresholds["pcie_starvation"]["traffic_share_of_capacity"]
