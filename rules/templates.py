"""Annotation text written once, rendered two ways.

An annotation is plain text with markers: `<gpu>` is a label of the alert, `<value|humanize>` its
value, `<bound|humanize>` the first sample of a named query run when the alert fires, and
`<if gpu>...<else>...<end>` picks a text by whether the alert has that label, or, where `gpu` names
a query, whether that query found anything (so a clause is left out rather than print "unknown"),
and `<faulting|processes>` lists every series a named query returns, in its order, as `name (pid N,
V/s)` (V humanized; "none" when it returns nothing), and `<shares|gpuShares>` as `GPU 0 (55%)`. `go_template`
turns the markers into Prometheus template code; `expected_text` fills them with the values a
promtool test expects, formatted exactly as Prometheus's template functions format them (ported
from prometheus/template/template.go), so the generated tests check the rules' PromQL and
templates without repeating either.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from functools import lru_cache

MARKER = re.compile(r"<([a-z_]+)(?:\|([A-Za-z0-9]+))?>")
CONDITION = re.compile(r"<if ([a-z_]+)>(.*?)<else>(.*?)<end>", re.S)
_SI_UP = ("k", "M", "G", "T", "P", "E", "Z", "Y")
_SI_DOWN = ("m", "u", "n", "p", "f", "a", "z", "y")
_IEC_UP = ("ki", "Mi", "Gi", "Ti", "Pi", "Ei", "Zi", "Yi")


def _g4(value: float) -> str:
    """Go's fmt %.4g for finite numbers (same rules as C's, which Python follows)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return "%.4g" % value


def humanize(value: float) -> str:
    if value == 0 or not math.isfinite(value):
        return _g4(value)
    prefix = ""
    if abs(value) >= 1:
        for step in _SI_UP:
            if abs(value) < 1000:
                break
            prefix, value = step, value / 1000
    else:
        for step in _SI_DOWN:
            if abs(value) >= 1:
                break
            prefix, value = step, value * 1000
    return _g4(value) + prefix


def humanize1024(value: float) -> str:
    if abs(value) <= 1 or not math.isfinite(value):
        return _g4(value)
    prefix = ""
    for step in _IEC_UP:
        if abs(value) < 1024:
            break
        prefix, value = step, value / 1024
    return _g4(value) + prefix


def humanize_percentage(value: float) -> str:
    return _g4(value * 100) + "%"


def humanize_duration(value: float) -> str:
    if not math.isfinite(value):
        return _g4(value)
    if value == 0:
        return _g4(value) + "s"
    if abs(value) >= 1:
        sign = "-" if value < 0 else ""
        whole = int(abs(value))  # Go's int64() truncates toward zero
        days, hours = whole // 86400, whole // 3600 % 24
        minutes, seconds = whole // 60 % 60, whole % 60
        if days:
            return f"{sign}{days}d {hours}h {minutes}m {seconds}s"
        if hours:
            return f"{sign}{hours}h {minutes}m {seconds}s"
        if minutes:
            return f"{sign}{minutes}m {seconds}s"
        return f"{sign}{_g4(abs(value))}s"
    prefix = ""
    for step in _SI_DOWN:
        if abs(value) >= 1:
            break
        prefix, value = step, value * 1000
    return f"{_g4(value)}{prefix}s"


def go_value(value: float | str) -> str:
    """A label (text) or a query result printed without a format, as Go's %v prints it."""
    if isinstance(value, str):
        return value
    if float(value).is_integer() and abs(value) < 1e6:
        return str(int(value))  # Go's %v switches to 1e+06 notation from a million on
    raise ValueError(f"give the marker for {value!r} a format")


FORMATS: dict[str, Callable[[float], str]] = {
    "humanize": humanize,
    "humanize1024": humanize1024,
    "humanizePercentage": humanize_percentage,
    "humanizeDuration": humanize_duration,
}


# List formats: a query's whole result, not its first sample. Each renders its items one way in
# Go (a `range` over the query's samples) and the same way in Python (a sequence of items).
_PROCESS_ITEM_GO = "{{ $s.Labels.process_name }} (pid {{ $s.Labels.pid }}, {{ $s.Value | humanize }}/s)"
_GPU_SHARE_ITEM_GO = "GPU {{ $s.Labels.gpu }} ({{ $s.Value | humanizePercentage }})"
LIST_ITEMS_GO = {"processes": _PROCESS_ITEM_GO, "gpuShares": _GPU_SHARE_ITEM_GO}
LIST_FORMATS = tuple(LIST_ITEMS_GO)
_EMPTY_LIST = "none"


def process_list(items) -> str:
    """`<name|processes>` filled from (process_name, pid, per-second value) items, as the Go
    template prints the query's samples."""
    if not items:
        return _EMPTY_LIST
    return ", ".join(f"{name} (pid {pid}, {humanize(float(value))}/s)" for name, pid, value in items)


def gpu_share_list(items) -> str:
    """`<name|gpuShares>` filled from (gpu index, ratio) items: "GPU 0 (55%), GPU 1 (45%)"."""
    if not items:
        return _EMPTY_LIST
    return ", ".join(f"GPU {gpu} ({humanize_percentage(float(share))})" for gpu, share in items)


_LIST_FILLERS = {"processes": process_list, "gpuShares": gpu_share_list}


def _query_call(promql: str, label_names: tuple[str, ...]) -> str:
    """Template code that runs `promql` with %q placeholders filled from the alert's labels."""
    arguments = " ".join(f"$labels.{name}" for name in label_names)
    return f"printf `{promql}` {arguments} | query"


def go_template(text: str, queries: Mapping[str, tuple[str, tuple[str, ...]]]) -> str:
    """Prometheus template code for `text`; `queries` maps a marker to (PromQL with %q, labels)."""

    def replace(match: re.Match[str]) -> str:
        name, fmt = match.group(1), match.group(2)
        pipe = f" | {fmt}" if fmt else ""
        if fmt in LIST_FORMATS:
            if name not in queries:
                raise ValueError(f"<{name}|{fmt}> lists a query's samples: give <{name}> a query")
            promql, label_names = queries[name]
            return (f"{{{{ range $i, $s := {_query_call(promql, label_names)} }}}}{{{{ if $i }}}}, "
                    f"{{{{ end }}}}{LIST_ITEMS_GO[fmt]}{{{{ else }}}}{_EMPTY_LIST}{{{{ end }}}}")
        if name == "value":
            return f"{{{{ $value{pipe} }}}}"
        if name in queries:
            promql, label_names = queries[name]
            return (f"{{{{ with {_query_call(promql, label_names)} }}}}"
                    f"{{{{ . | first | value{pipe} }}}}{{{{ else }}}}unknown{{{{ end }}}}")
        if fmt:
            raise ValueError(f"label marker <{name}> takes no format")
        return f"{{{{ $labels.{name} }}}}"

    def condition(match: re.Match[str]) -> str:
        name = match.group(1)
        # An empty query result is false in a Go template, as an empty label is.
        test = _query_call(*queries[name]) if name in queries else f"$labels.{name}"
        return f"{{{{ if {test} }}}}{match.group(2)}{{{{ else }}}}{match.group(3)}{{{{ end }}}}"

    _check_markers(text)
    text = CONDITION.sub(condition, text)
    return MARKER.sub(replace, text)


def expected_text(text: str, values: Mapping[str, float | str | None]) -> str:
    """`text` with its markers filled from `values`, formatted as Prometheus would; None stands for
    a query that found nothing, which the Go template prints as "unknown"."""

    def filled(name: str, fmt: str | None) -> str:
        value = values[name]
        if fmt in LIST_FORMATS:
            return _LIST_FILLERS[fmt](value)
        if value is None:  # a query that returned nothing: the template's {{ else }}
            return "unknown"
        if fmt:
            return FORMATS[fmt](float(value))
        return go_value(value)

    if "<if " in text:
        # A label is there when not empty; a query when it found something, 0 included.
        text = CONDITION.sub(lambda m: m.group(2) if values.get(m.group(1)) not in (None, "") else m.group(3),
                             text)
    _check_markers(text)
    return "".join(piece if isinstance(piece, str) else filled(*piece) for piece in _pieces(text))


@lru_cache(maxsize=1024)
def _pieces(text: str) -> tuple[str | tuple[str, str | None], ...]:
    """`text` cut into its literal parts and its markers, (name, format), in order: the agent fills
    the same few texts at every evaluation, a join of the pieces instead of a regex pass."""
    pieces: list[str | tuple[str, str | None]] = []
    last = 0
    for match in MARKER.finditer(text):
        pieces += [text[last:match.start()], (match.group(1), match.group(2))]
        last = match.end()
    pieces.append(text[last:])
    return tuple(pieces)


def markers(text: str) -> set[str]:
    plain = CONDITION.sub(lambda m: f"{m.group(2)} {m.group(3)}", text)
    return {match.group(1) for match in MARKER.finditer(plain)} | {
        match.group(1) for match in CONDITION.finditer(text)}


@lru_cache(maxsize=1024)
def _check_markers(text: str) -> None:
    """Raises for a format or template code the texts may not hold. Remembered per text (a bad
    one raises every time): the agent fills the same few texts at every evaluation."""
    for match in MARKER.finditer(text):
        if match.group(2) and match.group(2) not in FORMATS and match.group(2) not in LIST_FORMATS:
            raise ValueError(f"unknown format {match.group(2)!r} in {text!r}")
    stray = MARKER.sub("", CONDITION.sub("", text))
    if "{{" in stray or "}}" in stray:
        raise ValueError(f"write markers, not template code: {text!r}")
