"""A fast path for the Prometheus text format bodies inference servers publish.

prometheus_client's parser (text_string_to_metric_families) walks each line character by
character in Python: 3.5 ms for the 106 lines a vLLM server's /metrics keeps
(tests/fixtures/inference/vllm-v1-names.1.prom), most of the inference collector's cost. The
bodies servers write (prometheus_client's own exposition in vLLM, SGLang, LMCache; llama.cpp's
and TGI's writers) are plain: ASCII, one space between the parts, label values without quotes or
backslashes. Such a body is read here with a few regular expressions, line by line in C.

Anything else falls back to prometheus_client's parser for the WHOLE body, so that every body
either reads exactly as that parser reads it or fails with that parser's own error: non-ASCII or
control characters, escapes and quotes, spaces inside the braces, exemplars, label names
beginning with "__" (reserved), repeated label names, values other than decimal numbers, NaN and
+/-Inf, more than one number after the value, a # TYPE or # HELP line that is not
"# TYPE name type" with a known type, and a counter whose # TYPE name lacks "_total" (that
parser then renames its samples name_total: prometheus_client 0.26 parser.py, build_metric).
The names and label names accepted pass both of prometheus_client's validation schemes (the
legacy one, METRIC_NAME_RE and METRIC_LABEL_NAME_RE of validation.py, and UTF-8).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from math import isfinite

SampleIndex = dict[str, list[tuple[dict[str, str], float]]]

# Printable ASCII and newlines only: str.strip() then strips spaces alone, as the fast path
# assumes, and no tab can be a separator (that parser splits on tabs where a line has no space).
_UNUSUAL_CHARACTER = re.compile(r"[^\x20-\x7e\n]")
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'(?!__)[a-zA-Z_][a-zA-Z0-9_]*="[^"\\]*"'
# Decimal numbers of at most 30 digits (no overflow when made a float: int() of a longer run is
# exact, float() of it may overflow), or the non-finite words the index leaves out.
_NUMBER = r"[+-]?(?:[0-9]{1,30}(?:\.[0-9]{0,30})?|\.[0-9]{1,30})(?:[eE][+-]?[0-9]{1,3})?"
_NON_FINITE = r"NaN|[+-]?Inf"
_SAMPLE_LINE = re.compile(
    rf"({_NAME})(?:\{{((?:{_LABEL}(?:,{_LABEL})*)?)\}})? +({_NUMBER}|{_NON_FINITE})(?: +-?[0-9]{{1,20}})?")
_LABEL_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"\\]*)"')
_FAMILY_NAME = re.compile(_NAME)
# prometheus_client 0.26 metrics_core.METRIC_TYPES, and "untyped" (which it reads as "unknown").
_TYPES = frozenset({"counter", "gauge", "summary", "histogram", "gaugehistogram", "unknown", "info",
                    "stateset", "untyped"})


@dataclass
class Bounds:
    """What one body may add to an index (issue 30: a peer's 36,000 models in a 7.9 MB body were
    indexed whole): at most `per_name` samples of a name, and samples of at most `entities`
    distinct values of the first of `entity_labels` a sample carries (a server's models), the first
    ones in the body. Holds what it has admitted: one per parse."""

    per_name: int | None = None
    entity_labels: tuple[str, ...] = ()
    entities: int | None = None
    _admitted: set[str] = field(default_factory=set)

    def admits(self, entries: list | None, labels: dict[str, str]) -> bool:
        if self.per_name is not None and entries is not None and len(entries) >= self.per_name:
            return False
        if self.entities is not None:
            entity = next((labels[name] for name in self.entity_labels if name in labels), None)
            if entity is not None and entity not in self._admitted:
                if len(self._admitted) >= self.entities:
                    return False
                self._admitted.add(entity)
        return True


def plain_sample_index(text: str, bounds: Bounds | None = None) -> SampleIndex | None:
    """{sample name: [(labels, value)]} of a plain body, finite values only, in line order: what
    prometheus_client's parser gives for it. None where the body is not plain (module docstring):
    the caller parses it with that parser instead. `bounds`: what is kept of a large body (every
    line is still read, so a body is plain or not as a whole); the lines are read one at a time,
    so a large body is never held twice."""
    if _UNUSUAL_CHARACTER.search(text):
        return None
    index: SampleIndex = {}
    sample_line = _SAMPLE_LINE.fullmatch
    for line in lines_of(text):
        line = line.strip()
        if not line:
            continue
        if line[0] == "#":
            if not _plain_comment(line):
                return None
            continue
        match = sample_line(line)
        if match is None:
            return None
        name, labels_text, value_text = match.groups()
        labels = dict(_LABEL_PAIR.findall(labels_text)) if labels_text else {}
        if labels_text and len(labels) != labels_text.count('="'):
            return None  # a label name given twice: that parser refuses the line, whatever its value
        if bounds is not None and not bounds.admits(index.get(name), labels):
            continue
        # As that parser: int() first where it takes the text ("-0" is 0, not -0.0), else float().
        value = float(int(value_text)) if value_text.lstrip("+-").isdigit() else float(value_text)
        if not isfinite(value):  # NaN, +/-Inf, 1e999: left out of the index, as parse_prometheus does
            continue
        index.setdefault(name, []).append((labels, value))
    return index


def lines_of(text: str):
    """The lines of `text`, one at a time: str.split would hold every line of a large body at once
    (a 7.9 MB body of 108,000 lines, ~13 MB more)."""
    start = 0
    while (end := text.find("\n", start)) >= 0:
        yield text[start:end]
        start = end + 1
    yield text[start:]


def _plain_comment(line: str) -> bool:
    """A comment that parser ignores, or a well-formed # HELP or # TYPE line that changes no
    sample's name. It splits comments on unquoted whitespace (_split_quoted); without quotes in
    the first three words that is str.split."""
    words = line.split(None, 3)
    if '"' in " ".join(words[:3]):
        return False  # a quoted space would join words, and make another line a # HELP or # TYPE
    if len(words) < 2 or words[1] not in ("HELP", "TYPE"):
        return True  # a comment
    if len(words) < 3 or not _FAMILY_NAME.fullmatch(words[2]):
        return False
    if words[1] == "HELP":
        return True
    return len(words) == 4 and words[3] in _TYPES and (words[3] != "counter" or words[2].endswith("_total"))
