"""JSON that comes from outside the agent (state files, HTTP bodies, trace lines), parsed within
bounds, so hostile input is a clear ValueError and never a RecursionError or an unbounded parse.

The standard library's parser recurses once per nesting level: 100,000 `[` raise RecursionError,
which is not a ValueError and so escapes every `except ValueError` written for bad JSON. Nothing
the agent reads legitimately nests deeper than a handful of levels.
"""
from __future__ import annotations

import json
from typing import Any

DEFAULT_MAX_DEPTH = 64
"""Deepest nesting accepted: a trace reading's NVML answer or a stored benchmark run is under 10."""


class JsonBoundsError(ValueError):
    """The text is larger or nested deeper than the caller accepts; the message says which."""


def loads_bounded(text: str | bytes | bytearray, max_bytes: int,
                  max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """json.loads(text), refusing more than `max_bytes` (of UTF-8 for str: its length in characters
    is a lower bound, checked before any encoding work) and nesting deeper than `max_depth`
    arrays/objects. Raises ValueError: JsonBoundsError for the bounds, json.JSONDecodeError or
    UnicodeDecodeError for what is not JSON."""
    if len(text) > max_bytes:
        raise JsonBoundsError(f"{len(text):,} bytes of JSON, over the {max_bytes:,} accepted")
    try:
        document = json.loads(text)
    except RecursionError:
        raise JsonBoundsError(f"JSON nested deeper than {max_depth} levels") from None
    if nesting_depth(document) > max_depth:
        raise JsonBoundsError(f"JSON nested deeper than {max_depth} levels")
    return document


def nesting_depth(document: Any) -> int:
    """Levels of arrays and objects in a parsed document (a scalar is 0); iterative, so it cannot
    itself run out of stack."""
    deepest = 0
    pending = [(document, 1)]
    while pending:
        node, depth = pending.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        pending.extend((child, depth + 1) for child in children)
    return deepest
