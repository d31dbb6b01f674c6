"""Files generated from the code (the rule file, the dashboards, the PrometheusRule, the promtool
tests, the derived documentation): every generator writes them, or with --check compares them, the
same way, saying one line per file on stderr so that a silent success cannot be mistaken for
nothing done."""
from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path
from typing import Callable


def check(output_dir: Path, files: dict[str, str]) -> list[str]:
    """Unified diffs of every generated file that differs from what is on disk."""
    diffs = []
    for name, text in files.items():
        path = output_dir / name
        current = path.read_text() if path.exists() else ""
        if current != text:
            diffs.append("".join(difflib.unified_diff(
                current.splitlines(keepends=True), text.splitlines(keepends=True),
                f"{name} (committed)", f"{name} (generated)")))
    return diffs


def write(output_dir: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = output_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def check_or_write(output_dir: Path, files: dict[str, str], check_only: bool, command: str,
                   checker=None, writer=None) -> int:
    """The end of every generator here: with --check, exit 1 with a diff when the files on disk
    differ from `files` (`checker`, default `check`); otherwise write them (`writer`, default
    `write`). Either way one line per file on stderr says what was checked or written, so a
    silent success cannot be mistaken for nothing done. Returns the exit status."""
    if check_only:
        diffs = (checker or check)(output_dir, files)
        for name, text in files.items():
            path = output_dir / name
            current = path.read_text() if path.exists() else None
            state = "up to date" if current == text else "missing" if current is None else "differs"
            print(f"checked {path}: {state}", file=sys.stderr)
        if diffs:
            sys.stdout.write("".join(diffs))
            print(f"generated files are stale: run {command}", file=sys.stderr)
            return 1
        return 0
    (writer or write)(output_dir, files)
    for name in files:
        print(f"wrote {output_dir / name}", file=sys.stderr)
    return 0


def generator_main(argv: list[str] | None, command: str, description: str,
                   render: Callable[[], dict[str, str]], output_dir: Path) -> int:
    """The command line of a generator with no options but --check: render, then check or write.
    A render that fails on its input (OSError, ValueError) exits 2 with the message."""
    parser = argparse.ArgumentParser(prog=command, description=description)
    parser.add_argument("--check", action="store_true",
                        help="generate in memory and exit 1 with a diff if a file on disk differs")
    args = parser.parse_args(argv)
    try:
        files = render()
    except (OSError, ValueError) as error:
        print(f"{command}: {error}", file=sys.stderr)
        return 2
    return check_or_write(output_dir, files, args.check, command)
