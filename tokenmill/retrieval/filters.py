"""OpenAI's attribute filters evaluated on one file's attributes. A comparison with a missing
key, or between a number and a string, is false (``ne`` / ``nin`` included): a filter selects
only files that carry the attribute it names."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from tokenmill.api.vector_stores import ComparisonFilter, CompoundFilter, Filter

_ORDER: dict[str, Callable[[Any, Any], bool]] = {
    "gt": operator.gt, "gte": operator.ge, "lt": operator.lt, "lte": operator.le}


def _kind(v: Any) -> str:
    """Which values compare with each other: numbers with numbers (not booleans), and so on."""
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    return "str"


def _equal(a: Any, b: Any) -> bool:
    return _kind(a) == _kind(b) and a == b


def _compare(f: ComparisonFilter, attrs: dict[str, Any]) -> bool:
    if f.key not in attrs:
        return False
    have = attrs[f.key]
    if f.type == "eq":
        return _equal(have, f.value)
    if f.type == "ne":
        return _kind(have) == _kind(f.value) and have != f.value
    if f.type in ("in", "nin"):
        found = any(_equal(have, v) for v in f.value)  # type: ignore[union-attr]
        return found if f.type == "in" else not found
    if _kind(have) != _kind(f.value):
        return False
    return _ORDER[f.type](have, f.value)


def matches(f: Filter | None, attrs: dict[str, Any] | None) -> bool:
    """Whether a file with ``attrs`` passes filter ``f`` (no filter: every file does)."""
    if f is None:
        return True
    attrs = attrs or {}
    # Recursive: a request body nests at most MAX_JSON_DEPTH levels (api/errors.py).
    if isinstance(f, CompoundFilter):
        results = (matches(sub, attrs) for sub in f.filters)
        return all(results) if f.type == "and" else any(results)
    return _compare(f, attrs)
