"""Inline SVG sparklines for the status page (agent/status/page.py): the last hour of a few series,
the related alert's threshold as a dashed line, a capacity as a solid one, and the spans in which
the alert fired shaded.

Pure functions from numbers to markup: the data comes from agent/status/trends.py. No scripts, no
fonts, no external files (template.py's rule). The drawing has a fixed viewBox stretched to
the card's width (preserveAspectRatio="none", strokes kept at 1.5 px by vector-effect), so it
fits a 390 px phone and a desktop card alike; every word (title, legend, values) is HTML beside
the drawing, not SVG text, so it stays readable and unstretched at any width.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Literal, Sequence

from hybridmon.agent.status.template import esc

VIEW_WIDTH, VIEW_HEIGHT = 300.0, 60.0
LINE_COLOURS = ("#1565c0", "#8e24aa", "#00897b", "#ef6c00")  # one per line, in order
THRESHOLD_COLOUR, CAPACITY_COLOUR, FIRING_FILL = "#c62828", "#757575", "#c6282833"


@dataclass(frozen=True)
class Line:
    """One series: values at times (seconds since the epoch), NaN where it was absent."""

    label: str
    times: Sequence[float]
    values: Sequence[float]


@dataclass(frozen=True)
class Reference:
    """A horizontal line: an alert's threshold (dashed) or what the resource holds (solid)."""

    label: str
    value: float
    kind: Literal["threshold", "capacity"]


Window = tuple[float, float]  # (start, end) in seconds since the epoch


def sparkline(title: str, start: float, end: float, lines: Sequence[Line], show: Callable[[float], str],
              references: Sequence[Reference] = (), windows: Iterable[Window] = (),
              firing_label: str = "") -> str:
    """A <figure> with the plot of `lines` over [start, end] and a legend; `show` formats a value
    (e.g. units.human_rate). Empty string when no line has a point: no empty box on the page."""
    finite = [v for line in lines for v in line.values if math.isfinite(v)]
    if not finite or end <= start:
        return ""
    top = max(finite + [r.value for r in references if math.isfinite(r.value)])
    top = top * 1.08 if top > 0 else 1.0

    def x(at: float) -> float:
        return (min(max(at, start), end) - start) / (end - start) * VIEW_WIDTH

    def y(value: float) -> float:
        return VIEW_HEIGHT - max(value, 0.0) / top * (VIEW_HEIGHT - 2)

    shapes = []
    spans = [(max(a, start), min(b, end)) for a, b in windows if b >= start and a <= end]
    for a, b in spans:  # under the lines
        shapes.append(f'<rect class="firing" x="{x(a):.1f}" y="0" width="{max(x(b) - x(a), 1.0):.1f}" '
                      f'height="{VIEW_HEIGHT:.0f}" fill="{FIRING_FILL}"/>')
    for reference in references:
        if not math.isfinite(reference.value):
            continue
        dash = ' stroke-dasharray="6 4"' if reference.kind == "threshold" else ""
        colour = THRESHOLD_COLOUR if reference.kind == "threshold" else CAPACITY_COLOUR
        shapes.append(f'<line class="{reference.kind}" x1="0" x2="{VIEW_WIDTH:.0f}" y1="{y(reference.value):.1f}" '
                      f'y2="{y(reference.value):.1f}" stroke="{colour}" stroke-width="1.2"{dash} '
                      f'vector-effect="non-scaling-stroke"/>')
    for index, line in enumerate(lines):
        colour = LINE_COLOURS[index % len(LINE_COLOURS)]
        for segment in _segments(line):
            points = " ".join(f"{x(at):.1f},{y(value):.1f}" for at, value in segment)
            if len(segment) == 1:  # a lone point between gaps: a dot, not an invisible line
                points = f"{points} {x(segment[0][0]) + 1:.1f},{y(segment[0][1]):.1f}"
            shapes.append(f'<polyline class="series" points="{points}" fill="none" stroke="{colour}" '
                          f'stroke-width="1.5" vector-effect="non-scaling-stroke" stroke-linejoin="round"/>')
    svg = (f'<svg viewBox="0 0 {VIEW_WIDTH:.0f} {VIEW_HEIGHT:.0f}" preserveAspectRatio="none" role="img" '
           f'aria-label="{esc(title)}, last {round((end - start) / 60)} min">{"".join(shapes)}</svg>')
    return (f'<figure class="plot"><figcaption>{esc(title)}</figcaption>{svg}'
            f'<p class="axis"><span>{round((end - start) / 60)} min ago</span><span>now</span></p>'
            f'{_legend(lines, references, spans, show, firing_label)}</figure>')


def _segments(line: Line) -> list[list[tuple[float, float]]]:
    segments: list[list[tuple[float, float]]] = [[]]
    for at, value in zip(line.times, line.values):
        if math.isfinite(value) and math.isfinite(at):
            segments[-1].append((at, value))
        elif segments[-1]:
            segments.append([])
    return [s for s in segments if s]


def _legend(lines: Sequence[Line], references: Sequence[Reference], spans: list[Window],
            show: Callable[[float], str], firing_label: str) -> str:
    items = []
    for index, line in enumerate(lines):
        latest = next((v for v in reversed(line.values) if math.isfinite(v)), None)
        peak = max((v for v in line.values if math.isfinite(v)), default=None)
        if latest is None or peak is None:
            continue
        colour = LINE_COLOURS[index % len(LINE_COLOURS)]
        items.append(f'<span><span class="swatch" style="border-top-color:{colour}"></span>{esc(line.label)} {esc(show(latest))} '
                     f'(peak {esc(show(peak))})</span>')
    for reference in references:
        if math.isfinite(reference.value):
            items.append(f'<span><span class="swatch {reference.kind}"></span>{esc(reference.label)} '
                         f'{esc(show(reference.value))}</span>')
    if spans:
        minutes = sum(b - a for a, b in spans) / 60
        items.append(f'<span><span class="swatch firing"></span>{esc(firing_label or "alert")} fired '
                     f'{minutes:.0f} min</span>')
    return f'<p class="legend">{"".join(items)}</p>'
