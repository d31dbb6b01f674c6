"""python -m tests.support.scenarios list | write NAME --output FILE (NAME "all": --output is a directory)."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from tests.support.scenarios import SCENARIOS, ScenarioError, write_trace


def _expected(scenario) -> str:
    if not scenario.expected:
        return "must stay silent"
    return ", ".join(name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
                     for name, labels in scenario.expected)


def _list() -> int:
    print(f"{'scenario':<26} {'tick':>5} {'duration':>9} {'onset':>6}  expected alerts")
    for scenario in SCENARIOS.values():
        onset = "-" if scenario.onset_seconds is None else f"{scenario.onset_seconds:g}s"
        print(f"{scenario.name:<26} {scenario.tick_seconds:>4g}s {scenario.duration_seconds:>8g}s {onset:>6}  "
              f"{_expected(scenario)}")
    return 0


def _write(name: str, output: Path) -> int:
    if name == "all":
        output.mkdir(parents=True, exist_ok=True)
        targets = [(scenario, output / f"{scenario}.jsonl.gz") for scenario in SCENARIOS]
    elif name in SCENARIOS:
        targets = [(name, output)]
    else:
        print(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)} (or all)", file=sys.stderr)
        return 2
    for scenario, path in targets:
        try:
            summary = write_trace(scenario, path)
        except ScenarioError as error:
            print(error, file=sys.stderr)
            return 1
        print(f"{summary.name}: {summary.path} ({summary.records} records, {summary.ticks} ticks over "
              f"{summary.duration_seconds:g} s simulated, {summary.size_bytes / 1024:.0f} KiB, "
              f"generated in {summary.wall_seconds:.1f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.scenarios",
                                     description="Synthetic hybridmon traces of incidents and healthy hosts "
                                                 "(docs/scenarios.md).")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="the scenarios, their timing and the alerts each should raise")
    write = commands.add_parser("write", help="generate a scenario's trace")
    write.add_argument("name", help="a scenario from `list`, or all")
    write.add_argument("--output", "-o", required=True, type=Path,
                       help="trace file to write (a directory for all)")
    arguments = parser.parse_args(argv)
    # The collectors log what they notice (a GPU lost, a device gone): part of the story, not noise
    # worth printing while generating.
    logging.basicConfig(level=logging.ERROR + 10)
    if arguments.command == "list":
        return _list()
    return _write(arguments.name, arguments.output)


if __name__ == "__main__":
    sys.exit(main())
