"""The two window computations an hour-long trend repeats most, done over numpy arrays: the
median of pairwise slopes (Theil-Sen) and per-minute counter rates (a `rate(x[1m])[1h:1m]`
subquery). Each gives bit for bit the float that windows.py's pure-Python definition gives: the
same IEEE operations on the same operands in the same order (numpy does not fuse a multiply and
an add; `cumsum` adds left to right, as `functools.reduce` does), only in C. That is what lets
memory_growth judge 16 processes' hour-long windows in a few milliseconds without changing what
it finds, or when (tests/agent/test_detectors_windows.py compares the two paths).

numpy is imported by the first caller: a host where nothing trends never loads it (~15 MB).
"""
from __future__ import annotations

from array import array
from functools import lru_cache
from typing import Sequence

# A rate step's window of 1 s samples holds ~61 points; past this many cells (steps x the widest
# window) the padded array costs more memory than the loop it replaces saves time.
MAX_CELLS = 1_000_000


def theil_sen_median(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The median of (ys[j] - ys[i]) / (xs[j] - xs[i]) over every pair i < j; xs strictly rise."""
    return theil_sen_medians(xs, [ys])[0]


def theil_sen_medians(xs: Sequence[float], rows: Sequence[Sequence[float]]) -> list[float]:
    """theil_sen_median(xs, ys) for each ys of `rows`, all at the same times xs (strictly rising):
    the pairs' time differences taken once, then each row's slopes and median in one-dimensional
    array operations (the same divisions, the same order statistic). Row by row, not one 2-D
    pass: 16 rows of 150 points are 1.4 MB of slopes, past the size glibc serves from the heap,
    and the fresh pages of each such temporary made that pass twice as slow as these."""
    import numpy

    first, second = _pair_indices(len(xs))
    x = _floats(numpy, xs)
    spans = x[second] - x[first]
    middle = len(first) // 2
    medians: list[float] = []
    for ys in rows:
        y = _floats(numpy, ys)
        with numpy.errstate(all="ignore"):   # an infinite figure gives NaN slopes, as in Python
            slopes = (y[second] - y[first]) / spans
        if len(first) % 2:
            medians.append(float(numpy.partition(slopes, middle)[middle]))
            continue
        lower, upper = numpy.partition(slopes, (middle - 1, middle))[middle - 1:middle + 1]
        medians.append((float(lower) + float(upper)) / 2)
    return medians


@lru_cache(maxsize=8)
def _pair_indices(count: int):
    """Both indices of every pair i < j of `count` points."""
    import numpy

    return numpy.triu_indices(count, 1)


def rate_steps(times: Sequence[float], counters: Sequence[Sequence[float]], steps: Sequence[float],
               seconds: float) -> tuple[list[float], list[list[float]]] | None:
    """windows.rate_steps of each of `counters`, all sampled at `times` (rising), at the given
    step times: for each step `at`, a counter's increase over the points in [at - seconds, at] (a
    drop counts as a reset to 0), extrapolated as windows._rate_in does. Steps with fewer than
    two points at distinct times are left out (the same for every counter: they share times).
    Returns the steps kept and each counter's rates; None where the arrays would be too large
    (the caller loops instead)."""
    import numpy

    t = _floats(numpy, times)
    v = numpy.stack([_floats(numpy, values) for values in counters])   # one row per counter
    at = numpy.asarray(steps, dtype=numpy.float64)
    first = numpy.searchsorted(t, at - seconds, side="left")
    last = numpy.searchsorted(t, at, side="right")
    count = last - first
    usable = count >= 2
    usable[usable] &= t[last[usable] - 1] > t[first[usable]]
    if not usable.any():
        return [], [[] for _ in counters]
    first, last, count, at = first[usable], last[usable], count[usable], at[usable]
    width = int(count.max()) - 1
    if width * len(at) * len(counters) > MAX_CELLS:
        return None
    with numpy.errstate(all="ignore"):
        # counter_increase's terms: the rise to each reading, or the reading itself after a reset
        rises = numpy.where(v[:, 1:] >= v[:, :-1], v[:, 1:] - v[:, :-1], v[:, 1:])
        increase = _increases(numpy, rises, first, count)
        rate = _extrapolated(numpy, increase, t[first], t[last - 1], count, v[:, first], at, seconds)
    kept = numpy.flatnonzero(usable).tolist()
    return [steps[i] for i in kept], rate.tolist()


def _increases(numpy, rises, first, count):
    """Each step's increase: its count - 1 rises from `first`, added left to right (a row of
    them, zeros after its last, summed by cumsum). Rows are padded to the longest of their group,
    and the steps go in two groups: a minute of the coarse tier (~5 points) beside a minute of
    every tick (~61) would otherwise be padded twelvefold (an hour's steps are mostly coarse)."""
    increase = numpy.empty((rises.shape[0], len(first)))
    short = count <= max(3, (int(count.max()) + 3) // 4)
    for group in (short, ~short):
        if not group.any():
            continue
        steps, counted = first[group], count[group]
        offsets = numpy.arange(int(counted.max()) - 1)
        cells = numpy.minimum(steps[:, None] + offsets, rises.shape[1] - 1)
        rows = numpy.where(offsets < (counted - 1)[:, None], rises[:, cells], 0.0)
        increase[:, group] = numpy.cumsum(rows, axis=2)[:, numpy.arange(len(steps)), counted - 2]
    return increase


def _floats(numpy, figures: Sequence[float]):
    """`figures` as a float64 array: History's array('d') read in place (a list copied), for
    this call only: an array exporting its buffer cannot grow, so none is kept."""
    if isinstance(figures, array) and figures.typecode == "d":
        return numpy.frombuffer(figures, dtype=numpy.float64)
    return numpy.asarray(figures, dtype=numpy.float64)


def _extrapolated(numpy, increase, first_time, last_time, count, first_value, at, seconds: float):
    """windows._rate_in's extrapolation, element by element, in its order of operations."""
    sampled = last_time - first_time
    average_step = sampled / (count - 1)
    to_start = first_time - (at - seconds)
    to_end = at - last_time
    # a counter cannot have been below zero: don't extrapolate past where it would be 0
    to_zero = sampled * first_value / increase
    to_start = numpy.where((increase > 0) & (first_value >= 0) & (to_zero < to_start), to_zero, to_start)
    threshold = average_step * 1.1
    covered = sampled + numpy.where(to_start < threshold, to_start, average_step / 2)
    covered = covered + numpy.where(to_end < threshold, to_end, average_step / 2)
    return increase * (covered / sampled) / seconds
