"""Runbooks rendered to HTML, so a runbook_url works on an air-gapped host."""
from __future__ import annotations

import html
import re
from functools import lru_cache
from pathlib import Path

import markdown

import hybridmon.runbooks

# Alert names are CamelCase words: nothing else can name a file, so no path ever leaves the folder.
RUNBOOK_NAME = re.compile(r"[A-Z][A-Za-z0-9]{1,80}")

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title} - hybridmon runbook</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 46rem; margin: 1rem auto; padding: 0 1rem; line-height: 1.5; }}
pre, code {{ background: #f3f3f3; border-radius: 3px; }}
pre {{ padding: .6rem; overflow-x: auto; }}
table {{ border-collapse: collapse; }} td, th {{ border: 1px solid #ccc; padding: .2rem .5rem; }}
nav {{ font-size: .9rem; margin-bottom: 1rem; }}
</style></head>
<body><nav><a href="/runbooks">All runbooks</a> · <a href="/api/v1/findings">Findings (JSON)</a></nav>
{body}
</body></html>
"""


def runbooks_directory() -> Path:
    """The runbooks/ folder: the `hybridmon.runbooks` package, a checkout's folder or a wheel's."""
    return Path(hybridmon.runbooks.__file__).resolve().parent


class RunbookLibrary:
    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or runbooks_directory()

    def names(self) -> list[str]:
        return sorted(p.stem for p in self.directory.glob("*.md")
                      if RUNBOOK_NAME.fullmatch(p.stem) and p.stem != "README")

    def page_html(self, name: str) -> str | None:
        if not RUNBOOK_NAME.fullmatch(name) or name == "README":
            return None
        path = self.directory / f"{name}.md"
        if not path.is_file():
            return None
        return _render(str(path), path.stat().st_mtime_ns, name)

    def index_html(self) -> str:
        items = "".join(f'<li><a href="/runbooks/{n}">{n}</a></li>' for n in self.names())
        return PAGE.format(title="Runbooks", body=f"<h1>hybridmon runbooks</h1><ul>{items}</ul>")

    def not_found_html(self, name: str) -> str:
        return PAGE.format(title="Not found", body=f"<h1>No runbook named {html.escape(name[:100])}</h1>")


@lru_cache(maxsize=64)
def _render(path: str, _mtime_ns: int, name: str) -> str:
    text = Path(path).read_text(encoding="utf-8")
    # Links between runbooks are written as files (Foo.md) so they work on GitHub too.
    body = markdown.markdown(text, extensions=["fenced_code", "tables"])
    body = re.sub(r'href="([A-Z][A-Za-z0-9]+)\.md"', r'href="/runbooks/\1"', body)
    return PAGE.format(title=html.escape(name), body=body)
