"""Property-test helpers shared by the parser tests: texts to feed a parser, and the check that it
raises nothing but the one error it promises on them (ParseError for the `parse_*` of exporters/,
ReportError for the benchmark readers). tests/exporters/test_parsers_robustness.py holds every one to it,
each on the realistic samples of its ParserRow: the test module of the parser's collector lists its
rows as PARSER_ROWS."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from hypothesis import strategies as st

from hybridmon.exporters.base import ParseError

@dataclass(frozen=True)
class ParserRow:
    """One parser, the real texts it reads, and how a test calls it on a text."""

    function: Callable[..., Any]
    samples: tuple[str, ...]
    refusal: type[Exception] = ParseError
    """The one error its docstring promises for text it cannot read."""
    call: Callable[[str], Any] | None = None
    """For a parser with more arguments than the text: the text in, the other arguments fixed."""

    def parse(self, text: str) -> Any:
        return (self.call or self.function)(text)

    @property
    def id(self) -> str:
        return f"{self.function.__module__.rsplit('.', 1)[-1]}.{self.function.__name__}"


def read(*paths: Path) -> tuple[str, ...]:
    """The texts of real files (fixture trees), as a ParserRow's samples."""
    return tuple(path.read_text() for path in paths)


# Python refuses to convert more digits than this to an int (sys.get_int_max_str_digits(), a
# ValueError), so a parser that hands a digit run to int() unchecked fails beyond it.
INT_DIGIT_LIMIT = 4300
_DIGIT_RUN = re.compile(r"[0-9]+")


@st.composite
def mutated(draw: Any, text: str) -> str:
    """`text` with one to four slices replaced by arbitrary text."""
    for _ in range(draw(st.integers(1, 4))):
        start = draw(st.integers(0, len(text)))
        end = draw(st.integers(start, min(len(text), start + 40)))
        text = text[:start] + draw(st.text(max_size=20)) + text[end:]
    return text


def huge_digit_run(draw: Any) -> str:
    return draw(st.sampled_from("123456789")) + "0" * draw(
        st.integers(INT_DIGIT_LIMIT, INT_DIGIT_LIMIT + 200))


@st.composite
def with_huge_number(draw: Any, text: str) -> str:
    """`text` with one of its numbers (or, if it has none, one position) made longer than int()
    accepts, so the rest of the text still reaches the conversion."""
    runs = [match.span() for match in _DIGIT_RUN.finditer(text)]
    if runs:
        start, end = draw(st.sampled_from(runs))
    else:
        start = end = draw(st.integers(0, len(text)))
    return text[:start] + huge_digit_run(draw) + text[end:]


def texts_like(sample: str) -> st.SearchStrategy[str]:
    """Arbitrary text, `sample` mutated, and `sample` with a huge number in it."""
    return st.one_of(st.text(), mutated(sample), with_huge_number(sample))


def each_number_made_huge(sample: str) -> Iterator[str]:
    """`sample` once per digit run, with that run made longer than int() accepts."""
    for match in _DIGIT_RUN.finditer(sample):
        yield sample[:match.start()] + "1" * (INT_DIGIT_LIMIT + 1) + sample[match.end():]


def only_parse_errors(parse: Callable[[str], Any], text: str,
                      refusal: type[Exception] = ParseError) -> None:
    """Runs parse(text); any exception but `refusal` (the one error the parser promises) fails the
    test."""
    try:
        parse(text)
    except refusal:
        pass
