"""History's two tiers: every tick for the last full_resolution_seconds, one per coarse step before."""
import math

from hybridmon.agent.loop.history import History
from hybridmon.exporters.base import MetricSpec, Samples

RESIDENT = MetricSpec("hybridmon_test_resident_bytes", "test", "gauge", ("pid",))
UPTIME = MetricSpec("hybridmon_test_uptime_seconds", "test", "gauge", ())


def batch(time: float, pids=("1",)) -> Samples:
    samples = Samples()
    for pid in pids:
        samples.add(RESIDENT, time * 10 + int(pid), pid)
    samples.add(UPTIME, time)
    return samples


def filled(seconds: int, start: float = 1_800_000_000.0, tiers: bool = True, absent=lambda t: False) -> History:
    history = History(7200, 660 if tiers else None, 15.0)
    history.add_collector("process", 1.0)
    for tick in range(seconds):
        at = start + tick
        history.commit("process", at, batch(at, () if absent(tick) else ("1",)))
    return history


def test_old_points_are_one_per_coarse_step_and_recent_ones_every_tick():
    start = 1_800_000_003.0
    history = filled(3600, start)
    newest = start + 3599
    (series,) = history.series(RESIDENT.name, pid="1")
    fine_from = newest - 660  # the fine ring holds 661 ticks
    old = [t for t in series.times if t < fine_from]
    assert old == [start + 15 * k for k in range(len(old))]  # evenly spaced from the first tick
    assert old[-1] + 15 >= fine_from
    assert [t for t in series.times if t >= fine_from] == [fine_from + k for k in range(661)]
    assert list(series.values) == [t * 10 + 1 for t in series.times]


def test_ticks_longer_than_a_third_of_the_step_are_kept_evenly():
    history = History(7200, 660, 15.0)
    history.add_collector("process", 10.0)
    for tick in range(360):  # an hour at 10 s
        history.commit("process", 1_800_000_000.0 + 10 * tick, batch(1_800_000_000.0 + 10 * tick))
    (series,) = history.series(UPTIME.name)
    old = [t for t in series.times if t < series.times[-1] - 660]
    assert {b - a for a, b in zip(old, old[1:])} == {20.0}  # every 2nd tick, not 2 of every 3


def test_a_detector_read_gets_coarse_points_before_coarse_before_and_every_tick_after():
    history = filled(7200)
    now = 1_800_000_000.0 + 7199
    (series,) = history.series(RESIDENT.name, since=now - 3600, coarse_before=now - 600, coarse_seconds=15.0)
    before = [t for t in series.times if t < now - 600]
    after = [t for t in series.times if t >= now - 600]
    assert before[0] >= now - 3600 and {b - a for a, b in zip(before, before[1:])} == {15.0}
    assert len(before) == 3000 / 15
    assert after == [now - 600 + k for k in range(601)]


def test_coarser_reads_thin_the_coarse_tier_further():
    history = filled(7200)
    now = 1_800_000_000.0 + 7199
    (series,) = history.series(RESIDENT.name, since=now - 3600, coarse_before=now - 600, coarse_seconds=60.0)
    before = [t for t in series.times if t < now - 600]
    assert all(b - a >= 60 for a, b in zip(before, before[1:])) and 45 <= len(before) <= 51


def test_the_tiers_hold_the_retention_in_a_seventh_of_the_memory():
    tiered, flat = filled(7200), filled(7200, tiers=False)
    assert flat.value_bytes() == 2 * 8 * 7200
    assert tiered.value_bytes() == 2 * 8 * (661 + 481)
    assert tiered.series_count() == flat.series_count() == 2
    (oldest_tiered,), (oldest_flat,) = tiered.series(UPTIME.name), flat.series(UPTIME.name)
    assert oldest_tiered.times[0] == oldest_flat.times[0]  # the same span, fewer points


def test_a_series_gone_from_the_fine_tier_is_still_read_from_the_coarse_one():
    history = filled(3600, absent=lambda tick: tick >= 1000)  # pid 1 exits after 1000 s
    (series,) = history.series(RESIDENT.name, pid="1")
    assert series.times[-1] < 1_800_000_000.0 + 1000
    assert len(series.times) == math.ceil(1000 / 15)


def test_labelless_metrics_and_absent_ticks_read_as_before():
    history = filled(2000, absent=lambda tick: tick % 2 == 0)
    (uptime,) = history.series(UPTIME.name)
    assert len(uptime.times) == len(set(uptime.times))
    (resident,) = history.series(RESIDENT.name)
    assert all(int(t) % 2 == 1 for t in resident.times)  # only the ticks it was present on
    assert all(v == t * 10 + 1 for t, v in zip(resident.times, resident.values))


def test_bucketed_reads_both_tiers():
    history = filled(3600)
    end = 1_800_000_000.0 + 3599
    (series,) = history.bucketed(UPTIME.name, end - 3600, end, 60)
    assert all(not math.isnan(m) for m in series.means[1:])
    assert series.last_values[-1] == end
    # a gauge rising 1 a second: each minute's mean is its middle, whichever tier it came from
    assert all(abs(mean - (end - 3600 + 60 * k + 30)) <= 8 for k, mean in enumerate(series.means) if k)


def test_slow_collectors_keep_one_tier():
    history = History(7200, 660, 15.0)
    history.add_collector("slow", 30.0)
    history.add_collector("fast", 1.0)
    assert dict(history.capacities()) == {"slow": 240, "fast": 661}
