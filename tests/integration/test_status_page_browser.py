"""The status page with its hour of plots, as headless Chromium lays it out at desktop (1280 px) and
phone (390 px) widths: plots drawn and non-empty, no horizontal overflow, no literal backticks, no
empty grid columns, and the screenshots of docs/ can be produced (tests/support/status_screenshots.py
makes them: `python -m tests.support.status_screenshots`).

The page is the real agent's over scenario memory_growth_vllm_v1_engine_leak replayed (70 min of
simulated history: two GPUs, vLLM's API server and engine core, llama-server, one vLLM endpoint).
Chromium is the Debian package scripts/test installs; under CI=true a missing one fails the test.
"""
from __future__ import annotations

import pytest
from PIL import Image

from hybridmon.agent.alerts import memory_growth
from hybridmon.agent.status.page import render_status_page
from hybridmon.agent.status.plots import FIRING_FILL, LINE_COLOURS, VIEW_WIDTH
from tests.support.status_page_helpers import chromium_binary, count_colour
from tests.support.status_screenshots import (DESKTOP_WIDTH, PHONE_WIDTH, SCENARIO, Layout, measure,
                                              replayed_agent, screenshot)

# What the scenario's page holds: 2 GPUs x (PCIe, VRAM), 3 watched processes, 1 server x (tokens/s,
# KV, time to first token, inter-token latency, KV offload traffic), the host's swap, major faults and PSI.
PLOTS = 2 * 2 + 3 + 5 + 3


@pytest.fixture(scope="module")
def page(scenarios, tmp_path_factory) -> str:
    agent = replayed_agent(scenarios.summary(SCENARIO).path, tmp_path_factory.mktemp("state"))
    try:
        firing = {s.finding.alertname for s in agent.engine.firing()}
        assert memory_growth.Detector.alertnames[0] in firing  # the shaded span the plots show
        return render_status_page(agent)
    finally:
        agent.stop()


@pytest.fixture(scope="module")
def layouts(page, tmp_path_factory) -> dict[int, Layout]:
    """The page laid out by Chromium at each width, once for the module (a run takes ~1 s)."""
    work = tmp_path_factory.mktemp("chromium")
    return {width: measure(chromium_binary(), page, width, work) for width in (DESKTOP_WIDTH, PHONE_WIDTH)}


@pytest.mark.parametrize("width", [DESKTOP_WIDTH, PHONE_WIDTH])
def test_plots_are_drawn_without_overflow_or_backticks(layouts, width):
    layout = layouts[width]
    assert layout.client_width == width, layout.client_width  # laid out at the width asked
    assert layout.scroll_width <= width, f"{layout.scroll_width} px wide content at {width} px"
    assert len(layout.plots) == PLOTS, layout.plots
    for plot in layout.plots:
        assert 0 < plot["width"] <= width and plot["height"] > 20, plot
        # a line across most of the hour (lengths in the viewBox's units), not a dot
        assert plot["lines"] >= 1 and plot["drawn"] > 0.5 * VIEW_WIDTH, plot
    assert "`" not in layout.text  # `hybridmon bench` in the bench collector's reason was printed as is
    assert "hybridmon bench" in layout.code
    # Every grid's cards reach its right edge: no empty columns beside one card (auto-fill left
    # two empty 20rem tracks beside the only inference server's card at 1280 px).
    for grid in layout.grids:
        assert grid["cardsRight"] >= grid["right"] - 2, grid


def test_screenshots_for_docs_can_be_produced(page, layouts, tmp_path):
    """What `python -m tests.support.status_screenshots` writes to docs/, drawn into tmp_path."""
    for name, width in (("desktop", DESKTOP_WIDTH), ("phone", PHONE_WIDTH)):
        png = tmp_path / f"status-page-{name}.png"
        screenshot(chromium_binary(), page, width, layouts[width].scroll_height, png, tmp_path)
        with Image.open(png) as image:
            assert image.size[0] == width and image.size[1] > 1500, image.size
            everything = (0, 0, *image.size)
            assert count_colour(image, everything, LINE_COLOURS[0]) > 2000, name  # the plots' first lines
            # the engine core's memory growth, shaded: FIRING_FILL blended over the plot background
            assert count_colour(image, everything, blended(FIRING_FILL, "#fafafa"), tolerance=4) > 500, name


def blended(colour_with_alpha: str, background: str) -> str:
    alpha = int(colour_with_alpha[7:9], 16) / 255
    channels = [round(int(colour_with_alpha[i:i + 2], 16) * alpha + int(background[i:i + 2], 16) * (1 - alpha))
                for i in (1, 3, 5)]
    return "#" + "".join(f"{c:02x}" for c in channels)
