"""exporters/nvml.py PcieThroughputReader: the PCIe sampler's lean call path (issue 33), over the
fake NVML, and its way back to the full path on any error."""
from __future__ import annotations

import logging

import pytest

from hybridmon.exporters.nvml import GpuLostError, Nvml, PcieThroughputReader
from hybridmon.exporters.pcie_traffic import (DEFAULT_SAMPLES_PER_SECOND, PcieTraffic,
                                              share_standard_error)
from hybridmon.exporters.sources import LiveSource, RecordingSource
from tests.support.fake_nvml import FakeNvml

GPU0_PAIR = (1_200_000 * 1024, 300_000 * 1024)  # the fake's default L40S, KB/s x 1024
THROUGHPUT = "nvmlDeviceGetPcieThroughput"


def reader_over(fake: FakeNvml, source=None) -> PcieThroughputReader:
    return PcieThroughputReader(Nvml(source or LiveSource(), fake), 0)


def test_after_one_full_read_a_sample_is_the_two_calls_alone():
    fake, source = FakeNvml(), RecordingSource()
    reader = reader_over(fake, source)
    assert reader.read_pair() == GPU0_PAIR
    assert reader.lean
    full_path_keys = [reading[1] for reading in source.take_readings()]
    assert full_path_keys[-2:] == ["nvml.nvmlDeviceGetPcieThroughput(0,rx)",
                                   "nvml.nvmlDeviceGetPcieThroughput(0,tx)"]
    calls_before = fake.calls.copy()
    for _ in range(5):
        assert reader.read_pair() == GPU0_PAIR
    assert source.take_readings() == []  # no source, no key, no retry layer on the lean path
    assert fake.calls - calls_before == {THROUGHPUT: 10}  # and no other NVML call either


def test_an_error_mid_run_reads_the_same_sample_through_the_full_path_then_goes_lean_again():
    fake = FakeNvml()
    reader = reader_over(fake)
    reader.read_pair()
    fake.fail(THROUGHPUT, "NVMLError_Timeout", gpu=0, times=1)
    assert reader.read_pair() == GPU0_PAIR  # the lean call failed; the full path's retry answered
    assert reader.fallbacks == 1
    assert reader.lean
    assert reader.read_pair() == GPU0_PAIR
    assert reader.fallbacks == 1


def test_an_error_the_full_path_sees_too_is_absent_and_logged_once(caplog):
    fake = FakeNvml()
    reader = reader_over(fake)
    reader.read_pair()
    fake.fail(THROUGHPUT, "NVMLError_Timeout", gpu=0)
    with caplog.at_level(logging.WARNING, logger="hybridmon.exporters.nvml"):
        assert reader.read_pair() == (None, None)
        assert not reader.lean  # stays on the full path while it fails
        assert reader.read_pair() == (None, None)
    assert reader.fallbacks == 1
    assert len([r for r in caplog.records if "nvmlDeviceGetPcieThroughput failed" in r.getMessage()]) == 1
    fake.heal()
    assert reader.read_pair() == GPU0_PAIR
    assert reader.lean


def test_not_supported_stays_on_the_full_path_and_says_so_once(caplog):
    fake = FakeNvml()
    fake.fail(THROUGHPUT, "NVMLError_NotSupported", gpu=0)
    reader = reader_over(fake)
    with caplog.at_level(logging.INFO, logger="hybridmon.exporters.nvml"):
        for _ in range(3):
            assert reader.read_pair() == (None, None)
    assert not reader.lean and reader.fallbacks == 0
    assert len([r for r in caplog.records if "is not supported" in r.getMessage()]) == 1


def test_a_lost_gpu_raises_as_the_full_path_does_and_a_restored_one_is_read_lean_anew():
    fake = FakeNvml()
    reader = reader_over(fake)
    reader.read_pair()
    handles = fake.calls["nvmlDeviceGetHandleByIndex_v2"]
    fake.lose_gpu(0)
    with pytest.raises(GpuLostError):
        reader.read_pair()
    with pytest.raises(GpuLostError):  # no lean handle is kept for a lost GPU
        reader.read_pair()
    assert reader.fallbacks == 1 and not reader.lean
    fake.restore_gpu(0)
    assert reader.read_pair() == GPU0_PAIR
    assert reader.lean
    assert fake.calls["nvmlDeviceGetHandleByIndex_v2"] > handles  # the loss dropped the old handle
    assert reader.read_pair() == GPU0_PAIR
    assert reader.fallbacks == 1


def test_a_replay_has_nothing_to_call_lean():
    nvml = Nvml(LiveSource(), None)
    assert nvml.pcie_throughput_function(0) is None


def test_the_sampler_threads_read_through_the_lean_path():
    fake = FakeNvml()
    sampler_gate = Nvml(LiveSource(), fake)
    traffic = PcieTraffic(Nvml(LiveSource(), fake), LiveSource(), sampler_gate, samples_per_second=25)
    try:
        sampler = traffic._sampler(0)
        assert sampler._read_pair() == GPU0_PAIR
        # The thread's own samples and the one above: after the first, no source.call at all;
        # besides them the gate read the link's maximum generation and width once, for the pace.
        assert sampler_gate._keys == {(THROUGHPUT, 0, ("rx",)): "nvml.nvmlDeviceGetPcieThroughput(0,rx)",
                                      (THROUGHPUT, 0, ("tx",)): "nvml.nvmlDeviceGetPcieThroughput(0,tx)",
                                      ("nvmlDeviceGetMaxPcieLinkGeneration", 0, ()):
                                          "nvml.nvmlDeviceGetMaxPcieLinkGeneration(0)",
                                      ("nvmlDeviceGetMaxPcieLinkWidth", 0, ()): "nvml.nvmlDeviceGetMaxPcieLinkWidth(0)"}
    finally:
        traffic.close()


def test_the_default_rate_keeps_the_starvation_margin():
    """DEFAULT_SAMPLES_PER_SECOND's bound: at d = 0.9 the 1 min reading's 2 sigma stays inside the
    4 % of capacity between the alert's 0.90 and traffic clearly under it, 0.86 (thresholds.toml)."""
    two_sigma = 2 * share_standard_error(0.9, round(60 * DEFAULT_SAMPLES_PER_SECOND))
    assert two_sigma < 0.90 - 0.86
    assert 2 * share_standard_error(0.9, round(60 * 3.5)) > 0.90 - 0.86  # the least rate, not slack


class ScriptedSampler:
    """Stands in for a GPU's ThroughputSampler: each take() answers the next scripted summary."""

    def __init__(self, takes: list[dict]) -> None:
        self.takes = takes

    def take(self) -> dict:
        return self.takes.pop(0)

    def stop(self) -> None:
        pass


def summary(samples: int, host_to_device: float | None, device_to_host: float | None) -> dict:
    return {"host_to_device": {"samples": samples, "mean_bytes_per_second": host_to_device,
                               "estimated_bytes": 0.0},
            "device_to_host": {"samples": samples, "mean_bytes_per_second": device_to_host,
                               "estimated_bytes": 0.0}}


def test_a_tick_without_a_sample_holds_the_last_mean_instead_of_blocking_on_a_window():
    """At the floor pace (1 a second) a 1 s tick finds no new sample now and then: the gauge holds
    the last mean, and the collector does not block 40 ms on a window pair for it. Only before the
    first sample is a window read."""
    fake = FakeNvml()
    traffic = PcieTraffic(Nvml(LiveSource(), fake), LiveSource(), Nvml(LiveSource(), fake))
    traffic._samplers[0] = ScriptedSampler([summary(0, None, None), summary(2, 5.0, 7.0),
                                            summary(0, None, None)])
    first = traffic._from_samples(0)
    assert (first.method, first.bytes_per_second) == ("window", GPU0_PAIR)
    windows = fake.calls["nvmlDeviceGetPcieThroughput"]
    assert traffic._from_samples(0).bytes_per_second == (5.0, 7.0)
    held = traffic._from_samples(0)
    assert (held.method, held.bytes_per_second) == ("samples", (5.0, 7.0))
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == windows  # no window since the first
