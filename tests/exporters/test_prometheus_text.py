"""The fast path for plain Prometheus text bodies (exporters/prometheus_text.py) reads exactly what
prometheus_client's parser reads, and leaves everything else to it, errors included (issue 17)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmon.exporters.base import ParseError
from hybridmon.exporters.inference_formats import (interpret, keep_known_families, parse_prometheus,
                                                  parse_with_prometheus_client)
from hybridmon.exporters.prometheus_text import Bounds, plain_sample_index

INFERENCE = Path(__file__).parents[1] / "fixtures" / "inference"


def parsed_by_prometheus_client(text: str):
    """The reference every body must read the same as: prometheus_client's parser alone, as
    parse_prometheus read every body before the fast path (commit 56c5f8d), OverflowError aside."""
    try:
        return parse_with_prometheus_client(text)
    except ParseError as error:
        return str(error)


def outcome(text: str):
    try:
        return parse_prometheus(text)
    except ParseError as error:
        return str(error)


def signs(index):
    """The values' signs too: 0.0 == -0.0, but the exposition writes them apart."""
    if isinstance(index, str):
        return index
    return {name: [(labels, math.copysign(1, value)) for labels, value in rows] for name, rows in index.items()}


@pytest.mark.parametrize("path", sorted(INFERENCE.glob("*.prom")), ids=lambda p: p.name)
def test_every_fixture_reads_as_prometheus_client_reads_it(path):
    for text in (path.read_text(), keep_known_families(path.read_text())):
        assert outcome(text) == parsed_by_prometheus_client(text)


@pytest.mark.parametrize("name", ["vllm-v1-names.1", "vllm-v0-names.1", "vllm-0.33-offloading", "sglang.1",
                                  "sglang-0.5.23-hicache", "lmcache.1"])
def test_what_python_servers_publish_takes_the_fast_path(name):
    """vLLM, SGLang and LMCache write with prometheus_client: plain bodies, 10x faster here."""
    assert plain_sample_index(keep_known_families((INFERENCE / f"{name}.prom").read_text())) is not None


@pytest.mark.parametrize("text", [
    "# TYPE tgi_request_count counter\ntgi_request_count 3\n",      # renamed tgi_request_count_total
    "# HELP x L1 ratio (0.0\u20131.0)\nvllm:x 1\n",                   # non-ASCII
    'vllm:x{a="q\\"uote"} 1\n', 'vllm:x{a="1",} 1\n', 'vllm:x{a="1",a="2"} 1\n', 'vllm:x{__name__="y"} 1\n',
    'vllm:x{a="x",a="x"} NaN\n', "vllm:x\t1\n", "vllm:x 1 2 3\n", "vllm:x 0x1F\n", "vllm:x 1" + "0" * 40 + "\n", '#"a b" HELP c\n',
])
def test_anything_unusual_goes_to_prometheus_client(text):
    assert plain_sample_index(text) is None
    assert outcome(text) == parsed_by_prometheus_client(text)


def test_a_value_too_large_for_a_float_is_a_parse_error_not_a_crash():
    """int() reads 400 digits and float() of it overflows: OverflowError escaped parse_prometheus
    and failed the whole inference collector, every endpoint's series lost with it."""
    text = (INFERENCE / "vllm-v1-names.1.prom").read_text() + "vllm:num_requests_running 1" + "0" * 400 + "\n"
    with pytest.raises(ParseError, match="too large"):
        parse_prometheus(text)
    reading = interpret({"status": 200, "body": text, "url": "u", "content_type": "text/plain"}, None)
    assert reading.error == "not_prometheus"


def test_non_finite_values_are_left_out_on_the_fast_path_too():
    text = 'vllm:x NaN\nvllm:x{a="1"} +Inf\nvllm:x -Inf\nvllm:x 1e999\nvllm:x 2.5 1700000000000\n'
    assert plain_sample_index(text) == {"vllm:x": [({}, 2.5)]} == parsed_by_prometheus_client(text)


def test_negative_zero_reads_as_prometheus_client_reads_it():
    assert signs(outcome("vllm:x -0\nvllm:y -0.0\n")) == {"vllm:x": [({}, 1.0)], "vllm:y": [({}, -1.0)]}


_NAMES = ["vllm:a", "vllm:a_total", "vllm:a_bucket", "a-b", "__x", "9a", ""]
_LABEL_NAMES = ["a", "le", "__name__", "__x", "a:b", "a b", "é", ""]
_LABEL_VALUES = ["x", "", "+Inf", 'a"b', 'a\\"b', "a}b", "a,b", "a=b", " # ", "é", "{", "\\n", "a\\\\"]
_VALUES = ["1", "-0", "+5", "1.5", "5.", ".5", "1e3", "1E-2", "1e999", "NaN", "+Inf", "-Inf", "Inf", "inf",
           "1_0", "0x1F", "1" + "0" * 400, "", "- 1", "1.2.3"]
_COMMENTS = ["# HELP vllm:a doc with \"quotes\" and \\n", "# TYPE vllm:a counter", "# TYPE vllm:a_total counter",
             "# TYPE vllm:a histogram", "# TYPE vllm:a bogus", "# TYPE vllm:a", "# TYPE", "# HELP",
             "#  TYPE vllm:a_total   gauge", '#"x y" HELP z', "# a comment", "#", "", "   ",
             "# HELP a-b doc", "# HELP vllm:a_total", "# TYPE vllm:a_total info"]
_SEPARATORS = [" ", "  ", "\t", ""]


@st.composite
def sample_lines(draw):
    labels = draw(st.lists(st.tuples(st.sampled_from(_LABEL_NAMES), st.sampled_from(_LABEL_VALUES)), max_size=3))
    braces = "{" + ",".join(f'{n}="{v}"' for n, v in labels) + draw(st.sampled_from(["", ","])) + "}"
    return (draw(st.sampled_from(_NAMES)) + (braces if labels or draw(st.booleans()) else "")
            + draw(st.sampled_from(_SEPARATORS)) + draw(st.sampled_from(_VALUES))
            + draw(st.sampled_from(["", " 1700000000000", " 1 2", " -5", " x", "\r"])))


@pytest.mark.slow  # a fuzzing budget of 1,500 bodies: ~10 s
@settings(max_examples=1500, deadline=None)
@given(st.lists(st.one_of(sample_lines(), st.sampled_from(_COMMENTS)), max_size=8))
def test_any_body_reads_or_fails_as_prometheus_client_reads_it(lines):
    text = "\n".join(lines) + "\n"
    assert signs(outcome(text)) == signs(parsed_by_prometheus_client(text))
    assert outcome(text) == parsed_by_prometheus_client(text)


@pytest.mark.parametrize("unusual", [False, True])
def test_both_paths_keep_the_first_samples_of_each_name_up_to_the_cap(unusual):
    """Issue 30: a body of tens of thousands of series was indexed whole (~190 MB held while a
    7.9 MB body was read); each path keeps the first `max_per_name` samples of a name, the same
    ones, and the whole body is still read (a non-plain line anywhere sends it to the other path)."""
    lines = [f'family_a{{model="m{i}"}} {i}' for i in range(50)] + ['family_b 1']
    if unusual:
        lines.append('family_c{model="caf\\u00e9"} 1'.replace("\\u00e9", "\u00e9"))  # not ASCII
    text = "\n".join(lines) + "\n"
    capped = parse_prometheus(text, max_per_name=10)
    assert capped["family_a"] == [({"model": f"m{i}"}, float(i)) for i in range(10)]
    assert capped["family_b"] == [({}, 1.0)]
    assert (plain_sample_index(text, Bounds(per_name=10)) is None) is unusual
    assert parse_with_prometheus_client(text, Bounds(per_name=10)) == capped
    # ...and of the models (MODEL_LABELS), the first `max_models`, every sample without one kept
    by_model = parse_prometheus(text, max_models=3)
    assert [labels["model"] for labels, _ in by_model["family_a"]] == ["m0", "m1", "m2"]
    assert by_model["family_b"] == [({}, 1.0)]
