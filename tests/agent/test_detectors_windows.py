import math
import random
from array import array

import pytest

from hybridmon.agent.detectors import windows
from hybridmon.agent.loop.history import SeriesHistory


def series(times, values, **labels):
    return SeriesHistory("hybridmon_test", labels, list(map(float, times)), list(map(float, values)))


def test_window_is_closed_at_both_ends_and_ignores_the_future():
    s = series(range(100, 111), range(11))
    times, values = windows.window(s, now=105, seconds=3)
    assert times == [102.0, 103.0, 104.0, 105.0] and values == [2.0, 3.0, 4.0, 5.0]


def test_avg_over_time_uses_the_last_minute_only():
    s = series(range(0, 121), [100.0] * 60 + [0.0] * 61)
    assert windows.avg_over_time(s, now=120) == 0.0
    assert windows.avg_over_time(s, now=89) == pytest.approx(31 * 100.0 / 61)  # t=29..59 at 100, 60..89 at 0
    assert windows.avg_over_time(s, now=500) is None


def test_latest_is_absent_once_older_than_the_lookback():
    s = series([0, 10, 20], [1, 2, 3])
    assert windows.latest(s, now=25) == 3.0
    assert windows.latest(s, now=15) == 2.0
    assert windows.latest(s, now=81) is None


def test_rate_is_increase_over_the_sampled_span():
    s = series(range(0, 61), [10 * t for t in range(61)])
    assert windows.rate(s, now=60) == pytest.approx(10.0)


def test_rate_counts_a_drop_as_a_restart_from_zero():
    # 0..30 at +5/s, restart, then 0..145 at +5/s: increase 150 + 145 over 59 s
    values = [5 * t for t in range(31)] + [5 * t for t in range(30)]
    s = series(range(0, 61), values)
    assert windows.rate(s, now=60, seconds=60) == pytest.approx((150 + 0 + 145) / 60)


def test_rate_needs_two_points_in_the_window():
    s = series([0, 100], [0, 1000])
    assert windows.rate(s, now=100, seconds=60) is None
    assert windows.rate(s, now=100, seconds=100) == pytest.approx(10.0)
    assert windows.increase(series([5], [3]), now=5, seconds=60) is None


def test_rate_is_prometheus_rate_over_the_whole_window():
    # Window [-19, 41]: the counter starts at 0 at t=0, so nothing is extrapolated before it
    # (PromQL's rate() stops at the counter's zero), and the increase spreads over 60 s.
    s = series([0, 1, 2, 40, 41], [0, 2, 4, 80, 82])
    assert windows.rate(s, now=41) == pytest.approx(82 / 60)
    # Samples covering the window: extrapolated to its edges, as Prometheus does.
    full = series(range(100, 161, 15), [1000 + 10 * (t - 100) for t in range(100, 161, 15)])
    assert windows.rate(full, now=160, seconds=60) == pytest.approx(10.0)
    # History shorter than the window (a 5 min window on 60 s of data) is not stretched over it.
    short = series(range(0, 61, 15), [100, 100, 100, 101, 102])
    assert windows.rate(short, now=60, seconds=300) == pytest.approx(2 * (60 + 7.5) / 60 / 300)


def test_rate_steps_is_a_minute_by_minute_rate():
    s = series(range(0, 601), [t * t / 100 for t in range(601)])
    times, rates = windows.rate_steps(s, 0, 600)
    assert times == [60.0 * k for k in range(1, 11)]
    assert rates[0] < rates[-1]
    assert rates[-1] == pytest.approx((600**2 - 540**2) / 100 / 60)


def test_theil_sen_ignores_outliers_that_tilt_least_squares():
    times = list(range(100))
    values = [2.0 * t + 5 for t in times]
    for spike in (10, 40, 70, 95):
        values[spike] = 10_000.0
    assert windows.theil_sen_slope(times, values) == pytest.approx(2.0)


def test_theil_sen_subsamples_long_series_deterministically():
    rng = random.Random(7)
    times = list(range(5000))
    values = [0.5 * t + rng.gauss(0, 3) for t in times]
    first = windows.theil_sen_slope(times, values, max_points=120)
    assert first == windows.theil_sen_slope(times, values, max_points=120)
    assert first == pytest.approx(0.5, rel=0.02)
    assert windows.evenly(5000, 120)[0] == 0 and windows.evenly(5000, 120)[-1] == 4999
    assert len(windows.evenly(5000, 120)) == 120


def pure_python_theil_sen(times, values, max_points):
    """The definition, slope by slope: the median of every pair's slope over the picked points."""
    picked = windows.evenly(len(times), max_points)
    xs, ys = [float(times[i]) for i in picked], [float(values[i]) for i in picked]
    slopes = sorted((ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs)))
    middle = len(slopes) // 2
    return slopes[middle] if len(slopes) % 2 else (slopes[middle - 1] + slopes[middle]) / 2


@pytest.mark.parametrize("count", [windows.NUMPY_PAIRS_FROM - 1, windows.NUMPY_PAIRS_FROM, 57, 150, 151, 3600])
def test_theil_sen_is_bit_for_bit_the_definition_on_either_path(count):
    """Long trends go to numpy; its slopes and median must be the very floats of the definition,
    odd and even pair counts alike (a forecast is printed to the minute from them)."""
    rng = random.Random(count)
    for start, scale in ((1_800_000_000.0, 1e9), (0.0, 3.0), (12_345.678, 1e12)):
        times = sorted({start + rng.random() * 7200 for _ in range(count)})
        values = [scale * (1 + rng.random()) + 0.1 * t for t in times]
        assert windows.theil_sen_slope(times, values, 150) == pure_python_theil_sen(times, values, 150)


def test_theil_sen_slopes_of_many_trends_are_each_ones_own_slope():
    """memory_growth works out every process's slope in one call: trends on the same ticks share
    their pairs' time differences, the rest (other times, too few points, a repeated time, NaN and
    infinite figures) go their own way; each figure must be the one theil_sen_slope gives alone."""
    rng = random.Random(17)
    ticks = [1_800_000_000.0 + 15 * i for i in range(800)]
    trends = [(ticks, [9e9 + rng.random() * 2e9 + 1e5 * i for i in range(800)]) for _ in range(5)]
    trends.append((ticks[:500], [rng.random() for _ in range(500)]))            # a shorter window
    trends.append((ticks[:30], [rng.random() for _ in range(30)]))              # pure Python
    trends.append(([0.0, 1.0, 1.0] + ticks[:60], [1.0, 2.0, 3.0] + [float(i) for i in range(60)]))
    trends.append((ticks, [math.nan] + [float(i) for i in range(799)]))
    trends.append((ticks, [math.inf] + [float(i) for i in range(799)]))
    trends.append(([5.0], [1.0]))                                              # no pair: None
    got = windows.theil_sen_slopes(trends, 150)
    assert [repr(slope) for slope in got] == [repr(windows.theil_sen_slope(t, v, 150)) for t, v in trends]
    assert got[-1] is None and windows.theil_sen_slopes([], 150) == []


def rate_steps_by_definition(one, start, end):
    """rate() at each step of step_times, window by window, as PromQL evaluates a subquery."""
    found = [(at, windows.rate(one, at, 60.0)) for at in windows.step_times(start, end)]
    return [at for at, value in found if value is not None], [value for _, value in found if value is not None]


def test_rate_steps_is_bit_for_bit_rate_at_each_step():
    """An hour of per-minute rates goes to numpy (windows.NUMPY_STEPS_FROM steps or more): the
    same floats as rate() step by step, whatever the counter does: resets, a NaN, a negative first
    reading, repeated times, gaps longer than a step, History's arrays or plain lists."""
    rng = random.Random(17)
    start = 1_800_000_000.0
    for trial in range(300):
        times = sorted({start + rng.random() * 3600 for _ in range(rng.randint(0, 900))})
        if trial % 7 == 0 and len(times) > 3:
            times[2] = times[1]
        if trial % 5 == 0:
            times = [t for t in times if not start + 1200 < t < start + 1500]
        counter, values = rng.random() * 1e6, []
        for _ in times:
            counter = rng.random() * 10 if rng.random() < 0.01 else counter + rng.random() * rng.choice([0, 1, 1e3])
            values.append(counter)
        if trial % 11 == 0 and values:
            values[rng.randrange(len(values))] = math.nan
        if trial % 13 == 0 and values:
            values[0] = -5.0
        one = series(times, values) if trial % 2 else SeriesHistory("hybridmon_test", {}, array("d", times), array("d", values))
        got, expected = windows.rate_steps(one, start, start + 3600), rate_steps_by_definition(one, start, start + 3600)
        assert got[0] == expected[0]
        assert [repr(v) for v in got[1]] == [repr(v) for v in expected[1]]


def test_rate_steps_of_counters_sampled_together_is_rate_steps_of_each():
    """A process's CPU time and page faults share their times and are worked out in one pass;
    a series at other times on its own. Each gets exactly rate_steps' figures, in input order."""
    rng = random.Random(5)
    start = 1_800_000_000.0
    times = array("d", sorted({start + rng.random() * 3600 for _ in range(700)}))
    counters = []
    for _ in range(3):
        total, values = 0.0, array("d")
        for _ in times:
            total = 0.0 if rng.random() < 0.005 else total + rng.random() * 50
            values.append(total)
        counters.append(SeriesHistory("hybridmon_test", {}, times, values))
    apart = series([start + 7 * k for k in range(500)], [3.0 * k for k in range(500)])
    copied = SeriesHistory("hybridmon_test", {}, array("d", times), counters[0].values)   # equal, not the same
    mixed = [counters[0], apart, counters[1], copied, counters[2]]
    assert windows.rate_steps_of(mixed, start, start + 3600) == [
        windows.rate_steps(one, start, start + 3600) for one in mixed]


def test_rate_steps_of_more_counters_than_one_pass_takes_is_rate_steps_of_each():
    """Memory growth rates every growing process's counters together: past ROWS_PER_PASS they
    go in several passes, and each still gets exactly rate_steps' figures."""
    rng = random.Random(6)
    start = 1_800_000_000.0
    times = array("d", (start + k for k in range(0, 3600, 3)))
    counters = []
    for _ in range(windows.ROWS_PER_PASS * 2 + 5):
        total, values = 0.0, array("d")
        for _ in times:
            total += rng.random() * 9
            values.append(total)
        counters.append(SeriesHistory("hybridmon_test", {}, times, values))
    assert windows.rate_steps_of(counters, start, start + 3600) == [
        windows.rate_steps(one, start, start + 3600) for one in counters]


def test_theil_sen_needs_two_distinct_times():
    assert windows.theil_sen_slope([1.0], [1.0]) is None
    assert windows.theil_sen_slope([1.0, 1.0], [1.0, 5.0]) is None


def test_seconds_until_a_limit():
    assert windows.seconds_until(10, 2, 30) == 10
    assert windows.seconds_until(30, 2, 30) == 0
    assert windows.seconds_until(10, 0, 30) == math.inf
    assert windows.seconds_until(10, -1, 30) == math.inf


def test_first_of_latest_run_finds_a_restart_under_the_same_pid():
    s = series(range(10), [500.0] * 6 + [900.0] * 4)
    assert windows.first_of_latest_run(s, now=9) == 6.0
    assert windows.first_of_latest_run(s, now=4) == 0.0
    assert windows.first_of_latest_run(series([], []), now=4) is None


def test_grouping_and_summing_by_entity():
    a = series([0, 1, 2], [1, 1, 1], gpu="0", pid="7")
    b = series([1, 2], [10, 10], gpu="1", pid="7")
    c = series([0], [5], gpu="0", pid="8")
    groups = windows.group_by([a, b, c], "pid")
    assert set(groups) == {("7",), ("8",)} and len(groups[("7",)]) == 2
    assert windows.summed(groups[("7",)]) == ([0.0, 1.0, 2.0], [1.0, 11.0, 11.0])
    assert windows.by_labels([a, b, c], "gpu", "pid")[("1", "7")] is b


# Issue 17: the faster paths must give exactly what the plain loops gave. The loops, as they were:

def looped_counter_increase(values):
    total = 0.0
    for previous, current in zip(values, values[1:]):
        total += current - previous if current >= previous else current
    return total


def walked_first_of_latest_run(s, now, tolerance=0.5):
    end = sum(1 for t in s.times if t <= now)
    if end == 0:
        return None
    first = end - 1
    while first > 0 and abs(s.values[first - 1] - s.values[end - 1]) <= tolerance:
        first -= 1
    return s.times[first]


def summed_by_time(parts):
    totals = {}
    for one in parts:
        for time, value in zip(one.times, one.values):
            totals[time] = totals.get(time, 0.0) + value
    times = sorted(totals)
    return times, [totals[t] for t in times]


def test_counter_increase_is_the_loops_to_the_last_bit():
    rng = random.Random(17)
    for _ in range(3000):
        values = [rng.choice([0.0, 0.01 * rng.randint(0, 10**6), rng.random() * 1e12, float(2**60)])
                  for _ in range(rng.randint(0, 40))]
        if rng.random() < 0.7:
            values.sort()   # no reset: the fast path
        assert repr(windows.counter_increase(values)) == repr(looped_counter_increase(values))


def test_first_of_latest_run_skips_long_runs_and_finds_the_same_start():
    rng = random.Random(5)
    for _ in range(300):
        count = rng.randint(1, 700)
        change = rng.randint(0, count)
        values = [1000.0] * change + [1000.0 + rng.choice([0.3, 0.6, 5.0, -0.6])] * (count - change)
        if rng.random() < 0.3 and count > 2:
            values[rng.randrange(count)] += rng.choice([0.4, -0.7])   # jitter inside a run
        s = series(range(count), values)
        now = rng.randint(0, count)
        assert windows.first_of_latest_run(s, now) == walked_first_of_latest_run(s, now)


def test_summed_series_on_the_same_ticks_add_as_the_general_case():
    rng = random.Random(9)
    times = [float(t) for t in range(200)]
    parts = [SeriesHistory("hybridmon_test", {"gpu": str(g)}, list(times),
                           [rng.random() * 1e10 for _ in times]) for g in range(3)]
    assert windows.summed(parts) == summed_by_time(parts)
    parts[1] = SeriesHistory("hybridmon_test", {"gpu": "1"}, times[::2], parts[1].values[::2])
    assert windows.summed(parts) == summed_by_time(parts)


def test_summed_arrays_read_apart_add_as_the_general_case():
    """Issue 17: two metrics of one collector (VmLck and VmPin) are read into two times arrays that
    hold the same floats; they take the point-by-point path, compared by their bytes, and give
    what the general case gives. Times that do not rise take the general case, sorted."""
    rng = random.Random(4)
    times = array("d", (1.8e9 + t for t in range(0, 3600, 15)))
    parts = [SeriesHistory("hybridmon_test", {"metric": name}, array("d", times),
                           array("d", (rng.random() * 1e9 for _ in times))) for name in ("a", "b")]
    found_times, found_values = windows.summed(parts)
    assert found_times is parts[0].times   # not copied
    assert (list(found_times), found_values) == summed_by_time(parts)
    falling = [SeriesHistory("hybridmon_test", {}, [3.0, 1.0, 2.0], [1.0, 2.0, 3.0])] * 2
    assert windows.summed(falling) == ([1.0, 2.0, 3.0], [4.0, 6.0, 2.0])


def test_theil_sen_below_without_the_count_decides_only_at_a_glance():
    """count_pairs=False: True only where the first glance (the whole range rises slower than
    the limit over the closest two times) rules the slope out; False where the count would be
    needed, whatever it would say."""
    flat = series(range(0, 3600, 10), [8e9 + (t % 20) for t in range(0, 3600, 10)])
    assert windows.theil_sen_below(flat.times, flat.values, 10.0, windows.LONG_TREND_POINTS, count_pairs=False)
    spiky = series(range(0, 1000, 10), [8e9 + (4e9 if t == 500 else 0.0) for t in range(0, 1000, 10)])
    assert windows.theil_sen_below(spiky.times, spiky.values, 10.0, windows.LONG_TREND_POINTS)
    assert not windows.theil_sen_below(spiky.times, spiky.values, 10.0, windows.LONG_TREND_POINTS,
                                       count_pairs=False)


def test_theil_sen_below_is_never_wrong_and_rules_out_flat_series():
    """theil_sen_below spares the n^2/2 slopes of memory that does not grow: when it says the
    slope is below a limit, theil_sen_slope must agree, on noisy, stepped and exact lines alike."""
    rng = random.Random(23)
    said_below = 0
    for _ in range(1500):
        origin = rng.choice([0.0, 1.8e9, 1.7e9 + 0.37])
        times = sorted({origin + rng.randint(0, 4000) * rng.choice([1, 10, 0.1])
                        for _ in range(rng.randint(0, 60))})
        slope = rng.choice([0.0, 1e3, -1e3, 3e4, 1e-3])
        noise = rng.choice([0.0, 1e5])
        values = [1e10 + slope * (t - origin) + rng.gauss(0, noise) for t in times]
        if times and rng.random() < 0.2:
            values[rng.randrange(len(values))] += 4e9   # a model load
        exact = windows.theil_sen_slope(times, values, 40)
        limit = rng.uniform(-5e4, 5e4)
        if exact is not None and rng.random() < 0.4:
            limit = rng.choice([exact, math.nextafter(exact, math.inf), math.nextafter(exact, -math.inf)])
        if windows.theil_sen_below(times, values, limit, 40):
            said_below += 1
            assert exact is None or exact < limit
    assert said_below > 200
    flat = series(range(0, 3600, 10), [8e9] * 360)
    assert windows.theil_sen_below(flat.times, flat.values, 1.0, windows.LONG_TREND_POINTS)
    growing = series(range(0, 3600, 10), [8e9 + 100.0 * t for t in range(0, 3600, 10)])
    assert not windows.theil_sen_below(growing.times, growing.values, 99.0, windows.LONG_TREND_POINTS)
