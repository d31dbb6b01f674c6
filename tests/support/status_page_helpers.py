"""Reading the status page back: its tags and text as a browser parses them, and headless Chromium
(Debian package `chromium`, installed by scripts/test) for what a phone would show."""
from __future__ import annotations

import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

PHONE_WIDTH = 390  # CSS pixels of a common phone (iPhone 12-15)
CHROMIUM_SECONDS = 30


class PageStructure(HTMLParser):
    """Every tag with its attributes, and the text a reader sees, entities decoded."""

    def __init__(self, page: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self._text: list[str] = []
        self.feed(page)
        self.close()

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self._text.append(data)

    @property
    def text(self) -> str:
        return "".join(self._text)

    def links(self) -> list[str]:
        return [attrs["href"] for tag, attrs in self.tags if tag == "a" and attrs.get("href")]


def chromium_binary() -> str:
    """The browser, or a failure in CI (where scripts/test installs it) and a skip elsewhere."""
    found = shutil.which("chromium")
    if found:
        return found
    message = "chromium is not installed (scripts/test installs the Debian package `chromium` as root)"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def chromium(binary: str, profile: Path, url: str, *arguments: str) -> subprocess.CompletedProcess:
    """One headless run with a throwaway profile. --no-sandbox: tests run as root in CI, where
    Chromium refuses its sandbox; the page is our own, served on loopback."""
    command = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               "--no-first-run", "--disable-extensions", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
               f"--window-size={PHONE_WIDTH},2000", *arguments, url]
    result = subprocess.run(command, capture_output=True, text=True, timeout=CHROMIUM_SECONDS)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stderr[-3000:]}"
    return result


def hex_colour(colour: str) -> tuple[int, int, int]:
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))  # type: ignore[return-value]


def count_colour(image, box: tuple[int, int, int, int], colour: str, tolerance: int = 6) -> int:
    """Pixels in box (left, top, right, bottom) within `tolerance` of colour on every channel."""
    red, green, blue = hex_colour(colour)
    data = image.convert("RGB").crop(box).tobytes()
    return sum(1 for r, g, b in zip(data[0::3], data[1::3], data[2::3])
               if abs(r - red) <= tolerance and abs(g - green) <= tolerance and abs(b - blue) <= tolerance)
