"""HTML building blocks of the status page (agent/status/page.py): the page shell, its inline CSS
and small escaping helpers.

Every helper escapes the text it is given (titles, labels, values, URLs), so no caller builds
markup from a label: process names and command lines are whatever a user of the host chose. Only
the `body` and `sections` arguments take markup, and only markup these helpers made. No scripts,
no web fonts, no external files: the page must work on an air-gapped host and on a phone.
"""
from __future__ import annotations

import html
import re
from datetime import datetime, timezone
from typing import Iterable, Sequence

from hybridmon.units import human_duration


# One colour per banner state (the worst severity firing; ok: none; off: detectors not running;
# warming: nothing firing, but some detectors have not judged yet, so not green),
# shared by the banner and the findings' left borders. The headless browser test looks for them.
SEVERITY_COLOURS = {"critical": "#c62828", "warning": "#f9a825", "info": "#1565c0", "ok": "#2e7d32", "off": "#616161",
                   "warming": "#455a64"}

CSS = """
body { margin: 0; font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
       color: #1b1b1b; background: #f6f6f6; }
main { max-width: 64rem; margin: 0 auto; padding: 0 .75rem 2rem; }
.banner { padding: .9rem .75rem; font-size: 1.15rem; font-weight: 600; color: #fff; }
.banner.warning { color: #1b1b1b; }
.banner small { display: block; font-size: .85rem; font-weight: 400; }
h2 { font-size: 1.1rem; margin: 1.4rem 0 .5rem; padding-bottom: .2rem; border-bottom: 1px solid #ccc; }
h3 { font-size: 1rem; margin: 0 0 .3rem; }
.grid { display: grid; grid-template-columns: repeat(auto-fit, minmax(min(20rem, 100%), 1fr)); gap: .75rem; }
@media (max-width: 600px) { .grid { grid-template-columns: 1fr; } }
.card { background: #fff; border: 1px solid #d6d6d6; border-radius: 6px; padding: .6rem .75rem;
        overflow-wrap: anywhere; margin-bottom: .75rem; }
.grid .card { margin-bottom: 0; }
.finding { border-left: 6px solid #999; }
.finding.pending { background: #fbfbfb; border-style: dashed; border-left-style: solid; }
.state { font-size: .75rem; text-transform: uppercase; letter-spacing: .04em; color: #555;
         border: 1px solid #bbb; border-radius: 3px; padding: 0 .3rem; margin-right: .3rem; }
.sub, .meta { color: #555; font-size: .85rem; margin: .1rem 0; }
table { width: 100%; border-collapse: collapse; font-size: .9rem; }
th, td { text-align: left; vertical-align: top; padding: .15rem .4rem .15rem 0; }
table.kv th { font-weight: 400; color: #555; width: 42%; }
table.grid-table th { font-weight: 600; border-bottom: 1px solid #ddd; }
/* the figures' names keep whole words beside two servers' columns at a phone's width */
.compare td:first-child { min-width: 7.5rem; overflow-wrap: normal; }
.flag { color: #b71c1c; font-weight: 600; }
code { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: .85em;
       background: #eee; border-radius: 3px; padding: 0 .2rem; }
details summary { cursor: pointer; color: #555; font-size: .85rem; }
.plot { margin: .6rem 0 0; }
.plot figcaption { font-size: .8rem; font-weight: 600; color: #333; }
.plot svg { display: block; width: 100%; height: 3.75rem; background: #fafafa; border: 1px solid #e4e4e4; }
.plot .axis { display: flex; justify-content: space-between; color: #777; font-size: .7rem; margin: 0; }
.plot .legend { font-size: .75rem; color: #444; margin: .1rem 0 0; }
.plot .legend > span { display: inline-block; margin-right: .7rem; }
.plot .legend .swatch { display: inline-block; width: .9rem; border-top: 3px solid #1565c0; vertical-align: middle;
                        margin-right: .25rem; }
.plot .legend .swatch.threshold { border-top: 2px dashed #c62828; }
.plot .legend .swatch.capacity { border-top: 2px solid #757575; }
.plot .legend .swatch.firing { height: .7rem; border: 0; background: #c6282833; }
a { color: #0b57a4; }
""" + "".join(f".banner.{name} {{ background: {colour}; }} .finding.{name} {{ border-left-color: {colour}; }}\n"
              for name, colour in SEVERITY_COLOURS.items())

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="refresh" content="30">
<title>{title}</title>
<style>{css}</style></head>
<body>{banner}<main>
{sections}
<p class="meta"><a href="/metrics">/metrics</a> · <a href="/api/v1/findings">findings (JSON)</a> · <a href="/runbooks">runbooks</a> · <a href="/healthz">/healthz</a></p>
</main></body></html>
"""

FLAGGED = ' class="flag"'
Row = tuple[str, str, bool]
"""(label, value, flagged): one line of a key-value table; a flagged value is drawn in red."""


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


_QUOTED_COMMAND = re.compile(r"`([^`\n]+)`")


def prose(text: object) -> str:
    """Escaped text with `quoted commands` as <code> (the messages of the agent and its alerts
    quote commands Markdown's way, e.g. `hybridmon bench`; a browser printed the backticks)."""
    return _QUOTED_COMMAND.sub(r"<code>\1</code>", esc(text))


def page(title: str, banner_class: str, banner_text: str, banner_detail: str, sections: Iterable[str]) -> str:
    banner = (f'<header class="banner {esc(banner_class)}" id="banner">{esc(banner_text)}'
              f"<small>{esc(banner_detail)}</small></header>")
    return PAGE.format(title=esc(title), css=CSS, banner=banner, sections="\n".join(sections))


def section(heading: str, body: str, section_id: str) -> str:
    return f'<section id="{esc(section_id)}"><h2>{esc(heading)}</h2>{body}</section>'


def card(title: str, body: str, subtitle: str = "", classes: str = "") -> str:
    sub = f'<p class="sub">{esc(subtitle)}</p>' if subtitle else ""
    return f'<div class="card {esc(classes)}"><h3>{esc(title)}</h3>{sub}{body}</div>'


# Rows whose value is the host's text, shown as is: a backtick there is the user's, not our quoting.
VERBATIM_ROWS = frozenset({"Command line"})


def key_values(rows: Iterable[Row]) -> str:
    cells = "".join(
        f'<tr><th>{esc(label)}</th><td{FLAGGED if flagged else ""}>'
        f'{esc(value) if label in VERBATIM_ROWS else prose(value)}</td></tr>'
        for label, value, flagged in rows)
    return f'<table class="kv">{cells}</table>' if cells else ""


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    head = "".join(f"<th>{esc(cell)}</th>" for cell in header)
    body = "".join("<tr>" + "".join(f"<td>{esc(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table class="grid-table"><tr>{head}</tr>{body}</table>'


def paragraph(text: str, classes: str = "") -> str:
    return f'<p class="{esc(classes)}">{prose(text)}</p>'


def link(href: str, text: str) -> str:
    return f'<a href="{esc(href)}">{esc(text)}</a>'


def clock(unix: float) -> str:
    return datetime.fromtimestamp(unix, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def clock_and_age(unix: float | None, now: float) -> str:
    """'2025-11-24 16:01:10 UTC (8 min ago)'; 'never' for None."""
    if unix is None:
        return "never"
    return f"{clock(unix)} ({human_duration(now - unix)} ago)"
