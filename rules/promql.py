"""PromQL building blocks shared by the rules and their tests: per-generation tables, durations,
selectors, robust slopes (the PCIe tables themselves are hybridmon.pcie_rates)."""
from __future__ import annotations



TARGET = ("job", "instance")  # the labels every scraped series carries; host-level joins use them
SLOPE_NOTE = "# bytes/s: median of the local least-squares slopes over the window (robust to one jump)\n"


def by_generation(generation_metric: str, table: dict[int, tuple[str, str]], indent: str) -> str:
    """A vector holding, per series of `generation_metric`, the table's value for its generation.

    `(x == 4) * 0 + 1969.2e6` keeps the series (and its labels) whose generation is 4 and replaces
    its value; `or` stacks the generations, which are disjoint.
    """
    width = max(len(f"({generation_metric} == {g}) * 0 + {v}") for g, (v, _) in table.items())
    lines = []
    for number, (generation, (value, why)) in enumerate(sorted(table.items())):
        term = f"({generation_metric} == {generation}) * 0 + {value}"
        lead = "  " if number == 0 else "or"
        lines.append(f"{indent}{lead} {term.ljust(width)}  # Gen{generation}: {why}")
    return "\n".join(lines)


def rate_name(counter: str) -> str:
    """A counter's name inside the name of a recording rule of its rate (level:metric:operation):
    without `_total`, as Prometheus's naming convention has it."""
    return counter.removesuffix("_total")


def duration(seconds: float) -> str:
    """A Prometheus duration in the largest unit that divides it: 120 -> 2m, 3600 -> 1h."""
    milliseconds = round(seconds * 1000)
    if milliseconds < 0 or abs(milliseconds - seconds * 1000) > 1e-6:
        raise ValueError(f"{seconds} s is not a whole number of milliseconds")
    if milliseconds == 0:
        return "0s"
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if milliseconds % size == 0:
            return f"{milliseconds // size}{unit}"
    return f"{milliseconds}ms"


def number(value: float) -> str:
    """A PromQL literal for a threshold: integers without a fraction, others in shortest form."""
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def selector(metric: str, *label_names: str, **fixed: str) -> tuple[str, tuple[str, ...]]:
    """`metric{job=%q,instance=%q,<label>=%q,...,<fixed>}` for a template query, and its labels."""
    names = TARGET + label_names
    matchers = [f"{name}=%q" for name in names] + [f'{name}="{value}"' for name, value in fixed.items()]
    return f"{metric}{{{','.join(matchers)}}}", names


def query(template: str, metric: str, *label_names: str, **fixed: str) -> tuple[str, tuple[str, ...]]:
    """A template query: `template` with `{}` standing for the selector of `metric`."""
    chosen, names = selector(metric, *label_names, **fixed)
    return template.replace("{}", chosen), names


def indent(text: str, spaces: int) -> str:
    pad = " " * spaces
    return "\n".join(pad + line if line else line for line in text.splitlines())


def robust_slope(series: str, window_seconds: float) -> str:
    """Per-second slope of `series` over the window: the median of its 1-minute-spaced local
    least-squares slopes, each over a sixth of the window.

    A plain `deriv()` over the window is pulled up by one jump (a model load, a cache warm-up)
    for as long as the jump stays in the window; the median of local slopes ignores it unless the
    jump lasts a large part of the window. It is the PromQL stand-in for the agent's Theil-Sen
    slope: both agree on steady growth and both ignore a single step.
    """
    local = duration(window_seconds / 6)
    return f"quantile_over_time(0.5, deriv({series}[{local}])[{duration(window_seconds)}:1m])"


def data_spans(series: str, window_seconds: float, at_least_seconds: float) -> str:
    """True where `series` has a sample at least `at_least_seconds` old within the window."""
    span = duration(max(window_seconds - at_least_seconds, 60))
    return f"present_over_time({series}[{span}] offset {duration(at_least_seconds)})"


def gpu_query(template: str, metric: str) -> tuple[str, tuple[str, ...]]:
    """query() for the GPU of the alert (label gpu)."""
    return query(template, metric, "gpu")
