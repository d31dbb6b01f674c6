"""A replayed agent as Prometheus would see it, and when promtool's evaluation of the rules fires.

`Scraper` watches an Agent's sampler and keeps, every `interval` seconds of recorded time, what its
/metrics would have served at that moment: the latest commit of every collector (the exposition
renders `History.latest()`), as a Prometheus scrape at that instant takes it. A series absent from
a scrape after being present gets a stale marker, as Prometheus writes one when a target stops
exposing a series.

`promtool_test` turns the scrapes into one promtool unit test document, and `first_and_last_firing`
runs it with two PromQL expression tests over the ALERTS series the rule evaluation writes:

    min_over_time(timestamp(ALERTS{alertstate="firing"})[END:STEP])  first evaluation firing
    max_over_time(timestamp(ALERTS{alertstate="firing"})[END:STEP])  last evaluation firing
    count_over_time(ALERTS{alertstate="firing"}[END:STEP])           evaluations firing

Their expected samples are left empty, so promtool fails the test and prints what it got, one
`{labels} value` per alert; that output is parsed. promtool evaluates every rule group at every
evaluation step from 0 to END first and the expression tests after (cmd/promtool/unittest.go), and
it marks alerting rules as restored so that ALERTS is written; an alert that resolves gets a stale
marker in ALERTS, so the maximum is its last firing evaluation.
"""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.support.promtool_cases import num

REPO = Path(__file__).resolve().parents[2]
RULES_FILE = REPO / "rules" / "hybridmon.rules.yml"
INSTANCE = "scenario-host:9787"
JOB = "hybridmon"

SeriesKey = tuple[str, tuple[tuple[str, str], ...]]
Labels = tuple[tuple[str, str], ...]


class Scraper:
    """What a Prometheus scraping `agent` every `interval` s from `start` would have stored."""

    def __init__(self, agent, start: float, interval: float = 15.0) -> None:
        self.history = agent.history
        self.start = start
        self.interval = interval
        self.scrapes: list[dict[SeriesKey, float]] = []   # the scrape at start + i * interval
        self._served: dict = {}                          # History.latest() after the last commit
        agent.sampler.on_commit.append(self._committed)

    @property
    def _next(self) -> float:
        return self.start + len(self.scrapes) * self.interval

    def _committed(self, at: float) -> None:
        # Commits arrive in recorded-time order; one later than the next scrape's time means that
        # scrape saw the state as it was before this commit.
        while self._next < at - 1e-9:
            self.scrapes.append(self._snapshot())
        self._served = self.history.latest()

    def finish(self, end: float) -> None:
        """The scrapes up to `end` (recorded time) that no later commit has taken yet."""
        while self._next <= end + 1e-9:
            self.scrapes.append(self._snapshot())

    def _snapshot(self) -> dict[SeriesKey, float]:
        # Prometheus writes `up` itself for every scrape, 1 when it succeeded ("Jobs and
        # instances", Prometheus documentation); HybridmonAgentDown's rules read it.
        scrape = {("up", ()): 1.0}
        for _collector, (_at, samples) in self._served.items():
            for sample in samples:
                labels = tuple(zip(sample.spec.label_names, sample.label_values))
                scrape[(sample.spec.name, labels)] = sample.value
        return scrape


def series_values(values: list[float | None]) -> str:
    """promtool's expanding notation: `vxN` for v and N repeats of it (finite v), `_xN` for N
    missing samples, and `stale` where a series present in the previous scrape is missing from this one."""
    tokens: list[str] = []
    previous_present = False
    for value in values:
        if value is None:
            tokens.append("stale" if previous_present else "_")
            previous_present = False
        else:
            tokens.append(_number(value))
            previous_present = True
    out: list[str] = []
    i = 0
    while i < len(tokens):
        j = i
        while j + 1 < len(tokens) and tokens[j + 1] == tokens[i] and tokens[i] != "stale":
            j += 1
        run = j - i + 1
        if tokens[i] == "_":
            out.append(f"_x{run}")
        elif run == 1 or tokens[i] in _NOT_EXPANDABLE:  # `axn` takes finite numbers only
            out.extend([tokens[i]] * run)
        else:
            out.append(f"{tokens[i]}x{run - 1}")
        i = j + 1
    return " ".join(out)


_NOT_EXPANDABLE = {"+Inf", "-Inf", "NaN"}


def _number(value: float) -> str:
    return "NaN" if math.isnan(value) else num(value)


def _quote(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def input_series(scrapes: list[dict[SeriesKey, float]], instance: str = INSTANCE,
                 job: str = JOB) -> list[dict[str, str]]:
    """Every series any scrape held, with `instance` and `job` added, one value per scrape."""
    keys = sorted({key for scrape in scrapes for key in scrape})
    out = []
    for name, labels in keys:
        pairs = dict(labels)
        pairs.update(instance=instance, job=job)
        selector = ", ".join(f"{k}={_quote(v)}" for k, v in sorted(pairs.items()))
        values = series_values([scrape.get((name, labels)) for scrape in scrapes])
        out.append({"series": f"{name}{{{selector}}}", "values": values})
    return out


FIRST = 'min_over_time(timestamp(ALERTS{{alertstate="firing"}})[{end}s:{step}s])'
LAST = 'max_over_time(timestamp(ALERTS{{alertstate="firing"}})[{end}s:{step}s])'
COUNT = 'count_over_time(ALERTS{{alertstate="firing"}}[{end}s:{step}s])'


def promtool_test(series: list[dict[str, str]], end: int, step: int = 15,
                  evaluation_interval: int = 15, name: str = "replay",
                  rule_files: list[str | Path] = (RULES_FILE,)) -> dict:
    """A promtool unit test document over `series` (sampled every `step` s) whose two expression
    tests, at `end`, list the first and the last firing evaluation of every alert."""
    return {
        "rule_files": [str(path) for path in rule_files],
        "evaluation_interval": f"{evaluation_interval}s",
        "tests": [{
            "name": name,
            "interval": f"{step}s",
            "input_series": series,
            "promql_expr_test": [
                {"expr": FIRST.format(end=end, step=evaluation_interval), "eval_time": f"{end}s", "exp_samples": []},
                {"expr": LAST.format(end=end, step=evaluation_interval), "eval_time": f"{end}s", "exp_samples": []},
                {"expr": COUNT.format(end=end, step=evaluation_interval), "eval_time": f"{end}s", "exp_samples": []},
            ],
        }],
    }


@dataclass(frozen=True)
class RuleFiring:
    alertname: str
    labels: dict[str, str]   # every label of the alert but alertname and alertstate
    first: float             # seconds from the test's start: first evaluation firing
    last: float              # last evaluation firing
    evaluations: int = 0     # evaluations firing: (last - first) / step + 1 when it never resolved between


class PromtoolError(Exception):
    """promtool could not run the document (a bad series, a rule error), as opposed to the
    expected failure of the empty expectations."""


_GOT = re.compile(r"^\s*got: (.*)$", re.M)
_EXPR = re.compile(r'^\s*expr: "(min|max|count)_over_time', re.M)
_SAMPLE = re.compile(r'\{((?:[^"}]|"(?:[^"\\]|\\.)*")*)\} (\S+?)(?:,|$)')
_PAIR = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_samples(text: str) -> list[tuple[dict[str, str], float]]:
    """`{a="1", b="2"} 3, {a="4"} 5` (promtool's `got:`) -> [({a: 1, b: 2}, 3.0), ({a: 4}, 5.0)];
    `nil` -> []."""
    text = text.strip()
    if text == "nil":
        return []
    out = []
    for match in _SAMPLE.finditer(text):
        labels = {k: json.loads(f'"{v}"') for k, v in _PAIR.findall(match.group(1))}
        out.append((labels, float(match.group(2))))
    if not out:
        raise ValueError(f"cannot parse promtool's samples: {text[:200]!r}")
    return out


def parse_firings(output: str) -> list[RuleFiring]:
    """The alerts in the output of a `promtool test rules` run of a `promtool_test` document."""
    got: dict[str, dict[Labels, float]] = {"min": {}, "max": {}, "count": {}}
    blocks = list(_EXPR.finditer(output))
    for index, block in enumerate(blocks):
        end = blocks[index + 1].start() if index + 1 < len(blocks) else len(output)
        line = _GOT.search(output, block.end(), end)
        if line is None:
            raise ValueError(f"no `got:` after {block.group(0)!r}")
        for labels, value in parse_samples(line.group(1)):
            got[block.group(1)][tuple(sorted(labels.items()))] = value
    if set(got["min"]) != set(got["max"]):
        raise ValueError("the first and last firing times name different alerts")
    firings = []
    for key, first in sorted(got["min"].items()):
        labels = dict(key)
        alertname = labels.pop("alertname")
        labels.pop("alertstate", None)
        firings.append(RuleFiring(alertname, labels, first, got["max"][key], int(got["count"].get(key, 0))))
    return firings


def promtool() -> str:
    path = shutil.which("promtool")
    if not path:
        raise FileNotFoundError("promtool is missing: install Debian's `prometheus` package (scripts/test does)")
    return path


def first_and_last_firing(document: dict, directory: Path, name: str = "replay") -> tuple[list[RuleFiring], str]:
    """Run the `promtool_test` document in `directory`; every alert that fired, and promtool's
    output (stdout and stderr)."""
    path = directory / f"{name}.promtool.yml"
    with path.open("w") as handle:
        yaml.safe_dump(document, handle, sort_keys=False, width=1 << 20)
    result = subprocess.run([promtool(), "test", "rules", str(path)], capture_output=True, text=True,
                            timeout=600)
    output = result.stdout + result.stderr
    if result.returncode == 0:
        if "SUCCESS" not in output:
            raise PromtoolError(output)
        return [], output   # both expressions empty: nothing ever fired
    if "got:" not in output:
        raise PromtoolError(output)
    return parse_firings(output), output
