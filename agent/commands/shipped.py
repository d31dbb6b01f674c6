"""The generated files the package carries, for `hybridmon rules|dashboards|runbooks`.

An operator who ran `pip install .` wants the Prometheus rules, the Grafana dashboards and the
runbooks, not the generators that made them (those need PyYAML and grafana-foundation-sdk, which
are test extras). The wheel carries the generated files as package data (pyproject.toml,
[tool.setuptools.package-data]); these functions read them with importlib.resources, so they work
from a wheel, an editable install or a checkout alike, and write them where the operator says.
"""
from __future__ import annotations

import itertools
import sys
from importlib import resources
from pathlib import Path
from typing import TextIO

RULES = ("hybridmon.rules", "hybridmon.rules.yml")
DASHBOARDS = ("hybridmon.dashboards", "json", ".json")
RUNBOOKS = ("hybridmon.runbooks", "", ".md")


class MissingPackageData(RuntimeError):
    """The installed package lacks a file it should carry: a broken build, not the operator's error."""


def rules_text(runbook_base_url: str | None = None) -> str:
    """The shipped rule file; with a base URL (checked by rules/runbook_links.py), every alert's
    runbook_url is BASE/<AlertName> and nothing else changes."""
    package, name = RULES
    path = resources.files(package) / name
    if not path.is_file():
        raise MissingPackageData(f"{package} carries no {name}: reinstall hybridmon")
    text = path.read_text(encoding="utf-8")
    if runbook_base_url is None:
        return text
    # Imported only here: the plain command prints the file as shipped, without PyYAML or the alert
    # families hybridmon.rules.generate reads. dump() is the generator's own YAML layout, so the
    # file differs from the shipped one in its links only.
    import yaml

    from hybridmon.rules.generate import dump
    from hybridmon.rules.runbook_links import with_runbook_base

    header = "".join(itertools.takewhile(lambda line: line.startswith("#"), text.splitlines(keepends=True)))
    document = with_runbook_base(yaml.safe_load(text), runbook_base_url)
    return (f"{header}# runbook_url: {runbook_base_url}/<AlertName> (hybridmon rules --runbook-url-base)\n"
            + dump(document))


def shipped_files(kind: tuple[str, str, str]) -> dict[str, str]:
    """{file name: text} of the dashboards (DASHBOARDS) or runbooks (RUNBOOKS) the package carries."""
    package, folder, suffix = kind
    directory = resources.files(package)
    if folder:
        directory = directory / folder
    files = {entry.name: entry.read_text(encoding="utf-8")
             for entry in directory.iterdir() if entry.is_file() and entry.name.endswith(suffix)}
    if not files:
        raise MissingPackageData(f"{package} carries no *{suffix} files: reinstall hybridmon")
    return dict(sorted(files.items()))


def write_files(output_dir: str | Path, files: dict[str, str], report: TextIO = sys.stderr) -> None:
    """Write each file into output_dir (created if missing), one "wrote PATH" line per file on
    `report`. An existing file of the same name is replaced: these are generated, never edited."""
    directory = Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        path = directory / name
        path.write_text(text, encoding="utf-8")
        report.write(f"wrote {path}\n")
