"""The `<name|processes>` list marker (rules/templates.py): a query's whole result, rendered the
same by the Go template (checked against promtool in tests/alerts/test_swap_thrash.py's cases)
and by expected_text, which the agent fills."""
from __future__ import annotations

import pytest

from hybridmon.rules.templates import expected_text, go_template, markers, process_list

TEXT = "Faulting: <faulting|processes>."
QUERIES = {"faulting": ("sort_desc(x{job=%q,instance=%q})", ("job", "instance"))}


def test_go_template_ranges_over_the_query():
    assert go_template(TEXT, QUERIES) == (
        "Faulting: {{ range $i, $s := printf `sort_desc(x{job=%q,instance=%q})` $labels.job "
        "$labels.instance | query }}{{ if $i }}, {{ end }}{{ $s.Labels.process_name }} (pid "
        "{{ $s.Labels.pid }}, {{ $s.Value | humanize }}/s){{ else }}none{{ end }}.")


def test_expected_text_lists_in_order_or_says_none():
    items = (("batch_job", "7001", 7412.5), ("python3", "4242", 150.0))
    assert expected_text(TEXT, {"faulting": items}) == (
        "Faulting: batch_job (pid 7001, 7.412k/s), python3 (pid 4242, 150/s).")
    assert expected_text(TEXT, {"faulting": ()}) == "Faulting: none."
    assert expected_text(TEXT, {"faulting": None}) == "Faulting: none."  # never "unknown"
    assert process_list([("a", "1", 0.5)]) == "a (pid 1, 500m/s)"
    assert markers(TEXT) == {"faulting"}


def test_a_list_marker_needs_a_query():
    with pytest.raises(ValueError, match="give <faulting> a query"):
        go_template(TEXT, {})
    with pytest.raises(ValueError, match="give <value> a query"):
        go_template("<value|processes>", {})
