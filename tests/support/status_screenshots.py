"""The status page of a replayed scenario drawn by headless Chromium: the screenshots committed under
docs/ and what tests/integration/test_status_page_browser.py measures.

    .venv/bin/python -m tests.support.status_screenshots [--out docs]

regenerates docs/status-page-desktop.png (1280 px wide) and docs/status-page-phone.png (390 px).
The page is the real agent's (render_status_page) over the history of a scenario replayed from its
trace: simulated numbers from tests/support/scenarios, not a measured host.

Layout is measured in the browser itself: a copy of the page with one <script> appended (the
agent's page has none) is shown in an <iframe srcdoc> exactly `width` CSS px wide, and the script
records the frame's scroll width, each plot's drawn size, the grids and the text as rendered in an
attribute of the outer page, read back from Chromium's --dump-dom (the DOM after scripts ran). The
frame, not the window, sets the width: headless Chromium 156 clamps --window-size to at least
500 px wide for --dump-dom (measured here: clientWidth 500 at --window-size=390,900), while
--screenshot draws at the width asked. No DevTools client is needed (neither websockets nor
websocket-client is a dependency).
"""
from __future__ import annotations

import argparse
import html
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hybridmon.agent.config import load_config
from hybridmon.agent.daemon import Agent
from hybridmon.agent.status.page import render_status_page
from tests.support.scenarios import SCENARIOS, history_seconds_for

# An hour and ten minutes of vLLM V1 (API server and engine core), both GPUs busy, the engine core
# leaking: every kind of plot has a line, and InferenceProcessMemoryGrowth fires (a shaded span).
SCENARIO = "memory_growth_vllm_v1_engine_leak"
DESKTOP_WIDTH, PHONE_WIDTH = 1280, 390
CHROMIUM_SECONDS = 60
EVALUATION_SECONDS = 60
REPOSITORY = Path(__file__).resolve().parents[2]
LAYOUT_ATTRIBUTE = "data-layout"

# Appended to a copy of the page only; JSON of the layout as the browser computed it.
MEASURE = f"""<script>
const plots = [...document.querySelectorAll("figure.plot svg")].map(svg => {{
  const box = svg.getBoundingClientRect();
  const lines = [...svg.querySelectorAll("polyline.series")];
  return {{width: box.width, height: box.height, lines: lines.length,
           drawn: lines.reduce((sum, line) => sum + line.getTotalLength(), 0)}};
}});
const grids = [...document.querySelectorAll(".grid")].map(grid => ({{
  section: grid.closest("section").id, right: grid.getBoundingClientRect().right,
  cardsRight: Math.max(...[...grid.children].map(card => card.getBoundingClientRect().right))}}));
parent.document.body.setAttribute("{LAYOUT_ATTRIBUTE}", JSON.stringify({{
  scrollWidth: document.documentElement.scrollWidth, clientWidth: document.documentElement.clientWidth,
  scrollHeight: document.documentElement.scrollHeight, plots: plots, grids: grids,
  text: document.body.innerText, code: [...document.querySelectorAll("code")].map(c => c.textContent)}}));
</script>"""


@dataclass(frozen=True)
class Layout:
    scroll_width: int
    client_width: int
    scroll_height: int
    plots: list[dict]   # per plot's <svg>: width, height (CSS px), lines, drawn (their total length)
    grids: list[dict]   # per card grid: section, right (its right edge), cardsRight (its cards' rightmost)
    text: str           # the page's text as drawn (innerText)
    code: list[str]     # the text of each <code>


def replayed_agent(trace: Path, state_dir: Path, scenario: str = SCENARIO) -> Agent:
    """An agent that replayed `trace` with its detectors on; the caller stops it."""
    # Evaluating once a simulated minute, not every 15 s: the shaded spans move by under a minute
    # (a pixel and a half of a 390 px plot of the hour) and the replay takes a quarter of the time.
    overrides = {"history_seconds": history_seconds_for(SCENARIOS[scenario]), "state_dir": str(state_dir),
                 "detectors.evaluation_interval_seconds": EVALUATION_SECONDS}
    agent = Agent(load_config(environ={}, overrides=overrides), replay_from=trace)
    agent.replay(speed=0)
    return agent


def chromium(binary: str, profile: Path, url: str, width: int, height: int, *arguments: str) -> str:
    """One headless run with a throwaway profile (flags: no network of its own, no first-run UI).
    --no-sandbox: CI runs the tests as root, where Chromium refuses its sandbox."""
    command = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-extensions", "--disable-dev-shm-usage", "--hide-scrollbars",
               f"--user-data-dir={profile}", f"--window-size={width},{height}", *arguments, url]
    result = subprocess.run(command, capture_output=True, text=True, timeout=CHROMIUM_SECONDS)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return result.stdout


def measure(binary: str, page: str, width: int, work: Path) -> Layout:
    """The page laid out `width` CSS px wide."""
    measured = work / f"measure-{width}.html"
    framed = html.escape(page.replace("</body>", MEASURE + "</body>"), quote=True)
    measured.write_text(f'<!doctype html><html><body style="margin:0"><iframe srcdoc="{framed}" '
                        f'style="border:0;width:{width}px;height:900px"></iframe></body></html>')
    dom = chromium(binary, work / f"profile-measure-{width}", measured.as_uri(), max(width, 500) + 40, 1000,
                   "--dump-dom")
    found = re.search(rf"{LAYOUT_ATTRIBUTE}=\"([^\"]*)\"", dom)
    if not found:
        raise RuntimeError(f"the layout script did not run at {width} px:\n{dom[:2000]}")
    raw = json.loads(html.unescape(found.group(1)))
    return Layout(raw["scrollWidth"], raw["clientWidth"], raw["scrollHeight"], raw["plots"], raw["grids"],
                  raw["text"], raw["code"])


def screenshot(binary: str, page: str, width: int, height: int, png: Path, work: Path) -> None:
    shown = work / "page.html"
    shown.write_text(page)
    chromium(binary, work / f"profile-shot-{width}", shown.as_uri(), width, height, f"--screenshot={png}")


def screenshots(binary: str, page: str, out: Path, work: Path) -> dict[str, Path]:
    """docs' two PNGs of `page`, each as tall as the page laid out at its width."""
    written = {}
    for name, width in (("desktop", DESKTOP_WIDTH), ("phone", PHONE_WIDTH)):
        layout = measure(binary, page, width, work)
        png = out / f"status-page-{name}.png"
        screenshot(binary, page, width, layout.scroll_height, png, work)
        written[name] = png
    return written


def shrink(png: Path) -> None:
    """256 colours are plenty for flat boxes, text and lines: a third of the bytes in the repository."""
    from PIL import Image

    with Image.open(png) as image:
        small = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    small.save(png, optimize=True)


def main(argv: list[str] | None = None) -> int:
    from tests.support.scenario_traces import cached_trace, trace_cache_directory

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPOSITORY / "docs")
    parser.add_argument("--chromium", default="chromium")
    args = parser.parse_args(argv)
    trace = cached_trace(SCENARIO, trace_cache_directory()).path
    with tempfile.TemporaryDirectory() as scratch:
        agent = replayed_agent(trace, Path(scratch) / "state")
        try:
            page = render_status_page(agent)
        finally:
            agent.stop()
        for name, png in screenshots(args.chromium, page, args.out, Path(scratch)).items():
            shrink(png)
            print(f"{name}: {png} ({png.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
